//! Compact storage of a block's holders and the index's hash function.
//!
//! A block is held by one or more replicas (engine streams), each at a tier. A holder is one
//! `u32` word, `slot << 1 | t2`, so a list of holders sorted by word is sorted by replica slot.
//! Most blocks have one or two holders, so [`Holders`] keeps up to two words inline in one `u64`;
//! longer lists spill into a [`HolderArena`] (sorted `Vec<u32>`s addressed by index). The block
//! table therefore costs 16 bytes per block (8-byte content key + 8-byte holders) plus the hash
//! table's control byte, and 4 bytes per extra holder once spilled.

use std::hash::{BuildHasher, Hasher};

/// Largest replica slot a holder word can carry.
pub(super) const MAX_SLOT: u32 = (1 << 29) - 2;

/// Marks a spilled holder list.
const SPILL: u64 = 1 << 63;

/// One holder: `slot << 1 | t2`.
pub(super) type Word = u32;

/// Makes a holder word.
pub(super) fn word(slot: u32, t2: bool) -> Word {
    (slot << 1) | u32::from(t2)
}

/// The slot of a holder word.
pub(super) fn slot_of(w: Word) -> u32 {
    w >> 1
}

/// True when the holder word is at T2.
pub(super) fn is_t2(w: Word) -> bool {
    w & 1 == 1
}

/// Spilled holder lists (more than two holders), each sorted by word.
#[derive(Debug, Default)]
pub(super) struct HolderArena {
    lists: Vec<Vec<Word>>,
    free: Vec<u32>,
}

