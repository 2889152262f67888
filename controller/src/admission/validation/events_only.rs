//! Events-only rules (spec "Events-only mode" → "Admission constraints"; "Validating":
//! "Events-only requires spec.type=LMCache", "Events-only forbids spec.autoscaling").
//!
//! An events-only backend wires routing only: no KV connector, no server workload. So
//! offload-oriented cache types, remote storage and autoscaling are contradictions and are
//! rejected. A `spec.lmCache` block is ignored for engine wiring and only warned about.

use ic_shared::crd::{CacheBackend, CacheType};

use super::{Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![
        Box::new(EventsOnlyRequiresLmcache),
        Box::new(EventsOnlyForbidsRemoteStorage),
        Box::new(EventsOnlyForbidsAutoscaling),
    ]
}

/// Rule `events_only_requires_lmcache`: `integration.mode: EventsOnly` with a `type` other than
/// LMCache (LMCache supplies the kvevent-subscriber the routing tier needs).
pub struct EventsOnlyRequiresLmcache;

impl Rule for EventsOnlyRequiresLmcache {
    fn name(&self) -> &'static str {
        "events_only_requires_lmcache"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let t = cb.spec.effective_type();
        if !cb.spec.is_events_only() || t == CacheType::LMCache {
            return Vec::new();
        }
        vec![Violation::invalid(
            "spec.type",
            t.as_str(),
            "spec.integration.mode EventsOnly wires no KV connector and requires type LMCache",
        )]
    }

    fn warnings(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<String> {
        if cb.spec.is_events_only() && cb.spec.lm_cache.is_some() {
            vec![
                "spec.lmCache is ignored in EventsOnly mode (no LMCache connector or host tier is \
                 injected); omit it so the manifest does not imply an active host tier"
                    .to_string(),
            ]
        } else {
            Vec::new()
        }
    }
}

/// Rule `events_only_forbids_remote_storage`: `spec.remoteStorage` declares a provider that
/// nothing would dial in EventsOnly mode.
pub struct EventsOnlyForbidsRemoteStorage;

impl Rule for EventsOnlyForbidsRemoteStorage {
    fn name(&self) -> &'static str {
        "events_only_forbids_remote_storage"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        if cb.spec.is_events_only() && cb.spec.remote_storage.is_some() {
            vec![Violation::forbidden(
                "spec.remoteStorage",
                "spec.integration.mode EventsOnly wires no KV connector, so no remote storage \
                 would ever be dialed",
            )]
        } else {
            Vec::new()
        }
    }
}

/// Rule `events_only_forbids_autoscaling`: an events-only backend provisions no workload to
/// scale. Field-scoped to `spec.autoscaling`.
pub struct EventsOnlyForbidsAutoscaling;

impl Rule for EventsOnlyForbidsAutoscaling {
    fn name(&self) -> &'static str {
        "events_only_forbids_autoscaling"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        if cb.spec.is_events_only() && cb.spec.autoscaling.is_some() {
            vec![Violation::forbidden(
                "spec.autoscaling",
                "spec.integration.mode EventsOnly provisions no server workload to autoscale",
            )]
        } else {
            Vec::new()
        }
    }
}
