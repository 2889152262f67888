//! CacheNode status from agent reports (conditions per check, aggregate Ready, gpus, engines,
//! transition-only timestamps, the write rate limit) and the CacheBackend `NodeHealthy`
//! advisory — pure, and end to end against the bare real apiserver (`bare_apiserver_support`:
//! the chart's CRDs with their status subresources, resourceVersion conflicts): a report fed
//! through the real ingest path (loopback gRPC) shows up as a CacheNode condition (a
//! cluster-scoped object named after the test's own unique node) and as the advisory condition
//! on the affected CacheBackend (in the test's own namespace).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use ic_controller::index::ReplicaSnapshot;
use ic_controller::ingest::registry::NodeRecord;
use ic_controller::reconcile::clock::{to_time, Clock, FakeClock};
use ic_controller::reconcile::nodes::advisory::{self, reason as adv_reason};
use ic_controller::reconcile::nodes::cachenode::{
    desired_status, reason, CacheNodeWriter, NodeView, WriteDecision, WriteLimiter,
};
use ic_controller::reconcile::nodes::{write_advisories, write_cachenodes, NodeSnapshot};
use ic_controller::standalone::{self, StandaloneConfig};
use ic_controller::state::LookupPolicy;
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::crd::conditions::{find_condition, new_condition, ConditionStatus};
use ic_shared::crd::{CacheBackend, CacheNode, CacheNodeStatus};
use ic_shared::plan::{EnginePlan, KvEventSource, NodePlan};
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, AgentMessage,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

mod bare_apiserver_support;
use bare_apiserver_support::{create_with_status, unique, BareCluster};

fn at(s: i64) -> Time {
    to_time(Timestamp::from_second(s).unwrap())
}

fn record(node: &str, connected: bool, checks: Vec<CheckResult>, report_ms: i64) -> NodeRecord {
    NodeRecord {
        node: node.into(),
        connected,
        agent_version: "0.1.0".into(),
        boot_id: "boot-1".into(),
        agent_instance: "i-1".into(),
        capabilities: vec![],
        connected_at_unix_ms: 1,
        last_seen_unix_ms: report_ms,
        last_report_unix_ms: report_ms,
        report_received_unix_ms: report_ms,
        // Not said (an older agent): the report never reads stale in these tests.
        check_interval_seconds: 0,
        plan_generation: 3,
        status: CheckStatus::worst(checks.iter().map(|c| c.status)),
        checks,
        epoch: 1,
    }
}

fn shm(status: CheckStatus, reason: &str, msg: &str) -> CheckResult {
    CheckResult::new("shm", "host", status, reason, msg)
}

fn gpu(i: u32, status: CheckStatus, reason: &str) -> CheckResult {
    CheckResult::new(
        "gpu",
        format!("gpu{i}"),
        status,
        reason,
        format!("gpu{i} is {reason}"),
    )
    .with("index", i)
    .with("uuid", format!("GPU-{i}"))
    .with("name", "NVIDIA H200")
}

