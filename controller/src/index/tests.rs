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
    }
}

fn empty_snapshot(pod: &str) -> proto::StreamSnapshot {
    proto::StreamSnapshot {
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
        .map(|m| (m.replica.as_str(), m.matched_blocks, m.matched_tokens))
        .collect();
    assert_eq!(got, vec![("a", 4, 16), ("b", 2, 8)]);
    assert_eq!(r.replicas[0].node, "n1");

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
    assert_eq!(r.replicas[0].replica, "c");
    assert_eq!(r.replicas[0].matched_blocks, 1);
    assert_eq!(ix.replica_count(), 1);
    assert_eq!(ix.block_count(), 1);
    // The resynced stream continues at seq 8.
    ix.apply_delta(
        "n1",
        &proto::StreamDelta {
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
