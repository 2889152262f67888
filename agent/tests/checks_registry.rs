//! The check registry: order, failure isolation, reports.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_agent::checks::fake::StaticCheck;
use ic_agent::checks::{render_table, report_json, Check, Checks, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;

struct Panics;

impl Check for Panics {
    fn name(&self) -> &'static str {
        "boom"
    }
    fn run(&self, _plan: &NodePlan) -> Vec<CheckResult> {
        panic!("surface exploded")
    }
}

#[test]
fn run_all_isolates_a_panicking_check_and_an_empty_one() {
    let ok = CheckResult::new("a", "host", CheckStatus::Ok, "AOk", "fine");
    let unnamed = CheckResult::new("", "x", CheckStatus::Warning, "W", "w");
    let checks = Checks::with(vec![
        Box::new(StaticCheck::new("a", vec![ok.clone()])),
        Box::new(Panics),
        Box::new(StaticCheck::new("empty", vec![])),
        Box::new(StaticCheck::new("c", vec![unnamed])),
    ]);
    assert_eq!(checks.names(), ["a", "boom", "empty", "c"]);
    let r = checks.run_all(&NodePlan::default());
    assert_eq!(r.len(), 4, "{r:#?}");
    assert_eq!(r[0], ok);
    assert_eq!(
        (r[1].name.as_str(), r[1].status, r[1].reason.as_str()),
        ("boom", CheckStatus::Unknown, "CheckPanicked")
    );
    assert!(
        r[1].message.contains("surface exploded"),
        "{}",
        r[1].message
    );
    assert_eq!(
        (r[2].name.as_str(), r[2].status, r[2].reason.as_str()),
        ("empty", CheckStatus::Unknown, "NoResult")
    );
    assert_eq!(r[3].name, "c", "an unnamed result takes the check's name");
}

#[test]
fn default_registry_on_this_host_renders() {
    let checks = Checks::new(&ChecksConfig::default());
    let names = ["shm", "mp_worker", "gpu", "cuda", "ports", "mounts"];
    assert_eq!(checks.names(), names);
    let results = checks.run_all(&NodePlan::default());
    for name in names {
        assert!(
            results.iter().any(|r| r.name == name),
            "{name}: {results:#?}"
        );
    }
    assert!(
        !results
            .iter()
            .any(|r| r.reason == "NoResult" || r.reason == "CheckPanicked"),
        "{results:#?}"
    );
    let by = |name: &str| results.iter().find(|r| r.name == name).unwrap();
    assert_eq!(by("mp_worker").reason, "NoMpWorkers");
    assert_eq!(by("mounts").reason, "NoReaderMounts");
    let table = render_table("this-node", &results);
    assert!(table.starts_with("CHECK"), "{table}");
    assert!(
        table
            .lines()
            .last()
            .unwrap()
            .starts_with("node this-node: "),
        "{table}"
    );
    let json = report_json("this-node", &results);
    assert_eq!(json["node"], "this-node");
    assert_eq!(json["checks"].as_array().map(Vec::len), Some(results.len()));
    let worst = CheckStatus::worst(results.iter().map(|r| r.status));
    assert_eq!(json["status"], worst.to_string());
}

#[test]
fn config_from_environment_names_the_bad_variable() {
    use ic_agent::checks::xid::XidAction;
    use std::collections::HashMap;
    use std::time::Duration;
    let env = |pairs: &[(&str, &str)]| {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| m.get(k).cloned()
    };
    let c = ChecksConfig::from_lookup(env(&[])).unwrap();
    assert_eq!(c, ChecksConfig::default());
    let c = ChecksConfig::from_lookup(env(&[
        ("IC_XID_ENABLE", "13"),
        ("IC_XID_DISABLE", "all"),
        ("IC_XID_UNLISTED", "critical"),
        ("IC_XID_QUIET_SECONDS", "30"),
        ("IC_CUDA_LIBRARY", "/usr/lib64/libcuda.so.1"),
        ("IC_CUDA_INTERVAL_SECONDS", "120"),
        ("IC_MP_WORKER_TIMEOUT_MS", "750"),
        ("IC_SHM_NEARLY_FULL_PERCENT", "80"),
        ("IC_PROC_ROOT", "/host/proc"),
        ("IC_HOST_NETNS", "/host/proc/1/net"),
        ("IC_SHM_PATH", ""),
    ]))
    .unwrap();
    assert_eq!(
        c.host_netns.as_deref(),
        Some(std::path::Path::new("/host/proc/1/net"))
    );
    assert_eq!(c.xid_policy.action(13), XidAction::Critical);
    assert_eq!(c.xid_policy.action(79), XidAction::Ignore);
    assert!(c.xid_policy.disable_all);
    assert_eq!(c.xid_policy.unlisted, XidAction::Critical);
    assert_eq!(c.xid_policy.quiet_period, Duration::from_secs(30));
    assert_eq!(
        c.cuda_library.as_deref(),
        Some(std::path::Path::new("/usr/lib64/libcuda.so.1"))
    );
    assert_eq!(c.cuda_interval, Duration::from_secs(120));
    assert_eq!(c.mp_worker_timeout, Duration::from_millis(750));
    assert_eq!(c.shm_nearly_full_percent, 80);
    assert_eq!(c.proc_root, std::path::Path::new("/host/proc"));
    assert_eq!(
        c.shm_path,
        std::path::Path::new("/dev/shm"),
        "empty means default"
    );
    for (var, value) in [
        ("IC_XID_ENABLE", "13,x"),
        ("IC_XID_DISABLE", "y"),
        ("IC_XID_UNLISTED", "loud"),
        ("IC_CUDA_INTERVAL_SECONDS", "-1"),
        ("IC_SHM_NEARLY_FULL_PERCENT", "101"),
    ] {
        let err = ChecksConfig::from_lookup(env(&[(var, value)])).unwrap_err();
        assert!(err.to_string().contains(var), "{var}: {err}");
    }
}
