//! CacheTenant status (spec 000 CacheTenant carve-out; `docs/crds.md` "CacheTenant").
//!
//! Every controller replica watches CacheTenants ([`run_quotas`]) and gives its index the
//! quotas ([`quotas`]: `spec.quota.maxIndexEntries` by tenant id, the smallest when several
//! CacheTenants name one tenant). The index enforces them: storing beyond a tenant's quota
//! evicts its oldest prefixes first, and the replicas that held them read Partial /
//! `TenantQuotaExceeded` — their engines still hold blocks the index no longer routes to, and
//! that is said, not hidden.
//!
//! The leader writes each CacheTenant's `status.indexEntries` (the distinct prefixes its tenant,
//! `spec.tenantID` or the object's namespace, holds), `status.evictedEntries` and one condition,
//! `WithinQuota`:
//!
//! | status | reason | when |
//! |---|---|---|
//! | True | `NoQuota` | no `maxIndexEntries` |
//! | True | `WithinQuota` | below the quota, or nothing evicted |
//! | False | `QuotaExceeded` | at the quota with prefixes evicted (the message gives the numbers) |
//! | False | `ForeignTenant` | `spec.tenantID` names another namespace: not enforced (a CacheTenant may bound only its own namespace's tenant) |
//!
//! [`desired_status`] is pure; the CacheIndex loop calls [`sync_tenants`] with the same index
//! aggregate.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

use ic_shared::crd::{
    new_condition, set_condition, CacheTenant, CacheTenantStatus, ConditionStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::Client;

use super::index_aggregate::{IndexAggregate, FIELD_MANAGER};

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
    /// WithinQuota=False: `spec.tenantID` names another namespace; not enforced.
    pub const FOREIGN_TENANT: &str = "ForeignTenant";
}

/// True when `t` bounds its own namespace's tenant. Engine streams report tenant = pod
/// namespace, so only such a CacheTenant is enforced: one in namespace `a` naming tenant `b`
/// would let whoever may create CacheTenants in `a` evict `b`'s entries.
pub fn enforceable(t: &CacheTenant) -> bool {
    t.tenant_id().is_some() && t.tenant_id() == t.metadata.namespace.as_deref()
}

/// The quotas the index enforces: tenant id → `spec.quota.maxIndexEntries` of the
/// [`enforceable`] CacheTenants (the smallest when several in one namespace set one); tenants
/// without a quota are absent.
pub fn quotas(tenants: &[CacheTenant]) -> HashMap<String, usize> {
    let mut out: HashMap<String, usize> = HashMap::new();
    for t in tenants.iter().filter(|t| enforceable(t)) {
        let (Some(id), Some(max)) = (
            t.tenant_id(),
            t.spec.quota.as_ref().and_then(|q| q.max_index_entries),
        ) else {
            continue;
        };
        let max = usize::try_from(max.max(0)).unwrap_or(usize::MAX);
        out.entry(id.to_string())
            .and_modify(|m| *m = (*m).min(max))
            .or_insert(max);
    }
    out
}

/// Watches CacheTenants of every namespace and keeps the index's quotas equal to them until
/// `shutdown` (every replica: each has its own index).
pub async fn run_quotas(
    client: Client,
    shared: Arc<crate::state::Shared>,
    shutdown: watch::Receiver<bool>,
) {
    crate::reconcile::follow::follow_all(
        client,
        "CacheTenant",
        shutdown,
        |all: Vec<CacheTenant>| {
            let mut ix = shared.index_write(crate::state::WriteHold::TenantQuotas);
            ix.set_tenant_quotas(quotas(&all));
            shared.update_index_gauges(&ix);
            std::future::ready(())
        },
    )
    .await;
}

/// The status `tenant` should have, given what the index holds and enforces (`agg`: distinct
/// blocks, quota evictions and the quotas in force, per tenant id). The quota reported is the
/// one the index enforces for the tenant (the smallest of the CacheTenants naming it).
pub fn desired_status(tenant: &CacheTenant, agg: &IndexAggregate, now: Time) -> CacheTenantStatus {
    let id = tenant.tenant_id().unwrap_or_default();
    let entries =
        i64::try_from(agg.blocks_by_tenant.get(id).copied().unwrap_or(0)).unwrap_or(i64::MAX);
    let evicted =
        i64::try_from(agg.quota_evictions.get(id).copied().unwrap_or(0)).unwrap_or(i64::MAX);
    let own = tenant.spec.quota.as_ref().and_then(|q| q.max_index_entries);
    // What the index enforces; before the quota watch delivered it, the object's own.
    let quota = agg
        .quotas
        .get(id)
        .map(|m| i64::try_from(*m).unwrap_or(i64::MAX))
        .or(own);
    let generation = tenant.metadata.generation;
    let foreign = !enforceable(tenant);
    let condition = match quota {
        _ if foreign => new_condition(
            CONDITION_WITHIN_QUOTA,
            ConditionStatus::False,
            reason::FOREIGN_TENANT,
            format!(
                "spec.tenantID {id:?} is not this CacheTenant's namespace ({:?}): engine streams \
                 report their pod's namespace as tenant, and a CacheTenant may bound only its own, \
                 so this quota is not enforced. Create the CacheTenant in namespace {id:?}.",
                tenant.metadata.namespace.as_deref().unwrap_or_default()
            ),
            generation,
            now,
        ),
        None => new_condition(
            CONDITION_WITHIN_QUOTA,
            ConditionStatus::True,
            reason::NO_QUOTA,
            format!("Tenant {id:?} holds {entries} distinct prefixes; no quota is set."),
            generation,
            now,
        ),
        Some(max) if entries < max || evicted == 0 => new_condition(
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
                "Tenant {id:?} is at spec.quota.maxIndexEntries ({max}): the index evicted \
                 {evicted} of its oldest prefixes so far, and the replicas that held them read \
                 Partial/TenantQuotaExceeded (their engines hold blocks that are no longer \
                 routed). Raise the quota or shrink the engines' caches."
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
        evicted_entries: quota.filter(|_| !foreign).map(|_| evicted),
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
    agg: &IndexAggregate,
    now: Time,
) -> Result<usize, kube::Error> {
    let all: Api<CacheTenant> = Api::all(client.clone());
    let mut written = 0;
    for t in all.list(&ListParams::default()).await?.items {
        let desired = desired_status(&t, agg, now.clone());
        if t.status.as_ref() == Some(&desired) {
            continue;
        }
        let (Some(ns), Some(name)) = (t.metadata.namespace.as_deref(), t.metadata.name.as_deref())
        else {
            continue;
        };
        let api: Api<CacheTenant> = Api::namespaced(client.clone(), ns);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
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
