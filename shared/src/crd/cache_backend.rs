//! `CacheBackend` (`inferencecache.io/v1alpha1`, namespaced, short name `cb`) — spec 000
//! "Identity", "Spec", "Status", "Index Participation", "Template Overrides", "SGLang native
//! HiCache", "Mooncake provider configuration", "Events-only mode".
//!
//! One CacheBackend describes an engine-side cache implementation (`spec.type`), an optional
//! remote tier (`spec.remoteStorage`) and how matched engine pods use them
//! (`spec.integration`). Each field has one architectural dimension:
//!
//! ```yaml
//! spec:
//!   runtime: SGLang            # inference runtime
//!   type: LMCache              # engine-side cache implementation (default LMCache)
//!   lmCache:                   # LMCache host tier
//!     chunkSizeTokens: 256
//!     hostMemory: { capacity: 32Gi }
//!   remoteStorage:             # optional; omitted = host-only, provisions nothing
//!     provider: Redis          # Redis | LMCacheServer | Mooncake
//!     ownership: Managed       # Managed | External
//!     redis: { resources: { limits: { memory: 8Gi } } }
//!   observation: { modelID: Qwen/Qwen3 }
//! ```
//!
//! Optional nested objects are `Option<…>` and stay absent when omitted (spec "Contract Notes":
//! server-side apply must not claim empty nested objects). Scalar defaults live in the generated
//! schema (the API server applies them) and are mirrored by the `effective_*` accessors for
//! callers that bypass the API server.
//!
//! One concept, kept in one file although it passes 1 000 lines: the CacheBackend API type —
//! its spec and status structs, their enums and defaults, the condition and reason names its
//! status carries, and the `effective_*` accessors that read it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, PodSecurityContext, ResourceRequirements, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Default `spec.type` (spec "Spec": "Defaults to LMCache").
pub const DEFAULT_CACHE_TYPE: CacheType = CacheType::LMCache;
/// Default `spec.deploymentKind`.
pub const DEFAULT_DEPLOYMENT_KIND: DeploymentKind = DeploymentKind::Deployment;
/// Default `spec.replicas`.
pub const DEFAULT_REPLICAS: i32 = 1;
/// Default `spec.autoscaling.targetCPUUtilizationPercent`.
pub const DEFAULT_TARGET_CPU_UTILIZATION_PERCENT: i32 = 80;
/// Default `spec.integration.mode`.
pub const DEFAULT_INTEGRATION_MODE: IntegrationMode = IntegrationMode::Offload;
/// Default `spec.integration.role`.
pub const DEFAULT_INTEGRATION_ROLE: IntegrationRole = IntegrationRole::ReadWrite;
/// Default `spec.integration.failOpen`: the cache is an optimization, never a serving dependency.
pub const DEFAULT_FAIL_OPEN: bool = true;
/// Default `spec.observation.firstEventTimeout` (a Go duration string).
pub const DEFAULT_FIRST_EVENT_TIMEOUT: &str = "5m";
/// Default `spec.lmCache.chunkSizeTokens` (tokens per LMCache chunk).
pub const DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS: i32 = 256;
/// Default `spec.lmCache.hostMemory.capacity` (a Kubernetes quantity).
pub const DEFAULT_LMCACHE_HOST_MEMORY_CAPACITY: &str = "4Gi";
/// Default `spec.lmCache.workerPort` (loopback ZMQ port of the LMCache MP worker).
pub const DEFAULT_LMCACHE_WORKER_PORT: i32 = 5555;

/// Pattern of a Go `time.Duration` string (`5m`, `1h30m`, `250ms`, `0`), as `metav1.Duration`
/// accepts it.
pub const DURATION_PATTERN: &str = r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$";

/// Condition types a CacheBackend publishes (spec 000 "Conditions").
pub mod backend_condition {
    /// Serving readiness (workload + KV-event gate + functional-probe gate).
    pub const READY: &str = "Ready";
    /// Terminal unhealthy state (ReplicasUnavailable, NoKVEventsObserved).
    pub const DEGRADED: &str = "Degraded";
    /// The controller is still driving live state toward desired state.
    pub const PROGRESSING: &str = "Progressing";
    /// Outcome of the most recent functional probe (Offload-managed only).
    pub const FUNCTIONAL_PROBE_OK: &str = "FunctionalProbeOK";
    /// LMCache native-kernel load health on matched engine pods (Offload-managed only).
    pub const ENGINE_KERNELS_HEALTHY: &str = "EngineKernelsHealthy";
    /// Advisory tier-2 health from `status.indexParticipation.t2HitRate` (Offload-managed only).
    pub const T2_DEGRADED: &str = "T2Degraded";
    /// Advisory engine↔connector observation (Offload-managed only).
    pub const ENGINE_COMPATIBILITY: &str = "EngineCompatibility";
    /// Advisory roll-up of node-agent checks on nodes running matched engine pods
    /// (`docs/crds.md` "status"); never gates Ready.
    pub const NODE_HEALTHY: &str = "NodeHealthy";
    /// Advisory SGLang HiCache host-tier write/read round trip of the matched engine pods
    /// (`(SGLang, SGLangHiCache)` backends only; issue 19 item 4, `docs/kv-events.md` "SGLang
    /// HiCache readiness"); never gates Ready (the spec publishes no Ready on this path).
    pub const HICACHE_HOST_TIER: &str = "HiCacheHostTier";
}

