//! `CacheTenant` (`inferencecache.io/v1alpha1`, namespaced, short name `ct`): a tenant's identity
//! and index quota (spec 000 "Identity" carve-out paragraph).
//!
//! The tenant id is what engine events and lookups carry; the KV-event subscriber reports
//! `tenant = <pod namespace>`, so by default a CacheTenant names its own namespace.
//!
//! Per the closed carve-out precedent, there is no `spec.quota.maxMemoryBytes` and no
//! `status.memoryUsed`: per-tenant byte budgets cannot be enforced on shared engines and the
//! observation would double-count. Only what the cache plane owns gets a quota: index entries.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired tenant identity and quota.
///
/// Printer columns: Tenant, Entries (`status.indexEntries`), Quota
/// (`spec.quota.maxIndexEntries`), Age.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "CacheTenant",
    plural = "cachetenants",
    singular = "cachetenant",
    shortname = "ct",
    namespaced,
    status = "CacheTenantStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "CacheTenant names a tenant of the KV-prefix index and bounds its index footprint (spec 000).",
    printcolumn = r#"{"name": "Tenant", "type": "string", "jsonPath": ".spec.tenantID"}"#,
    printcolumn = r#"{"name": "Entries", "type": "integer", "jsonPath": ".status.indexEntries"}"#,
    printcolumn = r#"{"name": "Quota", "type": "integer", "jsonPath": ".spec.quota.maxIndexEntries"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct CacheTenantSpec {
    /// Tenant id used by engine events and lookups. Unset means the CacheTenant's namespace.
    #[serde(rename = "tenantID", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub tenant_id: Option<String>,

    /// Bounds on the tenant's index footprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<CacheTenantQuota>,
}

/// `spec.quota`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheTenantQuota {
    /// Maximum distinct prefixes the tenant may hold in the index (≥ 0; a prefix on several
    /// replicas counts once). Over it, the index evicts the tenant's oldest prefixes first; the
    /// replicas that held them read Partial / `TenantQuotaExceeded` (their engines still hold
    /// blocks the index no longer routes to) and the condition `WithinQuota=False/QuotaExceeded`
    /// says so. When several CacheTenants name one tenant, the smallest quota applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_index_entries: Option<i64>,
}

/// Observed tenant state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheTenantStatus {
    /// `.metadata.generation` last applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Distinct prefixes the tenant currently holds (written by the controller's leader with
    /// the CacheIndex); absent = not yet computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub index_entries: Option<i64>,

    /// Prefixes the leader's index evicted to keep the tenant within its quota, since that
    /// controller process started (`inferencecache_controller_index_quota_evictions_total`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub evicted_entries: Option<i64>,

    /// Conditions keyed by type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl CacheTenant {
    /// The effective tenant id: `spec.tenantID`, else the object's namespace.
    pub fn tenant_id(&self) -> Option<&str> {
        self.spec
            .tenant_id
            .as_deref()
            .filter(|s| !s.is_empty())
            .or(self.metadata.namespace.as_deref())
    }
}
