//! A small direct-mapped cache stream-id hash → replica slot, in front of the index's stream-id
//! map, for the one stream resolution every delta needs ([`super::PrefixIndex::apply_delta`]).
//!
//! Why: resolving a delta's stream through a `HashMap<String, _>` is three dependent cache
//! misses before the replica itself is read — the control bytes, the bucket, and the key's
//! string to compare — and between two deltas of one stream the block-table probes of the
//! others evict all of them (docs/benchmarks.md). Here the hash picks one 8-byte entry (a
//! 2-way set in one cache line) that names a candidate slot, so the replica is read after one
//! miss; the caller then confirms the candidate by comparing the replica's own stream id with
//! the delta's (exact, never trusted from the hash), and falls back to the map on a miss or a
//! mismatch. The cache is therefore never a source of truth: a stale entry (stream removed,
//! slot recycled, an evicted way) costs only the fallback, and nothing has to invalidate it.

use super::table::{fold, StrHasher, MUL};
use super::ReplicaSlot;

/// Low bits of an entry: `slot + 1` (0 = empty). Slots are below `holders::MAX_SLOT` < 2^30.
const SLOT_BITS: u32 = 30;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;

/// Entries per known stream (two per 2-way set: conflicts stay rare).
const ENTRIES_PER_STREAM: usize = 4;

/// Smallest table (a few cache lines).
const MIN_ENTRIES: usize = 64;

/// Stream-id hash → candidate slot, 2-way set associative (see the module docs).
#[derive(Debug, Clone)]
pub(super) struct StreamCache {
    /// `hash & !SLOT_MASK | (slot + 1)`; 0 = empty. Length: 0 or a power of two ≥ 2.
    entries: Vec<u64>,
    seed: u64,
}

impl StreamCache {
    /// An empty cache hashing with `seed`.
    pub(super) fn new(seed: u64) -> Self {
        StreamCache {
            entries: Vec::new(),
            seed,
        }
    }

    /// The hash of a stream id the other methods take.
    #[inline]
    pub(super) fn hash(&self, stream_id: &str) -> u64 {
        let mut h = StrHasher::seeded(self.seed);
        std::hash::Hasher::write(&mut h, stream_id.as_bytes());
        // Spread the last fold's bits over the whole word (index low, tag high).
        fold(std::hash::Hasher::finish(&h), MUL)
    }

    /// Index of the 2-way set of `h` (its first way; the second is next to it).
    #[inline]
    fn set_of(&self, h: u64) -> Option<usize> {
        let n = self.entries.len();
        (n >= 2).then(|| (h as usize) & (n - 1) & !1)
    }

    /// The candidate slot cached for hash `h`, if any (to be confirmed by the caller).
    #[inline]
    pub(super) fn get(&self, h: u64) -> Option<ReplicaSlot> {
        let i = self.set_of(h)?;
        let tag = h & !SLOT_MASK;
        self.entries
            .get(i..i + 2)?
            .iter()
            .find(|e| **e & SLOT_MASK != 0 && **e & !SLOT_MASK == tag)
            .map(|e| ((*e & SLOT_MASK) - 1) as ReplicaSlot)
    }

    /// Caches `slot` for hash `h`; `streams` (the number of known streams) sizes the table,
    /// which is rebuilt empty when it is too small (entries refill on the next misses).
    pub(super) fn put(&mut self, h: u64, slot: ReplicaSlot, streams: usize) {
        let want = streams
            .saturating_mul(ENTRIES_PER_STREAM)
            .next_power_of_two()
            .max(MIN_ENTRIES);
        if self.entries.len() < want {
            self.entries = vec![0; want];
        }
        let Some(i) = self.set_of(h) else {
            return;
        };
        let tag = h & !SLOT_MASK;
        let entry = tag | ((u64::from(slot) + 1) & SLOT_MASK);
        let Some(set) = self.entries.get_mut(i..i + 2) else {
            return;
        };
        // The way already holding this tag, else an empty way, else the way picked by a hash
        // bit the index does not use (a pseudo-random victim).
        let way = set
            .iter()
            .position(|e| *e & SLOT_MASK != 0 && *e & !SLOT_MASK == tag)
            .or_else(|| set.iter().position(|e| *e & SLOT_MASK == 0))
            .unwrap_or(((h >> (SLOT_BITS + 1)) & 1) as usize);
        if let Some(e) = set.get_mut(way) {
            *e = entry;
        }
    }

    /// Heap bytes of the table.
    pub(super) fn heap_bytes(&self) -> usize {
        self.entries.capacity() * 8
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn caches_candidates_and_forgets_nothing_it_was_not_told() {
        let mut c = StreamCache::new(0x5eed);
        assert_eq!(c.get(c.hash("a")), None);
        let ids: Vec<String> = (0..500).map(|i| format!("ns/pod-{i}#0")).collect();
        c.put(c.hash(&ids[0]), 0, 1);
        assert_eq!(c.heap_bytes(), MIN_ENTRIES * 8);
        // Grown with the streams (4 entries per stream, a power of two), rebuilt empty.
        c.put(c.hash(&ids[1]), 1, ids.len());
        assert_eq!(c.heap_bytes(), 2048 * 8);
        assert_eq!(c.get(c.hash(&ids[0])), None);
        assert_eq!(c.get(c.hash(&ids[1])), Some(1));
        for (slot, id) in ids.iter().enumerate() {
            c.put(c.hash(id), slot as u32, ids.len());
        }
        // Every hit names the slot that was put for that id (a 2-way set may have evicted
        // some: those miss, never answer another id's slot for a distinct hash).
        let mut hits = 0;
        for (slot, id) in ids.iter().enumerate() {
            if let Some(s) = c.get(c.hash(id)) {
                hits += 1;
                assert_eq!(s, slot as u32, "{id}");
            }
        }
        assert!(hits > 450, "{hits} of 500 cached");
        // Re-putting a tag replaces its way; the largest slot round-trips.
        let h = c.hash("ns/pod-7#0");
        c.put(h, super::super::holders::MAX_SLOT, 500);
        assert_eq!(c.get(h), Some(super::super::holders::MAX_SLOT));
        // Different seeds hash differently.
        assert_ne!(StreamCache::new(1).hash("x"), StreamCache::new(2).hash("x"));
    }

    #[test]
    fn a_full_set_evicts_one_way() {
        let mut c = StreamCache::new(3);
        c.put(c.hash("warm"), 0, 1);
        // Three hashes in one set (same index bits, different tags).
        let base = 0x10u64;
        let hs = [base | (1 << 40), base | (2 << 40), base | (3 << 40)];
        c.put(hs[0], 1, 1);
        c.put(hs[1], 2, 1);
        assert_eq!((c.get(hs[0]), c.get(hs[1])), (Some(1), Some(2)));
        c.put(hs[2], 3, 1);
        assert_eq!(c.get(hs[2]), Some(3));
        let left = [c.get(hs[0]), c.get(hs[1])];
        assert_eq!(left.iter().filter(|x| x.is_some()).count(), 1, "{left:?}");
    }
}
