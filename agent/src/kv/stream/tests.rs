//! The state machine's rules, fed batch by batch.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use ic_shared::kv::content_key::chain;
use ic_shared::kv::decode::{BlockRemoved, BlockStored};
use ic_shared::proto::{kv_op, KvOp};

fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.collect(),
        block_size: 16,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64], medium: Option<&str>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: medium.map(str::to_string),
        ..BlockRemoved::default()
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: 1_780_000_000.5,
        events,
        data_parallel_rank: Some(0),
        skipped: Vec::new(),
    }
}

fn tokens(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

/// Flattens ops to (kind, tier, key) for assertions.
fn flat(ops: &[KvOp]) -> Vec<(&'static str, i32, u64)> {
    let mut out = Vec::new();
    for op in ops {
        match &op.op {
            Some(kv_op::Op::Store(s)) => {
                out.extend(s.content_keys.iter().map(|k| ("store", s.tier, *k)))
            }
            Some(kv_op::Op::Remove(r)) => {
                out.extend(r.content_keys.iter().map(|k| ("remove", 0, *k)))
            }
            Some(kv_op::Op::Clear(_)) => out.push(("clear", 0, 0)),
            None => {}
        }
    }
    out
}

fn clear_reason(ops: &[KvOp]) -> Option<String> {
    ops.iter().find_map(|o| match &o.op {
        Some(kv_op::Op::Clear(c)) => Some(c.reason.clone()),
        _ => None,
    })
}

const T1: i32 = Tier::T1 as i32;
const T2: i32 = Tier::T2 as i32;

#[test]
fn run_continuation_and_divergence_chain_like_the_router() {
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(0, &batch(vec![stored(&[10, 11], None, 0..32)]), 0);
    st.apply(1, &batch(vec![stored(&[12, 13], Some(11), 32..64)]), 0);
    st.apply(2, &batch(vec![stored(&[20], Some(10), 1000..1016)]), 0);
    let (seq, ops, ts) = st.take_delta().unwrap();
    assert_eq!((seq, ts), (1, 1_780_000_000_500));
    let a = chain(&tokens(0..64), 16);
    let b = chain(&[tokens(0..16), tokens(1000..1016)].concat(), 16);
    let keys: Vec<u64> = flat(&ops).iter().map(|x| x.2).collect();
    assert_eq!(keys, vec![a[0], a[1], a[2], a[3], b[1]]);
    // Adjacent stores of one adapter/size/tier coalesce into one op.
    assert_eq!(ops.len(), 1);
    assert_eq!(st.blocks_held(), 5);
    assert!(st.take_delta().is_none());
}

#[test]
fn duplicate_stores_are_idempotent_and_unknown_removals_ignored() {
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(0, &batch(vec![stored(&[1], None, 0..16)]), 0);
    st.take_delta();
    let r = st.apply(
        1,
        &batch(vec![stored(&[1], None, 0..16), removed(&[99], None)]),
        0,
    );
    assert!(st.take_delta().is_none());
    assert_eq!(r.ignored.get("unknown_hash"), 1);
}

#[test]
fn removal_evicts_or_demotes_with_l2() {
    let k = chain(&tokens(0..16), 16)[0];
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(
        0,
        &batch(vec![stored(&[1], None, 0..16), removed(&[1], Some("GPU"))]),
        0,
    );
    assert_eq!(
        flat(&st.take_delta().unwrap().1),
        vec![("store", T1, k), ("remove", 0, k)]
    );
    assert_eq!(st.blocks_held(), 0);

    let mut st = StreamState::new(StreamConfig {
        keeps_l2: true,
        ..StreamConfig::default()
    });
    st.apply(
        0,
        &batch(vec![stored(&[1], None, 0..16), removed(&[1], None)]),
        0,
    );
    assert_eq!(
        flat(&st.take_delta().unwrap().1),
        vec![("store", T1, k), ("store", T2, k)]
    );
    let (_, entries, stale) = st.snapshot();
    assert!(!stale);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].tier, T2);
}

