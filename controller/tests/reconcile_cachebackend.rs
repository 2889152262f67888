//! The CacheBackend reconciler against the bare real apiserver (`bare_apiserver_support`, through
//! `reconcile_support::Harness`: a namespace per test): provisioning, shedding, status
//! persistence, Events, cascade restarts, the leader flag. No controller runs there, so
//! `reconcile` is called directly and the harness plays the Deployment controller and the
//! kubelet by writing status through the status subresource; injected faults and another
//! writer's update landing between a read and a write go through `bare::Faults`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod reconcile_support;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ic_controller::reconcile::cachebackend::events::{EventSpec, KubeEventSink};
use ic_controller::reconcile::cachebackend::probe::{
    FakeProber, ProbeOutcome, ProbeStages, StageResult,
};
use ic_controller::reconcile::{error_policy, Error};
use ic_shared::crd::CacheBackend;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::Resource;
use reconcile_support::bare::{Faults, Step};
use reconcile_support::*;
use serde_json::json;

const TRIGGER: &str = "inferencecache.io/cache-server-restart-trigger";

async fn restart_trigger(h: &Harness, deploy: &str) -> Option<String> {
    h.api::<Deployment>()
        .get(deploy)
        .await
        .unwrap()
        .spec
        .unwrap()
        .template
        .metadata
        .and_then(|m| m.annotations)
        .and_then(|a| a.get(TRIGGER).cloned())
}
/// The server instance a cache-server pod stands for in `observedServerInstance`:
/// `<uid>:<restarts>` (the uid the apiserver assigned).
fn instance(p: &Pod, restarts: i32) -> String {
    format!("{}:{restarts}", p.metadata.uid.as_deref().unwrap())
}

/// A step that lands another writer's update on CacheBackend `name` (an annotation: a new
/// resourceVersion, no spec change) before the request it runs ahead of.
fn another_writer(h: &Harness, name: &str) -> Step {
    let api = h.api::<CacheBackend>();
    let name = name.to_string();
    Step::Before(Box::pin(async move {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            .to_string();
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {"example.com/touched": n}}})),
        )
        .await
        .unwrap();
    }))
}

#[tokio::test]
async fn managed_redis_provisions_rolls_out_and_passes_the_kv_gate() {
    let faults = Faults::new();
    let h = Harness::with_faults(vec![managed_redis("kv")], false, faults.clone()).await;
    // Wired by the webhook (its decision marker): a matched engine pod.
    let by = h.key("kv");
    h.add_pod(pod(
        "engine-0",
        &[("app", "vllm")],
        &[("inferencecache.io/injected-by", by.as_str())],
    ))
    .await;
    h.reconcile("kv").await;

    let d = h.deployment("kv-redis").await.expect("Deployment rendered");
    let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
    let uid = h.cb("kv").await.metadata.uid.unwrap();
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("CacheBackend", uid.as_str())
    );
    assert!(h.service("kv-redis").await.is_some());
    assert!(h.hpa("kv-redis").await.is_none());
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("False", "RolloutInProgress"));
    assert_eq!(
        st.endpoint.as_deref(),
        Some(format!("kv-redis.{}.svc:6379", h.ns).as_str())
    );
    assert_eq!(st.matched_engine_pods, Some(1));
    assert_eq!(st.fail_open, Some(true));
    assert_eq!(st.observed_generation, h.cb("kv").await.metadata.generation);

    h.settle_deployment("kv-redis", 1).await;
    h.advance(10);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert!(st.first_available_at.is_some());
    assert_eq!(h.events.reasons(), vec!["AwaitingFirstKVEvent"]);

    h.index.set(vec![h.replica("engine-0", 42, h.now_ms())]);
    h.advance(10);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("True", "KVEventsObserved"));
    assert_eq!(st.index_participation.as_ref().unwrap().prefix_count, 42);
    assert_eq!(
        h.events.reasons(),
        vec!["AwaitingFirstKVEvent", "KVEventsObserved"]
    );
    let ev = h.events.events();
    assert_eq!(ev[1].object, h.key("kv"));
    assert_eq!(ev[1].object_kind, "CacheBackend");

    // Steady state: no write-through churn, no events. What the apiserver defaulted in the
    // children (Deployment strategy, Service clusterIP, …) does not make them differ from what
    // the reconciler applies: it reads, and writes nothing.
    h.advance(30);
    let seen = faults.calls().len();
    h.reconcile("kv").await;
    assert_eq!(h.events.events().len(), 2);
    let writes: Vec<_> = faults.calls()[seen..]
        .iter()
        .filter(|c| c.method != "GET")
        .cloned()
        .collect();
    assert!(writes.is_empty(), "{writes:?}");
}

#[tokio::test]
async fn drained_backend_stays_ready_through_the_latch() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    h.add_pod(pod("engine-0", &[("app", "vllm")], &[])).await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    h.index.set(vec![h.replica("engine-0", 5, h.now_ms())]);
    h.reconcile("kv").await;
    assert_eq!(
        sr(&h.status("kv").await, "Ready"),
        is("True", "KVEventsObserved")
    );

    // Replicas drain out of the index; long after the timeout the backend is still Ready.
    h.index.set(vec![]);
    h.advance(3600);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("True", "KVEventsObserved"));
    let ip = st.index_participation.unwrap();
    assert_eq!(ip.prefix_count, 0);
    assert!(
        ip.last_event_at.is_none(),
        "lastEventAt removed by the status patch"
    );
    assert!(st.first_kv_event_observed_at.is_some());
}

