//! The status machine, driven purely (`status::evaluate` with hand-built observations and a
//! hand-moved clock): one test per transition and condition reason of spec 000 "Status",
//! "Conditions", "KV-event readiness gate", "Functional-probe gate", "Events-only mode",
//! "Contract Notes". The API-level flows are in `reconcile_cachebackend.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod reconcile_support;

use std::time::Duration;

use ic_controller::reconcile::cachebackend::cascade::CascadeDecision;
use ic_controller::reconcile::cachebackend::events::EventKind;
use ic_controller::reconcile::cachebackend::index_view::ReplicaObservation;
use ic_controller::reconcile::cachebackend::path::PathKind;
use ic_controller::reconcile::cachebackend::probe::{
    ProbeInput, ProbeOutcome, ProbeStages, StageResult,
};
use ic_controller::reconcile::cachebackend::status::{
    evaluate, Evaluation, Memory, Observed, Settings, WorkloadState,
};
use ic_controller::reconcile::render;
use ic_shared::crd::{CacheBackend, CacheBackendStatus, DeploymentKind, IndexParticipation};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use reconcile_support::*;
use serde_json::json;

/// A pure simulation of successive reconciles of one backend.
struct Sim {
    cb: CacheBackend,
    mem: Memory,
    now: i64,
    settings: Settings,
    workload: Option<WorkloadState>,
    owned_workload_present: bool,
    pods: Option<Vec<Pod>>,
    replicas: Result<Vec<ReplicaObservation>, String>,
    probe_enabled: bool,
    probe_next: Option<ProbeOutcome>,
    probes_run: usize,
}

fn available(desired: i32) -> WorkloadState {
    WorkloadState {
        kind: DeploymentKind::Deployment,
        name: "kv-redis".to_string(),
        generation: 1,
        observed_generation: 1,
        spec_replicas: desired,
        replicas: desired,
        updated_replicas: desired,
        ready_replicas: desired,
        available_replicas: desired,
        rollout_completed: true,
        progress_deadline_exceeded: false,
        max_unavailable: 0,
    }
}

impl Sim {
    fn new(cb: CacheBackend) -> Self {
        Sim {
            cb,
            mem: Memory::default(),
            now: T0,
            settings: Settings::default(),
            workload: None,
            owned_workload_present: false,
            pods: Some(Vec::new()),
            replicas: Ok(Vec::new()),
            probe_enabled: false,
            probe_next: None,
            probes_run: 0,
        }
    }

    fn observed(&self) -> Observed {
        let mut o = Observed::new(self.cb.clone(), Timestamp::from_second(self.now).unwrap());
        o.workload = self.workload.clone();
        o.owned_workload_present = self.owned_workload_present;
        if let Some(r) = render::render(&self.cb).unwrap() {
            o.service_endpoint = render::service_endpoint(&r.service);
            o.server_selector = Some(r.selector.clone());
            o.server_containers = r.container_names.clone();
        }
        o.pods = self.pods.clone();
        o.index = self
            .replicas
            .clone()
            .map_err(ic_controller::reconcile::cachebackend::index_view::IndexUnavailable);
        o.backends = Some(vec![self.cb.clone()]);
        o.probe_enabled = self.probe_enabled;
        o
    }

    /// One reconcile: evaluate, run the probe when wanted, persist status and memory.
    fn step(&mut self) -> Evaluation {
        let obs = self.observed();
        let mut e = evaluate(&obs, &self.mem, &ProbeInput::NotRun, &self.settings);
        if e.probe_wanted {
            let out = self.probe_next.clone().unwrap_or_else(all_ok);
            self.probes_run += 1;
            self.mem.last_probe_at = Some(obs.now);
            e = evaluate(&obs, &self.mem, &ProbeInput::Ran(out), &self.settings);
        }
        if matches!(e.cascade, CascadeDecision::Fire(_)) {
            self.mem.last_cascade_at = Some(obs.now);
        }
        self.mem.last_path = Some(e.path.kind());
        self.cb.status = Some(e.status.clone());
        e
    }

    fn status(&self) -> CacheBackendStatus {
        self.cb.status.clone().unwrap_or_default()
    }

    fn advance(&mut self, secs: i64) {
        self.now += secs;
    }

    fn event_at(&mut self) {
        let ms = self.now * 1000;
        self.replicas = Ok(vec![replica("engine-0", 10, ms)]);
        let p = decided_pod("engine-0", &[("app", "vllm")]);
        self.pods = Some(vec![p]);
    }
}

/// An engine pod the Pod webhook decided on (its `injected-by` marker): counted in
/// `matchedEnginePods` (a pod without any marker is counted in `unwiredEnginePods`).
fn decided_pod(name: &str, labels: &[(&str, &str)]) -> Pod {
    pod(
        name,
        labels,
        &[("inferencecache.io/injected-by", "default/kv")],
    )
}

fn all_ok() -> ProbeOutcome {
    ProbeOutcome::Completed(ProbeStages {
        ingest: StageResult::Ok,
        routing: StageResult::Ok,
        t2: StageResult::Skipped,
    })
}

fn reasons(e: &Evaluation) -> Vec<String> {
    e.events.iter().map(|e| e.reason.clone()).collect()
}

fn spec_patch(cb: &mut CacheBackend, patch: serde_json::Value) {
    let mut v = serde_json::to_value(&cb.spec).unwrap();
    json_patch::merge(&mut v, &patch);
    cb.spec = serde_json::from_value(v).unwrap();
}

// ---------------------------------------------------------------- managed readiness

#[test]
fn managed_rollout_then_backend_ready_with_gate_off() {
    let cb = annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    );
    let mut s = Sim::new(cb);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "RolloutInProgress"));
    assert_eq!(
        sr(&e.status, "Progressing"),
        is("True", "RolloutInProgress")
    );
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
    assert_eq!(e.status.endpoint.as_deref(), Some("kv-redis.ml.svc:6379"));

    s.workload = Some(available(1));
    s.advance(10);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
    assert_eq!(sr(&e.status, "Progressing"), is("False", "Synced"));
    assert!(e.status.first_available_at.is_some());
    // First rollout is not a recovery.
    assert!(!reasons(&e).contains(&"BackendRecovered".to_string()));
}

#[test]
fn scaled_to_zero() {
    let mut cb = managed_redis("kv");
    spec_patch(&mut cb, json!({"replicas": 0}));
    let mut s = Sim::new(cb);
    s.workload = Some(WorkloadState {
        spec_replicas: 0,
        ..available(0)
    });
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "ScaledToZero"));
    assert_eq!(sr(&e.status, "Progressing"), is("False", "ScaledToZero"));
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
}

#[test]
fn replicas_unavailable_degrades_then_recovers_with_events() {
    let mut cb = annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    );
    spec_patch(&mut cb, json!({"replicas": 2}));
    let mut s = Sim::new(cb);
    s.workload = Some(available(2));
    s.step();
    s.workload = Some(WorkloadState {
        available_replicas: 1,
        ready_replicas: 1,
        ..available(2)
    });
    s.advance(30);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "ReplicasUnavailable"));
    assert_eq!(sr(&e.status, "Degraded"), is("True", "ReplicasUnavailable"));
    assert_eq!(
        sr(&e.status, "Progressing"),
        is("False", "ReplicasUnavailable")
    );
    assert_eq!(reasons(&e), vec!["BackendDegraded"]);
    assert_eq!(e.events[0].kind, EventKind::Warning);
    // Steady state: no repeat.
    s.advance(30);
    assert!(s.step().events.is_empty());

    s.workload = Some(available(2));
    s.advance(30);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
    assert_eq!(reasons(&e), vec!["BackendRecovered"]);
}