#[test]
fn offload_medium_and_placeholders_move_tiers() {
    let k = chain(&tokens(0..16), 16)[0];
    let mut st = StreamState::new(StreamConfig::default());
    // Placeholder: empty tokens, block size 0, medium CPU.
    let placeholder = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![1, 777],
        medium: Some("CPU".into()),
        ..BlockStored::default()
    });
    let r = st.apply(
        0,
        &batch(vec![
            stored(&[1], None, 0..16),
            placeholder,
            removed(&[1], Some("GPU")),
        ]),
        0,
    );
    assert_eq!(r.ignored.get("unknown_hash"), 1);
    // T1 while on GPU, T2 once only the CPU copy is left, gone when that goes too.
    st.apply(1, &batch(vec![removed(&[1], Some("CPU"))]), 0);
    assert_eq!(
        flat(&st.take_delta().unwrap().1),
        vec![("store", T1, k), ("store", T2, k), ("remove", 0, k)]
    );
}

#[test]
fn shared_content_key_is_removed_only_with_its_last_holder() {
    // Same tokens, two engine hashes (e.g. two cache salts).
    let k = chain(&tokens(0..16), 16)[0];
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(
        0,
        &batch(vec![stored(&[1], None, 0..16), stored(&[2], None, 0..16)]),
        0,
    );
    st.apply(1, &batch(vec![removed(&[1], None)]), 0);
    assert_eq!(flat(&st.take_delta().unwrap().1), vec![("store", T1, k)]);
    st.apply(2, &batch(vec![removed(&[2], None)]), 0);
    assert_eq!(flat(&st.take_delta().unwrap().1), vec![("remove", 0, k)]);
}

#[test]
fn unknown_parent_is_parked_then_resolved_never_rooted() {
    let a = chain(&tokens(0..64), 16);
    let mut st = StreamState::new(StreamConfig::default());
    // Children arrive first (e.g. a subscriber that started late, then a replay).
    let r = st.apply(5, &batch(vec![stored(&[12, 13], Some(11), 32..64)]), 0);
    assert_eq!(r.ignored.get("unknown_parent"), 1);
    st.apply(6, &batch(vec![stored(&[14], Some(13), 64..80)]), 0);
    // No guessed keys: the delta carries only the coverage change.
    let (_, ops, _) = st.take_delta().unwrap();
    assert!(ops.is_empty(), "no guessed keys");
    assert_eq!(
        st.reported_coverage(),
        Coverage::new(CoverageState::Partial, coverage::PARENT_UNKNOWN)
    );
    assert_eq!(st.orphans(), 3);
    st.apply(7, &batch(vec![stored(&[10, 11], None, 0..32)]), 0);
    let keys: Vec<u64> = flat(&st.take_delta().unwrap().1)
        .iter()
        .map(|x| x.2)
        .collect();
    let full = chain(&tokens(0..80), 16);
    assert_eq!(keys, vec![a[0], a[1], a[2], a[3], full[4]]);
    assert_eq!(st.orphans(), 0);
    assert_eq!(st.reported_coverage(), Coverage::EXACT);
}

