use ic_shared::kv::content_key::chain;
use ic_shared::proto::{self, kv_op::Op};

use super::*;

fn desc(pod: &str, rank: u32) -> proto::StreamDescriptor {
    proto::StreamDescriptor {
        stream_id: format!("default/{pod}#{rank}"),
        replica: pod.to_string(),
        dp_rank: rank,
        tenant: "default".into(),
        model: "m".into(),
        hash_scheme: "vllm".into(),
        backend: String::new(),
        node: String::new(),
        offload_chunk_tokens: 0,
    }
}

fn empty_snapshot(pod: &str) -> proto::StreamSnapshot {
    proto::StreamSnapshot {
        coverage: ic_shared::proto::Coverage::Exact as i32,
        coverage_reason: String::new(),
        stream: Some(desc(pod, 0)),
        seq: 0,
        entries: vec![],
        last_event_unix_ms: 0,
        stale: false,
    }
}

fn store(keys: &[u64], tier: proto::Tier, adapter: &str) -> proto::KvOp {
    proto::KvOp {
        op: Some(Op::Store(proto::StoreOp {
            adapter: adapter.into(),
            block_size: 4,
            tier: tier as i32,
            content_keys: keys.to_vec(),
        })),
    }
}

fn delta(pod: &str, seq: u64, ops: Vec<proto::KvOp>) -> proto::StreamDelta {
    proto::StreamDelta {
        coverage: ic_shared::proto::Coverage::Exact as i32,
        coverage_reason: String::new(),
        stream: Some(desc(pod, 0)),
        seq,
        ops,
        last_event_unix_ms: 1000 + seq as i64,
    }
}

fn query(tokens: &[u32]) -> LookupQuery {
    LookupQuery {
        token_ids: tokens.to_vec(),
        ..Default::default()
    }
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn stored_prefix_is_found_with_its_depth_and_unrelated_tokens_are_not() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    let keys = chain(&tokens(0..16), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    ix.apply_delta(
        "n1",
        &delta("b", 1, vec![store(&keys[..2], proto::Tier::T1, "")]),
    )
    .unwrap();

    let r = ix.lookup(&query(&tokens(0..18)));
    assert!(r.prefix_match);
    assert_eq!(r.block_size, 4);
    assert_eq!(r.request_blocks, 4);
    let got: Vec<(&str, u32, u32)> = r
        .replicas
        .iter()
        .map(|m| (m.replica(), m.matched_blocks, m.matched_tokens))
        .collect();
    assert_eq!(got, vec![("a", 4, 16), ("b", 2, 8)]);
    assert_eq!(r.replicas[0].node(), "n1");

    let miss = ix.lookup(&query(&tokens(100..120)));
    assert!(!miss.prefix_match);
    assert_eq!(miss.reason, "NoReplicaHoldsPrefix");
    assert!(miss.replicas.is_empty());
}

#[test]
fn a_hole_in_the_chain_ends_the_match_there() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..16), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    let remove = proto::KvOp {
        op: Some(Op::Remove(proto::RemoveOp {
            adapter: String::new(),
            block_size: 4,
            content_keys: vec![keys[2]],
        })),
    };
    ix.apply_delta("n1", &delta("a", 2, vec![remove])).unwrap();
    let r = ix.lookup(&query(&tokens(0..16)));
    assert_eq!(r.replicas[0].matched_blocks, 2);
    assert_eq!(ix.entry_count(), 3);
}

#[test]
fn tier_is_t2_when_any_matched_block_is_offloaded_and_restore_returns_t1() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    ix.apply_delta(
        "n1",
        &delta("a", 2, vec![store(&keys[1..], proto::Tier::T2, "")]),
    )
    .unwrap();
    let r = ix.lookup(&query(&tokens(0..8)));
    assert_eq!(r.replicas[0].tier, Tier::T2);
    assert_eq!(ix.snapshot().replicas[0].t2_blocks, 1);
    ix.apply_delta(
        "n1",
        &delta("a", 3, vec![store(&keys[1..], proto::Tier::T1, "")]),
    )
    .unwrap();
    assert_eq!(ix.lookup(&query(&tokens(0..8))).replicas[0].tier, Tier::T1);
    assert_eq!(ix.snapshot().replicas[0].t2_blocks, 0);
}

#[test]
fn out_of_order_and_unknown_deltas_are_refused_without_change() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..4), 4);
    let err = ix
        .apply_delta(
            "n1",
            &delta("a", 2, vec![store(&keys, proto::Tier::T1, "")]),
        )
        .unwrap_err();
    assert_eq!(
        err,
        ApplyError::SequenceGap {
            stream_id: "default/a#0".into(),
            expected: 1,
            got: 2
        }
    );
    assert_eq!(ix.entry_count(), 0);
    let err = ix
        .apply_delta(
            "n1",
            &delta("zz", 1, vec![store(&keys, proto::Tier::T1, "")]),
        )
        .unwrap_err();
    assert_eq!(err.reason(), "unknown_stream");
    // A stream of node n1 cannot be fed by node n2.
    let err = ix
        .apply_delta(
            "n2",
            &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
        )
        .unwrap_err();
    assert_eq!(err.reason(), "unknown_stream");
}

#[test]
fn deltas_resolve_their_stream_exactly_across_removals_recycled_slots_and_moves() {
    // Every delta's stream goes through the stream cache: a stream removed (its cached
    // candidate now stale), its slot recycled by another stream, a stream moved to another
    // node and a fleet larger than the cache's first table must all resolve as the map does.
    let keys = chain(&tokens(0..32), 4);
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    let one = |pod: &str, seq| delta(pod, seq, vec![store(&keys[..1], proto::Tier::T1, "")]);
    ix.apply_delta("n1", &one("a", 1)).unwrap();
    ix.apply_delta("n1", &one("b", 1)).unwrap();
    // "a" goes; "c" takes its slot (the cache still names that slot for "a").
    assert!(ix.remove_stream("default/a#0"));
    ix.resync_node("n2", &[empty_snapshot("c")]);
    let err = ix.apply_delta("n1", &one("a", 2)).unwrap_err();
    assert_eq!(err.reason(), "unknown_stream");
    let err = ix.apply_delta("n1", &one("c", 1)).unwrap_err();
    assert_eq!(err.reason(), "unknown_stream", "c belongs to n2");
    ix.apply_delta("n2", &one("c", 1)).unwrap();
    // "b" moves to n3 (seq restarts): n1 may no longer feed it.
    ix.resync_node("n3", &[empty_snapshot("b")]);
    assert_eq!(
        ix.apply_delta("n1", &one("b", 2)).unwrap_err().reason(),
        "unknown_stream"
    );
    ix.apply_delta("n3", &one("b", 1)).unwrap();
    // A fleet of 300 streams (the cache grows and refills), each fed twice in turn.
    let pods: Vec<String> = (0..300).map(|i| format!("p{i:03}")).collect();
    ix.resync_node(
        "n4",
        &pods.iter().map(|p| empty_snapshot(p)).collect::<Vec<_>>(),
    );
    for seq in 1..=2 {
        for (i, p) in pods.iter().enumerate() {
            let k = &keys[(i % 4)..(i % 4) + 1 + seq as usize];
            ix.apply_delta("n4", &delta(p, seq, vec![store(k, proto::Tier::T1, "")]))
                .unwrap();
        }
    }
    for (i, p) in pods.iter().enumerate() {
        let got: Vec<u64> = ix
            .stream_entries(&format!("default/{p}#0"))
            .unwrap()
            .into_iter()
            .map(|e| e.content_key)
            .collect();
        let mut want = keys[(i % 4)..(i % 4) + 3].to_vec();
        want.sort_unstable();
        assert_eq!(got, want, "{p}");
    }
    assert_eq!(ix.entry_count(), 1 + 1 + 300 * 3);
}

#[test]
fn resync_replaces_the_nodes_state_and_clear_empties_a_replica() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    ix.apply_delta(
        "n1",
        &delta("b", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    let clear = proto::KvOp {
        op: Some(Op::Clear(proto::ClearOp {
            reason: "AllBlocksCleared".into(),
        })),
    };
    ix.apply_delta("n1", &delta("b", 2, vec![clear])).unwrap();
    assert_eq!(ix.lookup(&query(&tokens(0..8))).replicas.len(), 1);

    let snap = proto::StreamSnapshot {
        coverage: ic_shared::proto::Coverage::Exact as i32,
        coverage_reason: String::new(),
        stream: Some(desc("c", 0)),
        seq: 7,
        entries: vec![proto::BlockEntry {
            adapter: String::new(),
            block_size: 4,
            content_key: keys[0],
            tier: proto::Tier::T1 as i32,
        }],
        last_event_unix_ms: 5,
        stale: false,
    };
    ix.resync_node("n1", &[snap]);
    let r = ix.lookup(&query(&tokens(0..8)));
    assert_eq!(r.replicas.len(), 1);
    assert_eq!(r.replicas[0].replica(), "c");
    assert_eq!(r.replicas[0].matched_blocks, 1);
    assert_eq!(ix.replica_count(), 1);
    assert_eq!(ix.block_count(), 1);
    // The resynced stream continues at seq 8.
    ix.apply_delta(
        "n1",
        &proto::StreamDelta {
            coverage: ic_shared::proto::Coverage::Exact as i32,
            coverage_reason: String::new(),
            stream: Some(desc("c", 0)),
            seq: 8,
            ops: vec![],
            last_event_unix_ms: 9,
        },
    )
    .unwrap();
}

#[test]
fn adapters_are_isolated_and_minimum_prefix_tokens_gates_the_hint() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "sql-lora")]),
    )
    .unwrap();
    assert!(!ix.lookup(&query(&tokens(0..8))).prefix_match);
    let mut q = query(&tokens(0..8));
    q.adapter = "sql-lora".into();
    assert!(ix.lookup(&q).prefix_match);
    q.minimum_prefix_tokens = 9;
    let r = ix.lookup(&q);
    assert!(!r.prefix_match);
    assert_eq!(r.reason, "BelowMinimumPrefixTokens");
}