#[test]
fn available_follows_the_deployments_own_reading() {
    // A 4-replica RollingUpdate Deployment (default maxUnavailable 25 % = 1) with one pod
    // unready is Available to the Deployment controller, and so to us: no Degraded, no Event.
    let deployment = |available: i32, strategy: serde_json::Value| {
        let d: k8s_openapi::api::apps::v1::Deployment = serde_json::from_value(json!({
            "metadata": {"name": "kv-redis", "generation": 2},
            "spec": {"replicas": 4, "selector": {}, "template": {}, "strategy": strategy},
            "status": {"observedGeneration": 2, "replicas": 4, "updatedReplicas": 4,
                       "readyReplicas": available, "availableReplicas": available,
                       "conditions": [{"type": "Progressing", "status": "True",
                                       "reason": "NewReplicaSetAvailable"}]}
        }))
        .unwrap();
        WorkloadState::from_deployment(&d)
    };
    let mut cb = annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    );
    spec_patch(&mut cb, json!({"replicas": 4}));
    let mut s = Sim::new(cb);
    s.workload = Some(deployment(4, json!({"type": "RollingUpdate"})));
    s.step();
    s.workload = Some(deployment(3, json!({"type": "RollingUpdate"})));
    s.advance(30);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
    assert!(!reasons(&e).contains(&"BackendDegraded".to_string()));
    // Two down is past what the Deployment tolerates.
    s.workload = Some(deployment(2, json!({"type": "RollingUpdate"})));
    s.advance(30);
    let e = s.step();
    assert_eq!(sr(&e.status, "Degraded"), is("True", "ReplicasUnavailable"));
    // maxUnavailable 0, and Recreate, tolerate none.
    for strategy in [
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}}),
        json!({"type": "Recreate"}),
    ] {
        assert_eq!(deployment(3, strategy).max_unavailable, 0);
    }
    assert_eq!(
        deployment(
            3,
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "50%"}})
        )
        .max_unavailable,
        2
    );
}

#[test]
fn a_stuck_first_rollout_that_recovers_narrates_one_backend_recovered() {
    let cb = annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    );
    let mut s = Sim::new(cb);
    let mut all = Vec::new();
    // Rolling out, then stuck past its progress deadline (never Available before).
    s.workload = Some(WorkloadState {
        updated_replicas: 0,
        available_replicas: 0,
        ready_replicas: 0,
        rollout_completed: false,
        ..available(1)
    });
    all.extend(reasons(&s.step()));
    s.workload = Some(WorkloadState {
        updated_replicas: 0,
        available_replicas: 0,
        ready_replicas: 0,
        rollout_completed: false,
        progress_deadline_exceeded: true,
        ..available(1)
    });
    s.advance(30);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "ReplicasUnavailable"));
    all.extend(reasons(&e));
    for _ in 0..3 {
        s.workload = Some(available(1));
        s.advance(30);
        let e = s.step();
        assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
        all.extend(reasons(&e));
    }
    let count = |r: &str| all.iter().filter(|x| *x == r).count();
    assert_eq!(count("BackendDegraded"), 1, "{all:?}");
    assert_eq!(count("BackendRecovered"), 1, "{all:?}");
    // A plain first rollout becoming Ready narrates no recovery.
    let mut s = Sim::new(annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    ));
    s.workload = Some(WorkloadState {
        available_replicas: 0,
        rollout_completed: false,
        ..available(1)
    });
    s.step();
    s.workload = Some(available(1));
    assert!(!reasons(&s.step()).contains(&"BackendRecovered".to_string()));
}

#[test]
fn progress_deadline_exceeded_reads_replicas_unavailable() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(WorkloadState {
        updated_replicas: 0,
        available_replicas: 0,
        ready_replicas: 0,
        rollout_completed: false,
        progress_deadline_exceeded: true,
        ..available(1)
    });
    let e = s.step();
    assert_eq!(sr(&e.status, "Degraded"), is("True", "ReplicasUnavailable"));
}

#[test]
fn hpa_owned_replicas_are_compared_against_the_workload() {
    let mut cb = managed_redis("kv");
    spec_patch(
        &mut cb,
        json!({"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 5}}),
    );
    cb = annotate(cb, "inferencecache.io/require-kv-events", "false");
    let mut s = Sim::new(cb);
    // The HPA scaled the Deployment to 3; only 2 available → not ready although spec.replicas=1.
    s.workload = Some(WorkloadState {
        available_replicas: 2,
        ready_replicas: 2,
        ..available(3)
    });
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "ReplicasUnavailable"));
    s.workload = Some(available(3));
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
}

// ---------------------------------------------------------------- KV-event gate

#[test]
fn kv_gate_awaits_then_observes_first_event() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert_eq!(
        sr(&e.status, "Progressing"),
        is("True", "AwaitingFirstKVEvent")
    );
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
    assert_eq!(
        reasons(&e),
        vec!["EngineSelectorUnmatched", "AwaitingFirstKVEvent"]
    );
    assert!(e.requeue_after <= Duration::from_secs(30));

    s.advance(60);
    s.event_at();
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
    assert_eq!(sr(&e.status, "Progressing"), is("False", "Synced"));
    assert!(e.status.first_kv_event_observed_at.is_some());
    assert_eq!(reasons(&e), vec!["KVEventsObserved"]);
    let ip = e.status.index_participation.as_ref().unwrap();
    assert_eq!(ip.prefix_count, 10);
    assert!(ip.last_event_at.is_some());
}

#[test]
fn event_present_on_first_reconcile_counts() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.event_at();
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
    assert_eq!(reasons(&e), vec!["KVEventsObserved"]);
}

#[test]
fn no_event_within_timeout_degrades_and_sticks_through_a_flap() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.step();
    let anchor = s.status().first_available_at.clone();
    s.advance(301);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "NoKVEventsObserved"));
    assert_eq!(sr(&e.status, "Degraded"), is("True", "NoKVEventsObserved"));
    assert_eq!(
        sr(&e.status, "Progressing"),
        is("False", "NoKVEventsObserved")
    );
    // The NoKV flavour carries its own event, not BackendDegraded.
    assert_eq!(reasons(&e), vec!["NoKVEventsObserved"]);

    // Availability flap: replicas unavailable, then back.
    s.workload = Some(replicas_down(1));
    s.advance(10);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "ReplicasUnavailable"));
    s.workload = Some(available(1));
    s.advance(10);
    let e = s.step();
    // Anchor unchanged; the verdict does not bounce back to AwaitingFirstKVEvent.
    assert_eq!(e.status.first_available_at, anchor);
    assert_eq!(sr(&e.status, "Ready"), is("False", "NoKVEventsObserved"));

    // Raising the timeout does not un-stick it either; an event does.
    spec_patch(
        &mut s.cb,
        json!({"observation": {"firstEventTimeout": "1h"}}),
    );
    s.advance(10);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "NoKVEventsObserved"));
    s.event_at();
    s.advance(10);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
    // Recovery from NoKVEventsObserved is narrated by KVEventsObserved only.
    assert_eq!(reasons(&e), vec!["KVEventsObserved"]);
}