#[test]
fn a_block_stored_twice_is_removed_when_removed_twice() {
    // vLLM's BlockPool holds one hash in two physical blocks for a repeated, block-aligned
    // prompt: two BlockStored, later one BlockRemoved per physical block.
    let k = chain(&tokens(0..32), 16);
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(0, &batch(vec![stored(&[1, 2], None, 0..32)]), 0);
    st.apply(1, &batch(vec![stored(&[1, 2], None, 0..32)]), 0);
    st.take_delta();
    st.apply(2, &batch(vec![removed(&[2], None)]), 0);
    assert!(
        st.take_delta().is_none(),
        "one copy of block 2 is still cached"
    );
    assert_eq!(st.blocks_held(), 2);
    st.apply(3, &batch(vec![removed(&[2], None)]), 0);
    assert_eq!(flat(&st.take_delta().unwrap().1), vec![("remove", 0, k[1])]);
    // With an L2 the last GPU copy demotes the entry to T2; its offload copy goes with
    // a removal from CPU.
    let mut st = StreamState::new(StreamConfig {
        keeps_l2: true,
        ..StreamConfig::default()
    });
    st.apply(0, &batch(vec![stored(&[1], None, 0..16)]), 0);
    st.apply(1, &batch(vec![stored(&[1], None, 0..16)]), 0);
    st.apply(2, &batch(vec![removed(&[1], Some("GPU"))]), 0);
    st.apply(3, &batch(vec![removed(&[1], Some("GPU"))]), 0);
    st.apply(4, &batch(vec![removed(&[1], Some("CPU"))]), 0);
    assert_eq!(
        flat(&st.take_delta().unwrap().1),
        vec![
            ("store", T1, k[0]),
            ("store", T2, k[0]),
            ("remove", 0, k[0])
        ]
    );
}

#[test]
fn a_stream_reporting_another_rank_is_never_indexed_under_the_planned_one() {
    let mut st = StreamState::new(StreamConfig {
        dp_rank: Some(1),
        ..StreamConfig::default()
    });
    let mut b = batch(vec![stored(&[1], None, 0..16)]);
    b.data_parallel_rank = Some(1);
    st.apply(0, &b, 0);
    assert_eq!(st.blocks_held(), 1);
    let mut wrong = batch(vec![stored(&[2], Some(1), 16..32)]);
    wrong.data_parallel_rank = Some(0);
    let r = st.apply(1, &wrong, 0);
    assert_eq!(r.dropped.get("rank_mismatch"), 1);
    assert_eq!(st.blocks_held(), 0, "cleared, nothing indexed");
    let (_, ops, _) = st.take_delta().unwrap();
    assert_eq!(clear_reason(&ops).as_deref(), Some(CLEAR_RANK_MISMATCH));
    assert_eq!(
        st.reported_coverage(),
        Coverage::new(CoverageState::Partial, coverage::RANK_MISMATCH)
    );
    // A restarted engine is judged afresh.
    st.restart();
    assert_eq!(st.coverage(), Coverage::EXACT);
}

#[test]
fn one_hash_with_two_contents_drops_the_older_entry_and_says_so() {
    // Content-hashed pages (no parent chaining): the same engine hash for the same tokens
    // under two different parents.
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(
        0,
        &batch(vec![
            stored(&[1], None, 0..16),
            stored(&[2], None, 100..116),
            stored(&[7], Some(1), 16..32),
            stored(&[7], Some(2), 16..32),
        ]),
        0,
    );
    let other = chain(&[tokens(100..116), tokens(16..32)].concat(), 16)[1];
    let (_, entries, _) = st.snapshot();
    let keys: Vec<u64> = entries.iter().map(|e| e.content_key).collect();
    assert!(keys.contains(&other));
    assert!(!keys.contains(&chain(&tokens(0..32), 16)[1]));
    assert_eq!(
        st.reported_coverage(),
        Coverage::new(CoverageState::Partial, coverage::HASH_COLLISION)
    );
    // AllBlocksCleared makes the state known again.
    st.apply(
        1,
        &batch(vec![KvEvent::AllBlocksCleared { medium: None }]),
        0,
    );
    assert_eq!(st.coverage(), Coverage::EXACT);
}

