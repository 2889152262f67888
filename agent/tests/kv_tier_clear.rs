//! Tier-scoped cache clears (issue 39 item 12): an engine's prefix-cache reset wipes its GPU
//! tier, not an offload tier; a clear naming one medium wipes only that tier.
//!
//! Payloads are encoded in vLLM ≥ 0.24's map shape (`ic_shared::kv::decode::encode_batch`,
//! which the golden tests hold to the engines' own frames) and go through the real decoder and
//! stream state; the ops each stream emits are folded into an index the way the controller
//! applies them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use ic_agent::kv::{StreamConfig, StreamState};
use ic_shared::kv::content_key::chain;
use ic_shared::kv::decode::{
    decode_batch, encode_batch, BlockStored, EventBatch, EventShape, KvEvent,
};
use ic_shared::proto::kv_op::Op;
use ic_shared::proto::Tier;

/// Content key → tier, as the controller holds the replica.
#[derive(Default)]
struct Index(BTreeMap<u64, i32>);

impl Index {
    fn fold(&mut self, st: &mut StreamState) {
        let Some((_, ops, _)) = st.take_delta() else {
            return;
        };
        for op in ops {
            match op.op {
                Some(Op::Store(s)) => {
                    for k in s.content_keys {
                        self.0.insert(k, s.tier);
                    }
                }
                Some(Op::Remove(r)) => {
                    for k in r.content_keys {
                        self.0.remove(&k);
                    }
                }
                Some(Op::Clear(_)) => self.0.clear(),
                None => {}
            }
        }
    }

    fn tier(&self, key: u64) -> Option<Tier> {
        self.0
            .get(&key)
            .map(|t| Tier::try_from(*t).unwrap_or(Tier::Unspecified))
    }
}

fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: std::ops::Range<u32>,
    medium: &str,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.collect(),
        block_size: 16,
        medium: Some(medium.to_string()),
        ..BlockStored::default()
    })
}

/// Encodes `events` as the engine would and applies the decoded batch.
fn apply(st: &mut StreamState, index: &mut Index, seq: u64, events: Vec<KvEvent>) {
    let batch = EventBatch {
        ts: 1_780_000_000.0 + seq as f64,
        events,
        data_parallel_rank: Some(0),
        skipped: Vec::new(),
    };
    let payload = encode_batch(&batch, EventShape::Map);
    let decoded = decode_batch(&payload).expect("decodes");
    st.apply(seq, &decoded, 0);
    index.fold(st);
}

fn keys() -> Vec<u64> {
    chain(&(0..48).collect::<Vec<u32>>(), 16)
}

#[test]
fn a_gpu_cache_reset_keeps_the_offload_copies() {
    // Blocks 0..2 on GPU; blocks 0 and 1 also copied to the CPU offload tier (vLLM's offload
    // connector reports them with medium CPU). The engine's prefix-cache reset wipes the GPU.
    let mut st = StreamState::new(StreamConfig::default());
    let mut ix = Index::default();
    apply(
        &mut st,
        &mut ix,
        0,
        vec![stored(&[1, 2, 3], None, 0..48, "GPU")],
    );
    apply(
        &mut st,
        &mut ix,
        1,
        vec![stored(&[1, 2], None, 0..32, "CPU")],
    );
    let k = keys();
    assert_eq!(ix.tier(k[0]), Some(Tier::T1));
    apply(
        &mut st,
        &mut ix,
        2,
        vec![KvEvent::AllBlocksCleared { medium: None }],
    );
    assert_eq!(
        ix.tier(k[0]),
        Some(Tier::T2),
        "the offload copy survives the GPU reset"
    );
    assert_eq!(ix.tier(k[1]), Some(Tier::T2));
    assert_eq!(ix.tier(k[2]), None, "a GPU-only block is gone");
    assert!(st.coverage().state.routable());
}

