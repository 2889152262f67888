//! The `ReadersHealthy` advisory on ModelCache requests, end to end against the in-memory API
//! (kube-fake-client 0.3.0): the leader's plan publisher puts a reader pod of a bound cache into
//! its node's plan, the node's agent (a gRPC client of the real ingest path) reports the
//! `mounts` check, and the leader's status loop writes the verdict on the request — at once on
//! a change, not at the resync — next to the model-cache reconciler's conditions, which it never
//! touches. Also: a concurrent status write is not lost (resourceVersion precondition).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_controller::leader::LeaderHandle;
use ic_controller::reconcile::clock::{to_time, Clock, FakeClock};
use ic_controller::reconcile::nodes::reader_advisory::{self, ReaderAdvisory, CONDITION_TYPE};
use ic_controller::reconcile::nodes::{
    spawn_plan_publisher, spawn_status_writer, NodeLoopConfig, NodesMetrics,
};
use ic_controller::standalone::{self, StandaloneConfig};
use ic_controller::state::LookupPolicy;
use ic_shared::crd::conditions::{find_condition, new_condition, ConditionStatus};
use ic_shared::crd::{model_cache_reason, CacheBackend, CacheNode, ModelCache};
use ic_shared::plan::NodePlan;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, AgentMessage,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube_fake_client::ClientBuilder;
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

mod cluster_scope_support;

const CTL: &str = "inference-cache-model-cache";
const NODE: &str = "gpu-1";
const STATUS_INTERVAL: Duration = Duration::from_secs(2);

/// A bound, durable request (as the model-cache reconciler leaves it) with its conditions.
fn durable_request(name: &str, binding: &str) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}"), "generation": 1},
        "spec": {"source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "r1"}, "size": "40Gi",
                 "workflow": "regularModelCache",
                 "writer": {"template": {"spec": {"containers": [{"name": "fetch", "image": "f"}]}}}},
        "status": {
            "mode": "durable",
            "binding": {"name": binding, "uid": format!("uid-{binding}")},
            "readerClaim": format!("{binding}-reader"),
            "readerNamespaces": ["team-a"],
            "observedGeneration": 1,
            "conditions": [
                {"type": "Selected", "status": "True", "reason": "DurableFlowSelected", "message": "rwxReadOnly",
                 "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1},
                {"type": "Ready", "status": "True", "reason": "ReadersReady", "message": "reader claims exist",
                 "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}
            ]
        }
    }))
    .unwrap()
}

/// A request the controller made `ephemeral`: no binding, so no reader mounts and no verdict.
fn ephemeral_request(name: &str) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}"), "generation": 1},
        "spec": {"source": {"uri": "hf://m", "revision": "r1"}, "size": "1Gi", "durability": "Ephemeral",
                 "workflow": "regularModelCache",
                 "writer": {"template": {"spec": {"containers": [{"name": "fetch", "image": "f"}]}}}},
        "status": {"mode": "ephemeral", "conditions": [
            {"type": "Ready", "status": "True", "reason": "NothingToProvision", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]}
    }))
    .unwrap()
}

/// A running reader pod on `NODE` that mounts `request`'s reader claim at `/models`.
fn reader_pod(name: &str, request: &str, claim: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("pod-uid-{name}"),
                     "annotations": {"inferencecache.io/model-cache": request}},
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                            "volumeMounts": [{"name": "model-data", "mountPath": "/models", "readOnly": true}]}],
            "volumes": [{"name": "model-data", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}]
        },
        "status": {"phase": "Running", "podIP": "10.0.0.9"}
    }))
    .unwrap()
}

async fn fake_client(caches: Vec<ModelCache>, pods: Vec<Pod>) -> kube::Client {
    let mut b = ClientBuilder::new()
        .with_resource::<CacheNode>()
        .with_status_subresource::<CacheNode>()
        .with_resource::<CacheBackend>()
        .with_status_subresource::<CacheBackend>()
        .with_resource::<ModelCache>()
        .with_status_subresource::<ModelCache>();
    for c in caches {
        b = b.with_object(c);
    }
    for p in pods {
        b = b.with_object(p);
    }
    kube::Client::new(
        cluster_scope_support::ClusterScopeShim(b.build().await.unwrap()),
        "default",
    )
}