/// Issue 37 item 3: each coverage state's invariant (shared/src/kv/coverage.rs) against a
/// ground truth — a pool of root blocks `i` (hash `1000 + i`, tokens `16i..16i+16`) stored
/// in batches 0..4 and removed in batches 4..6. Exact = the truth; Partial ⊆ the truth;
/// whatever may hold a block the engine removed is Stale and not routed.
#[test]
fn every_coverage_state_keeps_its_invariant_against_the_ground_truth() {
    let key = |i: u32| chain(&tokens(16 * i..16 * i + 16), 16)[0];
    let store = |i: u32| stored(&[1000 + u64::from(i)], None, 16 * i..16 * i + 16);
    let remove = |i: u32| removed(&[1000 + u64::from(i)], None);
    let mut batches: Vec<EventBatch> = (0..4)
        .map(|b| batch((3 * b..3 * b + 3).map(store).collect()))
        .collect();
    batches.push(batch((0..3).map(remove).collect()));
    batches.push(batch((3..6).map(remove).collect()));
    let truth: BTreeSet<u64> = (6..12).map(key).collect();
    let entries = |st: &mut StreamState| -> BTreeSet<u64> {
        st.snapshot().1.into_iter().map(|e| e.content_key).collect()
    };
    let run = |from: usize, upto: usize, st: &mut StreamState| {
        for (seq, b) in batches.iter().enumerate().take(upto).skip(from) {
            st.apply(seq as u64, b, 0);
        }
    };
    // Exact: nothing missing, nothing extra.
    let mut st = StreamState::new(StreamConfig::default());
    run(0, 6, &mut st);
    assert_eq!(st.coverage(), Coverage::EXACT);
    assert_eq!(entries(&mut st), truth);
    // Partial BootstrapIncomplete (the buffer starts at batch 3): a subset, routed.
    let mut st = StreamState::new(StreamConfig::default());
    st.set_incomplete(Some(coverage::BOOTSTRAP_INCOMPLETE));
    run(3, 6, &mut st);
    assert_eq!(st.coverage().state, CoverageState::Partial);
    let got = entries(&mut st);
    assert!(got.is_subset(&truth) && got != truth, "{got:?}");
    // Partial SequenceGap (batches 2..4 lost, the replica cleared): a subset.
    let mut st = StreamState::new(StreamConfig::default());
    run(0, 2, &mut st);
    st.mark_gap(4);
    run(4, 6, &mut st);
    assert_eq!(st.coverage().state, CoverageState::Partial);
    assert!(entries(&mut st).is_subset(&truth));
    // Stale TailUnverified (batch 5, the last, lost): holds blocks the engine removed, so
    // it is not routed — even under an incomplete-history reason.
    let mut st = StreamState::new(StreamConfig::default());
    run(0, 5, &mut st);
    st.set_tail_unverified(true);
    let got = entries(&mut st);
    assert!(!got.is_subset(&truth), "the lost removals stay: {got:?}");
    assert_eq!(
        st.coverage(),
        Coverage::new(CoverageState::Stale, coverage::TAIL_UNVERIFIED)
    );
    assert!(!st.coverage().state.routable());
    st.set_incomplete(Some(coverage::SEQUENCE_GAP));
    assert_eq!(st.coverage().state, CoverageState::Stale);
    // Stale EventsDropped (batch 5's removals unreadable): extra blocks, not routed.
    let mut st = StreamState::new(StreamConfig::default());
    run(0, 5, &mut st);
    let mut lost = batch(Vec::new());
    lost.skipped.push(ic_shared::kv::decode::SkippedEvent {
        index: 0,
        error: ic_shared::kv::decode::DecodeError::UnknownTag("BlockRemovedV2".into()),
    });
    st.apply(5, &lost, 0);
    assert!(!entries(&mut st).is_subset(&truth));
    assert_eq!(
        st.coverage(),
        Coverage::new(CoverageState::Stale, coverage::EVENTS_DROPPED)
    );
    assert!(!st.coverage().state.routable());
    // Healing: a verified prefix (batches 0..4) while the rest is replayed — extra only
    // what the batches in flight remove; routed.
    let mut st = StreamState::new(StreamConfig::default());
    run(0, 4, &mut st);
    st.set_link(LinkState::Healing);
    assert!(st.coverage().state.routable());
    let in_flight: BTreeSet<u64> = (0..6).map(key).collect();
    assert!(entries(&mut st)
        .difference(&truth)
        .all(|k| in_flight.contains(k)));
    // A rebuild from a complete replay (the heal) starts over: Exact again.
    st.set_link(LinkState::Up);
    st.set_incomplete(Some(coverage::REPLAY_TRUNCATED));
    st.set_tail_unverified(true);
    st.start_over(CLEAR_REBUILT);
    run(0, 6, &mut st);
    assert_eq!(st.coverage(), Coverage::EXACT);
    assert_eq!(entries(&mut st), truth);
}

