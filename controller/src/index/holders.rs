//! Compact storage of a block's holders.
//!
//! A block is held by one or more replicas (engine streams), each at a tier. A holder is one
//! `u64`: `slot << 33 | t2 << 32 | pos`, where `pos` is the block's position in that replica's
//! key vector (so removing it there is a swap-remove, no per-replica hash set). A list sorted by
//! value is therefore sorted by replica slot. Most blocks have one holder, which [`Holders`]
//! keeps inline in its own `u64`; longer lists spill into a [`HolderArena`] (sorted vectors
//! addressed by index). With the 8-byte content key the block table pays 16 bytes per block
//! plus 8 per extra holder once spilled.

/// Largest replica slot a holder can carry.
pub(super) const MAX_SLOT: u32 = (1 << 30) - 2;

/// Marks a spilled holder list.
const SPILL: u64 = 1 << 63;

/// One holder: `slot << 33 | t2 << 32 | pos`.
pub(super) type Holder = u64;

/// Makes a holder.
pub(super) fn holder(slot: u32, t2: bool, pos: u32) -> Holder {
    (u64::from(slot) << 33) | (u64::from(t2) << 32) | u64::from(pos)
}

/// The replica slot of a holder.
#[inline]
pub(super) fn slot_of(h: Holder) -> u32 {
    (h >> 33) as u32
}

/// True when the holder keeps the block at T2.
#[inline]
pub(super) fn is_t2(h: Holder) -> bool {
    (h >> 32) & 1 == 1
}

/// The block's position in the holder's key vector.
#[inline]
pub(super) fn pos_of(h: Holder) -> u32 {
    h as u32
}

/// Holders per pool page (32 KiB). A pool grows a page at a time: what it holds never moves,
/// so a growing pool costs no copy (a flat vector doubling copied the whole pool under the
/// index's write lock — up to 16 MiB at once at 100 M entries, docs/scaling.md), and at most
/// one page per class is partly used.
const PAGE_HOLDERS: usize = 4096;

/// Chunks of one capacity in pages of [`PAGE_HOLDERS`] holders (or one chunk per page for
/// chunks larger than that), with a free list.
#[derive(Debug, Default)]
struct Pool {
    cap: usize,
    /// log2 of the chunks per page.
    shift: u32,
    pages: Vec<Vec<Holder>>,
    /// Chunks handed out so far, free ones included.
    chunks: u32,
    free: Vec<u32>,
}

impl Pool {
    /// A pool of chunks of `cap` (a power of two) holders.
    fn new(cap: usize) -> Self {
        let per_page = (PAGE_HOLDERS / cap).max(1);
        Pool {
            cap,
            shift: per_page.trailing_zeros(),
            ..Pool::default()
        }
    }

    /// A chunk: a freed one if any, else the next of the last page (a new page when full).
    #[inline]
    fn alloc(&mut self) -> u32 {
        match self.free.pop() {
            Some(i) => i,
            None => self.fresh(),
        }
    }

    #[inline(never)]
    fn fresh(&mut self) -> u32 {
        let i = self.chunks;
        let page = (i >> self.shift) as usize;
        if page == self.pages.len() {
            self.pages.push(Vec::with_capacity(self.cap << self.shift));
        }
        if let Some(p) = self.pages.get_mut(page) {
            // `extend` of a counted repeat writes in place within the page's capacity (a
            // `resize` call costs more than the two cells of the smallest class).
            p.extend(std::iter::repeat_n(0, self.cap));
        }
        self.chunks += 1;
        i
    }

    /// Page and offset of chunk `i`.
    #[inline]
    fn at(&self, i: u32) -> (usize, usize) {
        let within = i as usize & ((1usize << self.shift) - 1);
        ((i >> self.shift) as usize, within * self.cap)
    }

    #[inline]
    fn chunk(&self, i: u32) -> &[Holder] {
        let (page, start) = self.at(i);
        self.pages
            .get(page)
            .and_then(|p| p.get(start..start + self.cap))
            .unwrap_or(&[])
    }

    #[inline]
    fn chunk_mut(&mut self, i: u32) -> &mut [Holder] {
        let (page, start) = self.at(i);
        let cap = self.cap;
        self.pages
            .get_mut(page)
            .and_then(|p| p.get_mut(start..start + cap))
            .unwrap_or(&mut [])
    }

