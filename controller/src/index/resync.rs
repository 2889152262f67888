//! The stream registry and resyncs: registering a node's streams from a snapshot (replica
//! slots, the stream-id order, coverage Partial / `ResyncApplying` while applying), applying
//! a resync's entries in slices so the caller can release the write lock between them
//! ([`ResyncApply`]), growing large tables ahead of a slice under a read lock
//! ([`PrefixIndex::grow_ahead`]), and dropping streams and nodes.
use std::collections::HashMap;
use std::sync::Arc;

use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::proto;

use super::holders::MAX_SLOT;
use super::table::BlockTable;
use super::{same_str, PartitionId, Parts, PrefixIndex, Replica, ReplicaNames, ReplicaSlot, Tier};

/// A node's resync being applied in slices: what [`PrefixIndex::begin_resync`] registered and
/// how far [`PrefixIndex::resync_step`] got. Holds no borrow of the index, so the caller may
/// release the index lock between steps.
#[derive(Debug)]
pub struct ResyncApply {
    generation: u64,
    /// Per snapshot of the resync: the slot it was registered in (`None`: skipped).
    slots: Vec<Option<ReplicaSlot>>,
    /// Next snapshot and entry to apply.
    stream: usize,
    entry: usize,
    /// Reused buffer of one run's keys.
    keys: Vec<u64>,
}

/// Block tables grown ahead of a resync slice ([`PrefixIndex::grow_ahead`]).
#[derive(Debug, Default)]
pub struct GrownTables {
    pub(super) tables: Vec<(PartitionId, BlockTable)>,
}

impl ResyncApply {
    /// Entries of `streams` (the resync this apply was begun with) behind the apply's position:
    /// applied, or skipped with their stream.
    pub fn entries_done(&self, streams: &[proto::StreamSnapshot]) -> u64 {
        let before: usize = streams
            .iter()
            .take(self.stream)
            .map(|s| s.entries.len())
            .sum();
        let within = streams
            .get(self.stream)
            .map_or(0, |s| self.entry.min(s.entries.len()));
        (before + within) as u64
    }
}

impl PrefixIndex {
    pub(super) fn alloc_slot(&mut self) -> Option<ReplicaSlot> {
        if let Some(s) = self.free_slots.pop() {
            return Some(s);
        }
        let s = self.replicas.len();
        if s > MAX_SLOT as usize {
            return None;
        }
        self.replicas.push(None);
        Some(s as ReplicaSlot)
    }

    /// Replaces every stream of `node` with the given snapshots (agent (re)connect or resync).
    /// Streams of the node not in `streams` are dropped. Stale snapshots register the stream with
    /// no entries.
    ///
    /// Costs what the node's streams hold plus O(log n) per stream for its place in the
    /// stream-id order: nothing here walks or sorts every stream of the index. The whole
    /// resync is applied at once: [`Self::begin_resync`] and [`Self::resync_step`] apply it in
    /// slices (the same result; see there), so the caller can release the write lock between.
    pub fn resync_node(&mut self, node: &str, streams: &[proto::StreamSnapshot]) {
        let mut apply = self.begin_resync(node, streams);
        while !self.resync_step(&mut apply, streams, usize::MAX) {}
    }