#[test]
fn content_keys_can_be_given_instead_of_tokens() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    let q = LookupQuery {
        content_keys: keys.clone(),
        block_size: Some(4),
        ..Default::default()
    };
    let r = ix.lookup(&q);
    assert_eq!(r.replicas[0].matched_tokens, 8);
    let q = LookupQuery {
        content_keys: keys,
        block_size: Some(16),
        ..Default::default()
    };
    assert_eq!(ix.lookup(&q).reason, "NoBlockSizeRegistered");
}

#[test]
fn removing_a_node_drops_its_entries() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    ix.remove_node("n1");
    assert_eq!(ix.entry_count(), 0);
    assert_eq!(ix.block_count(), 0);
    assert_eq!(ix.replica_count(), 0);
}

// ---- Layout, policy and projection (issue 3, item 5/6) ----

fn snapshot_with(pod: &str, entries: Vec<proto::BlockEntry>) -> proto::StreamSnapshot {
    proto::StreamSnapshot {
        coverage: ic_shared::proto::Coverage::Exact as i32,
        coverage_reason: String::new(),
        stream: Some(desc(pod, 0)),
        seq: 0,
        entries,
        last_event_unix_ms: 0,
        stale: false,
    }
}

#[test]
fn many_holders_spill_and_shrink_and_lookups_intersect_them() {
    let mut ix = PrefixIndex::new();
    let pods: Vec<String> = (0..40).map(|i| format!("p{i:02}")).collect();
    let snaps: Vec<_> = pods.iter().map(|p| empty_snapshot(p)).collect();
    ix.resync_node("n1", &snaps);
    let keys = chain(&tokens(0..16), 4);
    // Every replica holds block 0 (a shared system prompt); replica i holds i % 4 + 1 blocks.
    for (i, p) in pods.iter().enumerate() {
        let depth = i % 4 + 1;
        ix.apply_delta(
            "n1",
            &delta(p, 1, vec![store(&keys[..depth], proto::Tier::T1, "")]),
        )
        .unwrap();
    }
    assert_eq!(ix.block_count(), 4);
    assert_eq!(ix.entry_count(), 10 * (1 + 2 + 3 + 4));
    let r = ix.lookup(&query(&tokens(0..16)));
    assert_eq!(r.replicas.len(), 40);
    // Deepest first, then by stream id.
    assert_eq!(r.replicas[0].replica(), "p03");
    assert_eq!(r.replicas[0].matched_blocks, 4);
    assert_eq!(r.replicas[9].replica(), "p39");
    assert_eq!(r.replicas[10].matched_blocks, 3);
    assert_eq!(r.replicas[39].matched_blocks, 1);
    // A capped answer keeps the best ones in the same order.
    let mut q = query(&tokens(0..16));
    q.max_replicas = 3;
    let capped = ix.lookup(&q);
    assert_eq!(
        capped
            .replicas
            .iter()
            .map(|m| m.replica())
            .collect::<Vec<_>>(),
        vec!["p03", "p07", "p11"]
    );
    // Clearing most replicas shrinks the spilled holder lists back.
    for p in &pods[2..] {
        ix.remove_stream(&format!("default/{p}#0"));
    }
    assert_eq!(ix.entry_count(), 1 + 2);
    let r = ix.lookup(&query(&tokens(0..16)));
    let got: Vec<_> = r
        .replicas
        .iter()
        .map(|m| (m.replica(), m.matched_blocks))
        .collect();
    assert_eq!(got, vec![("p01", 2), ("p00", 1)]);
}

#[test]
fn duplicate_stores_are_idempotent_and_unknown_removes_ignored() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta(
            "a",
            1,
            vec![
                store(&keys, proto::Tier::T1, ""),
                store(&keys, proto::Tier::T1, ""),
            ],
        ),
    )
    .unwrap();
    let remove_unknown = proto::KvOp {
        op: Some(Op::Remove(proto::RemoveOp {
            adapter: "other".into(),
            block_size: 4,
            content_keys: vec![1, 2, 3],
        })),
    };
    let remove_missing = proto::KvOp {
        op: Some(Op::Remove(proto::RemoveOp {
            adapter: String::new(),
            block_size: 4,
            content_keys: vec![12345],
        })),
    };
    ix.apply_delta("n1", &delta("a", 2, vec![remove_unknown, remove_missing]))
        .unwrap();
    assert_eq!(ix.entry_count(), 2);
    let entries = ix.stream_entries("default/a#0").unwrap();
    assert_eq!(entries.len(), 2);
    assert!(entries
        .iter()
        .all(|e| e.tier == Tier::T1 && e.block_size == 4));
    assert_eq!(ix.stream_entries("default/zz#0"), None);
}

#[test]
fn replicas_with_several_block_sizes_match_at_each_and_the_deepest_wins() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("v"), empty_snapshot("s")]);
    let t = tokens(0..64);
    let k4 = chain(&t, 4);
    let k16 = chain(&t, 16);
    ix.apply_delta(
        "n1",
        &delta("v", 1, vec![store(&k4[..3], proto::Tier::T1, "")]),
    )
    .unwrap();
    let s16 = proto::KvOp {
        op: Some(Op::Store(proto::StoreOp {
            adapter: String::new(),
            block_size: 16,
            tier: proto::Tier::T2 as i32,
            content_keys: k16[..2].to_vec(),
        })),
    };
    ix.apply_delta("n1", &delta("s", 1, vec![s16])).unwrap();
    // Raw tokens are chunked at every registered size: 32 tokens at 16 beat 12 at 4.
    let r = ix.lookup(&query(&t));
    assert_eq!(r.block_size, 16);
    assert_eq!(r.replicas[0].replica(), "s");
    assert_eq!(r.replicas[0].matched_tokens, 32);
    assert_eq!(r.replicas[0].tier, Tier::T2);
    // Restricted to one size, the other partition answers.
    let mut q = query(&t);
    q.block_size = Some(4);
    let r = ix.lookup(&q);
    assert_eq!(
        (r.replicas[0].replica(), r.replicas[0].matched_tokens),
        ("v", 12)
    );
    assert_eq!(ix.block_sizes()["vllm"], vec![4, 16]);
    let snap = ix.snapshot();
    assert_eq!(snap.replicas[0].block_sizes, vec![16]);
    assert_eq!(snap.replicas[0].t2_blocks, 2);
    assert_eq!(snap.replicas[1].block_sizes, vec![4]);
}

#[test]
fn short_requests_and_expired_deadlines_answer_no_hint_with_their_reason() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..64), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    // The request itself is shorter than the minimum: the index is not consulted.
    let mut q = query(&tokens(0..16));
    q.minimum_prefix_tokens = 32;
    let r = ix.lookup(&q);
    assert_eq!(
        (r.prefix_match, r.reason.as_str()),
        (false, "BelowMinimumPrefixTokens")
    );
    // Content keys count at the given block size.
    let q = LookupQuery {
        content_keys: keys[..4].to_vec(),
        block_size: Some(4),
        minimum_prefix_tokens: 17,
        ..Default::default()
    };
    assert_eq!(ix.lookup(&q).reason, "BelowMinimumPrefixTokens");
    // A deadline already past.
    let mut q = query(&tokens(0..64));
    q.deadline = Some(std::time::Instant::now());
    let r = ix.lookup(&q);
    assert_eq!((r.prefix_match, r.reason.as_str()), (false, LOOKUP_TIMEOUT));
    assert!(r.replicas.is_empty());
    // Shorter than one block.
    assert_eq!(
        ix.lookup(&query(&tokens(0..3))).reason,
        "RequestShorterThanOneBlock"
    );
}

#[test]
fn snapshot_shows_tier_counts_last_event_and_t2_counters() {
    let mut ix = PrefixIndex::new();
    let keys = chain(&tokens(0..12), 4);
    let entries = keys
        .iter()
        .enumerate()
        .map(|(i, k)| proto::BlockEntry {
            adapter: String::new(),
            block_size: 4,
            content_key: *k,
            tier: if i == 2 {
                proto::Tier::T2
            } else {
                proto::Tier::T1
            } as i32,
        })
        .collect();
    let mut snap = snapshot_with("a", entries);
    snap.last_event_unix_ms = 1_780_000_000_123;
    ix.resync_node("n1", &[snap]);
    let s = ix.snapshot();
    let r = &s.replicas[0];
    assert_eq!((r.prefix_count, r.t1_blocks, r.t2_blocks), (3, 2, 1));
    assert_eq!(r.last_event_at.as_deref(), Some("2026-05-28T20:26:40.123Z"));
    assert_eq!((r.t2_hits, r.t2_queries), (None, None));
    let json = serde_json::to_value(r).unwrap();
    assert!(json.get("t2Hits").is_none());
    assert_eq!(json["lastEventAt"], "2026-05-28T20:26:40.123Z");
    ix.set_engine_counters(
        "default/a#0",
        EngineReport {
            t2: Some((5, 9)),
            ..Default::default()
        },
    );
    let json = serde_json::to_value(&ix.snapshot().replicas[0]).unwrap();
    assert_eq!(
        (json["t2Hits"].as_u64(), json["t2Queries"].as_u64()),
        (Some(5), Some(9))
    );
    assert!(json.get("cacheMemoryBytes").is_none());
    // A memory-only report (the engine exports no tier-2 counters now) keeps the counters.
    ix.set_engine_counters(
        "default/a#0",
        EngineReport {
            cache_memory_bytes: Some(1 << 30),
            ..Default::default()
        },
    );
    let json = serde_json::to_value(&ix.snapshot().replicas[0]).unwrap();
    assert_eq!(
        (json["t2Hits"].as_u64(), json["cacheMemoryBytes"].as_u64()),
        (Some(5), Some(1 << 30))
    );
    assert!(ix.approx_heap_bytes() > 0);
}

#[test]
fn policy_table_resolves_namespace_then_defaults_then_fallback() {
    let ix = PrefixIndex::new();
    let t = ix.policies();
    let fallback = ResolvedPolicy {
        lookup_timeout: Some(std::time::Duration::from_millis(50)),
        minimum_prefix_tokens: 7,
    };
    assert_eq!(t.resolve_or("ns", fallback), fallback);
    ix.set_policy("ns", Some(0), Some(0));
    let p = t.resolve_or("ns", fallback);
    assert_eq!((p.lookup_timeout, p.minimum_prefix_tokens), (None, 0));
    t.set_defaults(Some(10), 3);
    let p = t.resolve_or("other", fallback);
    assert_eq!(
        (p.lookup_timeout, p.minimum_prefix_tokens),
        (Some(std::time::Duration::from_millis(10)), 3)
    );
    assert_eq!(t.resolve_or("", fallback).minimum_prefix_tokens, 3);
    assert_eq!(t.list().len(), 1);
    t.remove_policy("ns");
    assert!(t.list().is_empty());
}