fn mounts_result(subject: &str, status: proto::CheckStatus, reason: &str) -> proto::CheckResult {
    proto::CheckResult {
        name: "mounts".into(),
        subject: subject.into(),
        status: status as i32,
        reason: reason.into(),
        message: format!("/models in pod team-a/reader-0 (model cache {CTL}/mcb-1): {reason}"),
        observed: [
            ("path".to_string(), "/models".to_string()),
            ("podUid".to_string(), "pod-uid-reader-0".to_string()),
        ]
        .into_iter()
        .collect(),
    }
}

async fn readers_condition(api: &Api<ModelCache>, name: &str) -> Option<Condition> {
    let mc = api.get(name).await.unwrap();
    find_condition(&mc.status.unwrap_or_default().conditions, CONDITION_TYPE).cloned()
}

/// Polls until the request's condition has `status`/`reason` and a message containing
/// `contains`; returns it and how long it took.
async fn wait_for(
    api: &Api<ModelCache>,
    name: &str,
    (status, reason, contains): (&str, &str, &str),
    within: Duration,
) -> (Condition, Duration) {
    let start = Instant::now();
    loop {
        if let Some(c) = readers_condition(api, name).await {
            if c.status == status && c.reason == reason && c.message.contains(contains) {
                return (c, start.elapsed());
            }
        }
        assert!(
            start.elapsed() < within,
            "ReadersHealthy={status}/{reason} not written within {within:?}; now {:?}",
            readers_condition(api, name).await
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Acceptance (issue 8 deliverable 6): a failing reader-volume check reported by an agent shows
/// up as `ReadersHealthy=False` on the ModelCache within one status interval, and clears when
/// the report passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_reader_reported_by_the_agent_reaches_the_request_and_clears() {
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
    let client = fake_client(
        vec![
            durable_request("llama", "mcb-1"),
            ephemeral_request("scratch"),
        ],
        vec![reader_pod("reader-0", "llama", "mcb-1-reader")],
    )
    .await;
    let caches = Api::<ModelCache>::namespaced(client.clone(), "team-a");
    let registry = prometheus::Registry::new();
    let metrics = NodesMetrics::register(&registry).unwrap();
    let clock = Arc::new(FakeClock::at_unix_seconds(1_800_000_000));
    let cfg = NodeLoopConfig {
        plan_interval: Duration::from_millis(200),
        status_interval: STATUS_INTERVAL,
        cachenode_min_write_interval: Duration::from_secs(30),
        // far away: every write below is caused by a verdict change, not by the resync
        advisory_resync: Duration::from_secs(600),
        model_cache_control_namespace: CTL.into(),
        ..Default::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let leader = LeaderHandle::fixed(true);
    let publisher = spawn_plan_publisher(
        client.clone(),
        shared.clone(),
        leader.clone(),
        Some(metrics.clone()),
        cfg.clone(),
        stop_rx.clone(),
    );
    let status = spawn_status_writer(
        client.clone(),
        shared.clone(),
        leader,
        clock.clone() as Arc<dyn Clock>,
        cfg.clone(),
        Some(metrics.clone()),
        stop_rx,
    );

    // The agent of gpu-1 connects and receives a plan carrying the reader mount.
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
        node: NODE.into(),
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
    let plan: NodePlan = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(proto::controller_message::Msg::Plan(p)) =
                downstream.message().await.unwrap().unwrap().msg
            {
                let plan: NodePlan = serde_json::from_str(&p.plan_json).unwrap();
                if !plan.reader_mounts.is_empty() {
                    break plan;
                }
            }
        }
    })
    .await
    .unwrap();
    let m = &plan.reader_mounts[0];
    assert_eq!(
        (m.namespace.as_str(), m.pod.as_str(), m.path.as_str()),
        ("team-a", "reader-0", "/models")
    );
    assert_eq!(m.pod_uid.as_deref(), Some("pod-uid-reader-0"));
    assert_eq!(m.binding, format!("{CTL}/mcb-1"));
    assert!(m.expect_read_only);
    let subject = reader_advisory::mount_subject(m);

    // Planned, connected, not reported yet: Unknown.
    // (Before the agent connected, the same reason named the missing agent.)
    wait_for(
        &caches,
        "llama",
        (
            "Unknown",
            model_cache_reason::AWAITING_REPORTS,
            "gpu-1: team-a/reader-0 at /models (not reported yet)",
        ),
        Duration::from_secs(10),
    )
    .await;

    // The mounts check finds the reader volume writable.
    clock.advance(Duration::from_secs(10));
    let reported = Instant::now();
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_010_000,
        plan_generation: plan.generation,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![mounts_result(
            &subject,
            proto::CheckStatus::Critical,
            "ReaderVolumeWritable",
        )],
    })))
    .await
    .unwrap();
    let (bad, _) = wait_for(
        &caches,
        "llama",
        (
            "False",
            model_cache_reason::READER_VOLUME_WRITABLE,
            "gpu-1: team-a/reader-0 at /models (ReaderVolumeWritable)",
        ),
        STATUS_INTERVAL,
    )
    .await;
    let took = reported.elapsed();
    assert!(took < STATUS_INTERVAL, "took {took:?}");
    assert!(
        bad.message
            .contains("gpu-1: team-a/reader-0 at /models (ReaderVolumeWritable)"),
        "{}",
        bad.message
    );
    assert!(bad.message.contains(&format!("binding {CTL}/mcb-1")));
    assert_eq!(bad.last_transition_time, to_time(clock.now()));
    assert_eq!(bad.observed_generation, Some(1));

    // The reconciler's conditions are untouched; Ready is not gated by the advisory.
    let mc = caches.get("llama").await.unwrap();
    let st = mc.status.unwrap();
    let ready = find_condition(&st.conditions, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "ReadersReady")
    );
    assert_eq!(
        find_condition(&st.conditions, "Selected").unwrap().reason,
        "DurableFlowSelected"
    );
    assert_eq!(st.reader_claim.as_deref(), Some("mcb-1-reader"));
    // The same failure shows on the CacheNode.
    let cn = Api::<CacheNode>::all(client.clone())
        .get(NODE)
        .await
        .unwrap();
    let mh = find_condition(&cn.status.unwrap().conditions, "MountsHealthy")
        .unwrap()
        .clone();
    assert_eq!(
        (mh.status.as_str(), mh.reason.as_str()),
        ("False", "ReaderVolumeWritable")
    );
    // A request without reader mounts gets no condition.
    assert!(readers_condition(&caches, "scratch").await.is_none());

    // The same report again: nothing is written, the transition time stays.
    let written = metrics
        .reader_advisory_writes_total
        .with_label_values(&["written"])
        .get();
    clock.advance(Duration::from_secs(10));
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_020_000,
        plan_generation: plan.generation,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![mounts_result(
            &subject,
            proto::CheckStatus::Critical,
            "ReaderVolumeWritable",
        )],
    })))
    .await
    .unwrap();
    tokio::time::sleep(STATUS_INTERVAL).await;
    assert_eq!(
        metrics
            .reader_advisory_writes_total
            .with_label_values(&["written"])
            .get(),
        written
    );
    assert_eq!(
        readers_condition(&caches, "llama")
            .await
            .unwrap()
            .last_transition_time,
        bad.last_transition_time
    );

    // Remounted read-only: the next report passes and the condition clears.
    clock.advance(Duration::from_secs(10));
    let reported = Instant::now();
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_030_000,
        plan_generation: plan.generation,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![mounts_result(
            &subject,
            proto::CheckStatus::Ok,
            "ReaderVolumeReadOnly",
        )],
    })))
    .await
    .unwrap();
    let (good, _) = wait_for(
        &caches,
        "llama",
        ("True", model_cache_reason::READERS_READ_ONLY, ""),
        STATUS_INTERVAL,
    )
    .await;
    let took = reported.elapsed();
    assert!(took < STATUS_INTERVAL, "took {took:?}");
    assert_eq!(good.last_transition_time, to_time(clock.now()));
    assert!(good
        .message
        .contains("1 reader mount of model cache binding"));
    assert_eq!(
        metrics
            .reader_advisory_writes_total
            .with_label_values(&["error"])
            .get(),
        0
    );

    stop_tx.send(true).unwrap();
    publisher.await.unwrap();
    status.await.unwrap();
}

