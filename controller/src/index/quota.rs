//! Tenant quotas (CacheTenant `spec.quota.maxIndexEntries`) and the per-stream block cap: each
//! tenant's blocks in arrival order, eviction of the oldest beyond its quota (plus headroom for
//! the controller's own probe blocks), and the counters of what either limit dropped.
use std::collections::HashMap;

use ic_shared::kv::coverage;

use super::{holders, PartitionId, PrefixIndex, ReplicaSlot};

/// A tenant's blocks in arrival order, for its quota (oldest evicted first).
///
/// Entries carry the arrival number of their block; `latest` holds each queued block's newest
/// number, so an entry whose block was removed and stored again (a newer entry exists) or that
/// was already evicted is skipped when popped. The queue is compacted when it holds more than
/// twice the tenant's blocks (plus slack), so it stays proportional to what the index holds.
#[derive(Debug, Default)]
pub(super) struct TenantFifo {
    pub(super) queue: std::collections::VecDeque<(PartitionId, u64, u64)>,
    pub(super) latest: HashMap<(PartitionId, u64), u64>,
    next: u64,
}

impl TenantFifo {
    pub(super) fn push(&mut self, pid: PartitionId, key: u64) {
        self.next += 1;
        self.latest.insert((pid, key), self.next);
        self.queue.push_back((pid, key, self.next));
    }

    /// The oldest block whose entry is its newest.
    pub(super) fn pop(&mut self) -> Option<(PartitionId, u64)> {
        while let Some((pid, key, n)) = self.queue.pop_front() {
            if self.latest.get(&(pid, key)) == Some(&n) {
                self.latest.remove(&(pid, key));
                return Some((pid, key));
            }
        }
        None
    }
}

impl PrefixIndex {
    /// Sets the tenant quotas (CacheTenant `spec.quota.maxIndexEntries`, by tenant id): each
    /// tenant holds at most that many distinct blocks; storing beyond evicts the tenant's oldest
    /// blocks first (from every replica that holds them, which then read Partial /
    /// `TenantQuotaExceeded`). Blocks already held when a quota is first set are ordered by their
    /// position in the replicas' key vectors (arrival order, but for removals). A tenant absent
    /// from `quotas` has none.
    pub fn set_tenant_quotas(&mut self, quotas: HashMap<String, usize>) {
        if quotas == self.quotas {
            return;
        }
        self.tenant_fifo.retain(|t, _| quotas.contains_key(t));
        for t in quotas.keys() {
            if self.tenant_fifo.contains_key(t) {
                continue;
            }
            // Blocks held before the quota: oldest first as far as the replicas' key vectors
            // tell (each is in arrival order but for removals), position by position.
            let mut fifo = TenantFifo::default();
            let mut seen = std::collections::HashSet::new();
            let vecs: Vec<(PartitionId, &[u64])> = self
                .replicas
                .iter()
                .flatten()
                .flat_map(|r| r.parts.iter())
                .filter(|p| {
                    self.partitions
                        .get(p.pid as usize)
                        .is_some_and(|ps| &ps.key.tenant == t)
                })
                .map(|p| (p.pid, p.keys.as_slice()))
                .collect();
            let longest = vecs.iter().map(|(_, k)| k.len()).max().unwrap_or(0);
            for i in 0..longest {
                for (pid, keys) in &vecs {
                    if let Some(&k) = keys.get(i) {
                        if seen.insert((*pid, k)) {
                            fifo.push(*pid, k);
                        }
                    }
                }
            }
            self.tenant_fifo.insert(t.clone(), fifo);
        }
        self.quotas = quotas;
        let tenants: Vec<String> = self.quotas.keys().cloned().collect();
        for t in tenants {
            self.enforce_quota(&t);
        }
    }

    /// Caps the blocks one stream may hold (`usize::MAX`: none). Blocks a stream stores beyond
    /// it are not indexed, and the stream reads Partial / `StreamCapExceeded`.
    pub fn set_max_blocks_per_stream(&mut self, cap: usize) {
        self.max_blocks_per_stream = cap;
    }