/// A small deterministic generator (xorshift64, no extra dependency) seeded with `seed` (not 0).
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

#[test]
fn random_ops_keep_the_index_equal_to_a_naive_model() {
    use std::collections::{BTreeMap, BTreeSet};
    let mut next = xorshift(0x1234_5678_9abc_def0);
    let mut ix = PrefixIndex::new();
    let pods: Vec<String> = (0..6).map(|i| format!("r{i}")).collect();
    ix.resync_node(
        "n1",
        &pods.iter().map(|p| empty_snapshot(p)).collect::<Vec<_>>(),
    );
    let mut seqs: BTreeMap<String, u64> = pods.iter().map(|p| (p.clone(), 0)).collect();
    let mut model: BTreeMap<String, BTreeMap<u64, Tier>> = BTreeMap::new();
    for _ in 0..4000 {
        let p = &pods[(next() % pods.len() as u64) as usize];
        let key = next() % 24;
        let seq = seqs.get_mut(p).unwrap();
        *seq += 1;
        let m = model.entry(p.clone()).or_default();
        let op = match next() % 10 {
            0..=4 => {
                let tier = if next().is_multiple_of(3) {
                    Tier::T2
                } else {
                    Tier::T1
                };
                m.insert(key, tier);
                store(&[key], tier.to_proto(), "")
            }
            5..=8 => {
                m.remove(&key);
                proto::KvOp {
                    op: Some(Op::Remove(proto::RemoveOp {
                        adapter: String::new(),
                        block_size: 4,
                        content_keys: vec![key],
                    })),
                }
            }
            _ => {
                m.clear();
                proto::KvOp {
                    op: Some(Op::Clear(proto::ClearOp {
                        reason: "AllBlocksCleared".into(),
                    })),
                }
            }
        };
        ix.apply_delta("n1", &delta(p, *seq, vec![op])).unwrap();
    }
    let mut total = 0;
    let mut blocks = BTreeSet::new();
    for p in &pods {
        let want: Vec<(u64, Tier)> = model
            .get(p)
            .map(|m| m.iter().map(|(k, t)| (*k, *t)).collect())
            .unwrap_or_default();
        let mut got: Vec<(u64, Tier)> = ix
            .stream_entries(&format!("default/{p}#0"))
            .unwrap()
            .into_iter()
            .map(|e| (e.content_key, e.tier))
            .collect();
        got.sort_unstable();
        assert_eq!(got, want, "replica {p}");
        total += want.len();
        blocks.extend(want.iter().map(|(k, _)| *k));
        let snap = ix.snapshot();
        let r = snap.replicas.iter().find(|r| r.replica == *p).unwrap();
        assert_eq!(r.prefix_count, want.len());
        assert_eq!(
            r.t2_blocks,
            want.iter().filter(|(_, t)| *t == Tier::T2).count()
        );
    }
    assert_eq!(ix.entry_count(), total);
    assert_eq!(ix.block_count(), blocks.len());
    // Chain walks (any key sequence, up to 40 levels: several gather chunks) agree with a naive
    // walk over the model.
    for _ in 0..300 {
        let len = 1 + (next() % 40) as usize;
        let chain: Vec<u64> = (0..len).map(|_| next() % 24).collect();
        let q = LookupQuery {
            content_keys: chain.clone(),
            block_size: Some(4),
            ..Default::default()
        };
        let mut got: Vec<(String, u32, Tier)> = ix
            .lookup(&q)
            .replicas
            .into_iter()
            .map(|m| (m.replica().to_string(), m.matched_blocks, m.tier))
            .collect();
        got.sort();
        let mut want: Vec<(String, u32, Tier)> = model
            .iter()
            .filter_map(|(p, m)| {
                let depth = chain.iter().take_while(|k| m.contains_key(k)).count() as u32;
                let t2 = chain[..depth as usize].iter().any(|k| m[k] == Tier::T2);
                (depth > 0).then(|| (p.clone(), depth, if t2 { Tier::T2 } else { Tier::T1 }))
            })
            .collect();
        want.sort();
        assert_eq!(got, want, "chain {chain:?}");
    }
    // Single-key lookups agree with the model.
    for key in 0..24u64 {
        let q = LookupQuery {
            content_keys: vec![key],
            block_size: Some(4),
            ..Default::default()
        };
        let mut got: Vec<String> = ix
            .lookup(&q)
            .replicas
            .into_iter()
            .map(|m| m.replica().to_string())
            .collect();
        got.sort();
        let want: Vec<String> = model
            .iter()
            .filter(|(_, m)| m.contains_key(&key))
            .map(|(p, _)| p.clone())
            .collect();
        assert_eq!(got, want, "key {key}");
    }
}

/// Chain walks over hundreds of replicas (long holder lists on both sides of every
/// intersection: a prefix everyone holds, then sets thinning out at random, holes included)
/// agree with a naive walk over what each replica stored.
#[test]
fn walks_over_long_holder_lists_agree_with_a_naive_model() {
    let mut next = xorshift(0x0bad_cafe_f00d_1234);
    let keys = chain(&tokens(0..4 * 48), 4);
    let pods: Vec<String> = (0..400).map(|i| format!("r{i:03}")).collect();
    let mut ix = PrefixIndex::new();
    ix.resync_node(
        "n1",
        &pods.iter().map(|p| empty_snapshot(p)).collect::<Vec<_>>(),
    );
    let mut held: Vec<Vec<bool>> = Vec::new();
    for p in &pods {
        // Every replica holds the first 8 blocks; after that each keeps going with a
        // replica-specific probability, with an occasional hole.
        let keep = 50 + next() % 50;
        let mut h = vec![false; keys.len()];
        let mut on = true;
        for (b, slot) in h.iter_mut().enumerate() {
            if b >= 8 && next() % 100 >= keep {
                on = false;
            }
            *slot = on || next().is_multiple_of(7);
        }
        let stored: Vec<u64> = keys
            .iter()
            .zip(&h)
            .filter(|(_, on)| **on)
            .map(|(k, _)| *k)
            .collect();
        ix.apply_delta(
            "n1",
            &delta(p, 1, vec![store(&stored, proto::Tier::T1, "")]),
        )
        .unwrap();
        held.push(h);
    }
    for start in [0usize, 0, 0, 3, 8, 20] {
        let len = 1 + (next() as usize) % (keys.len() - start);
        let q = LookupQuery {
            content_keys: keys[start..start + len].to_vec(),
            block_size: Some(4),
            ..Default::default()
        };
        let mut got: Vec<(String, u32)> = ix
            .lookup(&q)
            .replicas
            .into_iter()
            .map(|m| (m.replica().to_string(), m.matched_blocks))
            .collect();
        got.sort();
        let want: Vec<(String, u32)> = pods
            .iter()
            .zip(&held)
            .filter_map(|(p, h)| {
                let depth = h[start..start + len].iter().take_while(|on| **on).count() as u32;
                (depth > 0).then(|| (p.clone(), depth))
            })
            .collect();
        assert!(!want.is_empty());
        assert_eq!(got, want, "chain {start}..{}", start + len);
    }
}

#[test]
fn disconnected_replicas_are_not_matched_and_come_back_with_their_entries() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    let keys = chain(&tokens(0..16), 4);
    for pod in ["a", "b"] {
        ix.apply_delta(
            "n1",
            &delta(pod, 1, vec![store(&keys, proto::Tier::T1, "")]),
        )
        .unwrap();
    }
    let matched = |ix: &PrefixIndex| -> Vec<(String, CoverageState)> {
        ix.lookup(&query(&tokens(0..16)))
            .replicas
            .into_iter()
            .map(|m| (m.replica().to_string(), m.coverage.state))
            .collect()
    };
    assert_eq!(matched(&ix).len(), 2);
    // b's publisher is gone: a coverage-only delta makes it unroutable, entries kept.
    let mut d = delta("b", 2, vec![]);
    d.coverage = proto::Coverage::Disconnected as i32;
    d.coverage_reason = coverage::PUBLISHER_DISCONNECTED.into();
    ix.apply_delta("n1", &d).unwrap();
    assert_eq!(matched(&ix), vec![("a".to_string(), CoverageState::Exact)]);
    assert_eq!(ix.stream_entries("default/b#0").unwrap().len(), 4);
    let snap = ix.snapshot();
    let b = snap.replicas.iter().find(|r| r.replica == "b").unwrap();
    assert_eq!((b.coverage, b.routable), ("Disconnected", false));
    // The agent's stream drops: a stays routable (Unknown), b stays unrouted.
    ix.mark_node_unreported("n1");
    assert_eq!(
        matched(&ix),
        vec![("a".to_string(), CoverageState::Unknown)]
    );
    assert_eq!(
        ix.coverage_counts()
            .iter()
            .filter(|(_, n)| *n > 0)
            .copied()
            .collect::<Vec<_>>(),
        vec![
            (CoverageState::Disconnected, 1),
            (CoverageState::Unknown, 1)
        ]
    );
    // b is back and verified.
    let mut d = delta("b", 3, vec![]);
    d.coverage = proto::Coverage::Exact as i32;
    ix.apply_delta("n1", &d).unwrap();
    assert_eq!(matched(&ix).len(), 2);
    // A partial replica is matched and says so.
    let mut d = delta("a", 2, vec![]);
    d.coverage = proto::Coverage::Partial as i32;
    d.coverage_reason = coverage::BOOTSTRAP_INCOMPLETE.into();
    ix.apply_delta("n1", &d).unwrap();
    let r = ix.lookup(&query(&tokens(0..16)));
    let a = r.replicas.iter().find(|m| m.replica() == "a").unwrap();
    assert_eq!(
        a.coverage,
        Coverage::new(CoverageState::Partial, coverage::BOOTSTRAP_INCOMPLETE)
    );
}

