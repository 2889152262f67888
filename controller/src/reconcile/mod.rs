//! Reconcilers (DESIGN.md "Reconcile"; spec 000 "Status", "Conditions", "Contract Notes").
//!
//! - [`cachebackend`] — the CacheBackend reconciler: provider workloads, status, conditions,
//!   Events, cascade restarts. Entry points [`reconcile`], [`error_policy`], [`Context`],
//!   [`cachebackend::controller`].
//! - [`render`] — pure rendering of provider workloads (Redis, LMCacheServer, Mooncake).
//! - [`engine_pods`] — the engine-pod Events controller (InjectedByCacheBackend,
//!   SkippedByOperator).
//! - [`clock`] — the injected clock.
//! - [`run`] — [`run_controllers`]: both controllers on a real client, for `ic-controller run`.
//! - [`nodes`] — node plans, CacheNode status and the CacheBackend `NodeHealthy` advisory.
//!
//! What `ic-controller run` must watch: CacheBackends plus the Deployments, StatefulSets,
//! Services and HorizontalPodAutoscalers they own (all carry the
//! `inferencecache.io/cachebackend` label) — [`cachebackend::controller`] builds exactly that —
//! and, for [`engine_pods`], Pods ([`engine_pods::controller`]). Engine pods are listed by the
//! CacheBackend reconciler at its requeue cadence, not watched.

pub mod backoff;
pub mod cache_index;
pub mod cachebackend;
pub mod clock;
pub mod engine_pods;
pub mod follow;
pub mod index_aggregate;
pub mod model_cache;
pub mod nodes;
pub mod policy;
pub mod render;
pub mod run;
pub mod tenants;

pub use cachebackend::{error_policy, reconcile, Context, Error};
pub use run::{run_controllers, Controllers};

/// Annotation keys the reconcilers read or write (spec 000).
pub mod annotations {
    /// On engine pods: `<namespace>/<name>` of the CacheBackend that injected the pod.
    pub const INJECTED_BY: &str = "inferencecache.io/injected-by";
    /// On engine pods: the injecting CacheBackend's `metadata.uid`.
    pub const INJECTED_BY_UID: &str = "inferencecache.io/injected-by-uid";
    /// On engine pods: the JSON `ic_shared::crd::WiredSpec` of the CacheBackend spec the pod
    /// was wired under; the node plan follows it, not the current spec.
    pub const WIRED_SPEC: &str = "inferencecache.io/wired-spec";
    /// On engine pods: truthy value opts the pod out of wiring.
    pub const SKIP_INJECT: &str = "inferencecache.io/skip-inject";
    /// On engine pods: the webhook's skip marker.
    pub const INJECT_SKIPPED: &str = "inferencecache.io/inject-skipped";
    /// Pod (and namespace) label that keeps the Pod webhook away when `disabled` (the chart's
    /// default `webhook.pod.optOutLabel` / `namespaceLabel`).
    pub const WEBHOOK_OPT_OUT: &str = "inferencecache.io/webhook";
    /// On engine pods a CacheBackend selects but the webhook admitted unwired:
    /// `CacheBackend <ns>/<name>: <reason>` (the Pod webhook's fail-open, kept on the pod).
    pub const NOT_INJECTED: &str = "inferencecache.io/not-injected";
    /// Value of [`INJECT_SKIPPED`] for an explicit opt-out.
    pub const INJECT_SKIPPED_BY_ANNOTATION: &str = "skip-inject-annotation";
    /// On CacheBackends: `"false"` turns the KV-event readiness gate off.
    pub const REQUIRE_KV_EVENTS: &str = "inferencecache.io/require-kv-events";
    /// On CacheBackends: `"true"` bypasses the functional probe (FunctionalProbeOK=ProbeBypassed).
    pub const SKIP_FUNCTIONAL_PROBE: &str = "inferencecache.io/skip-functional-probe";
    /// On CacheBackends (admission): `auto`, `report-only`, `strict`, `off`. A pod's admitted
    /// mode is its kernel-check container's env, not an annotation
    /// (`crate::adapters::vllm_lmcache::ENV_KERNEL_CHECK_MODE`).
    pub const LMCACHE_KERNEL_CHECK: &str = "inferencecache.io/lmcache-kernel-check";
    /// On engine Deployments' pod templates: patched to `server-<hash of the new server
    /// instance>` to roll the engines once per cache-server replacement.
    pub const CACHE_SERVER_RESTART_TRIGGER: &str = "inferencecache.io/cache-server-restart-trigger";

    /// The one truthiness of boolean-ish annotation values (`skip-inject`), used by the Pod
    /// webhook and the engine-pod reconciler alike: `true`, `t`, `1`, `yes`, `y`, `on`, any
    /// case, surrounding spaces ignored.
    pub fn is_truthy(v: &str) -> bool {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "true" | "t" | "1" | "yes" | "y" | "on"
        )
    }
}