/// Condition reasons a CacheBackend uses (spec 000 "Conditions", "KV-event readiness gate",
/// "Functional-probe gate", "Externally owned remote storage").
pub mod backend_reason {
    /// Ready=True: workload available, both gates disabled.
    pub const BACKEND_READY: &str = "BackendReady";
    /// Ready/Progressing: a rollout is in flight.
    pub const ROLLOUT_IN_PROGRESS: &str = "RolloutInProgress";
    /// Ready=False/Progressing=False: scaled to zero replicas.
    pub const SCALED_TO_ZERO: &str = "ScaledToZero";
    /// Ready=False/Degraded=True: rolled out but replicas unavailable.
    pub const REPLICAS_UNAVAILABLE: &str = "ReplicasUnavailable";
    /// Ready=False: up, no KV event yet, within firstEventTimeout.
    pub const AWAITING_FIRST_KV_EVENT: &str = "AwaitingFirstKVEvent";
    /// Ready=True: at least one KV event ever observed.
    pub const KV_EVENTS_OBSERVED: &str = "KVEventsObserved";
    /// Ready=False/Degraded=True: no KV event by firstEventTimeout.
    pub const NO_KV_EVENTS_OBSERVED: &str = "NoKVEventsObserved";
    /// Base Ready=True reason of a host-only backend.
    pub const HOST_ONLY_ACTIVE: &str = "HostOnlyActive";
    /// Base Ready reason of an events-only backend.
    pub const EVENTS_ONLY_ACTIVE: &str = "EventsOnlyActive";
    /// External ownership: endpoint valid for the provider.
    pub const EXTERNAL_ENDPOINT_ACCEPTED: &str = "ExternalEndpointAccepted";
    /// External ownership: endpoint empty.
    pub const EXTERNAL_ENDPOINT_MISSING: &str = "ExternalEndpointMissing";
    /// External ownership: endpoint fails the provider's shape check.
    pub const EXTERNAL_ENDPOINT_INVALID: &str = "ExternalEndpointInvalid";
    /// Degraded=False.
    pub const NOT_DEGRADED: &str = "NotDegraded";
    /// Progressing=False: converged.
    pub const SYNCED: &str = "Synced";
    /// FunctionalProbeOK=True: every enabled stage round-tripped.
    pub const PROBE_OK: &str = "ProbeOK";
    /// FunctionalProbeOK=True: opted out by annotation.
    pub const PROBE_BYPASSED: &str = "ProbeBypassed";
    /// Probe ingest stage failed.
    pub const PROBE_INGEST_FAILED: &str = "ProbeIngestFailed";
    /// Probe routing stage failed.
    pub const PROBE_ROUTING_FAILED: &str = "ProbeRoutingFailed";
    /// Probe tier-2 stage failed.
    pub const PROBE_T2_FAILED: &str = "ProbeT2Failed";
    /// FunctionalProbeOK=Unknown: the probe endpoint could not be reached.
    pub const PROBE_ERROR: &str = "ProbeError";
    /// FunctionalProbeOK=Unknown: the upstream gates say Ready is not True, so the probe is not
    /// run (spec 000 "Functional-probe gate": it fires only when the upstream would say
    /// Ready=True); the last outcome is no longer vouched for. A stage failure stays False.
    pub const PROBE_AWAITING_READY: &str = "ProbeAwaitingReady";
    /// EngineKernelsHealthy=True.
    pub const KERNELS_HEALTHY: &str = "KernelsHealthy";
    /// EngineKernelsHealthy=False.
    pub const KERNEL_LOAD_FAILED: &str = "KernelLoadFailed";
    /// EngineKernelsHealthy=Unknown: a check ended without a recognised result.
    pub const KERNEL_CHECK_ERROR: &str = "KernelCheckError";
    /// EngineKernelsHealthy=Unknown: a check is still running.
    pub const KERNEL_CHECK_PENDING: &str = "KernelCheckPending";
    /// Ready=False in strict kernel-check mode after a kernel load failure.
    pub const ENGINE_KERNEL_DEGRADED: &str = "EngineKernelDegraded";
    /// T2Degraded=True: tier-2 queried but served zero reloads.
    pub const T2_ZERO_HIT_RATE: &str = "T2ZeroHitRate";
    /// T2Degraded=False: tier-2 serving reloads.
    pub const T2_SERVING: &str = "T2Serving";
    /// EngineCompatibility=False: an injected engine container is crash-looping.
    pub const INJECTED_ENGINE_CRASH_LOOPING: &str = "InjectedEngineCrashLooping";
    /// HiCacheHostTier=True: a matched pod's current engine wrote tokens to its host tier and
    /// served prompt tokens from it.
    pub const HOST_TIER_ROUND_TRIP: &str = "HostTierRoundTrip";
    /// HiCacheHostTier=Unknown: pods report the host-tier counters, no pod has both a write
    /// and a read yet.
    pub const HOST_TIER_NOT_EXERCISED: &str = "HostTierNotExercised";
    /// HiCacheHostTier=Unknown: no matched pod's host-tier counters are current (not exported,
    /// not scraped, or their node agent is gone).
    pub const HOST_TIER_SIGNAL_UNAVAILABLE: &str = "HostTierSignalUnavailable";
}