/// A NO_HINT whose only holders are unroutable (publisher gone) says so — `HolderNotRoutable`,
/// not `NoReplicaHoldsPrefix` ("a cold prefix"); an unrelated prompt is still a cold prefix, and
/// the holder back reads PREFIX_MATCH again.
#[test]
fn a_miss_whose_holder_is_disconnected_says_the_holder_is_not_routable() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..16), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    assert!(ix.lookup(&query(&tokens(0..16))).prefix_match);
    let mut d = delta("a", 2, vec![]);
    d.coverage = proto::Coverage::Disconnected as i32;
    d.coverage_reason = coverage::PUBLISHER_DISCONNECTED.into();
    ix.apply_delta("n1", &d).unwrap();
    let miss = ix.lookup(&query(&tokens(0..16)));
    assert!(!miss.prefix_match);
    assert_eq!(miss.reason, "HolderNotRoutable");
    assert!(miss.replicas.is_empty());
    // a shorter prompt still starts with the held block
    assert_eq!(ix.lookup(&query(&tokens(0..5))).reason, "HolderNotRoutable");
    assert_eq!(
        ix.lookup(&query(&tokens(100..116))).reason,
        "NoReplicaHoldsPrefix"
    );
    let mut d = delta("a", 3, vec![]);
    d.coverage = proto::Coverage::Exact as i32;
    ix.apply_delta("n1", &d).unwrap();
    assert!(ix.lookup(&query(&tokens(0..16))).prefix_match);
}

/// A CacheTenant quota (issue 15: one pod-bound token must not grow the index without bound):
/// the tenant holds at most `max` distinct blocks; storing beyond evicts its oldest first, from
/// every replica holding them, and those replicas say so (Partial / TenantQuotaExceeded) in the
/// snapshot and in lookup answers. Other tenants are untouched; a Clear resets the flag.
#[test]
fn a_tenant_quota_evicts_the_oldest_blocks_and_says_so() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    let other = proto::StreamSnapshot {
        stream: Some(proto::StreamDescriptor {
            stream_id: "other/c#0".into(),
            replica: "c".into(),
            tenant: "other".into(),
            ..desc("c", 0)
        }),
        ..empty_snapshot("c")
    };
    ix.resync_node("n2", &[other]);
    let keys = chain(&tokens(0..40), 4); // 10 chained blocks
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys[..6], proto::Tier::T1, "")]),
    )
    .unwrap();
    ix.apply_delta(
        "n1",
        &delta("b", 1, vec![store(&keys[..2], proto::Tier::T1, "")]),
    )
    .unwrap();
    let other_keys: Vec<u64> = (1000..1020).collect();
    let mut other_delta = delta("c", 1, vec![store(&other_keys, proto::Tier::T1, "")]);
    other_delta.stream = Some(proto::StreamDescriptor {
        stream_id: "other/c#0".into(),
        replica: "c".into(),
        tenant: "other".into(),
        ..desc("c", 0)
    });
    ix.apply_delta("n2", &other_delta).unwrap();

    // A quota below what the tenant holds: the oldest two blocks go (keys 0, 1 — held by a and b).
    ix.set_tenant_quotas(HashMap::from([("default".to_string(), 4)]));
    assert_eq!(ix.blocks_by_tenant().get("default"), Some(&4));
    assert_eq!(ix.blocks_by_tenant().get("other"), Some(&20));
    assert_eq!(ix.quota_evictions().get("default"), Some(&2));
    let snap = ix.snapshot();
    let cov: Vec<(&str, &str, Option<&str>, usize)> = snap
        .replicas
        .iter()
        .map(|r| {
            (
                r.replica.as_str(),
                r.coverage,
                r.coverage_reason,
                r.prefix_count,
            )
        })
        .collect();
    assert_eq!(
        cov,
        vec![
            ("a", "Partial", Some("TenantQuotaExceeded"), 4),
            ("b", "Partial", Some("TenantQuotaExceeded"), 0),
            ("c", "Exact", None, 20),
        ]
    );
    // Storing more evicts the oldest remaining first; the newest blocks stay routable.
    ix.apply_delta(
        "n1",
        &delta("a", 2, vec![store(&keys[6..], proto::Tier::T1, "")]),
    )
    .unwrap();
    assert_eq!(ix.blocks_by_tenant().get("default"), Some(&4));
    assert_eq!(ix.quota_evictions().get("default"), Some(&6));
    let mut entries: Vec<u64> = ix
        .stream_entries("default/a#0")
        .unwrap()
        .iter()
        .map(|e| e.content_key)
        .collect();
    entries.sort_unstable();
    let mut newest = keys[6..].to_vec();
    newest.sort_unstable();
    assert_eq!(entries, newest);
    let r = ix.lookup(&query(&tokens(0..40)));
    // The chain's head was evicted, so the prefix no longer matches from the start: the index
    // does not pretend.
    assert!(!r.prefix_match);
    // The delta's Exact does not overwrite the index's own Partial.
    assert_eq!(ix.snapshot().replicas[0].coverage, "Partial");
    // A Clear (engine cache reset) empties the replica and the flag with it.
    ix.apply_delta(
        "n1",
        &delta(
            "a",
            3,
            vec![proto::KvOp {
                op: Some(Op::Clear(proto::ClearOp {
                    reason: "AllBlocksCleared".into(),
                })),
            }],
        ),
    )
    .unwrap();
    assert_eq!(ix.snapshot().replicas[0].coverage, "Exact");
}

/// The per-stream cap (`--max-blocks-per-stream`): blocks beyond it are not indexed, tier
/// changes of held ones still apply, the stream reads Partial / StreamCapExceeded and lookups
/// say it on every match.
#[test]
fn the_per_stream_cap_refuses_new_blocks_loudly() {
    let mut ix = PrefixIndex::new();
    ix.set_max_blocks_per_stream(3);
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let keys = chain(&tokens(0..20), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    assert_eq!(ix.entry_count(), 3);
    assert_eq!(ix.stream_cap_refusals(), 2);
    ix.apply_delta(
        "n1",
        &delta("a", 2, vec![store(&keys[..1], proto::Tier::T2, "")]),
    )
    .unwrap();
    let s = ix.snapshot();
    assert_eq!(
        (s.replicas[0].t2_blocks, s.replicas[0].prefix_count),
        (1, 3)
    );
    assert_eq!(s.replicas[0].coverage_reason, Some("StreamCapExceeded"));
    let r = ix.lookup(&query(&tokens(0..12)));
    assert!(r.prefix_match);
    assert_eq!(r.replicas[0].coverage.reason, Some("StreamCapExceeded"));
}

/// Under a quota, a block removed and stored again is new again (it is not evicted as old), and
/// churn below the quota (an engine's LRU storing and removing) keeps the arrival queue
/// proportional to what the tenant holds.
#[test]
fn quota_order_follows_re_stores_and_the_queue_stays_bounded_under_churn() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    ix.set_tenant_quotas(HashMap::from([("default".to_string(), 3)]));
    let remove = |keys: &[u64]| proto::KvOp {
        op: Some(Op::Remove(proto::RemoveOp {
            adapter: String::new(),
            block_size: 4,
            content_keys: keys.to_vec(),
        })),
    };
    let mut seq = 0;
    let mut step = |ix: &mut PrefixIndex, ops: Vec<proto::KvOp>| {
        seq += 1;
        ix.apply_delta("n1", &delta("a", seq, ops)).unwrap();
    };
    step(&mut ix, vec![store(&[1, 2, 3], proto::Tier::T1, "")]);
    step(&mut ix, vec![remove(&[1])]);
    step(&mut ix, vec![store(&[1], proto::Tier::T1, "")]); // 1 is now the newest
    step(&mut ix, vec![store(&[4], proto::Tier::T1, "")]); // over: the oldest is 2
    let mut held: Vec<u64> = ix
        .stream_entries("default/a#0")
        .unwrap()
        .iter()
        .map(|e| e.content_key)
        .collect();
    held.sort_unstable();
    assert_eq!(held, vec![1, 3, 4]);
    assert_eq!(ix.quota_evictions().get("default"), Some(&1));

    // Churn below the quota: 20 000 stores and removes of fresh blocks.
    step(&mut ix, vec![remove(&[1, 3, 4])]);
    for k in 0..20_000u64 {
        step(&mut ix, vec![store(&[100 + k], proto::Tier::T1, "")]);
        step(&mut ix, vec![remove(&[100 + k])]);
    }
    let f = &ix.tenant_fifo["default"];
    assert!(
        f.queue.len() <= 2 * ix.tenant_blocks("default") + 1025,
        "queue {} for {} blocks",
        f.queue.len(),
        ix.tenant_blocks("default")
    );
    assert!(f.latest.len() <= f.queue.len());
    assert_eq!(
        ix.quota_evictions().get("default"),
        Some(&1),
        "no eviction below the quota"
    );
}

