//! SGLang's content-hashed pages (SGLang ≤ 0.5.5; issue 39 item 9, `docs/kv-events.md`
//! "Content-hashed pages").
//!
//! SGLang's radix cache up to 0.5.5 (`sglang/srt/mem_cache/radix_cache.py`,
//! `_record_store_event`) sends one `BlockStored` per page whose hash is Python's
//! `hash(tuple(page_tokens))` — the page's **content only**, so a page repeated at another depth
//! has the same hash — and sends `parent_block_hash = None` for the first page of **every**
//! radix node (its `node.parent is None or node != self.root_node` test is always true), so a
//! page continuing a cached prefix looks exactly like the first page of a prompt. From 0.5.6 on
//! page hashes are a SHA-256 chain and a node's first page names its parent's last page.
//!
//! The agent tells such a publisher by the hashes themselves: [`is_content_hashed`] recomputes
//! CPython's tuple hash of each page's token ids; a chained (SHA-256, vLLM) hash equals it with
//! probability 2⁻⁶⁴ per page.

use super::BlockStored;

/// CPython's `_PyHASH_XXPRIME_1` (`Objects/tupleobject.c`, 64-bit builds, CPython ≥ 3.8).
const XXPRIME_1: u64 = 11_400_714_785_074_694_791;
/// `_PyHASH_XXPRIME_2`.
const XXPRIME_2: u64 = 14_029_467_366_897_019_727;
/// `_PyHASH_XXPRIME_5`.
const XXPRIME_5: u64 = 2_870_177_450_012_600_261;

/// CPython's `hash(tuple(tokens))` on a 64-bit build (CPython ≥ 3.8, the xxHash-based
/// `tuplehash`), as the u64 bits of the signed result — the value the decoder reads from an
/// SGLang ≤ 0.5.5 page hash (sent as a msgpack signed int).
///
/// `tokens`: token ids; each is a Python int below 2⁶¹ − 1, whose hash is the id itself. Never
/// fails.
pub fn python_tuple_hash(tokens: &[u32]) -> u64 {
    let mut acc = XXPRIME_5;
    for &t in tokens {
        acc = acc.wrapping_add(u64::from(t).wrapping_mul(XXPRIME_2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(XXPRIME_1);
    }
    acc = acc.wrapping_add((tokens.len() as u64) ^ (XXPRIME_5 ^ 3_527_539));
    if acc == u64::MAX {
        // CPython never returns -1 from a hash.
        return 1_546_275_796;
    }
    acc
}

/// True when every hash of `s` is the CPython tuple hash of its page's token ids: the event
/// comes from a publisher that hashes pages by content alone (SGLang ≤ 0.5.5), so its hashes are
/// not unique per position and a `None` parent does not mean the first page of a prompt.
///
/// Pages are `block_size` tokens each (the last may be shorter); a single-hash event's page is
/// all of `token_ids`. `false` for placeholders (no tokens), events without hashes, and runs
/// whose tokens do not fit their hashes.
pub fn is_content_hashed(s: &BlockStored) -> bool {
    if s.token_ids.is_empty() || s.block_hashes.is_empty() {
        return false;
    }
    if let [h] = s.block_hashes.as_slice() {
        return *h == python_tuple_hash(&s.token_ids);
    }
    let bs = s.block_size as usize;
    if bs == 0 || s.token_ids.len().div_ceil(bs) != s.block_hashes.len() {
        return false;
    }
    s.token_ids
        .chunks(bs)
        .zip(&s.block_hashes)
        .all(|(page, h)| *h == python_tuple_hash(page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuple_hash_equals_cpython() {
        // python3 -c 'print(hash(tuple(range(16))), hash(tuple(range(16, 32))), hash(()), hash((7,)))'
        assert_eq!(
            python_tuple_hash(&(0..16).collect::<Vec<_>>()),
            2_828_489_712_818_767_170
        );
        assert_eq!(
            python_tuple_hash(&(16..32).collect::<Vec<_>>()) as i64,
            -2_299_187_964_520_990_307
        );
        assert_eq!(python_tuple_hash(&[]) as i64, 5_740_354_900_026_072_187);
        assert_eq!(
            python_tuple_hash(&[7]) as i64,
            -6_198_871_656_470_064_846_i64
        );
    }

    #[test]
    fn content_hashed_pages_are_told_from_chained_ones() {
        let page: Vec<u32> = (0..16).collect();
        let mut s = BlockStored {
            block_hashes: vec![python_tuple_hash(&page)],
            token_ids: page.clone(),
            block_size: 16,
            ..BlockStored::default()
        };
        assert!(is_content_hashed(&s));
        s.block_hashes = vec![0x5d85_718e_c594_b982];
        assert!(!is_content_hashed(&s), "a chained hash");
        let two: Vec<u32> = (0..32).collect();
        s.block_hashes = vec![python_tuple_hash(&two[..16]), python_tuple_hash(&two[16..])];
        s.token_ids = two;
        assert!(is_content_hashed(&s));
        s.token_ids.clear();
        assert!(!is_content_hashed(&s), "a placeholder");
    }
}