/// The writer's read-modify-write: a stale read (another writer changed the status since) gets
/// 409 from the resourceVersion precondition, re-reads and writes again, keeping the other
/// writer's condition; an absent verdict removes only this condition.
#[tokio::test]
async fn a_concurrent_status_write_is_not_lost() {
    let client = fake_client(vec![durable_request("llama", "mcb-1")], vec![]).await;
    let api = Api::<ModelCache>::namespaced(client.clone(), "team-a");
    let stale = api.get("llama").await.unwrap();

    // The model-cache reconciler writes its status meanwhile (a new condition).
    let mut fresh = stale.status.clone().unwrap();
    fresh.conditions.push(new_condition(
        "Reconciled",
        ConditionStatus::True,
        "Synced",
        "",
        Some(1),
        to_time(Timestamp::from_second(1_800_000_000).unwrap()),
    ));
    api.patch_status(
        "llama",
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": fresh })),
    )
    .await
    .unwrap();

    let desired = BTreeMap::from([(
        format!("{CTL}/mcb-1"),
        ReaderAdvisory {
            status: ConditionStatus::False,
            reason: model_cache_reason::READER_VOLUME_WRITABLE,
            message: "gpu-1: team-a/reader-0 at /models (ReaderVolumeWritable)".into(),
        },
    )]);
    let at = to_time(Timestamp::from_second(1_800_000_100).unwrap());
    let report = reader_advisory::sync_reader_conditions(
        &client,
        std::slice::from_ref(&stale),
        CTL,
        &desired,
        at.clone(),
    )
    .await;
    assert_eq!(report.written, vec!["team-a/llama".to_string()]);
    assert!(report.failed.is_empty());
    let conds = api.get("llama").await.unwrap().status.unwrap().conditions;
    let types: Vec<&str> = conds.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(
        types,
        vec!["Selected", "Ready", "Reconciled", "ReadersHealthy"]
    );
    assert_eq!(
        find_condition(&conds, CONDITION_TYPE)
            .unwrap()
            .last_transition_time,
        at
    );

    // Unchanged: no write.
    let current = api.get("llama").await.unwrap();
    let report = reader_advisory::sync_reader_conditions(
        &client,
        std::slice::from_ref(&current),
        CTL,
        &desired,
        at.clone(),
    )
    .await;
    assert!(report.written.is_empty());

    // No reader mounts planned any more: the condition goes, the others stay.
    let report =
        reader_advisory::sync_reader_conditions(&client, &[current], CTL, &BTreeMap::new(), at)
            .await;
    assert_eq!(report.written, vec!["team-a/llama".to_string()]);
    let conds = api.get("llama").await.unwrap().status.unwrap().conditions;
    let types: Vec<&str> = conds.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, vec!["Selected", "Ready", "Reconciled"]);
}