#[test]
fn churn_of_streams_keeps_answer_order_and_coverage_counts_exact() {
    // Streams come and go on several nodes (resyncs, removals, expiry), with coverage
    // changes, a per-stream cap and a tenant quota: after every step the incrementally kept
    // coverage tally equals a walk over the replicas, and answers list ties by stream id.
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut ix = PrefixIndex::new();
    ix.set_max_blocks_per_stream(6);
    ix.set_tenant_quotas([("default".to_string(), 40usize)].into_iter().collect());
    let keys = chain(&tokens(0..32), 4);
    let mut seqs: HashMap<String, u64> = HashMap::new();
    let states = [
        proto::Coverage::Exact,
        proto::Coverage::Healing,
        proto::Coverage::Partial,
        proto::Coverage::Disconnected,
        proto::Coverage::EngineDown,
    ];
    for step in 0..600 {
        let node = format!("n{}", next() % 4);
        match next() % 8 {
            0 => {
                // A resync of the node with a random set of pods (ids shared across nodes:
                // the newest report wins).
                let pods: Vec<String> = (0..(next() % 6))
                    .map(|_| format!("p{:02}", next() % 30))
                    .collect();
                let snaps: Vec<_> = pods.iter().map(|p| empty_snapshot(p)).collect();
                ix.resync_node(&node, &snaps);
                for p in &pods {
                    seqs.insert(p.clone(), 0);
                }
            }
            1 => {
                ix.remove_node(&node);
            }
            2 => {
                ix.remove_stream(&format!("default/p{:02}#0", next() % 30));
            }
            3 => ix.mark_node_unreported(&node),
            // The plans change: a random subset of the pods (some never reported) expected.
            4 if next().is_multiple_of(4) => {
                let planned: HashMap<String, StreamScope> = (0..(next() % 12))
                    .map(|_| {
                        let d = desc(&format!("p{:02}", next() % 36), 0);
                        (d.stream_id, (d.tenant, d.model, d.hash_scheme))
                    })
                    .collect();
                ix.set_planned_streams(planned);
            }
            _ => {
                let p = format!("p{:02}", next() % 30);
                let Some(seq) = seqs.get_mut(&p) else {
                    continue;
                };
                let depth = 1 + (next() % 8) as usize;
                let mut d = delta(
                    &p,
                    *seq + 1,
                    vec![store(&keys[..depth], proto::Tier::T1, "")],
                );
                d.coverage = states[(next() % states.len() as u64) as usize] as i32;
                d.coverage_reason = "Test".into();
                for n in 0..4 {
                    if ix.apply_delta(&format!("n{n}"), &d).is_ok() {
                        *seq += 1;
                        break;
                    }
                }
            }
        }
        assert_eq!(
            ix.coverage_counts(),
            ix.coverage_counts_walked(),
            "step {step}"
        );
        assert_eq!(
            ix.coverage_tally.inexact,
            ix.inexact_walked(),
            "step {step}"
        );
        let absent = ix
            .coverage_tally
            .planned
            .keys()
            .filter(|id| !ix.slot_by_stream.contains_key(id.as_str()))
            .count();
        assert_eq!(ix.planned_streams_absent(), absent, "step {step}");
        let r = ix.lookup(&query(&tokens(0..32)));
        let order: Vec<(std::cmp::Reverse<u32>, Tier, String)> = r
            .replicas
            .iter()
            .map(|m| {
                (
                    std::cmp::Reverse(m.matched_tokens),
                    m.tier,
                    m.stream_id().to_string(),
                )
            })
            .collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "step {step}: answer order");
    }
}

/// The answer a router gets (`lookup`, capped at `max`) equals sorting every score of the
/// scoring pass by (deeper first, T1 before T2, stream id) and keeping the first `max`: the
/// bounded-heap selection, reading labels only where depth and tier do not decide, changes
/// nothing. Random fleets with many ties at the boundary, re-registered streams (recycled
/// slots, fresh labels) and two tenants merged under a wildcard query.
mod answer_selection {
    use super::*;
    use proptest::prelude::*;

    fn desc_in(tenant: &str, pod: &str) -> proto::StreamDescriptor {
        proto::StreamDescriptor {
            stream_id: format!("{tenant}/{pod}#0"),
            tenant: tenant.into(),
            ..desc(pod, 0)
        }
    }

    fn snap_in(tenant: &str, pod: &str) -> proto::StreamSnapshot {
        proto::StreamSnapshot {
            stream: Some(desc_in(tenant, pod)),
            ..empty_snapshot(pod)
        }
    }

    /// (tenant index, pod name, depth stored, index of a block stored at T2 if any).
    fn fleet() -> impl Strategy<Value = Vec<(usize, String, usize, Option<usize>)>> {
        prop::collection::vec(
            (
                0..2usize,
                "[a-d]{1,3}",
                0..5usize,
                prop::option::weighted(0.3, 0..5usize),
            ),
            1..90,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn capped_answer_equals_a_full_sort(
            fleet in fleet(),
            drop_every in 2..7usize,
            max in 0..40usize,
            query_depth in 1..6usize,
            wildcard in any::<bool>(),
        ) {
            let tenants = ["default", "other"];
            let keys = chain(&tokens(0..24), 4);
            let mut ix = PrefixIndex::new();
            // Unique stream ids, registered on one node per tenant, in generation order.
            let mut seen = std::collections::BTreeSet::new();
            let fleet: Vec<_> = fleet
                .into_iter()
                .filter(|(t, p, _, _)| seen.insert((*t, p.clone())))
                .collect();
            for (t, tenant) in tenants.iter().enumerate() {
                let snaps: Vec<_> = fleet
                    .iter()
                    .filter(|(ft, ..)| *ft == t)
                    .map(|(_, p, ..)| snap_in(tenant, p))
                    .collect();
                ix.resync_node(&format!("n{t}"), &snaps);
            }
            // Drop some streams and register them again (new slots and labels).
            for (i, (t, p, ..)) in fleet.iter().enumerate() {
                if i % drop_every == 0 {
                    let tenant = tenants[*t];
                    ix.remove_stream(&format!("{tenant}/{p}#0"));
                    ix.resync_node(&format!("extra-{tenant}-{p}"), &[snap_in(tenant, p)]);
                }
            }
            for (i, (t, p, depth, t2_at)) in fleet.iter().enumerate() {
                let tenant = tenants[*t];
                let node = if i % drop_every == 0 {
                    format!("extra-{tenant}-{p}")
                } else {
                    format!("n{t}")
                };
                let mut ops = vec![store(&keys[..*depth], proto::Tier::T1, "")];
                if let Some(j) = t2_at.filter(|j| j < depth) {
                    ops.push(store(&keys[j..=j], proto::Tier::T2, ""));
                }
                let d = proto::StreamDelta {
                    stream: Some(desc_in(tenant, p)),
                    ..delta(p, 1, ops)
                };
                ix.apply_delta(&node, &d).unwrap();
            }
            let q = LookupQuery {
                tenant: if wildcard { String::new() } else { "default".into() },
                content_keys: keys[..query_depth].to_vec(),
                block_size: Some(4),
                max_replicas: max,
                ..Default::default()
            };
            let got: Vec<(String, u32, u32, Tier, String, String)> = ix
                .lookup(&q)
                .replicas
                .iter()
                .map(|m| {
                    (
                        m.stream_id().to_string(),
                        m.matched_blocks,
                        m.matched_tokens,
                        m.tier,
                        m.replica().to_string(),
                        m.node().to_string(),
                    )
                })
                .collect();
            // The straightforward answer: every score, fully sorted by stream id strings.
            let mut want: Vec<(std::cmp::Reverse<u32>, Tier, String, u32)> = ix
                .score(&q)
                .unwrap()
                .replicas
                .iter()
                .map(|s| {
                    (
                        std::cmp::Reverse(s.matched_blocks * s.block_size),
                        if s.t1 { Tier::T1 } else { Tier::T2 },
                        ix.stream_of(s.slot).unwrap().to_string(),
                        s.matched_blocks,
                    )
                })
                .collect();
            want.sort();
            if max > 0 {
                want.truncate(max);
            }
            let want: Vec<(String, u32, u32, Tier, String, String)> = want
                .into_iter()
                .map(|(tokens, tier, id, blocks)| {
                    let (tenant, rest) = id.split_once('/').unwrap();
                    let pod = rest.trim_end_matches("#0").to_string();
                    let t = tenants.iter().position(|x| *x == tenant).unwrap();
                    let i = fleet.iter().position(|(ft, p, ..)| *ft == t && *p == pod).unwrap();
                    let node = if i % drop_every == 0 {
                        format!("extra-{tenant}-{pod}")
                    } else {
                        format!("n{t}")
                    };
                    (id.clone(), blocks, tokens.0, tier, pod, node)
                })
                .collect();
            prop_assert_eq!(got, want);
        }
    }

    /// The selection alone on large, heavily tied inputs (a fleet sharing block 0), against a
    /// full sort by (primary key, label).
    #[test]
    fn selection_on_large_tied_groups_equals_a_full_sort() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for round in 0..200 {
            let n = 1 + (next() % 2000) as usize;
            let deep = (next() % 64) as usize;
            let labels: Vec<u64> = (0..n).map(|_| next() >> (next() % 60)).collect();
            let scores: Vec<ReplicaScore> = (0..n)
                .map(|i| ReplicaScore {
                    slot: i as u32,
                    // Most at depth 1 (the shared prefix), a few deeper.
                    matched_blocks: if (next() as usize % n) < deep {
                        2 + (next() % 4) as u32
                    } else {
                        1
                    },
                    block_size: if next().is_multiple_of(9) { 8 } else { 4 },
                    t1: !next().is_multiple_of(5),
                })
                .collect();
            let max = (next() % 40) as usize;
            let got = lookup::select_answer(&scores, max, |s| labels[s as usize]);
            let mut want: Vec<usize> = (0..n).collect();
            want.sort_by_key(|&i| {
                let s = &scores[i];
                (
                    std::cmp::Reverse(s.matched_blocks * s.block_size),
                    !s.t1,
                    labels[i],
                    i,
                )
            });
            if max > 0 {
                want.truncate(max);
            }
            assert_eq!(got, want, "round {round}: n {n}, max {max}");
        }
    }
}

// ---- Sliced resync (issue 18 item 5) ----

fn entry(key: u64, tier: proto::Tier, adapter: &str) -> proto::BlockEntry {
    proto::BlockEntry {
        adapter: adapter.into(),
        block_size: 4,
        content_key: key,
        tier: tier as i32,
    }
}

/// A node's resync with what a real one carries: chains sharing a prefix, T1 and T2, two
/// adapters in one stream, a stale stream, a stream id listed twice (the later one wins) and a
/// stream another node reported before (it moves here).
fn node_resync() -> (Vec<u64>, Vec<proto::StreamSnapshot>) {
    let keys = chain(&tokens(0..256), 4);
    let lora = chain(&tokens(500..564), 4);
    let mut a = snapshot_with(
        "a",
        keys.iter()
            .enumerate()
            .map(|(i, k)| {
                entry(
                    *k,
                    if i % 5 == 4 {
                        proto::Tier::T2
                    } else {
                        proto::Tier::T1
                    },
                    "",
                )
            })
            .collect(),
    );
    a.entries
        .extend(lora.iter().map(|k| entry(*k, proto::Tier::T1, "lora-x")));
    let b = snapshot_with(
        "b",
        keys[..9]
            .iter()
            .map(|k| entry(*k, proto::Tier::T1, ""))
            .collect(),
    );
    let mut stale = snapshot_with("s", vec![entry(keys[0], proto::Tier::T1, "")]);
    stale.stale = true;
    let dup_first = snapshot_with(
        "d",
        keys[..3]
            .iter()
            .map(|k| entry(*k, proto::Tier::T1, ""))
            .collect(),
    );
    let mut dup_later = snapshot_with(
        "d",
        keys[..6]
            .iter()
            .map(|k| entry(*k, proto::Tier::T2, ""))
            .collect(),
    );
    dup_later.coverage = proto::Coverage::Partial as i32;
    dup_later.coverage_reason = ic_shared::kv::coverage::EVENTS_DROPPED.into();
    let moved = snapshot_with(
        "m",
        keys[..12]
            .iter()
            .map(|k| entry(*k, proto::Tier::T1, ""))
            .collect(),
    );
    (keys, vec![a, b, stale, dup_first, dup_later, moved])
}