#[test]
fn coverage_precedence_and_coverage_only_deltas() {
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(0, &batch(vec![stored(&[1], None, 0..16)]), 0);
    st.take_delta();
    st.set_incomplete(Some(coverage::BOOTSTRAP_INCOMPLETE));
    st.set_tail_unverified(true);
    assert!(st.has_pending(), "a coverage change alone is sent");
    // A tail that may hold a missed removal outranks every Partial reason: Stale, unrouted.
    assert_eq!(
        st.coverage(),
        Coverage::new(CoverageState::Stale, coverage::TAIL_UNVERIFIED)
    );
    assert!(!st.coverage().state.routable());
    st.set_tail_unverified(false);
    assert_eq!(
        st.coverage(),
        Coverage::new(CoverageState::Partial, coverage::BOOTSTRAP_INCOMPLETE)
    );
    st.set_tail_unverified(true);
    st.set_link(LinkState::Healing);
    assert_eq!(st.coverage().state, CoverageState::Healing);
    st.set_link(LinkState::Disconnected);
    assert_eq!(st.coverage().state, CoverageState::Disconnected);
    // An attach not yet verified is never routed, whatever else is known.
    st.set_link(LinkState::Unverified);
    assert_eq!(
        st.coverage(),
        Coverage::new(CoverageState::Disconnected, coverage::ATTACH_UNVERIFIED)
    );
    assert!(!st.coverage().state.routable());
    st.set_link(LinkState::Up);
    let (_, ops, _) = st.take_delta().unwrap();
    assert!(ops.is_empty());
    assert!(!st.has_pending());
    // A clear by the engine (AllBlocksCleared) leaves nothing unknown; the tail flag too.
    st.apply(
        1,
        &batch(vec![KvEvent::AllBlocksCleared { medium: None }]),
        0,
    );
    assert_eq!(st.coverage(), Coverage::EXACT);
    // An unhealed gap is Partial/SequenceGap until the engine's state is known again.
    st.mark_gap(9);
    assert_eq!(
        st.coverage(),
        Coverage::new(CoverageState::Partial, coverage::SEQUENCE_GAP)
    );
    st.apply(10, &batch(vec![]), 0);
    assert!(!st.is_stale());
    assert_eq!(st.coverage().state, CoverageState::Partial);
}

#[test]
fn orphans_are_bounded() {
    let mut st = StreamState::new(StreamConfig {
        max_orphans: 2,
        ..StreamConfig::default()
    });
    let r = st.apply(
        0,
        &batch(vec![
            stored(&[1], Some(100), 0..16),
            stored(&[2], Some(101), 0..16),
            stored(&[3], Some(102), 0..16),
        ]),
        0,
    );
    assert_eq!(r.dropped.get("orphan_evicted"), 1);
    assert_eq!(st.orphans(), 2);
    // The evicted orphan (hash 1) is not resolved when its parent shows up.
    st.apply(1, &batch(vec![stored(&[100], None, 0..16)]), 0);
    let n = flat(&st.take_delta().unwrap().1).len();
    assert_eq!(n, 1);
}

#[test]
fn a_removed_parent_still_anchors_a_child_via_its_tombstone() {
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(
        0,
        &batch(vec![
            stored(&[1], None, 0..16),
            removed(&[1], None),
            stored(&[2], Some(1), 16..32),
        ]),
        0,
    );
    let keys: Vec<_> = flat(&st.take_delta().unwrap().1);
    assert_eq!(keys.last().unwrap().2, chain(&tokens(0..32), 16)[1]);
}

