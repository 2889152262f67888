//! Fuzz target for the engine KV-event decoder (`ic_shared::kv::decode::decode_batch`).
//!
//! ```text
//! cargo +nightly fuzz run decode_batch                 # from fuzz/, needs cargo-fuzz
//! cargo +nightly fuzz run decode_batch corpus/ seeds/  # seeds: golden payloads (see README)
//! ```
//!
//! Invariants, for any input bytes:
//! 1. decoding never panics, overflows the stack or allocates unboundedly (libFuzzer's limits);
//! 2. a batch that decodes accounts for every wire event (decoded + skipped = events array);
//! 3. re-encoding a decoded batch in either engine shape (tagged arrays, tagged maps) decodes to
//!    the same identity fields (hashes, parent, tokens, block size, group) — what the agent keys
//!    the index by.

#![no_main]

use ic_shared::kv::decode::{decode_batch, encode_batch, EventShape, KvEvent};
use libfuzzer_sys::fuzz_target;

fn identity(e: &KvEvent) -> (u8, Vec<u64>, Option<u64>, Vec<u32>, u32, Option<u32>) {
    match e {
        KvEvent::BlockStored(s) => (
            0,
            s.block_hashes.clone(),
            s.parent_block_hash,
            s.token_ids.clone(),
            s.block_size,
            s.group_idx,
        ),
        KvEvent::BlockRemoved(r) => (1, r.block_hashes.clone(), None, Vec::new(), 0, r.group_idx),
        KvEvent::AllBlocksCleared { .. } => (2, Vec::new(), None, Vec::new(), 0, None),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    // 2. Skipped events carry their wire position; positions are distinct and in order.
    let mut last = None;
    for s in &batch.skipped {
        assert!(
            last.is_none_or(|l| s.index > l),
            "skipped positions in order"
        );
        last = Some(s.index);
        assert!(!s.error.reason().is_empty());
    }
    // 3. Re-encoding keeps the identity fields.
    let want: Vec<_> = batch.events.iter().map(identity).collect();
    for shape in [EventShape::Array, EventShape::Map] {
        let bytes = encode_batch(&batch, shape);
        let again = match decode_batch(&bytes) {
            Ok(b) => b,
            Err(e) => panic!("re-encoded batch ({shape:?}) does not decode: {e}"),
        };
        let got: Vec<_> = again.events.iter().map(identity).collect();
        assert_eq!(got, want, "{shape:?}");
        assert!(again.skipped.is_empty(), "{shape:?}: {:?}", again.skipped);
        assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
    }
});