fn engine(ns: &str, pod: &str, backend: &str) -> EnginePlan {
    EnginePlan {
        namespace: ns.into(),
        pod: pod.into(),
        model: "m".into(),
        backend: backend.into(),
        kv_events: vec![KvEventSource {
            endpoint: "tcp://10.0.0.5:5557".into(),
            dp_rank: 0,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn plan(engines: Vec<EnginePlan>) -> NodePlan {
    NodePlan {
        generation: 3,
        engines,
        ..Default::default()
    }
}

#[test]
fn conditions_per_check_aggregate_ready_gpus_and_engines() {
    let rec = record(
        "gpu-1",
        true,
        vec![
            shm(
                CheckStatus::Critical,
                "ShmUndersized",
                "/dev/shm is 64.0 MiB but the plan requires 1.0 GiB",
            ),
            gpu(1, CheckStatus::Ok, "GpuOk"),
            gpu(0, CheckStatus::Warning, "GpuThrottled"),
            CheckResult::new("ports", "tcp/5557", CheckStatus::Ok, "PortHeld", "held"),
        ],
        1_700_000_000_500,
    );
    let p = plan(vec![engine("ns", "vllm-0", "ns/cb")]);
    let replicas = vec![ReplicaSnapshot {
        stream_id: "ns/vllm-0#0".into(),
        replica: "vllm-0".into(),
        node: "gpu-1".into(),
        tenant: "ns".into(),
        model: "m".into(),
        hash_scheme: "vllm".into(),
        backend: "ns/cb".into(),
        dp_rank: 0,
        prefix_count: 42,
        t1_blocks: 40,
        t2_blocks: 2,
        last_event_unix_ms: 1_700_000_000_000,
        seq: 7,
        stale: false,
        ..Default::default()
    }];
    let view = NodeView {
        node: "gpu-1",
        record: Some(&rec),
        plan: Some(&p),
        replicas: &replicas,
        plans_authoritative: true,
    };
    let s = desired_status(&view, None, at(100));
    let types: Vec<&str> = s.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(
        types,
        vec![
            "Ready",
            "AgentConnected",
            "GPUHealthy",
            "PortsHealthy",
            "ShmHealthy"
        ]
    );
    let ready = find_condition(&s.conditions, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", reason::CHECK_CRITICAL)
    );
    assert!(
        ready.message.contains("shm (ShmUndersized)"),
        "{}",
        ready.message
    );
    let shm_c = find_condition(&s.conditions, "ShmHealthy").unwrap();
    assert_eq!(
        (shm_c.status.as_str(), shm_c.reason.as_str()),
        ("False", "ShmUndersized")
    );
    assert!(shm_c.message.starts_with("/dev/shm is 64.0 MiB"));
    let gpu_c = find_condition(&s.conditions, "GPUHealthy").unwrap();
    assert_eq!(
        (gpu_c.status.as_str(), gpu_c.reason.as_str()),
        ("False", "GpuThrottled")
    );
    assert_eq!(gpu_c.message, "gpu0: gpu0 is GpuThrottled");
    assert_eq!(
        find_condition(&s.conditions, "PortsHealthy")
            .unwrap()
            .status,
        "True"
    );
    assert_eq!(s.gpu_count, 2);
    assert_eq!(s.gpus[0].index, 0);
    assert_eq!(s.gpus[0].uuid.as_deref(), Some("GPU-0"));
    assert_eq!(s.gpus[1].name.as_deref(), Some("NVIDIA H200"));
    assert_eq!(s.engine_count, 1);
    let stream = &s.engines[0].streams[0];
    assert!(stream.connected);
    assert_eq!(stream.prefix_count, 42);
    assert_eq!(stream.last_event_at, Some(at(1_700_000_000)));
    assert_eq!(s.last_report_time, Some(at(1_700_000_000)));
    assert_eq!(s.agent_version.as_deref(), Some("0.1.0"));
    assert_eq!(s.boot_id.as_deref(), Some("boot-1"));
    assert_eq!(s.observed_plan_generation, Some(3));

    // A new leader before its first plan pass has no plans: the node's engines stay as they
    // were rather than read "no engine" until the pass.
    let early = NodeView {
        plan: None,
        plans_authoritative: false,
        ..view
    };
    let kept = desired_status(&early, Some(&s), at(110));
    assert_eq!(kept.engine_count, 1);
    assert_eq!(kept.engines, s.engines);
    let after = desired_status(
        &NodeView {
            plans_authoritative: true,
            ..early
        },
        Some(&s),
        at(120),
    );
    assert_eq!(
        after.engine_count, 0,
        "an authoritative empty plan is believed"
    );
}

#[test]
fn a_stream_that_is_not_exact_says_so_in_the_cachenode() {
    let rec = record("gpu-1", true, vec![], 1_700_000_000_500);
    let p = plan(vec![engine("ns", "vllm-0", "ns/cb")]);
    let snap =
        |coverage: &'static str, reason: Option<&'static str>, routable: bool| ReplicaSnapshot {
            stream_id: "ns/vllm-0#0".into(),
            replica: "vllm-0".into(),
            node: "gpu-1".into(),
            tenant: "ns".into(),
            prefix_count: 7,
            coverage,
            coverage_reason: reason,
            routable,
            ..Default::default()
        };
    let stream_of = |replicas: &[ReplicaSnapshot]| {
        let view = NodeView {
            node: "gpu-1",
            record: Some(&rec),
            plan: Some(&p),
            replicas,
            plans_authoritative: true,
        };
        desired_status(&view, None, at(100)).engines[0].streams[0].clone()
    };
    let s = stream_of(&[snap("Partial", Some("BootstrapIncomplete"), true)]);
    assert!(s.connected);
    assert_eq!(s.coverage.as_deref(), Some("Partial"));
    assert_eq!(s.coverage_reason.as_deref(), Some("BootstrapIncomplete"));
    assert!(
        s.message
            .as_deref()
            .unwrap()
            .starts_with("Partial: the engine's replay buffer"),
        "{:?}",
        s.message
    );
    let s = stream_of(&[snap("Disconnected", Some("PublisherDisconnected"), false)]);
    assert!(!s.connected);
    assert!(s.message.unwrap().contains("not routed"));
    let s = stream_of(&[snap("Unknown", Some("AgentDisconnected"), true)]);
    assert!(!s.connected);
    let s = stream_of(&[snap("Exact", None, true)]);
    assert!(s.connected && s.message.is_none());
    assert_eq!(s.coverage.as_deref(), Some("Exact"));
}

#[test]
fn transition_times_move_only_when_a_status_changes() {
    let bad = record(
        "n",
        true,
        vec![shm(CheckStatus::Critical, "ShmUndersized", "a")],
        1_000,
    );
    let view = NodeView {
        node: "n",
        record: Some(&bad),
        plan: None,
        replicas: &[],
        plans_authoritative: true,
    };
    let first = desired_status(&view, None, at(100));

    // Same verdict, new message, later: transition times stay.
    let bad2 = record(
        "n",
        true,
        vec![shm(CheckStatus::Critical, "ShmUndersized", "b")],
        2_000,
    );
    let view = NodeView {
        node: "n",
        record: Some(&bad2),
        plan: None,
        replicas: &[],
        plans_authoritative: true,
    };
    let second = desired_status(&view, Some(&first), at(200));
    let c = find_condition(&second.conditions, "ShmHealthy").unwrap();
    assert_eq!(
        (c.message.as_str(), &c.last_transition_time),
        ("b", &at(100))
    );

    // Fixed: ShmHealthy and Ready flip, with the new time; AgentConnected keeps its time.
    let good = record("n", true, vec![shm(CheckStatus::Ok, "ShmOk", "ok")], 3_000);
    let view = NodeView {
        node: "n",
        record: Some(&good),
        plan: None,
        replicas: &[],
        plans_authoritative: true,
    };
    let third = desired_status(&view, Some(&second), at(300));
    for (t, status, time) in [
        ("ShmHealthy", "True", 300),
        ("Ready", "True", 300),
        ("AgentConnected", "True", 100),
    ] {
        let c = find_condition(&third.conditions, t).unwrap();
        assert_eq!(
            (c.status.as_str(), &c.last_transition_time),
            (status, &at(time)),
            "{t}"
        );
    }

    // A check that stops reporting loses its condition.
    let none = record("n", true, vec![], 4_000);
    let view = NodeView {
        node: "n",
        record: Some(&none),
        plan: None,
        replicas: &[],
        plans_authoritative: true,
    };
    let fourth = desired_status(&view, Some(&third), at(400));
    assert!(find_condition(&fourth.conditions, "ShmHealthy").is_none());
}

#[test]
fn disconnected_missing_and_silent_agents() {
    let gone = record("n", false, vec![shm(CheckStatus::Ok, "ShmOk", "ok")], 1_000);
    let s = desired_status(
        &NodeView {
            node: "n",
            record: Some(&gone),
            plan: None,
            replicas: &[],
            plans_authoritative: true,
        },
        None,
        at(1),
    );
    let ready = find_condition(&s.conditions, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", reason::AGENT_DISCONNECTED)
    );
    assert_eq!(
        find_condition(&s.conditions, "ShmHealthy").unwrap().status,
        "True",
        "last report kept"
    );

    let p = plan(vec![engine("ns", "p", "ns/cb")]);
    let s = desired_status(
        &NodeView {
            node: "n",
            record: None,
            plan: Some(&p),
            replicas: &[],
            plans_authoritative: true,
        },
        None,
        at(1),
    );
    let c = find_condition(&s.conditions, "AgentConnected").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reason::AGENT_NOT_CONNECTED)
    );
    assert_eq!(s.engine_count, 1);
    assert!(!s.engines[0].streams[0].connected);

    let quiet = record("n", true, vec![], 0);
    let s = desired_status(
        &NodeView {
            node: "n",
            record: Some(&quiet),
            plan: None,
            replicas: &[],
            plans_authoritative: true,
        },
        None,
        at(1),
    );
    let ready = find_condition(&s.conditions, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("Unknown", reason::AWAITING_FIRST_REPORT)
    );
}

#[test]
fn writes_are_rate_limited_unless_a_condition_status_changes() {
    let mut lim = WriteLimiter::new(Duration::from_secs(30));
    let t = |s: i64| Timestamp::from_second(s).unwrap();
    let status = |report: i64, st: &str| CacheNodeStatus {
        conditions: vec![new_condition(
            "Ready",
            ConditionStatus::parse(st).unwrap(),
            "R",
            "",
            None,
            at(1),
        )],
        last_report_time: Some(at(report)),
        ..Default::default()
    };
    assert_eq!(
        lim.decide("n", None, &status(1, "True"), t(0)),
        WriteDecision::Write("first")
    );
    lim.wrote("n", t(0));
    let stored = status(1, "True");
    assert_eq!(
        lim.decide("n", Some(&stored), &status(1, "True"), t(5)),
        WriteDecision::Unchanged
    );
    assert_eq!(
        lim.decide("n", Some(&stored), &status(6, "True"), t(6)),
        WriteDecision::RateLimited
    );
    assert_eq!(
        lim.decide("n", Some(&stored), &status(6, "False"), t(6)),
        WriteDecision::Write("condition")
    );
    assert_eq!(
        lim.decide("n", Some(&stored), &status(31, "True"), t(31)),
        WriteDecision::Write("interval")
    );
    // Another node has its own budget.
    assert_eq!(
        lim.decide("m", Some(&stored), &status(6, "True"), t(6)),
        WriteDecision::Write("interval")
    );
}

#[test]
fn advisory_names_nodes_and_checks_and_ignores_other_backends_pods() {
    let plans = BTreeMap::from([
        (
            "n1".to_string(),
            plan(vec![
                engine("ns", "a-0", "ns/a"),
                engine("ns", "b-0", "ns/b"),
            ]),
        ),
        ("n2".to_string(), plan(vec![engine("ns", "a-1", "ns/a")])),
        ("n3".to_string(), plan(vec![engine("ns", "c-0", "ns/c")])),
        ("n4".to_string(), plan(vec![engine("ns", "d-0", "ns/d")])),
    ]);
    let records = BTreeMap::from([
        (
            "n1".to_string(),
            record(
                "n1",
                true,
                vec![
                    // About b's pod only.
                    CheckResult::new(
                        "mp_worker",
                        "ns/b-0",
                        CheckStatus::Critical,
                        "MpWorkerNotListening",
                        "x",
                    ),
                    shm(CheckStatus::Ok, "ShmOk", "ok"),
                ],
                1,
            ),
        ),
        (
            "n2".to_string(),
            record(
                "n2",
                true,
                vec![gpu(0, CheckStatus::Critical, "XidFatal")],
                1,
            ),
        ),
        ("n4".to_string(), record("n4", true, vec![], 0)),
    ]);
    let adv = advisory::advisories(&plans, &records, 1);
    let a = &adv["ns/a"];
    assert_eq!(
        (a.status, a.reason),
        (ConditionStatus::False, adv_reason::NODE_CHECK_FAILING)
    );
    assert!(
        a.message.contains("n2: gpu Critical (XidFatal)"),
        "{}",
        a.message
    );
    assert!(
        !a.message.contains("mp_worker"),
        "b's pod result does not count for a: {}",
        a.message
    );
    let b = &adv["ns/b"];
    assert!(b
        .message
        .contains("n1: mp_worker Critical (MpWorkerNotListening)"));
    let c = &adv["ns/c"];
    assert_eq!(
        (c.status, c.reason),
        (
            ConditionStatus::Unknown,
            adv_reason::NODE_AGENT_NOT_CONNECTED
        )
    );
    assert!(c.message.contains("n3"));
    assert_eq!(adv["ns/d"].reason, adv_reason::NODE_REPORT_PENDING);
    let healthy = advisory::advisories(
        &BTreeMap::from([("n1".to_string(), plan(vec![engine("ns", "a-0", "ns/a")]))]),
        &BTreeMap::from([(
            "n1".to_string(),
            record("n1", true, vec![shm(CheckStatus::Ok, "ShmOk", "ok")], 1),
        )]),
        1,
    );
    assert_eq!(healthy["ns/a"].status, ConditionStatus::True);
    assert_eq!(healthy["ns/a"].reason, adv_reason::NODES_HEALTHY);
}

/// A connected agent whose check pass hangs (no report for over 3 intervals + 60 s) no longer
/// vouches for its last verdict: NodeHealthy reads Unknown/NodeReportStale, as its CacheNode
/// reads Ready=Unknown/ChecksStale, and True again once a report arrives.
#[test]
fn a_stale_report_is_not_vouched_for_in_node_healthy() {
    let plans = BTreeMap::from([("n1".to_string(), plan(vec![engine("ns", "a-0", "ns/a")]))]);
    let mut rec = record(
        "n1",
        true,
        vec![shm(CheckStatus::Ok, "ShmOk", "ok")],
        1_000_000,
    );
    rec.check_interval_seconds = 10;
    let records = BTreeMap::from([("n1".to_string(), rec)]);
    let fresh = advisory::advisories(&plans, &records, 1_000_000 + 90_000);
    assert_eq!(fresh["ns/a"].reason, adv_reason::NODES_HEALTHY);
    let stale = advisory::advisories(&plans, &records, 1_000_000 + 91_000);
    assert_eq!(
        (stale["ns/a"].status, stale["ns/a"].reason),
        (ConditionStatus::Unknown, adv_reason::NODE_REPORT_STALE)
    );
    assert!(
        stale["ns/a"].message.contains("n1"),
        "{}",
        stale["ns/a"].message
    );
    // A pass that could not run (the checks thread is gone) vouches for nothing either.
    let gone = record(
        "n1",
        true,
        vec![CheckResult::new(
            "checks",
            "host",
            CheckStatus::Unknown,
            ic_shared::check::CHECKS_UNAVAILABLE,
            "gone",
        )],
        1_000_000,
    );
    let records = BTreeMap::from([("n1".to_string(), gone)]);
    assert_eq!(
        advisory::advisories(&plans, &records, 1_000_001)["ns/a"].reason,
        adv_reason::NODE_REPORT_STALE
    );
}

/// A pod result whose podUid is not the planned pod's (a StatefulSet pod recreated under the
/// same name) is about the earlier pod and does not count.
#[test]
fn a_result_about_an_earlier_pod_of_the_same_name_does_not_count() {
    let mut e = engine("ns", "vllm-0", "ns/a");
    e.pod_uid = Some("uid-new".into());
    let plans = BTreeMap::from([("n1".to_string(), plan(vec![e]))]);
    let about = |uid: &str| {
        CheckResult::new(
            "shm",
            "ns/vllm-0",
            CheckStatus::Critical,
            "ShmUndersized",
            "small",
        )
        .with("podUid", uid)
    };
    let verdict = |uid: &str| {
        let records = BTreeMap::from([("n1".to_string(), record("n1", true, vec![about(uid)], 1))]);
        advisory::advisories(&plans, &records, 1)["ns/a"].reason
    };
    assert_eq!(verdict("uid-old"), adv_reason::NODES_HEALTHY);
    assert_eq!(verdict("uid-new"), adv_reason::NODE_CHECK_FAILING);
}

fn cache_backend(ns: &str, name: &str) -> CacheBackend {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"runtime": "VLLM", "observation": {"modelID": "m"}},
        "status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KVEventsObserved", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}
        ]},
    }))
    .unwrap()
}