#[test]
fn a_gpu_cache_reset_with_an_l2_leaves_every_block_at_t2() {
    // Offload mode (LMCache holds what the GPU drops): the reset is a GPU removal of every block.
    let mut st = StreamState::new(StreamConfig {
        keeps_l2: true,
        ..StreamConfig::default()
    });
    let mut ix = Index::default();
    apply(
        &mut st,
        &mut ix,
        0,
        vec![stored(&[1, 2, 3], None, 0..48, "GPU")],
    );
    apply(
        &mut st,
        &mut ix,
        1,
        vec![KvEvent::AllBlocksCleared { medium: None }],
    );
    for k in keys() {
        assert_eq!(ix.tier(k), Some(Tier::T2));
    }
}

#[test]
fn a_clear_of_one_medium_wipes_only_that_tier() {
    // Block 0 on GPU and CPU, block 1 only on CPU (evicted from GPU), block 2 only on GPU.
    let mut st = StreamState::new(StreamConfig::default());
    let mut ix = Index::default();
    apply(
        &mut st,
        &mut ix,
        0,
        vec![stored(&[1, 2, 3], None, 0..48, "GPU")],
    );
    apply(
        &mut st,
        &mut ix,
        1,
        vec![stored(&[1, 2], None, 0..32, "CPU")],
    );
    apply(
        &mut st,
        &mut ix,
        2,
        vec![KvEvent::BlockRemoved(ic_shared::kv::decode::BlockRemoved {
            block_hashes: vec![2],
            medium: Some("GPU".into()),
            ..Default::default()
        })],
    );
    let k = keys();
    assert_eq!(ix.tier(k[1]), Some(Tier::T2));
    apply(
        &mut st,
        &mut ix,
        3,
        vec![KvEvent::AllBlocksCleared {
            medium: Some("CPU".into()),
        }],
    );
    assert_eq!(
        ix.tier(k[1]),
        None,
        "the wiped CPU-only block is no longer matched"
    );
    assert_eq!(ix.tier(k[0]), Some(Tier::T1), "GPU copies are untouched");
    assert_eq!(ix.tier(k[2]), Some(Tier::T1));
    // And the GPU tier alone, named: only the CPU copy would have stayed; none is left.
    apply(
        &mut st,
        &mut ix,
        4,
        vec![KvEvent::AllBlocksCleared {
            medium: Some("GPU".into()),
        }],
    );
    assert!(ix.0.is_empty(), "{:?}", ix.0);
}

#[test]
fn a_reset_of_an_engine_with_its_own_host_tier_clears_everything() {
    // SGLang HiCache keeps host copies in its own memory (CPU_PINNED); its reset clears them too.
    let mut st = StreamState::new(StreamConfig {
        keeps_l2: true,
        ..StreamConfig::default()
    });
    let mut ix = Index::default();
    apply(
        &mut st,
        &mut ix,
        0,
        vec![stored(&[1, 2, 3], None, 0..48, "GPU")],
    );
    apply(
        &mut st,
        &mut ix,
        1,
        vec![stored(&[1, 2], None, 0..32, "CPU_PINNED")],
    );
    apply(
        &mut st,
        &mut ix,
        2,
        vec![KvEvent::AllBlocksCleared { medium: None }],
    );
    assert!(ix.0.is_empty(), "{:?}", ix.0);
}

#[test]
fn a_scoped_clear_decodes_in_both_shapes() {
    for shape in [EventShape::Array, EventShape::Map] {
        let batch = EventBatch {
            ts: 1.0,
            events: vec![
                KvEvent::AllBlocksCleared {
                    medium: Some("CPU".into()),
                },
                KvEvent::AllBlocksCleared { medium: None },
            ],
            data_parallel_rank: Some(0),
            skipped: Vec::new(),
        };
        let back = decode_batch(&encode_batch(&batch, shape)).expect("decodes");
        assert_eq!(back.events, batch.events, "{shape:?}");
    }
}
