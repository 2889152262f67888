//! The cluster-wide KV-prefix index (DESIGN.md "Index"; spec 000 "Index Participation").
//!
//! A plain library, fed by [`PrefixIndex::apply_delta`] and [`PrefixIndex::resync_node`] and asked
//! by [`PrefixIndex::lookup`]; the gRPC ingest and router services are thin layers around it.
//!
//! Entries are keyed by a *partition* — (tenant, model, hash_scheme, adapter, block_size) — and
//! our content key (see `ic_shared::kv::content_key`); each entry lists the replicas (engine
//! streams) holding the block and the tier they hold it at. Content keys are chained over the
//! whole prefix, so a replica holding block *i* of a request's chain holds a cache of the entire
//! prefix up to *i*; a lookup walks the chain and reports, per replica, the depth of its longest
//! consecutive run from block 0.

mod lookup;
mod snapshot;

use std::collections::{HashMap, HashSet};

use ic_shared::proto::{self, kv_op::Op};
use thiserror::Error;

pub use lookup::{LookupQuery, LookupResult, ReplicaMatch};
pub use snapshot::{IndexSnapshot, ReplicaSnapshot};

/// Where a replica holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory (the engine's prefix cache).
    T1,
    /// Offload tier (LMCache host memory or remote store).
    T2,
}

impl Tier {
    fn from_proto(t: i32) -> Tier {
        match proto::Tier::try_from(t) {
            Ok(proto::Tier::T2) => Tier::T2,
            _ => Tier::T1,
        }
    }

    /// The wire enum.
    pub fn to_proto(self) -> proto::Tier {
        match self {
            Tier::T1 => proto::Tier::T1,
            Tier::T2 => proto::Tier::T2,
        }
    }
}

/// The coordinates of a block other than its content key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Partition {
    /// Tenant (engine pod namespace).
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// `vllm` or `sglang`.
    pub hash_scheme: String,
    /// LoRA adapter name, empty for the base model.
    pub adapter: String,
    /// Block size in tokens the content keys were chained at.
    pub block_size: u32,
}

type PartitionId = u32;
type ReplicaSlot = u32;

/// One holder of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    replica: ReplicaSlot,
    tier: Tier,
}

/// State of one engine stream (a replica in routing answers).
#[derive(Debug, Clone)]
struct Replica {
    desc: proto::StreamDescriptor,
    node: String,
    /// Last applied delta seq.
    seq: u64,
    /// Blocks held: (partition, content key).
    blocks: HashSet<(PartitionId, u64)>,
    t2_blocks: usize,
    last_event_unix_ms: i64,
    stale: bool,
}

/// Why a delta could not be applied; the agent is asked for a resync.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ApplyError {
    /// The stream is not known (no snapshot yet, or it belongs to another node).
    #[error("stream {stream_id} is unknown on node {node}")]
    UnknownStream {
        /// Stream id.
        stream_id: String,
        /// Node that sent the delta.
        node: String,
    },
    /// The delta's seq does not follow the last applied one.
    #[error("stream {stream_id}: expected delta seq {expected}, got {got}")]
    SequenceGap {
        /// Stream id.
        stream_id: String,
        /// Next seq the index expected.
        expected: u64,
        /// Seq received.
        got: u64,
    },
    /// The delta carries no stream descriptor.
    #[error("delta without a stream descriptor")]
    MissingStream,
}

impl ApplyError {
    /// Stable metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            ApplyError::UnknownStream { .. } => "unknown_stream",
            ApplyError::SequenceGap { .. } => "sequence_gap",
            ApplyError::MissingStream => "missing_stream",
        }
    }
}

