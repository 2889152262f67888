//! CacheTenant status (spec 000 CacheTenant carve-out; `docs/crds.md` "CacheTenant").
//!
//! The leader writes each CacheTenant's `status.indexEntries` — the distinct prefixes its tenant
//! (`spec.tenantID`, else the object's namespace) holds in the index — and one condition,
//! `WithinQuota`:
//!
//! | status | reason | when |
//! |---|---|---|
//! | True | `WithinQuota` | `indexEntries ≤ spec.quota.maxIndexEntries` |
//! | False | `QuotaExceeded` | above it (the message gives both numbers) |
//! | True | `NoQuota` | no `maxIndexEntries` |
//!
//! The quota is reported, not enforced: the index mirrors what the engines hold, and dropping
//! entries an engine still holds would make routes inexact (docs/kv-events.md "Coverage"). The
//! engines' own cache sizes bound a tenant's footprint; the condition and `indexEntries` show
//! it. Two CacheTenants naming the same tenant both report it. [`desired_status`] is pure; the
//! CacheIndex loop calls [`sync_tenants`] with the same index aggregate.

use std::collections::BTreeMap;

use ic_shared::crd::{
    new_condition, set_condition, CacheTenant, CacheTenantStatus, ConditionStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::Client;

/// Condition type on a CacheTenant.
pub const CONDITION_WITHIN_QUOTA: &str = "WithinQuota";

/// Condition reasons.
pub mod reason {
    /// WithinQuota=True: at or below the quota.
    pub const WITHIN_QUOTA: &str = "WithinQuota";
    /// WithinQuota=False: above the quota.
    pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";
    /// WithinQuota=True: no quota set.
    pub const NO_QUOTA: &str = "NoQuota";
}

/// The status `tenant` should have, given the index's distinct blocks per tenant id.
pub fn desired_status(
    tenant: &CacheTenant,
    blocks_by_tenant: &BTreeMap<String, usize>,
    now: Time,
) -> CacheTenantStatus {
    let id = tenant.tenant_id().unwrap_or_default();
    let entries = i64::try_from(blocks_by_tenant.get(id).copied().unwrap_or(0)).unwrap_or(i64::MAX);
    let quota = tenant.spec.quota.as_ref().and_then(|q| q.max_index_entries);
    let generation = tenant.metadata.generation;
    let condition = match quota {
        None => new_condition(
            CONDITION_WITHIN_QUOTA,
            ConditionStatus::True,
            reason::NO_QUOTA,
            format!("Tenant {id:?} holds {entries} distinct prefixes; no quota is set."),
            generation,
            now,
        ),
        Some(max) if entries <= max => new_condition(
            CONDITION_WITHIN_QUOTA,
            ConditionStatus::True,
            reason::WITHIN_QUOTA,
            format!("Tenant {id:?} holds {entries} of at most {max} distinct prefixes."),
            generation,
            now,
        ),
        Some(max) => new_condition(
            CONDITION_WITHIN_QUOTA,
            ConditionStatus::False,
            reason::QUOTA_EXCEEDED,
            format!(
                "Tenant {id:?} holds {entries} distinct prefixes, above spec.quota.maxIndexEntries \
                 ({max}). The quota is reported, not enforced: the index mirrors what the engines \
                 hold. Shrink the engines' caches (or add a CacheTenant quota you can meet)."
            ),
            generation,
            now,
        ),
    };
    let mut conditions = tenant
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    set_condition(&mut conditions, condition);
    CacheTenantStatus {
        observed_generation: generation,
        index_entries: Some(entries),
        conditions,
    }
}

/// Writes every CacheTenant whose status differs from [`desired_status`]. Returns how many were
/// written.
///
/// # Errors
/// The list's; a failed status write is logged and left for the next pass.
pub async fn sync_tenants(
    client: &Client,
    blocks_by_tenant: &BTreeMap<String, usize>,
    now: Time,
) -> Result<usize, kube::Error> {
    let all: Api<CacheTenant> = Api::all(client.clone());
    let mut written = 0;
    for t in all.list(&ListParams::default()).await?.items {
        let desired = desired_status(&t, blocks_by_tenant, now.clone());
        if t.status.as_ref() == Some(&desired) {
            continue;
        }
        let (Some(ns), Some(name)) = (t.metadata.namespace.as_deref(), t.metadata.name.as_deref())
        else {
            continue;
        };
        let api: Api<CacheTenant> = Api::namespaced(client.clone(), ns);
        let params = PatchParams {
            field_manager: Some(super::cache_index::FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        let patch = serde_json::json!({ "status": desired });
        match api.patch_status(name, &params, &Patch::Merge(patch)).await {
            Ok(_) => written += 1,
            Err(e) => {
                tracing::warn!(tenant = %format!("{ns}/{name}"), error = %e, "writing CacheTenant status failed")
            }
        }
    }
    Ok(written)
}
