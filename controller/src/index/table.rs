//! The block table: content key → [`Holders`], open addressing with linear probing.
//!
//! Each slot is 16 bytes — the key and its holders side by side — so a lookup costs one cache
//! line (a Swiss table keeps control bytes and buckets apart: two dependent misses). Key 0 marks
//! an empty slot; the rare content key 0 lives in a side cell. Deletion shifts the following
//! run back (no tombstones), so probe lengths stay short under churn. The table's capacity is
//! any number of slots, not only a power of two: a key's home slot is the high half of
//! `hash × capacity` (one multiply, no modulo), so a large table can grow by a quarter instead of
//! doubling. It grows at 70 % load — doubling while smaller than [`SMALL_SLOTS`], by a quarter
//! from there (a 6 M-block partition sits at 56–70 % load, not 37 % as in a power-of-two table,
//! which halves the index's largest part at fleet scale; docs/scaling.md) — and shrinks to 60 %
//! load when a quarter full after removals. Slot arrays of 4 MiB and more ask for
//! transparent huge pages (`mem::advise_huge_pages`): a probe is a random access into megabytes,
//! and with 4 KiB pages it is a TLB miss as well as a cache miss.

use super::holders::Holders;
use super::mem::{advise_huge_pages, prefetch, HUGE_MIN_BYTES};

const EMPTY: u64 = 0;

/// One slot: a key and its holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    key: u64,
    holders: Holders,
}

const VACANT: Slot = Slot {
    key: EMPTY,
    holders: Holders::VACANT,
};

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

/// Slot count (64 MiB of slots) below which the table doubles when it grows; from it on it grows
/// by a quarter. Doubling keeps small, hot tables at low load (short probes, few grows); a quarter
/// keeps a growing large table's slots within 1/0.56 of its keys (after removals the load may
/// fall to 25 % before it shrinks) at the price of more frequent grows, each moving the table
/// once (amortised ≤ 5 moves per key).
pub(super) const SMALL_SLOTS: usize = 1 << 22;

/// Slot count (1 MiB of slots) from which a resync grows a table ahead, outside the index's
/// exclusive lock ([`BlockTable::capacity_for`]); smaller grows take well under a millisecond
/// in place.
pub(super) const GROW_AHEAD_MIN_SLOTS: usize = 1 << 16;

/// Fewest slots a non-empty table keeps.
const MIN_SLOTS: usize = 16;

/// Slot `i`'s successor in probe order (wrapping at `cap`).
#[inline]
fn next_slot(i: usize, cap: usize) -> usize {
    let j = i + 1;
    if j == cap {
        0
    } else {
        j
    }
}

