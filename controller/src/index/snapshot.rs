//! `/snapshot`: the per-replica projection of the index (spec 000 "Index Participation").

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use super::PrefixIndex;

/// One replica (engine stream) as `/snapshot` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
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
    /// Blocks held (any tier): the replica's distinct prefix entries.
    pub prefix_count: usize,
    /// Blocks held in GPU memory.
    pub t1_blocks: usize,
    /// Blocks held only in the offload tier.
    pub t2_blocks: usize,
    /// Block sizes the replica's entries were chained at.
    pub block_sizes: Vec<u32>,
    /// Unix ms of the newest engine event, 0 if none yet.
    pub last_event_unix_ms: i64,
    /// The same instant as RFC 3339 (`lastEventAt`), absent before the first event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_event_at: Option<String>,
    /// Engine tier-2 hits (cumulative `external_prefix_cache_hits`), when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t2_hits: Option<u64>,
    /// Engine tier-2 queries (cumulative `external_prefix_cache_queries`), when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t2_queries: Option<u64>,
    /// LMCache local-cache bytes the engine reports for this replica
    /// (`lmcache:local_cache_usage`), when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_memory_bytes: Option<u64>,
    /// Engine prefix-cache hits (cumulative `vllm:prefix_cache_hits_total`), when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache_hits: Option<u64>,
    /// Engine prefix-cache lookups (cumulative `vllm:prefix_cache_queries_total`), when
    /// reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache_queries: Option<u64>,
    /// Last applied delta seq.
    pub seq: u64,
    /// True while the replica's state is uncertain (gap without replay).
    pub stale: bool,
    /// Coverage state the agent reports (`Exact`, `Healing`, `Partial`, `Disconnected`,
    /// `EngineDown`; `Unknown` while its agent is away or predates coverage).
    pub coverage: &'static str,
    /// Why it is not Exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coverage_reason: Option<&'static str>,
    /// False while lookups skip the replica (Disconnected, EngineDown, or Unknown /
    /// `HeartbeatMissed`).
    pub routable: bool,
    /// Age of the coverage: milliseconds since the controller last heard from the agent stream
    /// that reports the replica (any message; agents send a heartbeat every second), on the
    /// controller's monotonic clock (docs/kv-events.md "Coverage age"). Absent when it has not
    /// heard from it since it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coverage_age_ms: Option<u64>,
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
    /// True when the document shows only the namespaces the caller may read
    /// ([`PrefixIndex::snapshot_of`]): `replicas` lists only theirs, and `blocks`, `entries`
    /// and `blockSizes` count only theirs. Absent (false) for the whole index.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub narrowed: bool,
}

/// RFC 3339 form of unix milliseconds; `None` for 0 or out of range.
pub fn rfc3339_ms(ms: i64) -> Option<String> {
    if ms <= 0 {
        return None;
    }
    Timestamp::from_millisecond(ms).ok().map(|t| t.to_string())
}

impl PrefixIndex {
    /// Projects the index per replica.
    pub fn snapshot(&self) -> IndexSnapshot {
        self.snapshot_of(&|_| true)
    }

    /// Projects the replicas of the tenants `visible` accepts. When it rejects a tenant the
    /// index holds, the totals are those of the visible tenants (distinct blocks of their
    /// partitions, their replicas' entries, their block sizes) and `narrowed` is set, so the
    /// document neither names nor counts what the caller may not read.
    pub fn snapshot_of(&self, visible: &dyn Fn(&str) -> bool) -> IndexSnapshot {
        let narrowed = self.tenants().iter().any(|t| !visible(t));
        let now_ms = super::mono_ms();
        let mut replicas: Vec<ReplicaSnapshot> = self
            .live_replicas()
            .filter(|(_, r)| visible(&r.desc.tenant))
            .map(|(_, r)| {
                let mut block_sizes: Vec<u32> = r
                    .parts
                    .iter()
                    .filter(|p| !p.keys.is_empty())
                    .map(|p| p.block_size)
                    .collect();
                block_sizes.sort_unstable();
                block_sizes.dedup();
                ReplicaSnapshot {
                    stream_id: r.desc.stream_id.clone(),
                    replica: r.desc.replica.clone(),
                    node: r.node.clone(),
                    tenant: r.desc.tenant.clone(),
                    model: r.desc.model.clone(),
                    hash_scheme: r.desc.hash_scheme.clone(),
                    backend: r.desc.backend.clone(),
                    dp_rank: r.desc.dp_rank,
                    prefix_count: r.blocks,
                    t1_blocks: r.blocks.saturating_sub(r.t2_blocks),
                    t2_blocks: r.t2_blocks,
                    block_sizes,
                    last_event_unix_ms: r.last_event_unix_ms,
                    last_event_at: rfc3339_ms(r.last_event_unix_ms),
                    t2_hits: r.t2_hits,
                    t2_queries: r.t2_queries,
                    cache_memory_bytes: r.cache_memory_bytes,
                    prefix_cache_hits: r.prefix_cache.map(|p| p.0),
                    prefix_cache_queries: r.prefix_cache.map(|p| p.1),
                    seq: r.seq,
                    stale: r.stale,
                    coverage: r.effective_coverage().state.as_str(),
                    coverage_reason: r.effective_coverage().reason,
                    routable: r.routable_now(),
                    coverage_age_ms: self.heard_at_ms(&r.node).map(|t| now_ms.saturating_sub(t)),
                }
            })
            .collect();
        replicas.sort_by(|a, b| a.stream_id.cmp(&b.stream_id));
        if !narrowed {
            return IndexSnapshot {
                replicas,
                blocks: self.block_count(),
                entries: self.entry_count(),
                block_sizes: self.block_sizes(),
                narrowed: false,
            };
        }
        IndexSnapshot {
            blocks: self
                .blocks_by_tenant()
                .iter()
                .filter(|(t, _)| visible(t))
                .map(|(_, n)| n)
                .sum(),
            entries: replicas.iter().map(|r| r.prefix_count).sum(),
            replicas,
            block_sizes: self.block_sizes_of(visible),
            narrowed: true,
        }
    }
}
