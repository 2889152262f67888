//! A stand-in engine pod process for scripts/image-tests.sh, which runs it in containers under
//! kubepods-style cgroup parents next to the agent image: it serves the LMCache MP worker's
//! exact protocol ([`ic_agent::checks::fake::serve_mp_worker`]) and optionally holds a TCP port,
//! until it is stopped.
//!
//!   fake_engine [--mp-worker tcp://127.0.0.1:5555] [--listen 0.0.0.0:18000]
//!
//! Prints `ready` once everything is bound; exits 2 on a bad argument or a failed bind.

use ic_agent::checks::fake::{serve_mp_worker, MpWorkerMode};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut mp_worker = None;
    let mut listen = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match (flag.as_str(), it.next()) {
            ("--mp-worker", Some(v)) => mp_worker = Some(v.clone()),
            ("--listen", Some(v)) => listen = Some(v.clone()),
            _ => {
                eprintln!("usage: fake_engine [--mp-worker ENDPOINT] [--listen ADDR]");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let _listener = match listen.as_deref().map(std::net::TcpListener::bind) {
        Some(Err(e)) => {
            eprintln!("fake_engine: cannot listen: {e}");
            return std::process::ExitCode::from(2);
        }
        Some(Ok(l)) => Some(l),
        None => None,
    };
    let serve = match mp_worker.as_deref() {
        Some(endpoint) => match serve_mp_worker(endpoint, MpWorkerMode::Answer).await {
            Ok((_, serve)) => Some(serve),
            Err(e) => {
                eprintln!("fake_engine: cannot bind the MP worker at {endpoint}: {e}");
                return std::process::ExitCode::from(2);
            }
        },
        None => None,
    };
    println!("ready");
    match serve {
        Some(serve) => serve.await,
        None => std::future::pending::<()>().await,
    }
    std::process::ExitCode::SUCCESS
}
