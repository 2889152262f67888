//! The cluster-wide KV-prefix index (DESIGN.md "Index"; spec 000 "Index Participation").
//!
//! A plain library, fed by [`PrefixIndex::apply_delta`] and [`PrefixIndex::resync_node`] and asked
//! by [`PrefixIndex::lookup`]; the gRPC ingest and router services are thin layers around it.
//!
//! Entries are keyed by a *partition* — (tenant, model, hash_scheme, adapter, block_size) — and
//! our content key (see `ic_shared::kv::content_key`); each entry lists the replicas (engine
//! streams) holding the block and the tier they hold it at, and each replica remembers when it
//! last reported an event. Content keys are chained over the whole prefix, so a replica holding
//! block *i* of a request's chain holds a cache of the entire prefix up to *i*; a lookup walks the
//! chain and reports, per replica, the depth of its longest consecutive run from block 0.
//!
//! # Layout (memory and speed)
//!
//! - Partitions are interned once (their strings are never copied per block); each has its own
//!   open-addressing table content key → holders (`table::BlockTable`): key and holders share
//!   one 16-byte slot, so a probe is one cache line. One holder is kept inline; more spill into a
//!   sorted list (8 bytes per holder).
//! - Replicas live in a slab addressed by a `u32` slot (recycled). A holder records the slot,
//!   the tier and the block's position in the replica's key vector, so each replica lists what it
//!   holds in a plain `Vec<u64>` (8 bytes per entry; removal is a swap-remove) and a replica
//!   clear (engine restart, `AllBlocksCleared`, resync, expiry) costs what that replica holds.
//! - Content keys are already uniform (XXH3), so tables hash them with one seeded multiply.
//! - Runs of keys (a store or remove op, a lookup chain) first fetch all their slots (software
//!   prefetches in a store or remove, a tight loop of loads in a lookup), so the cache misses
//!   overlap instead of queueing one per block. Slot arrays of 4 MiB and more ask the kernel for
//!   transparent huge pages (fewer TLB misses on those random probes).
//! - A replica's first part (nearly always its only one) is kept inline, so a delta reaches the
//!   replica's key vector without another dependent cache miss.
//! - A lookup answer selects its best replicas in one pass over a bounded heap, reading a
//!   stream-order label only for a score whose depth and tier are not worse than the worst
//!   kept; names are shared (`ReplicaNames`), not copied.
//! - A lookup intersects sorted holder lists level by level, iterating the smaller side, so a
//!   block held by every replica (a shared system prompt) costs one pass, not one per level.
//!
//! # Modules
//!
//! `store` (deltas: stores, removes, clears), `resync` (the stream registry and resyncs in
//! slices), `tally` (coverage, routability, planned streams), `quota` (tenant quotas and the
//! per-stream cap), `lookup` (scoring and answers), `order` (stream-id order labels), `table`
//! and `holders` (the block tables and holder lists), `heard` (reporter heartbeats),
//! `snapshot` (`/snapshot`), `policy` (per-namespace lookup policies), `mem` (huge pages).
//!
//! `ic-controller`'s benchmark (`controller/benches/index.rs`, `bench/`) measures this layout on
//! the Mooncake FAST'25 trace; `docs/benchmarks.md` has the numbers.

mod heard;
mod holders;
mod lookup;
mod mem;
mod order;
mod policy;
mod quota;
mod resync;
mod snapshot;
mod store;
mod table;
mod tally;

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::proto;

use holders::{is_t2, HolderArena};
use order::StreamOrder;
use table::BlockTable;

pub use heard::{mono_ms, Heard, HEARTBEAT_CAPABILITY, HEARTBEAT_MISSED};
pub use lookup::{
    LookupQuery, LookupResult, ReplicaMatch, ReplicaNames, ReplicaScore, Scores, TimedOut,
    LOOKUP_TIMEOUT,
};
pub use policy::{NamespacePolicy, PolicyTable, ResolvedPolicy};
pub use resync::{GrownTables, ResyncApply};
pub use snapshot::{IndexSnapshot, ReplicaSnapshot};
pub use store::ApplyError;
pub use tally::{planned_streams, StreamScope};

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

