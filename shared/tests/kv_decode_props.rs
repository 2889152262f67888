//! Property tests of the KV-event decoder: no input panics it, and every valid batch round-trips
//! through an rmpv encoder in both wire shapes (tagged arrays and tagged maps).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_shared::kv::decode::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, EventBatch, EventShape, KvEvent,
};
use proptest::prelude::*;
use rmpv::Value;

fn opt_string() -> impl Strategy<Value = Option<String>> {
    prop::option::of("[A-Za-z_]{0,12}")
}

fn extra_keys() -> impl Strategy<Value = Option<Value>> {
    prop::option::of(
        prop::collection::vec(
            prop::option::of(prop::collection::vec(
                prop_oneof![
                    "[a-z-]{0,8}".prop_map(Value::from),
                    any::<i64>().prop_map(Value::from),
                ],
                0..3,
            )),
            0..4,
        )
        .prop_map(|blocks| {
            Value::Array(
                blocks
                    .into_iter()
                    .map(|b| b.map(Value::Array).unwrap_or(Value::Nil))
                    .collect(),
            )
        }),
    )
}

fn stored() -> impl Strategy<Value = BlockStored> {
    (
        (
            prop::collection::vec(any::<u64>(), 0..5),
            prop::option::of(any::<u64>()),
            prop::collection::vec(any::<u32>(), 0..40),
            any::<u32>(),
            prop::option::of(any::<i64>()),
            opt_string(),
            opt_string(),
            extra_keys(),
        ),
        (
            prop::option::of(any::<u32>()),
            opt_string(),
            prop::option::of(any::<u32>()),
            opt_string(),
            opt_string(),
            opt_string(),
            prop::option::of(prop::collection::vec(any::<u32>(), 0..4)),
        ),
    )
        .prop_map(
            |(
                (
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                ),
                (
                    group_idx,
                    kv_cache_spec_kind,
                    kv_cache_spec_sliding_window,
                    locality,
                    ownership,
                    session_id,
                    lookahead_token_ids,
                ),
            )| BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window,
                locality,
                ownership,
                session_id,
                lookahead_token_ids,
            },
        )
}

fn removed() -> impl Strategy<Value = BlockRemoved> {
    (
        prop::collection::vec(any::<u64>(), 0..5),
        opt_string(),
        prop::option::of(any::<u32>()),
        opt_string(),
        opt_string(),
    )
        .prop_map(
            |(block_hashes, medium, group_idx, locality, ownership)| BlockRemoved {
                block_hashes,
                medium,
                group_idx,
                locality,
                ownership,
            },
        )
}

fn event() -> impl Strategy<Value = KvEvent> {
    prop_oneof![
        stored().prop_map(KvEvent::BlockStored),
        removed().prop_map(KvEvent::BlockRemoved),
        Just(KvEvent::AllBlocksCleared { medium: None }),
    ]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
        prop::collection::vec(event(), 0..6),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
            skipped: Vec::new(),
        })
}

/// A golden payload to mutate (vLLM 0.26 map shape, one BlockStored with every field).
fn golden_payload() -> Vec<u8> {
    hex::decode(concat!(
        "93cb41da862940001438918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368",
        "657392cfb0147556276afc9ccf192dd62904fcccacb1706172656e745f626c6f636b5f68617368c0",
        "a9746f6b656e5f696473dc0020000102030405060708090a0b0c0d0e0f101112131415161718191a",
        "1b1c1d1e1faa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f",
        "72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f636163",
        "68655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
    ))
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn mutated_golden_payloads_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut p = golden_payload();
        for (at, byte) in edits {
            let i = at.index(p.len());
            p[i] = byte;
        }
        let _ = decode_batch(&p);
        let n = cut.index(p.len());
        let _ = decode_batch(&p[..n]);
    }

    #[test]
    fn valid_batches_round_trip_in_both_shapes(b in batch()) {
        for shape in [EventShape::Array, EventShape::Map] {
            let bytes = encode_batch(&b, shape);
            let back = decode_batch(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back, &b, "shape {:?}", shape);
        }
    }

    #[test]
    fn extra_trailing_batch_elements_and_unknown_map_keys_are_ignored(b in batch(), junk in any::<i64>()) {
        let bytes = encode_batch(&b, EventShape::Map);
        let mut v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        if let Value::Array(items) = &mut v {
            if items.len() == 2 {
                items.push(Value::Nil);
            }
            items.push(Value::from(junk));
            if let Value::Array(events) = &mut items[1] {
                for e in events.iter_mut() {
                    if let Value::Map(pairs) = e {
                        pairs.insert(0, (Value::from("future_field"), Value::from(junk)));
                    }
                }
            }
        }
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        let back = decode_batch(&out).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&back.events, &b.events);
        prop_assert_eq!(back.ts, b.ts);
    }
}

#[test]
fn deep_nesting_is_rejected_without_overflowing_the_stack() {
    let mut p = vec![0x92, 0x01];
    p.extend(std::iter::repeat_n(0x91, 100_000));
    p.push(0xc0);
    assert_eq!(decode_batch(&p).unwrap_err().reason(), "not_msgpack");
}

#[test]
fn i64_hashes_and_map16_headers_decode() {
    // map16 header (0xde) for a BlockRemoved with a negative i64 hash.
    let mut p = vec![0x92, 0xcb];
    p.extend_from_slice(&1.0f64.to_be_bytes());
    p.push(0x91);
    p.extend_from_slice(&[0xde, 0x00, 0x02]);
    p.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e']);
    p.push(0xac);
    p.extend_from_slice(b"BlockRemoved");
    p.push(0xac);
    p.extend_from_slice(b"block_hashes");
    p.push(0x91);
    p.push(0xd3);
    p.extend_from_slice(&(-5i64).to_be_bytes());
    let b = decode_batch(&p).unwrap();
    assert_eq!(
        b.events,
        vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![(-5i64) as u64],
            ..BlockRemoved::default()
        })]
    );
    assert_eq!(b.data_parallel_rank, None);
}

/// The identity fields the agent keys the index by.
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// The invariants of the `decode_batch` fuzz target (`fuzz/fuzz_targets/decode_batch.rs`),
    /// on mutated golden payloads: whatever decodes lists skipped events in wire order and
    /// re-encodes (both shapes) to the same identity fields.
    #[test]
    fn whatever_decodes_re_encodes_to_the_same_identity(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        use_random in any::<bool>(),
    ) {
        let p = if use_random {
            bytes
        } else {
            let mut p = golden_payload();
            for (at, byte) in edits {
                let i = at.index(p.len());
                p[i] = byte;
            }
            p
        };
        if let Ok(batch) = decode_batch(&p) {
            let mut last = None;
            for s in &batch.skipped {
                prop_assert!(last.is_none_or(|l| s.index > l));
                last = Some(s.index);
            }
            let want: Vec<_> = batch.events.iter().map(identity).collect();
            for shape in [EventShape::Array, EventShape::Map] {
                let again = decode_batch(&encode_batch(&batch, shape))
                    .map_err(|e| TestCaseError::fail(format!("{shape:?}: {e}")))?;
                let got: Vec<_> = again.events.iter().map(identity).collect();
                prop_assert_eq!(&got, &want, "shape {:?}", shape);
                prop_assert!(again.skipped.is_empty());
                prop_assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
            }
        }
    }
}