fn fold(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

/// Open-addressing map from content key to holders.
#[derive(Debug, Clone)]
pub(super) struct BlockTable {
    slots: Vec<Slot>,
    len: usize,
    zero: Option<Holders>,
    seed: u64,
    /// Capacity below which growth doubles ([`SMALL_SLOTS`] outside tests).
    small_slots: usize,
}

impl BlockTable {
    /// An empty table hashing with `seed` (random per index: crafted keys cannot collide on
    /// purpose).
    pub(super) fn new(seed: u64) -> Self {
        Self::with_small_slots(seed, SMALL_SLOTS)
    }

    /// [`Self::new`] with the doubling threshold at `small_slots` slots (tests reach the
    /// quarter-growth regime with small tables).
    pub(super) fn with_small_slots(seed: u64, small_slots: usize) -> Self {
        BlockTable {
            slots: Vec::new(),
            len: 0,
            zero: None,
            seed,
            small_slots: small_slots.max(MIN_SLOTS),
        }
    }

    /// Number of keys.
    pub(super) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// True when no key is present.
    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots allocated.
    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Heap bytes of the slot array.
    pub(super) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }

    /// Home slot of `key` in a table of `cap` slots: the high half of `hash × cap`, in `0..cap`.
    #[inline]
    fn ideal(&self, key: u64, cap: usize) -> usize {
        ((u128::from(fold(key ^ self.seed, MUL)) * cap as u128) >> 64) as usize
    }

    /// True when one more key would pass the 70 % load bound.
    #[inline]
    fn full(&self) -> bool {
        (self.len + 1) * 10 > self.slots.len() * 7
    }

    /// Capacity after a grow: double below `small_slots`, a quarter more from there.
    fn grown(&self) -> usize {
        self.grown_from(self.slots.len())
    }

    fn grown_from(&self, cap: usize) -> usize {
        if cap < self.small_slots {
            (cap * 2).max(MIN_SLOTS)
        } else {
            cap + cap / 4
        }
    }

    /// The capacity a table of at least [`GROW_AHEAD_MIN_SLOTS`] slots must grow to (by its
    /// usual steps) so that `extra` more keys stay within the load bound; `None` when it has
    /// room, or is small enough to grow in place cheaply.
    pub(super) fn capacity_for(&self, extra: usize) -> Option<usize> {
        let cap = self.slots.len();
        let need = self.len + extra;
        if cap < GROW_AHEAD_MIN_SLOTS || need * 10 <= cap * 7 {
            return None;
        }
        let mut grown = cap;
        while need * 10 > grown * 7 {
            grown = self.grown_from(grown);
        }
        Some(grown)
    }

    /// A copy of this table in `cap` slots (`cap` > len): built from a shared borrow, so a
    /// caller can grow a large table while lookups go on reading the original, then swap it in.
    pub(super) fn resized_copy(&self, cap: usize) -> BlockTable {
        let mut t = BlockTable {
            slots: vacant_slots(cap),
            len: self.len,
            zero: self.zero,
            seed: self.seed,
            small_slots: self.small_slots,
        };
        for s in &self.slots {
            if s.key != EMPTY {
                t.place(*s);
            }
        }
        t
    }

    /// Position of `key`, if present (key ≠ 0).
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let cap = self.slots.len();
        let mut i = self.ideal(key, cap);
        loop {
            let s = self.slots.get(i)?;
            if s.key == key {
                return Some(i);
            }
            if s.key == EMPTY {
                return None;
            }
            i = next_slot(i, cap);
        }
    }

    /// The holders of `key`.
    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<Holders> {
        if key == EMPTY {
            return self.zero;
        }
        self.find(key)
            .and_then(|i| self.slots.get(i))
            .map(|s| s.holders)
    }

    /// Mutable holders of `key`.
    #[inline]
    pub(super) fn get_mut(&mut self, key: u64) -> Option<&mut Holders> {
        if key == EMPTY {
            return self.zero.as_mut();
        }
        let i = self.find(key)?;
        self.slots.get_mut(i).map(|s| &mut s.holders)
    }

    /// Prefetches the home slots of `keys`: the CPU fetches them in parallel without waiting for
    /// them, so the probes that follow hit cache (memory-level parallelism for a run of blocks).
    #[inline]
    pub(super) fn prefetch(&self, keys: &[u64]) {
        if self.slots.is_empty() {
            return;
        }
        let cap = self.slots.len();
        for k in keys {
            if let Some(s) = self.slots.get(self.ideal(*k, cap)) {
                prefetch(s);
            }
        }
    }

    /// Prefetches the home slot of one key.
    #[inline]
    pub(super) fn prefetch_key(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        if let Some(s) = self.slots.get(self.ideal(key, self.slots.len())) {
            prefetch(s);
        }
    }

    /// The holders of `key` for update, or — when absent — inserts `make()` and returns `None`.
    /// One probe either way (the hot path of a store).
    #[inline]
    pub(super) fn get_mut_or_insert(
        &mut self,
        key: u64,
        make: impl FnOnce() -> Holders,
    ) -> Option<&mut Holders> {
        if key == EMPTY {
            if self.zero.is_none() {
                self.zero = Some(make());
                return None;
            }
            return self.zero.as_mut();
        }
        if self.full() {
            self.resize(self.grown());
        }
        let cap = self.slots.len();
        let mut i = self.ideal(key, cap);
        loop {
            let found = match self.slots.get(i) {
                Some(s) if s.key == key => true,
                Some(s) if s.key == EMPTY => false,
                Some(_) => {
                    i = next_slot(i, cap);
                    continue;
                }
                None => return None,
            };
            if found {
                return self.slots.get_mut(i).map(|s| &mut s.holders);
            }
            if let Some(s) = self.slots.get_mut(i) {
                *s = Slot {
                    key,
                    holders: make(),
                };
                self.len += 1;
            }
            return None;
        }
    }

    /// Inserts `key` (which must be absent) with `holders`.
    #[cfg(test)]
    pub(super) fn insert_new(&mut self, key: u64, holders: Holders) {
        if key == EMPTY {
            self.zero = Some(holders);
            return;
        }
        if self.full() {
            self.resize(self.grown());
        }
        self.place(Slot { key, holders });
        self.len += 1;
    }

    fn place(&mut self, slot: Slot) {
        let cap = self.slots.len();
        let mut i = self.ideal(slot.key, cap);
        while let Some(s) = self.slots.get_mut(i) {
            if s.key == EMPTY {
                *s = slot;
                return;
            }
            i = next_slot(i, cap);
        }
    }

    /// Moves every key into a fresh array of `cap` slots (`cap` > `len`). Home slots rise with
    /// the hash, so the old array is read and the new one written nearly in order.
    fn resize(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.slots, vacant_slots(cap));
        for s in old {
            if s.key != EMPTY {
                self.place(s);
            }
        }
    }

    /// Removes `key`; returns its holders.
    pub(super) fn remove(&mut self, key: u64) -> Option<Holders> {
        if key == EMPTY {
            return self.zero.take();
        }
        let mut hole = self.find(key)?;
        let removed = self.slots.get(hole).map(|s| s.holders);
        let cap = self.slots.len();
        let mut j = hole;
        loop {
            j = next_slot(j, cap);
            let Some(next) = self.slots.get(j).copied() else {
                break;
            };
            if next.key == EMPTY {
                break;
            }
            let k = self.ideal(next.key, cap);
            // `next` may move back into the hole unless its ideal slot lies cyclically in
            // (hole, j].
            let stays = if hole <= j {
                hole < k && k <= j
            } else {
                hole < k || k <= j
            };
            if stays {
                continue;
            }
            if let Some(h) = self.slots.get_mut(hole) {
                *h = next;
            }
            hole = j;
        }
        if let Some(h) = self.slots.get_mut(hole) {
            *h = VACANT;
        }
        self.len -= 1;
        if self.slots.len() > 64 && self.len * 4 < self.slots.len() {
            // Back to 60 % load: the next grow is a sixth of the keys away.
            self.resize((self.len * 10 / 6).max(64));
        }
        removed
    }

    /// Every (key, holders).
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, Holders)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.key != EMPTY)
            .map(|s| (s.key, s.holders))
            .chain(self.zero.map(|h| (EMPTY, h)))
    }
}

