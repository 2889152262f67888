//! `/snapshot`: the per-replica projection of the index (spec 000 "Index Participation").

use std::collections::BTreeMap;

use serde::Serialize;

use super::PrefixIndex;

/// One replica (engine stream) as `/snapshot` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaSnapshot {
    /// `ns/pod#rank`.
    pub stream_id: String,
    /// Replica id used in routing answers.
    pub replica: String,
    /// Node whose agent reports it.
    pub node: String,
    /// Tenant (namespace).
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// `vllm` / `sglang`.
    pub hash_scheme: String,
    /// CacheBackend that wired it, if known.
    pub backend: String,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Blocks held (any tier).
    pub prefix_count: usize,
    /// Blocks held in GPU memory.
    pub t1_blocks: usize,
    /// Blocks held only in the offload tier.
    pub t2_blocks: usize,
    /// Unix ms of the newest engine event, 0 if none yet.
    pub last_event_unix_ms: i64,
    /// Last applied delta seq.
    pub seq: u64,
    /// True while the replica's state is uncertain (gap without replay).
    pub stale: bool,
}

/// The whole `/snapshot` document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IndexSnapshot {
    /// Replicas sorted by stream id.
    pub replicas: Vec<ReplicaSnapshot>,
    /// Distinct blocks.
    pub blocks: usize,
    /// (block, replica) entries.
    pub entries: usize,
    /// Block sizes registered per hash scheme.
    pub block_sizes: BTreeMap<String, Vec<u32>>,
}

impl PrefixIndex {
    /// Projects the index per replica.
    pub fn snapshot(&self) -> IndexSnapshot {
        let mut replicas: Vec<ReplicaSnapshot> = self
            .replicas
            .values()
            .map(|r| ReplicaSnapshot {
                stream_id: r.desc.stream_id.clone(),
                replica: r.desc.replica.clone(),
                node: r.node.clone(),
                tenant: r.desc.tenant.clone(),
                model: r.desc.model.clone(),
                hash_scheme: r.desc.hash_scheme.clone(),
                backend: r.desc.backend.clone(),
                dp_rank: r.desc.dp_rank,
                prefix_count: r.blocks.len(),
                t1_blocks: r.blocks.len().saturating_sub(r.t2_blocks),
                t2_blocks: r.t2_blocks,
                last_event_unix_ms: r.last_event_unix_ms,
                seq: r.seq,
                stale: r.stale,
            })
            .collect();
        replicas.sort_by(|a, b| a.stream_id.cmp(&b.stream_id));
        IndexSnapshot {
            replicas,
            blocks: self.block_count(),
            entries: self.entry_count(),
            block_sizes: self.block_sizes(),
        }
    }
}
