//! Applying a stream's deltas: stores, removes and clears of (block, replica) entries — the
//! per-block loop over a run's prefetched table slots, the replica's key vector (swap-remove,
//! positions kept in the holders), tier counts, and the per-stream cap and tenant quota checks
//! a store triggers. What [`PrefixIndex::apply_delta`] and a resync's slices run.
use ic_shared::kv::coverage::{self, Coverage};
use ic_shared::proto::{self, kv_op::Op};
use thiserror::Error;

use super::holders::{holder, is_t2, pos_of, Holders, SetOutcome};
use super::table::BlockTable;
use super::{Partition, PartitionId, PartitionState, PrefixIndex, ReplicaPart, ReplicaSlot, Tier};

/// Why a delta could not be applied; the agent is asked for a resync.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ApplyError {
    /// The stream is not known (no snapshot yet, or it belongs to another node).
    #[error("stream {stream_id} is unknown on node {node}")]
    UnknownStream {
        /// Stream id.
        stream_id: String,
        /// Node that sent the delta.
        node: String,
    },
    /// The delta's seq does not follow the last applied one.
    #[error("stream {stream_id}: expected delta seq {expected}, got {got}")]
    SequenceGap {
        /// Stream id.
        stream_id: String,
        /// Next seq the index expected.
        expected: u64,
        /// Seq received.
        got: u64,
    },
    /// The delta carries no stream descriptor.
    #[error("delta without a stream descriptor")]
    MissingStream,
}

impl ApplyError {
    /// Stable metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            ApplyError::UnknownStream { .. } => "unknown_stream",
            ApplyError::SequenceGap { .. } => "sequence_gap",
            ApplyError::MissingStream => "missing_stream",
        }
    }
}

impl PrefixIndex {
    pub(super) fn intern(&mut self, p: Partition) -> PartitionId {
        if let Some(id) = self.partition_ids.get(&p) {
            return *id;
        }
        let id = self.partitions.len() as PartitionId;
        self.tenant_partitions
            .entry(p.tenant.clone())
            .or_default()
            .push(id);
        self.partitions.push(PartitionState {
            key: p.clone(),
            blocks: BlockTable::new(self.seed),
        });
        self.partition_ids.insert(p, id);
        id
    }

    /// The replica's part for (adapter, block size), created (and the partition interned) on
    /// first use. Returns its index in `replica.parts`.
    pub(super) fn part_for(
        &mut self,
        slot: ReplicaSlot,
        adapter: &str,
        block_size: u32,
    ) -> Option<usize> {
        let r = self.replica(slot)?;
        if let Some(i) = r.parts.position(block_size, adapter) {
            return Some(i);
        }
        let p = Partition {
            tenant: r.desc.tenant.clone(),
            model: r.desc.model.clone(),
            hash_scheme: r.desc.hash_scheme.clone(),
            adapter: adapter.to_string(),
            block_size,
        };
        let pid = self.intern(p);
        let r = self.replica_mut(slot)?;
        Some(r.parts.push(ReplicaPart {
            pid,
            adapter: adapter.to_string(),
            block_size,
            keys: Vec::new(),
        }))
    }

    /// Applies one delta from `node`. On error nothing is changed and the caller asks the agent
    /// for a resync.
    pub fn apply_delta(
        &mut self,
        node: &str,
        delta: &proto::StreamDelta,
    ) -> Result<(), ApplyError> {
        let desc = delta.stream.as_ref().ok_or(ApplyError::MissingStream)?;
        let found = self
            .slot_by_stream
            .get(&desc.stream_id)
            .copied()
            .and_then(|s| self.replica(s).map(|r| (s, r)))
            .filter(|(_, r)| r.node == node);
        let Some((slot, replica)) = found else {
            return Err(ApplyError::UnknownStream {
                stream_id: desc.stream_id.clone(),
                node: node.to_string(),
            });
        };
        let expected = replica.seq + 1;
        if delta.seq != expected {
            return Err(ApplyError::SequenceGap {
                stream_id: desc.stream_id.clone(),
                expected,
                got: delta.seq,
            });
        }
        for op in &delta.ops {
            match &op.op {
                Some(Op::Store(s)) => {
                    let Some(part) = self.part_for(slot, &s.adapter, s.block_size) else {
                        continue;
                    };
                    self.store(slot, part, &s.content_keys, Tier::from_proto(s.tier));
                }
                Some(Op::Remove(r)) => {
                    let Some(part) = self.find_part(slot, &r.adapter, r.block_size) else {
                        continue;
                    };
                    self.remove(slot, part, &r.content_keys);
                }
                Some(Op::Clear(_)) => self.clear_replica(slot),
                None => {}
            }
        }
        if let Some(r) = self.replica_mut(slot) {
            r.seq = delta.seq;
            r.stale = false;
            if delta.last_event_unix_ms > r.last_event_unix_ms {
                r.last_event_unix_ms = delta.last_event_unix_ms;
            }
        }
        self.set_coverage(
            slot,
            Coverage::from_proto(delta.coverage, &delta.coverage_reason),
        );
        Ok(())
    }

    pub(super) fn find_part(
        &self,
        slot: ReplicaSlot,
        adapter: &str,
        block_size: u32,
    ) -> Option<usize> {
        self.replica(slot)?.parts.position(block_size, adapter)
    }