/// The in-memory prefix index. Not internally synchronised: wrap it in a lock.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    partition_ids: HashMap<Partition, PartitionId>,
    partitions: Vec<Partition>,
    entries: HashMap<(PartitionId, u64), Vec<Holder>>,
    replicas: HashMap<ReplicaSlot, Replica>,
    slot_by_stream: HashMap<String, ReplicaSlot>,
    next_slot: ReplicaSlot,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of (block, replica) entries.
    pub fn entry_count(&self) -> usize {
        self.replicas.values().map(|r| r.blocks.len()).sum()
    }

    /// Number of distinct (partition, content key) blocks.
    pub fn block_count(&self) -> usize {
        self.entries.len()
    }

    /// Number of known streams.
    pub fn replica_count(&self) -> usize {
        self.replicas.len()
    }

    fn partition_id(&mut self, p: Partition) -> PartitionId {
        if let Some(id) = self.partition_ids.get(&p) {
            return *id;
        }
        let id = self.partitions.len() as PartitionId;
        self.partitions.push(p.clone());
        self.partition_ids.insert(p, id);
        id
    }

    fn partition_for(
        &mut self,
        desc: &proto::StreamDescriptor,
        adapter: &str,
        bs: u32,
    ) -> PartitionId {
        self.partition_id(Partition {
            tenant: desc.tenant.clone(),
            model: desc.model.clone(),
            hash_scheme: desc.hash_scheme.clone(),
            adapter: adapter.to_string(),
            block_size: bs,
        })
    }

    /// Replaces every stream of `node` with the given snapshots (agent (re)connect or resync).
    /// Streams of the node not in `streams` are dropped. Stale snapshots register the stream with
    /// no entries.
    pub fn resync_node(&mut self, node: &str, streams: &[proto::StreamSnapshot]) {
        self.remove_node(node);
        for snap in streams {
            let Some(desc) = snap.stream.clone() else {
                continue;
            };
            // A stream id moving between nodes: the newest report wins.
            self.remove_stream(&desc.stream_id);
            let slot = self.next_slot;
            self.next_slot = self.next_slot.wrapping_add(1);
            self.slot_by_stream.insert(desc.stream_id.clone(), slot);
            self.replicas.insert(
                slot,
                Replica {
                    desc: desc.clone(),
                    node: node.to_string(),
                    seq: snap.seq,
                    blocks: HashSet::new(),
                    t2_blocks: 0,
                    last_event_unix_ms: snap.last_event_unix_ms,
                    stale: snap.stale,
                },
            );
            if snap.stale {
                continue;
            }
            for e in &snap.entries {
                let pid = self.partition_for(&desc, &e.adapter, e.block_size);
                self.store(slot, pid, e.content_key, Tier::from_proto(e.tier));
            }
        }
    }

    /// Drops every stream reported by `node`.
    pub fn remove_node(&mut self, node: &str) {
        let streams: Vec<String> = self
            .replicas
            .values()
            .filter(|r| r.node == node)
            .map(|r| r.desc.stream_id.clone())
            .collect();
        for s in streams {
            self.remove_stream(&s);
        }
    }

    /// Drops one stream and all its entries.
    pub fn remove_stream(&mut self, stream_id: &str) {
        let Some(slot) = self.slot_by_stream.remove(stream_id) else {
            return;
        };
        self.clear_replica(slot);
        self.replicas.remove(&slot);
    }

    /// Applies one delta from `node`. On error nothing is changed and the caller asks the agent
    /// for a resync.
    pub fn apply_delta(
        &mut self,
        node: &str,
        delta: &proto::StreamDelta,
    ) -> Result<(), ApplyError> {
        let desc = delta.stream.as_ref().ok_or(ApplyError::MissingStream)?;
        let slot = match self.slot_by_stream.get(&desc.stream_id) {
            Some(s) if self.replicas.get(s).is_some_and(|r| r.node == node) => *s,
            _ => {
                return Err(ApplyError::UnknownStream {
                    stream_id: desc.stream_id.clone(),
                    node: node.to_string(),
                })
            }
        };
        let expected = self.replicas.get(&slot).map(|r| r.seq + 1).unwrap_or(1);
        if delta.seq != expected {
            return Err(ApplyError::SequenceGap {
                stream_id: desc.stream_id.clone(),
                expected,
                got: delta.seq,
            });
        }
        for op in &delta.ops {
            match &op.op {
                Some(Op::Store(s)) => {
                    let pid = self.partition_for(desc, &s.adapter, s.block_size);
                    let tier = Tier::from_proto(s.tier);
                    for k in &s.content_keys {
                        self.store(slot, pid, *k, tier);
                    }
                }
                Some(Op::Remove(r)) => {
                    let pid = self.partition_for(desc, &r.adapter, r.block_size);
                    for k in &r.content_keys {
                        self.remove(slot, pid, *k);
                    }
                }
                Some(Op::Clear(_)) => self.clear_replica(slot),
                None => {}
            }
        }
        if let Some(r) = self.replicas.get_mut(&slot) {
            r.seq = delta.seq;
            r.stale = false;
            if delta.last_event_unix_ms > r.last_event_unix_ms {
                r.last_event_unix_ms = delta.last_event_unix_ms;
            }
        }
        Ok(())
    }

    fn store(&mut self, slot: ReplicaSlot, pid: PartitionId, key: u64, tier: Tier) {
        let holders = self.entries.entry((pid, key)).or_default();
        let prev = match holders.iter_mut().find(|h| h.replica == slot) {
            Some(h) => Some(std::mem::replace(&mut h.tier, tier)),
            None => {
                holders.push(Holder {
                    replica: slot,
                    tier,
                });
                None
            }
        };
        if let Some(r) = self.replicas.get_mut(&slot) {
            r.blocks.insert((pid, key));
            match (prev, tier) {
                (Some(Tier::T2), Tier::T1) => r.t2_blocks = r.t2_blocks.saturating_sub(1),
                (Some(Tier::T1) | None, Tier::T2) => r.t2_blocks += 1,
                _ => {}
            }
        }
    }

    fn remove(&mut self, slot: ReplicaSlot, pid: PartitionId, key: u64) {
        let mut removed_tier = None;
        if let Some(holders) = self.entries.get_mut(&(pid, key)) {
            if let Some(pos) = holders.iter().position(|h| h.replica == slot) {
                removed_tier = Some(holders.swap_remove(pos).tier);
            }
            if holders.is_empty() {
                self.entries.remove(&(pid, key));
            }
        }
        if let Some(r) = self.replicas.get_mut(&slot) {
            r.blocks.remove(&(pid, key));
            if removed_tier == Some(Tier::T2) {
                r.t2_blocks = r.t2_blocks.saturating_sub(1);
            }
        }
    }

    fn clear_replica(&mut self, slot: ReplicaSlot) {
        let blocks = match self.replicas.get_mut(&slot) {
            Some(r) => {
                r.t2_blocks = 0;
                std::mem::take(&mut r.blocks)
            }
            None => return,
        };
        for (pid, key) in blocks {
            if let Some(holders) = self.entries.get_mut(&(pid, key)) {
                holders.retain(|h| h.replica != slot);
                if holders.is_empty() {
                    self.entries.remove(&(pid, key));
                }
            }
        }
    }

    /// Block sizes registered per hash scheme (from the partitions streams have reported).
    pub fn block_sizes(&self) -> std::collections::BTreeMap<String, Vec<u32>> {
        let mut out: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
        for p in &self.partitions {
            let v = out.entry(p.hash_scheme.clone()).or_default();
            if !v.contains(&p.block_size) {
                v.push(p.block_size);
            }
        }
        for v in out.values_mut() {
            v.sort_unstable();
        }
        out
    }
}

#[cfg(test)]
mod tests;