    /// Starts replacing every stream of `node` with `streams` (what [`Self::resync_node`] does
    /// at once): drops the node's streams (and streams of these ids elsewhere: the newest
    /// report wins), registers each snapshot's stream with no entries yet, its key vector sized
    /// for its snapshot, and coverage Partial / [`coverage::RESYNC_APPLYING`] — so a lookup
    /// before the last [`Self::resync_step`] sees the node's streams Partial, never Exact. A
    /// later snapshot of the same stream id replaces an earlier one (as a whole resync does).
    /// Pass the same `streams` to every [`Self::resync_step`] of the returned apply.
    pub fn begin_resync(&mut self, node: &str, streams: &[proto::StreamSnapshot]) -> ResyncApply {
        self.resync_generation += 1;
        let generation = self.resync_generation;
        self.remove_node_streams(node);
        let mut slots: Vec<Option<ReplicaSlot>> = Vec::with_capacity(streams.len());
        let mut by_id: HashMap<&str, usize> = HashMap::with_capacity(streams.len());
        for (i, snap) in streams.iter().enumerate() {
            let Some(desc) = snap.stream.clone() else {
                slots.push(None);
                continue;
            };
            // The same id earlier in this resync: the later snapshot replaces it.
            if let Some(earlier) =
                by_id.insert(snap.stream.as_ref().map_or("", |d| d.stream_id.as_str()), i)
            {
                if let Some(cell) = slots.get_mut(earlier) {
                    *cell = None;
                }
            }
            // A stream id moving between nodes: the newest report wins.
            self.remove_stream(&desc.stream_id);
            let Some(slot) = self.alloc_slot() else {
                tracing::warn!(stream = %desc.stream_id, "prefix index: replica slots exhausted");
                slots.push(None);
                continue;
            };
            self.slot_by_stream.insert(desc.stream_id.clone(), slot);
            self.order.insert(&desc.stream_id, slot);
            self.node_slots
                .entry(node.to_string())
                .or_default()
                .push(slot);
            if let Some(cell) = self.replicas.get_mut(slot as usize) {
                *cell = Some(Replica {
                    names: Arc::new(ReplicaNames {
                        replica: desc.replica.clone(),
                        stream_id: desc.stream_id.clone(),
                        node: node.to_string(),
                        backend: desc.backend.clone(),
                    }),
                    desc,
                    node: node.to_string(),
                    seq: snap.seq,
                    parts: Parts::default(),
                    blocks: 0,
                    t2_blocks: 0,
                    last_event_unix_ms: snap.last_event_unix_ms,
                    stale: snap.stale,
                    coverage: Coverage::EXACT,
                    t2_hits: None,
                    t2_queries: None,
                    cache_memory_bytes: None,
                    prefix_cache: None,
                    limited: None,
                    resync: generation,
                    silent: false,
                });
                if let Some(r) = self.replicas.get(slot as usize).and_then(Option::as_ref) {
                    self.coverage_tally
                        .moved(&r.desc, None, Some(CoverageState::Exact));
                }
            }
            self.set_coverage(
                slot,
                Coverage::new(CoverageState::Partial, coverage::RESYNC_APPLYING),
            );
            if self.node_silent(node) {
                self.set_silent(slot, true);
            }
            if !snap.stale {
                self.reserve_parts(slot, &snap.entries);
            }
            slots.push(Some(slot));
        }
        ResyncApply {
            generation,
            slots,
            stream: 0,
            entry: 0,
            keys: Vec::new(),
        }
    }

    /// Sizes `slot`'s key vectors for `entries` (one part per (adapter, block size), each
    /// reserved exactly: a resync's vectors never carry push-growth slack).
    pub(super) fn reserve_parts(&mut self, slot: ReplicaSlot, entries: &[proto::BlockEntry]) {
        let mut counts: Vec<(&str, u32, usize)> = Vec::new();
        for e in entries {
            match counts.last_mut() {
                Some((a, b, n)) if *b == e.block_size && same_str(a, &e.adapter) => *n += 1,
                _ => match counts
                    .iter_mut()
                    .find(|(a, b, _)| *b == e.block_size && same_str(a, &e.adapter))
                {
                    Some((_, _, n)) => *n += 1,
                    None => counts.push((&e.adapter, e.block_size, 1)),
                },
            }
        }
        let cap = self.max_blocks_per_stream;
        for (adapter, block_size, n) in counts {
            let Some(part) = self.part_for(slot, adapter, block_size) else {
                continue;
            };
            if let Some(rp) = self.replica_mut(slot).and_then(|r| r.parts.get_mut(part)) {
                rp.keys.reserve_exact(n.min(cap));
            }
        }
    }