#[test]
fn availability_flap_does_not_restart_the_first_event_window() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.step();
    let anchor = s.status().first_available_at.clone().unwrap();
    s.advance(200);
    s.workload = Some(replicas_down(1));
    s.step();
    s.advance(50);
    s.workload = Some(available(1));
    let e = s.step();
    assert_eq!(e.status.first_available_at.as_ref(), Some(&anchor));
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
    // 200 + 50 + 51 > 300 s from the original anchor: timed out although the workload only
    // came back 51 s ago.
    s.advance(51);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "NoKVEventsObserved"));
}

#[test]
fn drained_backend_stays_ready_through_the_latch() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.event_at();
    s.step();
    // Replicas drain: the index no longer names them.
    s.replicas = Ok(Vec::new());
    s.advance(600);
    let e = s.step();
    let ip = e.status.index_participation.as_ref().unwrap();
    assert_eq!(
        ip.prefix_count, 0,
        "reset to 0 on a successful scrape with no replicas"
    );
    assert!(ip.last_event_at.is_none());
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
    assert!(e.events.is_empty());
}

#[test]
fn index_failure_keeps_participation_soft() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.event_at();
    let before = s.step().status.index_participation;
    s.replicas = Err("index lock poisoned".to_string());
    s.advance(30);
    let e = s.step();
    assert_eq!(e.status.index_participation, before);
}

#[test]
fn participation_unset_until_a_scrape_names_the_backend() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    let e = s.step();
    assert!(e.status.index_participation.is_none());
}

