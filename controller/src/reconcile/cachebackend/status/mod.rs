//! The pure status machine of a CacheBackend (spec 000 "Status", "Conditions", "KV-event
//! readiness gate", "Functional-probe gate", "Events-only mode", "Contract Notes").
//!
//! [`evaluate`] takes everything a reconcile observed ([`Observed`]), the in-process memory of
//! earlier reconciles ([`Memory`]), the probe input and the clock reading, and returns the new
//! status, the Events to emit, the cascade decision and when to requeue. It performs no I/O.
//!
//! Composition order on the Ready condition: managed readiness (or the host-only /
//! events-only base) → KV-event gate → functional-probe gate → strict kernel-check downgrade.
//! Conditions are merged with `set_condition`, so `lastTransitionTime` moves only when a
//! condition's status changes. `(SGLang, SGLangHiCache)` backends get the advisory
//! `HiCacheHostTier` ([`super::host_tier`]) and no readiness condition. The node roll-up's
//! `NodeHealthy` mirrors `status.nodeHealth` where the spec's condition set leaves room for it
//! and is removed on events-only and External backends
//! ([`crate::reconcile::nodes::advisory::publishes_condition`]).
//!
//! Split by concept: `inputs.rs` holds what the machine is given ([`Settings`], [`Observed`]
//! with its [`WorkloadState`], [`Memory`]); this file computes the conditions (the base verdict,
//! the gates, the per-path condition sets, the node roll-up, the cascade decision); and
//! `transitions.rs` derives the Events from the prior and the new status.

use std::time::Duration;

use ic_shared::crd::{
    backend_condition as cond, backend_reason as reason, find_condition, new_condition,
    remove_condition, set_condition, CacheBackend, CacheBackendSpec, CacheBackendStatus,
    ConditionStatus, DeploymentKind,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::cascade::{self, CascadeDecision, Convergence};
use super::endpoint::{check_endpoint, EndpointCheck};
use super::engine::{self, KernelResult};
use super::events::EventSpec;
use super::host_tier;
use super::index_view::participation;
use super::path::{classify, BackendPath, PathKind};
use super::probe::{ProbeInput, ProbeOutcome, StageResult};
use crate::reconcile::annotations::{REQUIRE_KV_EVENTS, SKIP_FUNCTIONAL_PROBE};
use crate::reconcile::clock::{add, elapsed, to_time};
use crate::reconcile::nodes::advisory;

mod inputs;
mod transitions;

pub use inputs::{resolve_max_unavailable, Memory, Observed, Settings, WorkloadState};

/// The result of [`evaluate`].
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// The path the backend is on.
    pub path: BackendPath,
    /// The new status (prior fields not owned here, e.g. other writers' conditions, kept).
    pub status: CacheBackendStatus,
    /// Events to emit on the CacheBackend, in order.
    pub events: Vec<EventSpec>,
    /// The `observedServerInstance` decision.
    pub cascade: CascadeDecision,
    /// Engine Deployments to restart when `cascade` is `Fire`.
    pub cascade_targets: Vec<String>,
    /// The upstream gates say Ready=True, the probe is due and was not run: run it and
    /// evaluate again with its outcome.
    pub probe_wanted: bool,
    /// When to reconcile again.
    pub requeue_after: Duration,
}

/// The managed-readiness / base verdict before the gates.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Base {
    /// Managed workload rolled out and available.
    Available,
    /// No workload to wait on: host-only or events-only, with its base reason.
    Active(&'static str),
    /// Managed rollout in flight (or the workload not yet observed).
    Rollout(String),
    /// Desired replicas 0.
    ScaledToZero,
    /// Rolled out but replicas unavailable.
    Unavailable(String),
}

fn annotation<'a>(cb: &'a CacheBackend, key: &str) -> Option<&'a str> {
    cb.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(|s| s.trim())
}

/// The desired replica count readiness compares against: the HPA-written workload
/// `spec.replicas` when autoscaling is set, else `spec.replicas`.
pub fn desired_replicas(spec: &CacheBackendSpec, workload: Option<&WorkloadState>) -> i32 {
    if spec.autoscaling.is_some() {
        workload.map(|w| w.spec_replicas).unwrap_or(1)
    } else {
        spec.effective_replicas()
    }
}