    /// Applies up to `budget` more entries of `apply` (begun by [`Self::begin_resync`] with
    /// these `streams`); once the last entry is in, sets each stream's own coverage from its
    /// snapshot and returns true. Streams a later resync or removal took over since
    /// (another generation in their slot) are skipped. Applying a resync in any number of steps
    /// of any budget gives the same index as [`Self::resync_node`].
    pub fn resync_step(
        &mut self,
        apply: &mut ResyncApply,
        streams: &[proto::StreamSnapshot],
        budget: usize,
    ) -> bool {
        let mut left = budget.max(1);
        let mut keys = std::mem::take(&mut apply.keys);
        while left > 0 {
            let Some((slot, run)) = self.next_resync_run(
                &apply.slots,
                apply.generation,
                streams,
                (&mut apply.stream, &mut apply.entry),
                left,
            ) else {
                break;
            };
            // One run of entries of one (adapter, block size, tier), within the budget: one
            // store, whose slot fetches overlap.
            let Some(first) = run.first() else {
                break;
            };
            keys.clear();
            keys.extend(run.iter().map(|e| e.content_key));
            if let Some(part) = self.part_for(slot, &first.adapter, first.block_size) {
                self.store(slot, part, &keys, Tier::from_proto(first.tier));
            }
            apply.entry += run.len();
            left -= run.len();
        }
        apply.keys = keys;
        if apply.stream < streams.len() {
            return false;
        }
        for (snap, slot) in streams.iter().zip(&apply.slots) {
            let Some(slot) = *slot else {
                continue;
            };
            if self
                .replica(slot)
                .is_some_and(|r| r.resync == apply.generation)
            {
                self.set_coverage(
                    slot,
                    Coverage::from_proto(snap.coverage, &snap.coverage_reason),
                );
            }
        }
        true
    }