/// `spec.runtime`: the inference runtime whose engine pods are wired (case-sensitive).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum Runtime {
    /// vLLM.
    #[default]
    #[serde(rename = "VLLM")]
    Vllm,
    /// SGLang.
    #[serde(rename = "SGLang")]
    SgLang,
}

/// `spec.type`: the engine-side cache implementation (spec "Cache type validation"). A closed
/// enum: the old `Mooncake` and `External` spellings are rejected by the API server.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum CacheType {
    /// LMCache (vLLM connector or SGLang MP worker).
    #[default]
    LMCache,
    /// SGLang native hierarchical cache (engine-local; no server workload).
    SGLangHiCache,
}

/// `spec.remoteStorage.provider`: the remote-tier technology.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum RemoteProvider {
    /// Redis (RESP binding).
    #[default]
    Redis,
    /// Standalone LMCache server (`lm://` binding).
    LMCacheServer,
    /// Mooncake master (`mooncakestore://` binding).
    Mooncake,
}

/// `spec.remoteStorage.ownership`: who owns the provider's lifecycle.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum Ownership {
    /// The controller renders the provider workload and Service.
    #[default]
    Managed,
    /// Operator-managed; `spec.remoteStorage.endpoint` is required.
    External,
}

/// `spec.deploymentKind`: the managed workload kind.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum DeploymentKind {
    /// apps/v1 Deployment.
    #[default]
    Deployment,
    /// apps/v1 StatefulSet.
    StatefulSet,
}

/// `spec.integration.mode`: which cache tiers engines are wired for (spec "Events-only mode").
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum IntegrationMode {
    /// Routing (tier-1) plus the KV-offload connector (tier-2).
    #[default]
    Offload,
    /// Routing only: no KV connector, no server workload.
    EventsOnly,
}

/// `spec.integration.role`: engine participation mode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum IntegrationRole {
    /// Consumer only (vLLM `kv_consumer`).
    ReadOnly,
    /// Producer only (vLLM `kv_producer`).
    WriteOnly,
    /// Both (vLLM `kv_both`); the only role SGLang supports.
    #[default]
    ReadWrite,
}

/// `spec.hiCache.writePolicy` → `--hicache-write-policy`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum HiCacheWritePolicy {
    /// `write_back`.
    #[serde(rename = "write_back")]
    WriteBack,
    /// `write_through`.
    #[serde(rename = "write_through")]
    WriteThrough,
    /// `write_through_selective`.
    #[serde(rename = "write_through_selective")]
    WriteThroughSelective,
}

/// `spec.hiCache.ioBackend` → `--hicache-io-backend`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum HiCacheIoBackend {
    /// `direct`.
    #[serde(rename = "direct")]
    Direct,
    /// `kernel`.
    #[serde(rename = "kernel")]
    Kernel,
    /// `kernel_ascend`.
    #[serde(rename = "kernel_ascend")]
    KernelAscend,
}

/// `spec.hiCache.memoryLayout` → `--hicache-mem-layout`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum HiCacheMemoryLayout {
    /// `layer_first`.
    #[serde(rename = "layer_first")]
    LayerFirst,
    /// `page_first`.
    #[serde(rename = "page_first")]
    PageFirst,
    /// `page_first_direct`.
    #[serde(rename = "page_first_direct")]
    PageFirstDirect,
    /// `page_first_kv_split`.
    #[serde(rename = "page_first_kv_split")]
    PageFirstKvSplit,
    /// `page_head`.
    #[serde(rename = "page_head")]
    PageHead,
}

/// Desired state of a CacheBackend (spec 000 "Spec").
///
/// Only `runtime` is required. Printer columns: Ready (the `Ready` condition's status),
/// Endpoint, Matched (`status.matchedEnginePods`), Prefixes
/// (`status.indexParticipation.prefixCount`), LastEvent, Age.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "CacheBackend",
    plural = "cachebackends",
    singular = "cachebackend",
    shortname = "cb",
    namespaced,
    status = "CacheBackendStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "CacheBackend wires vLLM / SGLang engine pods to KV-cache tiers and optionally provisions a remote tier (spec 000).",
    printcolumn = r#"{"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"}"#,
    printcolumn = r#"{"name": "Matched", "type": "integer", "jsonPath": ".status.matchedEnginePods"}"#,
    printcolumn = r#"{"name": "Prefixes", "type": "integer", "jsonPath": ".status.indexParticipation.prefixCount"}"#,
    printcolumn = r#"{"name": "LastEvent", "type": "date", "jsonPath": ".status.indexParticipation.lastEventAt"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = super::shorten_quantity_descriptions)]
pub struct CacheBackendSpec {
    /// Required inference runtime: `VLLM` or `SGLang` (case-sensitive).
    pub runtime: Runtime,

    /// Engine-side cache implementation: `LMCache` (default) or `SGLangHiCache`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "LMCache"))]
    pub type_: Option<CacheType>,

    /// Typed LMCache engine configuration (chunk size, host memory, MP worker, remote serde).
    /// Valid only with `type: LMCache`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lm_cache: Option<LmCacheSpec>,