fn check(
    name: &str,
    status: proto::CheckStatus,
    reason: &str,
    message: &str,
) -> proto::CheckResult {
    proto::CheckResult {
        name: name.into(),
        subject: "host".into(),
        status: status as i32,
        reason: reason.into(),
        message: message.into(),
        ..Default::default()
    }
}

/// Acceptance: a failing check reported through the ingest path becomes a CacheNode condition
/// and the advisory condition of the backend whose engine pod runs on that node, in one writer
/// pass (no rate-limit wait: a condition status change is written at once).
#[tokio::test]
async fn a_failing_check_reaches_the_cachenode_and_the_backends_advisory() {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("nodes").await;
    // CacheNodes are cluster-scoped and named after the node: a node of this test only.
    let node = unique("gpu");
    let cb_key = format!("{ns}/cb");
    let stack = standalone::start(
        StandaloneConfig {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            agent_expiry: Duration::from_secs(60),
            policy: LookupPolicy::default(),
            limits: Default::default(),
            allow_unauthenticated_non_loopback: false,
            tokenizers: Default::default(),
        },
        std::future::pending(),
    )
    .await
    .unwrap();
    let shared = stack.shared.clone();
    // The plan book says backend <ns>/cb runs pod vllm-0 on the node (as the publisher derives
    // it).
    shared.nodes.lock().publish_plans(
        BTreeMap::from([(node.clone(), plan(vec![engine(&ns, "vllm-0", &cb_key)]))]),
        1,
    );

    let client = bare.admin.clone();
    let backends = Api::<CacheBackend>::namespaced(client.clone(), &ns);
    let cb_created = create_with_status(&backends, &cache_backend(&ns, "cb")).await;
    create_with_status(&backends, &cache_backend(&ns, "other")).await;
    let clock = FakeClock::at_unix_seconds(1_800_000_000);
    let mut writer = CacheNodeWriter::new(client.clone(), Duration::from_secs(30));

    // The agent connects and reports: /dev/shm is too small.
    let mut agent = AgentServiceClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{}", stack.grpc_addr))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let send = |m: Msg| AgentMessage { msg: Some(m) };
    tx.send(send(Msg::Hello(proto::Hello {
        node: node.clone(),
        version: "0.1.0".into(),
        boot_id: "b".into(),
        ..Default::default()
    })))
    .await
    .unwrap();
    let mut downstream = agent
        .connect(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // The plan published before the agent connected arrives first.
    match downstream.message().await.unwrap().unwrap().msg {
        Some(proto::controller_message::Msg::Plan(p)) => assert_eq!(p.generation, 1),
        other => panic!("expected the node plan first, got {other:?}"),
    }
    let mut changes = shared.node_changes();
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_000_000,
        plan_generation: 1,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![
            check(
                "shm",
                proto::CheckStatus::Critical,
                "ShmUndersized",
                "/dev/shm is 64.0 MiB but the plan requires 1.0 GiB",
            ),
            check("ports", proto::CheckStatus::Ok, "PortsOk", "ok"),
        ],
    })))
    .await
    .unwrap();
    // Wait until the ingest path stored the report.
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            changes.changed().await.unwrap();
            if shared
                .nodes
                .lock()
                .get(&node)
                .is_some_and(|r| !r.checks.is_empty())
            {
                break;
            }
        }
    })
    .await
    .unwrap();

    // One writer pass (what the leader's status loop runs on every report).
    let snap = NodeSnapshot::take(&shared);
    let decisions = write_cachenodes(&mut writer, &snap, &clock, None).await;
    assert_eq!(decisions[&node], Ok(WriteDecision::Write("first")));
    let report = write_advisories(&client, &snap, &clock, None)
        .await
        .unwrap();
    // The writer sees every CacheBackend of the cluster (it removes a stale advisory from
    // another test's backend too): of this test's, only cb's is written.
    assert_eq!(of_ns(&report.written, &ns), vec![cb_key.clone()]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);

    let cn = Api::<CacheNode>::all(client.clone())
        .get(&node)
        .await
        .unwrap();
    assert_eq!(cn.spec.node_name.as_deref(), Some(node.as_str()));
    let st = cn.status.unwrap();
    let shm_c = find_condition(&st.conditions, "ShmHealthy").unwrap();
    assert_eq!(
        (shm_c.status.as_str(), shm_c.reason.as_str()),
        ("False", "ShmUndersized")
    );
    assert_eq!(shm_c.last_transition_time, to_time(clock.now()));
    assert_eq!(
        find_condition(&st.conditions, "Ready").unwrap().status,
        "False"
    );
    assert_eq!(st.agent_version.as_deref(), Some("0.1.0"));
    assert_eq!(st.observed_plan_generation, Some(1));

    let cb = backends.get("cb").await.unwrap();
    let conds = cb.status.unwrap().conditions;
    let adv = find_condition(&conds, "NodeHealthy").unwrap();
    assert_eq!(
        (adv.status.as_str(), adv.reason.as_str()),
        ("False", "NodeCheckFailing")
    );
    assert!(
        adv.message
            .contains(&format!("{node}: shm Critical (ShmUndersized)")),
        "{}",
        adv.message
    );
    assert_eq!(adv.observed_generation, cb_created.metadata.generation);
    assert!(adv.observed_generation.is_some());
    assert_eq!(
        find_condition(&conds, "Ready").map(|c| c.reason.as_str()),
        Some("KVEventsObserved"),
        "the reconciler's conditions are left alone"
    );
    // A backend without engine pods on the node gets no advisory.
    let other = backends.get("other").await.unwrap();
    assert!(find_condition(&other.status.unwrap().conditions, "NodeHealthy").is_none());

    // The next identical pass writes nothing; only lastReportTime moving is rate-limited.
    clock.advance(Duration::from_secs(5));
    let decisions = write_cachenodes(&mut writer, &NodeSnapshot::take(&shared), &clock, None).await;
    assert_eq!(decisions[&node], Ok(WriteDecision::Unchanged));
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_005_000,
        plan_generation: 1,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![
            check(
                "shm",
                proto::CheckStatus::Critical,
                "ShmUndersized",
                "/dev/shm is 64.0 MiB but the plan requires 1.0 GiB",
            ),
            check("ports", proto::CheckStatus::Ok, "PortsOk", "ok"),
        ],
    })))
    .await
    .unwrap();
    wait_for_report(&shared, &node, 1_800_000_005_000).await;
    let decisions = write_cachenodes(&mut writer, &NodeSnapshot::take(&shared), &clock, None).await;
    assert_eq!(decisions[&node], Ok(WriteDecision::RateLimited));

    // The check recovers: written at once, the advisory turns True.
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_010_000,
        plan_generation: 1,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![
            check("shm", proto::CheckStatus::Ok, "ShmOk", "ok"),
            check("ports", proto::CheckStatus::Ok, "PortsOk", "ok"),
        ],
    })))
    .await
    .unwrap();
    wait_for_report(&shared, &node, 1_800_000_010_000).await;
    clock.advance(Duration::from_secs(5));
    let snap = NodeSnapshot::take(&shared);
    let decisions = write_cachenodes(&mut writer, &snap, &clock, None).await;
    assert_eq!(decisions[&node], Ok(WriteDecision::Write("condition")));
    write_advisories(&client, &snap, &clock, None)
        .await
        .unwrap();
    let st = Api::<CacheNode>::all(client.clone())
        .get(&node)
        .await
        .unwrap()
        .status
        .unwrap();
    let shm_c = find_condition(&st.conditions, "ShmHealthy").unwrap();
    assert_eq!(shm_c.status, "True");
    assert_eq!(shm_c.last_transition_time, to_time(clock.now()));
    let cb = backends.get("cb").await.unwrap();
    let adv = find_condition(&cb.status.as_ref().unwrap().conditions, "NodeHealthy")
        .unwrap()
        .clone();
    assert_eq!(
        (adv.status.as_str(), adv.reason.as_str()),
        ("True", "NodesHealthy")
    );

    // A concurrent write by the reconciler (another resourceVersion) is not lost: the advisory
    // write gets 409 from the apiserver, re-reads and keeps the reconciler's condition.
    let api = backends.clone();
    let mut stale = cb.clone();
    let mut fresh = cb.clone();
    fresh
        .status
        .as_mut()
        .unwrap()
        .conditions
        .push(new_condition(
            "Degraded",
            ConditionStatus::False,
            "NotDegraded",
            "",
            None,
            at(5),
        ));
    api.replace_status("cb", &PostParams::default(), &fresh)
        .await
        .unwrap();
    stale
        .status
        .as_mut()
        .unwrap()
        .conditions
        .retain(|c| c.type_ != "NodeHealthy");
    let desired = BTreeMap::from([(
        cb_key.clone(),
        advisory::NodeAdvisory {
            status: ConditionStatus::False,
            reason: adv_reason::NODE_CHECK_FAILING,
            message: "m".into(),
        },
    )]);
    let r = advisory::sync_advisories(&client, &[stale], &desired, at(10)).await;
    assert_eq!(r.written, vec![cb_key.clone()]);
    assert!(r.failed.is_empty(), "{:?}", r.failed);
    let conds = api.get("cb").await.unwrap().status.unwrap().conditions;
    assert!(find_condition(&conds, "Degraded").is_some());
    assert_eq!(
        find_condition(&conds, "NodeHealthy").unwrap().status,
        "False"
    );
}

