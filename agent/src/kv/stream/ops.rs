//! The ops a stream hands the link: pending [`KvOp`]s coalesced by kind, adapter, block size
//! and tier, bounded ([`StreamConfig::max_pending_keys`]: on overflow they are discarded and the
//! next delta skips a sequence number, forcing a resync), and taken as deltas or snapshots.
//!
//! [`StreamConfig::max_pending_keys`]: super::StreamConfig::max_pending_keys

use ic_shared::proto::{kv_op, BlockEntry, ClearOp, KvOp, RemoveOp, StoreOp, Tier};

use super::{ApplyReport, EntryKey, StreamState};

/// Pending ops, coalescing adjacent ops of the same kind, adapter, block size and tier.
#[derive(Debug, Default)]
pub(super) struct OpBuffer {
    ops: Vec<KvOp>,
    keys: usize,
    overflowed: bool,
}

impl OpBuffer {
    /// A `Store` of content key `key` under `adapter` and `block_size` (tokens) at `tier`.
    pub(super) fn store(&mut self, adapter: &str, block_size: u32, key: u64, tier: Tier) {
        self.keys += 1;
        if let Some(KvOp {
            op: Some(kv_op::Op::Store(s)),
        }) = self.ops.last_mut()
        {
            if s.tier == tier as i32 && s.block_size == block_size && s.adapter == adapter {
                s.content_keys.push(key);
                return;
            }
        }
        self.ops.push(KvOp {
            op: Some(kv_op::Op::Store(StoreOp {
                adapter: adapter.to_string(),
                block_size,
                tier: tier as i32,
                content_keys: vec![key],
            })),
        });
    }

    /// A `Remove` of content key `key` under `adapter` and `block_size` (tokens).
    pub(super) fn remove(&mut self, adapter: &str, block_size: u32, key: u64) {
        self.keys += 1;
        if let Some(KvOp {
            op: Some(kv_op::Op::Remove(r)),
        }) = self.ops.last_mut()
        {
            if r.block_size == block_size && r.adapter == adapter {
                r.content_keys.push(key);
                return;
            }
        }
        self.ops.push(KvOp {
            op: Some(kv_op::Op::Remove(RemoveOp {
                adapter: adapter.to_string(),
                block_size,
                content_keys: vec![key],
            })),
        });
    }

    /// A clear supersedes every pending op.
    pub(super) fn clear(&mut self, reason: &str) {
        self.ops.clear();
        self.keys = 0;
        self.ops.push(KvOp {
            op: Some(kv_op::Op::Clear(ClearOp {
                reason: reason.to_string(),
            })),
        });
    }
}

impl StreamState {
    /// Keys (stored or removed blocks) in the pending ops.
    pub fn pending_keys(&self) -> usize {
        self.pending.keys
    }

    /// True when ops or a coverage change wait to be taken ([`Self::take_delta`]).
    pub fn has_pending(&self) -> bool {
        !self.pending.ops.is_empty() || self.pending.overflowed || self.coverage() != self.reported
    }

    /// Continues the delta numbering of a replaced stream of the same id whose last delta seq was
    /// `prev`: the first delta taken skips one number, so the controller sees a gap and asks for a
    /// resync instead of applying new deltas on top of the old stream's entries.
    pub fn continue_after(&mut self, prev: u64) {
        self.delta_seq = prev;
        self.pending.overflowed = true;
    }

    /// Takes the pending ops as the next delta: `(delta seq, ops, last event unix ms)`, or `None`
    /// when nothing is pending. After an overflow the seq skips one number (see module docs).
    pub fn take_delta(&mut self) -> Option<(u64, Vec<KvOp>, i64)> {
        if !self.has_pending() {
            return None;
        }
        if self.pending.overflowed {
            self.delta_seq += 1;
        }
        self.delta_seq += 1;
        let ops = std::mem::take(&mut self.pending.ops);
        self.pending = OpBuffer::default();
        self.reported = self.coverage();
        Some((self.delta_seq, ops, self.last_event_unix_ms))
    }

    /// Full state: `(delta seq, entries, stale)`. Pending ops are discarded (the snapshot includes
    /// them); deltas taken afterwards continue at seq + 1. A stale stream has no entries.
    pub fn snapshot(&mut self) -> (u64, Vec<BlockEntry>, bool) {
        self.pending = OpBuffer::default();
        self.reported = self.coverage();
        let entries = if self.stale.is_some() {
            Vec::new()
        } else {
            let mut v: Vec<BlockEntry> = self
                .held
                .iter()
                .filter_map(|(e, h)| {
                    let (adapter, block_size) = self.classes.get(e.class)?;
                    h.tier().map(|t| BlockEntry {
                        adapter: adapter.to_string(),
                        block_size,
                        content_key: e.key,
                        tier: t as i32,
                    })
                })
                .collect();
            v.sort_by(|a, b| {
                (&a.adapter, a.block_size, a.content_key).cmp(&(
                    &b.adapter,
                    b.block_size,
                    b.content_key,
                ))
            });
            v
        };
        (self.delta_seq, entries, self.stale.is_some())
    }

    pub(super) fn push_store(&mut self, e: &EntryKey, t: Tier, report: &mut ApplyReport) {
        if let Some((adapter, block_size)) = self.classes.get(e.class) {
            self.pending.store(adapter, block_size, e.key, t);
        }
        self.check_overflow(report);
    }

    /// Queues the `Remove` of entry `e`.
    pub(super) fn push_remove(&mut self, e: &EntryKey, report: &mut ApplyReport) {
        if let Some((adapter, block_size)) = self.classes.get(e.class) {
            self.pending.remove(adapter, block_size, e.key);
        }
        self.check_overflow(report);
    }

    pub(super) fn check_overflow(&mut self, report: &mut ApplyReport) {
        if self.pending.keys > self.cfg.max_pending_keys {
            self.pending.ops.clear();
            self.pending.keys = 0;
            self.pending.overflowed = true;
            report.dropped.add("pending_overflow", 1);
        }
    }
}