    /// Heap bytes (capacity, not length).
    fn heap_bytes(&self) -> usize {
        self.pages.iter().map(|p| p.capacity() * 8).sum::<usize>()
            + self.pages.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self.free.capacity() * 4
    }
}

/// Largest size class: lists of up to `2 << MAX_CLASS` holders.
const MAX_CLASS: usize = 24;

/// Spilled holder lists (two or more holders), each sorted by slot, in size-classed pools
/// (class *c* holds up to `2 << c` holders): no per-list allocation or header.
#[derive(Debug)]
pub(super) struct HolderArena {
    pools: Vec<Pool>,
}

impl Default for HolderArena {
    fn default() -> Self {
        HolderArena {
            pools: (0..=MAX_CLASS).map(|c| Pool::new(2 << c)).collect(),
        }
    }
}

impl HolderArena {
    fn pool(&self, class: usize) -> Option<&Pool> {
        self.pools.get(class)
    }

    fn pool_mut(&mut self, class: usize) -> Option<&mut Pool> {
        self.pools.get_mut(class)
    }

    /// Heap bytes of the pools (capacity, not length).
    pub(super) fn heap_bytes(&self) -> usize {
        self.pools.iter().map(Pool::heap_bytes).sum()
    }

    /// Stores `list` (sorted, ≥ 2 holders) in the smallest class that fits it.
    fn store(&mut self, list: &[Holder]) -> Holders {
        let class = class_for(list.len());
        let Some(pool) = self.pool_mut(class) else {
            return Holders::VACANT;
        };
        let i = pool.alloc();
        if let Some(dst) = pool.chunk_mut(i).get_mut(..list.len()) {
            copy_holders(dst, list);
        }
        Holders::spill(class, list.len(), i)
    }

    /// Moves the full list (`len` holders in chunk `i` of `class`) into the next class with
    /// `new` inserted at index `j`, copying straight from chunk to chunk (no temporary list),
    /// and frees the old chunk. An arena without a larger class keeps the list as it was.
    fn grow_insert(&mut self, class: usize, i: u32, len: usize, j: usize, new: Holder) -> Holders {
        let old = Holders::spill(class, len, i);
        let (lower, upper) = self.pools.split_at_mut(class + 1);
        let (Some(from), Some(to)) = (lower.last_mut(), upper.first_mut()) else {
            return old;
        };
        let k = to.alloc();
        let src = from.chunk(i);
        let dst = to.chunk_mut(k);
        let (Some(head), Some(tail)) = (src.get(..j), src.get(j..len)) else {
            return old;
        };
        let Some(d) = dst.get_mut(..=len) else {
            return old;
        };
        let (d_head, d_rest) = d.split_at_mut(j);
        copy_holders(d_head, head);
        if let Some((cell, d_tail)) = d_rest.split_first_mut() {
            *cell = new;
            copy_holders(d_tail, tail);
        }
        from.free.push(i);
        Holders::spill(class + 1, len + 1, k)
    }

    fn release(&mut self, class: usize, i: u32) {
        if let Some(p) = self.pool_mut(class) {
            p.free.push(i);
        }
    }
}

/// `dst.copy_from_slice(src)` (equal lengths), with the short copies of small lists done in
/// registers: most spilled lists hold two to four holders, and a `memcpy` call costs more than
/// moving them.
#[inline]
fn copy_holders(dst: &mut [Holder], src: &[Holder]) {
    match (dst, src) {
        ([], []) => {}
        ([d0], [s0]) => *d0 = *s0,
        ([d0, d1], [s0, s1]) => {
            *d0 = *s0;
            *d1 = *s1;
        }
        ([d0, d1, d2], [s0, s1, s2]) => {
            *d0 = *s0;
            *d1 = *s1;
            *d2 = *s2;
        }
        (d, s) => {
            if d.len() == s.len() {
                d.copy_from_slice(s);
            }
        }
    }
}

fn class_for(len: usize) -> usize {
    let mut c = 0;
    while c < MAX_CLASS && (2usize << c) < len {
        c += 1;
    }
    c
}

/// A block's holders: one inline holder, or a spilled list in the arena (`SPILL | class << 58 |
/// len << 32 | chunk`). Never empty in a table (an entry without holders is removed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holders(u64);