#[test]
fn attribution_prefers_injected_by_then_sorted_selector() {
    use ic_controller::reconcile::cachebackend::index_view::{owning_backend, participation};
    // Two backends with overlapping selectors: "a-first" wins the fallback by name.
    let a = backend(
        "a-first",
        json!({"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "vllm"}}}),
    );
    let b = backend(
        "b-second",
        json!({"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "vllm"}}}),
    );
    let empty = backend("0-empty", json!({"runtime": "VLLM"}));
    let plain = pod("p1", &[("app", "vllm")], &[]);
    let injected = pod(
        "p2",
        &[("app", "vllm")],
        &[("inferencecache.io/injected-by", "ml/b-second")],
    );
    let backends = vec![b.clone(), empty.clone(), a.clone()];
    assert_eq!(
        owning_backend(&plain, &backends).as_deref(),
        Some("a-first")
    );
    assert_eq!(
        owning_backend(&injected, &backends).as_deref(),
        Some("b-second")
    );
    let pods = vec![plain, injected];
    let replicas = Ok(vec![
        replica("p1", 3, 1_000),
        replica("p2#1", 4, 2_000),
        replica("gone", 100, 9_000),
    ]);
    let pa = participation(None, NS, "a-first", &replicas, Some(&pods), Some(&backends)).unwrap();
    assert_eq!(pa.prefix_count, 3);
    let pb = participation(
        None,
        NS,
        "b-second",
        &replicas,
        Some(&pods),
        Some(&backends),
    )
    .unwrap();
    assert_eq!(pb.prefix_count, 4);
    assert!(
        pb.inexact_replicas.is_empty(),
        "every replica Exact: no list"
    );
    // A replica that is not exact is named with its coverage and reason.
    let mut partial = replica("p2#1", 4, 2_000);
    partial.coverage = "Partial";
    partial.coverage_reason = Some("BootstrapIncomplete");
    let replicas2 = Ok(vec![replica("p1", 3, 1_000), partial]);
    let pb = participation(
        None,
        NS,
        "b-second",
        &replicas2,
        Some(&pods),
        Some(&backends),
    )
    .unwrap();
    assert_eq!(
        pb.inexact_replicas,
        vec![ic_shared::crd::ReplicaCoverage {
            replica: "p2#1".into(),
            coverage: "Partial".into(),
            reason: Some("BootstrapIncomplete".into()),
        }]
    );
    let json = serde_json::to_value(&pb).unwrap();
    assert_eq!(json["inexactReplicas"][0]["coverage"], "Partial");
    // A selector-less backend claims nothing by vacuous truth.
    assert!(participation(None, NS, "0-empty", &replicas, Some(&pods), Some(&backends)).is_none());
}

#[test]
fn gate_opt_out_annotation() {
    let cb = annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    );
    let mut s = Sim::new(cb);
    s.workload = Some(available(1));
    s.advance(1000);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
}

// ---------------------------------------------------------------- host-only, events-only

#[test]
fn host_only_base_reason_and_gate() {
    let mut s = Sim::new(annotate(
        host_only("h"),
        "inferencecache.io/require-kv-events",
        "false",
    ));
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("True", "HostOnlyActive"));
    assert!(e.status.endpoint.is_none());

    let mut s = Sim::new(host_only("h"));
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert!(
        e.status.first_available_at.is_some(),
        "anchored on the first reconcile"
    );
    assert!(sr(&e.status, "FunctionalProbeOK").is_none());
}

#[test]
fn events_only_latches_at_first_reconcile_and_publishes_three_conditions() {
    let mut s = Sim::new(events_only("e"));
    s.probe_enabled = true;
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert!(e.status.first_available_at.is_some());
    assert!(e.status.endpoint.is_none());
    let types: Vec<&str> = e
        .status
        .conditions
        .iter()
        .map(|c| c.type_.as_str())
        .collect();
    assert_eq!(types.len(), 3, "{types:?}");

    let mut s = Sim::new(annotate(
        events_only("e"),
        "inferencecache.io/require-kv-events",
        "false",
    ));
    assert_eq!(
        sr(&s.step().status, "Ready"),
        is("True", "EventsOnlyActive")
    );
}

#[test]
fn offload_to_events_only_reanchors_bypasses_sticky_and_clears_advisories() {
    let mut s = Sim::new(managed_redis("kv"));
    s.probe_enabled = true;
    s.workload = Some(available(1));
    s.step();
    s.advance(400);
    let e = s.step();
    assert_eq!(sr(&e.status, "Degraded"), is("True", "NoKVEventsObserved"));
    let old_anchor = e.status.first_available_at.clone();

    // Flip to EventsOnly.
    spec_patch(
        &mut s.cb,
        json!({"integration": {"mode": "EventsOnly"}, "remoteStorage": null}),
    );
    s.workload = None;
    s.owned_workload_present = true;
    s.advance(5);
    let e = s.step();
    assert_ne!(
        e.status.first_available_at, old_anchor,
        "re-anchored to the flip"
    );
    assert_eq!(
        e.status.first_available_at.as_ref().unwrap().0.as_second(),
        s.now
    );
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert_eq!(sr(&e.status, "Degraded"), is("False", "NotDegraded"));
    assert!(e.status.endpoint.is_none());
    assert!(e.status.observed_server_instance.is_none());
    for t in [
        "FunctionalProbeOK",
        "EngineKernelsHealthy",
        "T2Degraded",
        "EngineCompatibility",
    ] {
        assert!(sr(&e.status, t).is_none(), "{t} cleared");
    }
    assert_eq!(s.mem.last_path, Some(PathKind::EventsOnly));
}

#[test]
fn offload_to_events_only_is_recognised_after_a_restart() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.step();
    s.advance(400);
    s.step();
    spec_patch(
        &mut s.cb,
        json!({"integration": {"mode": "EventsOnly"}, "remoteStorage": null}),
    );
    // Controller restarted: no memory, but the old workload is still there to be shed.
    s.mem = Memory::default();
    s.workload = None;
    s.owned_workload_present = true;
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
}

/// Runs `before` steps, flips the spec, then one step — once with this process's memory,
/// once as a new leader with none (and no leftover workload to hint at the flip): both must
/// reach the same status.
fn flip_across_failover(
    start: CacheBackend,
    flip: serde_json::Value,
    workload_after: Option<WorkloadState>,
) -> (CacheBackendStatus, CacheBackendStatus) {
    let run = |failover: bool| {
        let mut s = Sim::new(start.clone());
        s.workload = Some(available(1));
        s.step();
        s.advance(400);
        s.step();
        spec_patch(&mut s.cb, flip.clone());
        s.workload = workload_after.clone();
        s.owned_workload_present = false;
        if failover {
            s.mem = Memory::default();
        }
        s.advance(5);
        s.step().status
    };
    (run(false), run(true))
}

fn conditions_of(st: &CacheBackendStatus) -> Vec<(String, String, String)> {
    let mut v: Vec<_> = st
        .conditions
        .iter()
        .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
        .collect();
    v.sort();
    v
}

#[test]
fn both_mode_flips_reach_the_same_conditions_after_a_failover() {
    // Managed (Offload, timed out: Degraded/NoKVEventsObserved) → EventsOnly.
    let (kept, failed_over) = flip_across_failover(
        managed_redis("kv"),
        json!({"integration": {"mode": "EventsOnly"}, "remoteStorage": null}),
        None,
    );
    assert_eq!(conditions_of(&kept), conditions_of(&failed_over));
    assert_eq!(kept.first_available_at, failed_over.first_available_at);
    assert_eq!(
        sr(&failed_over, "Ready"),
        is("False", "AwaitingFirstKVEvent")
    );
    assert_eq!(failed_over.observed_path.as_deref(), Some("EventsOnly"));
    // EventsOnly → Offload (managed Redis): the anchor waits for the new workload.
    let (kept, failed_over) = flip_across_failover(
        events_only("kv"),
        json!({"integration": {"mode": "Offload"},
               "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
        Some(WorkloadState {
            available_replicas: 0,
            ready_replicas: 0,
            rollout_completed: false,
            ..available(1)
        }),
    );
    assert_eq!(conditions_of(&kept), conditions_of(&failed_over));
    assert_eq!(kept.first_available_at, failed_over.first_available_at);
    assert!(
        failed_over.first_available_at.is_none(),
        "re-anchored on the new workload"
    );
    assert_eq!(failed_over.observed_path.as_deref(), Some("Managed"));
}

#[test]
fn unmanaged_transition_clears_the_anchor_and_keeps_the_kv_latch() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.event_at();
    s.step();
    let latch = s.status().first_kv_event_observed_at.clone();
    assert!(latch.is_some());
    spec_patch(
        &mut s.cb,
        json!({"remoteStorage": {"ownership": "External", "endpoint": "redis.ext:6379"}}),
    );
    let e = s.step();
    assert!(e.status.first_available_at.is_none());
    assert_eq!(e.status.first_kv_event_observed_at, latch);
    assert!(e.status.observed_server_instance.is_none());
    assert_eq!(
        sr(&e.status, "Ready"),
        is("True", "ExternalEndpointAccepted")
    );
}

// ---------------------------------------------------------------- External

#[test]
fn external_conditions_mirror_the_endpoint_check() {
    let mut s = Sim::new(external("x", "LMCacheServer", " lm://cache.ext:65432 "));
    let e = s.step();
    assert_eq!(
        sr(&e.status, "Ready"),
        is("True", "ExternalEndpointAccepted")
    );
    assert_eq!(
        sr(&e.status, "Progressing"),
        is("False", "ExternalEndpointAccepted")
    );
    assert!(
        sr(&e.status, "Degraded").is_none(),
        "External publishes Ready + Progressing only"
    );
    assert_eq!(e.status.endpoint.as_deref(), Some("lm://cache.ext:65432"));

    let mut s = Sim::new(external("x", "Redis", "   "));
    let e = s.step();
    assert_eq!(
        sr(&e.status, "Ready"),
        is("False", "ExternalEndpointMissing")
    );
    assert_eq!(
        sr(&e.status, "Progressing"),
        is("False", "ExternalEndpointMissing")
    );
    assert!(e.status.endpoint.is_none());

    let mut s = Sim::new(external("x", "Redis", "redis://r:6379"));
    let e = s.step();
    assert_eq!(
        sr(&e.status, "Ready"),
        is("False", "ExternalEndpointInvalid")
    );
    let msg = &cond(&e.status, "Ready").unwrap().message;
    assert!(msg.contains("spec.remoteStorage.endpoint"), "{msg}");
}

#[test]
fn external_is_exempt_from_the_kv_gate() {
    let mut s = Sim::new(external("x", "Redis", "r:6379"));
    s.advance(10_000);
    let e = s.step();
    assert_eq!(
        sr(&e.status, "Ready"),
        is("True", "ExternalEndpointAccepted")
    );
    assert!(e.status.first_available_at.is_none());
}

// ---------------------------------------------------------------- functional probe

fn failed(stage: &str) -> ProbeOutcome {
    let f = |s: &str| {
        if s == stage {
            StageResult::Failed(format!("{s} broken"))
        } else {
            StageResult::Ok
        }
    };
    ProbeOutcome::Completed(ProbeStages {
        ingest: f("ingest"),
        routing: f("routing"),
        t2: f("t2"),
    })
}

fn probing_sim() -> Sim {
    let mut s = Sim::new(managed_redis("kv"));
    s.probe_enabled = true;
    s.workload = Some(available(1));
    s.event_at();
    s
}

#[test]
fn probe_ok() {
    let mut s = probing_sim();
    let e = s.step();
    assert_eq!(sr(&e.status, "FunctionalProbeOK"), is("True", "ProbeOK"));
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
    assert_eq!(s.probes_run, 1);
}

#[test]
fn probe_stage_failures_downgrade_ready() {
    for (stage, reason) in [
        ("ingest", "ProbeIngestFailed"),
        ("routing", "ProbeRoutingFailed"),
        ("t2", "ProbeT2Failed"),
    ] {
        let mut s = probing_sim();
        s.probe_next = Some(failed(stage));
        let e = s.step();
        assert_eq!(sr(&e.status, "FunctionalProbeOK"), is("False", reason));
        assert_eq!(sr(&e.status, "Ready"), is("False", reason));
        assert_eq!(
            sr(&e.status, "Degraded"),
            is("False", "NotDegraded"),
            "the probe never drives Degraded"
        );
        assert!(cond(&e.status, "FunctionalProbeOK")
            .unwrap()
            .message
            .contains(&format!("{stage} broken")));
    }
}

#[test]
fn probe_transport_error_without_prior_failure_is_unknown() {
    let mut s = probing_sim();
    s.probe_next = Some(ProbeOutcome::TransportError(
        "connection refused".to_string(),
    ));
    let e = s.step();
    assert_eq!(
        sr(&e.status, "FunctionalProbeOK"),
        is("Unknown", "ProbeError")
    );
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
}

#[test]
fn probe_transport_error_keeps_a_prior_stage_failure() {
    let mut s = probing_sim();
    s.probe_next = Some(failed("routing"));
    s.step();
    s.probe_next = Some(ProbeOutcome::TransportError("503".to_string()));
    s.advance(31);
    let e = s.step();
    assert_eq!(s.probes_run, 2);
    assert_eq!(
        sr(&e.status, "FunctionalProbeOK"),
        is("False", "ProbeRoutingFailed")
    );
    assert_eq!(sr(&e.status, "Ready"), is("False", "ProbeRoutingFailed"));
    // Only a successful probe resolves it.
    s.probe_next = Some(all_ok());
    s.advance(31);
    let e = s.step();
    assert_eq!(sr(&e.status, "FunctionalProbeOK"), is("True", "ProbeOK"));
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
}

#[test]
fn probe_is_rate_limited_and_reapplies_a_known_failure() {
    let mut s = probing_sim();
    s.probe_next = Some(failed("ingest"));
    s.step();
    s.advance(10);
    let e = s.step();
    assert_eq!(s.probes_run, 1, "no second call inside the window");
    assert_eq!(sr(&e.status, "Ready"), is("False", "ProbeIngestFailed"));
    assert_eq!(
        e.requeue_after,
        Duration::from_secs(20),
        "requeue at window expiry"
    );
}

/// `desired` replicas, rolled out, none of them available.
fn replicas_down(desired: i32) -> WorkloadState {
    WorkloadState {
        available_replicas: 0,
        ready_replicas: 0,
        ..available(desired)
    }
}

/// A backend whose replicas go away after a good probe: the gate stops probing, so the old
/// True/ProbeOK is not left standing for the outage; the first reconcile after recovery probes
/// at once (inside the rate-limit window) instead of showing the pause until it expires.
#[test]
fn an_earlier_probe_ok_is_not_vouched_for_while_upstream_is_not_ready() {
    let mut s = probing_sim();
    s.step();
    assert_eq!(sr(&s.status(), "FunctionalProbeOK"), is("True", "ProbeOK"));
    s.workload = Some(replicas_down(1));
    s.advance(5);
    let e = s.step();
    assert_eq!(sr(&e.status, "Ready"), is("False", "ReplicasUnavailable"));
    assert_eq!(
        sr(&e.status, "FunctionalProbeOK"),
        is("Unknown", "ProbeAwaitingReady")
    );
    let msg = e
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "FunctionalProbeOK")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(msg.contains("False/ReplicasUnavailable"), "{msg}");
    assert_eq!(s.probes_run, 1);
    s.workload = Some(available(1));
    s.advance(5);
    let e = s.step();
    assert_eq!(s.probes_run, 2, "recovery probes inside the window");
    assert_eq!(sr(&e.status, "FunctionalProbeOK"), is("True", "ProbeOK"));
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
}

/// A stage failure stays False through an upstream outage (sticky), and still holds Ready down
/// when the upstream recovers inside the window, until a probe passes.
#[test]
fn a_probe_stage_failure_stays_false_while_upstream_is_not_ready() {
    let mut s = probing_sim();
    s.probe_next = Some(failed("routing"));
    s.step();
    s.workload = Some(replicas_down(1));
    s.advance(5);
    let e = s.step();
    assert_eq!(
        sr(&e.status, "FunctionalProbeOK"),
        is("False", "ProbeRoutingFailed")
    );
    s.workload = Some(available(1));
    s.advance(5);
    let e = s.step();
    assert_eq!(
        s.probes_run, 1,
        "rate-limited: the known failure is re-applied"
    );
    assert_eq!(sr(&e.status, "Ready"), is("False", "ProbeRoutingFailed"));
    s.probe_next = Some(all_ok());
    s.advance(31);
    let e = s.step();
    assert_eq!(sr(&e.status, "FunctionalProbeOK"), is("True", "ProbeOK"));
}

#[test]
fn probe_waits_for_the_upstream_gates() {
    let mut s = Sim::new(managed_redis("kv"));
    s.probe_enabled = true;
    s.workload = Some(available(1));
    let e = s.step();
    assert_eq!(s.probes_run, 0);
    assert_eq!(sr(&e.status, "Ready"), is("False", "AwaitingFirstKVEvent"));
    assert!(sr(&e.status, "FunctionalProbeOK").is_none());
}

#[test]
fn probe_bypassed_by_annotation() {
    let mut s = probing_sim();
    s.cb = annotate(
        s.cb.clone(),
        "inferencecache.io/skip-functional-probe",
        "true",
    );
    s.probe_next = Some(failed("ingest"));
    let e = s.step();
    assert_eq!(s.probes_run, 0);
    assert_eq!(
        sr(&e.status, "FunctionalProbeOK"),
        is("True", "ProbeBypassed")
    );
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
}

#[test]
fn probe_gate_off_clears_a_stale_condition() {
    let mut s = probing_sim();
    s.probe_next = Some(failed("ingest"));
    s.step();
    s.probe_enabled = false;
    let e = s.step();
    assert!(sr(&e.status, "FunctionalProbeOK").is_none());
    assert_eq!(sr(&e.status, "Ready"), is("True", "KVEventsObserved"));
}

// ---------------------------------------------------------------- engine-side advisories

/// A site directory for the adapter's kernel-check program: with `healthy`, an `lmcache`
/// package holding a real compiled `c_ops` CPython extension (built here with gcc against the
/// interpreter's own headers) and a stand-in `torch`; without, no `lmcache` at all.
fn kernel_site(healthy: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    if !healthy {
        return dir;
    }
    let pkg = dir.path().join("lmcache");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), "").unwrap();
    std::fs::write(dir.path().join("torch.py"), "").unwrap();
    let src = dir.path().join("c_ops.c");
    std::fs::write(
        &src,
        "#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"c_ops\", NULL, -1, NULL};\nPyMODINIT_FUNC PyInit_c_ops(void) { return PyModule_Create(&m); }\n",
    )
    .unwrap();
    let q = |expr: &str| {
        let o = std::process::Command::new("python3")
            .args(["-c", &format!("import sysconfig; print({expr})")])
            .output()
            .expect("python3");
        String::from_utf8(o.stdout).unwrap().trim().to_string()
    };
    let include = q("sysconfig.get_paths()['include']");
    let suffix = q("sysconfig.get_config_var('EXT_SUFFIX')");
    let st = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-I", &include, "-o"])
        .arg(pkg.join(format!("c_ops{suffix}")))
        .arg(&src)
        .status()
        .expect("cc");
    assert!(
        st.success(),
        "building the stand-in c_ops extension (needs Python.h in {include})"
    );
    dir
}