#[tokio::test]
async fn availability_flap_does_not_restart_the_first_event_window() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    h.reconcile("kv").await;
    let anchor = h.status("kv").await.first_available_at.unwrap();

    h.advance(200);
    h.settle_deployment("kv-redis", 0).await;
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("False", "ReplicasUnavailable"));
    assert_eq!(sr(&st, "Degraded"), is("True", "ReplicasUnavailable"));
    assert!(h.events.reasons().contains(&"BackendDegraded".to_string()));

    h.advance(50);
    h.settle_deployment("kv-redis", 1).await;
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(st.first_available_at.as_ref(), Some(&anchor));
    assert_eq!(sr(&st, "Ready"), is("False", "AwaitingFirstKVEvent"));
    // Back from ReplicasUnavailable but not Ready: no BackendRecovered.
    assert!(!h.events.reasons().contains(&"BackendRecovered".to_string()));

    h.advance(51);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("False", "NoKVEventsObserved"));
    assert_eq!(sr(&st, "Degraded"), is("True", "NoKVEventsObserved"));
    assert_eq!(h.events.count("NoKVEventsObserved"), 1);
}

#[tokio::test]
async fn offload_to_events_only_reanchors_and_sheds_the_workload() {
    let h = Harness::new(vec![managed_redis("kv")], true).await;
    let a = h
        .add_pod(server_pod("kv-redis-a", "u1", "kv", "redis", 0))
        .await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    h.reconcile("kv").await;
    h.advance(400);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Degraded"), is("True", "NoKVEventsObserved"));
    assert_eq!(st.observed_server_instance, Some(instance(&a, 0)));
    let old_anchor = st.first_available_at.clone();

    h.patch_cb(
        "kv",
        json!({"spec": {"integration": {"mode": "EventsOnly"}, "remoteStorage": null}}),
    )
    .await;
    h.advance(5);
    h.reconcile("kv").await;

    assert!(h.deployment("kv-redis").await.is_none(), "Deployment shed");
    assert!(h.service("kv-redis").await.is_none(), "Service shed");
    let st = h.status("kv").await;
    assert!(st.endpoint.is_none());
    assert!(st.observed_server_instance.is_none());
    assert_ne!(st.first_available_at, old_anchor);
    assert_eq!(sr(&st, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert_eq!(sr(&st, "Degraded"), is("False", "NotDegraded"));
    let types: Vec<String> = st.conditions.iter().map(|c| c.type_.clone()).collect();
    assert_eq!(types.len(), 3, "{types:?}");
}

fn stage_failure(msg: &str) -> ProbeOutcome {
    ProbeOutcome::Completed(ProbeStages {
        ingest: StageResult::Failed(msg.to_string()),
        routing: StageResult::Skipped,
        t2: StageResult::Skipped,
    })
}

#[tokio::test]
async fn probe_transport_error_keeps_a_prior_stage_failure() {
    let h = Harness::new(vec![managed_redis("kv")], true).await;
    h.add_pod(pod("engine-0", &[("app", "vllm")], &[])).await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    h.index.set(vec![h.replica("engine-0", 5, h.now_ms())]);
    h.prober
        .push(stage_failure("synthesized event not in index"));
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(
        sr(&st, "FunctionalProbeOK"),
        is("False", "ProbeIngestFailed")
    );
    assert_eq!(sr(&st, "Ready"), is("False", "ProbeIngestFailed"));

    h.prober.push(ProbeOutcome::TransportError(
        "connection refused".to_string(),
    ));
    h.advance(31);
    h.reconcile("kv").await;
    assert_eq!(h.prober.calls(), 2);
    let st = h.status("kv").await;
    assert_eq!(
        sr(&st, "FunctionalProbeOK"),
        is("False", "ProbeIngestFailed")
    );
    assert_eq!(sr(&st, "Ready"), is("False", "ProbeIngestFailed"));

    h.prober.push(FakeProber::all_ok());
    h.advance(31);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "FunctionalProbeOK"), is("True", "ProbeOK"));
    assert_eq!(sr(&st, "Ready"), is("True", "KVEventsObserved"));
    // A probe verdict clearing is not the spec's ReplicasUnavailable → Ready recovery.
    assert!(!h.events.reasons().contains(&"BackendRecovered".to_string()));
}

/// A managed-Redis backend `kv` whose Deployment is Available, an injected engine Deployment
/// `vllm` with its pod, and the Ready cache-server pod `kv-redis-a` (returned) as the baseline.
async fn cascade_fixture() -> (Harness, Pod) {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    h.add_deployment(engine_deployment("vllm", &[("app", "vllm")], 1))
        .await;
    h.add_pod(injected_engine("vllm-abc123-x", &cb, "vllm"))
        .await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    let a = h
        .add_pod(server_pod("kv-redis-a", "u1", "kv", "redis", 0))
        .await;
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&a, 0)),
        "first observation is a baseline"
    );
    assert!(
        restart_trigger(&h, "vllm").await.is_none(),
        "empty→set never cascades"
    );
    (h, a)
}