/// `cap` vacant slots. A large array is advised to use huge pages before its first write (the
/// advice applies to pages faulted in after it).
fn vacant_slots(cap: usize) -> Vec<Slot> {
    let mut slots = Vec::with_capacity(cap);
    if cap.saturating_mul(std::mem::size_of::<Slot>()) >= HUGE_MIN_BYTES {
        advise_huge_pages(slots.spare_capacity_mut());
    }
    slots.resize(cap, VACANT);
    slots
}

/// A fast hasher for short strings (stream ids looked up once per delta): 8 bytes per fold.
/// Stream ids come from authenticated agents and the map holds one entry per stream, so the
/// seed-free hash is no collision risk worth SipHash's cost.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StrBuild;

/// The hasher [`StrBuild`] makes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StrHasher(u64);

impl std::hash::Hasher for StrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            self.0 = fold(self.0 ^ u64::from_le_bytes(b), MUL);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.0 = fold(self.0 ^ u64::from_le_bytes(b), MUL);
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.0 = fold(self.0 ^ u64::from(i), MUL);
    }
}

impl std::hash::BuildHasher for StrBuild {
    type Hasher = StrHasher;

    fn build_hasher(&self) -> StrHasher {
        StrHasher(0x6963_2d6b_762d_7631)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::holders::{holder, Holders};
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_like_a_hash_map_under_random_churn() {
        let mut t = BlockTable::new(7);
        let mut model: HashMap<u64, Holders> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small key space (collisions, key 0) with clustered values.
            let key = x % 5000;
            let h = Holders::one(holder((step % 1000) as u32, false, 0));
            if x % 7 == 1 {
                // The one-probe upsert.
                let existed = model.contains_key(&key);
                match t.get_mut_or_insert(key, || h) {
                    Some(cur) => {
                        assert!(existed);
                        *cur = h;
                    }
                    None => assert!(!existed),
                }
                model.insert(key, h);
            } else if x.is_multiple_of(3) {
                assert_eq!(t.remove(key), model.remove(&key), "remove {key}");
            } else if let Some(cur) = t.get_mut(key) {
                *cur = h;
                model.insert(key, h);
            } else {
                assert!(!model.contains_key(&key));
                t.insert_new(key, h);
                model.insert(key, h);
            }
            if step % 20_000 == 0 {
                for (k, v) in &model {
                    assert_eq!(t.get(*k), Some(*v));
                }
            }
        }
        assert_eq!(t.len(), model.len());
        let mut got: Vec<_> = t.iter().collect();
        got.sort_by_key(|(k, _)| *k);
        let mut want: Vec<_> = model.into_iter().collect();
        want.sort_by_key(|(k, _)| *k);
        assert_eq!(got, want);
        // Emptied, it shrinks.
        for (k, _) in want {
            t.remove(k);
        }
        assert_eq!(t.len(), 0);
        assert!(t.capacity() <= 64);
        t.prefetch(&[1, 2, 3]);
    }

