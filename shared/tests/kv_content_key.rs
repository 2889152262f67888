//! Pins the content-key definition (`ic_shared::kv::content_key`) with fixed vectors.
//!
//! The vectors were computed once and cross-checked against the reference xxHash implementation
//! (PyPI `xxhash` 4.1.0: `xxh3_64_intdigest(struct.pack('<16I', *block), seed=parent)`). Any change
//! to the definition fails here; such a change is a wire-format change for the index.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_shared::kv::content_key::{block_key, chain, chain_from, ROOT};

/// Content keys of tokens 0..63 at block size 16 (blocks 0..15, 16..31, 32..47, 48..63).
const VECTORS_0_63_BS16: [u64; 4] = [
    0x04a0_ed3f_f29b_5acd,
    0x5e80_974b_3b53_17ad,
    0x7561_f6be_46de_484e,
    0x11f4_8af7_aff9_e346,
];

#[test]
fn root_is_ic_kv_v1() {
    assert_eq!(ROOT.to_be_bytes(), *b"ic-kv-v1");
}

#[test]
fn chain_of_0_to_63_at_block_size_16_is_pinned() {
    let tokens: Vec<u32> = (0..64).collect();
    assert_eq!(chain(&tokens, 16), VECTORS_0_63_BS16.to_vec());
}

#[test]
fn block_key_follows_parent_links() {
    let tokens: Vec<u32> = (0..64).collect();
    let mut parent = ROOT;
    for (i, expected) in VECTORS_0_63_BS16.iter().enumerate() {
        parent = block_key(parent, &tokens[i * 16..(i + 1) * 16]);
        assert_eq!(parent, *expected, "block {i}");
    }
    assert_eq!(
        chain_from(VECTORS_0_63_BS16[1], &tokens[32..], 16),
        VECTORS_0_63_BS16[2..].to_vec()
    );
}

#[test]
fn empty_block_and_partial_tail_are_pinned() {
    assert_eq!(block_key(ROOT, &[]), 0xdea8_fd2b_93a6_7ef0);
    let tokens: Vec<u32> = (0..70).collect();
    assert_eq!(chain(&tokens, 16), VECTORS_0_63_BS16.to_vec());
}

#[test]
fn diverging_request_shares_only_the_common_prefix() {
    // Request B of the fixtures: tokens 0..15 then 1000..1015.
    let b: Vec<u32> = (0..16).chain(1000..1016).collect();
    let keys = chain(&b, 16);
    assert_eq!(keys, vec![VECTORS_0_63_BS16[0], 0xd2e8_6895_633c_e161]);
}

#[test]
fn keys_depend_on_order_and_parent() {
    let a: Vec<u32> = (0..16).collect();
    let mut r = a.clone();
    r.reverse();
    assert_ne!(block_key(ROOT, &a), block_key(ROOT, &r));
    assert_ne!(block_key(ROOT, &a), block_key(ROOT ^ 1, &a));
}