fn managed_base(spec: &CacheBackendSpec, w: Option<&WorkloadState>, ever_available: bool) -> Base {
    let Some(w) = w else {
        return Base::Rollout("the cache-server workload has not been observed yet".to_string());
    };
    let desired = desired_replicas(spec, Some(w));
    if desired == 0 {
        return Base::ScaledToZero;
    }
    let kind = match w.kind {
        DeploymentKind::Deployment => "Deployment",
        DeploymentKind::StatefulSet => "StatefulSet",
    };
    let rolled_out = w.observed_generation >= w.generation
        && w.updated_replicas >= desired
        && w.replicas <= w.updated_replicas;
    if w.progress_deadline_exceeded {
        return Base::Unavailable(format!(
            "{kind} {} exceeded its progress deadline: {}/{desired} replicas available",
            w.name, w.available_replicas
        ));
    }
    // Available as the Deployment reads it (its own Available condition): at least
    // desired − maxUnavailable pods available.
    if rolled_out && w.available_replicas >= desired - w.max_unavailable.clamp(0, desired) {
        return Base::Available;
    }
    if rolled_out && (w.rollout_completed || ever_available) {
        return Base::Unavailable(format!(
            "{kind} {} has rolled out but only {}/{desired} replicas are available",
            w.name, w.available_replicas
        ));
    }
    Base::Rollout(format!(
        "{kind} {} is rolling out: {}/{desired} updated, {}/{desired} available",
        w.name, w.updated_replicas, w.available_replicas
    ))
}

/// The Ready verdict after the KV-event gate.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    BackendReady,
    Active(&'static str),
    KvObserved,
    Awaiting,
    NoKv,
    Rollout(String),
    ScaledToZero,
    Unavailable(String),
}

struct Cond {
    status: ConditionStatus,
    reason: String,
    message: String,
}

fn c(status: ConditionStatus, reason: &str, message: impl Into<String>) -> Cond {
    Cond {
        status,
        reason: reason.to_string(),
        message: message.into(),
    }
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 && s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

fn is_probe_failure(reason: &str) -> bool {
    matches!(
        reason,
        reason::PROBE_INGEST_FAILED | reason::PROBE_ROUTING_FAILED | reason::PROBE_T2_FAILED
    )
}

fn is(conds: &[Condition], type_: &str, status: ConditionStatus, reason: &str) -> bool {
    find_condition(conds, type_).is_some_and(|c| c.status == status.as_str() && c.reason == reason)
}

struct Writer<'a> {
    conditions: &'a mut Vec<Condition>,
    generation: Option<i64>,
    now: Time,
}

impl Writer<'_> {
    fn set(&mut self, type_: &str, v: Cond) {
        set_condition(
            self.conditions,
            new_condition(
                type_,
                v.status,
                v.reason,
                v.message,
                self.generation,
                self.now.clone(),
            ),
        );
    }

    fn remove(&mut self, type_: &str) {
        remove_condition(self.conditions, type_);
    }
}