    /// Optional remote tier. Omitted means host-only: no provider workload is provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_storage: Option<RemoteStorageSpec>,

    /// KV-event observation identity (`modelID`) and timing (`firstEventTimeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation: Option<ObservationSpec>,

    /// Managed workload kind: `Deployment` (default) or `StatefulSet`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "Deployment"))]
    pub deployment_kind: Option<DeploymentKind>,

    /// Desired managed backend replicas. Default 1, minimum 0. With `autoscaling` set, the HPA
    /// owns the replica count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0), extend("default" = 1))]
    pub replicas: Option<i32>,

    /// Horizontal autoscaling of the managed workload (an owned HPA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,

    /// How matched engine pods use the cache. The defaulting webhook materialises this object so
    /// the nested schema defaults apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integration: Option<IntegrationSpec>,

    /// Equality-based label selector matched against engine pod labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_selector: Option<EngineSelector>,

    /// SGLang native HiCache configuration; required only for `type: SGLangHiCache`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hi_cache: Option<HiCacheSpec>,

    /// Narrow pod-level overrides for managed backend pods (no containers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<PodTemplateOverrides>,

    /// Allows `spec.remoteStorage.endpoint` to name a Service in another namespace. Defaults to
    /// false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_cross_namespace: bool,
}

/// `spec.lmCache`: typed LMCache engine configuration (spec "SGLang LMCache MP mode").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LmCacheSpec {
    /// Tokens per LMCache chunk (the worker's `--chunk-size`). Default 256, minimum 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1), extend("default" = 256))]
    pub chunk_size_tokens: Option<i32>,

    /// Host-memory (L1) tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<LmCacheHostMemorySpec>,

    /// Optional MP-worker image override; defaults to the engine image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_image: Option<String>,

    /// Loopback ZMQ port shared by engine and MP worker. Default 5555, range 1–65535.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535), extend("default" = 5555))]
    pub worker_port: Option<i32>,

    /// Serializer for the remote tier (`LMCACHE_REMOTE_SERDE`, e.g. `naive`, `cachegen`).
    /// Unset leaves the adapter's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_serde: Option<String>,
}

/// `spec.lmCache.hostMemory`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LmCacheHostMemorySpec {
    /// Host-memory budget (a positive quantity; default `4Gi`), rendered to the worker's
    /// whole-GiB L1 allocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "4Gi"))]
    pub capacity: Option<Quantity>,
}

/// `spec.remoteStorage`: the optional remote tier (spec "Cache hierarchy and ownership").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RemoteStorageSpec {
    /// Remote technology: `Redis`, `LMCacheServer` or `Mooncake`.
    pub provider: RemoteProvider,

    /// `Managed` (controller-provisioned) or `External` (operator-managed).
    pub ownership: Ownership,

    /// Required for External, rejected for Managed. Bare `host:port` works for every provider;
    /// LMCacheServer also accepts `lm://host:port`, Mooncake `mooncakestore://host:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,

    /// Redis-owned image and resources (valid with `provider: Redis`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisSpec>,

    /// Standalone LMCache-server image, command and resources (valid with
    /// `provider: LMCacheServer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lm_cache_server: Option<LmCacheServerSpec>,

    /// Mooncake master image, command and resources (valid with `provider: Mooncake`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mooncake: Option<MooncakeSpec>,
}

/// `spec.remoteStorage.redis`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RedisSpec {
    /// Redis image (Managed only); the provider default applies when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Container resources. Unset: 4Gi request / 8Gi limit without persisting a default; `{}`
    /// suppresses the default. `limits.memory` also sizes `--maxmemory` (~80%).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// `spec.remoteStorage.lmCacheServer`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LmCacheServerSpec {
    /// Standalone server image (default pinned `lmcache/standalone:v0.4.7`); must be
    /// wire-compatible with the engine's LMCache client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Server command and arguments; the provider default applies when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,

    /// Container resources (same defaulting rules as `redis.resources`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// `spec.remoteStorage.mooncake` (spec "Mooncake provider configuration").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MooncakeSpec {
    /// Master image (default `docker.io/kvcacheai/mooncake:0.3.11.post1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Master command and arguments (default `mooncake_master --rpc_port=50051
    /// --metrics_port=9003 --enable_http_metadata_server=true …`). Do not move the RPC (50051) or
    /// HTTP metadata (8080) ports through it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,

    /// Master container resources (default 4Gi request / 8Gi limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// `spec.observation`: KV-event observation identity and timing.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObservationSpec {
    /// Model id attached to observed KV events; its presence gates the KV-event subscription.
    #[serde(rename = "modelID", default, skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,

    /// How long readiness waits for the first KV event (Go duration, default `5m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        pattern(r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$"),
        extend("default" = "5m")
    )]
    pub first_event_timeout: Option<String>,
}

/// `spec.autoscaling`: HPA bounds for the managed workload. CEL: `minReplicas <= maxReplicas`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.minReplicas) || self.minReplicas <= self.maxReplicas").message("minReplicas must not exceed maxReplicas"))]
pub struct AutoscalingSpec {
    /// HPA lower bound (minimum 1). Defaulted to `spec.replicas` on first apply only by the
    /// admission defaulter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub min_replicas: Option<i32>,

