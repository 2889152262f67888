//! An agent pointed at an HTTP port instead of the controller's gRPC port (here: its own HTTP
//! port, which answers 404 to AgentService/Connect) never says "connected": the link reports
//! that the URL is not a gRPC endpoint and which port to use. Pointed at a port where nothing
//! listens, it says the connection was refused there (not tonic's bare "transport error"); a
//! bare `HOST:PORT` (no scheme) is taken as `http://HOST:PORT`, as `subscribe` and `lookup` do.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::http_get;

#[test]
fn an_http_port_is_not_a_controller() {
    let http = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let plan = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/standalone/plan.yaml"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args([
            "run",
            "--controller",
            &format!("http://{http}"),
            "--plan",
            plan,
        ])
        .args(["--http-addr", &http])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for l in BufReader::new(stderr).lines() {
            lines.push(l.unwrap());
        }
        lines
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        if std::net::TcpStream::connect(&http).is_ok() {
            let r = http_get(&http, "/v1/report");
            if r.contains("is not a gRPC endpoint") {
                break r;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no not-gRPC link error in /v1/report"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    let lines = log.join().unwrap();
    assert!(report.contains("the gRPC port"), "{report}");
    assert!(
        !lines.iter().any(|l| l.contains("connected to controller")),
        "{}",
        lines.join("\n")
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("controller link down") && l.contains("not a gRPC endpoint")),
        "{}",
        lines.join("\n")
    );
}

/// Runs `ic-agent run --controller <controller>` with its own HTTP port until `/v1/report`
/// contains `needle` (30 s at most); returns the report and the agent's log lines.
fn run_until_report_has(controller: &str, needle: &str) -> (String, Vec<String>) {
    let http = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args(["run", "--controller", controller, "--checks-only"])
        .args(["--http-addr", &http, "--t2-scrape-interval-seconds", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut report = String::new();
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(&http).is_ok() {
            report = http_get(&http, "/v1/report");
            if report.contains(needle) {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let lines = log.join().unwrap();
    assert!(
        report.contains(needle),
        "no {needle:?} in /v1/report: {report}\n{}",
        lines.join("\n")
    );
    (report, lines)
}

#[test]
fn nothing_listening_says_connection_refused_there() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // bare HOST:PORT: the report names it as http://…, the error names the refusal and where
    let (report, lines) = run_until_report_has(
        &format!("127.0.0.1:{port}"),
        &format!("connection refused at 127.0.0.1:{port}"),
    );
    assert!(
        report.contains(&format!("http://127.0.0.1:{port}")),
        "{report}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("controller link down") && l.contains("nothing listens there")),
        "{}",
        lines.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_host_port_reaches_the_controller() {
    let (_fake, grpc, _received) = support::FakeController::start().await;
    let (report, _) = tokio::task::spawn_blocking(move || {
        run_until_report_has(&grpc.to_string(), "\"connects\":1")
    })
    .await
    .unwrap();
    assert!(report.contains(&format!("http://{grpc}")), "{report}");
}