/// An index with another node (sharing the prefix, and the stream "m" before it moves) and
/// an older state of n1 that the resync replaces.
fn before_resync(keys: &[u64]) -> PrefixIndex {
    let mut ix = PrefixIndex::new();
    ix.resync_node(
        "n0",
        &[
            snapshot_with(
                "o",
                keys[..20]
                    .iter()
                    .map(|k| entry(*k, proto::Tier::T1, ""))
                    .collect(),
            ),
            snapshot_with("m", vec![entry(keys[0], proto::Tier::T1, "")]),
        ],
    );
    ix.resync_node(
        "n1",
        &[
            snapshot_with("a", vec![entry(keys[40], proto::Tier::T1, "")]),
            snapshot_with(
                "gone",
                keys[..30]
                    .iter()
                    .map(|k| entry(*k, proto::Tier::T1, ""))
                    .collect(),
            ),
        ],
    );
    ix
}

/// Everything a caller can read of `ix`, for comparing two indexes.
fn observable(ix: &PrefixIndex, keys: &[u64]) -> impl PartialEq + std::fmt::Debug {
    let ids = [
        "default/a#0",
        "default/b#0",
        "default/s#0",
        "default/d#0",
        "default/m#0",
        "default/o#0",
        "default/gone#0",
    ];
    let streams: Vec<_> = ids.iter().map(|id| ix.stream_entries(id)).collect();
    let lookups: Vec<_> = [keys.len(), 9, 3]
        .iter()
        .map(|n| {
            ix.lookup(&LookupQuery {
                content_keys: keys[..*n].to_vec(),
                block_size: Some(4),
                ..Default::default()
            })
        })
        .collect();
    (
        ix.entry_count(),
        ix.block_count(),
        ix.replica_count(),
        ix.coverage_counts(),
        streams,
        lookups,
    )
}

#[test]
fn a_sliced_resync_never_reads_exact_midway_and_ends_equal_to_a_whole_one() {
    let (keys, snaps) = node_resync();
    let mut whole = before_resync(&keys);
    whole.resync_node("n1", &snaps);
    let want = observable(&whole, &keys);
    assert_eq!(whole.coverage_counts(), whole.coverage_counts_walked());

    for budget in [1, 3, 7, 64] {
        let mut ix = before_resync(&keys);
        let mut apply = ix.begin_resync("n1", &snaps);
        let mut steps = 0;
        loop {
            // Between slices (what a lookup under the read lock sees): n1's streams are
            // there, never Exact, with a prefix of their entries; n0's stream is untouched.
            let r = ix.lookup(&LookupQuery {
                content_keys: keys.clone(),
                block_size: Some(4),
                ..Default::default()
            });
            for m in &r.replicas {
                if m.node() == "n1" {
                    assert_eq!(
                        m.coverage,
                        Coverage::new(CoverageState::Partial, coverage::RESYNC_APPLYING),
                        "budget {budget}, step {steps}: {m:?}"
                    );
                } else {
                    assert_eq!(m.coverage, Coverage::EXACT, "{m:?}");
                }
            }
            assert_eq!(ix.coverage_counts(), ix.coverage_counts_walked());
            let exact = ix.coverage_counts()[0].1;
            assert_eq!(
                exact, 1,
                "only n0's stream reads Exact midway (budget {budget})"
            );
            steps += 1;
            if ix.resync_step(&mut apply, &snaps, budget) {
                break;
            }
        }
        assert!(
            budget >= 64 || steps > 10,
            "budget {budget} took {steps} steps"
        );
        assert_eq!(observable(&ix, &keys), want, "budget {budget}");
        assert_eq!(ix.heap_bytes(), whole.heap_bytes(), "budget {budget}");
        assert_eq!(ix.coverage_counts(), ix.coverage_counts_walked());
    }
    // The streams read what their snapshots say; the earlier copy of "d" left nothing.
    let d = whole.stream_entries("default/d#0").unwrap();
    assert_eq!(d.len(), 6);
    assert!(d.iter().all(|e| e.tier == Tier::T2));
    assert!(whole.stream_entries("default/gone#0").is_none());
    assert_eq!(whole.stream_entries("default/s#0").unwrap().len(), 0);
    assert_eq!(whole.stream_entries("default/m#0").unwrap().len(), 12);
    // Key vectors are sized exactly from the snapshot.
    for (_, r) in whole.live_replicas() {
        for p in r.parts.iter() {
            assert_eq!(
                p.keys.capacity(),
                p.keys.len(),
                "{} {}",
                r.desc.stream_id,
                p.adapter
            );
        }
    }
}

#[test]
fn a_resync_begun_later_for_the_node_wins_over_one_still_in_slices() {
    let (keys, snaps) = node_resync();
    let newer = vec![snapshot_with(
        "a",
        keys[..5]
            .iter()
            .map(|k| entry(*k, proto::Tier::T1, ""))
            .collect(),
    )];
    // What the two resyncs do one after the other (the older one took "m" from n0 at its
    // start: the newest report wins, and the newer resync of n1 does not list it).
    let mut want = before_resync(&keys);
    want.resync_node("n1", &snaps);
    want.resync_node("n1", &newer);

    let mut ix = before_resync(&keys);
    let mut old = ix.begin_resync("n1", &snaps);
    assert!(!ix.resync_step(&mut old, &snaps, 10));
    // A newer stream of the node resyncs whole (slots recycled) while the old apply is midway;
    // the old apply's remaining steps touch nothing of it.
    ix.resync_node("n1", &newer);
    while !ix.resync_step(&mut old, &snaps, 10) {}
    assert_eq!(observable(&ix, &keys), observable(&want, &keys));
    assert_eq!(ix.coverage_counts(), ix.coverage_counts_walked());
}

#[test]
fn large_tables_grow_ahead_of_a_slice_and_the_slice_never_grows_them() {
    use super::table::GROW_AHEAD_MIN_SLOTS;
    // Two streams of one node, 120 000 distinct blocks each plus 40 000 they share, and a second
    // adapter: the base-model partition's table passes GROW_AHEAD_MIN_SLOTS and grows several
    // times while the resync is applied.
    let base = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let entries = |from: u64, n: u64| -> Vec<proto::BlockEntry> {
        (from..from + n)
            .map(|i| entry(base(i), proto::Tier::T1, ""))
            .collect()
    };
    let mut a = snapshot_with("a", entries(0, 160_000));
    a.entries
        .extend((0..500).map(|i| entry(base(i + 9_000_000), proto::Tier::T2, "lora-x")));
    let b = snapshot_with("b", entries(120_000, 160_000));
    let snaps = vec![a, b];
    let keys: Vec<u64> = (0..8).map(base).collect();

    let mut whole = PrefixIndex::new();
    whole.resync_node("n1", &snaps);

    let mut ix = PrefixIndex::new();
    let mut apply = ix.begin_resync("n1", &snaps);
    let (mut grown_ahead, mut slices) = (0, 0);
    let budget = 2048;
    loop {
        let grown = ix.grow_ahead(&apply, &snaps, budget);
        let n_grown = grown.tables.len();
        grown_ahead += n_grown;
        let replaced = ix.install_grown(grown);
        assert_eq!(replaced.tables.len(), n_grown);
        let caps: Vec<usize> = ix.partitions.iter().map(|p| p.blocks.capacity()).collect();
        let done = ix.resync_step(&mut apply, &snaps, budget);
        slices += 1;
        for (p, before) in ix.partitions.iter().zip(&caps) {
            if *before >= GROW_AHEAD_MIN_SLOTS {
                assert_eq!(
                    p.blocks.capacity(),
                    *before,
                    "slice {slices} grew a large table"
                );
            }
        }
        if done {
            break;
        }
    }
    assert!(
        grown_ahead >= 2,
        "grown ahead {grown_ahead} times in {slices} slices"
    );
    let base_table = ix
        .partitions
        .iter()
        .map(|p| p.blocks.capacity())
        .max()
        .unwrap();
    assert!(base_table > GROW_AHEAD_MIN_SLOTS);
    // The same index as a whole resync: entries, blocks, answers, per-stream entries.
    assert_eq!(ix.entry_count(), whole.entry_count());
    assert_eq!(ix.block_count(), whole.block_count());
    assert_eq!(ix.block_count(), 280_500);
    for id in ["default/a#0", "default/b#0"] {
        assert_eq!(ix.stream_entries(id), whole.stream_entries(id));
    }
    let q = LookupQuery {
        content_keys: keys,
        block_size: Some(4),
        ..Default::default()
    };
    assert_eq!(ix.lookup(&q), whole.lookup(&q));
    // A table with room, or a small one, is not copied.
    assert!(ix.grow_ahead(&apply, &snaps, budget).tables.is_empty());
}