#[test]
fn hybrid_groups_index_full_attention_only_and_never_share_chains() {
    let mut st = StreamState::new(StreamConfig::default());
    let mk =
        |group: u32, kind: &str, hashes: &[u64], parent: Option<u64>, t: std::ops::Range<u32>| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: parent,
                token_ids: t.collect(),
                block_size: 16,
                group_idx: Some(group),
                kv_cache_spec_kind: Some(kind.into()),
                ..BlockStored::default()
            })
        };
    // Group 1 (sliding window) uses the same hashes as group 0; group 2 is Mamba.
    let r = st.apply(
        0,
        &batch(vec![
            mk(1, "sliding_window", &[1, 2], None, 0..32),
            mk(0, "full_attention", &[1, 2], None, 0..32),
            mk(2, "mamba", &[1], None, 0..16),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![1],
                group_idx: Some(2),
                ..BlockRemoved::default()
            }),
        ]),
        0,
    );
    assert_eq!(r.ignored.get("other_group"), 3);
    assert_eq!(st.blocks_held(), 2);
    // A removal in group 1 does not touch group 0's block of the same hash.
    st.apply(
        1,
        &batch(vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![1],
            group_idx: Some(1),
            ..BlockRemoved::default()
        })]),
        0,
    );
    assert_eq!(st.blocks_held(), 2);
}

#[test]
fn partial_blocks_are_tracked_not_indexed() {
    let mut st = StreamState::new(StreamConfig::default());
    let partial = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![2],
        parent_block_hash: Some(1),
        token_ids: (16..20).collect(),
        block_size: 4,
        ..BlockStored::default()
    });
    let r = st.apply(
        0,
        &batch(vec![
            stored(&[1], None, 0..16),
            partial,
            removed(&[2], None),
        ]),
        0,
    );
    assert_eq!(r.ignored.get("partial_block"), 1);
    assert_eq!(flat(&st.take_delta().unwrap().1).len(), 1);
    assert_eq!(st.observed_block_size(), 16);
    // Mismatched token counts are dropped.
    let bad = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![5],
        token_ids: (0..40).collect(),
        block_size: 16,
        ..BlockStored::default()
    });
    let r = st.apply(1, &batch(vec![bad]), 0);
    assert_eq!(r.dropped.get("token_mismatch"), 1);
}

#[test]
fn adapter_comes_from_lora_name_then_lora_id() {
    let mut st = StreamState::new(StreamConfig::default());
    let ev = |name: Option<&str>, id: Option<i64>, h: u64| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![h],
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_name: name.map(str::to_string),
            lora_id: id,
            ..BlockStored::default()
        })
    };
    st.apply(
        0,
        &batch(vec![
            ev(Some("sql-lora"), Some(1), 1),
            ev(None, Some(7), 2),
            ev(None, None, 3),
        ]),
        0,
    );
    let (_, entries, _) = st.snapshot();
    let adapters: Vec<&str> = entries.iter().map(|e| e.adapter.as_str()).collect();
    assert_eq!(adapters, vec!["", "7", "sql-lora"]);
}

#[test]
fn seq_checks_and_clears() {
    let mut st = StreamState::new(StreamConfig::default());
    assert_eq!(st.check_seq(3), SeqCheck::First);
    st.apply(3, &batch(vec![stored(&[1], None, 0..16)]), 0);
    assert_eq!(st.check_seq(4), SeqCheck::InOrder);
    assert_eq!(st.check_seq(7), SeqCheck::Gap { from: 4 });
    assert_eq!(st.check_seq(0), SeqCheck::Restarted);
    assert_eq!(st.check_seq(3), SeqCheck::Restarted);
    st.restart();
    assert_eq!(st.check_seq(0), SeqCheck::First);
    let (_, ops, _) = st.take_delta().unwrap();
    assert_eq!(clear_reason(&ops).as_deref(), Some(CLEAR_ENGINE_RESTARTED));
    assert_eq!(
        flat(&ops),
        vec![("clear", 0, 0)],
        "clear supersedes pending stores"
    );

    st.apply(
        0,
        &batch(vec![
            stored(&[1], None, 0..16),
            KvEvent::AllBlocksCleared { medium: None },
        ]),
        0,
    );
    let (_, ops, _) = st.take_delta().unwrap();
    assert_eq!(clear_reason(&ops).as_deref(), Some(CLEAR_ALL_BLOCKS));
    assert_eq!(st.blocks_held(), 0);
    assert_eq!(st.check_seq(1), SeqCheck::InOrder);
}

