//! Tests of the `ReadersHealthy` advisory: mount outcomes from the agent's results, the verdict
//! per binding, the condition and its patch.

use super::*;
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

const B: &str = "inference-cache-model-cache/mcb-1";

fn at(s: i64) -> Time {
    Time(Timestamp::from_second(s).unwrap())
}

fn mount(pod: &str, path: &str) -> ReaderMount {
    ReaderMount {
        namespace: "team-a".into(),
        pod: pod.into(),
        pod_uid: Some(format!("uid-{pod}")),
        path: path.into(),
        binding: B.into(),
        ..ReaderMount::default()
    }
}

fn plans(mounts: Vec<(&str, ReaderMount)>) -> BTreeMap<String, NodePlan> {
    let mut out: BTreeMap<String, NodePlan> = BTreeMap::new();
    for (node, m) in mounts {
        out.entry(node.to_string())
            .or_default()
            .reader_mounts
            .push(m);
    }
    out
}

fn result(m: &ReaderMount, status: CheckStatus, reason: &str) -> CheckResult {
    let mut c = CheckResult::new(
        MOUNTS_CHECK,
        mount_subject(m),
        status,
        reason,
        format!("{} says {reason}", m.path),
    )
    .with("path", &m.path);
    if let Some(uid) = &m.pod_uid {
        c = c.with("podUid", uid);
    }
    c
}

fn record(node: &str, connected: bool, checks: Vec<CheckResult>) -> NodeRecord {
    NodeRecord {
        node: node.into(),
        connected,
        agent_version: "0.1.0".into(),
        boot_id: "b".into(),
        agent_instance: "i".into(),
        capabilities: vec![],
        connected_at_unix_ms: 1,
        last_seen_unix_ms: 2,
        last_report_unix_ms: if checks.is_empty() { 0 } else { 2 },
        report_received_unix_ms: if checks.is_empty() { 0 } else { 2 },
        check_interval_seconds: 0,
        plan_generation: 1,
        status: CheckStatus::worst(checks.iter().map(|c| c.status)),
        checks,
        epoch: 1,
    }
}

fn records(rs: Vec<NodeRecord>) -> BTreeMap<String, NodeRecord> {
    rs.into_iter().map(|r| (r.node.clone(), r)).collect()
}

fn request(binding: Option<&str>) -> ModelCache {
    let mut v = json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llama", "namespace": "team-a", "generation": 3, "resourceVersion": "7"},
        "spec": {"source": {"uri": "hf://m", "revision": "r"}, "size": "1Gi", "workflow": "regularModelCache",
                 "writer": {"template": {"spec": {"containers": [{"name": "w", "image": "i"}]}}}},
        "status": {"mode": "durable", "conditions": [
            {"type": "Ready", "status": "True", "reason": "ReadersReady", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]}
    });
    if let Some(b) = binding {
        v["status"]["binding"] = json!({"name": b, "uid": "u"});
    }
    serde_json::from_value(v).unwrap()
}

fn one(plans: &BTreeMap<String, NodePlan>, recs: &BTreeMap<String, NodeRecord>) -> ReaderAdvisory {
    let all = reader_advisories(plans, recs, 0);
    assert_eq!(all.keys().collect::<Vec<_>>(), vec![B]);
    all[B].clone()
}

