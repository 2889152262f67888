//! Block events to holder counts: `BlockStored` (runs split into blocks, keys chained from the
//! parent), `BlockRemoved` and tier-scoped `AllBlocksCleared`, each moving an entry's GPU and
//! offload holders and emitting an op on a tier transition (rules in the [`super`] docs).

use std::sync::Arc;

use ic_shared::kv::content_key::{block_key, ROOT};
use ic_shared::kv::decode::{sglang, BlockRemoved, BlockStored};

use super::{
    copies, make_room, ApplyReport, Block, BlockId, EntryKey, Orphan, StreamState,
    CLEAR_ALL_BLOCKS, INDEXED_KINDS, MEDIUM_CPU_PINNED, PARTIAL,
};

/// Parent of the next block of a run.
#[derive(Clone, Copy)]
enum ParentRef {
    Known(u64),
    Pending(u64),
}

impl StreamState {
    pub(super) fn adapter(&mut self, s: &BlockStored) -> Arc<str> {
        let name = match (&s.lora_name, s.lora_id) {
            (Some(n), _) => n.clone(),
            (None, Some(id)) => id.to_string(),
            (None, None) => String::new(),
        };
        if let Some(a) = self.adapters.get(&name) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(name.as_str());
        if self.adapters.len() < 1024 {
            self.adapters.insert(name, a.clone());
        }
        a
    }

    /// Groups a removal or placeholder without `group_idx` may refer to.
    pub(super) fn groups_for(&self, group: Option<u32>) -> Vec<u32> {
        match group {
            Some(g) => vec![g],
            None if self.indexed_groups.is_empty() => vec![0],
            None => self.indexed_groups.iter().copied().collect(),
        }
    }

