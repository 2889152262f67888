//! Annotation keys of inference-cache on engine pods and its objects (spec 000), and how a
//! truthy value reads.
//!
//! The contract between the Pod webhook (which writes them) and the reconcilers (which read
//! them); both import it from here.

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