/// Runs the wired pod's `lmcache-kernel-check` container as the kubelet would — its own
/// command and env — with `site` on PYTHONPATH; returns its exit code and the termination
/// message it left at its env's termination-log path (redirected to a temporary file).
fn run_kernel_check(pod: &Pod, site: &std::path::Path) -> (i32, String) {
    let c = pod
        .spec
        .as_ref()
        .unwrap()
        .init_containers
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.name == "lmcache-kernel-check")
        .unwrap();
    let cmd = c.command.clone().unwrap();
    assert_eq!(cmd[1], "-c", "{cmd:?}");
    let log = site.join("termination-log");
    let mut run = std::process::Command::new("python3");
    run.args(&cmd[1..]);
    let mut saw_log_env = false;
    for e in c.env.iter().flatten() {
        if let Some(v) = &e.value {
            if e.name == "INFERENCECACHE_TERMINATION_LOG" {
                assert_eq!(Some(v.as_str()), c.termination_message_path.as_deref());
                saw_log_env = true;
                run.env(&e.name, &log);
            } else {
                run.env(&e.name, v);
            }
        }
    }
    assert!(
        saw_log_env,
        "the program is told the container's terminationMessagePath"
    );
    let out = run.env("PYTHONPATH", site).output().expect("python3 runs");
    let msg = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(msg.trim(), String::from_utf8_lossy(&out.stdout).trim());
    (out.status.code().unwrap_or(-1), msg)
}