    /// HPA upper bound (required, minimum 1).
    #[schemars(range(min = 1))]
    pub max_replicas: i32,

    /// Target average per-pod CPU utilization, percent in [1, 100]. Default 80.
    #[serde(
        rename = "targetCPUUtilizationPercent",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1, max = 100), extend("default" = 80))]
    pub target_cpu_utilization_percent: Option<i32>,
}

/// `spec.integration`: how engines use the cache.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IntegrationSpec {
    /// `Offload` (default: routing + KV offload) or `EventsOnly` (routing only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "Offload"))]
    pub mode: Option<IntegrationMode>,

    /// `ReadOnly`, `WriteOnly` or `ReadWrite` (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "ReadWrite"))]
    pub role: Option<IntegrationRole>,

    /// Default true: engines fall back to local prefill when the cache is unreachable. false is
    /// an advanced fail-closed opt-in (a Warning `FailClosedEnabled` Event is emitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub fail_open: Option<bool>,

    /// Amendments to the non-reserved args/env the Pod webhook injects (known-fragile: nothing
    /// here is type-checked against the engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_overrides: Option<EngineOverrides>,

    /// Opt-in: move matched engine pods onto the host network (required for Mooncake's
    /// transfer mesh; rejected on backends that do not need it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_host_network: Option<bool>,
}

/// `spec.integration.engineOverrides` (spec "Engine-injection overrides").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineOverrides {
    /// Args merged by leading flag token into the adapter-owned set; order preserved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,

    /// Leading flag names the adapter must not inject.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suppress_args: Vec<String>,

    /// Env upserted by name into the adapter-owned set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,

    /// Env var names the adapter must not inject.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suppress_env: Vec<String>,
}

/// `spec.engineSelector`: equality-only label selector (no `matchExpressions` in v1alpha1).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineSelector {
    /// Every key/value must appear on the engine pod's labels. Empty claims nothing.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
}

/// `spec.hiCache` (spec "SGLang native HiCache"). Exactly one of `ratio` and `sizeGB`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.ratio) != has(self.sizeGB)").message("exactly one of ratio and sizeGB must be set"))]
pub struct HiCacheSpec {
    /// Host pool size relative to the device KV pool: a finite decimal > 0, as a string
    /// (`"2.0"`). `--hicache-ratio`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<String>,

    /// Host pool size in decimal gigabytes, ≥ 1. `--hicache-size`.
    #[serde(rename = "sizeGB", default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub size_gb: Option<i32>,

    /// `--hicache-write-policy`; unset leaves the engine's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_policy: Option<HiCacheWritePolicy>,

    /// `--hicache-io-backend`; unset leaves the engine's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_backend: Option<HiCacheIoBackend>,

    /// `--hicache-mem-layout`; unset leaves the engine's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_layout: Option<HiCacheMemoryLayout>,
}

/// `spec.template`: partial pod-level overrides merged into managed backend pods (spec
/// "Template Overrides"). Containers are deliberately not exposed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateOverrides {
    /// Node labels the backend pods must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Scheduling affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// Tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    /// Topology spread constraints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,

    /// Image pull secrets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,

    /// Service account of the backend pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,

    /// Pod-level security context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_context: Option<PodSecurityContext>,

    /// Priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,

    /// Scheduler name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,

    /// Runtime class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,

    /// Graceful shutdown period in seconds (≥ 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub termination_grace_period_seconds: Option<i64>,
}

/// Observed state of a CacheBackend (spec 000 "Status").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheBackendStatus {
    /// Endpoint clients use: mirrors `spec.remoteStorage.endpoint` for External, the rendered
    /// Service for Managed; empty for host-only and events-only backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,

    /// Pods in the namespace matching `spec.engineSelector` at the last reconcile that the Pod
    /// webhook decided on (wired, admitted unwired with a `not-injected` reason, or opted out);
    /// pods it never saw are counted in `unwiredEnginePods` instead. Absent = not computed (or
    /// no claim-capable selector); 0 = computed, none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub matched_engine_pods: Option<i32>,

    /// Pods in the namespace matching `spec.engineSelector` at the last reconcile that carry no
    /// decision of the Pod webhook at all (created while it was unreachable or past its
    /// timeout, or before this CacheBackend existed): they run without the cache. Delete them
    /// (or roll their workload) to have them re-admitted and wired. Absent = not computed;
    /// 0 = computed, none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub unwired_engine_pods: Option<i32>,

    /// Selector-drift diagnosis, set while engine pods are expected but none match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_selector_message: Option<String>,

    /// Observed echo of the effective `spec.integration.failOpen` (explicit false serialized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_open: Option<bool>,

    /// Per-backend slice of the cluster-wide index; absent until a successful scrape names this
    /// backend's replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_participation: Option<IndexParticipation>,

    /// Write-once latch: first time the KV-event gate saw `indexParticipation.lastEventAt`.
    #[serde(
        rename = "firstKVEventObservedAt",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub first_kv_event_observed_at: Option<Time>,

    /// Write-once latch anchoring the firstEventTimeout clock (re-anchored on a mode change).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_available_at: Option<Time>,

    /// The serving path this status was computed for (`Managed`, `HostOnly`, `EventsOnly`,
    /// `External`, `Inert`): how a mode flip (Managed→EventsOnly, EventsOnly→Offload) is
    /// recognised by any controller replica, after a restart or a leader change, from what is
    /// persisted rather than from one process's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_path: Option<String>,

    /// Cascade baseline: `<pod-uid>:<restart-sum>` per Ready cache-server pod, comma-joined,
    /// sorted by pod name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_server_instance: Option<String>,

    /// `.metadata.generation` last reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Roll-up of the node agents' checks on the nodes running this backend's engine pods:
    /// written by the node status loop on every backend with scheduled engine pods, absent
    /// otherwise; never gates Ready. The advisory `NodeHealthy` condition carries the same
    /// verdict only where spec 000 "Conditions" leaves room for it: never on an events-only
    /// backend (exactly Ready, Degraded, Progressing) nor on External ownership (Ready and
    /// Progressing only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_health: Option<BackendNodeHealth>,

    /// Conditions keyed by type: Ready, Degraded, Progressing, FunctionalProbeOK,
    /// EngineKernelsHealthy, T2Degraded, EngineCompatibility, NodeHealthy (not on events-only
    /// or External backends), HiCacheHostTier.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// `status.nodeHealth`: the node agents' verdict on the nodes running a backend's engine pods
