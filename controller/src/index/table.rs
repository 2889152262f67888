//! The block table: content key → [`Holders`], open addressing with linear probing.
//!
//! Each slot is 16 bytes — the key and its holders side by side — so a lookup costs one cache
//! line (a Swiss table keeps control bytes and buckets apart: two dependent misses). Key 0 marks
//! an empty slot; the rare content key 0 lives in a side cell. Deletion shifts the following
//! run back (no tombstones), so probe lengths stay short under churn. The table grows at 70 %
//! load and shrinks when a quarter full after removals. Slot arrays of 4 MiB and more ask for
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
}

impl BlockTable {
    /// An empty table hashing with `seed` (random per index: crafted keys cannot collide on
    /// purpose).
    pub(super) fn new(seed: u64) -> Self {
        BlockTable {
            slots: Vec::new(),
            len: 0,
            zero: None,
            seed,
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

    fn ideal(&self, key: u64, mask: usize) -> usize {
        (fold(key ^ self.seed, MUL) as usize) & mask
    }

    /// Position of `key`, if present (key ≠ 0).
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.ideal(key, mask);
        loop {
            let s = self.slots.get(i)?;
            if s.key == key {
                return Some(i);
            }
            if s.key == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
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
        let mask = self.slots.len() - 1;
        for k in keys {
            if let Some(s) = self.slots.get(self.ideal(*k, mask)) {
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
        if let Some(s) = self.slots.get(self.ideal(key, self.slots.len() - 1)) {
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
        if (self.len + 1) * 10 > self.slots.len() * 7 {
            self.resize((self.slots.len() * 2).max(16));
        }
        let mask = self.slots.len() - 1;
        let mut i = self.ideal(key, mask);
        loop {
            let found = match self.slots.get(i) {
                Some(s) if s.key == key => true,
                Some(s) if s.key == EMPTY => false,
                Some(_) => {
                    i = (i + 1) & mask;
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
        if (self.len + 1) * 10 > self.slots.len() * 7 {
            self.resize((self.slots.len() * 2).max(16));
        }
        self.place(Slot { key, holders });
        self.len += 1;
    }

    fn place(&mut self, slot: Slot) {
        let mask = self.slots.len() - 1;
        let mut i = self.ideal(slot.key, mask);
        while let Some(s) = self.slots.get_mut(i) {
            if s.key == EMPTY {
                *s = slot;
                return;
            }
            i = (i + 1) & mask;
        }
    }

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
        let mask = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let Some(next) = self.slots.get(j).copied() else {
                break;
            };
            if next.key == EMPTY {
                break;
            }
            let k = self.ideal(next.key, mask);
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
            let cap = (self.len * 2).next_power_of_two().max(64);
            self.resize(cap);
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