    /// Why a hash named by a removal or placeholder was not found: its group is not indexed, or
    /// the block is unknown.
    pub(super) fn miss_reason(&self, group: Option<u32>) -> &'static str {
        match group {
            Some(g) if !self.indexed_groups.is_empty() && !self.indexed_groups.contains(&g) => {
                "other_group"
            }
            _ => "unknown_hash",
        }
    }

    pub(super) fn on_stored(&mut self, s: &BlockStored, report: &mut ApplyReport) {
        let gpu_medium = is_gpu(s.medium.as_deref());
        if s.medium.as_deref() == Some(MEDIUM_CPU_PINNED) {
            self.in_process_host_tier = true;
        }
        if s.token_ids.is_empty() {
            // Placeholder: medium update of known blocks (of any indexed group; placeholders
            // may lack the kind).
            for h in &s.block_hashes {
                let mut found = false;
                for g in self.groups_for(s.group_idx) {
                    let id = (g, *h);
                    if self.blocks.contains_key(&id) || self.orphans.contains_key(&id) {
                        found = true;
                        self.update_media(id, report, |gpu, off| {
                            if gpu_medium {
                                *gpu += 1;
                            } else {
                                *off += 1;
                            }
                        });
                    }
                }
                if !found {
                    report.ignored.add(self.miss_reason(s.group_idx), 1);
                }
            }
            return;
        }
        if !indexed(s) {
            report.ignored.add("other_group", 1);
            return;
        }
        let g = s.group_idx.unwrap_or(0);
        self.indexed_groups.insert(g);
        let bs = if s.block_size > 0 {
            s.block_size
        } else {
            self.cfg.block_size
        };
        let Some(slices) = split_blocks(s.block_hashes.len(), &s.token_ids, bs as usize) else {
            report.dropped.add("token_mismatch", 1);
            self.events_lost = true;
            return;
        };
        let adapter = self.adapter(s);
        let class = self.classes.of(&adapter, bs);
        let content_hashed = sglang::is_content_hashed(s);
        let placed = if content_hashed {
            let Some(k) = self.content_hashed_parent(g, s.parent_block_hash) else {
                // Its position is unknowable: never a prompt root, never under a guessed parent.
                self.unplaced = true;
                self.prev_page = s.block_hashes.last().map(|h| ((g, *h), None));
                report
                    .ignored
                    .add("unknown_parent", s.block_hashes.len() as u64);
                return;
            };
            Some(k)
        } else {
            None
        };
        let mut parent = match s.parent_block_hash {
            _ if placed.is_some() => ParentRef::Known(placed.unwrap_or(ROOT)),
            None => ParentRef::Known(ROOT),
            Some(p) => {
                if let Some(b) = self.blocks.get(&(g, p)) {
                    ParentRef::Known(b.key)
                } else if let Some(k) = self.tombstones.get(&(g, p)) {
                    ParentRef::Known(*k)
                } else {
                    if !self.orphans.contains_key(&(g, p)) {
                        report.ignored.add("unknown_parent", 1);
                    }
                    ParentRef::Pending(p)
                }
            }
        };
        let (gpu, offload) = (u32::from(gpu_medium), u32::from(!gpu_medium));
        for (h, toks) in s.block_hashes.iter().zip(slices) {
            let id = (g, *h);
            let partial = toks.len() < bs as usize || bs < self.cfg.block_size;
            if partial {
                report.ignored.add("partial_block", 1);
            } else {
                self.observed_block_size = self.observed_block_size.max(bs);
            }
            match parent {
                ParentRef::Known(pk) => {
                    let key = block_key(pk, toks);
                    let entry = (!partial).then_some(EntryKey { class, key });
                    if content_hashed {
                        // The same page content at another depth has the same engine hash: each
                        // position gets its own record, the link names the page just stored.
                        let at = self.position_id(id, key);
                        self.store_block(at, key, entry, gpu, offload, report);
                        self.prev_page = Some((id, Some(key)));
                    } else {
                        self.store_block(id, key, entry, gpu, offload, report);
                        self.resolve_waiting(id, key, report);
                    }
                    parent = ParentRef::Known(key);
                }
                ParentRef::Pending(ph) => {
                    if let Some(b) = self.blocks.get(&id) {
                        // Known already (e.g. a duplicate store): its key anchors the rest.
                        let key = b.key;
                        self.update_media(id, report, |g_, o_| {
                            *g_ += gpu;
                            *o_ += offload;
                        });
                        parent = ParentRef::Known(key);
                    } else {
                        self.park(
                            id,
                            Orphan {
                                parent: ph,
                                tokens: toks.to_vec(),
                                adapter: adapter.clone(),
                                block_size: bs,
                                partial,
                                gpu,
                                offload,
                            },
                            report,
                        );
                        parent = ParentRef::Pending(*h);
                    }
                }
            }
        }
    }

    /// `AllBlocksCleared`, scoped to the tier `medium` names (issue 39 item 12):
    ///
    /// - unscoped or `GPU`: the engine's GPU cache was reset. Every GPU copy goes; with the
    ///   plan's `keeps_l2` the block keeps an offload copy (the L2 still holds it, as for a GPU
    ///   `BlockRemoved`); offload copies from events stay (the reset does not reach an offload
    ///   tier) — except when the engine keeps them in its own host memory
    ///   ([`MEDIUM_CPU_PINNED`], SGLang HiCache, whose reset clears it too): a full clear;
    /// - another medium: only offload copies go; GPU copies stay.
    ///
    /// Entries move by ordinary ops (`Store` T2, `Remove`); when nothing is left the replica is
    /// cleared (one `Clear` op) and its state is known again.
    pub(super) fn on_cleared(&mut self, medium: Option<&str>, report: &mut ApplyReport) {
        let gpu_tier = is_gpu(medium);
        self.prev_page = None;
        if gpu_tier && self.in_process_host_tier && medium.is_none() {
            self.clear(CLEAR_ALL_BLOCKS);
            return;
        }
        let keeps_l2 = self.cfg.keeps_l2;
        let ids: Vec<BlockId> = self
            .blocks
            .keys()
            .chain(self.orphans.keys())
            .copied()
            .collect();
        for id in ids {
            self.update_media(id, report, |gpu, off| {
                if gpu_tier {
                    if *gpu > 0 {
                        *gpu = 0;
                        if keeps_l2 {
                            *off = (*off).max(1);
                        }
                    }
                } else {
                    *off = 0;
                }
            });
        }
        if self.blocks.is_empty() && self.orphans.is_empty() {
            self.clear(CLEAR_ALL_BLOCKS);
        }
    }

    pub(super) fn on_removed(&mut self, r: &BlockRemoved, report: &mut ApplyReport) {
        let gpu_medium = is_gpu(r.medium.as_deref());
        let keeps_l2 = self.cfg.keeps_l2;
        for h in &r.block_hashes {
            let mut found = false;
            for g in self.groups_for(r.group_idx) {
                // A content-hashed page held at several depths: which one went is unknowable,
                // so every position goes (a subset, never a guess) and the stream says so.
                let ids = self.positions_of((g, *h));
                if ids.len() > 1 {
                    self.collision = true;
                }
                for id in ids {
                    found = true;
                    // One physical copy goes per removal (the engine's pool counts copies).
                    self.update_media(id, report, |gpu, off| {
                        if gpu_medium {
                            if *gpu > 0 {
                                *gpu -= 1;
                                if *gpu == 0 && keeps_l2 {
                                    *off = (*off).max(1);
                                }
                            }
                        } else {
                            *off = off.saturating_sub(1);
                        }
                    });
                }
            }
            if !found {
                report.ignored.add(self.miss_reason(r.group_idx), 1);
            }
        }
    }

    /// Inserts or replaces a keyed block, moving its holder counts. A store of a hash already
    /// held with the same content adds its copies (a second physical block); one with another
    /// content (an engine that hashes pages by content alone) replaces the old entry and marks
    /// the stream Partial ([`coverage::HASH_COLLISION`]): which copy a later removal means is
    /// unknowable, so the older entry is dropped rather than guessed.
    pub(super) fn store_block(
        &mut self,
        id: BlockId,
        key: u64,
        entry: Option<EntryKey>,
        gpu: u32,
        offload: u32,
        report: &mut ApplyReport,
    ) {
        self.drop_orphan(id);
        let (gpu, offload) = match self.blocks.get(&id) {
            Some(old) if old.key == key && old.entry() == entry => (
                u32::from(old.gpu).saturating_add(gpu),
                u32::from(old.offload).saturating_add(offload),
            ),
            Some(old) if old.key != key => {
                self.collision = true;
                report.dropped.add("hash_collision", 1);
                (gpu, offload)
            }
            _ => (gpu, offload),
        };
        let (gpu, offload) = (copies(gpu), copies(offload));
        let old = self.blocks.remove(&id);
        match (old.and_then(|o| o.entry()), &entry) {
            (Some(oe), Some(ne)) if oe == *ne => {
                let (og, oo) = old.map(|o| (o.gpu, o.offload)).unwrap_or_default();
                self.adjust(ne, has(gpu) - has(og), has(offload) - has(oo), report);
            }
            (oe, ne) => {
                if let (Some(oe), Some(o)) = (oe, old) {
                    self.adjust(&oe, -has(o.gpu), -has(o.offload), report);
                }
                if let Some(ne) = ne {
                    self.adjust(ne, has(gpu), has(offload), report);
                }
            }
        }
        make_room(&mut self.blocks);
        self.blocks.insert(
            id,
            Block {
                key,
                class: entry.map_or(PARTIAL, |e| e.class),
                gpu,
                offload,
            },
        );
    }

    /// Changes the media of a known block or orphan; forgets it when no copy is left.
    pub(super) fn update_media(
        &mut self,
        id: BlockId,
        report: &mut ApplyReport,
        f: impl FnOnce(&mut u32, &mut u32),
    ) {
        if let Some(o) = self.orphans.get_mut(&id) {
            f(&mut o.gpu, &mut o.offload);
            if o.gpu == 0 && o.offload == 0 {
                self.drop_orphan(id);
            }
            return;
        }
        let Some(b) = self.blocks.get(&id) else {
            return;
        };
        let (old_gpu, old_off) = (b.gpu, b.offload);
        let (mut gpu, mut off) = (u32::from(old_gpu), u32::from(old_off));
        f(&mut gpu, &mut off);
        let (gpu, off) = (copies(gpu), copies(off));
        if (gpu, off) == (old_gpu, old_off) {
            return;
        }
        let entry = b.entry();
        let key = b.key;
        if let Some(e) = &entry {
            self.adjust(e, has(gpu) - has(old_gpu), has(off) - has(old_off), report);
        }
        if gpu > 0 || off > 0 {
            if let Some(b) = self.blocks.get_mut(&id) {
                b.gpu = gpu;
                b.offload = off;
            }
        } else {
            self.blocks.remove(&id);
            self.tombstone(id, key);
        }
    }

    /// Moves an entry's holder counts by `dgpu` / `doff` (each -1, 0 or 1) in one step and emits
    /// an op when the entry's tier changes.
    pub(super) fn adjust(&mut self, e: &EntryKey, dgpu: i32, doff: i32, report: &mut ApplyReport) {
        if dgpu == 0 && doff == 0 {
            return;
        }
        make_room(&mut self.held);
        let h = self.held.entry(*e).or_default();
        let before = h.tier();
        let step = |n: u32, d: i32| -> u32 {
            match d.signum() {
                1 => n.saturating_add(1),
                -1 => n.saturating_sub(1),
                _ => n,
            }
        };
        h.gpu = step(h.gpu, dgpu);
        h.offload = step(h.offload, doff);
        let after = h.tier();
        if after.is_none() {
            self.held.remove(e);
        }
        if before != after {
            match after {
                Some(t) => self.push_store(e, t, report),
                None => self.push_remove(e, report),
            }
        }
    }
}