/// (`docs/in-cluster.md` "The node roll-up on CacheBackends"), shaped like a condition.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackendNodeHealth {
    /// `True` (every node passes its checks), `False` (a check at Warning or Critical) or
    /// `Unknown` (no connected agent, no report yet, or a stale report).
    #[schemars(extend("enum" = ["True", "False", "Unknown"]))]
    pub status: String,
    /// CamelCase reason: `NodesHealthy`, `NodeCheckFailing`, `NodeAgentNotConnected`,
    /// `NodeReportPending`, `NodeReportStale`.
    pub reason: String,
    /// Names the nodes and the failing checks (at most 10 of each, then a count).
    #[serde(default)]
    pub message: String,
    /// When `status` last changed.
    pub last_transition_time: Time,
}

/// `status.indexParticipation` (spec 000 "Index Participation").
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IndexParticipation {
    /// Distinct prefix entries attributed to this backend's replicas; 0 is a valid observed
    /// value and is always serialized.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub prefix_count: i64,

    /// Most recent KV-event time for any replica; absent means "not yet observed".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_at: Option<Time>,

    /// The engines' prefix-cache hit rate across this backend's replicas, decimal in [0,1]:
    /// query-weighted (Σ `vllm:prefix_cache_hits_total` / Σ `vllm:prefix_cache_queries_total`
    /// over the replicas that report them, cumulative since each engine started). Unset until a
    /// replica reported lookups; absence is not 0, and `"0"` means exactly zero hits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<String>,

    /// Query-weighted tier-2 reload hit rate, decimal in [0,1]. Unset = tier-2 never exercised;
    /// "0" = queried, zero reloads.
    #[serde(rename = "t2HitRate", default, skip_serializing_if = "Option::is_none")]
    pub t2_hit_rate: Option<String>,

    /// This backend's replicas whose index entries are not exact (`Healing`, `Partial`,
    /// `Stale`, `Disconnected`, `EngineDown`, `Unknown`; `docs/kv-events.md` "Coverage"), at most 32:
    /// those the index holds first, then each planned engine stream it holds nothing of
    /// (`Unknown` / `NotReported`), each group by replica id. Absent when every replica is
    /// Exact: then `prefixCount` is the engines' own count.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub inexact_replicas: Vec<ReplicaCoverage>,
}