/// One replacement must roll the engines once, however often its cascade is retried: the
/// cascade's status write meets a real 409 (another writer's update lands between the
/// reconciler's read and its resourceVersion-guarded status patch), the retry and a restarted
/// controller cascade again, and the engine Deployment's template changed exactly once (its
/// `generation`, which the apiserver bumps on spec changes only, went from 1 to 2).
#[tokio::test]
async fn a_cascade_whose_status_write_conflicts_restarts_the_engines_once() {
    use std::sync::atomic::AtomicUsize;
    let faults = Faults::new();
    let mut h = Harness::with_faults(vec![managed_redis("kv")], false, faults.clone()).await;
    let fail_next = Arc::new(AtomicUsize::new(0));
    {
        let f = fail_next.clone();
        let writer = h.api::<CacheBackend>();
        faults.rule(move |c| {
            if c.is("PATCH", "/cachebackends/kv/status")
                && f.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                let api = writer.clone();
                return Step::Before(Box::pin(async move {
                    api.patch(
                        "kv",
                        &PatchParams::default(),
                        &Patch::Merge(
                            &json!({"metadata": {"annotations": {"example.com/touched": "1"}}}),
                        ),
                    )
                    .await
                    .unwrap();
                }));
            }
            Step::Pass
        });
    }
    let cb = h.cb("kv").await;
    let engine = h
        .add_deployment(engine_deployment("vllm", &[("app", "vllm")], 1))
        .await;
    assert_eq!(engine.metadata.generation, Some(1));
    h.add_pod(injected_engine("vllm-abc123-x", &cb, "vllm"))
        .await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    h.add_pod(server_pod("kv-redis-a", "u1", "kv", "redis", 0))
        .await;
    h.reconcile("kv").await;
    // The server is replaced; the cascade's status write then meets a concurrent writer.
    h.delete_pod("kv-redis-a").await;
    let b = h
        .add_pod(server_pod("kv-redis-b", "u2", "kv", "redis", 0))
        .await;
    h.advance(5);
    fail_next.store(1, Ordering::SeqCst);
    let err = h.try_reconcile("kv").await.unwrap_err();
    assert_eq!(
        err.metric_label(),
        "status",
        "the status write conflicted: {err}"
    );
    assert!(
        matches!(std::error::Error::source(&err)
            .and_then(|e| e.downcast_ref::<kube::Error>()),
            Some(kube::Error::Api(s)) if s.code == 409),
        "the apiserver's 409: {err:?}"
    );
    assert_eq!(fail_next.load(Ordering::SeqCst), 0);
    let first = restart_trigger(&h, "vllm").await.expect("restarted");
    // The retry (after the rate-limit window), and a controller restart (fresh memory) that
    // reconciles again: the same replacement, so the same trigger — no second roll.
    h.advance(31);
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&b, 0))
    );
    h.restart_controller();
    h.advance(31);
    h.reconcile("kv").await;
    assert_eq!(restart_trigger(&h, "vllm").await, Some(first));
    let engine = h.deployment("vllm").await.unwrap();
    assert_eq!(
        engine.metadata.generation,
        Some(2),
        "one distinct template change"
    );
    let cascades = faults
        .calls()
        .iter()
        .filter(|c| c.is("PATCH", "/deployments/vllm"))
        .count();
    assert!(cascades >= 1, "the cascade patched the engine Deployment");
}

#[tokio::test]
async fn cascade_skips_a_rolling_update_midpoint_and_its_rollback() {
    let (h, a) = cascade_fixture().await;
    // Rolling update midpoint: the new pod is Ready next to the old one; Deployment not
    // converged (1 desired, 2 ready pods).
    h.deployment_status("kv-redis", Some(1), 1, false).await;
    h.add_pod(server_pod("kv-redis-b", "u2", "kv", "redis", 0))
        .await;
    h.advance(5);
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&a, 0))
    );
    assert!(restart_trigger(&h, "vllm").await.is_none());
    // Rollback: the new pod dies, the original is alone again → same as the baseline.
    h.delete_pod("kv-redis-b").await;
    h.advance(5);
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&a, 0))
    );
    assert!(
        restart_trigger(&h, "vllm").await.is_none(),
        "no false cascade on rollback"
    );
}

#[tokio::test]
async fn cascade_fires_on_replacement_and_is_rate_limited() {
    let (h, _) = cascade_fixture().await;
    // Replacement: the old pod is gone, a new one is Ready.
    h.delete_pod("kv-redis-a").await;
    let b = h
        .add_pod(server_pod("kv-redis-b", "u2", "kv", "redis", 0))
        .await;
    h.advance(5);
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&b, 0))
    );
    let first = restart_trigger(&h, "vllm")
        .await
        .expect("engine Deployment restarted");

    // Another replacement within 30 s: deferred, baseline kept.
    h.delete_pod("kv-redis-b").await;
    let c = h
        .add_pod(server_pod("kv-redis-c", "u3", "kv", "redis", 0))
        .await;
    h.advance(10);
    let action = h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&b, 0))
    );
    assert_eq!(
        restart_trigger(&h, "vllm").await.as_deref(),
        Some(first.as_str())
    );
    assert!(format!("{action:?}").contains("20s"), "{action:?}");

    h.advance(21);
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&c, 0))
    );
    assert_ne!(restart_trigger(&h, "vllm").await, Some(first));

    // An in-place restart of the cache-server container (the kubelet's status write on the
    // same pod) advances it too.
    let restarted = h
        .replace_pod(server_pod("kv-redis-c", "u3", "kv", "redis", 1))
        .await;
    assert_eq!(restarted.metadata.uid, c.metadata.uid, "the same pod");
    h.advance(31);
    h.reconcile("kv").await;
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(instance(&c, 1))
    );
}

#[tokio::test]
async fn converged_scale_up_widens_the_baseline() {
    let (h, a) = cascade_fixture().await;
    h.patch_cb("kv", json!({"spec": {"replicas": 2}})).await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 2).await;
    let b = h
        .add_pod(server_pod("kv-redis-b", "u2", "kv", "redis", 0))
        .await;
    h.reconcile("kv").await;
    // Sorted by pod name: kv-redis-a, kv-redis-b.
    assert_eq!(
        h.status("kv").await.observed_server_instance,
        Some(format!("{},{}", instance(&a, 0), instance(&b, 0)))
    );
    assert!(restart_trigger(&h, "vllm").await.is_none());
}

