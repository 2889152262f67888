//! Parent links that cannot be followed yet: a run whose parent is unknown is parked (bounded by
//! [`StreamConfig::max_orphans`], oldest evicted) and indexed once the parent's key is known; a
//! forgotten block's key is kept as a bounded tombstone so a child stored later still chains.
//!
//! [`StreamConfig::max_orphans`]: super::StreamConfig::max_orphans

use ic_shared::kv::content_key::block_key;

use super::{ApplyReport, BlockId, EntryKey, Orphan, StreamState};

/// Tombstones a stream may keep whatever few blocks it holds.
pub(super) const TOMBSTONES_MIN: usize = 4096;

impl StreamState {
    /// Most tombstones kept now: a quarter of the blocks held (a pool's worth of forgotten keys
    /// is never needed: a child names a parent the engine evicted only just before), at least
    /// [`TOMBSTONES_MIN`], at most [`StreamConfig::max_tombstones`](super::StreamConfig).
    pub(super) fn tombstone_limit(&self) -> usize {
        self.cfg
            .max_tombstones
            .min(TOMBSTONES_MIN.max(self.blocks.len() / 4))
    }

    /// Keeps the content key of forgotten block `id`, evicting the oldest beyond
    /// [`Self::tombstone_limit`].
    pub(super) fn tombstone(&mut self, id: BlockId, key: u64) {
        let limit = self.tombstone_limit();
        if limit == 0 {
            return;
        }
        super::make_room(&mut self.tombstones);
        if self.tombstones.insert(id, key).is_none() {
            self.tombstone_order.push_back(id);
        }
        while self.tombstones.len() > limit {
            match self.tombstone_order.pop_front() {
                Some(old) => {
                    self.tombstones.remove(&old);
                }
                None => break,
            }
        }
    }

    pub(super) fn park(&mut self, id: BlockId, o: Orphan, report: &mut ApplyReport) {
        let parent = (id.0, o.parent);
        if self.orphans.insert(id, o).is_none() {
            self.orphan_order.push_back(id);
            self.waiting.entry(parent).or_default().push(id.1);
        }
        while self.orphans.len() > self.cfg.max_orphans {
            let Some(old) = self.orphan_order.pop_front() else {
                break;
            };
            if self.orphans.contains_key(&old) {
                self.drop_orphan(old);
                report.dropped.add("orphan_evicted", 1);
            }
        }
    }

    pub(super) fn drop_orphan(&mut self, id: BlockId) {
        if let Some(o) = self.orphans.remove(&id) {
            let parent = (id.0, o.parent);
            if let Some(list) = self.waiting.get_mut(&parent) {
                list.retain(|c| *c != id.1);
                if list.is_empty() {
                    self.waiting.remove(&parent);
                }
            }
        }
    }

    /// Indexes every parked descendant of a block whose key just became known.
    pub(super) fn resolve_waiting(&mut self, id: BlockId, key: u64, report: &mut ApplyReport) {
        let mut stack = vec![(id, key)];
        while let Some((pid, pkey)) = stack.pop() {
            let Some(children) = self.waiting.remove(&pid) else {
                continue;
            };
            for c in children {
                let cid = (pid.0, c);
                let Some(o) = self.orphans.remove(&cid) else {
                    continue;
                };
                let ckey = block_key(pkey, &o.tokens);
                let entry = (!o.partial).then(|| EntryKey {
                    class: self.classes.of(&o.adapter, o.block_size),
                    key: ckey,
                });
                self.store_block(cid, ckey, entry, o.gpu, o.offload, report);
                report.ignored.add("orphan_resolved", 1);
                stack.push((cid, ckey));
            }
        }
    }
}
