//! `ic-agent run` keeps the agent's capabilities on the checks thread alone (docs/checks.md
//! "Capabilities", docs/security.md): the tokio threads that decode engine KV-event frames,
//! parse engine /metrics, talk to the controller and serve HTTP — and the main thread once the
//! agent is up — hold no capability, as the kernel reports in /proc/<pid>/task/<tid>/status.
//! Runs the real binary as root (CI does); scripts/image-tests.sh repeats this in Docker under
//! the chart's securityContext.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ZERO: &str = "0000000000000000";

/// `(tid, comm, CapEff, CapPrm)` of every thread of `pid`.
fn threads(pid: u32) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let dir = t.path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("status")),
        ) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        out.push((
            t.file_name().to_string_lossy().into_owned(),
            comm.trim().to_string(),
            field("CapEff:"),
            field("CapPrm:"),
        ));
    }
    out
}

#[test]
fn only_the_checks_thread_holds_capabilities() {
    let mine = ic_agent::privilege::thread_cap_eff().unwrap();
    assert_ne!(mine, ZERO, "run the agent tests as root (CI does)");
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args([
            "run",
            "--checks-only",
            "--http-addr",
            "127.0.0.1:0",
            "--check-interval-seconds",
            "1",
            "--t2-scrape-interval-seconds",
            "0",
            "--node",
            "caps-test",
        ])
        .env("IC_NVML_LIBRARY", dir.path().join("no-nvml.so"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Up: the checks thread and both tokio workers exist, and the main thread has dropped.
    let deadline = Instant::now() + Duration::from_secs(30);
    let seen = loop {
        let t = threads(pid);
        let main_dropped = t
            .iter()
            .any(|(tid, _, eff, prm)| *tid == pid.to_string() && eff == ZERO && prm == ZERO);
        let workers = t.iter().filter(|x| x.1.starts_with("tokio-r")).count();
        if main_dropped && workers >= 2 && t.iter().any(|x| x.1 == "ic-checks") {
            // A few passes more, so threads started later are seen too.
            std::thread::sleep(Duration::from_millis(2500));
            break threads(pid);
        }
        assert!(
            Instant::now() < deadline,
            "ic-agent run did not come up: {t:?}"
        );
        assert!(child.try_wait().unwrap().is_none(), "ic-agent run exited");
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    // The checks thread keeps the process's set; threads it starts (NVML's monitor, the CUDA
    // probe) inherit it. Everything else holds nothing, effective or permitted.
    let keep = ["ic-checks", "ic-nvml", "ic-cuda-probe"];
    let checks: Vec<_> = seen.iter().filter(|t| t.1 == "ic-checks").collect();
    assert_eq!(checks.len(), 1, "{seen:?}");
    assert_eq!(checks[0].2, mine, "{seen:?}");
    for (tid, comm, eff, prm) in &seen {
        if !keep.contains(&comm.as_str()) {
            assert_eq!(
                (eff.as_str(), prm.as_str()),
                (ZERO, ZERO),
                "thread {tid} ({comm}): {seen:?}"
            );
        }
    }
    assert!(seen.len() >= 4, "{seen:?}");
}
