//! `ic-agent check` as a user runs it: exit status and output on this host.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn ic_agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ic-agent"))
}

#[test]
fn check_without_a_plan_passes_on_this_host() {
    let out = ic_agent()
        .args(["check", "--node", "cli-node"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("CHECK"), "{stdout}");
    assert!(stdout.contains("node cli-node: "), "{stdout}");
}

#[test]
fn check_with_an_oversized_shm_requirement_exits_2_naming_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.yaml");
    // 64 TiB: more than any /dev/shm here.
    std::fs::write(&plan, "shm:\n  requiredBytes: 70368744177664\n").unwrap();
    let out = ic_agent()
        .args(["check", "--json", "--node", "cli-node", "--plan"])
        .arg(&plan)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["node"], "cli-node");
    assert_eq!(doc["status"], "Critical");
    let shm = doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "shm")
        .unwrap();
    assert_eq!(shm["reason"], "ShmUndersized");
    let message = shm["message"].as_str().unwrap();
    let size = shm["observed"]["sizeBytes"].as_str().unwrap();
    assert!(message.contains("70368744177664"), "{message}");
    assert!(message.contains(size), "{message}");
    assert_eq!(shm["observed"]["requiredBytes"], "70368744177664");
}

#[test]
fn check_with_an_unreadable_plan_exits_3_with_the_field_name() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.yaml");
    std::fs::write(&plan, "shmm: {}\n").unwrap();
    let out = ic_agent()
        .args(["check", "--plan"])
        .arg(&plan)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("shmm"));
}

#[test]
fn check_with_a_missing_plan_exits_3_naming_the_cause_once() {
    let out = ic_agent()
        .args(["check", "--plan", "/nonexistent/plan.yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/plan.yaml"), "{stderr}");
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "{stderr}"
    );
}

/// `ic-agent check --json | head -1`: the reader goes away before the report is written.
#[test]
fn check_into_a_closed_pipe_ends_quietly() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = ic_agent()
        .args(["check", "--json", "--node", "cli-node"])
        .env("RUST_BACKTRACE", "0")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        matches!(out.status.code(), Some(0..=2)),
        "exit {:?}: {stderr}",
        out.status
    );
}
