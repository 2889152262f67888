//! The CacheBackend's Events (spec 000 "Events"), keyed on transitions: each is derived by
//! comparing the prior status with the new one, so a steady state, a restarted controller or a
//! new leader emits nothing new.

use std::time::Duration;

use ic_shared::crd::{
    backend_condition as cond, backend_reason as reason, find_condition, CacheBackendStatus,
    ConditionStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use crate::reconcile::cachebackend::engine;
use crate::reconcile::cachebackend::events::{reason as ev, EventSpec};

use super::{fmt_duration, is, is_status};

/// The note of an [`ev::ENGINE_PODS_UNWIRED`] Event: the count, at most 5 pod names, and the
/// re-wire by re-creation (`docs/troubleshooting.md`).
fn unwired_note(n: i32, pods: &[String]) -> String {
    let shown: Vec<&str> = pods.iter().take(5).map(String::as_str).collect();
    let more = pods.len().saturating_sub(shown.len());
    format!(
        "{n} engine pod(s) selected by spec.engineSelector run without the cache: the Pod webhook          never saw them (unreachable or past its timeout when they were created, or they predate          this CacheBackend): {}{}. Re-create them to have them wired (kubectl rollout restart of          their workload, or delete the pods); each carries a Warning NotInjected Event.",
        shown.join(", "),
        if more > 0 { format!(" and {more} more") } else { String::new() }
    )
}

/// The Events of one reconcile, in order: the fail-open flips, the selector message, a rise in
/// unwired engine pods, and the condition transitions from `prior` to `st` (`timeout` is the
/// backend's `firstEventTimeout`; `kv_latched_now`: the first KV event was latched in this
/// reconcile).
pub(super) fn transition_events(
    prior: &CacheBackendStatus,
    st: &CacheBackendStatus,
    sel: &engine::SelectorObservation,
    timeout: Duration,
    kv_latched_now: bool,
) -> Vec<EventSpec> {
    let mut events = Vec::new();
    let was = &prior.conditions;
    let now_c = &st.conditions;
    if st.fail_open == Some(false) && prior.fail_open != Some(false) {
        events.push(EventSpec::warning(
            ev::FAIL_CLOSED_ENABLED,
            "spec.integration.failOpen is false: the cache is now a serving dependency of \
             matched engine pods (fail-closed).",
        ));
    }
    if st.fail_open == Some(true) && prior.fail_open == Some(false) {
        events.push(EventSpec::normal(
            ev::FAIL_OPEN_RESTORED,
            "spec.integration.failOpen is true again: engines fall back to local prefill when \
             the cache is unreachable.",
        ));
    }
    if let (true, Some(msg)) = (sel.observed, sel.message.as_ref()) {
        let steady = prior.matched_engine_pods == Some(0)
            && prior.engine_selector_message.as_ref() == Some(msg);
        if !steady {
            events.push(EventSpec::normal(
                ev::ENGINE_SELECTOR_UNMATCHED,
                msg.clone(),
            ));
        }
    }
    // Engine pods the webhook never saw: one Warning each time their number rises (a steady
    // or falling count is no news; the persisted status keeps a restarted leader quiet).
    if let (true, Some(n)) = (sel.observed, sel.unwired) {
        if n > prior.unwired_engine_pods.unwrap_or(0) {
            events.push(EventSpec::warning(
                ev::ENGINE_PODS_UNWIRED,
                unwired_note(n, &sel.unwired_pods),
            ));
        }
    }
    let degraded_with = |r: &str| is(now_c, cond::DEGRADED, ConditionStatus::True, r);
    let was_degraded_with = |r: &str| is(was, cond::DEGRADED, ConditionStatus::True, r);
    if degraded_with(reason::REPLICAS_UNAVAILABLE)
        && !was_degraded_with(reason::REPLICAS_UNAVAILABLE)
    {
        let m = find_condition(now_c, cond::DEGRADED)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        events.push(EventSpec::warning(ev::BACKEND_DEGRADED, m));
    }
    let ready_reason = |cs: &[Condition]| find_condition(cs, cond::READY).map(|c| c.reason.clone());
    if ready_reason(now_c).as_deref() == Some(reason::AWAITING_FIRST_KV_EVENT)
        && ready_reason(was).as_deref() != Some(reason::AWAITING_FIRST_KV_EVENT)
    {
        events.push(EventSpec::normal(
            ev::AWAITING_FIRST_KV_EVENT,
            format!(
                "Waiting up to {} for the first KV event from this backend's engine pods.",
                fmt_duration(timeout)
            ),
        ));
    }
    if kv_latched_now {
        events.push(EventSpec::normal(
            ev::KV_EVENTS_OBSERVED,
            "The first KV event from this backend's engine pods reached the index.",
        ));
    }
    if degraded_with(reason::NO_KV_EVENTS_OBSERVED)
        && !was_degraded_with(reason::NO_KV_EVENTS_OBSERVED)
    {
        events.push(EventSpec::warning(
            ev::NO_KV_EVENTS_OBSERVED,
            format!(
                "No KV event observed within firstEventTimeout ({}): check that engine pods are \
                 wired to this backend and that their KV-event publisher is configured.",
                fmt_duration(timeout)
            ),
        ));
    }
    let prior_ready = find_condition(was, cond::READY);
    let now_ready_true = is_status(now_c, cond::READY, ConditionStatus::True);
    if now_ready_true {
        if let Some(p) = prior_ready {
            // Exactly the spec's narrative: ReplicasUnavailable → BackendReady /
            // KVEventsObserved (a stuck first rollout that recovers included). A rollout, a
            // scale from zero, a probe or kernel verdict clearing, or the KV-event gate
            // opening are not recoveries of a degraded backend.
            if p.status == ConditionStatus::False.as_str()
                && p.reason == reason::REPLICAS_UNAVAILABLE
            {
                events.push(EventSpec::normal(
                    ev::BACKEND_RECOVERED,
                    format!("The backend is Ready again (was {}).", p.reason),
                ));
            }
        }
    }
    if is(
        now_c,
        cond::ENGINE_COMPATIBILITY,
        ConditionStatus::False,
        reason::INJECTED_ENGINE_CRASH_LOOPING,
    ) && !is(
        was,
        cond::ENGINE_COMPATIBILITY,
        ConditionStatus::False,
        reason::INJECTED_ENGINE_CRASH_LOOPING,
    ) {
        let m = find_condition(now_c, cond::ENGINE_COMPATIBILITY)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        events.push(EventSpec::warning(ev::INJECTED_ENGINE_CRASH_LOOPING, m));
    }

    events
}