/// One partition's blocks.
#[derive(Debug)]
struct PartitionState {
    key: Partition,
    blocks: BlockTable,
}

/// The blocks one replica holds in one partition (each key once; a holder's `pos` indexes it).
#[derive(Debug)]
struct ReplicaPart {
    pid: PartitionId,
    adapter: String,
    block_size: u32,
    keys: Vec<u64>,
}

/// A replica's parts: nearly always one, kept inline (applying a delta then reads the replica
/// and its part's key vector without a dependent cache miss on a separate parts array); more
/// parts spill into a vector. Indices are stable: 0 is the first part, then `rest` in order.
#[derive(Debug, Default)]
struct Parts {
    first: Option<ReplicaPart>,
    rest: Vec<ReplicaPart>,
}

impl Parts {
    fn iter(&self) -> impl Iterator<Item = &ReplicaPart> {
        self.first.iter().chain(self.rest.iter())
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut ReplicaPart> {
        self.first.iter_mut().chain(self.rest.iter_mut())
    }

    #[inline]
    fn get_mut(&mut self, i: usize) -> Option<&mut ReplicaPart> {
        match i.checked_sub(1) {
            None => self.first.as_mut(),
            Some(j) => self.rest.get_mut(j),
        }
    }

    #[inline]
    fn position(&self, block_size: u32, adapter: &str) -> Option<usize> {
        self.iter()
            .position(|p| p.block_size == block_size && same_str(&p.adapter, adapter))
    }

    #[inline]
    fn get(&self, i: usize) -> Option<&ReplicaPart> {
        match i.checked_sub(1) {
            None => self.first.as_ref(),
            Some(j) => self.rest.get(j),
        }
    }

    /// Appends `p`; returns its index.
    fn push(&mut self, p: ReplicaPart) -> usize {
        if self.first.is_none() {
            self.first = Some(p);
            return 0;
        }
        self.rest.push(p);
        self.rest.len()
    }
}

/// State of one engine stream (a replica in routing answers).
#[derive(Debug)]
struct Replica {
    desc: proto::StreamDescriptor,
    /// The names answers list (shared with them; see [`ReplicaNames`]).
    names: Arc<ReplicaNames>,
    node: String,
    /// Last applied delta seq.
    seq: u64,
    /// Blocks held, per partition (usually one).
    parts: Parts,
    blocks: usize,
    t2_blocks: usize,
    last_event_unix_ms: i64,
    stale: bool,
    /// What the agent says of the entries (see `ic_shared::kv::coverage`).
    coverage: Coverage,
    /// Engine tier-2 counters, when reported.
    t2_hits: Option<u64>,
    t2_queries: Option<u64>,
    /// LMCache local-cache bytes of the engine (`lmcache:local_cache_usage`), when reported.
    cache_memory_bytes: Option<u64>,
    /// Engine prefix-cache (hits, queries), when reported.
    prefix_cache: Option<(u64, u64)>,
    /// Set when the index itself dropped some of the replica's blocks (a tenant quota
    /// eviction, the per-stream cap): the replica reads Partial with this reason until it is
    /// cleared or resynced, whatever its agent says.
    limited: Option<&'static str>,
    /// The [`PrefixIndex::begin_resync`] that registered it (a sliced apply touches only
    /// replicas of its own generation).
    resync: u64,
    /// Its reporter has not been heard within the heartbeat bound ([`heard`]): it reads
    /// Unknown / `HeartbeatMissed` and is not routed, whatever its agent last said.
    silent: bool,
}

impl Replica {
    /// The coverage answers show: the agent's, overlaid with [`Replica::limited`] (an Exact or
    /// Healing replica whose blocks the index dropped is Partial) and [`Replica::silent`]
    /// (Unknown / `HeartbeatMissed`, over anything the agent said).
    fn effective_coverage(&self) -> Coverage {
        if self.silent {
            return Coverage::new(CoverageState::Unknown, coverage::HEARTBEAT_MISSED);
        }
        match self.limited {
            Some(reason)
                if matches!(
                    self.coverage.state,
                    CoverageState::Exact | CoverageState::Healing
                ) =>
            {
                Coverage::new(CoverageState::Partial, reason)
            }
            _ => self.coverage,
        }
    }