/// `namespace/name` keys of `keys` in namespace `ns`.
fn of_ns(keys: &[String], ns: &str) -> Vec<String> {
    keys.iter()
        .filter(|k| k.split_once('/').is_some_and(|(n, _)| n == ns))
        .cloned()
        .collect()
}

async fn wait_for_report(shared: &ic_controller::state::Shared, node: &str, ms: i64) {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if shared
                .nodes
                .lock()
                .get(node)
                .is_some_and(|r| r.last_report_unix_ms == ms)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
}

/// A check pass that hangs on the node (a reader volume on an unreachable NFS server) stops the
/// reports while the stream stays up: once the last report is older than a few of the agent's
/// intervals, Ready is Unknown / ChecksStale, not the last report's True.
#[test]
fn a_report_older_than_a_few_check_intervals_makes_ready_unknown() {
    let mut rec = record(
        "n",
        true,
        vec![shm(CheckStatus::Ok, "ShmOk", "ok")],
        100_000,
    );
    rec.check_interval_seconds = 5;
    let ready_at = |rec: &NodeRecord, s: i64| {
        let view = NodeView {
            node: "n",
            record: Some(rec),
            plan: None,
            replicas: &[],
            plans_authoritative: true,
        };
        let st = desired_status(&view, None, at(s));
        let c = find_condition(&st.conditions, "Ready").unwrap().clone();
        (c.status, c.reason, c.message)
    };
    // 3 × 5 s + 60 s after the report arrived (at 100 s) it is still fresh.
    let (status, reason_, _) = ready_at(&rec, 175);
    assert_eq!(
        (status.as_str(), reason_.as_str()),
        ("True", reason::NODE_READY)
    );
    let (status, reason_, message) = ready_at(&rec, 176);
    assert_eq!(
        (status.as_str(), reason_.as_str()),
        ("Unknown", reason::CHECKS_STALE)
    );
    assert!(
        message.contains("76 s old") && message.contains("every 5 s"),
        "{message}"
    );
    // A critical last report stays False (the worst known).
    let mut bad = record(
        "n",
        true,
        vec![shm(CheckStatus::Critical, "ShmUndersized", "a")],
        100_000,
    );
    bad.check_interval_seconds = 5;
    assert_eq!(ready_at(&bad, 500).1, reason::CHECK_CRITICAL);
    // An agent that does not say its interval is never judged stale.
    rec.check_interval_seconds = 0;
    assert_eq!(ready_at(&rec, 100_000).1, reason::NODE_READY);
}

