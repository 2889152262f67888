//! Our own content keys: a chained hash over each KV block's token ids.
//!
//! Engine block hashes are not portable (vLLM pickles Python objects and seeded its root randomly
//! before 0.29, LoRA hashes include an adapter path, SGLang salts per request), so the index never
//! uses them. Instead every block is keyed by a hash of its token ids chained to its parent's key,
//! so a key identifies the whole prefix up to and including the block.
//!
//! # Definition (version 1)
//!
//! ```text
//! ROOT                 = 0x6963_2d6b_762d_7631            (the ASCII bytes "ic-kv-v1")
//! bytes(tokens)        = each token id as 4 bytes little-endian, concatenated in order
//! block_key(p, tokens) = XXH3-64(bytes(tokens), seed = p)
//! chain(tokens, bs)    = k_0 = block_key(ROOT, tokens[0..bs]),
//!                        k_i = block_key(k_{i-1}, tokens[i*bs..(i+1)*bs]), full blocks only
//! ```
//!
//! XXH3-64 is the 64-bit XXH3 of xxHash 0.8 (`xxhash_rust::xxh3::xxh3_64_with_seed`). The block
//! size is not hashed: the index keys entries by `(tenant, model, hash_scheme, adapter, block_size,
//! content key)`, so the same tokens at two block sizes never meet. Adapters and engine extra keys
//! (cache salt, multimodal hashes) are not hashed either; the adapter is a separate index key.
//!
//! Both sides must agree: the controller's router calls [`chain`] on raw prompt token ids, the
//! agent calls [`block_key`] while following the engine's parent links. Fixed test vectors in
//! `shared/tests/kv_content_key.rs` pin the definition; changing it is a wire-format change.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Parent key of a block at position 0 (a block with no parent): the ASCII bytes `"ic-kv-v1"`
/// read as a big-endian u64.
pub const ROOT: u64 = 0x6963_2d6b_762d_7631;

/// Token ids hashed through a stack buffer up to this many tokens (4 KiB); longer blocks
/// allocate.
const STACK_TOKENS: usize = 1024;

/// Content key of one block: XXH3-64 over `tokens` (each id as 4 little-endian bytes) seeded with
/// the parent block's content key (`ROOT` for the first block of a sequence).
///
/// Any number of tokens is accepted (a partial block hashes its own tokens); an empty slice hashes
/// the empty input.
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        let len = fill_le(&mut buf, tokens);
        xxh3_64_with_seed(&buf[..len], parent)
    } else {
        let mut buf = vec![0u8; tokens.len() * 4];
        let len = fill_le(&mut buf, tokens);
        xxh3_64_with_seed(&buf[..len], parent)
    }
}

/// Writes `tokens` as little-endian u32s into `buf` (which must hold `4 * tokens.len()` bytes);
/// returns the number of bytes written.
fn fill_le(buf: &mut [u8], tokens: &[u32]) -> usize {
    let mut len = 0;
    for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
        len += 4;
    }
    len
}

/// Content keys of every full block of `tokens` at `block_size` tokens per block, first block
/// first, chained from [`ROOT`]. A partial tail block is ignored; `block_size` 0 yields no keys.
pub fn chain(tokens: &[u32], block_size: usize) -> Vec<u64> {
    chain_from(ROOT, tokens, block_size)
}

/// Like [`chain`], continuing from the content key `parent` of the block before `tokens`.
pub fn chain_from(parent: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut keys = Vec::with_capacity(tokens.len() / block_size);
    let mut prev = parent;
    for block in tokens.chunks_exact(block_size) {
        prev = block_key(prev, block);
        keys.push(prev);
    }
    keys
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn stack_and_heap_paths_agree() {
        let long: Vec<u32> = (0..(STACK_TOKENS as u32 + 7)).collect();
        let bytes: Vec<u8> = long.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(block_key(ROOT, &long), xxh3_64_with_seed(&bytes, ROOT));
        let short = &long[..STACK_TOKENS];
        assert_eq!(
            block_key(7, short),
            xxh3_64_with_seed(&bytes[..STACK_TOKENS * 4], 7)
        );
    }

    #[test]
    fn chain_ignores_partial_tail_and_zero_block_size() {
        let t: Vec<u32> = (0..40).collect();
        assert_eq!(chain(&t, 16).len(), 2);
        assert!(chain(&t, 0).is_empty());
        assert_eq!(chain(&t, 16)[..], chain(&t[..32], 16)[..]);
    }
}
