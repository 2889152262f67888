//! The `ReadersHealthy` advisory on ModelCache requests, end to end against the bare real
//! apiserver (`bare_apiserver_support`: the chart's CRDs, status subresources, resourceVersion
//! preconditions): the leader's plan publisher puts a reader pod of a bound cache into its
//! node's plan, the node's agent (a gRPC client of the real ingest path) reports the `mounts`
//! check, and the leader's status loop writes the verdict on the request — at once on a change,
//! not at the resync — next to the model-cache reconciler's conditions, which it never touches.
//! Also: a concurrent status write is not lost (the apiserver's 409 on a stale
//! resourceVersion).
//!
//! Each test has its own namespace, node name (CacheNodes are cluster-scoped) and binding name.
//! The loops read every Pod and ModelCache of the cluster, as the controller does; the status
//! loop removes the condition from requests whose binding it has no verdict for, so the tests
//! that write the condition take turns (`SERIAL`).
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
use ic_shared::crd::{model_cache_reason, CacheNode, ModelCache};
use ic_shared::plan::NodePlan;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, AgentMessage,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

mod bare_apiserver_support;
use bare_apiserver_support::{create_with_status, unique, BareCluster, Faults};

const CTL: &str = "inference-cache-model-cache";
/// The status loop's pause between passes without agent activity: long, so that a write within
/// it is the loop reacting to the report, not its periodic pass.
const STATUS_INTERVAL: Duration = Duration::from_secs(30);

/// The tests that run the status loop or write the condition, one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A bound, durable request (as the model-cache reconciler leaves it) with its conditions.
fn durable_request(ns: &str, name: &str, binding: &str) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "r1"}, "size": "40Gi",
                 "workflow": "regularModelCache",
                 "writer": {"template": {"spec": {"containers": [{"name": "fetch", "image": "f"}]}}}},
        "status": {
            "mode": "durable",
            "binding": {"name": binding, "uid": format!("uid-{binding}")},
            "readerClaim": format!("{binding}-reader"),
            "readerNamespaces": [ns],
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
fn ephemeral_request(ns: &str, name: &str) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": ns},
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

/// A running reader pod on `node` that mounts `request`'s reader claim at `/models`.
fn reader_pod(ns: &str, node: &str, name: &str, request: &str, claim: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns,
                     "annotations": {"inferencecache.io/model-cache": request}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                            "volumeMounts": [{"name": "model-data", "mountPath": "/models", "readOnly": true}]}],
            "volumes": [{"name": "model-data", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}]
        },
        "status": {"phase": "Running", "podIP": "10.0.0.9"}
    }))
    .unwrap()
}

