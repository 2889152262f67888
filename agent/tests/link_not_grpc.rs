//! An agent pointed at an HTTP port instead of the controller's gRPC port (here: its own HTTP
//! port, which answers 404 to AgentService/Connect) never says "connected": the link reports
//! that the URL is not a gRPC endpoint and which port to use.

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
