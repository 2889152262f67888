//! What a node agent's stream may put into the index (docs/security.md "Node scope" and
//! "Input bounds"), applied by the ingest session before anything reaches the index:
//!
//! - **node scope** — with plans derived on this replica, a node agent may report only streams
//!   of engine pods the plans place on its node
//!   ([`NodeRegistry::node_may_report`](super::registry::NodeRegistry::node_may_report)); a
//!   stream of another node's (or tenant's) pod is left out of its resync, its deltas are
//!   dropped, and each is counted (`kv_streams_refused_total{reason="outside_node_scope"}`).
//!   Standalone mode derives no plans and keeps no node scope.
//! - **block sizes** — an entry or op with a block size above
//!   [`MAX_BLOCK_SIZE`](ic_shared::limits::MAX_BLOCK_SIZE), or one that would register more
//!   than [`MAX_BLOCK_SIZES`](ic_shared::limits::MAX_BLOCK_SIZES) distinct sizes for a hash
//!   scheme, is dropped and counted (`reason="block_size_cap"`); the rest of its stream is kept.

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::limits::{MAX_BLOCK_SIZE, MAX_BLOCK_SIZES};
use ic_shared::proto::{self, kv_op::Op};

/// The block sizes registered per hash scheme, and the caps new ones are held to.
#[derive(Debug, Default)]
pub struct BlockSizeBudget {
    sizes: BTreeMap<String, BTreeSet<u32>>,
}

impl BlockSizeBudget {
    /// A budget starting from the index's registered sizes (`PrefixIndex::block_sizes`).
    pub fn new(registered: BTreeMap<String, Vec<u32>>) -> Self {
        BlockSizeBudget {
            sizes: registered
                .into_iter()
                .map(|(scheme, v)| (scheme, v.into_iter().collect()))
                .collect(),
        }
    }

    /// Whether `block_size` may be used for `scheme` (registering it when new and under the
    /// cap).
    pub fn admit(&mut self, scheme: &str, block_size: u32) -> bool {
        if block_size > MAX_BLOCK_SIZE {
            return false;
        }
        if self
            .sizes
            .get(scheme)
            .is_some_and(|set| set.contains(&block_size))
        {
            return true;
        }
        let set = self.sizes.entry(scheme.to_string()).or_default();
        if set.len() >= MAX_BLOCK_SIZES {
            return false;
        }
        set.insert(block_size);
        true
    }
}

/// Drops the snapshot's entries whose block size the budget refuses; returns how many.
pub fn cap_snapshot(snap: &mut proto::StreamSnapshot, budget: &mut BlockSizeBudget) -> usize {
    let scheme = snap
        .stream
        .as_ref()
        .map(|d| d.hash_scheme.clone())
        .unwrap_or_default();
    let before = snap.entries.len();
    // A stream's entries come in runs of one block size: ask the budget once per run.
    let mut last: Option<(u32, bool)> = None;
    snap.entries.retain(|e| match last {
        Some((size, ok)) if size == e.block_size => ok,
        _ => {
            let ok = budget.admit(&scheme, e.block_size);
            last = Some((e.block_size, ok));
            ok
        }
    });
    before - snap.entries.len()
}

/// Drops the delta's Store/Remove ops whose block size the budget refuses (the delta and its
/// seq stay, so the stream does not fall out of sequence); returns how many.
pub fn cap_delta(delta: &mut proto::StreamDelta, budget: &mut BlockSizeBudget) -> usize {
    let scheme = delta
        .stream
        .as_ref()
        .map(|d| d.hash_scheme.clone())
        .unwrap_or_default();
    let before = delta.ops.len();
    delta.ops.retain(|op| match &op.op {
        Some(Op::Store(s)) => budget.admit(&scheme, s.block_size),
        Some(Op::Remove(r)) => budget.admit(&scheme, r.block_size),
        _ => true,
    });
    before - delta.ops.len()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_above_the_cap_or_past_the_count_cap_are_refused() {
        let mut b = BlockSizeBudget::new([("vllm".to_string(), vec![16])].into());
        assert!(b.admit("vllm", 16));
        assert!(!b.admit("vllm", MAX_BLOCK_SIZE + 1));
        assert!(b.admit("vllm", MAX_BLOCK_SIZE));
        // The attack registered 2 048 sizes; the count stops at the cap.
        let admitted = (1..=2048u32).filter(|s| b.admit("sglang", *s)).count();
        assert_eq!(admitted, MAX_BLOCK_SIZES);
        assert!(!b.admit("sglang", 2048));
        assert!(b.admit("sglang", 1), "a registered size stays usable");
        // Another scheme has its own budget.
        assert!(b.admit("vllm", 2048));
    }
}