fn kernel_sim(pod: Pod) -> Evaluation {
    let mut s = Sim::new(annotate(
        managed_redis("kv"),
        "inferencecache.io/require-kv-events",
        "false",
    ));
    s.workload = Some(available(1));
    s.pods = Some(vec![pod]);
    s.step()
}

#[test]
fn the_adapters_own_kernel_check_output_sets_engine_kernels_healthy() {
    // report-only: the program always exits 0; its JSON verdict is the result.
    for (healthy, status, reason) in [
        (true, "True", "KernelsHealthy"),
        (false, "False", "KernelLoadFailed"),
    ] {
        let wired = wired_for_kernel_check(pod("engine-0", &[("app", "vllm")], &[]), "report-only");
        let site = kernel_site(healthy);
        let (code, msg) = run_kernel_check(&wired, site.path());
        assert_eq!(code, 0, "{msg}");
        let e = kernel_sim(with_kernel_check_state(
            wired,
            json!({"terminated": {"exitCode": code, "message": msg}}),
        ));
        assert_eq!(
            sr(&e.status, "EngineKernelsHealthy"),
            is(status, reason),
            "{msg}"
        );
        // Report-only never downgrades Ready.
        assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
        if !healthy {
            let m = &cond(&e.status, "EngineKernelsHealthy").unwrap().message;
            assert!(m.contains("lmcache is not importable"), "{m}");
        }
    }
    // No message (logs lost) from a report-only check: not a verdict.
    let wired = wired_for_kernel_check(pod("engine-0", &[("app", "vllm")], &[]), "report-only");
    let e = kernel_sim(with_kernel_check_state(
        wired.clone(),
        json!({"terminated": {"exitCode": 0, "message": ""}}),
    ));
    assert_eq!(
        sr(&e.status, "EngineKernelsHealthy"),
        is("Unknown", "KernelCheckError")
    );
    let e = kernel_sim(with_kernel_check_state(wired, json!({"running": {}})));
    assert_eq!(
        sr(&e.status, "EngineKernelsHealthy"),
        is("Unknown", "KernelCheckPending")
    );
}

#[test]
fn a_strict_kernel_failure_downgrades_ready_from_the_adapters_env_alone() {
    let wired = wired_for_kernel_check(pod("engine-0", &[("app", "vllm")], &[]), "strict");
    // The pod carries no mode annotation: strictness is the env the adapter rendered.
    assert!(!wired
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("inferencecache.io/lmcache-kernel-check")));
    let site = kernel_site(false);
    let (code, msg) = run_kernel_check(&wired, site.path());
    assert_eq!(code, 1, "strict exits non-zero on failure: {msg}");
    // The init container restarts: the failure is in lastState.
    let mut p = with_kernel_check_state(
        wired.clone(),
        json!({"waiting": {"reason": "CrashLoopBackOff"}}),
    );
    let mut st = serde_json::to_value(p.status.take().unwrap()).unwrap();
    st["initContainerStatuses"][0]["lastState"] =
        json!({"terminated": {"exitCode": code, "message": msg}});
    p.status = Some(serde_json::from_value(st).unwrap());
    let e = kernel_sim(p);
    assert_eq!(
        sr(&e.status, "EngineKernelsHealthy"),
        is("False", "KernelLoadFailed")
    );
    assert_eq!(sr(&e.status, "Ready"), is("False", "EngineKernelDegraded"));
    // Strict success: exit 0, Healthy, Ready untouched.
    let site = kernel_site(true);
    let (code, msg) = run_kernel_check(&wired, site.path());
    assert_eq!(code, 0, "{msg}");
    let e = kernel_sim(with_kernel_check_state(
        wired,
        json!({"terminated": {"exitCode": code, "message": msg}}),
    ));
    assert_eq!(
        sr(&e.status, "EngineKernelsHealthy"),
        is("True", "KernelsHealthy")
    );
    assert_eq!(sr(&e.status, "Ready"), is("True", "BackendReady"));
}

#[test]
fn no_kernel_check_means_no_condition() {
    let mut s = Sim::new(host_only("h"));
    s.pods = Some(vec![pod("engine-0", &[("app", "vllm")], &[])]);
    let e = s.step();
    assert!(sr(&e.status, "EngineKernelsHealthy").is_none());
}

#[test]
fn t2_degraded_follows_the_hit_rate_and_is_absent_until_exercised() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.event_at();
    let e = s.step();
    assert!(sr(&e.status, "T2Degraded").is_none());

    let mut r = replica("engine-0", 10, T0 * 1000);
    r.t2_queries = Some(100);
    r.t2_hits = Some(0);
    s.replicas = Ok(vec![r.clone()]);
    let e = s.step();
    assert_eq!(
        e.status
            .index_participation
            .as_ref()
            .unwrap()
            .t2_hit_rate
            .as_deref(),
        Some("0")
    );
    assert_eq!(sr(&e.status, "T2Degraded"), is("True", "T2ZeroHitRate"));
    assert_eq!(
        sr(&e.status, "Ready"),
        is("True", "KVEventsObserved"),
        "never gates Ready"
    );

    r.t2_hits = Some(25);
    s.replicas = Ok(vec![r]);
    let e = s.step();
    assert_eq!(
        e.status
            .index_participation
            .as_ref()
            .unwrap()
            .t2_hit_rate
            .as_deref(),
        Some("0.25")
    );
    assert_eq!(sr(&e.status, "T2Degraded"), is("False", "T2Serving"));

    // One reload in 30 000 queries is a tier that serves, not a dead one.
    let mut r = replica("engine-0", 10, T0 * 1000);
    r.t2_queries = Some(30_000);
    r.t2_hits = Some(1);
    s.replicas = Ok(vec![r]);
    let e = s.step();
    let rate = e
        .status
        .index_participation
        .as_ref()
        .unwrap()
        .t2_hit_rate
        .clone();
    assert_eq!(rate.as_deref(), Some("0.0000333"));
    assert_eq!(sr(&e.status, "T2Degraded"), is("False", "T2Serving"));
}