    /// Whether lookups may match it: its agent's coverage is routable and its reporter is not
    /// silent.
    fn routable_now(&self) -> bool {
        self.coverage.state.routable() && !self.silent
    }
}

/// What a replica's engine last reported on its `/metrics` (through the node agent's
/// `CounterReport`); `None` = not reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineReport {
    /// Cumulative tier-2 (hits, queries) in tokens.
    pub t2: Option<(u64, u64)>,
    /// Cumulative prefix-cache (hits, queries) in tokens.
    pub prefix_cache: Option<(u64, u64)>,
    /// LMCache local-cache bytes.
    pub cache_memory_bytes: Option<u64>,
}

impl EngineReport {
    /// What one `StreamCounters` of a `CounterReport` says (the agent's wire format:
    /// `t2_absent` marks counters that are not readings; the prefix-cache pair is present only
    /// as a pair).
    pub fn from_counters(c: &proto::StreamCounters) -> Self {
        EngineReport {
            t2: (!c.t2_absent).then_some((c.t2_hits, c.t2_queries)),
            prefix_cache: c.prefix_cache_hits.zip(c.prefix_cache_queries),
            cache_memory_bytes: c.cache_memory_bytes,
        }
    }
}

/// The index's heap by part, bytes, estimated from capacities ([`PrefixIndex::heap_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeapBytes {
    /// Block tables' slot arrays at their capacity (16 bytes a slot, one slot per block).
    pub table_slots: usize,
    /// The part of `table_slots` holding a block (16 bytes per distinct block): the rest is
    /// the tables' load-factor slack.
    pub table_slots_used: usize,
    /// Spilled holder lists (blocks with more than one holder).
    pub holder_lists: usize,
    /// Per-replica key vectors at their capacity (8 bytes a slot, one per entry).
    pub key_vectors: usize,
    /// The part of `key_vectors` holding a key.
    pub key_vectors_used: usize,
}

impl HeapBytes {
    /// Everything allocated: slots, holder lists, key vectors.
    pub fn total(&self) -> usize {
        self.table_slots + self.holder_lists + self.key_vectors
    }
}

/// `a == b` without a `memcmp` call when either is empty (the usual adapter: the base model).
/// Resync runs compare an entry's adapter per entry; `==` on two empty strings still calls
/// `bcmp`, which profiled at a third of a resync's apply time.
#[inline]
fn same_str(a: &str, b: &str) -> bool {
    a.len() == b.len() && (a.is_empty() || a == b)
}

/// One (block, replica) entry as [`PrefixIndex::stream_entries`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamEntry {
    /// LoRA adapter, empty for the base model.
    pub adapter: String,
    /// Block size the key was chained at.
    pub block_size: u32,
    /// Content key.
    pub content_key: u64,
    /// Tier the replica holds it at.
    pub tier: Tier,
}

/// What the index has registered ([`PrefixIndex::registered_block_sizes`]): per hash scheme
/// its block sizes, and per tenant its (hash scheme, block size) pairs.
pub type RegisteredBlockSizes = (
    std::collections::BTreeMap<String, std::collections::BTreeSet<u32>>,
    std::collections::BTreeMap<String, std::collections::BTreeSet<(String, u32)>>,
);