#[tokio::test]
async fn external_endpoint_that_became_invalid_reads_invalid() {
    let h = Harness::new(vec![external("x", "Redis", "redis.ext:6379")], false).await;
    h.reconcile("x").await;
    let st = h.status("x").await;
    assert_eq!(sr(&st, "Ready"), is("True", "ExternalEndpointAccepted"));
    assert_eq!(st.endpoint.as_deref(), Some("redis.ext:6379"));
    assert!(
        h.deployment("x-redis").await.is_none(),
        "External provisions nothing"
    );

    h.patch_cb(
        "x",
        json!({"spec": {"remoteStorage": {"endpoint": "redis://redis.ext:6379"}}}),
    )
    .await;
    h.reconcile("x").await;
    let st = h.status("x").await;
    assert_eq!(sr(&st, "Ready"), is("False", "ExternalEndpointInvalid"));
    assert_eq!(
        sr(&st, "Progressing"),
        is("False", "ExternalEndpointInvalid")
    );

    h.patch_cb("x", json!({"spec": {"remoteStorage": {"endpoint": " "}}}))
        .await;
    h.reconcile("x").await;
    let st = h.status("x").await;
    assert_eq!(sr(&st, "Ready"), is("False", "ExternalEndpointMissing"));
    assert!(
        st.endpoint.is_none(),
        "endpoint removed by the status patch"
    );
}

#[tokio::test]
async fn managed_to_external_sheds_and_clears_the_server_instance() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    h.add_pod(server_pod("kv-redis-a", "u1", "kv", "redis", 0))
        .await;
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;
    h.reconcile("kv").await;
    assert!(h.status("kv").await.observed_server_instance.is_some());
    h.patch_cb(
        "kv",
        json!({"spec": {"remoteStorage": {"ownership": "External", "endpoint": "r.ext:6379"}}}),
    )
    .await;
    h.reconcile("kv").await;
    assert!(h.deployment("kv-redis").await.is_none());
    let st = h.status("kv").await;
    assert!(st.observed_server_instance.is_none());
    assert!(st.first_available_at.is_none());
    assert!(sr(&st, "Degraded").is_none());
}

#[tokio::test]
async fn kind_switch_and_autoscaling_changes_shed_stale_children() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    h.patch_cb(
        "kv",
        json!({"spec": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3}}}),
    )
    .await;
    h.reconcile("kv").await;
    let hpa = h.hpa("kv-redis").await.expect("HPA rendered");
    assert_eq!(hpa.spec.unwrap().scale_target_ref.kind, "Deployment");
    let d = h.deployment("kv-redis").await.unwrap();
    let c = &d.spec.unwrap().template.spec.unwrap().containers[0];
    assert_eq!(
        c.resources.as_ref().unwrap().requests.as_ref().unwrap()["cpu"].0,
        "250m"
    );

    h.patch_cb(
        "kv",
        json!({"spec": {"deploymentKind": "StatefulSet", "autoscaling": null}}),
    )
    .await;
    h.reconcile("kv").await;
    assert!(h.deployment("kv-redis").await.is_none(), "old kind shed");
    assert!(h.statefulset("kv-redis").await.is_some());
    assert!(
        h.hpa("kv-redis").await.is_none(),
        "HPA shed with autoscaling"
    );
    assert!(h.service("kv-redis").await.is_some());
}

#[tokio::test]
async fn follower_writes_nothing() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    h.leader.store(false, Ordering::SeqCst);
    h.reconcile("kv").await;
    assert!(h.deployment("kv-redis").await.is_none());
    assert!(h.cb("kv").await.status.is_none());
    assert!(h.events.events().is_empty());
    // Taking the Lease: the next reconcile writes.
    h.leader.store(true, Ordering::SeqCst);
    h.reconcile("kv").await;
    assert!(h.deployment("kv-redis").await.is_some());
    assert!(h.cb("kv").await.status.is_some());
}

#[tokio::test]
async fn injected_engine_crash_loop_is_reported_once() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    h.add_pod(crash_looping(injected_engine("vllm-abc123-x", &cb, "vllm")))
        .await;
    h.reconcile("kv").await;
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(
        sr(&st, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
    assert_eq!(h.events.count("InjectedEngineCrashLooping"), 1);
    let ev = h
        .events
        .events()
        .into_iter()
        .find(|e| e.event.reason == "InjectedEngineCrashLooping")
        .unwrap();
    assert_eq!(ev.object, h.key("kv"), "recorded on the CacheBackend");
}

/// `p` with one container status, `status`.
fn engine_status(mut p: Pod, status: serde_json::Value) -> Pod {
    p.status = Some(
        serde_json::from_value(json!({"phase": "Running", "containerStatuses": [status]})).unwrap(),
    );
    p
}

#[tokio::test]
async fn a_crash_loop_reads_as_one_episode_across_its_back_off_cycle() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    let base = injected_engine("vllm-abc123-x", &cb, "vllm");
    let started = |secs_ago: i64| {
        let t =
            k8s_openapi::jiff::Timestamp::from_millisecond(h.now_ms() - secs_ago * 1000).unwrap();
        t.to_string()
    };
    let failed = json!({"terminated": {"exitCode": 1, "reason": "Error"}});
    // Three reconciles: waiting in back-off; running again (lastState Error); back-off again.
    let cycle = [
        json!({"name": "vllm", "ready": false, "restartCount": 3, "image": "i", "imageID": "",
               "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": failed}),
        json!({"name": "vllm", "ready": false, "restartCount": 4, "image": "i", "imageID": "",
               "state": {"running": {"startedAt": started(5)}}, "lastState": failed}),
        json!({"name": "vllm", "ready": false, "restartCount": 4, "image": "i", "imageID": "",
               "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": failed}),
    ];
    h.add_pod(engine_status(base.clone(), cycle[0].clone()))
        .await;
    for (i, st) in cycle.iter().enumerate() {
        h.replace_pod(engine_status(base.clone(), st.clone())).await;
        h.reconcile("kv").await;
        assert_eq!(
            sr(&h.status("kv").await, "EngineCompatibility"),
            is("False", "InjectedEngineCrashLooping"),
            "reconcile {i}"
        );
        h.advance(20);
    }
    assert_eq!(
        h.events.count("InjectedEngineCrashLooping"),
        1,
        "one Event per episode"
    );
    // Running for longer than the back-off window: the episode is over.
    h.replace_pod(engine_status(
        base.clone(),
        json!({"name": "vllm", "ready": true, "restartCount": 4, "image": "i", "imageID": "",
               "state": {"running": {"startedAt": started(700)}}, "lastState": failed}),
    ))
    .await;
    h.reconcile("kv").await;
    assert_eq!(sr(&h.status("kv").await, "EngineCompatibility"), None);
}

