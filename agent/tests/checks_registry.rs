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
    assert_eq!(checks.names(), ["shm", "ports", "gpu"]);
    let results = checks.run_all(&NodePlan::default());
    for name in ["shm", "ports", "gpu"] {
        assert!(
            results.iter().any(|r| r.name == name),
            "{name}: {results:#?}"
        );
    }
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