impl HolderArena {
    fn alloc(&mut self, list: Vec<Word>) -> u32 {
        match self.free.pop() {
            Some(i) => {
                if let Some(slot) = self.lists.get_mut(i as usize) {
                    *slot = list;
                }
                i
            }
            None => {
                self.lists.push(list);
                (self.lists.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, i: u32) -> Vec<Word> {
        let list = self
            .lists
            .get_mut(i as usize)
            .map(std::mem::take)
            .unwrap_or_default();
        self.free.push(i);
        list
    }

    fn get(&self, i: u32) -> &[Word] {
        self.lists.get(i as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    fn get_mut(&mut self, i: u32) -> Option<&mut Vec<Word>> {
        self.lists.get_mut(i as usize)
    }

    /// Heap bytes held by spilled lists (capacity, not length).
    pub(super) fn heap_bytes(&self) -> usize {
        self.lists.capacity() * std::mem::size_of::<Vec<Word>>()
            + self.free.capacity() * 4
            + self.lists.iter().map(|l| l.capacity() * 4).sum::<usize>()
    }
}

/// A block's holders: up to two inline words, or a spilled list in the arena. Never empty (an
/// entry without holders is removed from its table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holders(u64);

/// What [`Holders::set`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SetOutcome {
    /// The replica was not a holder; it is now.
    Added,
    /// The replica held the block at the other tier; the tier changed.
    TierChanged,
    /// Nothing changed.
    Unchanged,
}

impl Holders {
    /// A list holding only `w`.
    pub(super) fn one(w: Word) -> Self {
        Holders(u64::from(w) + 1)
    }

    fn inline(self) -> Option<(Option<Word>, Option<Word>)> {
        if self.0 & SPILL != 0 {
            return None;
        }
        let lo = (self.0 & 0xFFFF_FFFF) as u32;
        let hi = (self.0 >> 32) as u32;
        Some((lo.checked_sub(1), hi.checked_sub(1)))
    }

    fn from_inline(a: Option<Word>, b: Option<Word>) -> Option<Self> {
        match (a, b) {
            (None, None) => None,
            (Some(x), None) | (None, Some(x)) => Some(Holders::one(x)),
            (Some(x), Some(y)) => {
                let (x, y) = if x <= y { (x, y) } else { (y, x) };
                Some(Holders((u64::from(x) + 1) | ((u64::from(y) + 1) << 32)))
            }
        }
    }

    fn spilled(i: u32) -> Self {
        Holders(SPILL | u64::from(i))
    }

    /// The holder words, sorted by slot. `buf` backs the inline case.
    pub(super) fn words<'a>(&self, arena: &'a HolderArena, buf: &'a mut [Word; 2]) -> &'a [Word] {
        match self.inline() {
            Some((Some(a), Some(b))) => {
                *buf = [a, b];
                &buf[..]
            }
            Some((Some(a), None)) | Some((None, Some(a))) => {
                buf[0] = a;
                &buf[..1]
            }
            Some((None, None)) => &[],
            None => arena.get((self.0 & 0xFFFF_FFFF) as u32),
        }
    }

    /// Number of holders.
    #[cfg(test)]
    pub(super) fn len(&self, arena: &HolderArena) -> usize {
        let mut buf = [0; 2];
        self.words(arena, &mut buf).len()
    }

    /// The holder word of `slot`, if it holds the block.
    pub(super) fn find(&self, arena: &HolderArena, slot: u32) -> Option<Word> {
        let mut buf = [0; 2];
        let words = self.words(arena, &mut buf);
        words
            .binary_search_by_key(&slot, |w| slot_of(*w))
            .ok()
            .and_then(|i| words.get(i).copied())
    }

    /// Adds `w`'s replica as a holder or updates its tier.
    pub(super) fn set(&mut self, arena: &mut HolderArena, w: Word) -> SetOutcome {
        let slot = slot_of(w);
        match self.inline() {
            Some((a, b)) => {
                for (x, other) in [(a, b), (b, a)] {
                    if let Some(x) = x {
                        if slot_of(x) == slot {
                            if x == w {
                                return SetOutcome::Unchanged;
                            }
                            if let Some(h) = Holders::from_inline(Some(w), other) {
                                *self = h;
                            }
                            return SetOutcome::TierChanged;
                        }
                    }
                }
                match (a, b) {
                    (Some(x), Some(y)) => {
                        let mut list = vec![x, y, w];
                        list.sort_unstable();
                        *self = Holders::spilled(arena.alloc(list));
                    }
                    _ => {
                        if let Some(h) = Holders::from_inline(a.or(b), Some(w)) {
                            *self = h;
                        }
                    }
                }
                SetOutcome::Added
            }
            None => {
                let Some(list) = arena.get_mut((self.0 & 0xFFFF_FFFF) as u32) else {
                    *self = Holders::one(w);
                    return SetOutcome::Added;
                };
                match list.binary_search_by_key(&slot, |x| slot_of(*x)) {
                    Ok(i) => {
                        if list[i] == w {
                            SetOutcome::Unchanged
                        } else {
                            list[i] = w;
                            SetOutcome::TierChanged
                        }
                    }
                    Err(i) => {
                        list.insert(i, w);
                        SetOutcome::Added
                    }
                }
            }
        }
    }

    /// Removes `slot` as a holder. Returns its word (if it held the block) and the remaining
    /// list (`None` when no holder is left; a spilled list is released then).
    pub(super) fn remove(
        self,
        arena: &mut HolderArena,
        slot: u32,
    ) -> (Option<Word>, Option<Holders>) {
        match self.inline() {
            Some((a, b)) => {
                if let Some(x) = a.filter(|x| slot_of(*x) == slot) {
                    return (Some(x), Holders::from_inline(b, None));
                }
                if let Some(y) = b.filter(|y| slot_of(*y) == slot) {
                    return (Some(y), Holders::from_inline(a, None));
                }
                (None, Some(self))
            }
            None => {
                let i = (self.0 & 0xFFFF_FFFF) as u32;
                let Some(list) = arena.get_mut(i) else {
                    return (None, None);
                };
                let Ok(pos) = list.binary_search_by_key(&slot, |x| slot_of(*x)) else {
                    return (None, Some(self));
                };
                let removed = list.remove(pos);
                if list.len() > 2 {
                    if list.capacity() > 4 * list.len() {
                        list.shrink_to(2 * list.len());
                    }
                    return (Some(removed), Some(self));
                }
                let rest = arena.release(i);
                let h = Holders::from_inline(rest.first().copied(), rest.get(1).copied());
                (Some(removed), h)
            }
        }
    }
}

/// Hashes content keys (already uniformly distributed XXH3 outputs) with one seeded folded
/// multiply: cheap, and the random per-index seed keeps crafted keys from piling into one
/// bucket.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeyBuild {
    seed: u64,
}

impl KeyBuild {
    /// A hasher builder with a random seed.
    pub(super) fn random() -> Self {
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x6963_2d6b_762d_7631u64);
        KeyBuild { seed }
    }
}

impl Default for KeyBuild {
    fn default() -> Self {
        KeyBuild::random()
    }
}

/// The hasher [`KeyBuild`] makes.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeyHasher {
    state: u64,
}

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

fn fold(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }

    fn write_u64(&mut self, k: u64) {
        self.state = fold(self.state ^ k, MUL);
    }

    fn write_u32(&mut self, k: u32) {
        self.write_u64(u64::from(k));
    }
}

impl BuildHasher for KeyBuild {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher { state: self.seed }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn slots(h: Holders, arena: &HolderArena) -> Vec<(u32, bool)> {
        let mut buf = [0; 2];
        h.words(arena, &mut buf)
            .iter()
            .map(|w| (slot_of(*w), is_t2(*w)))
            .collect()
    }

    #[test]
    fn holders_stay_sorted_inline_then_spilled_and_shrink_back() {
        assert_eq!(std::mem::size_of::<Holders>(), 8);
        let mut arena = HolderArena::default();
        let mut h = Holders::one(word(7, false));
        assert_eq!(h.set(&mut arena, word(3, true)), SetOutcome::Added);
        assert_eq!(slots(h, &arena), vec![(3, true), (7, false)]);
        assert_eq!(h.set(&mut arena, word(3, true)), SetOutcome::Unchanged);
        assert_eq!(h.set(&mut arena, word(3, false)), SetOutcome::TierChanged);
        assert_eq!(h.set(&mut arena, word(5, false)), SetOutcome::Added);
        assert_eq!(h.set(&mut arena, word(MAX_SLOT, true)), SetOutcome::Added);
        assert_eq!(
            slots(h, &arena),
            vec![(3, false), (5, false), (7, false), (MAX_SLOT, true)]
        );
        assert_eq!(h.find(&arena, 5), Some(word(5, false)));
        assert_eq!(h.find(&arena, 6), None);
        assert_eq!(h.set(&mut arena, word(7, true)), SetOutcome::TierChanged);
        let (w, rest) = h.remove(&mut arena, 5);
        assert_eq!(w, Some(word(5, false)));
        let h = rest.unwrap();
        assert_eq!(h.len(&arena), 3);
        let (_, rest) = h.remove(&mut arena, 3);
        let h = rest.unwrap();
        // Back inline: the spilled list was released.
        assert!(h.inline().is_some());
        assert_eq!(arena.free.len(), 1);
        assert_eq!(slots(h, &arena), vec![(7, true), (MAX_SLOT, true)]);
        let (none, same) = h.remove(&mut arena, 99);
        assert_eq!((none, same), (None, Some(h)));
        let (_, rest) = h.remove(&mut arena, MAX_SLOT);
        let (_, rest) = rest.unwrap().remove(&mut arena, 7);
        assert_eq!(rest, None);
    }

    #[test]
    fn key_hasher_spreads_sequential_keys() {
        let b = KeyBuild { seed: 1 };
        let mut top = std::collections::HashSet::new();
        for k in 0..1024u64 {
            top.insert(b.hash_one(k) >> 57);
        }
        assert!(top.len() > 100);
    }
}