/// Partitions of equal depth merge: a replica in two of them (two block sizes) is listed once,
/// with its better score (the first partition's on a tie); thousands of replicas of two tenants
/// under a wildcard query are each listed once.
#[test]
fn equal_depth_partitions_merge_each_replica_once() {
    let toks = tokens(0..32);
    let store_at = |keys: &[u64], block_size: u32| proto::KvOp {
        op: Some(Op::Store(proto::StoreOp {
            adapter: String::new(),
            block_size,
            tier: proto::Tier::T1 as i32,
            content_keys: keys.to_vec(),
        })),
    };
    let mut ix = PrefixIndex::new();
    ix.resync_node("n", &[empty_snapshot("a")]);
    let ops = vec![store_at(&chain(&toks, 4), 4), store_at(&chain(&toks, 8), 8)];
    ix.apply_delta("n", &delta("a", 1, ops)).unwrap();
    let s = ix.score(&query(&toks)).unwrap();
    assert_eq!(s.replicas.len(), 1, "{:?}", s.replicas);
    let only = s.replicas[0];
    assert_eq!((only.matched_blocks, only.block_size), (8, 4));
    assert_eq!(ix.lookup(&query(&toks)).replicas.len(), 1);

    // Both partitions reach 32 tokens through replica "b"; "a" holds 8 tokens at block size 4
    // and all 32 at block size 8: it keeps the deeper score whichever partition came first.
    let mut ix = PrefixIndex::new();
    ix.resync_node("n", &[empty_snapshot("a"), empty_snapshot("b")]);
    let a = vec![
        store_at(&chain(&toks, 4)[..2], 4),
        store_at(&chain(&toks, 8), 8),
    ];
    let b = vec![store_at(&chain(&toks, 4), 4), store_at(&chain(&toks, 8), 8)];
    ix.apply_delta("n", &delta("a", 1, a)).unwrap();
    ix.apply_delta("n", &delta("b", 1, b)).unwrap();
    let s = ix.score(&query(&toks)).unwrap();
    assert_eq!(s.replicas.len(), 2, "{:?}", s.replicas);
    assert!(
        s.replicas
            .iter()
            .all(|r| r.matched_blocks * r.block_size == 32),
        "{:?}",
        s.replicas
    );
    // The router answer says in which block size each replica's blocks are counted.
    let answer = ix.lookup(&query(&toks));
    assert!(
        answer
            .replicas
            .iter()
            .all(|m| m.matched_blocks * m.block_size == m.matched_tokens && m.matched_tokens == 32),
        "{:?}",
        answer.replicas
    );

    // Two tenants, 600 replicas each, one shared chain; a wildcard query lists all 1 200 once.
    let keys = chain(&toks, 4);
    let mut ix = PrefixIndex::new();
    for tenant in ["t1", "t2"] {
        let d = |pod: &str| proto::StreamDescriptor {
            stream_id: format!("{tenant}/{pod}#0"),
            tenant: tenant.into(),
            ..desc(pod, 0)
        };
        let pods: Vec<String> = (0..600).map(|i| format!("p{i}")).collect();
        let snaps: Vec<_> = pods
            .iter()
            .map(|p| proto::StreamSnapshot {
                stream: Some(d(p)),
                ..empty_snapshot(p)
            })
            .collect();
        ix.resync_node(tenant, &snaps);
        for p in &pods {
            let delta = proto::StreamDelta {
                stream: Some(d(p)),
                ..delta(p, 1, vec![store(&keys, proto::Tier::T1, "")])
            };
            ix.apply_delta(tenant, &delta).unwrap();
        }
    }
    let q = LookupQuery {
        content_keys: keys.clone(),
        block_size: Some(4),
        ..Default::default()
    };
    let s = ix.score(&q).unwrap();
    let mut slots: Vec<u32> = s.replicas.iter().map(|r| r.slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!((s.replicas.len(), slots.len()), (1200, 1200));
    assert!(s.replicas.iter().all(|r| r.matched_blocks == 8));
    // One tenant asked: its 600 only.
    let one = ix
        .score(&LookupQuery {
            tenant: "t2".into(),
            ..q
        })
        .unwrap();
    assert_eq!(one.replicas.len(), 600);
}

fn coverage_of(ix: &PrefixIndex, pod: &str) -> (&'static str, Option<&'static str>) {
    let snap = ix.snapshot();
    let r = snap
        .replicas
        .iter()
        .find(|r| r.replica == pod)
        .expect("the replica is indexed");
    (r.coverage, r.coverage_reason)
}

/// A newer agent stream of the node takes over while the old stream's resync is applied in
/// slices: the rest of that resync touches nothing, and the node's replicas read Unknown /
/// `AgentDisconnected` (not the old snapshot's Exact) until the new stream resyncs.
#[test]
fn a_superseded_nodes_resync_stops_and_its_replicas_are_not_vouched_for() {
    let mut ix = PrefixIndex::new();
    let mut snap = empty_snapshot("a");
    snap.entries = (1..=100)
        .map(|k| proto::BlockEntry {
            block_size: 4,
            content_key: k,
            ..Default::default()
        })
        .collect();
    let streams = vec![snap];
    let mut apply = ix.begin_resync("n1", &streams);
    assert!(!ix.resync_step(&mut apply, &streams, 10));
    assert_eq!(coverage_of(&ix, "a"), ("Partial", Some("ResyncApplying")));
    ix.supersede_node("n1");
    while !ix.resync_step(&mut apply, &streams, 10) {}
    assert_eq!(ix.stream_entries("default/a#0").unwrap().len(), 10);
    assert_eq!(
        coverage_of(&ix, "a"),
        ("Unknown", Some("AgentDisconnected"))
    );
    // The new stream's resync is vouched for again.
    ix.resync_node("n1", &streams);
    assert_eq!(ix.stream_entries("default/a#0").unwrap().len(), 100);
    assert_eq!(coverage_of(&ix, "a"), ("Exact", None));
}

/// After a refused delta the controller applies none of the node's deltas until its resync:
/// every routable replica of the node says so, and stays routed.
#[test]
fn a_node_awaiting_its_resync_reads_resync_requested() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    ix.resync_node("n2", &[empty_snapshot("c")]);
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    ix.mark_node_awaiting_resync("n1");
    assert_eq!(coverage_of(&ix, "a"), ("Unknown", Some("ResyncRequested")));
    assert_eq!(coverage_of(&ix, "b"), ("Unknown", Some("ResyncRequested")));
    assert_eq!(coverage_of(&ix, "c"), ("Exact", None));
    let r = ix.lookup(&query(&tokens(0..8)));
    assert!(r.prefix_match);
    assert_eq!(r.replicas[0].coverage.reason, Some("ResyncRequested"));
}

/// Entries ingest dropped (the block-size caps) keep the stream Partial whatever its later
/// deltas say, until a resync that drops nothing.
#[test]
fn a_limited_stream_stays_partial_until_it_is_resynced() {
    let mut ix = PrefixIndex::new();
    ix.resync_node("n1", &[empty_snapshot("a")]);
    assert!(ix.limit_stream("default/a#0", coverage::BLOCK_SIZE_CAP_EXCEEDED));
    assert!(!ix.limit_stream("default/nope#0", coverage::BLOCK_SIZE_CAP_EXCEEDED));
    ix.apply_delta("n1", &delta("a", 1, vec![])).unwrap();
    assert_eq!(
        coverage_of(&ix, "a"),
        ("Partial", Some("BlockSizeCapExceeded"))
    );
    assert_eq!(ix.coverage_counts(), ix.coverage_counts_walked());
    ix.resync_node("n1", &[empty_snapshot("a")]);
    assert_eq!(coverage_of(&ix, "a"), ("Exact", None));
}

/// Blocks the controller stores for itself under headroom (the routing probe) do not evict a
/// tenant's real entries; once the headroom is taken back the quota holds as before.
#[test]
fn quota_headroom_keeps_a_probes_blocks_from_evicting_real_entries() {
    let mut ix = PrefixIndex::new();
    ix.set_tenant_quotas(HashMap::from([("default".to_string(), 4)]));
    ix.resync_node("n1", &[empty_snapshot("a")]);
    let real = chain(&tokens(0..16), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&real, proto::Tier::T1, "")]),
    )
    .unwrap();
    assert_eq!(ix.entry_count(), 4);
    let probe = chain(&tokens(1000..1024), 4);
    ix.add_quota_headroom("default", probe.len());
    ix.resync_node("probe-node", &[empty_snapshot("probe")]);
    ix.apply_delta(
        "probe-node",
        &delta("probe", 1, vec![store(&probe, proto::Tier::T1, "")]),
    )
    .unwrap();
    assert_eq!(ix.stream_entries("default/a#0").unwrap().len(), 4);
    assert_eq!(coverage_of(&ix, "a"), ("Exact", None));
    assert_eq!(ix.quota_evictions().get("default"), None);
    ix.remove_node("probe-node");
    ix.remove_quota_headroom("default", probe.len());
    // A fifth real block is one too many again: the oldest goes.
    let more = chain(&tokens(0..20), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 2, vec![store(&more, proto::Tier::T1, "")]),
    )
    .unwrap();
    assert_eq!(ix.stream_entries("default/a#0").unwrap().len(), 4);
    assert_eq!(ix.quota_evictions().get("default"), Some(&1));
}

/// With no match in any partition, the NO_HINT reason is that of the partition the request
/// has the most blocks in, whichever block size was registered first.
#[test]
fn no_match_speaks_of_the_smallest_block_size_not_the_first_registered() {
    let mut ix = PrefixIndex::new();
    let sized = |pod: &str, bs: u32| {
        let mut s = empty_snapshot(pod);
        s.entries = vec![proto::BlockEntry {
            block_size: bs,
            content_key: 7,
            ..Default::default()
        }];
        s
    };
    ix.resync_node("n1", &[sized("big", 32), sized("small", 16)]);
    // 20 tokens: no block at size 32, one at size 16 (held by nobody).
    let r = ix.lookup(&query(&tokens(500..520)));
    assert!(!r.prefix_match);
    assert_eq!(
        (r.reason.as_str(), r.block_size, r.request_blocks),
        ("NoReplicaHoldsPrefix", 16, 1)
    );
    // Shorter than every size: that reason.
    let r = ix.lookup(&query(&tokens(500..510)));
    assert_eq!(r.reason, "RequestShorterThanOneBlock");
}