    /// The next run of a resync's entries from `at` = (stream, entry): at most `left` entries
    /// of one adapter, block size and tier, in a stream the apply of generation `generation`
    /// still owns (registered in `slots`, not stale). Moves `at` past the streams it skips to
    /// the run's start; `None` past the last stream. What [`Self::resync_step`] applies and
    /// [`Self::grow_ahead`] sizes for.
    pub(super) fn next_resync_run<'s>(
        &self,
        slots: &[Option<ReplicaSlot>],
        generation: u64,
        streams: &'s [proto::StreamSnapshot],
        at: (&mut usize, &mut usize),
        left: usize,
    ) -> Option<(ReplicaSlot, &'s [proto::BlockEntry])> {
        let (stream, entry) = at;
        loop {
            let snap = streams.get(*stream)?;
            let slot = slots.get(*stream).copied().flatten().filter(|s| {
                !snap.stale && self.replica(*s).is_some_and(|r| r.resync == generation)
            });
            let rest = snap.entries.get(*entry..).unwrap_or_default();
            if let (Some(slot), Some(first)) = (slot, rest.first()) {
                let n = rest
                    .iter()
                    .take(left.max(1))
                    .take_while(|e| {
                        e.block_size == first.block_size
                            && e.tier == first.tier
                            && same_str(&e.adapter, &first.adapter)
                    })
                    .count();
                return rest.get(..n).map(|run| (slot, run));
            }
            *stream += 1;
            *entry = 0;
        }
    }

    /// Grows, in copies built from `&self`, the block tables that the next `budget` entries of
    /// `apply` could push past their load bound (each entry counted as a new key of its
    /// partition; only tables of [`table::GROW_AHEAD_MIN_SLOTS`] slots and more). The caller
    /// holds an upgradable read lock meanwhile — lookups go on reading, no writer can change
    /// the tables — then upgrades and [`Self::install_grown`]s them, so the slice that follows
    /// never grows a large table under the exclusive lock. A grow of a 6 M-block partition
    /// (≈ 100–160 MiB of fresh slots) took 0.2–0.5 s, all of it a stall for every lookup when
    /// done in place (docs/scaling.md "Index at fleet scale").
    pub fn grow_ahead(
        &self,
        apply: &ResyncApply,
        streams: &[proto::StreamSnapshot],
        budget: usize,
    ) -> GrownTables {
        let mut per_pid: Vec<(PartitionId, usize)> = Vec::new();
        let (mut stream, mut entry, mut left) = (apply.stream, apply.entry, budget.max(1));
        while left > 0 {
            let Some((slot, run)) = self.next_resync_run(
                &apply.slots,
                apply.generation,
                streams,
                (&mut stream, &mut entry),
                left,
            ) else {
                break;
            };
            let pid = run.first().and_then(|first| {
                let parts = &self.replica(slot)?.parts;
                let i = parts.position(first.block_size, &first.adapter)?;
                parts.get(i).map(|p| p.pid)
            });
            if let Some(pid) = pid {
                match per_pid.iter_mut().find(|(p, _)| *p == pid) {
                    Some((_, c)) => *c += run.len(),
                    None => per_pid.push((pid, run.len())),
                }
            }
            entry += run.len();
            left -= run.len();
        }
        let tables = per_pid
            .into_iter()
            .filter_map(|(pid, n)| {
                let table = &self.partitions.get(pid as usize)?.blocks;
                let cap = table.capacity_for(n)?;
                Some((pid, table.resized_copy(cap)))
            })
            .collect();
        GrownTables { tables }
    }

    /// Swaps in tables [`Self::grow_ahead`] grew (from this index, unchanged since); returns
    /// the tables they replace, for the caller to drop after it releases the lock (freeing
    /// 100 MiB of slots is page-table work a lookup need not wait for).
    pub fn install_grown(&mut self, grown: GrownTables) -> GrownTables {
        let mut replaced = GrownTables::default();
        for (pid, table) in grown.tables {
            // A table that changed since (a contract breach) keeps growing in place instead.
            if let Some(ps) = self
                .partitions
                .get_mut(pid as usize)
                .filter(|ps| ps.blocks.len() == table.len())
            {
                replaced
                    .tables
                    .push((pid, std::mem::replace(&mut ps.blocks, table)));
            }
        }
        replaced
    }

    /// Drops every stream reported by `node`, and when it was last heard.
    pub fn remove_node(&mut self, node: &str) {
        self.remove_node_streams(node);
        self.forget_heard(node);
    }

    pub(super) fn remove_node_streams(&mut self, node: &str) {
        let streams: Vec<String> = self
            .node_slots
            .remove(node)
            .into_iter()
            .flatten()
            .filter_map(|s| self.replica(s))
            .filter(|r| r.node == node)
            .map(|r| r.desc.stream_id.clone())
            .collect();
        for s in streams {
            self.remove_stream(&s);
        }
    }

    /// Drops one stream and all its entries. True when it was known.
    pub fn remove_stream(&mut self, stream_id: &str) -> bool {
        let Some(slot) = self.slot_by_stream.remove(stream_id) else {
            return false;
        };
        self.order.remove(stream_id);
        if let Some(node) = self.replica(slot).map(|r| r.node.clone()) {
            if let Some(slots) = self.node_slots.get_mut(&node) {
                slots.retain(|s| *s != slot);
                if slots.is_empty() {
                    self.node_slots.remove(&node);
                }
            }
        }
        self.clear_replica(slot);
        self.set_silent(slot, false);
        self.set_coverage(slot, Coverage::EXACT);
        if let Some(cell) = self.replicas.get_mut(slot as usize) {
            if let Some(r) = cell.take() {
                self.coverage_tally
                    .moved(&r.desc, Some(r.effective_coverage().state), None);
            }
        }
        self.free_slots.push(slot);
        true
    }
}