/// Unknown results are named in Ready's message (Ready stays True: they do not fail), and a pass
/// that could not run at all (the agent's checks thread is gone) is Ready=Unknown.
#[test]
fn unknown_checks_are_named_and_an_unavailable_pass_is_unknown() {
    let ready_of = |checks: Vec<CheckResult>| {
        let rec = record("n", true, checks, 100_000);
        let view = NodeView {
            node: "n",
            record: Some(&rec),
            plan: None,
            replicas: &[],
            plans_authoritative: true,
        };
        let st = desired_status(&view, None, at(101));
        let c = find_condition(&st.conditions, "Ready").unwrap().clone();
        (c.status, c.reason, c.message)
    };
    let (status, reason_, message) = ready_of(vec![
        shm(CheckStatus::Ok, "ShmOk", "ok"),
        CheckResult::new("gpu", "gpu0", CheckStatus::Unknown, "GpuHealthUnknown", "x"),
    ]);
    assert_eq!(
        (status.as_str(), reason_.as_str()),
        ("True", reason::NODE_READY)
    );
    assert!(
        message.contains("Not known") && message.contains("gpu"),
        "{message}"
    );
    assert!(!message.contains("Every node check passes"), "{message}");
    let (status, reason_, _) = ready_of(vec![CheckResult::new(
        "checks",
        "host",
        CheckStatus::Unknown,
        ic_shared::check::CHECKS_UNAVAILABLE,
        "gone",
    )]);
    assert_eq!(
        (status.as_str(), reason_.as_str()),
        ("Unknown", reason::CHECKS_UNAVAILABLE)
    );
}
