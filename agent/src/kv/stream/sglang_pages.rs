//! Content-hashed pages (SGLang ≤ 0.5.5, [`sglang::is_content_hashed`]): one engine hash per
//! page content wherever it sits, and no parent on a radix node's first page. Where such a page
//! is placed (a prompt root only while the engine's cache is provably empty; under the page the
//! event before stored) and the alias records of a page held at several depths.
//!
//! [`sglang::is_content_hashed`]: ic_shared::kv::decode::sglang::is_content_hashed

use ic_shared::kv::content_key::{block_key, ROOT};

use super::{BlockId, StreamState};

/// Most extra depths one content-hashed page is recorded at ([`alias_id`]).
pub(super) const MAX_ALIASES: u32 = 64;

/// The record id of the `n`-th (≥ 1) extra depth at which a content-hashed page (SGLang ≤ 0.5.5:
/// one engine hash for one page content wherever it sits) is held: same group, a hash derived
/// from the engine hash and `n`.
pub(super) fn alias_id((g, h): BlockId, n: u32) -> BlockId {
    (g, block_key(h, &[n, 0x616c_6961]))
}

impl StreamState {
    /// The content key a content-hashed page (SGLang ≤ 0.5.5) chains from, or `None` when its
    /// position cannot be known: a `None` parent is a prompt's first page only while the engine's
    /// cache is provably empty (followed from empty, nothing held, nothing unplaced or lost);
    /// a parent hash counts only when it names the page the event before stored (the engine
    /// sends a node's pages in order, and the same hash may name that content at other depths).
    pub(super) fn content_hashed_parent(&self, g: u32, parent: Option<u64>) -> Option<u64> {
        match parent {
            None => (self.tree_known
                && !self.unplaced
                && !self.events_lost
                && self.incomplete.is_none()
                && self.stale.is_none()
                && self.blocks.is_empty()
                && self.orphans.is_empty())
            .then_some(ROOT),
            Some(p) => match self.prev_page {
                Some((id, key)) if id == (g, p) => key,
                _ => None,
            },
        }
    }

    /// Where a content-hashed page with engine id `id` and content key `key` is recorded: `id`
    /// itself unless that holds another content, else the first alias id
    /// ([`alias_id`]) that is free or holds `key`.
    pub(super) fn position_id(&self, id: BlockId, key: u64) -> BlockId {
        let mut at = id;
        let mut n = 0u32;
        while let Some(b) = self.blocks.get(&at) {
            if b.key == key || n >= MAX_ALIASES {
                break;
            }
            n += 1;
            at = alias_id(id, n);
        }
        at
    }

    /// The records of engine id `id`: itself (when known) and its alias ids in use.
    pub(super) fn positions_of(&self, id: BlockId) -> Vec<BlockId> {
        let mut out = Vec::new();
        if self.blocks.contains_key(&id) || self.orphans.contains_key(&id) {
            out.push(id);
        }
        let mut n = 1u32;
        while n <= MAX_ALIASES && self.blocks.contains_key(&alias_id(id, n)) {
            out.push(alias_id(id, n));
            n += 1;
        }
        out
    }
}