#[test]
fn unhealed_gap_is_stale_until_a_newer_batch_then_reannounces() {
    let k = chain(&tokens(0..16), 16);
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(0, &batch(vec![stored(&[1], None, 0..16)]), 0);
    st.take_delta();
    st.mark_gap(5);
    st.apply(5, &batch(vec![stored(&[1], None, 0..16)]), 0);
    assert!(st.is_stale());
    let (seq, entries, stale) = st.snapshot();
    assert_eq!((seq, entries.len(), stale), (1, 0, true));
    st.apply(6, &batch(vec![]), 0);
    assert!(!st.is_stale());
    let (seq, ops, _) = st.take_delta().unwrap();
    assert_eq!(seq, 2);
    assert_eq!(flat(&ops), vec![("store", T1, k[0])]);
}

#[test]
fn snapshot_discards_pending_and_deltas_continue() {
    let mut st = StreamState::new(StreamConfig::default());
    st.apply(0, &batch(vec![stored(&[1], None, 0..16)]), 0);
    assert_eq!(st.take_delta().unwrap().0, 1);
    st.apply(1, &batch(vec![stored(&[2], Some(1), 16..32)]), 0);
    let (seq, entries, _) = st.snapshot();
    assert_eq!((seq, entries.len()), (1, 2));
    assert!(st.take_delta().is_none());
    st.apply(2, &batch(vec![removed(&[2], None)]), 0);
    assert_eq!(st.take_delta().unwrap().0, 2);
}

#[test]
fn pending_overflow_skips_a_delta_seq_to_force_a_resync() {
    let mut st = StreamState::new(StreamConfig {
        max_pending_keys: 3,
        ..StreamConfig::default()
    });
    let r = st.apply(0, &batch(vec![stored(&[1, 2, 3, 4], None, 0..64)]), 0);
    assert_eq!(r.dropped.get("pending_overflow"), 1);
    let (seq, _, _) = st.take_delta().unwrap();
    assert_eq!(seq, 2, "seq 1 skipped");
    let (seq, entries, _) = st.snapshot();
    assert_eq!((seq, entries.len()), (2, 4));
}

#[test]
fn a_replaced_stream_forces_a_resync() {
    let mut st = StreamState::new(StreamConfig::default());
    st.continue_after(7);
    let (seq, ops, _) = st.take_delta().unwrap();
    assert_eq!((seq, ops.len()), (9, 0));
    let mut st = StreamState::new(StreamConfig::default());
    st.continue_after(7);
    assert_eq!(st.snapshot().0, 7);
    assert!(st.take_delta().is_none());
}

/// Issue 41 item 5: a held block costs a 16-byte id + 16-byte record in `blocks` and a 16-byte
/// entry + 8-byte holder count in `held` (it was 16 + 48 and 32 + 8: an `Arc<str>` adapter and
/// the content key twice).
#[test]
fn per_block_records_stay_small() {
    assert_eq!(std::mem::size_of::<Block>(), 16);
    assert_eq!(std::mem::size_of::<EntryKey>(), 16);
    assert_eq!(std::mem::size_of::<Holders>(), 8);
}

