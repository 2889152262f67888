//! The real `ic-controller standalone` binary as a user runs it: its `/metrics` carries the
//! process collector's `process_*` series and `inferencecache_build_info{version,commit}` with
//! this checkout's commit, and SIGTERM (what Kubernetes and `scripts/standalone.sh` send) stops
//! it with exit status 0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod http_support;
mod process_support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http_support::http_get;
use process_support::{free_port, KillOnDrop};

/// The commit the binary must report: `$IC_GIT_COMMIT` when the build was given one, else this
/// checkout's HEAD (`git rev-parse HEAD`, run here independently of the build script), else
/// `unknown` (built outside git).
fn expected_commit() -> String {
    if let Ok(c) = std::env::var("IC_GIT_COMMIT") {
        return c;
    }
    Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

/// The value of the first sample named exactly `name` (no labels) in an exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
}

struct Controller {
    child: KillOnDrop,
    http: String,
}

/// Starts the binary on free loopback ports and waits for `/readyz`.
fn start() -> Controller {
    let http = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_ic-controller"))
        .args(["standalone", "--grpc-addr"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .args(["--http-addr", &http])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let c = Controller {
        child: KillOnDrop(child),
        http,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&c.http).is_err()
        || http_get(&c.http, "/readyz") != "ready\n"
    {
        assert!(
            Instant::now() < deadline,
            "ic-controller not ready on {}",
            c.http
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c
}

#[test]
fn metrics_carry_process_series_and_build_info() {
    let c = start();
    let text = http_get(&c.http, "/metrics");
    let info = format!(
        "inferencecache_build_info{{commit=\"{}\",version=\"{}\"}} 1",
        expected_commit(),
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.lines().any(|l| l == info), "no `{info}` in:\n{text}");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = sample(&text, "process_start_time_seconds");
    assert!(
        (now - 120.0..=now + 1.0).contains(&started),
        "process_start_time_seconds {started}, now {now}"
    );
    assert!(sample(&text, "process_resident_memory_bytes") > 1e6);
    assert!(sample(&text, "process_virtual_memory_bytes") > 1e6);
    assert!(sample(&text, "process_open_fds") >= 3.0);
    assert!(sample(&text, "process_max_fds") >= sample(&text, "process_open_fds"));
    assert!(sample(&text, "process_threads") >= 1.0);
    assert!(sample(&text, "process_cpu_seconds_total") >= 0.0);
}

#[test]
fn sigterm_stops_the_standalone_controller_with_status_0() {
    let mut c = start();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(c.child.0.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = c.child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "ic-controller still running 20 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
}