    /// Records that `slot` holds `keys` (in its part `part`) at `tier`. Idempotent.
    pub(super) fn store(&mut self, slot: ReplicaSlot, part: usize, keys: &[u64], tier: Tier) {
        let Some(replica) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        let Some(rp) = replica.parts.get_mut(part) else {
            return;
        };
        let Some(ps) = self.partitions.get_mut(rp.pid as usize) else {
            return;
        };
        let arena = &mut self.arena;
        let t2 = tier == Tier::T2;
        let pid = rp.pid;
        // Only tenants with a quota track the order their blocks arrived in.
        let mut fifo = if self.quotas.is_empty() {
            None
        } else {
            self.tenant_fifo.get_mut(&ps.key.tenant)
        };
        let room = self.max_blocks_per_stream.saturating_sub(replica.blocks);
        ps.blocks.prefetch(keys);
        let (mut added, mut t2_up, mut t2_down, mut refused) = (0usize, 0usize, 0usize, 0usize);
        let mut new_blocks = 0usize;
        for &key in keys {
            let pos = rp.keys.len() as u32;
            if added >= room {
                // At the per-stream cap: tier changes of held blocks still apply, new blocks
                // are not indexed.
                match ps.blocks.get_mut(key) {
                    Some(h) if h.find(arena, slot).is_some() => match h.set(arena, slot, t2, pos) {
                        SetOutcome::TierChanged if t2 => t2_up += 1,
                        SetOutcome::TierChanged => t2_down += 1,
                        _ => {}
                    },
                    _ => refused += 1,
                }
                continue;
            }
            let outcome = match ps
                .blocks
                .get_mut_or_insert(key, || Holders::one(holder(slot, t2, pos)))
            {
                Some(h) => h.set(arena, slot, t2, pos),
                None => {
                    // A new block of the partition (and so of its tenant).
                    if let Some(f) = fifo.as_mut() {
                        f.push(pid, key);
                        new_blocks += 1;
                    }
                    SetOutcome::Added
                }
            };
            match outcome {
                SetOutcome::Added => {
                    rp.keys.push(key);
                    added += 1;
                    t2_up += usize::from(t2);
                }
                SetOutcome::TierChanged if t2 => t2_up += 1,
                SetOutcome::TierChanged => t2_down += 1,
                SetOutcome::Unchanged => {}
            }
        }
        replica.blocks += added;
        replica.t2_blocks = (replica.t2_blocks + t2_up).saturating_sub(t2_down);
        if refused > 0 {
            let before = replica.effective_coverage().state;
            replica.limited = Some(coverage::STREAM_CAP_EXCEEDED);
            self.coverage_tally.moved(
                &replica.desc,
                Some(before),
                Some(replica.effective_coverage().state),
            );
            self.stream_cap_refusals += refused as u64;
        }
        self.entries += added;
        if new_blocks > 0 {
            let tenant = ps.key.tenant.clone();
            self.enforce_quota(&tenant);
        }
    }

    /// Drops `slot`'s copies of `keys` (in its part `part`); unknown keys are ignored.
    pub(super) fn remove(&mut self, slot: ReplicaSlot, part: usize, keys: &[u64]) {
        let Some(replica) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        let Some(rp) = replica.parts.get_mut(part) else {
            return;
        };
        let Some(ps) = self.partitions.get_mut(rp.pid as usize) else {
            return;
        };
        let arena = &mut self.arena;
        ps.blocks.prefetch(keys);
        let (mut removed, mut t2_removed) = (0usize, 0usize);
        for &key in keys {
            // Unless it is the one removed, the last key of the replica's vector moves into the
            // hole and its holder learns the new position: fetch its slot too.
            if let Some(&last) = rp.keys.last() {
                ps.blocks.prefetch_key(last);
            }
            let Some(h) = ps.blocks.get_mut(key) else {
                continue;
            };
            let (gone, rest) = h.remove(arena, slot);
            let Some(gone) = gone else {
                continue;
            };
            match rest {
                Some(rest) => *h = rest,
                None => {
                    ps.blocks.remove(key);
                }
            }
            removed += 1;
            t2_removed += usize::from(is_t2(gone));
            // Swap-remove from the replica's key vector; the key moved into the hole learns its
            // new position.
            let pos = pos_of(gone) as usize;
            if pos < rp.keys.len() {
                rp.keys.swap_remove(pos);
                if let Some(&moved) = rp.keys.get(pos) {
                    if let Some(mh) = ps.blocks.get_mut(moved) {
                        mh.set_pos(arena, slot, pos as u32);
                    }
                }
            }
        }
        if rp.keys.capacity() > 4 * rp.keys.len() + 16 {
            rp.keys.shrink_to(2 * rp.keys.len());
        }
        replica.blocks = replica.blocks.saturating_sub(removed);
        replica.t2_blocks = replica.t2_blocks.saturating_sub(t2_removed);
        self.entries = self.entries.saturating_sub(removed);
    }

    pub(super) fn clear_replica(&mut self, slot: ReplicaSlot) {
        let Some(replica) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        replica.t2_blocks = 0;
        replica.blocks = 0;
        // Nothing is held any more, so nothing the index dropped is missing.
        let before = replica.effective_coverage().state;
        replica.limited = None;
        self.coverage_tally.moved(
            &replica.desc,
            Some(before),
            Some(replica.effective_coverage().state),
        );
        for rp in replica.parts.iter_mut() {
            let Some(ps) = self.partitions.get_mut(rp.pid as usize) else {
                continue;
            };
            ps.blocks.prefetch(&rp.keys);
            for key in std::mem::take(&mut rp.keys) {
                let Some(h) = ps.blocks.get_mut(key) else {
                    continue;
                };
                let (gone, rest) = h.remove(&mut self.arena, slot);
                match rest {
                    Some(rest) => *h = rest,
                    None => {
                        ps.blocks.remove(key);
                    }
                }
                if gone.is_some() {
                    self.entries = self.entries.saturating_sub(1);
                }
            }
        }
    }
}