/// The in-memory prefix index. Not internally synchronised (except its [`PolicyTable`]): wrap it
/// in a lock.
#[derive(Debug)]
pub struct PrefixIndex {
    partition_ids: HashMap<Partition, PartitionId>,
    partitions: Vec<PartitionState>,
    replicas: Vec<Option<Replica>>,
    free_slots: Vec<ReplicaSlot>,
    slot_by_stream: HashMap<String, ReplicaSlot, table::StrBuild>,
    /// Stream-id order labels (ties in lookup answers), kept incrementally.
    order: StreamOrder,
    /// Slots of each node's streams (a resync or expiry touches only the node's own).
    node_slots: HashMap<String, Vec<ReplicaSlot>>,
    /// Replicas per effective coverage state, in `CoverageState::ALL` order (kept as coverage
    /// and limits change, so the gauges never walk every replica under the write lock).
    coverage_tally: tally::CoverageTally,
    arena: HolderArena,
    seed: u64,
    entries: usize,
    policies: Arc<PolicyTable>,
    /// Per slot: true while the replica must not be matched (Disconnected, EngineDown).
    unroutable: Vec<bool>,
    /// Number of `true` in `unroutable` (0 in steady state: lookups skip the filter).
    unroutable_count: usize,
    /// Tenant quotas (CacheTenant `spec.quota.maxIndexEntries`): most distinct blocks per tenant.
    quotas: HashMap<String, usize>,
    /// Blocks per tenant allowed above its quota ([`PrefixIndex::add_quota_headroom`]).
    quota_headroom: HashMap<String, usize>,
    /// Per tenant with a quota: its blocks in the order they entered the index.
    tenant_fifo: HashMap<String, quota::TenantFifo>,
    /// Partitions of each tenant (a tenant's block count is the sum of theirs).
    tenant_partitions: HashMap<String, Vec<PartitionId>>,
    /// Most blocks one stream may hold (`usize::MAX`: no cap).
    max_blocks_per_stream: usize,
    /// Blocks evicted by tenant quotas, per tenant, since the index was created.
    quota_evictions: HashMap<String, u64>,
    /// Blocks refused by the per-stream cap since the index was created.
    stream_cap_refusals: u64,
    /// Resyncs begun so far (each stamps its replicas with its number).
    resync_generation: u64,
    /// When each reporter (node, or subscriber `<node>/<ns>/<pod>`) was last heard, and
    /// whether its replicas read silent ([`heard`]).
    heard: HashMap<String, heard::NodeHeard>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}
impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        PrefixIndex {
            partition_ids: HashMap::new(),
            partitions: Vec::new(),
            replicas: Vec::new(),
            free_slots: Vec::new(),
            slot_by_stream: HashMap::default(),
            order: StreamOrder::default(),
            node_slots: HashMap::new(),
            coverage_tally: tally::CoverageTally::default(),
            arena: HolderArena::default(),
            seed: std::collections::hash_map::RandomState::new().hash_one(0x6963_2d6b_762d_7631u64),
            entries: 0,
            policies: Arc::new(PolicyTable::new()),
            unroutable: Vec::new(),
            unroutable_count: 0,
            quotas: HashMap::new(),
            quota_headroom: HashMap::new(),
            tenant_fifo: HashMap::new(),
            tenant_partitions: HashMap::new(),
            max_blocks_per_stream: usize::MAX,
            quota_evictions: HashMap::new(),
            stream_cap_refusals: 0,
            resync_generation: 0,
            heard: HashMap::new(),
        }
    }

    /// Number of (block, replica) entries.
    pub fn entry_count(&self) -> usize {
        self.entries
    }

    /// Number of distinct (partition, content key) blocks.
    pub fn block_count(&self) -> usize {
        self.partitions.iter().map(|p| p.blocks.len()).sum()
    }

    /// Tenants (namespaces) the index holds anything of: those of live replicas and of
    /// partitions that hold blocks (what a caller's grant is checked against).
    pub fn tenants(&self) -> std::collections::BTreeSet<String> {
        let mut out: std::collections::BTreeSet<String> = self
            .live_replicas()
            .map(|(_, r)| r.desc.tenant.clone())
            .collect();
        out.extend(
            self.partitions
                .iter()
                .filter(|p| !p.blocks.is_empty())
                .map(|p| p.key.tenant.clone()),
        );
        out
    }

    /// Distinct blocks per tenant (a block several replicas of the tenant hold counts once;
    /// partitions never span tenants, so the values sum to [`Self::block_count`]).
    pub fn blocks_by_tenant(&self) -> std::collections::BTreeMap<String, usize> {
        let mut out = std::collections::BTreeMap::new();
        for p in self.partitions.iter().filter(|p| !p.blocks.is_empty()) {
            *out.entry(p.key.tenant.clone()).or_insert(0) += p.blocks.len();
        }
        out
    }

    /// Distinct blocks held by some replica at T1 (`.0`), and held only at T2 (`.1`). Walks
    /// every block: O(blocks); for status writers that run seconds apart, not for lookups.
    pub fn blocks_by_tier(&self) -> (usize, usize) {
        let (mut t1, mut t2_only) = (0usize, 0usize);
        let mut buf = [0; 1];
        for p in &self.partitions {
            for (_, h) in p.blocks.iter() {
                if h.holders(&self.arena, &mut buf).iter().any(|x| !is_t2(*x)) {
                    t1 += 1;
                } else {
                    t2_only += 1;
                }
            }
        }
        (t1, t2_only)
    }

    /// Number of known streams.
    pub fn replica_count(&self) -> usize {
        self.slot_by_stream.len()
    }

    /// The per-namespace lookup policies (shared with the router; see [`PolicyTable`]).
    pub fn policies(&self) -> Arc<PolicyTable> {
        self.policies.clone()
    }

    /// Records `namespace`'s CachePolicy lookup values (`lookupTimeoutMs`,
    /// `minimumPrefixTokens`); `None` leaves a field to the controller's default. Shorthand for
    /// `policies().set_policy(…)`.
    pub fn set_policy(
        &self,
        namespace: &str,
        lookup_timeout_ms: Option<u32>,
        minimum_prefix_tokens: Option<u32>,
    ) {
        self.policies
            .set_policy(namespace, lookup_timeout_ms, minimum_prefix_tokens);
    }

    /// Records what a replica's engine reported on its `/metrics`, shown in `/snapshot`. The
    /// cumulative counter pairs (`t2`, `prefix_cache`) keep their last reported value when
    /// absent from `report` (counters never go back to "not exercised"); the
    /// `cache_memory_bytes` gauge is replaced (absent now: none is shown). Unknown streams are
    /// ignored.
    pub fn set_engine_counters(&mut self, stream_id: &str, report: EngineReport) {
        if let Some(r) = self
            .slot_by_stream
            .get(stream_id)
            .and_then(|s| self.replicas.get_mut(*s as usize))
            .and_then(Option::as_mut)
        {
            if let Some((hits, queries)) = report.t2 {
                r.t2_hits = Some(hits);
                r.t2_queries = Some(queries);
            }
            if report.prefix_cache.is_some() {
                r.prefix_cache = report.prefix_cache;
            }
            r.cache_memory_bytes = report.cache_memory_bytes;
        }
    }

    fn replica(&self, slot: ReplicaSlot) -> Option<&Replica> {
        self.replicas.get(slot as usize).and_then(Option::as_ref)
    }

    fn replica_mut(&mut self, slot: ReplicaSlot) -> Option<&mut Replica> {
        self.replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
    }

    fn live_replicas(&self) -> impl Iterator<Item = (ReplicaSlot, &Replica)> {
        self.replicas
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i as ReplicaSlot, r)))
    }

    /// The entries one stream holds, sorted; `None` when the stream is unknown.
    pub fn stream_entries(&self, stream_id: &str) -> Option<Vec<StreamEntry>> {
        let slot = *self.slot_by_stream.get(stream_id)?;
        let r = self.replica(slot)?;
        let mut out = Vec::with_capacity(r.blocks);
        for p in r.parts.iter() {
            let Some(ps) = self.partitions.get(p.pid as usize) else {
                continue;
            };
            for k in &p.keys {
                if let Some(w) = ps.blocks.get(*k).and_then(|h| h.find(&self.arena, slot)) {
                    out.push(StreamEntry {
                        adapter: p.adapter.clone(),
                        block_size: p.block_size,
                        content_key: *k,
                        tier: if is_t2(w) { Tier::T2 } else { Tier::T1 },
                    });
                }
            }
        }
        out.sort_unstable();
        Some(out)
    }

    /// Block sizes registered per hash scheme: those of partitions that hold blocks.
    pub fn block_sizes(&self) -> std::collections::BTreeMap<String, Vec<u32>> {
        self.block_sizes_of(&|_| true)
    }

    /// The block sizes registered per hash scheme and, per tenant, its (hash scheme, block
    /// size) pairs: what the ingest caps count from (issue 38 items 4 and 5). O(partitions).
    pub fn registered_block_sizes(&self) -> RegisteredBlockSizes {
        let mut sizes: std::collections::BTreeMap<String, std::collections::BTreeSet<u32>> =
            Default::default();
        let mut tenants: std::collections::BTreeMap<
            String,
            std::collections::BTreeSet<(String, u32)>,
        > = Default::default();
        for p in self.partitions.iter().filter(|p| !p.blocks.is_empty()) {
            sizes
                .entry(p.key.hash_scheme.clone())
                .or_default()
                .insert(p.key.block_size);
            tenants
                .entry(p.key.tenant.clone())
                .or_default()
                .insert((p.key.hash_scheme.clone(), p.key.block_size));
        }
        (sizes, tenants)
    }

    /// [`Self::block_sizes`] of the partitions of tenants `visible` accepts.
    pub(crate) fn block_sizes_of(
        &self,
        visible: &dyn Fn(&str) -> bool,
    ) -> std::collections::BTreeMap<String, Vec<u32>> {
        let mut out: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
        for p in self
            .partitions
            .iter()
            .filter(|p| !p.blocks.is_empty() && visible(&p.key.tenant))
        {
            let v = out.entry(p.key.hash_scheme.clone()).or_default();
            if !v.contains(&p.key.block_size) {
                v.push(p.key.block_size);
            }
        }
        for v in out.values_mut() {
            v.sort_unstable();
        }
        out
    }

    /// Heap bytes held by the index's tables (slot arrays at their capacity, spilled holder
    /// lists, per-replica key vectors), estimated from capacities. The benchmark measures the real
    /// figure with a counting allocator; this is for `/snapshot` and quick checks.
    pub fn approx_heap_bytes(&self) -> usize {
        self.heap_bytes().total()
    }

    /// [`Self::approx_heap_bytes`] by part (the `inferencecache_controller_index_heap_bytes`
    /// gauge, docs/scaling.md): walks every partition and replica, O(replicas).
    pub fn heap_bytes(&self) -> HeapBytes {
        HeapBytes {
            table_slots: self.partitions.iter().map(|p| p.blocks.heap_bytes()).sum(),
            table_slots_used: self.partitions.iter().map(|p| p.blocks.len() * 16).sum(),
            holder_lists: self.arena.heap_bytes(),
            key_vectors: self
                .live_replicas()
                .flat_map(|(_, r)| r.parts.iter())
                .map(|p| p.keys.capacity() * 8)
                .sum(),
            key_vectors_used: self
                .live_replicas()
                .flat_map(|(_, r)| r.parts.iter())
                .map(|p| p.keys.len() * 8)
                .sum(),
        }
    }
}

#[cfg(test)]
mod tests;