/// One replica in `status.indexParticipation.inexactReplicas`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCoverage {
    /// Replica id (pod name, `#rank` above rank 0).
    pub replica: String,
    /// Coverage state.
    pub coverage: String,
    /// Why it is not Exact (`BootstrapIncomplete`, `ReplayTruncated`, `PublisherDisconnected`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl CacheBackendSpec {
    /// `spec.type`, or its default `LMCache`.
    pub fn effective_type(&self) -> CacheType {
        self.type_.unwrap_or(DEFAULT_CACHE_TYPE)
    }

    /// `spec.deploymentKind`, or its default `Deployment`.
    pub fn effective_deployment_kind(&self) -> DeploymentKind {
        self.deployment_kind.unwrap_or(DEFAULT_DEPLOYMENT_KIND)
    }

    /// `spec.replicas`, or its default 1.
    pub fn effective_replicas(&self) -> i32 {
        self.replicas.unwrap_or(DEFAULT_REPLICAS)
    }

    /// `spec.integration.mode`, or `Offload` when the object or field is absent.
    pub fn integration_mode(&self) -> IntegrationMode {
        self.integration
            .as_ref()
            .and_then(|i| i.mode)
            .unwrap_or(DEFAULT_INTEGRATION_MODE)
    }

    /// `spec.integration.role`, or `ReadWrite`.
    pub fn integration_role(&self) -> IntegrationRole {
        self.integration
            .as_ref()
            .and_then(|i| i.role)
            .unwrap_or(DEFAULT_INTEGRATION_ROLE)
    }

    /// `spec.integration.failOpen`, or true (nil spec or nil field ⇒ true).
    pub fn fail_open(&self) -> bool {
        self.integration
            .as_ref()
            .and_then(|i| i.fail_open)
            .unwrap_or(DEFAULT_FAIL_OPEN)
    }

    /// `spec.integration.engineHostNetwork`, or false.
    pub fn engine_host_network(&self) -> bool {
        self.integration
            .as_ref()
            .and_then(|i| i.engine_host_network)
            .unwrap_or(false)
    }

    /// True for `integration.mode: EventsOnly`.
    pub fn is_events_only(&self) -> bool {
        self.integration_mode() == IntegrationMode::EventsOnly
    }

    /// `spec.observation.modelID` when present and non-empty.
    pub fn model_id(&self) -> Option<&str> {
        self.observation
            .as_ref()
            .and_then(|o| o.model_id.as_deref())
            .filter(|s| !s.is_empty())
    }

    /// `spec.observation.firstEventTimeout` as a duration, or the 5m default when absent or
    /// unparsable.
    pub fn first_event_timeout(&self) -> std::time::Duration {
        self.observation
            .as_ref()
            .and_then(|o| o.first_event_timeout.as_deref())
            .and_then(super::parse_duration)
            .unwrap_or(std::time::Duration::from_secs(300))
    }

    /// The `engineSelector.matchLabels` when present and non-empty (an empty map claims nothing).
    pub fn match_labels(&self) -> Option<&BTreeMap<String, String>> {
        self.engine_selector
            .as_ref()
            .map(|s| &s.match_labels)
            .filter(|m| !m.is_empty())
    }
}

/// The CacheBackends of `namespace` whose `engineSelector` selects a pod with `labels`, by name
/// (the first one wires the pod; spec 000 "Mutating Pod webhook" → Selection). An empty
/// selector claims nothing; a backend without a namespace counts as the pod's. The Pod webhook
/// selects with it, and the engine-pod Events controller finds with it the selected pods that
/// were admitted without the webhook.
pub fn selecting_backends<'a, B: std::borrow::Borrow<CacheBackend>>(
    backends: &'a [B],
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<&'a CacheBackend> {
    let mut matching: Vec<&CacheBackend> = backends
        .iter()
        .map(std::borrow::Borrow::borrow)
        .filter(|cb| {
            cb.metadata
                .namespace
                .as_deref()
                .is_none_or(|ns| ns.is_empty() || ns == namespace)
        })
        .filter(|cb| {
            cb.spec
                .match_labels()
                .is_some_and(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
        })
        .collect();
    matching.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    matching
}

impl LmCacheSpec {
    /// `chunkSizeTokens`, or 256.
    pub fn effective_chunk_size_tokens(&self) -> i32 {
        self.chunk_size_tokens
            .unwrap_or(DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS)
    }

    /// `workerPort`, or 5555.
    pub fn effective_worker_port(&self) -> i32 {
        self.worker_port.unwrap_or(DEFAULT_LMCACHE_WORKER_PORT)
    }

    /// `hostMemory.capacity`, or `4Gi`.
    pub fn effective_host_memory_capacity(&self) -> Quantity {
        self.host_memory
            .as_ref()
            .and_then(|h| h.capacity.clone())
            .unwrap_or_else(|| Quantity(DEFAULT_LMCACHE_HOST_MEMORY_CAPACITY.to_string()))
    }
}

/// The part of a CacheBackend's spec a wired engine pod runs by — what the node plan needs and
/// what a later spec edit does not change in a running pod (its containers, env and volumes
/// were rendered at admission). The Pod webhook records it on each pod it wires (annotation
/// `inferencecache.io/wired-spec`, JSON of this type: [`WiredSpec::to_annotation`]); the node
/// plan reads it back ([`WiredSpec::from_annotation`]) instead of the current spec, and says
/// which fields changed since ([`WiredSpec::changed_fields`]).
///
/// Compatibility: unknown fields (a newer writer's) are ignored; a field added later must carry
/// `#[serde(default)]` so records written before it still parse. The fields here are required:
/// a record without one (edited by hand) is unreadable rather than read as a zero port.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct WiredSpec {
    /// The CacheBackend's `metadata.generation` at admission, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// `spec.runtime`.
    pub runtime: Runtime,
    /// `spec.type` (defaulted).
    pub cache_type: CacheType,
    /// `spec.integration.mode` (defaulted).
    pub integration_mode: IntegrationMode,
    /// `spec.lmCache.workerPort` (defaulted).
    pub worker_port: i32,
    /// `spec.lmCache.hostMemory.capacity` (defaulted), a Kubernetes quantity.
    pub host_memory_capacity: String,
    /// `spec.observation.modelID`, when set and non-empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
}

impl WiredSpec {
    /// What `cb` wires a pod with now.
    pub fn of(cb: &CacheBackend) -> Self {
        let spec = &cb.spec;
        let lm = spec.lm_cache.clone().unwrap_or_default();
        WiredSpec {
            generation: cb.metadata.generation,
            runtime: spec.runtime,
            cache_type: spec.effective_type(),
            integration_mode: spec.integration_mode(),
            worker_port: lm.effective_worker_port(),
            host_memory_capacity: lm.effective_host_memory_capacity().0,
            model_id: spec.model_id().map(str::to_string),
        }
    }