/// Computes the new status, events, cascade decision and requeue (see the module docs).
pub fn evaluate(
    obs: &Observed,
    mem: &Memory,
    probe: &ProbeInput,
    settings: &Settings,
) -> Evaluation {
    let cb = &obs.backend;
    let spec = &cb.spec;
    let ns = cb.metadata.namespace.clone().unwrap_or_default();
    let name = cb.metadata.name.clone().unwrap_or_default();
    let generation = cb.metadata.generation;
    let prior = cb.status.clone().unwrap_or_default();
    let path = classify(spec);
    let now = obs.now;
    let now_t = to_time(now);
    let mut requeue = settings.steady_requeue;
    let mut st = prior.clone();

    st.observed_generation = generation;
    st.fail_open = Some(spec.fail_open());

    // Endpoint.
    let external = match path {
        BackendPath::External(p) => Some(check_endpoint(
            p,
            spec.remote_storage
                .as_ref()
                .and_then(|r| r.endpoint.as_deref()),
        )),
        _ => None,
    };
    st.endpoint = match (&path, &external) {
        (BackendPath::Managed(_), _) => obs.service_endpoint.clone(),
        (_, Some(EndpointCheck::Accepted(e))) => Some(e.clone()),
        (_, Some(EndpointCheck::Invalid { endpoint, .. })) => Some(endpoint.clone()),
        _ => None,
    };

    // matchedEnginePods / engineSelectorMessage.
    let sel = engine::selector_status(
        spec,
        &ns,
        obs.pods.as_deref(),
        obs.deployments.as_deref(),
        &prior,
        prior.observed_generation != generation,
    );
    st.matched_engine_pods = sel.matched;
    st.unwired_engine_pods = sel.unwired;
    st.engine_selector_message = sel.message.clone();
    if sel.churn {
        requeue = requeue.min(settings.churn_requeue);
    }

    // indexParticipation (soft state).
    st.index_participation = participation(
        prior.index_participation.as_ref(),
        &ns,
        &name,
        &obs.index,
        obs.pods.as_deref(),
        obs.backends.as_deref(),
    );

    // Mode transitions, from what is persisted: the path the prior status was computed for
    // (`status.observedPath`), so a restarted controller or a new leader reaches the same
    // conditions; then this process's memory; then (a status from before the field) the
    // not-yet-shed owned workload of a server-bearing → EventsOnly flip.
    let previous = prior
        .observed_path
        .as_deref()
        .and_then(PathKind::parse)
        .or(mem.last_path)
        .or_else(|| {
            (path == BackendPath::EventsOnly && obs.owned_workload_present)
                .then_some(PathKind::Managed)
        });
    st.observed_path = Some(path.kind().as_str().to_string());
    let changed = previous.is_some_and(|p| p != path.kind());
    let reanchored = changed && matches!(path, BackendPath::EventsOnly | BackendPath::HostOnly);

    // KV-event latch.
    let gate_enabled = path.gate_capable()
        && !annotation(cb, REQUIRE_KV_EVENTS).is_some_and(|v| v.eq_ignore_ascii_case("false"));
    let mut kv_latched_now = false;
    if gate_enabled
        && st.first_kv_event_observed_at.is_none()
        && st
            .index_participation
            .as_ref()
            .is_some_and(|p| p.last_event_at.is_some())
    {
        st.first_kv_event_observed_at = Some(now_t.clone());
        kv_latched_now = true;
    }

    // Base verdict and the firstAvailableAt anchor.
    let base = match path {
        BackendPath::Managed(_) => {
            let ever = !changed && prior.first_available_at.is_some();
            Some(managed_base(spec, obs.workload.as_ref(), ever))
        }
        BackendPath::HostOnly => Some(Base::Active(reason::HOST_ONLY_ACTIVE)),
        BackendPath::EventsOnly => Some(Base::Active(reason::EVENTS_ONLY_ACTIVE)),
        BackendPath::External(_) | BackendPath::Inert => None,
    };
    match path {
        BackendPath::External(_) | BackendPath::Inert => st.first_available_at = None,
        BackendPath::EventsOnly | BackendPath::HostOnly => {
            if reanchored || st.first_available_at.is_none() {
                st.first_available_at = Some(now_t.clone());
            }
        }
        BackendPath::Managed(_) => {
            if changed {
                st.first_available_at = None;
            }
            if base == Some(Base::Available) && st.first_available_at.is_none() {
                st.first_available_at = Some(now_t.clone());
            }
        }
    }

    // KV-event gate.
    let timeout = spec.first_event_timeout();
    let verdict = base.map(|b| match b {
        Base::Available | Base::Active(_) if gate_enabled => {
            if st.first_kv_event_observed_at.is_some() {
                Verdict::KvObserved
            } else {
                let waited = st
                    .first_available_at
                    .as_ref()
                    .map(|t| elapsed(t, now))
                    .unwrap_or(Duration::ZERO);
                let sticky = !reanchored
                    && is(
                        &prior.conditions,
                        cond::DEGRADED,
                        ConditionStatus::True,
                        reason::NO_KV_EVENTS_OBSERVED,
                    );
                if waited >= timeout || sticky {
                    Verdict::NoKv
                } else {
                    let left = timeout.saturating_sub(waited).max(Duration::from_secs(1));
                    requeue = requeue.min(left);
                    Verdict::Awaiting
                }
            }
        }
        Base::Available => Verdict::BackendReady,
        Base::Active(r) => Verdict::Active(r),
        Base::Rollout(m) => Verdict::Rollout(m),
        Base::ScaledToZero => Verdict::ScaledToZero,
        Base::Unavailable(m) => Verdict::Unavailable(m),
    });

    let t2_rate: Option<f64> = st
        .index_participation
        .as_ref()
        .and_then(|p| p.t2_hit_rate.as_deref())
        .and_then(|r| r.trim().parse::<f64>().ok());
    let mut w = Writer {
        conditions: &mut st.conditions,
        generation,
        now: now_t.clone(),
    };
    let mut probe_wanted = false;
    let mut cascade_decision = CascadeDecision::Keep;
    let mut cascade_targets = Vec::new();

    match (path, verdict) {
        (BackendPath::External(p), _) => {
            let (status, r, msg) = match external {
                Some(EndpointCheck::Accepted(e)) => (
                    ConditionStatus::True,
                    reason::EXTERNAL_ENDPOINT_ACCEPTED,
                    format!(
                        "External {} endpoint {e} accepted; its reachability is not probed by \
                         the controller.",
                        p.as_str()
                    ),
                ),
                Some(EndpointCheck::Invalid { endpoint, error }) => (
                    ConditionStatus::False,
                    reason::EXTERNAL_ENDPOINT_INVALID,
                    format!(
                        "spec.remoteStorage.endpoint {endpoint:?} is not a valid {} endpoint: \
                         {error}.",
                        p.as_str()
                    ),
                ),
                _ => (
                    ConditionStatus::False,
                    reason::EXTERNAL_ENDPOINT_MISSING,
                    "spec.remoteStorage.endpoint is empty; External ownership requires the \
                     provider's host:port."
                        .to_string(),
                ),
            };
            w.set(cond::READY, c(status, r, msg.clone()));
            w.set(cond::PROGRESSING, c(ConditionStatus::False, r, msg));
            for t in [
                cond::DEGRADED,
                cond::FUNCTIONAL_PROBE_OK,
                cond::ENGINE_KERNELS_HEALTHY,
                cond::T2_DEGRADED,
                cond::ENGINE_COMPATIBILITY,
            ] {
                w.remove(t);
            }
        }
        (BackendPath::Inert, _) | (_, None) => {
            for t in [
                cond::READY,
                cond::DEGRADED,
                cond::PROGRESSING,
                cond::FUNCTIONAL_PROBE_OK,
                cond::ENGINE_KERNELS_HEALTHY,
                cond::T2_DEGRADED,
                cond::ENGINE_COMPATIBILITY,
            ] {
                w.remove(t);
            }
        }
        (_, Some(verdict)) => {
            let timeout_s = fmt_duration(timeout);
            let (mut ready, degraded, progressing) = match &verdict {
                Verdict::BackendReady => (
                    c(
                        ConditionStatus::True,
                        reason::BACKEND_READY,
                        "The cache-server workload has rolled out and its replicas are available.",
                    ),
                    None,
                    c(
                        ConditionStatus::False,
                        reason::SYNCED,
                        "Live state matches the spec.",
                    ),
                ),
                Verdict::Active(r) => (
                    c(
                        ConditionStatus::True,
                        r,
                        if *r == reason::EVENTS_ONLY_ACTIVE {
                            "Events-only integration: routing is wired through KV events; no KV \
                             connector or cache server is provisioned."
                        } else {
                            "Host-only caching: engines use the node-local LMCache tier; no remote \
                             provider is provisioned."
                        },
                    ),
                    None,
                    c(
                        ConditionStatus::False,
                        reason::SYNCED,
                        "Live state matches the spec.",
                    ),
                ),
                Verdict::KvObserved => (
                    c(
                        ConditionStatus::True,
                        reason::KV_EVENTS_OBSERVED,
                        "At least one KV event has been observed for this backend's engine pods.",
                    ),
                    None,
                    c(
                        ConditionStatus::False,
                        reason::SYNCED,
                        "Live state matches the spec.",
                    ),
                ),
                Verdict::Awaiting => {
                    let m = format!(
                        "The backend is up but no KV event has been observed yet; waiting up to \
                         {timeout_s} from status.firstAvailableAt for engine pods to publish."
                    );
                    (
                        c(
                            ConditionStatus::False,
                            reason::AWAITING_FIRST_KV_EVENT,
                            m.clone(),
                        ),
                        None,
                        c(ConditionStatus::True, reason::AWAITING_FIRST_KV_EVENT, m),
                    )
                }
                Verdict::NoKv => {
                    let m = if spec.model_id().is_none() {
                        format!(
                            "No KV event observed within firstEventTimeout ({timeout_s}): \
                             spec.observation.modelID is not set, so the engines' KV events are \
                             not subscribed. Set it to the model the engines serve."
                        )
                    } else {
                        format!(
                            "No KV event observed within firstEventTimeout ({timeout_s}). Check \
                             that engine pods are wired to this backend \
                             (status.matchedEnginePods), then the engines' --kv-events-config \
                             and that their ZMQ publisher bound."
                        )
                    };
                    (
                        c(
                            ConditionStatus::False,
                            reason::NO_KV_EVENTS_OBSERVED,
                            m.clone(),
                        ),
                        Some(c(
                            ConditionStatus::True,
                            reason::NO_KV_EVENTS_OBSERVED,
                            m.clone(),
                        )),
                        c(ConditionStatus::False, reason::NO_KV_EVENTS_OBSERVED, m),
                    )
                }
                Verdict::Rollout(m) => (
                    c(
                        ConditionStatus::False,
                        reason::ROLLOUT_IN_PROGRESS,
                        m.clone(),
                    ),
                    None,
                    c(
                        ConditionStatus::True,
                        reason::ROLLOUT_IN_PROGRESS,
                        m.clone(),
                    ),
                ),
                Verdict::ScaledToZero => {
                    let m = "spec.replicas is 0: the cache server is scaled to zero.";
                    (
                        c(ConditionStatus::False, reason::SCALED_TO_ZERO, m),
                        None,
                        c(ConditionStatus::False, reason::SCALED_TO_ZERO, m),
                    )
                }
                Verdict::Unavailable(m) => (
                    c(
                        ConditionStatus::False,
                        reason::REPLICAS_UNAVAILABLE,
                        m.clone(),
                    ),
                    Some(c(
                        ConditionStatus::True,
                        reason::REPLICAS_UNAVAILABLE,
                        m.clone(),
                    )),
                    c(
                        ConditionStatus::False,
                        reason::REPLICAS_UNAVAILABLE,
                        m.clone(),
                    ),
                ),
            };
            let degraded = degraded.unwrap_or_else(|| {
                c(
                    ConditionStatus::False,
                    reason::NOT_DEGRADED,
                    "The backend is not in a terminal unhealthy state.",
                )
            });

            // Functional-probe gate (Offload-managed only).
            if matches!(path, BackendPath::Managed(_)) && obs.probe_enabled {
                let bypass = annotation(cb, SKIP_FUNCTIONAL_PROBE)
                    .is_some_and(|v| v.eq_ignore_ascii_case("true"));
                let prior_fail = find_condition(&prior.conditions, cond::FUNCTIONAL_PROBE_OK)
                    .filter(|f| {
                        f.status == ConditionStatus::False.as_str() && is_probe_failure(&f.reason)
                    })
                    .cloned();
                if bypass {
                    w.set(
                        cond::FUNCTIONAL_PROBE_OK,
                        c(
                            ConditionStatus::True,
                            reason::PROBE_BYPASSED,
                            "The functional probe is skipped: inferencecache.io/skip-functional-probe \
                             is \"true\".",
                        ),
                    );
                } else if ready.status == ConditionStatus::True {
                    // Upstream just came back: probe now rather than show the pause's
                    // Unknown for the rest of the rate-limit window.
                    let resumed = find_condition(&prior.conditions, cond::FUNCTIONAL_PROBE_OK)
                        .is_some_and(|f| f.reason == reason::PROBE_AWAITING_READY);
                    match probe {
                        ProbeInput::NotRun => {
                            let next = mem.last_probe_at.map(|t| add(t, settings.probe_interval));
                            match next.filter(|n| now < *n && !resumed) {
                                Some(n) => {
                                    // Rate-limited: re-apply a known failure, look again at expiry.
                                    if let Some(f) = &prior_fail {
                                        ready =
                                            c(ConditionStatus::False, &f.reason, f.message.clone());
                                    }
                                    let left = Duration::try_from(n.duration_since(now))
                                        .unwrap_or(settings.probe_interval);
                                    requeue = requeue.min(left.max(Duration::from_secs(1)));
                                }
                                None => {
                                    probe_wanted = true;
                                    if let Some(f) = &prior_fail {
                                        ready =
                                            c(ConditionStatus::False, &f.reason, f.message.clone());
                                    }
                                }
                            }
                        }
                        ProbeInput::Ran(ProbeOutcome::Completed(stages)) => {
                            requeue = requeue.min(settings.probe_interval);
                            let failed = [
                                (&stages.ingest, reason::PROBE_INGEST_FAILED, "ingest"),
                                (&stages.routing, reason::PROBE_ROUTING_FAILED, "routing"),
                                (&stages.t2, reason::PROBE_T2_FAILED, "t2"),
                            ]
                            .into_iter()
                            .find_map(|(s, r, stage)| match s {
                                StageResult::Failed(m) => Some((r, stage, m.clone())),
                                _ => None,
                            });
                            match failed {
                                Some((r, stage, m)) => {
                                    let msg = format!("Functional probe stage {stage} failed: {m}");
                                    w.set(
                                        cond::FUNCTIONAL_PROBE_OK,
                                        c(ConditionStatus::False, r, msg.clone()),
                                    );
                                    ready = c(ConditionStatus::False, r, msg);
                                }
                                None => {
                                    let show = |s: &StageResult| match s {
                                        StageResult::Ok => "ok",
                                        StageResult::Skipped => "skipped",
                                        StageResult::Failed(_) => "failed",
                                    };
                                    w.set(
                                        cond::FUNCTIONAL_PROBE_OK,
                                        c(
                                            ConditionStatus::True,
                                            reason::PROBE_OK,
                                            format!(
                                                "Every enabled functional-probe stage round-tripped \
                                                 (ingest: {}, routing: {}, t2: {}).",
                                                show(&stages.ingest),
                                                show(&stages.routing),
                                                show(&stages.t2)
                                            ),
                                        ),
                                    );
                                }
                            }
                        }
                        ProbeInput::Ran(ProbeOutcome::TransportError(e)) => {
                            requeue = requeue.min(settings.probe_interval);
                            match &prior_fail {
                                // Sticky-False: a transport error never fades a stage failure.
                                Some(f) => {
                                    ready = c(ConditionStatus::False, &f.reason, f.message.clone());
                                }
                                None => w.set(
                                    cond::FUNCTIONAL_PROBE_OK,
                                    c(
                                        ConditionStatus::Unknown,
                                        reason::PROBE_ERROR,
                                        format!(
                                            "The controller could not reach the functional probe: \
                                             {e}. Check the probe wiring; backend readiness is \
                                             unchanged."
                                        ),
                                    ),
                                ),
                            }
                        }
                    }
                } else if prior_fail.is_none()
                    && find_condition(&prior.conditions, cond::FUNCTIONAL_PROBE_OK).is_some()
                {
                    // The gate does not probe a backend whose upstream is not Ready, so an
                    // earlier ProbeOK (or ProbeError) no longer describes the cache plane. A stage
                    // failure stays False (sticky) until a successful probe resolves it.
                    w.set(
                        cond::FUNCTIONAL_PROBE_OK,
                        c(
                            ConditionStatus::Unknown,
                            reason::PROBE_AWAITING_READY,
                            format!(
                                "The functional probe is paused while Ready is {}/{}: the gate \
                                 probes only a backend whose upstream gates say Ready, so no \
                                 earlier outcome is vouched for now. It probes again as soon as \
                                 they do.",
                                ready.status.as_str(),
                                ready.reason
                            ),
                        ),
                    );
                }
            } else {
                w.remove(cond::FUNCTIONAL_PROBE_OK);
            }

            // Engine-side advisory conditions (managed and host-only; never events-only).
            if path.wires_connector() {
                match obs.pods.as_deref() {
                    Some(pods) => {
                        let engines = engine::engine_pods(cb, pods);
                        let checks = engine::kernel_checks(&engines);
                        let names = |f: &dyn Fn(&KernelResult) -> bool| {
                            checks
                                .iter()
                                .filter(|k| f(&k.result))
                                .map(|k| match &k.result {
                                    KernelResult::Failed(m) | KernelResult::Error(m) => {
                                        format!("{} ({m})", k.pod)
                                    }
                                    _ => k.pod.clone(),
                                })
                                .collect::<Vec<_>>()
                                .join(", ")
                        };
                        let failed = names(&|r| matches!(r, KernelResult::Failed(_)));
                        let errored = names(&|r| matches!(r, KernelResult::Error(_)));
                        let pending = names(&|r| matches!(r, KernelResult::Pending));
                        if checks.is_empty() {
                            w.remove(cond::ENGINE_KERNELS_HEALTHY);
                        } else if !failed.is_empty() {
                            w.set(
                                cond::ENGINE_KERNELS_HEALTHY,
                                c(
                                    ConditionStatus::False,
                                    reason::KERNEL_LOAD_FAILED,
                                    format!(
                                        "LMCache native kernels (c_ops) failed to load on: {failed}. \
                                         Align the engine image's lmcache build with its CUDA runtime."
                                    ),
                                ),
                            );
                        } else if !errored.is_empty() {
                            w.set(
                                cond::ENGINE_KERNELS_HEALTHY,
                                c(
                                    ConditionStatus::Unknown,
                                    reason::KERNEL_CHECK_ERROR,
                                    format!("The kernel check ended without a recognised result on: {errored}."),
                                ),
                            );
                        } else if !pending.is_empty() {
                            w.set(
                                cond::ENGINE_KERNELS_HEALTHY,
                                c(
                                    ConditionStatus::Unknown,
                                    reason::KERNEL_CHECK_PENDING,
                                    format!("The kernel check is still running on: {pending}."),
                                ),
                            );
                        } else {
                            w.set(
                                cond::ENGINE_KERNELS_HEALTHY,
                                c(
                                    ConditionStatus::True,
                                    reason::KERNELS_HEALTHY,
                                    format!(
                                        "LMCache native kernels loaded on every reporting pod ({}).",
                                        checks.len()
                                    ),
                                ),
                            );
                        }
                        let strict_failed: Vec<&str> = checks
                            .iter()
                            .filter(|k| k.strict && matches!(k.result, KernelResult::Failed(_)))
                            .map(|k| k.pod.as_str())
                            .collect();
                        if !strict_failed.is_empty() && ready.status == ConditionStatus::True {
                            ready = c(
                                ConditionStatus::False,
                                reason::ENGINE_KERNEL_DEGRADED,
                                format!(
                                    "Engine pods admitted in strict kernel-check mode failed to load \
                                     the LMCache native kernels: {}. Fix the engine image's \
                                     lmcache/CUDA alignment or set inferencecache.io/lmcache-kernel-check \
                                     to report-only.",
                                    strict_failed.join(", ")
                                ),
                            );
                        }

                        // An episode observed before goes on between back-offs.
                        let episode = find_condition(&prior.conditions, cond::ENGINE_COMPATIBILITY)
                            .filter(|p| p.reason == reason::INJECTED_ENGINE_CRASH_LOOPING)
                            .map(|p| engine::crash_loop_pods(&p.message))
                            .unwrap_or_default();
                        let looping =
                            engine::crash_looping_injected(cb, pods, obs.now.as_second(), &episode);
                        if looping.is_empty() {
                            w.remove(cond::ENGINE_COMPATIBILITY);
                        } else {
                            w.set(
                                cond::ENGINE_COMPATIBILITY,
                                c(
                                    ConditionStatus::False,
                                    reason::INJECTED_ENGINE_CRASH_LOOPING,
                                    engine::crash_loop_message(&looping),
                                ),
                            );
                        }
                    }
                    None => {
                        // Pod list failed: keep the prior advisory conditions and any strict
                        // downgrade they imply.
                        if ready.status == ConditionStatus::True
                            && is(
                                &prior.conditions,
                                cond::READY,
                                ConditionStatus::False,
                                reason::ENGINE_KERNEL_DEGRADED,
                            )
                        {
                            if let Some(r) = find_condition(&prior.conditions, cond::READY) {
                                ready = c(ConditionStatus::False, &r.reason, r.message.clone());
                            }
                        }
                    }
                }
                match t2_rate {
                    Some(v) if v <= 0.0 => w.set(
                        cond::T2_DEGRADED,
                        c(
                            ConditionStatus::True,
                            reason::T2_ZERO_HIT_RATE,
                            "Tier-2 was queried but served zero reloads: check the remote store \
                             (connection, size, version skew) and the scheduler/worker hash seed.",
                        ),
                    ),
                    Some(v) => w.set(
                        cond::T2_DEGRADED,
                        c(
                            ConditionStatus::False,
                            reason::T2_SERVING,
                            format!("Tier-2 is serving reloads (hit rate {v})."),
                        ),
                    ),
                    None => w.remove(cond::T2_DEGRADED),
                }
            } else {
                for t in [
                    cond::ENGINE_KERNELS_HEALTHY,
                    cond::T2_DEGRADED,
                    cond::ENGINE_COMPATIBILITY,
                ] {
                    w.remove(t);
                }
            }

            w.set(cond::READY, ready);
            w.set(cond::DEGRADED, degraded);
            w.set(cond::PROGRESSING, progressing);
        }
    }

    // HiCacheHostTier: advisory, (SGLang, SGLangHiCache) only; never gates Ready.
    if host_tier::applies(spec) {
        let v = host_tier::verdict(cb, obs.pods.as_deref(), &obs.index);
        w.set(cond::HICACHE_HOST_TIER, c(v.status, v.reason, v.message));
    } else {
        w.remove(cond::HICACHE_HOST_TIER);
    }

    // NodeHealthy: the node roll-up (written into status.nodeHealth by the node status loop,
    // `nodes::advisory`) as a condition only where spec 000 "Conditions" leaves room for it;
    // an events-only or External backend sheds it (a stale one from an earlier release, or
    // one from before a mode flip) and keeps the roll-up in status.nodeHealth alone.
    if advisory::publishes_condition(spec) {
        if let Some(h) = st.node_health.as_ref() {
            set_condition(w.conditions, advisory::mirror_condition(h, generation));
        }
    } else {
        w.remove(cond::NODE_HEALTHY);
    }

    // observedServerInstance and the cascade (managed only).
    match (path, obs.server_selector.as_ref(), obs.pods.as_deref()) {
        (BackendPath::Managed(_), Some(selector), Some(pods)) => {
            let current = cascade::ready_server_pods(pods, &ns, selector, &obs.server_containers);
            let convergence = obs.workload.as_ref().map(|w| Convergence {
                spec_replicas: w.spec_replicas,
                ready_replicas: w.ready_replicas,
                updated_replicas: w.updated_replicas,
                observed_generation: w.observed_generation,
                generation: w.generation,
            });
            cascade_decision = cascade::decide(
                prior.observed_server_instance.as_deref(),
                &current,
                convergence,
                mem.last_cascade_at,
                now,
                settings.cascade_min_interval,
            );
            match &cascade_decision {
                CascadeDecision::Keep => {}
                CascadeDecision::Baseline(id) => st.observed_server_instance = Some(id.clone()),
                CascadeDecision::Fire(id) => {
                    st.observed_server_instance = Some(id.clone());
                    cascade_targets =
                        engine::injected_engine_deployments(cb, pods, obs.deployments.as_deref());
                }
                CascadeDecision::Defer(d) => requeue = requeue.min(*d),
            }
        }
        (BackendPath::Managed(_), _, _) => {}
        _ => st.observed_server_instance = None,
    }

    // Events: transition-keyed, compared with the prior status.
    let events = transitions::transition_events(&prior, &st, &sel, timeout, kv_latched_now);

    Evaluation {
        path,
        status: st,
        events,
        cascade: cascade_decision,
        cascade_targets,
        probe_wanted,
        requeue_after: requeue.max(Duration::from_secs(1)),
    }
}

fn is_status(conds: &[Condition], type_: &str, status: ConditionStatus) -> bool {
    find_condition(conds, type_).is_some_and(|c| c.status == status.as_str())
}
