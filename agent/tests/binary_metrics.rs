//! The real `ic-agent run` binary, linked to a stand-in controller: its `/metrics` carries the
//! process collector's `process_*` series and `inferencecache_build_info{version,commit}` with
//! this checkout's commit.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{http_get, FakeController};

/// The commit the binary must report: `$IC_GIT_COMMIT` when the build was given one, else this
/// checkout's HEAD (asked of git here, not of the build script), else `unknown`.
fn expected_commit() -> String {
    std::env::var("IC_GIT_COMMIT").unwrap_or_else(|_| {
        let out = Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output();
        match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
            _ => "unknown".to_string(),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_process_series_and_build_info() {
    let (_fake, grpc, _received) = FakeController::start().await;
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
            &format!("http://{grpc}"),
            "--plan",
            plan,
        ])
        .args(["--http-addr", &http])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        if std::net::TcpStream::connect(&http).is_ok() {
            let r = http_get(&http, "/metrics");
            if r.contains("inferencecache_agent_link_connected 1") {
                break r;
            }
        }
        assert!(Instant::now() < deadline, "ic-agent never linked on {http}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    let info = format!(
        "inferencecache_build_info{{commit=\"{}\",version=\"{}\"}} 1",
        expected_commit(),
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.lines().any(|l| l == info), "no `{info}` in:\n{text}");
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no sample {name}"))
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = value("process_start_time_seconds");
    assert!(
        (now - 120.0..=now + 1.0).contains(&started),
        "{started} vs {now}"
    );
    assert!(value("process_resident_memory_bytes") > 1e6);
    assert!(value("process_open_fds") >= 3.0);
    assert!(value("process_threads") >= 1.0);
    assert!(value("process_cpu_seconds_total") >= 0.0);
}