/// Field case (issue 39 item 7): restarts that are not a back-off loop. The kubelet restarts
/// an engine OOM-killed once a day at once (its back-off for the container expired long ago),
/// and a node reboot restarts every container with `Unknown`/255: both read `running` with a
/// failed `lastState` and a growing `restartCount`, never `CrashLoopBackOff`. Only a container
/// the kubelet holds in `CrashLoopBackOff` is crash-looping (spec 000 "EngineCompatibility");
/// the shapes below are the kubelet's, written through the status subresource.
#[tokio::test]
async fn a_benign_restart_is_not_a_crash_loop_only_the_kubelets_back_off_is() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    let base = injected_engine("vllm-abc123-z", &cb, "vllm");
    let at = |secs_ago: i64| {
        k8s_openapi::jiff::Timestamp::from_millisecond(h.now_ms() - secs_ago * 1000)
            .unwrap()
            .to_string()
    };
    let day = 24 * 3600;
    let id = "containerd://4f1c0d2b9e8a7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d";
    // Third daily OOM kill: ran a day, killed 20 s ago, restarted at once 19 s ago.
    let oom_daily = json!({"name": "vllm", "ready": false, "started": true, "restartCount": 3,
        "image": "vllm/vllm-openai:v0.11.2", "imageID": "", "containerID": id,
        "state": {"running": {"startedAt": at(19)}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
            "startedAt": at(day + 20), "finishedAt": at(20), "containerID": id}}});
    h.add_pod(engine_status(base.clone(), oom_daily)).await;
    h.reconcile("kv").await;
    assert_eq!(sr(&h.status("kv").await, "EngineCompatibility"), None);

    // After a node reboot: the kubelet records the old container as Unknown, exit 255.
    let rebooted = json!({"name": "vllm", "ready": false, "started": true, "restartCount": 4,
        "image": "vllm/vllm-openai:v0.11.2", "imageID": "", "containerID": id,
        "state": {"running": {"startedAt": at(30)}},
        "lastState": {"terminated": {"exitCode": 255, "reason": "Unknown",
            "startedAt": at(3 * day), "finishedAt": at(120), "containerID": id}}});
    h.replace_pod(engine_status(base.clone(), rebooted)).await;
    h.reconcile("kv").await;
    assert_eq!(sr(&h.status("kv").await, "EngineCompatibility"), None);
    assert_eq!(h.events.count("InjectedEngineCrashLooping"), 0);

    // Now it fails again within seconds and the kubelet backs off: that is a crash loop, and
    // the message carries the kubelet's last termination.
    let backing_off = json!({"name": "vllm", "ready": false, "started": false, "restartCount": 6,
        "image": "vllm/vllm-openai:v0.11.2", "imageID": "", "containerID": id,
        "state": {"waiting": {"reason": "CrashLoopBackOff",
            "message": "back-off 20s restarting failed container=vllm pod=vllm-abc123-z_ns(uid)"}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
            "startedAt": at(12), "finishedAt": at(4), "containerID": id}}});
    h.replace_pod(engine_status(base.clone(), backing_off))
        .await;
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(
        sr(&st, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
    let message = st
        .conditions
        .iter()
        .find(|c| c.type_ == "EngineCompatibility")
        .unwrap()
        .message
        .clone();
    assert!(
        message.starts_with("Injected engine pod(s) vllm-abc123-z are crash-looping")
            && message.contains("vllm-abc123-z: exit code 137 (OOMKilled)"),
        "{message}"
    );
    assert_eq!(h.events.count("InjectedEngineCrashLooping"), 1);
}

#[tokio::test]
async fn the_engine_container_is_the_one_the_adapter_wires_not_the_first() {
    // `[log-shipper, server]`: `server` launches vLLM. A crash-looping log shipper is not the
    // engine's problem; a crash-looping server is.
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    let mut p = injected_engine("vllm-abc123-y", &cb, "vllm");
    p.spec.as_mut().unwrap().containers = serde_json::from_value(json!([
        {"name": "log-shipper", "image": "fluent/fluent-bit:3.0", "command": ["/fluent-bit/bin/fluent-bit"]},
        {"name": "server", "image": "vllm/vllm-openai:v0.9.1", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"], "args": ["--model", "m"]}
    ]))
    .unwrap();
    let looping = |name: &str| {
        json!({"name": name, "ready": false, "restartCount": 5, "image": "i", "imageID": "",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}}})
    };
    let ok = |name: &str| {
        json!({"name": name, "ready": true, "restartCount": 0, "image": "i", "imageID": "",
        "state": {"running": {}}})
    };
    let mut shipper_loops = p.clone();
    shipper_loops.status = Some(
        serde_json::from_value(json!({"phase": "Running",
        "containerStatuses": [looping("log-shipper"), ok("server")]}))
        .unwrap(),
    );
    h.add_pod(shipper_loops).await;
    h.reconcile("kv").await;
    assert_eq!(sr(&h.status("kv").await, "EngineCompatibility"), None);
    let mut server_loops = p.clone();
    server_loops.status = Some(
        serde_json::from_value(json!({"phase": "Running",
        "containerStatuses": [ok("log-shipper"), looping("server")]}))
        .unwrap(),
    );
    h.replace_pod(server_loops).await;
    h.reconcile("kv").await;
    assert_eq!(
        sr(&h.status("kv").await, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
}

#[tokio::test]
async fn cleared_fields_are_removed_from_the_stored_status() {
    let h = Harness::new(vec![host_only("h")], false).await;
    h.reconcile("h").await;
    let st = h.status("h").await;
    assert_eq!(st.matched_engine_pods, Some(0));
    assert!(st.engine_selector_message.is_some());
    assert_eq!(h.events.count("EngineSelectorUnmatched"), 1);
    h.patch_cb("h", json!({"spec": {"engineSelector": null}}))
        .await;
    h.reconcile("h").await;
    let st = h.status("h").await;
    assert_eq!(st.matched_engine_pods, None);
    assert_eq!(st.engine_selector_message, None);
}

#[tokio::test]
async fn failed_pod_list_is_soft() {
    // Plain (unselected) lists fail: pods, engine Deployments, sibling CacheBackends. Owned
    // objects are listed by label and still work.
    static FAIL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let faults = Faults::new();
    faults.rule(|c| {
        let plain_list = c.method == "GET"
            && !c.query.contains("labelSelector")
            && ["/pods", "/deployments", "/cachebackends"]
                .iter()
                .any(|p| c.path.ends_with(p));
        if plain_list && FAIL.load(Ordering::SeqCst) {
            Step::internal("etcd timeout")
        } else {
            Step::Pass
        }
    });
    let h = Harness::with_faults(vec![managed_redis("kv")], false, faults.clone()).await;
    let cb = h.cb("kv").await;
    h.add_pod(crash_looping(injected_engine("vllm-abc123-x", &cb, "vllm")))
        .await;
    h.reconcile("kv").await;
    let before = h.status("kv").await;
    assert_eq!(before.matched_engine_pods, Some(1));
    assert_eq!(
        sr(&before, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
    FAIL.store(true, Ordering::SeqCst);
    h.reconcile("kv").await;
    let after = h.status("kv").await;
    assert_eq!(after.matched_engine_pods, Some(1));
    assert_eq!(
        sr(&after, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
    assert_eq!(
        h.events.count("InjectedEngineCrashLooping"),
        1,
        "not re-fired"
    );
    let failed: Vec<_> = faults
        .calls()
        .into_iter()
        .filter(|c| c.method == "GET" && !c.query.contains("labelSelector"))
        .filter(|c| c.path.ends_with("/pods") || c.path.ends_with("/cachebackends"))
        .collect();
    assert!(
        failed.len() >= 4,
        "both reconciles listed pods and backends: {failed:?}"
    );
}

#[tokio::test]
async fn missing_backend_awaits_change_and_errors_map_to_a_requeue() {
    let h = Harness::new(vec![], false).await;
    let action = h.reconcile("gone").await;
    assert_eq!(
        format!("{action:?}"),
        format!("{:?}", kube::runtime::controller::Action::await_change())
    );
    let err = Error::MissingMetadata("namespace");
    assert_eq!(err.metric_label(), "metadata");
    let a = error_policy(Arc::new(managed_redis("kv")), &err, h.ctx.clone());
    assert!(format!("{a:?}").contains("15s"));
}

#[tokio::test]
async fn kube_event_sink_publishes_events_k8s_io() {
    use ic_controller::reconcile::cachebackend::events::EventSink;
    use k8s_openapi::api::events::v1::Event;
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let sink = KubeEventSink::new(h.admin.clone(), "inference-cache-controller", None);
    let oref = h.cb("kv").await.object_ref(&());
    sink.publish(
        &oref,
        &EventSpec::warning("FailClosedEnabled", "fail-closed"),
    )
    .await
    .unwrap();
    let evs = h.api::<Event>().list(&ListParams::default()).await.unwrap();
    assert_eq!(evs.items.len(), 1);
    assert_eq!(evs.items[0].reason.as_deref(), Some("FailClosedEnabled"));
    assert_eq!(evs.items[0].type_.as_deref(), Some("Warning"));
    let regarding = evs.items[0].regarding.as_ref().unwrap();
    assert_eq!(regarding.uid, oref.uid);
}

/// A concurrent writer bumps the resourceVersion between the reconciler's read and its status
/// write: the apiserver answers the guarded patch with 409, the reconcile fails with a status
/// error, nothing is written and no Event goes out.
#[tokio::test]
async fn status_write_conflict_is_an_error() {
    let faults = Faults::new();
    let h = Harness::with_faults(vec![host_only("h")], false, faults.clone()).await;
    let step = std::sync::Mutex::new(Some(another_writer(&h, "h")));
    faults.rule(move |c| {
        if c.is("PATCH", "/cachebackends/h/status") {
            if let Some(s) = step.lock().unwrap().take() {
                return s;
            }
        }
        Step::Pass
    });
    let err = h.try_reconcile("h").await.unwrap_err();
    assert_eq!(err.metric_label(), "status");
    assert!(
        matches!(std::error::Error::source(&err)
            .and_then(|e| e.downcast_ref::<kube::Error>()),
            Some(kube::Error::Api(s)) if s.code == 409),
        "the apiserver's 409: {err:?}"
    );
    assert!(h.cb("h").await.status.is_none(), "nothing written");
    assert!(
        h.events.events().is_empty(),
        "no events without a status write"
    );
}

/// The writes (anything but GET) among `faults`' calls from the `seen`-th on.
fn writes_since(faults: &Faults, seen: usize) -> Vec<reconcile_support::bare::Call> {
    faults.calls()[seen..]
        .iter()
        .filter(|c| c.method != "GET")
        .cloned()
        .collect()
}

/// What the real apiserver stores differs in form from what the reconciler applies: it
/// canonicalizes quantities (`0.5` → `500m`, `1024Mi` → `1Gi`) and omits empty lists of the
/// built-in kinds (`securityContext.sysctls: []`). The children still equal what was applied,
/// so a steady reconcile writes nothing; a real change of a value is still applied. (Before
/// `is_subset` compared resource quantities by value and an absent field with an empty one, every
/// reconcile re-applied such a workload.)
#[tokio::test]
async fn canonicalized_quantities_and_omitted_empty_lists_are_not_reapplied() {
    let faults = Faults::new();
    let spec = json!({
        "runtime": "VLLM",
        "remoteStorage": {"provider": "Redis", "ownership": "Managed",
            "redis": {"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"},
                                    "limits": {"cpu": "1.5", "memory": "2048Mi"}}}},
        "template": {"securityContext": {"runAsUser": 1000, "sysctls": []}, "tolerations": []}
    });
    let h = Harness::with_faults(vec![backend("kv", spec)], false, faults.clone()).await;
    h.reconcile("kv").await;
    let d = h.deployment("kv-redis").await.unwrap();
    let pod = d.spec.unwrap().template.spec.unwrap();
    let r = pod.containers[0].resources.clone().unwrap();
    assert_eq!(
        r.requests.as_ref().unwrap()["cpu"].0,
        "500m",
        "canonicalized"
    );
    assert_eq!(
        r.limits.as_ref().unwrap()["memory"].0,
        "2Gi",
        "canonicalized"
    );
    assert!(pod.security_context.unwrap().sysctls.is_none(), "omitted");
    h.settle_deployment("kv-redis", 1).await;
    h.reconcile("kv").await;

    h.advance(30);
    let seen = faults.calls().len();
    h.reconcile("kv").await;
    let writes = writes_since(&faults, seen);
    assert!(writes.is_empty(), "a steady reconcile wrote: {writes:?}");

    // Another value is applied.
    h.patch_cb(
        "kv",
        json!({"spec": {"remoteStorage": {"redis": {"resources": {"requests": {"cpu": "0.75"}}}}}}),
    )
    .await;
    h.reconcile("kv").await;
    let d = h.deployment("kv-redis").await.unwrap();
    let r = d.spec.unwrap().template.spec.unwrap().containers[0]
        .resources
        .clone()
        .unwrap();
    assert_eq!(r.requests.as_ref().unwrap()["cpu"].0, "750m");
}

/// Issue 39 item 6: engine pods the apiserver admitted without the Pod webhook (it was down, or
/// past its timeout — the bare apiserver has no mutating webhook, so a pod created here is
/// exactly that: no `injected-by`, no `not-injected`, no `inject-skipped`) are counted in
/// `status.unwiredEnginePods`, not in `matchedEnginePods`, and the CacheBackend gets a Warning
/// `EnginePodsUnwired` naming them each time their number rises — not on every reconcile.
#[tokio::test]
async fn pods_admitted_without_the_webhook_are_unwired_not_matched() {
    let h = Harness::new(vec![host_only("kv")], false).await;
    let cb = h.cb("kv").await;
    h.add_pod(injected_engine("vllm-abc123-wired", &cb, "vllm"))
        .await;
    h.add_pod(pod("vllm-abc123-raw", &[("app", "vllm")], &[]))
        .await;
    // Decided by the webhook (admitted unwired with a reason; opted out): matched, not unwired.
    h.add_pod(pod(
        "vllm-abc123-failopen",
        &[("app", "vllm")],
        &[(
            "inferencecache.io/not-injected",
            "CacheBackend x/kv: no engine container found",
        )],
    ))
    .await;
    h.add_pod(pod(
        "vllm-abc123-optout",
        &[("app", "vllm"), ("inferencecache.io/webhook", "disabled")],
        &[],
    ))
    .await;
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(st.unwired_engine_pods, Some(1), "{st:?}");
    assert_eq!(st.matched_engine_pods, Some(3), "{st:?}");
    assert!(st.engine_selector_message.is_none());
    let unwired: Vec<EventSpec> = h
        .events
        .events()
        .into_iter()
        .filter(|e| e.event.reason == "EnginePodsUnwired")
        .map(|e| e.event)
        .collect();
    assert_eq!(unwired.len(), 1, "{unwired:?}");
    assert_eq!(
        unwired[0].kind,
        ic_controller::reconcile::cachebackend::events::EventKind::Warning
    );
    assert!(unwired[0].note.contains("vllm-abc123-raw"), "{unwired:?}");
    assert!(unwired[0].note.contains("rollout restart"), "{unwired:?}");
    // The persisted field round-trips through the CRD schema (not pruned).
    let raw: serde_json::Value = serde_json::to_value(h.cb("kv").await).unwrap();
    assert_eq!(raw["status"]["unwiredEnginePods"], json!(1));

    // Steady: no second Event, also after a controller restart (the count is persisted).
    h.reconcile("kv").await;
    assert_eq!(h.events.count("EnginePodsUnwired"), 1);

    // Another pod admitted while the webhook is down: the number rises, one more Event.
    h.add_pod(pod("vllm-abc123-raw2", &[("app", "vllm")], &[]))
        .await;
    h.reconcile("kv").await;
    assert_eq!(h.status("kv").await.unwired_engine_pods, Some(2));
    assert_eq!(h.events.count("EnginePodsUnwired"), 2);

    // Re-wired by re-creation (the webhook back): the unwired pods are gone, the wired
    // replacement counts as matched.
    h.delete_pod("vllm-abc123-raw").await;
    h.delete_pod("vllm-abc123-raw2").await;
    h.add_pod(injected_engine("vllm-abc123-rewired", &cb, "vllm"))
        .await;
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(st.unwired_engine_pods, Some(0));
    assert_eq!(st.matched_engine_pods, Some(4));
    assert_eq!(h.events.count("EnginePodsUnwired"), 2);
}

/// The condition types of `status`, sorted.
fn condition_types(status: &ic_shared::crd::CacheBackendStatus) -> Vec<String> {
    let mut t: Vec<String> = status.conditions.iter().map(|c| c.type_.clone()).collect();
    t.sort();
    t
}

/// `status.nodeHealth` as the apiserver stores it (`(status, reason)`), read as JSON.
async fn node_health(h: &Harness, name: &str) -> Option<(String, String)> {
    let v = serde_json::to_value(h.cb(name).await).unwrap();
    let nh = v.pointer("/status/nodeHealth")?;
    Some((
        nh["status"].as_str()?.to_string(),
        nh["reason"].as_str()?.to_string(),
    ))
}

/// Spec 000 "Conditions": an events-only backend publishes exactly Ready, Degraded and
/// Progressing, External ownership Ready and Progressing only. The node roll-up on backends
/// with engine pods on a failing node keeps its information in `status.nodeHealth` there (and
/// as the `NodeHealthy` condition on a host-only backend); a stale `NodeHealthy` left on an
/// events-only or External backend by an earlier release goes on the next reconcile.
#[tokio::test]
async fn node_roll_up_keeps_the_spec_condition_sets() {
    use ic_controller::reconcile::nodes::advisory::{self, reason as adv_reason, NodeAdvisory};
    use ic_shared::crd::{new_condition, ConditionStatus};
    use k8s_openapi::jiff::Timestamp;

    let stale = |mut cb: CacheBackend| {
        cb.status = Some(ic_shared::crd::CacheBackendStatus {
            conditions: vec![new_condition(
                "NodeHealthy",
                ConditionStatus::False,
                "NodeCheckFailing",
                "node-1: shm Critical (ShmUndersized)",
                None,
                ic_controller::reconcile::clock::to_time(Timestamp::from_second(T0).unwrap()),
            )],
            ..Default::default()
        });
        cb
    };
    let h = Harness::new(
        vec![
            stale(events_only("eo")),
            stale(external("ext", "Redis", "redis.ext:6379")),
            stale(host_only("ho")),
        ],
        false,
    )
    .await;
    let three = vec!["Degraded", "Progressing", "Ready"];
    let two = vec!["Progressing", "Ready"];

    // The next reconcile sheds the stale condition where the spec fixes the set.
    for n in ["eo", "ext", "ho"] {
        h.reconcile(n).await;
    }
    assert_eq!(condition_types(&h.status("eo").await), three);
    assert_eq!(condition_types(&h.status("ext").await), two);
    assert!(cond(&h.status("ho").await, "NodeHealthy").is_some());

    // The node status loop's pass: every backend's engine pods run on a failing node.
    let failing = NodeAdvisory {
        status: ConditionStatus::False,
        reason: adv_reason::NODE_CHECK_FAILING,
        message: "Engine pods of this backend run on nodes with failing checks: node-1: shm \
                  Critical (ShmUndersized)."
            .into(),
    };
    let desired: std::collections::BTreeMap<String, NodeAdvisory> = ["eo", "ext", "ho"]
        .iter()
        .map(|n| (h.key(n), failing.clone()))
        .collect();
    let mut cbs: Vec<CacheBackend> = Vec::new();
    for n in ["eo", "ext", "ho"] {
        cbs.push(h.cb(n).await);
    }
    let now = ic_controller::reconcile::clock::to_time(Timestamp::from_second(T0 + 10).unwrap());
    let r = advisory::sync_advisories(&h.admin, &cbs, &desired, now).await;
    assert!(r.failed.is_empty(), "{:?}", r.failed);
    for _ in 0..2 {
        assert_eq!(condition_types(&h.status("eo").await), three);
        assert_eq!(condition_types(&h.status("ext").await), two);
        let failing = Some(("False".to_string(), "NodeCheckFailing".to_string()));
        for n in ["eo", "ext", "ho"] {
            assert_eq!(node_health(&h, n).await, failing, "{n}: status.nodeHealth");
        }
        assert_eq!(
            sr(&h.status("ho").await, "NodeHealthy"),
            is("False", "NodeCheckFailing")
        );
        // The reconciler keeps the roll-up and the sets.
        for n in ["eo", "ext", "ho"] {
            h.reconcile(n).await;
        }
    }

    // An events-only backend flipped to a host-only one gets the condition at its next
    // reconcile, from status.nodeHealth.
    h.api::<CacheBackend>()
        .patch(
            "eo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"integration": null}})),
        )
        .await
        .unwrap();
    h.reconcile("eo").await;
    assert_eq!(
        sr(&h.status("eo").await, "NodeHealthy"),
        is("False", "NodeCheckFailing")
    );
}