/// Plan figures are the leader's: a replica that loses leadership drops its
/// `node_plan_issues` series instead of exporting its last counts for good.
#[tokio::test]
async fn a_replica_that_loses_leadership_exports_no_plan_issues() {
    let shared = Arc::new(ic_controller::state::Shared::new(LookupPolicy::default()).unwrap());
    // Wired by a CacheBackend that does not exist: a BackendNotFound plan issue.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "engine-0", "namespace": "team-a", "uid": "u-engine-0",
                     "annotations": {"inferencecache.io/injected-by": "team-a/gone"}},
        "spec": {"nodeName": "gpu-1", "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.5"},
    }))
    .unwrap();
    let client = fake_client(vec![], vec![pod]).await;
    let registry = prometheus::Registry::new();
    let metrics = NodesMetrics::register(&registry).unwrap();
    let (lead_tx, lead_rx) = tokio::sync::watch::channel(true);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let publisher = spawn_plan_publisher(
        client,
        shared,
        LeaderHandle::new(lead_rx),
        Some(metrics),
        NodeLoopConfig {
            plan_interval: Duration::from_millis(50),
            ..Default::default()
        },
        stop_rx,
    );
    let issues = || -> Vec<(String, i64)> {
        registry
            .gather()
            .iter()
            .filter(|f| f.name().ends_with("node_plan_issues"))
            .flat_map(|f| f.get_metric().iter())
            .map(|m| {
                (
                    m.get_label()[0].value().to_string(),
                    m.get_gauge().get_value() as i64,
                )
            })
            .collect()
    };
    let until = |want: Vec<(String, i64)>| async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = issues();
            if got == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node_plan_issues: {got:?}, want {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    until(vec![("BackendNotFound".to_string(), 1)]).await;
    lead_tx.send(false).unwrap();
    until(vec![]).await;
    stop_tx.send(true).unwrap();
    publisher.await.unwrap();
}