/// The agent's `mounts` result about reader pod `<ns>/reader-0` (uid `pod_uid`) of `binding`.
fn mounts_result(
    subject: &str,
    (ns, pod_uid, binding): (&str, &str, &str),
    status: proto::CheckStatus,
    reason: &str,
) -> proto::CheckResult {
    proto::CheckResult {
        name: "mounts".into(),
        subject: subject.into(),
        status: status as i32,
        reason: reason.into(),
        message: format!("/models in pod {ns}/reader-0 (model cache {CTL}/{binding}): {reason}"),
        observed: [
            ("path".to_string(), "/models".to_string()),
            ("podUid".to_string(), pod_uid.to_string()),
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

/// Status writes (PATCH `…/modelcaches/<name>/status`) of request `<ns>/<name>` among `calls`.
fn status_writes(calls: &[bare_apiserver_support::Call], ns: &str, name: &str) -> usize {
    calls
        .iter()
        .filter(|c| {
            c.is(
                "PATCH",
                &format!("/namespaces/{ns}/modelcaches/{name}/status"),
            )
        })
        .count()
}

/// Acceptance (issue 8 deliverable 6): a failing reader-volume check reported by an agent shows
/// up as `ReadersHealthy=False` on the ModelCache within one status interval, and clears when
/// the report passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_reader_reported_by_the_agent_reaches_the_request_and_clears() {
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    let ns = bare.namespace("readers").await;
    let node = unique("gpu");
    let binding = unique("mcb");
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
    let caches = Api::<ModelCache>::namespaced(bare.admin.clone(), &ns);
    let llama = create_with_status(&caches, &durable_request(&ns, "llama", &binding)).await;
    create_with_status(&caches, &ephemeral_request(&ns, "scratch")).await;
    let pods = Api::<Pod>::namespaced(bare.admin.clone(), &ns);
    let pod = create_with_status(
        &pods,
        &reader_pod(
            &ns,
            &node,
            "reader-0",
            "llama",
            &format!("{binding}-reader"),
        ),
    )
    .await;
    let pod_uid = pod.metadata.uid.clone().unwrap();
    let faults = Faults::new();
    let client = bare.client_with(faults.clone());
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

    // The agent of the node connects and receives a plan carrying the reader mount.
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
    let plan: NodePlan = tokio::time::timeout(Duration::from_secs(30), async {
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
        (ns.as_str(), "reader-0", "/models")
    );
    assert_eq!(m.pod_uid.as_deref(), Some(pod_uid.as_str()));
    assert_eq!(m.binding, format!("{CTL}/{binding}"));
    assert!(m.expect_read_only);
    let subject = reader_advisory::mount_subject(m);
    let about = (ns.as_str(), pod_uid.as_str(), binding.as_str());

    // The leader's status loop, started once the plan book holds the mount (its first pass
    // then has the plans; a pass wakes on agent activity, or after STATUS_INTERVAL).
    let status = spawn_status_writer(
        client.clone(),
        shared.clone(),
        leader,
        clock.clone() as Arc<dyn Clock>,
        cfg.clone(),
        Some(metrics.clone()),
        stop_rx,
    );

    // Planned, connected, not reported yet: Unknown.
    // (Before the agent connected, the same reason named the missing agent.)
    wait_for(
        &caches,
        "llama",
        (
            "Unknown",
            model_cache_reason::AWAITING_REPORTS,
            &format!("{node}: {ns}/reader-0 at /models (not reported yet)"),
        ),
        Duration::from_secs(30),
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
            about,
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
            &format!("{node}: {ns}/reader-0 at /models (ReaderVolumeWritable)"),
        ),
        STATUS_INTERVAL,
    )
    .await;
    let took = reported.elapsed();
    assert!(took < STATUS_INTERVAL, "took {took:?}");
    assert!(
        bad.message.contains(&format!(
            "{node}: {ns}/reader-0 at /models (ReaderVolumeWritable)"
        )),
        "{}",
        bad.message
    );
    assert!(bad.message.contains(&format!("binding {CTL}/{binding}")));
    assert_eq!(bad.last_transition_time, to_time(clock.now()));
    assert_eq!(bad.observed_generation, llama.metadata.generation);
    assert!(bad.observed_generation.is_some());

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
    let reader_claim = format!("{binding}-reader");
    assert_eq!(st.reader_claim.as_deref(), Some(reader_claim.as_str()));
    // The same failure shows on the CacheNode.
    let cn = Api::<CacheNode>::all(client.clone())
        .get(&node)
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
    let rate_limited = || {
        metrics
            .cachenode_syncs_total
            .with_label_values(&["rate_limited"])
            .get()
    };
    let limited_before = rate_limited();
    let calls_before = faults.calls().len();
    clock.advance(Duration::from_secs(10));
    tx.send(send(Msg::Checks(proto::CheckReport {
        observed_at_unix_ms: 1_800_000_020_000,
        plan_generation: plan.generation,
        // An older agent: no interval, so the fake clock never makes it stale.
        interval_seconds: 0,
        age_ms: 0,
        results: vec![mounts_result(
            &subject,
            about,
            proto::CheckStatus::Critical,
            "ReaderVolumeWritable",
        )],
    })))
    .await
    .unwrap();
    // A status pass saw the report (its CacheNode write, only lastReportTime newer, is
    // rate-limited); the rest of that pass then runs.
    let deadline = Instant::now() + Duration::from_secs(30);
    while rate_limited() == limited_before {
        assert!(Instant::now() < deadline, "no status pass saw the report");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        status_writes(&faults.calls()[calls_before..], &ns, "llama"),
        0,
        "the unchanged verdict was written again"
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
            about,
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
    // Later runs' loops need not plan this test's reader mount (a pod bound to a node has no
    // kubelet here to finish a graceful deletion).
    pods.delete(
        "reader-0",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    caches
        .delete("llama", &DeleteParams::default())
        .await
        .unwrap();
}

/// The writer's read-modify-write: a stale read (another writer changed the status since) gets
/// 409 from the resourceVersion precondition, re-reads and writes again, keeping the other
/// writer's condition; an absent verdict removes only this condition.
#[tokio::test]
async fn a_concurrent_status_write_is_not_lost() {
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    let ns = bare.namespace("readers").await;
    let binding = unique("mcb");
    let client = bare.admin.clone();
    let api = Api::<ModelCache>::namespaced(client.clone(), &ns);
    create_with_status(&api, &durable_request(&ns, "llama", &binding)).await;
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
        format!("{CTL}/{binding}"),
        ReaderAdvisory {
            status: ConditionStatus::False,
            reason: model_cache_reason::READER_VOLUME_WRITABLE,
            message: "gpu-1: team-a/reader-0 at /models (ReaderVolumeWritable)".into(),
        },
    )]);
    let at = to_time(Timestamp::from_second(1_800_000_100).unwrap());
    let faults = Faults::new();
    let recorded = bare.client_with(faults.clone());
    let report = reader_advisory::sync_reader_conditions(
        &recorded,
        std::slice::from_ref(&stale),
        CTL,
        &desired,
        at.clone(),
    )
    .await;
    assert_eq!(report.written, vec![format!("{ns}/llama")]);
    assert!(report.failed.is_empty());
    // The first write was refused by the apiserver (stale resourceVersion), then re-read.
    let calls = faults.calls();
    assert_eq!(status_writes(&calls, &ns, "llama"), 2, "{calls:?}");
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
    assert_eq!(report.written, vec![format!("{ns}/llama")]);
    let conds = api.get("llama").await.unwrap().status.unwrap().conditions;
    let types: Vec<&str> = conds.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, vec!["Selected", "Ready", "Reconciled"]);
}