/// What [`Holders::set`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SetOutcome {
    /// The replica was not a holder; it is now (at the given position).
    Added,
    /// The replica held the block at the other tier; the tier changed.
    TierChanged,
    /// Nothing changed.
    Unchanged,
}

impl Holders {
    /// Filler for vacant table slots (never read as holders).
    pub(super) const VACANT: Holders = Holders(0);

    /// A list holding only `h`.
    pub(super) fn one(h: Holder) -> Self {
        Holders(h)
    }

    fn spill(class: usize, len: usize, chunk: u32) -> Self {
        Holders(
            SPILL | ((class as u64) << 58) | (((len as u64) & 0x3FF_FFFF) << 32) | u64::from(chunk),
        )
    }

    /// `(class, len, chunk)` of a spilled list.
    fn spilled(self) -> Option<(usize, usize, u32)> {
        (self.0 & SPILL != 0).then_some((
            ((self.0 >> 58) & 0x1F) as usize,
            ((self.0 >> 32) & 0x3FF_FFFF) as usize,
            self.0 as u32,
        ))
    }

    /// Prefetches the first cache line of a spilled list (an inline holder needs no load), so
    /// that a walk reading several levels' lists overlaps their misses.
    #[inline]
    pub(super) fn prefetch_list(&self, arena: &HolderArena) {
        if let Some((class, _, i)) = self.spilled() {
            if let Some(first) = arena.pool(class).and_then(|p| p.chunk(i).first()) {
                super::mem::prefetch(first);
            }
        }
    }

