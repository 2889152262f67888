//! `CacheIndex` (`inferencecache.io/v1alpha1`, cluster-scoped, short name `ci`): a status-only
//! reflection of the controller's in-process KV-prefix index, for `kubectl get cacheindex`
//! (spec 000 "Identity" carve-out paragraph, "Index Participation"; DESIGN.md "Index").
//!
//! Metadata only — never KV tensors or prompt text. It is an observability surface, not a
//! routing substrate: gateways call `LookupRoute`.
//!
//! Per the v1alpha1 carve-out, `status.tenants[].memoryUsed` is deprecated and always 0 (summing
//! engine memory per tenant double-counts shared engines); it stays in the schema for wire
//! compatibility until v1beta1. Read the per-replica engine total at
//! `status.replicas[].cacheMemoryBytes` instead.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// CacheIndex spec: intentionally empty; the controller maintains the object (conventionally one,
/// named `default`).
///
/// Printer columns: Prefixes (`status.prefixes.total`), Replicas (`status.replicaCount`),
/// Changed (`status.lastUpdated`), Age.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "CacheIndex",
    plural = "cacheindexes",
    singular = "cacheindex",
    shortname = "ci",
    status = "CacheIndexStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "CacheIndex is the status-only, cluster-wide view of the KV-prefix index (spec 000).",
    printcolumn = r#"{"name": "Prefixes", "type": "integer", "jsonPath": ".status.prefixes.total"}"#,
    printcolumn = r#"{"name": "Replicas", "type": "integer", "jsonPath": ".status.replicaCount"}"#,
    printcolumn = r#"{"name": "Changed", "type": "date", "jsonPath": ".status.lastUpdated"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct CacheIndexSpec {}

/// Observed cluster-wide index aggregate.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheIndexStatus {
    /// Per-replica rows, keyed by (`tenant`, `id`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["tenant", "id"]))]
    pub replicas: Vec<ReplicaCacheStatus>,

    /// Number of replicas currently reporting. Equals the length of `replicas` unless the list
    /// was truncated (condition `Complete=False/ReplicasTruncated`).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub replica_count: i32,

    /// Per-tenant rows, keyed by `id`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["id"]))]
    pub tenants: Vec<TenantCacheStatus>,

    /// Prefix summary; always serialized.
    #[serde(default)]
    pub prefixes: PrefixSummary,

    /// Where the aggregate came from (`in-process` for the controller's own index, or a URL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_server: Option<String>,

    /// When the aggregate last changed (status is written only on change, so this is not the
    /// last poll).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_updated: Option<Time>,

    /// Conditions keyed by type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// `status.replicas[]`: one engine replica (pod × data-parallel rank) reporting to the index.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCacheStatus {
    /// Replica id as routing answers name it: the engine pod name, with `#<N>` for
    /// data-parallel ranks above 0.
    pub id: String,

    /// Tenant the replica reports under (the engine pod's namespace).
    #[serde(default)]
    pub tenant: String,

    /// Owning CacheBackend as `<namespace>/<name>`, when attributed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,

    /// Model id the replica's events carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,

    /// Distinct prefixes the replica holds in the index.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub prefix_count: i64,

    /// Cache memory in bytes for the whole replica (all tenants) — the honest memory signal at
    /// this altitude: what the engine's LMCache holds in its local (CPU) cache
    /// (`lmcache:local_cache_usage` on the engine's `/metrics`, scraped by the node agent,
    /// summed over the engine's workers). Absent when the engine does not export it (no
    /// LMCache) or it cannot be attributed to one data-parallel rank; never a guess.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub cache_memory_bytes: Option<i64>,

    /// The engine's prefix-cache hit rate since it started (`vllm:prefix_cache_hits_total /
    /// vllm:prefix_cache_queries_total`), decimal string in [0,1]; absent when the engine does
    /// not report the counters or has had no lookups (the presence bit: absent is never 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<String>,

    /// Most recent KV event from this replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_at: Option<Time>,

    /// Whether the index holds exactly what the engine holds (`Exact`, `Healing`, `Partial`,
    /// `Stale`, `Disconnected`, `EngineDown`, `Unknown`; see docs/kv-events.md "Coverage").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<String>,

    /// Why the replica is not `Exact`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage_reason: Option<String>,
}

/// `status.tenants[]`: one tenant's footprint in the index.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantCacheStatus {
    /// Tenant id (the namespace); empty is the untenanted bucket.
    #[serde(default)]
    pub id: String,

    /// Distinct prefixes the tenant holds (a prefix on several replicas counts once). The rows
    /// sum to `prefixes.total`.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub index_entries: i64,

    /// Query-weighted prefix-cache hit rate over the tenant's replicas that report one, decimal
    /// string in [0,1]; absent when none does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<String>,

    /// Deprecated: always 0 (per-tenant memory double-counts shared engines). Kept, always
    /// serialized, for v1alpha1 wire compatibility; removed at v1beta1. Read
    /// `status.replicas[].cacheMemoryBytes` instead.
    #[serde(default)]
    pub memory_used: i64,
}

/// `status.prefixes`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrefixSummary {
    /// Distinct prefixes in the index.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub total: i64,

    /// Prefixes held at tier T1 (engine HBM).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub t1: i64,

    /// Prefixes held only at tier T2 (offloaded, reloadable).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub t2: i64,
}

/// Condition types on the CacheIndex.
pub mod index_condition {
    /// True when `status.replicas` lists every reporting replica.
    pub const COMPLETE: &str = "Complete";
    /// True when every replica's coverage is `Exact` (the index holds exactly what the engines
    /// hold); False names how many are not and why.
    pub const EXACT: &str = "Exact";
}

/// Conventional name of the single CacheIndex the controller maintains.
pub const CACHE_INDEX_NAME: &str = "default";
