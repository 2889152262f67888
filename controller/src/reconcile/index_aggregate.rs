//! What the CacheIndex status writer ([`super::cache_index`]) and the CacheTenant status writer
//! ([`super::tenants`]) share: the [`IndexAggregate`] both compute their status from (read
//! from the index under one read lock, spec 000 "Index Participation") and the field manager
//! of both writes. Its own module below the two writers, so neither imports the other for it
//! (issue 42); the CacheIndex loop calls [`super::tenants::sync_tenants`].

use std::collections::BTreeMap;

use crate::index::{IndexSnapshot, PrefixIndex};

/// Field manager of the CacheIndex and CacheTenant status writes.
pub const FIELD_MANAGER: &str = "inference-cache-controller";

/// What the status writers read from the index, copied under one read lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexAggregate {
    /// The per-replica snapshot.
    pub snapshot: IndexSnapshot,
    /// Distinct blocks per tenant.
    pub blocks_by_tenant: BTreeMap<String, usize>,
    /// Distinct blocks held at T1 by some replica, and held only at T2.
    pub blocks_by_tier: (usize, usize),
    /// Blocks evicted by tenant quotas, per tenant.
    pub quota_evictions: std::collections::HashMap<String, u64>,
    /// The tenant quotas the index enforces.
    pub quotas: std::collections::HashMap<String, usize>,
}

impl IndexAggregate {
    /// Reads `index`.
    pub fn of(index: &PrefixIndex) -> Self {
        IndexAggregate {
            snapshot: index.snapshot(),
            blocks_by_tenant: index.blocks_by_tenant(),
            blocks_by_tier: index.blocks_by_tier(),
            quota_evictions: index.quota_evictions().clone(),
            quotas: index.tenant_quotas().clone(),
        }
    }
}