    /// The holders, sorted by slot. `buf` backs the inline case.
    #[inline]
    pub(super) fn holders<'a>(
        &self,
        arena: &'a HolderArena,
        buf: &'a mut [Holder; 1],
    ) -> &'a [Holder] {
        match self.spilled() {
            None => {
                buf[0] = self.0;
                &buf[..]
            }
            Some((class, len, i)) => arena
                .pool(class)
                .map(|p| p.chunk(i))
                .and_then(|c| c.get(..len))
                .unwrap_or(&[]),
        }
    }

    /// Number of holders.
    #[cfg(test)]
    pub(super) fn len(&self, arena: &HolderArena) -> usize {
        let mut buf = [0; 1];
        self.holders(arena, &mut buf).len()
    }

    /// The holder of `slot`, if it holds the block.
    pub(super) fn find(&self, arena: &HolderArena, slot: u32) -> Option<Holder> {
        if self.spilled().is_none() {
            return (slot_of(self.0) == slot).then_some(self.0);
        }
        let mut buf = [0; 1];
        let list = self.holders(arena, &mut buf);
        list.binary_search_by_key(&slot, |h| slot_of(*h))
            .ok()
            .and_then(|j| list.get(j).copied())
    }

    /// Makes `slot` a holder at tier `t2` (position `pos` when newly added), or updates its tier.
    pub(super) fn set(
        &mut self,
        arena: &mut HolderArena,
        slot: u32,
        t2: bool,
        pos: u32,
    ) -> SetOutcome {
        let Some((class, len, i)) = self.spilled() else {
            let cur = self.0;
            if slot_of(cur) == slot {
                if is_t2(cur) == t2 {
                    return SetOutcome::Unchanged;
                }
                self.0 = holder(slot, t2, pos_of(cur));
                return SetOutcome::TierChanged;
            }
            let new = holder(slot, t2, pos);
            let list = if cur < new { [cur, new] } else { [new, cur] };
            *self = arena.store(&list);
            return SetOutcome::Added;
        };
        let Some(pool) = arena.pool_mut(class) else {
            return SetOutcome::Unchanged;
        };
        let cap = pool.cap;
        let chunk = pool.chunk_mut(i);
        let Some(list) = chunk.get_mut(..len) else {
            return SetOutcome::Unchanged;
        };
        match list.binary_search_by_key(&slot, |h| slot_of(*h)) {
            Ok(j) => {
                let cur = list[j];
                if is_t2(cur) == t2 {
                    SetOutcome::Unchanged
                } else {
                    list[j] = holder(slot, t2, pos_of(cur));
                    SetOutcome::TierChanged
                }
            }
            Err(j) => {
                let new = holder(slot, t2, pos);
                if len < cap {
                    // Room in the chunk: shift the tail one place up (from its end: short
                    // tails, no `memmove` call), then fill the gap.
                    if len - j <= 3 {
                        for k in (j..len).rev() {
                            if let Some(&h) = chunk.get(k) {
                                if let Some(cell) = chunk.get_mut(k + 1) {
                                    *cell = h;
                                }
                            }
                        }
                    } else {
                        chunk.copy_within(j..len, j + 1);
                    }
                    if let Some(cell) = chunk.get_mut(j) {
                        *cell = new;
                    }
                    *self = Holders::spill(class, len + 1, i);
                } else {
                    *self = arena.grow_insert(class, i, len, j, new);
                }
                SetOutcome::Added
            }
        }
    }

    /// Records that `slot`'s copy moved to position `pos` in its key vector.
    pub(super) fn set_pos(&mut self, arena: &mut HolderArena, slot: u32, pos: u32) {
        let Some((class, len, i)) = self.spilled() else {
            if slot_of(self.0) == slot {
                self.0 = holder(slot, is_t2(self.0), pos);
            }
            return;
        };
        if let Some(list) = arena
            .pool_mut(class)
            .and_then(|p| p.chunk_mut(i).get_mut(..len))
        {
            if let Ok(j) = list.binary_search_by_key(&slot, |h| slot_of(*h)) {
                list[j] = holder(slot, is_t2(list[j]), pos);
            }
        }
    }

    /// Removes `slot` as a holder. Returns its holder (if it held the block) and the remaining
    /// list (`None` when no holder is left; a spilled list goes back inline at one holder and
    /// moves to a smaller class when a quarter full).
    pub(super) fn remove(
        self,
        arena: &mut HolderArena,
        slot: u32,
    ) -> (Option<Holder>, Option<Holders>) {
        let Some((class, len, i)) = self.spilled() else {
            return if slot_of(self.0) == slot {
                (Some(self.0), None)
            } else {
                (None, Some(self))
            };
        };
        let Some(pool) = arena.pool_mut(class) else {
            return (None, Some(self));
        };
        let cap = pool.cap;
        let Some(list) = pool.chunk_mut(i).get_mut(..len) else {
            return (None, Some(self));
        };
        let Ok(j) = list.binary_search_by_key(&slot, |h| slot_of(*h)) else {
            return (None, Some(self));
        };
        let removed = list[j];
        list.copy_within(j + 1.., j);
        let len = len - 1;
        if len == 1 {
            let last = list[0];
            arena.release(class, i);
            return (Some(removed), Some(Holders::one(last)));
        }
        if class > 0 && len * 4 <= cap {
            let kept: Vec<Holder> = list[..len].to_vec();
            arena.release(class, i);
            return (Some(removed), Some(arena.store(&kept)));
        }
        (Some(removed), Some(Holders::spill(class, len, i)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn slots(h: Holders, arena: &HolderArena) -> Vec<(u32, bool, u32)> {
        let mut buf = [0; 1];
        h.holders(arena, &mut buf)
            .iter()
            .map(|w| (slot_of(*w), is_t2(*w), pos_of(*w)))
            .collect()
    }

    #[test]
    fn long_lists_grow_through_classes_and_shrink_back() {
        let mut arena = HolderArena::default();
        let mut h = Holders::one(holder(500, false, 0));
        for s in (0..1000u32).rev().filter(|s| *s != 500) {
            assert_eq!(h.set(&mut arena, s, s % 2 == 0, s), SetOutcome::Added);
        }
        let mut buf = [0; 1];
        let got: Vec<u32> = h
            .holders(&arena, &mut buf)
            .iter()
            .map(|x| slot_of(*x))
            .collect();
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
        assert_eq!(h.find(&arena, 999).map(pos_of), Some(999));
        for s in 0..999u32 {
            let (gone, rest) = h.remove(&mut arena, s);
            assert_eq!(gone.map(slot_of), Some(s));
            h = rest.unwrap();
        }
        assert_eq!(h, Holders::one(holder(999, false, 999)));
        // Every chunk went back to its pool's free list.
        for p in &arena.pools {
            assert_eq!(p.free.len(), p.chunks as usize, "class of {}", p.cap);
        }
    }

    #[test]
    fn pools_grow_a_page_at_a_time_and_never_move_a_chunk() {
        // Chunks of 2 (4 096 holders a page: 2 048 chunks) and of 2 × PAGE_HOLDERS (one chunk
        // per page): three pages of each, every chunk written with its own values.
        for cap in [2, 2 * PAGE_HOLDERS] {
            let mut pool = Pool::new(cap);
            let n = 3 * ((PAGE_HOLDERS / cap).max(1) as u32);
            let mut first_page_at = None;
            for i in 0..n {
                assert_eq!(pool.alloc(), i);
                for (j, cell) in pool.chunk_mut(i).iter_mut().enumerate() {
                    *cell = u64::from(i) << 32 | j as u64;
                }
                // The first page's memory stays where it was while later pages are added.
                let at = pool.chunk(0).as_ptr();
                assert_eq!(*first_page_at.get_or_insert(at), at);
            }
            assert_eq!(pool.pages.len(), 3);
            assert!(pool
                .pages
                .iter()
                .all(|p| p.capacity() == cap.max(PAGE_HOLDERS)));
            for i in 0..n {
                let c = pool.chunk(i);
                assert_eq!(c.len(), cap);
                assert!(c
                    .iter()
                    .enumerate()
                    .all(|(j, v)| *v == (u64::from(i) << 32 | j as u64)));
            }
            // A freed chunk is handed out again before a new one.
            pool.free.push(1);
            assert_eq!(pool.alloc(), 1);
            assert_eq!(pool.alloc(), n);
            assert_eq!(pool.pages.len(), 4);
            // Out of range: empty, never a panic.
            assert!(pool.chunk(n + 10_000).is_empty());
        }
    }

    #[test]
    fn holders_stay_sorted_inline_then_spilled_and_shrink_back() {
        assert_eq!(std::mem::size_of::<Holders>(), 8);
        let mut arena = HolderArena::default();
        let mut h = Holders::one(holder(7, false, 70));
        assert_eq!(h.set(&mut arena, 7, false, 99), SetOutcome::Unchanged);
        assert_eq!(h.set(&mut arena, 7, true, 99), SetOutcome::TierChanged);
        assert_eq!(slots(h, &arena), vec![(7, true, 70)]);
        assert_eq!(h.set(&mut arena, 3, true, 30), SetOutcome::Added);
        assert_eq!(h.spilled().map(|(c, l, _)| (c, l)), Some((0, 2)));
        assert_eq!(slots(h, &arena), vec![(3, true, 30), (7, true, 70)]);
        assert_eq!(h.set(&mut arena, 3, false, 0), SetOutcome::TierChanged);
        assert_eq!(h.set(&mut arena, 5, false, 50), SetOutcome::Added);
        assert_eq!(
            h.set(&mut arena, MAX_SLOT, true, u32::MAX),
            SetOutcome::Added
        );
        assert_eq!(
            slots(h, &arena),
            vec![
                (3, false, 30),
                (5, false, 50),
                (7, true, 70),
                (MAX_SLOT, true, u32::MAX)
            ]
        );
        assert_eq!(h.find(&arena, 5), Some(holder(5, false, 50)));
        assert_eq!(h.find(&arena, 6), None);
        h.set_pos(&mut arena, 5, 51);
        assert_eq!(pos_of(h.find(&arena, 5).unwrap()), 51);
        let (w, rest) = h.remove(&mut arena, 5);
        assert_eq!(w, Some(holder(5, false, 51)));
        let h = rest.unwrap();
        assert_eq!(h.len(&arena), 3);
        assert_eq!(h.spilled().map(|(c, l, _)| (c, l)), Some((1, 3)));
        let (_, rest) = h.remove(&mut arena, 3);
        let (_, rest) = rest.unwrap().remove(&mut arena, 7);
        let mut h = rest.unwrap();
        // Back inline: the spilled list was released.
        assert!(h.spilled().is_none());
        assert_eq!(arena.pools[1].free.len(), 1);
        assert_eq!(slots(h, &arena), vec![(MAX_SLOT, true, u32::MAX)]);
        let (none, same) = h.remove(&mut arena, 99);
        assert_eq!((none, same), (None, Some(h)));
        h.set_pos(&mut arena, MAX_SLOT, 4);
        let (w, rest) = h.remove(&mut arena, MAX_SLOT);
        assert_eq!((w.map(pos_of), rest), (Some(4), None));
    }
}