#[test]
fn injected_engine_crash_loop_sets_engine_compatibility_once() {
    let cb = managed_redis("kv");
    let mut s = Sim::new(cb.clone());
    s.workload = Some(available(1));
    s.pods = Some(vec![crash_looping(injected_engine(
        "engine-0", &cb, "vllm",
    ))]);
    let e = s.step();
    assert_eq!(
        sr(&e.status, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
    assert!(reasons(&e).contains(&"InjectedEngineCrashLooping".to_string()));
    let e = s.step();
    assert!(!reasons(&e).contains(&"InjectedEngineCrashLooping".to_string()));
    // A failed pod list keeps the verdict without re-firing.
    s.pods = None;
    let e = s.step();
    assert_eq!(
        sr(&e.status, "EngineCompatibility"),
        is("False", "InjectedEngineCrashLooping")
    );
    assert!(e.events.is_empty());
    // Healthy again: the condition goes away.
    s.pods = Some(vec![injected_engine("engine-0", &cb, "vllm")]);
    let e = s.step();
    assert!(sr(&e.status, "EngineCompatibility").is_none());
}

#[test]
fn crash_loop_of_a_forged_injection_is_ignored() {
    let cb = managed_redis("kv");
    let mut forged = crash_looping(injected_engine("engine-0", &cb, "vllm"));
    forged.metadata.annotations.as_mut().unwrap().insert(
        "inferencecache.io/injected-by-uid".to_string(),
        "other".to_string(),
    );
    let mut s = Sim::new(cb);
    s.workload = Some(available(1));
    s.pods = Some(vec![forged]);
    assert!(sr(&s.step().status, "EngineCompatibility").is_none());
}

// ---------------------------------------------------------------- selector, failOpen

#[test]
fn matched_engine_pods_and_selector_message() {
    let mut s = Sim::new(host_only("h"));
    // Initial observation of zero → message + event.
    let e = s.step();
    assert_eq!(e.status.matched_engine_pods, Some(0));
    let msg = e.status.engine_selector_message.clone().unwrap();
    assert!(
        msg.contains("spec.engineSelector.matchLabels={app=vllm}"),
        "{msg}"
    );
    assert_eq!(
        reasons(&e)
            .iter()
            .filter(|r| *r == "EngineSelectorUnmatched")
            .count(),
        1
    );
    // Steady zero: no repeat.
    let e = s.step();
    assert!(!reasons(&e).contains(&"EngineSelectorUnmatched".to_string()));
    // Matched → cleared.
    s.pods = Some(vec![decided_pod("engine-0", &[("app", "vllm")])]);
    let e = s.step();
    assert_eq!(e.status.matched_engine_pods, Some(1));
    assert!(e.status.engine_selector_message.is_none());
    // Matched → zero: event again.
    s.pods = Some(vec![]);
    let e = s.step();
    assert!(reasons(&e).contains(&"EngineSelectorUnmatched".to_string()));
    // Upgrade from an older zero-count status without the message: event.
    let mut st = s.status();
    st.engine_selector_message = None;
    s.cb.status = Some(st);
    let e = s.step();
    assert!(reasons(&e).contains(&"EngineSelectorUnmatched".to_string()));
    // Selector removed → nil, message cleared.
    spec_patch(&mut s.cb, json!({"engineSelector": null}));
    let e = s.step();
    assert_eq!(e.status.matched_engine_pods, None);
    assert!(e.status.engine_selector_message.is_none());
    // Empty matchLabels is no-claim too.
    spec_patch(&mut s.cb, json!({"engineSelector": {"matchLabels": {}}}));
    assert_eq!(s.step().status.matched_engine_pods, None);
}

/// A failed pod list keeps the last count only for the spec it was taken under: after a spec
/// edit (a new selector) the count is unset and the message says none is known yet, rather
/// than the old selector's count and message under the new observedGeneration.
#[test]
fn a_failed_pod_list_after_a_spec_change_does_not_show_the_old_selectors_count() {
    let mut s = Sim::new(host_only("h"));
    s.cb.metadata.generation = Some(1);
    s.pods = Some(vec![decided_pod("engine-0", &[("app", "vllm")])]);
    assert_eq!(s.step().status.matched_engine_pods, Some(1));
    // Same spec, list fails: the last count stands.
    s.pods = None;
    let e = s.step();
    assert_eq!(e.status.matched_engine_pods, Some(1));
    assert!(e.status.engine_selector_message.is_none());
    // A new selector, and the list still fails.
    spec_patch(
        &mut s.cb,
        json!({"engineSelector": {"matchLabels": {"app": "sglang"}}}),
    );
    s.cb.metadata.generation = Some(2);
    let e = s.step();
    assert_eq!(e.status.observed_generation, Some(2));
    assert_eq!(e.status.matched_engine_pods, None);
    let msg = e.status.engine_selector_message.clone().unwrap_or_default();
    assert!(msg.contains("could not be listed"), "{msg}");
    assert!(!msg.contains("app=vllm"), "{msg}");
    // The list works again: the new selector's count.
    s.pods = Some(vec![decided_pod("engine-1", &[("app", "sglang")])]);
    let e = s.step();
    assert_eq!(e.status.matched_engine_pods, Some(1));
    assert!(e.status.engine_selector_message.is_none());
}

#[test]
fn scaled_to_zero_engines_expect_no_pods_and_churn_requeues_fast() {
    use k8s_openapi::api::apps::v1::Deployment;
    let cb = host_only("h");
    let obs_with = |deploys: Vec<Deployment>, pods: Vec<Pod>| {
        let mut o = Observed::new(cb.clone(), Timestamp::from_second(T0).unwrap());
        o.deployments = Some(deploys);
        o.pods = Some(pods);
        o
    };
    let e = evaluate(
        &obs_with(
            vec![engine_deployment("vllm", &[("app", "vllm")], 0)],
            vec![],
        ),
        &Memory::default(),
        &ProbeInput::NotRun,
        &Settings::default(),
    );
    assert_eq!(e.status.matched_engine_pods, Some(0));
    assert!(e.status.engine_selector_message.is_none());
    assert!(!e
        .events
        .iter()
        .any(|x| x.reason == "EngineSelectorUnmatched"));

    let e = evaluate(
        &obs_with(
            vec![engine_deployment("vllm", &[("app", "vllm")], 2)],
            vec![pod("vllm-1", &[("app", "vllm")], &[])],
        ),
        &Memory::default(),
        &ProbeInput::NotRun,
        &Settings::default(),
    );
    assert_eq!(
        e.requeue_after,
        Duration::from_secs(5),
        "pods ≠ desired replicas"
    );

    let e = evaluate(
        &obs_with(
            vec![engine_deployment("vllm", &[("app", "vllm")], 1)],
            vec![pod("vllm-1", &[("app", "vllm")], &[])],
        ),
        &Memory::default(),
        &ProbeInput::NotRun,
        &Settings::default(),
    );
    assert!(e.requeue_after > Duration::from_secs(5));
}

#[test]
fn fail_open_events_on_transitions_only() {
    let mut cb = host_only("h");
    spec_patch(&mut cb, json!({"integration": {"failOpen": false}}));
    let mut s = Sim::new(cb);
    let e = s.step();
    assert_eq!(e.status.fail_open, Some(false));
    let ev = e
        .events
        .iter()
        .find(|x| x.reason == "FailClosedEnabled")
        .unwrap();
    assert_eq!(ev.kind, EventKind::Warning);
    assert!(!reasons(&s.step()).contains(&"FailClosedEnabled".to_string()));
    spec_patch(&mut s.cb, json!({"integration": {"failOpen": true}}));
    let e = s.step();
    assert_eq!(e.status.fail_open, Some(true));
    assert!(reasons(&e).contains(&"FailOpenRestored".to_string()));
    assert!(!reasons(&s.step()).contains(&"FailOpenRestored".to_string()));
}

// ---------------------------------------------------------------- transitions, generation

#[test]
fn last_transition_time_moves_only_on_status_changes() {
    let mut s = Sim::new(managed_redis("kv"));
    let e = s.step();
    let t_rollout = cond(&e.status, "Ready")
        .unwrap()
        .last_transition_time
        .clone();
    s.advance(20);
    s.workload = Some(available(1));
    let e = s.step();
    // RolloutInProgress → AwaitingFirstKVEvent: both False, time kept.
    let ready = cond(&e.status, "Ready").unwrap();
    assert_eq!(ready.reason, "AwaitingFirstKVEvent");
    assert_eq!(ready.last_transition_time, t_rollout);
    s.advance(20);
    s.event_at();
    let e = s.step();
    let ready = cond(&e.status, "Ready").unwrap();
    assert_eq!(ready.status, "True");
    assert_eq!(ready.last_transition_time.0.as_second(), s.now);
    // Steady: unchanged status → identical conditions.
    let before = e.status.conditions.clone();
    s.advance(20);
    assert_eq!(s.step().status.conditions, before);
}

#[test]
fn observed_generation_and_fail_open_echo() {
    let mut cb = host_only("h");
    cb.metadata.generation = Some(7);
    let mut s = Sim::new(cb);
    let e = s.step();
    assert_eq!(e.status.observed_generation, Some(7));
    assert_eq!(e.status.fail_open, Some(true));
    assert!(e
        .status
        .conditions
        .iter()
        .all(|c| c.observed_generation == Some(7)));
}

#[test]
fn other_writers_conditions_are_kept() {
    let mut cb = host_only("h");
    cb.status = Some(CacheBackendStatus {
        conditions: vec![ic_shared::crd::new_condition(
            "NodeHealthy",
            ic_shared::crd::ConditionStatus::False,
            "CheckFailed",
            "node-1: shm",
            None,
            ic_controller::reconcile::clock::to_time(Timestamp::from_second(T0).unwrap()),
        )],
        ..Default::default()
    });
    let mut s = Sim::new(cb);
    let e = s.step();
    assert_eq!(sr(&e.status, "NodeHealthy"), is("False", "CheckFailed"));
}

#[test]
fn hicache_publishes_no_readiness_conditions() {
    let cb = backend(
        "hc",
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2.0"},
               "engineSelector": {"matchLabels": {"app": "sglang"}}}),
    );
    let mut s = Sim::new(cb);
    let e = s.step();
    // Only the advisory host-tier condition (issue 19 item 4), never a readiness one: no pod,
    // no signal.
    let types: Vec<&str> = e
        .status
        .conditions
        .iter()
        .map(|c| c.type_.as_str())
        .collect();
    assert_eq!(types, ["HiCacheHostTier"]);
    assert_eq!(
        sr(&e.status, "HiCacheHostTier"),
        is("Unknown", "HostTierSignalUnavailable")
    );
    assert!(
        e.events.iter().all(|ev| !ev.reason.contains("HostTier")),
        "{:?}",
        e.events
    );
    assert!(e.status.first_available_at.is_none());
    assert_eq!(e.status.matched_engine_pods, Some(0));
}