    /// The tenant quotas in force ([`Self::set_tenant_quotas`]).
    pub fn tenant_quotas(&self) -> &HashMap<String, usize> {
        &self.quotas
    }

    /// Blocks evicted by tenant quotas so far, per tenant.
    pub fn quota_evictions(&self) -> &HashMap<String, u64> {
        &self.quota_evictions
    }

    /// Blocks refused by the per-stream cap so far.
    pub fn stream_cap_refusals(&self) -> u64 {
        self.stream_cap_refusals
    }

    pub(super) fn tenant_blocks(&self, tenant: &str) -> usize {
        self.tenant_partitions
            .get(tenant)
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| self.partitions.get(*id as usize))
                    .map(|p| p.blocks.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Lets `tenant` hold `blocks` more than its quota until [`Self::remove_quota_headroom`]
    /// takes them back: blocks the controller stores for itself (the routing probe's synthetic
    /// stream) so that they do not evict the tenant's real entries.
    pub fn add_quota_headroom(&mut self, tenant: &str, blocks: usize) {
        *self.quota_headroom.entry(tenant.to_string()).or_insert(0) += blocks;
    }

    /// Takes back headroom given by [`Self::add_quota_headroom`].
    pub fn remove_quota_headroom(&mut self, tenant: &str, blocks: usize) {
        if let Some(h) = self.quota_headroom.get_mut(tenant) {
            *h = h.saturating_sub(blocks);
            if *h == 0 {
                self.quota_headroom.remove(tenant);
            }
        }
    }

    /// Evicts `tenant`'s oldest blocks until it is within its quota (plus any headroom).
    pub(super) fn enforce_quota(&mut self, tenant: &str) {
        let Some(&quota) = self.quotas.get(tenant) else {
            return;
        };
        let max = quota.saturating_add(self.quota_headroom.get(tenant).copied().unwrap_or(0));
        let mut held = self.tenant_blocks(tenant);
        while held > max {
            let Some((pid, key)) = self.tenant_fifo.get_mut(tenant).and_then(TenantFifo::pop)
            else {
                break;
            };
            if self.evict_block(pid, key) {
                held -= 1;
                *self.quota_evictions.entry(tenant.to_string()).or_insert(0) += 1;
            }
        }
        // Keep the queue proportional to what the tenant holds: drop entries that are not
        // their block's newest and blocks the engines removed since.
        let partitions = &self.partitions;
        if let Some(f) = self.tenant_fifo.get_mut(tenant) {
            if f.queue.len() > 2 * held + 1024 {
                let present = |pid: PartitionId, key: u64| {
                    partitions
                        .get(pid as usize)
                        .is_some_and(|p| p.blocks.get(key).is_some())
                };
                f.latest.retain(|(pid, key), _| present(*pid, *key));
                let latest = &f.latest;
                f.queue
                    .retain(|(pid, key, n)| latest.get(&(*pid, *key)) == Some(n));
            }
        }
    }

    /// Drops block `key` of partition `pid` from every replica that holds it; they read Partial
    /// / `TenantQuotaExceeded`. False when the block is not there (any more).
    pub(super) fn evict_block(&mut self, pid: PartitionId, key: u64) -> bool {
        let Some(h) = self
            .partitions
            .get(pid as usize)
            .and_then(|p| p.blocks.get(key))
        else {
            return false;
        };
        let mut buf = [0; 1];
        let slots: Vec<ReplicaSlot> = h
            .holders(&self.arena, &mut buf)
            .iter()
            .map(|x| holders::slot_of(*x))
            .collect();
        for slot in slots {
            let part = self
                .replica(slot)
                .and_then(|r| r.parts.iter().position(|p| p.pid == pid));
            if let Some(part) = part {
                self.remove(slot, part, &[key]);
            }
            self.limit_slot(slot, coverage::TENANT_QUOTA_EXCEEDED);
        }
        true
    }
}