/// Plan figures are the leader's: a replica that loses leadership drops its
/// `node_plan_issues` series instead of exporting its last counts for good. (The publisher
/// lists every pod of the cluster, other tests' too: while leading it counts at least this
/// test's issue; after, none at all.)
#[tokio::test]
async fn a_replica_that_loses_leadership_exports_no_plan_issues() {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("issues").await;
    let node = unique("gpu");
    let shared = Arc::new(ic_controller::state::Shared::new(LookupPolicy::default()).unwrap());
    // Wired by a CacheBackend that does not exist: a BackendNotFound plan issue.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "engine-0", "namespace": ns,
                     "annotations": {"inferencecache.io/injected-by": format!("{ns}/gone")}},
        "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.5"},
    }))
    .unwrap();
    create_with_status(&Api::<Pod>::namespaced(bare.admin.clone(), &ns), &pod).await;
    let client = bare.admin.clone();
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
    let until = |what: &'static str, want: fn(&[(String, i64)]) -> bool| async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = issues();
            if want(&got) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node_plan_issues: {got:?}, want {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    until("BackendNotFound >= 1", |got| {
        got.iter().any(|(r, n)| r == "BackendNotFound" && *n >= 1)
    })
    .await;
    lead_tx.send(false).unwrap();
    until("no series", |got| got.is_empty()).await;
    stop_tx.send(true).unwrap();
    publisher.await.unwrap();
}