/// A publisher naming a new adapter in every batch: class numbers of adapters no block holds
/// any more are reused, so the table stays bounded, and every op still names its own adapter.
#[test]
fn entry_classes_of_gone_adapters_are_reused_and_ops_keep_their_adapter() {
    let mut st = StreamState::new(StreamConfig::default());
    let n = 3 * CLASSES_COLLECT_AT as u64;
    for i in 0..n {
        let name = format!("lora-{i}");
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![i + 1],
            parent_block_hash: None,
            token_ids: tokens(0..16),
            block_size: 16,
            lora_name: Some(name.clone()),
            ..BlockStored::default()
        });
        let mut events = vec![ev];
        if i > 0 {
            events.push(removed(&[i], None));
        }
        st.apply(i, &batch(events), 0);
        let (_, ops, _) = st.take_delta().unwrap();
        let store = ops
            .iter()
            .find_map(|o| match &o.op {
                Some(kv_op::Op::Store(s)) => Some(s.adapter.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(store, name);
        if i > 0 {
            let gone = ops
                .iter()
                .find_map(|o| match &o.op {
                    Some(kv_op::Op::Remove(r)) => Some(r.adapter.clone()),
                    _ => None,
                })
                .unwrap();
            assert_eq!(gone, format!("lora-{}", i - 1));
        }
    }
    assert_eq!(st.blocks_held(), 1);
    assert!(
        st.classes.list.len() <= CLASSES_COLLECT_AT + 1,
        "{} classes for 1 held block",
        st.classes.list.len()
    );
    let (_, entries, _) = st.snapshot();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].adapter, format!("lora-{}", n - 1));
}

/// Issue 41 item 5: forgotten blocks' keys are bounded by the pool (a quarter of the blocks
/// held, at least 4 096), not 65 536 per stream whatever the pool; the newest still anchor.
#[test]
fn tombstones_are_bounded_by_the_blocks_held() {
    let mut st = StreamState::new(StreamConfig::default());
    let n = 3 * orphans::TOMBSTONES_MIN as u64;
    for i in 0..n {
        let h = i + 1;
        st.apply(
            i,
            &batch(vec![stored(&[h], None, 0..16), removed(&[h], None)]),
            0,
        );
    }
    assert_eq!(st.tombstones.len(), orphans::TOMBSTONES_MIN);
    assert_eq!(st.tombstone_order.len(), orphans::TOMBSTONES_MIN);
    st.apply(n, &batch(vec![stored(&[n + 1], Some(n), 16..32)]), 0);
    let keys = flat(&st.take_delta().unwrap().1);
    assert_eq!(keys.last().unwrap().2, chain(&tokens(0..32), 16)[1]);
}

/// Issue 41 item 5: a pool of steady size churning (each store evicts an older block) keeps
/// its tables at the size its entries need; the standard table, full of removed-slot markers,
/// doubled past half load instead.
#[test]
fn churn_at_a_steady_pool_size_does_not_grow_the_tables() {
    let mut st = StreamState::new(StreamConfig::default());
    let pool = 10_000u64;
    let mut seq = 0;
    for h in 1..=pool {
        st.apply(seq, &batch(vec![stored(&[h], None, 0..16)]), 0);
        seq += 1;
    }
    for h in pool + 1..=12 * pool {
        // Distinct contents, so every store is a new entry.
        let t = (h as u32) * 16;
        st.apply(
            seq,
            &batch(vec![
                stored(&[h], None, t..t + 16),
                removed(&[h - pool], None),
            ]),
            0,
        );
        seq += 1;
        let _ = st.take_delta();
    }
    assert_eq!(st.blocks.len(), pool as usize);
    assert_eq!(st.blocks_held(), pool as usize);
    // 16 384 slots hold up to 14 336 entries; doubled, 28 672.
    assert!(
        st.blocks.capacity() < 2 * pool as usize,
        "blocks {}",
        st.blocks.capacity()
    );
    assert!(
        st.held.capacity() < 2 * pool as usize,
        "held {}",
        st.held.capacity()
    );
}