#[test]
fn every_mount_passing_is_true() {
    let a = mount("reader-0", "/models");
    let b = mount("reader-1", "/models");
    let p = plans(vec![("n1", a.clone()), ("n2", b.clone())]);
    let recs = records(vec![
        record(
            "n1",
            true,
            vec![result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly")],
        ),
        record(
            "n2",
            true,
            vec![result(&b, CheckStatus::Ok, "ReaderVolumeMounted")],
        ),
    ]);
    let adv = one(&p, &recs);
    assert_eq!(adv.status, ConditionStatus::True);
    assert_eq!(adv.reason, r::READERS_READ_ONLY);
    assert!(adv.message.contains("2 reader mounts"), "{}", adv.message);
    assert!(adv.message.contains("on n1, n2"), "{}", adv.message);
}

/// The dead-NFS case: the mounts check hangs, the agent stays connected, no report comes.
/// The last ReadersReadOnly is not vouched for past 3 intervals + 60 s.
#[test]
fn a_stale_report_is_unknown_not_the_last_verdict() {
    let a = mount("reader-0", "/models");
    let p = plans(vec![("n1", a.clone())]);
    let mut rec = record(
        "n1",
        true,
        vec![result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly")],
    );
    rec.report_received_unix_ms = 1_000_000;
    rec.check_interval_seconds = 10;
    let recs = records(vec![rec]);
    let at = |now_ms: i64| reader_advisories(&p, &recs, now_ms)[B].clone();
    assert_eq!(at(1_090_000).reason, r::READERS_READ_ONLY);
    let adv = at(1_091_000);
    assert_eq!(
        (adv.status, adv.reason),
        (ConditionStatus::Unknown, r::READER_REPORT_STALE)
    );
    assert!(
        adv.message
            .contains("n1: team-a/reader-0 at /models (no check report"),
        "{}",
        adv.message
    );
}

#[test]
fn a_writable_reader_is_false_and_named() {
    let a = mount("reader-0", "/models");
    let b = mount("reader-1", "/data");
    let p = plans(vec![("n1", a.clone()), ("n1", b.clone())]);
    let recs = records(vec![record(
        "n1",
        true,
        vec![
            result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly"),
            result(&b, CheckStatus::Critical, "ReaderVolumeWritable"),
        ],
    )]);
    let adv = one(&p, &recs);
    assert_eq!(adv.status, ConditionStatus::False);
    assert_eq!(adv.reason, r::READER_VOLUME_WRITABLE);
    assert!(
        adv.message
            .contains("n1: team-a/reader-1 at /data (ReaderVolumeWritable)"),
        "{}",
        adv.message
    );
    assert!(!adv.message.contains("reader-0"), "{}", adv.message);
    assert!(adv.message.contains("readOnly: true"));
}

#[test]
fn missing_and_digest_mismatch_keep_their_names_and_writable_leads() {
    let a = mount("reader-0", "/models");
    let b = mount("reader-1", "/models");
    let c = mount("reader-2", "/models");
    let p = plans(vec![
        ("n1", a.clone()),
        ("n1", b.clone()),
        ("n2", c.clone()),
    ]);
    let recs = records(vec![
        record(
            "n1",
            true,
            vec![result(&a, CheckStatus::Critical, "ReaderVolumeMissing")],
        ),
        record(
            "n2",
            true,
            vec![result(
                &c,
                CheckStatus::Critical,
                "ReaderVolumeDigestMismatch",
            )],
        ),
    ]);
    let adv = one(&p, &recs);
    assert_eq!(
        (adv.status, adv.reason),
        (ConditionStatus::False, r::READER_VOLUME_DIGEST_MISMATCH)
    );
    // the leading reason's mount is named first, the other failure too; b is pending
    let first = adv.message.find("reader-2").unwrap();
    let second = adv
        .message
        .find("reader-0 at /models (ReaderVolumeMissing)")
        .unwrap();
    assert!(first < second, "{}", adv.message);
    assert!(
        adv.message
            .contains("1 other reader mount is not judged yet"),
        "{}",
        adv.message
    );

    let recs = records(vec![record(
        "n1",
        true,
        vec![result(&a, CheckStatus::Critical, "ReaderVolumeMissing")],
    )]);
    let p = plans(vec![("n1", a.clone())]);
    let adv = one(&p, &recs);
    assert_eq!(adv.reason, r::READER_VOLUME_MISSING);
    assert!(adv.message.contains("volumeMounts"));

    // a failing reason this controller does not know
    let recs = records(vec![record(
        "n1",
        true,
        vec![result(&a, CheckStatus::Warning, "ReaderVolumeSomethingNew")],
    )]);
    assert_eq!(one(&p, &recs).reason, r::READER_CHECK_FAILING);
    // writable beats every other failure
    let p = plans(vec![("n1", a.clone()), ("n2", c.clone())]);
    let recs = records(vec![
        record(
            "n1",
            true,
            vec![result(&a, CheckStatus::Critical, "ReaderVolumeWritable")],
        ),
        record(
            "n2",
            true,
            vec![result(
                &c,
                CheckStatus::Critical,
                "ReaderVolumeDigestMismatch",
            )],
        ),
    ]);
    assert_eq!(one(&p, &recs).reason, r::READER_VOLUME_WRITABLE);
}

#[test]
fn no_report_yet_is_awaiting_reports() {
    let a = mount("reader-0", "/models");
    let p = plans(vec![("n1", a.clone())]);
    // connected, no report at all; and connected with a report from a plan without the mount
    for checks in [
        vec![],
        vec![CheckResult::new(
            MOUNTS_CHECK,
            "host",
            CheckStatus::Ok,
            "NoReaderMounts",
            "none",
        )],
    ] {
        let adv = one(&p, &records(vec![record("n1", true, checks)]));
        assert_eq!(
            (adv.status, adv.reason),
            (ConditionStatus::Unknown, r::AWAITING_REPORTS)
        );
        assert!(
            adv.message
                .contains("n1: team-a/reader-0 at /models (not reported yet)"),
            "{}",
            adv.message
        );
    }
    // a result about an earlier pod of the same name does not count
    let mut old = result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly");
    old.observed.insert("podUid".into(), "uid-earlier".into());
    let adv = one(&p, &records(vec![record("n1", true, vec![old])]));
    assert_eq!(adv.reason, r::AWAITING_REPORTS);
}

#[test]
fn a_disconnected_or_absent_agent_is_awaiting_reports() {
    let a = mount("reader-0", "/models");
    let p = plans(vec![("n1", a.clone())]);
    // the last report passed, but the agent is gone: its report no longer proves anything
    let gone = records(vec![record(
        "n1",
        false,
        vec![result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly")],
    )]);
    for recs in [gone, BTreeMap::new()] {
        let adv = one(&p, &recs);
        assert_eq!(
            (adv.status, adv.reason),
            (ConditionStatus::Unknown, r::AWAITING_REPORTS)
        );
        assert!(
            adv.message.contains("no node agent connected"),
            "{}",
            adv.message
        );
    }
    // a failure elsewhere still wins over a missing agent
    let b = mount("reader-1", "/models");
    let p = plans(vec![("n1", a.clone()), ("n2", b.clone())]);
    let recs = records(vec![record(
        "n2",
        true,
        vec![result(&b, CheckStatus::Critical, "ReaderVolumeWritable")],
    )]);
    let adv = one(&p, &recs);
    assert_eq!(adv.status, ConditionStatus::False);
    assert!(adv
        .message
        .contains("1 other reader mount is not judged yet"));
}

#[test]
fn agent_unknowns_are_unknown() {
    let a = mount("reader-0", "/models");
    let p = plans(vec![("n1", a.clone())]);
    let adv = one(
        &p,
        &records(vec![record(
            "n1",
            true,
            vec![result(&a, CheckStatus::Unknown, "PodNotFound")],
        )]),
    );
    assert_eq!(
        (adv.status, adv.reason),
        (ConditionStatus::Unknown, r::READER_POD_NOT_FOUND)
    );
    let panicked = CheckResult::new(
        MOUNTS_CHECK,
        "host",
        CheckStatus::Unknown,
        "CheckPanicked",
        "boom",
    );
    let adv = one(&p, &records(vec![record("n1", true, vec![panicked])]));
    assert_eq!(
        (adv.status, adv.reason),
        (ConditionStatus::Unknown, r::READER_CHECK_INCONCLUSIVE)
    );
}

#[test]
fn no_planned_mounts_means_no_condition() {
    // engines only, a mount without a binding (standalone plan file): no verdict
    let mut p = plans(vec![(
        "n1",
        ReaderMount {
            binding: String::new(),
            ..mount("reader-0", "/models")
        },
    )]);
    p.entry("n2".into()).or_default();
    let recs = records(vec![record("n1", true, vec![])]);
    let all = reader_advisories(&p, &recs, 0);
    assert!(all.is_empty());
    // a bound request whose binding has no planned mount, and an unbound one: absent
    let bound = request(Some("mcb-1"));
    let unbound = request(None);
    assert_eq!(
        binding_key("inference-cache-model-cache", &bound).as_deref(),
        Some(B)
    );
    assert!(desired_condition(&bound, "inference-cache-model-cache", &all, at(1)).is_none());
    assert!(desired_condition(&unbound, "inference-cache-model-cache", &all, at(1)).is_none());
    // an absent verdict removes a stored condition, leaving the others
    let mut conds = bound.status.clone().unwrap().conditions;
    conds.push(reader_condition(
        &ReaderAdvisory {
            status: ConditionStatus::True,
            reason: r::READERS_READ_ONLY,
            message: "m".into(),
        },
        Some(3),
        at(1),
    ));
    assert!(!is_current(&conds, None));
    assert!(apply_reader_condition(&mut conds, None));
    assert_eq!(conds.len(), 1);
    assert_eq!(conds[0].type_, "Ready");
    assert!(is_current(&conds, None));
}

#[test]
fn transition_time_moves_only_on_status_changes() {
    let a = mount("reader-0", "/models");
    let b = mount("reader-1", "/models");
    let p = plans(vec![("n1", a.clone()), ("n1", b.clone())]);
    let mc = request(Some("mcb-1"));
    let mut conds = mc.status.clone().unwrap().conditions;

    let bad = |which: &ReaderMount, reason: &str| {
        reader_advisories(
            &p,
            &records(vec![record(
                "n1",
                true,
                vec![
                    result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly"),
                    result(&b, CheckStatus::Ok, "ReaderVolumeReadOnly"),
                    result(which, CheckStatus::Critical, reason),
                ],
            )]),
            0,
        )
    };
    let first = desired_condition(
        &mc,
        "inference-cache-model-cache",
        &bad(&a, "ReaderVolumeWritable"),
        at(10),
    );
    assert!(apply_reader_condition(&mut conds, first.clone()));
    let c = find_condition(&conds, CONDITION_TYPE).unwrap().clone();
    assert_eq!(
        (c.status.as_str(), c.last_transition_time.clone()),
        ("False", at(10))
    );
    assert_eq!(c.observed_generation, Some(3));
    // the same verdict later: current, nothing to write
    let again = desired_condition(
        &mc,
        "inference-cache-model-cache",
        &bad(&a, "ReaderVolumeWritable"),
        at(20),
    );
    assert!(is_current(&conds, again.as_ref()));
    // still False, for another mount and reason: written, the transition time kept
    let other = desired_condition(
        &mc,
        "inference-cache-model-cache",
        &bad(&b, "ReaderVolumeMissing"),
        at(30),
    );
    assert!(!is_current(&conds, other.as_ref()));
    assert!(apply_reader_condition(&mut conds, other));
    let c = find_condition(&conds, CONDITION_TYPE).unwrap().clone();
    assert_eq!(c.reason, r::READER_VOLUME_MISSING);
    assert_eq!(c.last_transition_time, at(10));
    // recovered: True, a new transition time
    let ok = reader_advisories(
        &p,
        &records(vec![record(
            "n1",
            true,
            vec![
                result(&a, CheckStatus::Ok, "ReaderVolumeReadOnly"),
                result(&b, CheckStatus::Ok, "ReaderVolumeReadOnly"),
            ],
        )]),
        0,
    );
    assert!(apply_reader_condition(
        &mut conds,
        desired_condition(&mc, "inference-cache-model-cache", &ok, at(40))
    ));
    let c = find_condition(&conds, CONDITION_TYPE).unwrap();
    assert_eq!(
        (c.status.as_str(), c.last_transition_time.clone()),
        ("True", at(40))
    );
    assert_eq!(
        find_condition(&conds, "Ready").unwrap().reason,
        "ReadersReady"
    );
}

#[test]
fn messages_are_bounded() {
    let mounts: Vec<ReaderMount> = (0..200)
        .map(|i| mount(&format!("reader-{i}"), "/models"))
        .collect();
    let p = plans(mounts.iter().map(|m| ("n1", m.clone())).collect());
    let recs = records(vec![record(
        "n1",
        true,
        mounts
            .iter()
            .map(|m| result(m, CheckStatus::Critical, "ReaderVolumeWritable"))
            .collect(),
    )]);
    let adv = one(&p, &recs);
    assert!(adv.message.len() <= MAX_MESSAGE, "{}", adv.message.len());
    assert!(adv.message.contains("and 190 more"), "{}", adv.message);
    // long names: cut at the limit
    let mounts: Vec<ReaderMount> = (0..20)
        .map(|i| mount(&format!("reader-{i}-{}", "x".repeat(200)), "/models"))
        .collect();
    let p = plans(mounts.iter().map(|m| ("n1", m.clone())).collect());
    let recs = records(vec![record(
        "n1",
        true,
        mounts
            .iter()
            .map(|m| result(m, CheckStatus::Critical, "ReaderVolumeWritable"))
            .collect(),
    )]);
    let adv = one(&p, &recs);
    assert!(adv.message.len() <= MAX_MESSAGE, "{}", adv.message.len());
    assert!(adv.message.ends_with('…'));
    let long = truncate("é".repeat(MAX_MESSAGE));
    assert!(long.len() <= MAX_MESSAGE && long.ends_with('…'));
}

#[test]
fn the_patch_carries_the_resource_version_and_the_whole_list() {
    let mc = request(Some("mcb-1"));
    let conds = mc.status.clone().unwrap().conditions;
    let p = conditions_patch(&conds, "7");
    assert_eq!(p["metadata"]["resourceVersion"], "7");
    assert_eq!(p["status"]["conditions"][0]["type"], "Ready");
    assert!(
        p["status"].get("mode").is_none(),
        "only the conditions are touched"
    );
    assert_eq!(
        conditions_patch(&[], "7")["status"]["conditions"],
        Value::Null
    );
}
