//! `ic-agent run` keeps the agent's capabilities only in its checks processes (docs/checks.md
//! "Capabilities", docs/security.md "The agent mounts only what its checks read"): the
//! supervisor and the worker it starts (`ic_agent::checks_worker`), children of the agent,
//! hold the process's set; every thread of the agent's own process — the main thread and the
//! tokio threads that decode engine KV-event frames, parse engine /metrics, talk to the
//! controller and serve HTTP — holds none, effective or permitted, as the kernel reports in
//! /proc/<pid>/task/<tid>/status. This replaces the earlier design, where a checks thread of the
//! agent's own process kept them (still there behind `--checks-in-process`, tested below).
//! Runs the real binary as root (CI does); scripts/image-tests.sh repeats this in Docker under
//! the chart's securityContext.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
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

/// `(pid, comm)` of every live process whose parent is `parent` (`/proc/*/stat`).
fn children(parent: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // state, ppid; a zombie is not a live child.
        if rest.len() > 1 && rest[0] != "Z" && rest[1] == parent.to_string() {
            out.push((pid, stat[open + 1..close].to_string()));
        }
    }
    out
}

fn start_agent(extra: &[&str]) -> (Child, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
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
        .args(extra)
        .env("IC_NVML_LIBRARY", dir.path().join("no-nvml.so"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (child, dir)
}

/// `--checks-in-process` (debugging): the checks thread of the agent's own process keeps the
/// capabilities, as every `ic-agent run` did before the checks moved to their own processes.
#[test]
fn with_checks_in_process_only_the_checks_thread_holds_capabilities() {
    let mine = ic_agent::privilege::thread_cap_eff().unwrap();
    assert_ne!(mine, ZERO, "run the agent tests as root (CI does)");
    let (mut child, _dir) = start_agent(&["--checks-in-process"]);
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
    assert!(
        children(pid).is_empty(),
        "no checks process with --checks-in-process"
    );
}

#[test]
fn only_the_checks_processes_hold_capabilities() {
    let mine = ic_agent::privilege::thread_cap_eff().unwrap();
    assert_ne!(mine, ZERO, "run the agent tests as root (CI does)");
    let (mut child, _dir) = start_agent(&[]);
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (supervisor, worker) = loop {
        let t = threads(pid);
        let workers = t.iter().filter(|x| x.1.starts_with("tokio-r")).count();
        let sup = children(pid)
            .into_iter()
            .find(|c| c.1 == ic_agent::checks_worker::SUPERVISOR_COMM);
        let wrk = sup.as_ref().and_then(|s| {
            children(s.0)
                .into_iter()
                .find(|c| c.1 == ic_agent::checks_worker::WORKER_COMM)
        });
        if let (true, Some(s), Some(w)) = (workers >= 2, sup, wrk) {
            // A few passes more, so threads started later are seen too.
            std::thread::sleep(Duration::from_millis(2500));
            break (s.0, w.0);
        }
        assert!(
            Instant::now() < deadline,
            "ic-agent run did not come up with its checks processes: {t:?}, children {:?}",
            children(pid)
        );
        assert!(child.try_wait().unwrap().is_none(), "ic-agent run exited");
        std::thread::sleep(Duration::from_millis(100));
    };
    let agent = threads(pid);
    let sup = threads(supervisor);
    let wrk = threads(worker);
    let _ = child.kill();
    let _ = child.wait();
    // No thread of the agent's own process holds a capability, effective or permitted — the
    // main thread included; there is no checks thread any more.
    for (tid, comm, eff, prm) in &agent {
        assert_eq!(
            (eff.as_str(), prm.as_str()),
            (ZERO, ZERO),
            "thread {tid} ({comm}) of the agent: {agent:?}"
        );
        assert_ne!(comm, ic_agent::runtime::CHECKS_THREAD_NAME, "{agent:?}");
    }
    assert!(agent.len() >= 3, "{agent:?}");
    // The supervisor and the worker keep the set the agent was started with, on every thread
    // (the worker's NVML monitor and CUDA probe threads included).
    for (who, seen) in [("supervisor", &sup), ("worker", &wrk)] {
        assert!(!seen.is_empty(), "{who}");
        for (tid, comm, eff, prm) in seen {
            assert_eq!(
                (eff, prm),
                (&mine, &mine),
                "{who} thread {tid} ({comm}): {seen:?}"
            );
        }
    }
    // Both end with the agent (stdin closed, PR_SET_PDEATHSIG).
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::path::Path::new(&format!("/proc/{supervisor}")).exists()
        || std::path::Path::new(&format!("/proc/{worker}")).exists()
    {
        let gone = |p: u32| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .map(|s| {
                    s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(true)
        };
        if gone(supervisor) && gone(worker) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the checks processes outlived the agent"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