/// A lookup says how many replicas of its scope the index does not vouch for: a replica
/// awaiting its resync (Unknown) or capped (Partial) may hold more of the prefix than the
/// answer shows; one whose engine is down does not count; other scopes do not count.
#[test]
fn lookups_count_the_inexact_replicas_of_their_scope() {
    let mut ix = PrefixIndex::new();
    ix.resync_node(
        "n1",
        &[
            empty_snapshot("a"),
            empty_snapshot("b"),
            empty_snapshot("c"),
        ],
    );
    let keys = chain(&tokens(0..8), 4);
    ix.apply_delta(
        "n1",
        &delta("a", 1, vec![store(&keys, proto::Tier::T1, "")]),
    )
    .unwrap();
    let q = query(&tokens(0..16));
    let r = ix.lookup(&q);
    assert!(r.prefix_match);
    assert_eq!(r.inexact_replicas, 0);
    // b awaits a resync: it may hold all 4 blocks, the index does not know.
    let mut d = delta("b", 1, vec![]);
    d.coverage = proto::Coverage::Unspecified as i32;
    d.coverage_reason = coverage::RESYNC_REQUESTED.into();
    ix.apply_delta("n1", &d).unwrap();
    // c's engine is gone: nothing to miss.
    let mut d = delta("c", 1, vec![]);
    d.coverage = proto::Coverage::EngineDown as i32;
    d.coverage_reason = "EngineExited".into();
    ix.apply_delta("n1", &d).unwrap();
    let r = ix.lookup(&q);
    assert_eq!(
        r.replicas.iter().map(|m| m.replica()).collect::<Vec<_>>(),
        vec!["a"]
    );
    assert_eq!(r.inexact_replicas, 1);
    // Scoped: the same model in another tenant, or another model, has none.
    let other = LookupQuery {
        tenant: "team-b".into(),
        ..query(&tokens(0..16))
    };
    assert_eq!(ix.lookup(&other).inexact_replicas, 0);
    assert_eq!(ix.inexact_replicas("default", "m", "vllm", None), 1);
    assert_eq!(ix.inexact_replicas("default", "other", "", None), 0);
    assert_eq!(ix.inexact_replicas("", "", "", None), 1);
    let none_visible = std::collections::BTreeSet::from(["team-b".to_string()]);
    assert_eq!(ix.inexact_replicas("", "m", "", Some(&none_visible)), 0);
    // A NO_HINT says it too.
    let miss = ix.lookup(&query(&tokens(100..116)));
    assert!(!miss.prefix_match);
    assert_eq!(miss.inexact_replicas, 1);
    // b's resync lands: Exact again, nothing to warn of.
    let mut d = delta("b", 2, vec![]);
    d.coverage = proto::Coverage::Exact as i32;
    ix.apply_delta("n1", &d).unwrap();
    assert_eq!(ix.lookup(&q).inexact_replicas, 0);
    assert_eq!(ix.coverage_tally.inexact, ix.inexact_walked());
    // Removing the node removes its replicas from the tally.
    let mut d = delta("b", 3, vec![]);
    d.coverage = proto::Coverage::Partial as i32;
    d.coverage_reason = "Test".into();
    ix.apply_delta("n1", &d).unwrap();
    assert_eq!(ix.lookup(&q).inexact_replicas, 1);
    ix.remove_node("n1");
    assert!(ix.coverage_tally.inexact.is_empty());
}

/// After a controller restart the index is empty until each agent resyncs: a stream the node
/// plans expect but the index has no replica for counts as inexact in its scope (a NO_HINT is
/// then not "nobody holds it"), from the plans' own descriptors, until its replica appears;
/// its replica expiring brings it back; a stream the plans drop stops counting.
#[test]
fn planned_streams_without_a_replica_count_as_inexact_until_their_agent_resyncs() {
    let plan = ic_shared::plan::NodePlan::parse(
        r#"
engines:
  - { namespace: default, pod: a, model: m, hashScheme: vllm, blockSize: 4,
      kvEvents: [ { endpoint: "tcp://127.0.0.1:5557", dpRank: 0 } ] }
  - { namespace: default, pod: b, model: m, hashScheme: vllm, blockSize: 4,
      kvEvents: [ { endpoint: "tcp://127.0.0.1:5567", dpRank: 0 } ] }
  - { namespace: team-b, pod: c, model: m, hashScheme: vllm, blockSize: 4,
      kvEvents: [ { endpoint: "tcp://127.0.0.1:5577", dpRank: 0 } ] }
"#,
        "test",
    )
    .unwrap();
    let planned = planned_streams([&plan]);
    assert_eq!(planned.len(), 3);
    assert_eq!(
        planned.get("default/a#0"),
        Some(&("default".to_string(), "m".to_string(), "vllm".to_string()))
    );
    let mut ix = PrefixIndex::new();
    ix.set_planned_streams(planned.clone());
    assert!(ix.planned_streams_are(&planned));
    assert_eq!(ix.planned_streams_absent(), 3);
    let q = query(&tokens(0..8));
    let r = ix.lookup(&q);
    assert!(!r.prefix_match);
    assert_eq!(r.inexact_replicas, 3);
    assert_eq!(ix.inexact_replicas("default", "m", "vllm", None), 2);
    assert_eq!(ix.coverage_tally.inexact, ix.inexact_walked());
    // a's agent resyncs (the descriptor the agent reports: the test helper's, the plan's).
    assert_eq!(desc("a", 0), plan.engines[0].descriptor(0));
    let keys = chain(&tokens(0..8), 4);
    ix.resync_node(
        "n1",
        &[snapshot_with(
            "a",
            keys.iter()
                .map(|k| entry(*k, proto::Tier::T1, ""))
                .collect(),
        )],
    );
    assert_eq!(ix.planned_streams_absent(), 2);
    let r = ix.lookup(&q);
    assert!(r.prefix_match);
    assert_eq!(r.inexact_replicas, 2);
    assert_eq!(ix.inexact_replicas("default", "m", "vllm", None), 1);
    assert_eq!(ix.coverage_tally.inexact, ix.inexact_walked());
    // b and c resync too: the index vouches for every planned stream.
    ix.resync_node("n1", &[empty_snapshot("a"), empty_snapshot("b")]);
    let mut c = empty_snapshot("c");
    c.stream = Some(plan.engines[2].descriptor(0));
    ix.resync_node("n2", &[c]);
    assert_eq!(ix.planned_streams_absent(), 0);
    assert_eq!(ix.lookup(&q).inexact_replicas, 0);
    assert!(ix.coverage_tally.inexact.is_empty());
    // n1's replicas expire (its agent gone past the TTL): planned, so counted again.
    ix.remove_node("n1");
    assert_eq!(ix.planned_streams_absent(), 2);
    assert_eq!(ix.inexact_replicas("default", "", "", None), 2);
    assert_eq!(ix.coverage_tally.inexact, ix.inexact_walked());
    // The plans drop b (its pod is gone): only a still counts.
    let fewer: HashMap<_, _> = planned
        .into_iter()
        .filter(|(id, _)| id != "default/b#0")
        .collect();
    ix.set_planned_streams(fewer);
    assert_eq!(ix.planned_streams_absent(), 1);
    assert_eq!(ix.inexact_replicas("", "", "", None), 1);
    assert_eq!(ix.coverage_tally.inexact, ix.inexact_walked());
    ix.set_planned_streams(HashMap::new());
    assert_eq!(ix.planned_streams_absent(), 0);
    assert!(ix.coverage_tally.inexact.is_empty());
}

/// Issue 39 item 12: an offload tier that loads whole 64-token chunks (LMCache
/// `chunk_size: 64`), announced as 4 × 16-token blocks, gets no credit for a prompt that
/// matches only part of a chunk; the GPU-held run is credited as before.
#[test]
fn a_chunked_offload_tier_is_credited_in_whole_chunks_only() {
    let chunked = |pod: &str, chunk: u32| proto::StreamSnapshot {
        stream: Some(proto::StreamDescriptor {
            offload_chunk_tokens: chunk,
            ..desc(pod, 0)
        }),
        ..empty_snapshot(pod)
    };
    let store16 = |keys: &[u64], tier: proto::Tier| proto::KvOp {
        op: Some(Op::Store(proto::StoreOp {
            adapter: String::new(),
            block_size: 16,
            tier: tier as i32,
            content_keys: keys.to_vec(),
        })),
    };
    let delta_of = |pod: &str, chunk: u32, ops: Vec<proto::KvOp>| proto::StreamDelta {
        stream: Some(proto::StreamDescriptor {
            offload_chunk_tokens: chunk,
            ..desc(pod, 0)
        }),
        ..delta(pod, 1, ops)
    };
    let mut ix = PrefixIndex::new();
    // "lm": one 64-token chunk offloaded, announced as 4 × 16; "mixed": the first block still
    // on GPU, the rest offloaded; "plain": an offload tier of engine-sized blocks (no chunk).
    ix.resync_node(
        "n1",
        &[
            chunked("lm", 64),
            chunked("mixed", 64),
            empty_snapshot("plain"),
        ],
    );
    let keys = chain(&tokens(0..64), 16);
    ix.apply_delta(
        "n1",
        &delta_of("lm", 64, vec![store16(&keys, proto::Tier::T2)]),
    )
    .unwrap();
    ix.apply_delta(
        "n1",
        &delta_of(
            "mixed",
            64,
            vec![
                store16(&keys[..1], proto::Tier::T1),
                store16(&keys[1..], proto::Tier::T2),
            ],
        ),
    )
    .unwrap();
    ix.apply_delta(
        "n1",
        &delta_of("plain", 0, vec![store16(&keys, proto::Tier::T2)]),
    )
    .unwrap();
    let got = |prompt: Vec<u32>| -> Vec<(String, u32, Tier)> {
        let mut v: Vec<(String, u32, Tier)> = ix
            .lookup(&query(&prompt))
            .replicas
            .iter()
            .map(|m| (m.replica().to_string(), m.matched_tokens, m.tier))
            .collect();
        v.sort();
        v
    };
    // The prompt shares the first 16 tokens only.
    let first16: Vec<u32> = tokens(0..16).into_iter().chain(1000..1048).collect();
    assert_eq!(
        got(first16),
        vec![
            ("mixed".to_string(), 16, Tier::T1),
            ("plain".to_string(), 16, Tier::T2),
        ],
        "no T2 credit for part of a 64-token chunk; the GPU block and the unchunked tier count"
    );
    // 48 of the chunk's 64 tokens: still no whole chunk.
    let first48: Vec<u32> = tokens(0..48).into_iter().chain(1000..1016).collect();
    assert_eq!(
        got(first48),
        vec![
            ("mixed".to_string(), 16, Tier::T1),
            ("plain".to_string(), 48, Tier::T2),
        ]
    );
    // The whole chunk: 64 tokens everywhere.
    assert_eq!(
        got(tokens(0..64)),
        vec![
            ("lm".to_string(), 64, Tier::T2),
            ("mixed".to_string(), 64, Tier::T2),
            ("plain".to_string(), 64, Tier::T2),
        ]
    );
}