    /// The annotation value (compact JSON).
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses an annotation value.
    ///
    /// # Errors
    /// The JSON error when `value` is not a `WiredSpec` (written by another version, edited).
    pub fn from_annotation(value: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(value)
    }

    /// The spec fields (paths) whose value in `now` differs from this record; the generation
    /// is not compared.
    pub fn changed_fields(&self, now: &WiredSpec) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.runtime != now.runtime {
            out.push("spec.runtime");
        }
        if self.cache_type != now.cache_type {
            out.push("spec.type");
        }
        if self.integration_mode != now.integration_mode {
            out.push("spec.integration.mode");
        }
        if self.worker_port != now.worker_port {
            out.push("spec.lmCache.workerPort");
        }
        if self.host_memory_capacity != now.host_memory_capacity {
            out.push("spec.lmCache.hostMemory.capacity");
        }
        if self.model_id != now.model_id {
            out.push("spec.observation.modelID");
        }
        out
    }
}

impl AutoscalingSpec {
    /// `targetCPUUtilizationPercent`, or 80.
    pub fn effective_target_cpu_utilization_percent(&self) -> i32 {
        self.target_cpu_utilization_percent
            .unwrap_or(DEFAULT_TARGET_CPU_UTILIZATION_PERCENT)
    }
}

impl Runtime {
    /// The wire spelling (`VLLM`, `SGLang`).
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Vllm => "VLLM",
            Runtime::SgLang => "SGLang",
        }
    }
}

impl CacheType {
    /// The wire spelling (`LMCache`, `SGLangHiCache`).
    pub fn as_str(self) -> &'static str {
        match self {
            CacheType::LMCache => "LMCache",
            CacheType::SGLangHiCache => "SGLangHiCache",
        }
    }
}

impl RemoteProvider {
    /// The wire spelling (`Redis`, `LMCacheServer`, `Mooncake`).
    pub fn as_str(self) -> &'static str {
        match self {
            RemoteProvider::Redis => "Redis",
            RemoteProvider::LMCacheServer => "LMCacheServer",
            RemoteProvider::Mooncake => "Mooncake",
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn minimal_spec_round_trips_without_materialising_nested_objects() {
        let json = serde_json::json!({"runtime": "VLLM"});
        let spec: CacheBackendSpec = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(spec.runtime, Runtime::Vllm);
        assert!(spec.integration.is_none());
        assert_eq!(serde_json::to_value(&spec).unwrap(), json);
    }

    #[test]
    fn effective_defaults() {
        let spec = CacheBackendSpec::default();
        assert_eq!(spec.effective_type(), CacheType::LMCache);
        assert_eq!(spec.effective_deployment_kind(), DeploymentKind::Deployment);
        assert_eq!(spec.effective_replicas(), 1);
        assert_eq!(spec.integration_mode(), IntegrationMode::Offload);
        assert_eq!(spec.integration_role(), IntegrationRole::ReadWrite);
        assert!(spec.fail_open());
        assert!(!spec.is_events_only());
        assert_eq!(
            spec.first_event_timeout(),
            std::time::Duration::from_secs(300)
        );
        let lm = LmCacheSpec::default();
        assert_eq!(lm.effective_chunk_size_tokens(), 256);
        assert_eq!(lm.effective_worker_port(), 5555);
        assert_eq!(lm.effective_host_memory_capacity().0, "4Gi");
    }

    #[test]
    fn explicit_false_fail_open_is_kept() {
        let spec: CacheBackendSpec = serde_json::from_value(serde_json::json!({
            "runtime": "SGLang",
            "integration": {"failOpen": false, "mode": "EventsOnly"}
        }))
        .unwrap();
        assert_eq!(spec.runtime, Runtime::SgLang);
        assert!(!spec.fail_open());
        assert!(spec.is_events_only());
        let back = serde_json::to_value(&spec).unwrap();
        assert_eq!(back["integration"]["failOpen"], serde_json::json!(false));
    }

    #[test]
    fn enum_spellings() {
        fn s<T: Serialize>(v: T) -> String {
            serde_json::to_string(&v).unwrap()
        }
        assert_eq!(s(Runtime::Vllm), "\"VLLM\"");
        assert_eq!(s(Runtime::SgLang), "\"SGLang\"");
        assert_eq!(s(CacheType::SGLangHiCache), "\"SGLangHiCache\"");
        assert_eq!(s(RemoteProvider::LMCacheServer), "\"LMCacheServer\"");
        assert_eq!(
            s(HiCacheWritePolicy::WriteThroughSelective),
            "\"write_through_selective\""
        );
        assert_eq!(s(HiCacheIoBackend::KernelAscend), "\"kernel_ascend\"");
        assert_eq!(
            s(HiCacheMemoryLayout::PageFirstKvSplit),
            "\"page_first_kv_split\""
        );
        assert_eq!(Runtime::SgLang.as_str(), "SGLang");
        assert!(serde_json::from_str::<Runtime>("\"vllm\"").is_err());
        assert!(serde_json::from_str::<CacheType>("\"Mooncake\"").is_err());
    }
}