// ---------------------------------------------------------------- cascade (pure)

#[test]
fn server_instance_baseline_excludes_sidecar_restarts() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.pods = Some(vec![server_pod("kv-redis-a", "u1", "kv", "redis", 2)]);
    let e = s.step();
    assert_eq!(e.status.observed_server_instance.as_deref(), Some("u1:2"));
    assert!(matches!(e.cascade, CascadeDecision::Baseline(_)));
    // Sidecar restart counts (istio-proxy: 7) are not in the sum.
}

#[test]
fn no_ready_server_pod_keeps_the_prior_instance() {
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.pods = Some(vec![server_pod("kv-redis-a", "u1", "kv", "redis", 0)]);
    s.step();
    s.pods = Some(vec![]);
    let e = s.step();
    assert_eq!(e.status.observed_server_instance.as_deref(), Some("u1:0"));
    // Recovery onto a new pod is a replacement, not a first observation.
    s.pods = Some(vec![server_pod("kv-redis-b", "u2", "kv", "redis", 0)]);
    let e = s.step();
    assert!(matches!(e.cascade, CascadeDecision::Fire(_)));
}

#[test]
fn status_participation_reset_keeps_t2() {
    let mut cb = managed_redis("kv");
    cb.status = Some(CacheBackendStatus {
        index_participation: Some(IndexParticipation {
            prefix_count: 9,
            last_event_at: None,
            hit_rate: None,
            t2_hit_rate: Some("0.5".to_string()),
            inexact_replicas: Vec::new(),
        }),
        ..Default::default()
    });
    let mut s = Sim::new(cb);
    let e = s.step();
    let ip = e.status.index_participation.unwrap();
    assert_eq!(ip.prefix_count, 0);
    assert_eq!(ip.t2_hit_rate.as_deref(), Some("0.5"));
}

/// A backend without `spec.observation.modelID` has its engines' KV events never subscribed:
/// when no event comes, the condition says so instead of sending the user to the engines.
#[test]
fn no_event_without_a_model_id_names_the_missing_field() {
    let mut cb = managed_redis("kv");
    cb.spec.observation.as_mut().unwrap().model_id = None;
    let mut s = Sim::new(cb);
    s.workload = Some(available(1));
    s.step();
    s.advance(301);
    let e = s.step();
    let degraded = cond(&e.status, "Degraded").unwrap();
    assert_eq!(degraded.reason, "NoKVEventsObserved");
    assert!(
        degraded
            .message
            .contains("spec.observation.modelID is not set"),
        "{}",
        degraded.message
    );
    // With a model id the message points at the engines, as before.
    let mut s = Sim::new(managed_redis("kv"));
    s.workload = Some(available(1));
    s.step();
    s.advance(301);
    let e = s.step();
    let degraded = cond(&e.status, "Degraded").unwrap();
    assert!(
        degraded.message.contains("status.matchedEnginePods"),
        "{}",
        degraded.message
    );
}