    /// Doubling threshold in tests: small tables reach the quarter-growth regime.
    const TEST_SMALL: usize = 1 << 8;

    /// One operation of the model-based test.
    #[derive(Debug, Clone)]
    enum Op {
        Upsert(u64, u32),
        Remove(u64),
        Get(u64),
    }

    fn ops() -> impl proptest::strategy::Strategy<Value = Vec<Op>> {
        use proptest::prelude::*;
        // Keys from a small space (collisions, key 0) and a wide one; removals weighted so
        // the table grows through both regimes and shrinks again.
        let key = prop_oneof![0..600u64, any::<u64>()];
        proptest::collection::vec(
            prop_oneof![
                4 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Upsert(k, v)),
                3 => key.clone().prop_map(Op::Remove),
                1 => key.prop_map(Op::Get),
            ],
            1..3000,
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]
        /// Across grows (doubling and by a quarter) and shrinks, the table answers as a HashMap.
        #[test]
        fn any_size_table_behaves_like_a_hash_map(ops in ops(), seed in proptest::prelude::any::<u64>()) {
            let mut t = BlockTable::with_small_slots(seed, TEST_SMALL);
            let mut model: HashMap<u64, Holders> = HashMap::new();
            for op in ops {
                match op {
                    Op::Upsert(k, v) => {
                        let h = Holders::one(holder(v % 1000, v % 2 == 0, v));
                        let existed = model.insert(k, h).is_some();
                        match t.get_mut_or_insert(k, || h) {
                            Some(cur) => {
                                proptest::prop_assert!(existed);
                                *cur = h;
                            }
                            None => proptest::prop_assert!(!existed),
                        }
                    }
                    Op::Remove(k) => proptest::prop_assert_eq!(t.remove(k), model.remove(&k)),
                    Op::Get(k) => proptest::prop_assert_eq!(t.get(k), model.get(&k).copied()),
                }
                // Load stays within the bounds; capacity is never forced to a power of two.
                proptest::prop_assert!(t.len * 10 <= t.capacity() * 7);
            }
            proptest::prop_assert_eq!(t.len(), model.len());
            for (k, v) in &model {
                proptest::prop_assert_eq!(t.get(*k), Some(*v));
            }
        }
    }

    #[test]
    fn production_tables_double_below_64_mib_and_add_a_quarter_from_there() {
        let mut t = BlockTable::new(3);
        let mut caps = Vec::new();
        let mut x = 0x1234_5678_9abc_def1u64;
        while t.capacity() <= SMALL_SLOTS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let before = t.capacity();
            t.get_mut_or_insert(x, || Holders::one(holder(1, false, 0)));
            if t.capacity() != before {
                caps.push(t.capacity());
            }
        }
        let (last, small) = caps.split_last().unwrap();
        assert!(small.iter().all(|c| c.is_power_of_two()), "{small:?}");
        assert_eq!(small.last(), Some(&SMALL_SLOTS));
        assert_eq!(*last, SMALL_SLOTS + SMALL_SLOTS / 4);
        // Just past the grow: 56 % load.
        assert_eq!(t.len() * 100 / t.capacity(), 56);
    }

    #[test]
    fn large_tables_grow_by_a_quarter_and_shrink_to_sixty_percent() {
        let mut t = BlockTable::with_small_slots(11, TEST_SMALL);
        let mut keys = Vec::new();
        let mut caps = vec![];
        for k in 1..=20_000u64 {
            let before = t.capacity();
            t.get_mut_or_insert(k * 0x9e37_79b9, || Holders::one(holder(2, true, 1)));
            keys.push(k * 0x9e37_79b9);
            if t.capacity() != before && before >= TEST_SMALL {
                // Every grow past the threshold adds a quarter.
                assert_eq!(t.capacity(), before + before / 4);
                caps.push(t.capacity());
            }
        }
        assert!(caps.len() >= 10, "{caps:?}");
        // Load after 20 000 keys: between 56 % and 70 %.
        let load = t.len() * 100 / t.capacity();
        assert!((56..=70).contains(&load), "{load} %");
        // Remove down to under a quarter: one shrink, to 60 % load.
        let cap = t.capacity();
        while t.capacity() == cap {
            let k = keys.pop().unwrap();
            assert!(t.remove(k).is_some());
        }
        assert_eq!(t.capacity(), t.len() * 10 / 6);
        for k in &keys {
            assert!(t.get(*k).is_some());
        }
    }

    #[test]
    fn probes_wrap_past_the_last_slot() {
        // Keys whose home is the last slot of a 16-slot table: their run wraps to slot 0.
        let mut t = BlockTable::with_small_slots(5, TEST_SMALL);
        let first = (2..u64::MAX).find(|k| t.ideal(*k, MIN_SLOTS) == 8).unwrap();
        t.get_mut_or_insert(first, || Holders::one(holder(0, false, 0)));
        assert_eq!(t.capacity(), MIN_SLOTS);
        let tail: Vec<u64> = (2..u64::MAX)
            .filter(|k| t.ideal(*k, MIN_SLOTS) == MIN_SLOTS - 1)
            .take(4)
            .collect();
        for (n, k) in tail.iter().enumerate() {
            t.get_mut_or_insert(*k, || Holders::one(holder(n as u32, false, 0)));
        }
        assert_eq!(t.capacity(), MIN_SLOTS, "no grow at 5 of 16");
        // Three of the four sit at the start of the array, after the wrap.
        let wrapped = t
            .slots
            .iter()
            .take(3)
            .filter(|s| tail.contains(&s.key))
            .count();
        assert_eq!(wrapped, 3, "{:?}", t.slots);
        for (n, k) in tail.iter().enumerate() {
            assert_eq!(t.get(*k), Some(Holders::one(holder(n as u32, false, 0))));
        }
        // Removing the first of the run pulls the wrapped ones back across the end.
        assert!(t.remove(tail[0]).is_some());
        for (n, k) in tail.iter().enumerate().skip(1) {
            assert_eq!(t.get(*k), Some(Holders::one(holder(n as u32, false, 0))));
        }
        assert_eq!(t.get(tail[0]), None);
        assert_eq!(t.get(first), Some(Holders::one(holder(0, false, 0))));
    }

    #[test]
    fn a_table_past_the_huge_page_threshold_still_behaves_like_a_map() {
        let mut t = BlockTable::new(0x5eed);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut keys = Vec::new();
        // Enough keys to grow through 4, 8 and 16 MiB slot arrays (advised) and back.
        while t.heap_bytes() < 4 * HUGE_MIN_BYTES {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let h = Holders::one(holder(
                (x % 1000) as u32,
                x.is_multiple_of(2),
                keys.len() as u32,
            ));
            assert!(t.get_mut_or_insert(x, || h).is_none(), "fresh key {x}");
            keys.push((x, h));
        }
        assert_eq!(t.len(), keys.len());
        assert!(t.capacity() * 16 >= 4 * HUGE_MIN_BYTES);
        t.prefetch(&[keys[0].0, keys[1].0, 12345]);
        t.prefetch_key(keys[2].0);
        for (k, h) in &keys {
            assert_eq!(t.get(*k), Some(*h));
        }
        // Remove every other key, then check both halves; then empty it.
        for (k, h) in keys.iter().step_by(2) {
            assert_eq!(t.remove(*k), Some(*h));
        }
        for (i, (k, h)) in keys.iter().enumerate() {
            assert_eq!(t.get(*k), (i % 2 == 1).then_some(*h), "key {i}");
        }
        for (k, _) in keys.iter().skip(1).step_by(2) {
            assert!(t.remove(*k).is_some());
        }
        assert!(t.is_empty());
        assert!(t.capacity() <= 64);
    }
}
