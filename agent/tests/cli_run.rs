//! `ic-agent run` as a user starts it: with neither a controller nor a plan it refuses to run
//! silently; `--checks-only` is the explicit way to run the host checks alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ic_agent() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ic-agent"));
    // The environment must not supply what the test leaves out.
    c.env_remove("IC_CONTROLLER")
        .env_remove("IC_PLAN")
        .env_remove("IC_CHECKS_ONLY");
    c
}

fn free_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

#[test]
fn run_with_neither_controller_nor_plan_exits_2_naming_both_flags_and_the_way_out() {
    let out = ic_agent()
        .args(["run", "--http-addr", &free_addr()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["--controller", "--plan", "--checks-only"] {
        assert!(err.contains(needle), "stderr lacks {needle}: {err}");
    }
}

#[test]
fn run_with_checks_only_serves_its_endpoints() {
    let addr = free_addr();
    let mut child = ic_agent()
        .args(["run", "--checks-only", "--http-addr", &addr])
        .args(["--t2-scrape-interval-seconds", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let healthy = loop {
        if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
            use std::io::Write;
            s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").unwrap();
            let mut body = String::new();
            let _ = s.read_to_string(&mut body);
            if body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200") {
                break true;
            }
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(
        healthy,
        "/healthz never answered 200: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