/// 1 when at least one copy is held.
fn has(copies: u16) -> i32 {
    i32::from(copies > 0)
}

/// Medium `None` or `GPU…` (any case) is the engine's HBM.
fn is_gpu(medium: Option<&str>) -> bool {
    match medium {
        None => true,
        Some(m) => m.len() >= 3 && m[..3].eq_ignore_ascii_case("gpu"),
    }
}

/// Whether a stored event's group is indexed (see module docs).
fn indexed(s: &BlockStored) -> bool {
    match s.kv_cache_spec_kind.as_deref() {
        Some(kind) => INDEXED_KINDS.contains(&kind),
        None => s.group_idx.unwrap_or(0) == 0,
    }
}

/// Splits a run's tokens into one slice per hash: all full except possibly the last (partial).
/// `None` when the token count cannot belong to `n` blocks of `bs`.
fn split_blocks(n: usize, tokens: &[u32], bs: usize) -> Option<Vec<&[u32]>> {
    if n == 0 {
        return Some(Vec::new());
    }
    if bs == 0 {
        return None;
    }
    let full = (n - 1).checked_mul(bs)?;
    let rem = tokens.len().checked_sub(full)?;
    if rem == 0 || rem > bs {
        return None;
    }
    let mut out: Vec<&[u32]> = tokens[..full].chunks_exact(bs).collect();
    out.push(&tokens[full..]);
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn split_blocks_rules() {
        let t: Vec<u32> = (0..36).collect();
        assert_eq!(split_blocks(3, &t, 16).map(|v| v.len()), Some(3));
        assert_eq!(split_blocks(2, &t, 16), None);
        assert_eq!(split_blocks(4, &t, 16), None);
        assert_eq!(split_blocks(0, &t, 16).map(|v| v.len()), Some(0));
        assert_eq!(split_blocks(1, &t, 0), None);
    }
}
