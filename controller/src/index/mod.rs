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
//! `ic-controller`'s benchmark (`controller/benches/index.rs`, `bench/`) measures this layout on
//! the Mooncake FAST'25 trace; `docs/benchmarks.md` has the numbers.

mod heard;
mod holders;
mod lookup;
mod mem;
mod order;
mod policy;
mod snapshot;
mod table;

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::proto::{self, kv_op::Op};
use thiserror::Error;

use holders::{holder, is_t2, pos_of, HolderArena, Holders, SetOutcome, MAX_SLOT};
use order::StreamOrder;
use table::BlockTable;

pub use heard::{mono_ms, Heard, HEARTBEAT_CAPABILITY, HEARTBEAT_MISSED};
pub use lookup::{
    LookupQuery, LookupResult, ReplicaMatch, ReplicaNames, ReplicaScore, Scores, TimedOut,
    LOOKUP_TIMEOUT,
};
pub use policy::{NamespacePolicy, PolicyTable, ResolvedPolicy};
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

/// A replica's scope in [`PrefixIndex::inexact_replicas`]: (tenant, model, hash scheme).
pub type StreamScope = (String, String, String);

/// The KV-event streams `plans` expect (stream id → scope), with the descriptors the agents
/// report them by ([`ic_shared::plan::EnginePlan::descriptor`]): what
/// [`PrefixIndex::set_planned_streams`] takes.
pub fn planned_streams<'a>(
    plans: impl IntoIterator<Item = &'a ic_shared::plan::NodePlan>,
) -> HashMap<String, StreamScope> {
    let mut out = HashMap::new();
    for e in plans.into_iter().flat_map(|p| &p.engines) {
        for src in &e.kv_events {
            let d = e.descriptor(src.dp_rank);
            out.entry(d.stream_id)
                .or_insert((d.tenant, d.model, d.hash_scheme));
        }
    }
    out
}

/// Replicas per effective coverage state ([`PrefixIndex::coverage_counts`]) and, per
/// (tenant, model, hash scheme), the replicas whose entries may miss blocks the engine holds
/// ([`misses_entries`]: [`PrefixIndex::inexact_replicas`]) plus the planned streams the index
/// has no replica for. Kept as coverage, limits, replicas and plans change, so neither the
/// gauges nor a lookup walks every replica.
#[derive(Debug, Default)]
struct CoverageTally {
    by_state: [usize; CoverageState::ALL.len()],
    inexact: HashMap<StreamScope, u32>,
    /// The streams the node plans expect ([`PrefixIndex::set_planned_streams`]), by stream id.
    planned: HashMap<String, StreamScope>,
    /// How many of `planned` have no replica.
    planned_absent: usize,
}

/// Whether a replica in `state` may hold blocks its index entries lack: anything but Exact,
/// and but EngineDown (the engine and its cache are gone).
fn misses_entries(state: CoverageState) -> bool {
    !matches!(state, CoverageState::Exact | CoverageState::EngineDown)
}

impl CoverageTally {
    /// Moves the replica of `desc` between states (`None`: it is created or removed).
    fn moved(
        &mut self,
        desc: &proto::StreamDescriptor,
        from: Option<CoverageState>,
        to: Option<CoverageState>,
    ) {
        if from == to {
            return;
        }
        retally(&mut self.by_state, from, to);
        // A planned stream without a replica counts as inexact under its planned scope.
        if from.is_none() || to.is_none() {
            if let Some(planned) = self.planned.get(&desc.stream_id).cloned() {
                let created = from.is_none();
                self.planned_absent = if created {
                    self.planned_absent.saturating_sub(1)
                } else {
                    self.planned_absent + 1
                };
                self.bump(planned, !created);
            }
        }
        let was = from.is_some_and(misses_entries);
        let is = to.is_some_and(misses_entries);
        if was == is {
            return;
        }
        let scope = (
            desc.tenant.clone(),
            desc.model.clone(),
            desc.hash_scheme.clone(),
        );
        self.bump(scope, is);
    }

    /// Counts one more (`up`) or one less inexact replica in `scope`.
    fn bump(&mut self, scope: StreamScope, up: bool) {
        if up {
            *self.inexact.entry(scope).or_default() += 1;
        } else if let Some(n) = self.inexact.get_mut(&scope) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.inexact.remove(&scope);
            }
        }
    }

    /// Replaces the planned streams; `present` says whether the index has a replica of a
    /// stream id.
    fn set_planned(
        &mut self,
        planned: HashMap<String, StreamScope>,
        present: impl Fn(&str) -> bool,
    ) {
        let old = std::mem::take(&mut self.planned);
        for (id, scope) in old {
            if !present(&id) {
                self.bump(scope, false);
            }
        }
        self.planned_absent = 0;
        for (id, scope) in &planned {
            if !present(id) {
                self.planned_absent += 1;
                self.bump(scope.clone(), true);
            }
        }
        self.planned = planned;
    }
}

/// Moves one replica between the per-state counts of [`PrefixIndex::coverage_counts`]
/// (`None`: the replica is created or removed).
fn retally(
    tally: &mut [usize; CoverageState::ALL.len()],
    from: Option<CoverageState>,
    to: Option<CoverageState>,
) {
    if from == to {
        return;
    }
    let at = |s: CoverageState| CoverageState::ALL.iter().position(|x| *x == s);
    if let Some(c) = from.and_then(at).and_then(|i| tally.get_mut(i)) {
        *c = c.saturating_sub(1);
    }
    if let Some(c) = to.and_then(at).and_then(|i| tally.get_mut(i)) {
        *c += 1;
    }
}

/// A tenant's blocks in arrival order, for its quota (oldest evicted first).
///
/// Entries carry the arrival number of their block; `latest` holds each queued block's newest
/// number, so an entry whose block was removed and stored again (a newer entry exists) or that
/// was already evicted is skipped when popped. The queue is compacted when it holds more than
/// twice the tenant's blocks (plus slack), so it stays proportional to what the index holds.
#[derive(Debug, Default)]
struct TenantFifo {
    queue: std::collections::VecDeque<(PartitionId, u64, u64)>,
    latest: HashMap<(PartitionId, u64), u64>,
    next: u64,
}

impl TenantFifo {
    fn push(&mut self, pid: PartitionId, key: u64) {
        self.next += 1;
        self.latest.insert((pid, key), self.next);
        self.queue.push_back((pid, key, self.next));
    }

    /// The oldest block whose entry is its newest.
    fn pop(&mut self) -> Option<(PartitionId, u64)> {
        while let Some((pid, key, n)) = self.queue.pop_front() {
            if self.latest.get(&(pid, key)) == Some(&n) {
                self.latest.remove(&(pid, key));
                return Some((pid, key));
            }
        }
        None
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

/// A node's resync being applied in slices: what [`PrefixIndex::begin_resync`] registered and
/// how far [`PrefixIndex::resync_step`] got. Holds no borrow of the index, so the caller may
/// release the index lock between steps.
#[derive(Debug)]
pub struct ResyncApply {
    generation: u64,
    /// Per snapshot of the resync: the slot it was registered in (`None`: skipped).
    slots: Vec<Option<ReplicaSlot>>,
    /// Next snapshot and entry to apply.
    stream: usize,
    entry: usize,
    /// Reused buffer of one run's keys.
    keys: Vec<u64>,
}

/// Block tables grown ahead of a resync slice ([`PrefixIndex::grow_ahead`]).
#[derive(Debug, Default)]
pub struct GrownTables {
    tables: Vec<(PartitionId, BlockTable)>,
}

impl ResyncApply {
    /// Entries of `streams` (the resync this apply was begun with) behind the apply's position:
    /// applied, or skipped with their stream.
    pub fn entries_done(&self, streams: &[proto::StreamSnapshot]) -> u64 {
        let before: usize = streams
            .iter()
            .take(self.stream)
            .map(|s| s.entries.len())
            .sum();
        let within = streams
            .get(self.stream)
            .map_or(0, |s| self.entry.min(s.entries.len()));
        (before + within) as u64
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
    coverage_tally: CoverageTally,
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
    tenant_fifo: HashMap<String, TenantFifo>,
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
            coverage_tally: CoverageTally::default(),
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

    /// Sets the tenant quotas (CacheTenant `spec.quota.maxIndexEntries`, by tenant id): each
    /// tenant holds at most that many distinct blocks; storing beyond evicts the tenant's oldest
    /// blocks first (from every replica that holds them, which then read Partial /
    /// `TenantQuotaExceeded`). Blocks already held when a quota is first set are ordered by their
    /// position in the replicas' key vectors (arrival order, but for removals). A tenant absent
    /// from `quotas` has none.
    pub fn set_tenant_quotas(&mut self, quotas: HashMap<String, usize>) {
        if quotas == self.quotas {
            return;
        }
        self.tenant_fifo.retain(|t, _| quotas.contains_key(t));
        for t in quotas.keys() {
            if self.tenant_fifo.contains_key(t) {
                continue;
            }
            // Blocks held before the quota: oldest first as far as the replicas' key vectors
            // tell (each is in arrival order but for removals), position by position.
            let mut fifo = TenantFifo::default();
            let mut seen = std::collections::HashSet::new();
            let vecs: Vec<(PartitionId, &[u64])> = self
                .replicas
                .iter()
                .flatten()
                .flat_map(|r| r.parts.iter())
                .filter(|p| {
                    self.partitions
                        .get(p.pid as usize)
                        .is_some_and(|ps| &ps.key.tenant == t)
                })
                .map(|p| (p.pid, p.keys.as_slice()))
                .collect();
            let longest = vecs.iter().map(|(_, k)| k.len()).max().unwrap_or(0);
            for i in 0..longest {
                for (pid, keys) in &vecs {
                    if let Some(&k) = keys.get(i) {
                        if seen.insert((*pid, k)) {
                            fifo.push(*pid, k);
                        }
                    }
                }
            }
            self.tenant_fifo.insert(t.clone(), fifo);
        }
        self.quotas = quotas;
        let tenants: Vec<String> = self.quotas.keys().cloned().collect();
        for t in tenants {
            self.enforce_quota(&t);
        }
    }

    /// Caps the blocks one stream may hold (`usize::MAX`: none). Blocks a stream stores beyond
    /// it are not indexed, and the stream reads Partial / `StreamCapExceeded`.
    pub fn set_max_blocks_per_stream(&mut self, cap: usize) {
        self.max_blocks_per_stream = cap;
    }

    /// The tenant quotas in force ([`Self::set_tenant_quotas`]).
    pub fn tenant_quotas(&self) -> &HashMap<String, usize> {
        &self.quotas
    }

    /// Blocks evicted by tenant quotas so far, per tenant.
    pub fn quota_evictions(&self) -> &HashMap<String, u64> {
        &self.quota_evictions
    }

    /// Blocks refused by the per-stream cap so far.
    pub fn stream_cap_refusals(&self) -> u64 {
        self.stream_cap_refusals
    }

    fn tenant_blocks(&self, tenant: &str) -> usize {
        self.tenant_partitions
            .get(tenant)
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| self.partitions.get(*id as usize))
                    .map(|p| p.blocks.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Lets `tenant` hold `blocks` more than its quota until [`Self::remove_quota_headroom`]
    /// takes them back: blocks the controller stores for itself (the routing probe's synthetic
    /// stream) so that they do not evict the tenant's real entries.
    pub fn add_quota_headroom(&mut self, tenant: &str, blocks: usize) {
        *self.quota_headroom.entry(tenant.to_string()).or_insert(0) += blocks;
    }

    /// Takes back headroom given by [`Self::add_quota_headroom`].
    pub fn remove_quota_headroom(&mut self, tenant: &str, blocks: usize) {
        if let Some(h) = self.quota_headroom.get_mut(tenant) {
            *h = h.saturating_sub(blocks);
            if *h == 0 {
                self.quota_headroom.remove(tenant);
            }
        }
    }

    /// Evicts `tenant`'s oldest blocks until it is within its quota (plus any headroom).
    fn enforce_quota(&mut self, tenant: &str) {
        let Some(&quota) = self.quotas.get(tenant) else {
            return;
        };
        let max = quota.saturating_add(self.quota_headroom.get(tenant).copied().unwrap_or(0));
        let mut held = self.tenant_blocks(tenant);
        while held > max {
            let Some((pid, key)) = self.tenant_fifo.get_mut(tenant).and_then(TenantFifo::pop)
            else {
                break;
            };
            if self.evict_block(pid, key) {
                held -= 1;
                *self.quota_evictions.entry(tenant.to_string()).or_insert(0) += 1;
            }
        }
        // Keep the queue proportional to what the tenant holds: drop entries that are not
        // their block's newest and blocks the engines removed since.
        let partitions = &self.partitions;
        if let Some(f) = self.tenant_fifo.get_mut(tenant) {
            if f.queue.len() > 2 * held + 1024 {
                let present = |pid: PartitionId, key: u64| {
                    partitions
                        .get(pid as usize)
                        .is_some_and(|p| p.blocks.get(key).is_some())
                };
                f.latest.retain(|(pid, key), _| present(*pid, *key));
                let latest = &f.latest;
                f.queue
                    .retain(|(pid, key, n)| latest.get(&(*pid, *key)) == Some(n));
            }
        }
    }

    /// Drops block `key` of partition `pid` from every replica that holds it; they read Partial
    /// / `TenantQuotaExceeded`. False when the block is not there (any more).
    fn evict_block(&mut self, pid: PartitionId, key: u64) -> bool {
        let Some(h) = self
            .partitions
            .get(pid as usize)
            .and_then(|p| p.blocks.get(key))
        else {
            return false;
        };
        let mut buf = [0; 1];
        let slots: Vec<ReplicaSlot> = h
            .holders(&self.arena, &mut buf)
            .iter()
            .map(|x| holders::slot_of(*x))
            .collect();
        for slot in slots {
            let part = self
                .replica(slot)
                .and_then(|r| r.parts.iter().position(|p| p.pid == pid));
            if let Some(part) = part {
                self.remove(slot, part, &[key]);
            }
            self.limit_slot(slot, coverage::TENANT_QUOTA_EXCEEDED);
        }
        true
    }

    /// Records a replica's coverage and whether lookups may match it.
    fn set_coverage(&mut self, slot: ReplicaSlot, cov: Coverage) {
        let mut silent = false;
        if let Some(r) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        {
            silent = r.silent;
            if r.coverage == cov {
                // Unchanged (nearly every delta): the tally and `unroutable` already agree.
                return;
            }
            let before = r.effective_coverage().state;
            r.coverage = cov;
            self.coverage_tally
                .moved(&r.desc, Some(before), Some(r.effective_coverage().state));
        }
        self.set_unroutable(slot, !cov.state.routable() || silent);
    }

    /// Reads the replica in `slot` silent or not ([`Replica::silent`]), keeping the tally and
    /// `unroutable`. True when that changed.
    fn set_silent(&mut self, slot: ReplicaSlot, silent: bool) -> bool {
        let Some(r) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return false;
        };
        if r.silent == silent {
            return false;
        }
        let before = r.effective_coverage().state;
        r.silent = silent;
        self.coverage_tally
            .moved(&r.desc, Some(before), Some(r.effective_coverage().state));
        let block = !r.routable_now();
        self.set_unroutable(slot, block);
        true
    }

    /// Sets whether lookups skip `slot`, keeping `unroutable_count`.
    fn set_unroutable(&mut self, slot: ReplicaSlot, block: bool) {
        let i = slot as usize;
        if self.unroutable.len() <= i {
            self.unroutable.resize(i + 1, false);
        }
        if let Some(cell) = self.unroutable.get_mut(i) {
            if *cell != block {
                *cell = block;
                if block {
                    self.unroutable_count += 1;
                } else {
                    self.unroutable_count = self.unroutable_count.saturating_sub(1);
                }
            }
        }
    }

    /// True when lookups may match the replica in `slot`.
    #[inline]
    fn routable(&self, slot: ReplicaSlot) -> bool {
        self.unroutable_count == 0 || !self.unroutable.get(slot as usize).copied().unwrap_or(false)
    }

    /// Marks every routable replica of `node` as unreported (its agent's stream ended):
    /// coverage Unknown / `AgentDisconnected` until the agent's next resync. Those entries stay
    /// routable (an agent restart is not an engine outage) until the node expires; a replica
    /// already reported Disconnected or EngineDown stays unrouted.
    pub fn mark_node_unreported(&mut self, node: &str) {
        self.mark_node_routable(
            node,
            Coverage::new(CoverageState::Unknown, coverage::AGENT_DISCONNECTED),
        );
    }

    /// A newer agent stream of `node` opened (it supersedes the one that reported the node's
    /// replicas): a resync of the old stream still being applied in slices stops touching them
    /// (its later [`Self::resync_step`]s skip them and do not set their coverage), and each
    /// routable one reads Unknown / `AgentDisconnected` until the new stream's resync.
    pub fn supersede_node(&mut self, node: &str) {
        for s in self.slots_of_node(node, |_| true) {
            if let Some(r) = self.replica_mut(s) {
                // No apply has generation 0 (`begin_resync` counts from 1).
                r.resync = 0;
            }
        }
        self.mark_node_unreported(node);
    }

    /// The slots of `node`'s replicas for which `keep` holds.
    fn slots_of_node(&self, node: &str, keep: impl Fn(&Replica) -> bool) -> Vec<ReplicaSlot> {
        self.node_slots
            .get(node)
            .into_iter()
            .flatten()
            .copied()
            .filter(|s| self.replica(*s).is_some_and(|r| r.node == node && keep(r)))
            .collect()
    }

    /// Marks the replica of `stream_id` Partial with `reason` until it is cleared or resynced
    /// (whatever its agent reports meanwhile): ingest dropped some of its entries or ops
    /// (e.g. [`coverage::BLOCK_SIZE_CAP_EXCEEDED`]). False when the stream is not indexed.
    pub fn limit_stream(&mut self, stream_id: &str, reason: &'static str) -> bool {
        let Some(&slot) = self.slot_by_stream.get(stream_id) else {
            return false;
        };
        self.limit_slot(slot, reason);
        true
    }

    /// Sets `slot`'s [`Replica::limited`] and keeps the coverage tally.
    fn limit_slot(&mut self, slot: ReplicaSlot, reason: &'static str) {
        if let Some(r) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        {
            let before = r.effective_coverage().state;
            r.limited = Some(reason);
            self.coverage_tally
                .moved(&r.desc, Some(before), Some(r.effective_coverage().state));
        }
    }

    /// Marks every routable replica of `node` Unknown / `ResyncRequested`: the controller
    /// refused one of the node's deltas and asked its agent for a resync, and applies none of
    /// its deltas until then, so the entries are as last applied. Still routed, like an
    /// unreported node; the resync sets each stream's coverage again.
    pub fn mark_node_awaiting_resync(&mut self, node: &str) {
        self.mark_node_routable(
            node,
            Coverage::new(CoverageState::Unknown, coverage::RESYNC_REQUESTED),
        );
    }

    /// Sets `cov` on every replica of `node` that is routable now.
    fn mark_node_routable(&mut self, node: &str, cov: Coverage) {
        for s in self.slots_of_node(node, |r| r.coverage.state.routable()) {
            self.set_coverage(s, cov);
        }
    }

    /// Replicas per coverage state, every state listed (the
    /// `inferencecache_controller_index_replicas_by_coverage` gauge).
    pub fn coverage_counts(&self) -> [(CoverageState, usize); CoverageState::ALL.len()] {
        let mut out = CoverageState::ALL.map(|s| (s, 0usize));
        for (c, n) in out.iter_mut().zip(self.coverage_tally.by_state) {
            c.1 = n;
        }
        out
    }

    /// The inexact-replica tally by walking every replica and planned stream (what it must
    /// equal).
    #[cfg(test)]
    fn inexact_walked(&self) -> HashMap<StreamScope, u32> {
        let mut out: HashMap<StreamScope, u32> = HashMap::new();
        for (_, r) in self.live_replicas() {
            if misses_entries(r.effective_coverage().state) {
                *out.entry((
                    r.desc.tenant.clone(),
                    r.desc.model.clone(),
                    r.desc.hash_scheme.clone(),
                ))
                .or_default() += 1;
            }
        }
        for (id, scope) in &self.coverage_tally.planned {
            if !self.slot_by_stream.contains_key(id.as_str()) {
                *out.entry(scope.clone()).or_default() += 1;
            }
        }
        out
    }

    /// Sets the streams the node plans expect (stream id → scope; [`planned_streams`] derives
    /// them from the plans): each one the index has no replica for — its node's agent has not
    /// connected since this controller started, or never did, or its replica expired — counts
    /// in [`Self::inexact_replicas`] of its scope until its replica appears. O(planned streams);
    /// the caller skips it when the plans did not change ([`Self::planned_streams_are`]).
    pub fn set_planned_streams(&mut self, planned: HashMap<String, StreamScope>) {
        let by_stream = &self.slot_by_stream;
        self.coverage_tally
            .set_planned(planned, |id| by_stream.contains_key(id));
    }

    /// True when [`Self::set_planned_streams`] last set exactly `planned`.
    pub fn planned_streams_are(&self, planned: &HashMap<String, StreamScope>) -> bool {
        self.coverage_tally.planned == *planned
    }

    /// Planned streams the index has no replica for (the
    /// `inferencecache_controller_index_planned_streams_absent` gauge).
    pub fn planned_streams_absent(&self) -> usize {
        self.coverage_tally.planned_absent
    }

    /// The planned streams the index has no replica for, as (stream id, scope), in no
    /// particular order: the replicas a status lists as `Unknown` / `NotReported`.
    /// O(planned streams).
    pub fn planned_streams_without_replica(&self) -> impl Iterator<Item = (&str, &StreamScope)> {
        self.coverage_tally
            .planned
            .iter()
            .filter(|(id, _)| !self.slot_by_stream.contains_key(id.as_str()))
            .map(|(id, scope)| (id.as_str(), scope))
    }

    /// [`Self::coverage_counts`] by walking every replica (what the tally must equal).
    #[cfg(test)]
    fn coverage_counts_walked(&self) -> [(CoverageState, usize); CoverageState::ALL.len()] {
        let mut out = CoverageState::ALL.map(|s| (s, 0usize));
        for (_, r) in self.live_replicas() {
            if let Some(c) = out
                .iter_mut()
                .find(|(s, _)| *s == r.effective_coverage().state)
            {
                c.1 += 1;
            }
        }
        out
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

    fn intern(&mut self, p: Partition) -> PartitionId {
        if let Some(id) = self.partition_ids.get(&p) {
            return *id;
        }
        let id = self.partitions.len() as PartitionId;
        self.tenant_partitions
            .entry(p.tenant.clone())
            .or_default()
            .push(id);
        self.partitions.push(PartitionState {
            key: p.clone(),
            blocks: BlockTable::new(self.seed),
        });
        self.partition_ids.insert(p, id);
        id
    }

    /// The replica's part for (adapter, block size), created (and the partition interned) on
    /// first use. Returns its index in `replica.parts`.
    fn part_for(&mut self, slot: ReplicaSlot, adapter: &str, block_size: u32) -> Option<usize> {
        let r = self.replica(slot)?;
        if let Some(i) = r.parts.position(block_size, adapter) {
            return Some(i);
        }
        let p = Partition {
            tenant: r.desc.tenant.clone(),
            model: r.desc.model.clone(),
            hash_scheme: r.desc.hash_scheme.clone(),
            adapter: adapter.to_string(),
            block_size,
        };
        let pid = self.intern(p);
        let r = self.replica_mut(slot)?;
        Some(r.parts.push(ReplicaPart {
            pid,
            adapter: adapter.to_string(),
            block_size,
            keys: Vec::new(),
        }))
    }

    fn alloc_slot(&mut self) -> Option<ReplicaSlot> {
        if let Some(s) = self.free_slots.pop() {
            return Some(s);
        }
        let s = self.replicas.len();
        if s > MAX_SLOT as usize {
            return None;
        }
        self.replicas.push(None);
        Some(s as ReplicaSlot)
    }

    /// Replaces every stream of `node` with the given snapshots (agent (re)connect or resync).
    /// Streams of the node not in `streams` are dropped. Stale snapshots register the stream with
    /// no entries.
    ///
    /// Costs what the node's streams hold plus O(log n) per stream for its place in the
    /// stream-id order: nothing here walks or sorts every stream of the index. The whole
    /// resync is applied at once: [`Self::begin_resync`] and [`Self::resync_step`] apply it in
    /// slices (the same result; see there), so the caller can release the write lock between.
    pub fn resync_node(&mut self, node: &str, streams: &[proto::StreamSnapshot]) {
        let mut apply = self.begin_resync(node, streams);
        while !self.resync_step(&mut apply, streams, usize::MAX) {}
    }

    /// Starts replacing every stream of `node` with `streams` (what [`Self::resync_node`] does
    /// at once): drops the node's streams (and streams of these ids elsewhere: the newest
    /// report wins), registers each snapshot's stream with no entries yet, its key vector sized
    /// for its snapshot, and coverage Partial / [`coverage::RESYNC_APPLYING`] — so a lookup
    /// before the last [`Self::resync_step`] sees the node's streams Partial, never Exact. A
    /// later snapshot of the same stream id replaces an earlier one (as a whole resync does).
    /// Pass the same `streams` to every [`Self::resync_step`] of the returned apply.
    pub fn begin_resync(&mut self, node: &str, streams: &[proto::StreamSnapshot]) -> ResyncApply {
        self.resync_generation += 1;
        let generation = self.resync_generation;
        self.remove_node_streams(node);
        let mut slots: Vec<Option<ReplicaSlot>> = Vec::with_capacity(streams.len());
        let mut by_id: HashMap<&str, usize> = HashMap::with_capacity(streams.len());
        for (i, snap) in streams.iter().enumerate() {
            let Some(desc) = snap.stream.clone() else {
                slots.push(None);
                continue;
            };
            // The same id earlier in this resync: the later snapshot replaces it.
            if let Some(earlier) =
                by_id.insert(snap.stream.as_ref().map_or("", |d| d.stream_id.as_str()), i)
            {
                if let Some(cell) = slots.get_mut(earlier) {
                    *cell = None;
                }
            }
            // A stream id moving between nodes: the newest report wins.
            self.remove_stream(&desc.stream_id);
            let Some(slot) = self.alloc_slot() else {
                tracing::warn!(stream = %desc.stream_id, "prefix index: replica slots exhausted");
                slots.push(None);
                continue;
            };
            self.slot_by_stream.insert(desc.stream_id.clone(), slot);
            self.order.insert(&desc.stream_id, slot);
            self.node_slots
                .entry(node.to_string())
                .or_default()
                .push(slot);
            if let Some(cell) = self.replicas.get_mut(slot as usize) {
                *cell = Some(Replica {
                    names: Arc::new(ReplicaNames {
                        replica: desc.replica.clone(),
                        stream_id: desc.stream_id.clone(),
                        node: node.to_string(),
                        backend: desc.backend.clone(),
                    }),
                    desc,
                    node: node.to_string(),
                    seq: snap.seq,
                    parts: Parts::default(),
                    blocks: 0,
                    t2_blocks: 0,
                    last_event_unix_ms: snap.last_event_unix_ms,
                    stale: snap.stale,
                    coverage: Coverage::EXACT,
                    t2_hits: None,
                    t2_queries: None,
                    cache_memory_bytes: None,
                    prefix_cache: None,
                    limited: None,
                    resync: generation,
                    silent: false,
                });
                if let Some(r) = self.replicas.get(slot as usize).and_then(Option::as_ref) {
                    self.coverage_tally
                        .moved(&r.desc, None, Some(CoverageState::Exact));
                }
            }
            self.set_coverage(
                slot,
                Coverage::new(CoverageState::Partial, coverage::RESYNC_APPLYING),
            );
            if self.node_silent(node) {
                self.set_silent(slot, true);
            }
            if !snap.stale {
                self.reserve_parts(slot, &snap.entries);
            }
            slots.push(Some(slot));
        }
        ResyncApply {
            generation,
            slots,
            stream: 0,
            entry: 0,
            keys: Vec::new(),
        }
    }

    /// Sizes `slot`'s key vectors for `entries` (one part per (adapter, block size), each
    /// reserved exactly: a resync's vectors never carry push-growth slack).
    fn reserve_parts(&mut self, slot: ReplicaSlot, entries: &[proto::BlockEntry]) {
        let mut counts: Vec<(&str, u32, usize)> = Vec::new();
        for e in entries {
            match counts.last_mut() {
                Some((a, b, n)) if *b == e.block_size && same_str(a, &e.adapter) => *n += 1,
                _ => match counts
                    .iter_mut()
                    .find(|(a, b, _)| *b == e.block_size && same_str(a, &e.adapter))
                {
                    Some((_, _, n)) => *n += 1,
                    None => counts.push((&e.adapter, e.block_size, 1)),
                },
            }
        }
        let cap = self.max_blocks_per_stream;
        for (adapter, block_size, n) in counts {
            let Some(part) = self.part_for(slot, adapter, block_size) else {
                continue;
            };
            if let Some(rp) = self.replica_mut(slot).and_then(|r| r.parts.get_mut(part)) {
                rp.keys.reserve_exact(n.min(cap));
            }
        }
    }

    /// Applies up to `budget` more entries of `apply` (begun by [`Self::begin_resync`] with
    /// these `streams`); once the last entry is in, sets each stream's own coverage from its
    /// snapshot and returns true. Streams a later resync or removal took over since
    /// (another generation in their slot) are skipped. Applying a resync in any number of steps
    /// of any budget gives the same index as [`Self::resync_node`].
    pub fn resync_step(
        &mut self,
        apply: &mut ResyncApply,
        streams: &[proto::StreamSnapshot],
        budget: usize,
    ) -> bool {
        let mut left = budget.max(1);
        let mut keys = std::mem::take(&mut apply.keys);
        while left > 0 {
            let Some((slot, run)) = self.next_resync_run(
                &apply.slots,
                apply.generation,
                streams,
                (&mut apply.stream, &mut apply.entry),
                left,
            ) else {
                break;
            };
            // One run of entries of one (adapter, block size, tier), within the budget: one
            // store, whose slot fetches overlap.
            let Some(first) = run.first() else {
                break;
            };
            keys.clear();
            keys.extend(run.iter().map(|e| e.content_key));
            if let Some(part) = self.part_for(slot, &first.adapter, first.block_size) {
                self.store(slot, part, &keys, Tier::from_proto(first.tier));
            }
            apply.entry += run.len();
            left -= run.len();
        }
        apply.keys = keys;
        if apply.stream < streams.len() {
            return false;
        }
        for (snap, slot) in streams.iter().zip(&apply.slots) {
            let Some(slot) = *slot else {
                continue;
            };
            if self
                .replica(slot)
                .is_some_and(|r| r.resync == apply.generation)
            {
                self.set_coverage(
                    slot,
                    Coverage::from_proto(snap.coverage, &snap.coverage_reason),
                );
            }
        }
        true
    }

    /// The next run of a resync's entries from `at` = (stream, entry): at most `left` entries
    /// of one adapter, block size and tier, in a stream the apply of generation `generation`
    /// still owns (registered in `slots`, not stale). Moves `at` past the streams it skips to
    /// the run's start; `None` past the last stream. What [`Self::resync_step`] applies and
    /// [`Self::grow_ahead`] sizes for.
    fn next_resync_run<'s>(
        &self,
        slots: &[Option<ReplicaSlot>],
        generation: u64,
        streams: &'s [proto::StreamSnapshot],
        at: (&mut usize, &mut usize),
        left: usize,
    ) -> Option<(ReplicaSlot, &'s [proto::BlockEntry])> {
        let (stream, entry) = at;
        loop {
            let snap = streams.get(*stream)?;
            let slot = slots.get(*stream).copied().flatten().filter(|s| {
                !snap.stale && self.replica(*s).is_some_and(|r| r.resync == generation)
            });
            let rest = snap.entries.get(*entry..).unwrap_or_default();
            if let (Some(slot), Some(first)) = (slot, rest.first()) {
                let n = rest
                    .iter()
                    .take(left.max(1))
                    .take_while(|e| {
                        e.block_size == first.block_size
                            && e.tier == first.tier
                            && same_str(&e.adapter, &first.adapter)
                    })
                    .count();
                return rest.get(..n).map(|run| (slot, run));
            }
            *stream += 1;
            *entry = 0;
        }
    }

    /// Grows, in copies built from `&self`, the block tables that the next `budget` entries of
    /// `apply` could push past their load bound (each entry counted as a new key of its
    /// partition; only tables of [`table::GROW_AHEAD_MIN_SLOTS`] slots and more). The caller
    /// holds an upgradable read lock meanwhile — lookups go on reading, no writer can change
    /// the tables — then upgrades and [`Self::install_grown`]s them, so the slice that follows
    /// never grows a large table under the exclusive lock. A grow of a 6 M-block partition
    /// (≈ 100–160 MiB of fresh slots) took 0.2–0.5 s, all of it a stall for every lookup when
    /// done in place (docs/scaling.md "Index at fleet scale").
    pub fn grow_ahead(
        &self,
        apply: &ResyncApply,
        streams: &[proto::StreamSnapshot],
        budget: usize,
    ) -> GrownTables {
        let mut per_pid: Vec<(PartitionId, usize)> = Vec::new();
        let (mut stream, mut entry, mut left) = (apply.stream, apply.entry, budget.max(1));
        while left > 0 {
            let Some((slot, run)) = self.next_resync_run(
                &apply.slots,
                apply.generation,
                streams,
                (&mut stream, &mut entry),
                left,
            ) else {
                break;
            };
            let pid = run.first().and_then(|first| {
                let parts = &self.replica(slot)?.parts;
                let i = parts.position(first.block_size, &first.adapter)?;
                parts.get(i).map(|p| p.pid)
            });
            if let Some(pid) = pid {
                match per_pid.iter_mut().find(|(p, _)| *p == pid) {
                    Some((_, c)) => *c += run.len(),
                    None => per_pid.push((pid, run.len())),
                }
            }
            entry += run.len();
            left -= run.len();
        }
        let tables = per_pid
            .into_iter()
            .filter_map(|(pid, n)| {
                let table = &self.partitions.get(pid as usize)?.blocks;
                let cap = table.capacity_for(n)?;
                Some((pid, table.resized_copy(cap)))
            })
            .collect();
        GrownTables { tables }
    }

    /// Swaps in tables [`Self::grow_ahead`] grew (from this index, unchanged since); returns
    /// the tables they replace, for the caller to drop after it releases the lock (freeing
    /// 100 MiB of slots is page-table work a lookup need not wait for).
    pub fn install_grown(&mut self, grown: GrownTables) -> GrownTables {
        let mut replaced = GrownTables::default();
        for (pid, table) in grown.tables {
            // A table that changed since (a contract breach) keeps growing in place instead.
            if let Some(ps) = self
                .partitions
                .get_mut(pid as usize)
                .filter(|ps| ps.blocks.len() == table.len())
            {
                replaced
                    .tables
                    .push((pid, std::mem::replace(&mut ps.blocks, table)));
            }
        }
        replaced
    }

    /// Drops every stream reported by `node`, and when it was last heard.
    pub fn remove_node(&mut self, node: &str) {
        self.remove_node_streams(node);
        self.forget_heard(node);
    }

    fn remove_node_streams(&mut self, node: &str) {
        let streams: Vec<String> = self
            .node_slots
            .remove(node)
            .into_iter()
            .flatten()
            .filter_map(|s| self.replica(s))
            .filter(|r| r.node == node)
            .map(|r| r.desc.stream_id.clone())
            .collect();
        for s in streams {
            self.remove_stream(&s);
        }
    }

    /// Drops one stream and all its entries. True when it was known.
    pub fn remove_stream(&mut self, stream_id: &str) -> bool {
        let Some(slot) = self.slot_by_stream.remove(stream_id) else {
            return false;
        };
        self.order.remove(stream_id);
        if let Some(node) = self.replica(slot).map(|r| r.node.clone()) {
            if let Some(slots) = self.node_slots.get_mut(&node) {
                slots.retain(|s| *s != slot);
                if slots.is_empty() {
                    self.node_slots.remove(&node);
                }
            }
        }
        self.clear_replica(slot);
        self.set_silent(slot, false);
        self.set_coverage(slot, Coverage::EXACT);
        if let Some(cell) = self.replicas.get_mut(slot as usize) {
            if let Some(r) = cell.take() {
                self.coverage_tally
                    .moved(&r.desc, Some(r.effective_coverage().state), None);
            }
        }
        self.free_slots.push(slot);
        true
    }

    /// Applies one delta from `node`. On error nothing is changed and the caller asks the agent
    /// for a resync.
    pub fn apply_delta(
        &mut self,
        node: &str,
        delta: &proto::StreamDelta,
    ) -> Result<(), ApplyError> {
        let desc = delta.stream.as_ref().ok_or(ApplyError::MissingStream)?;
        let found = self
            .slot_by_stream
            .get(&desc.stream_id)
            .copied()
            .and_then(|s| self.replica(s).map(|r| (s, r)))
            .filter(|(_, r)| r.node == node);
        let Some((slot, replica)) = found else {
            return Err(ApplyError::UnknownStream {
                stream_id: desc.stream_id.clone(),
                node: node.to_string(),
            });
        };
        let expected = replica.seq + 1;
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
                    let Some(part) = self.part_for(slot, &s.adapter, s.block_size) else {
                        continue;
                    };
                    self.store(slot, part, &s.content_keys, Tier::from_proto(s.tier));
                }
                Some(Op::Remove(r)) => {
                    let Some(part) = self.find_part(slot, &r.adapter, r.block_size) else {
                        continue;
                    };
                    self.remove(slot, part, &r.content_keys);
                }
                Some(Op::Clear(_)) => self.clear_replica(slot),
                None => {}
            }
        }
        if let Some(r) = self.replica_mut(slot) {
            r.seq = delta.seq;
            r.stale = false;
            if delta.last_event_unix_ms > r.last_event_unix_ms {
                r.last_event_unix_ms = delta.last_event_unix_ms;
            }
        }
        self.set_coverage(
            slot,
            Coverage::from_proto(delta.coverage, &delta.coverage_reason),
        );
        Ok(())
    }

    fn find_part(&self, slot: ReplicaSlot, adapter: &str, block_size: u32) -> Option<usize> {
        self.replica(slot)?.parts.position(block_size, adapter)
    }

    /// Records that `slot` holds `keys` (in its part `part`) at `tier`. Idempotent.
    fn store(&mut self, slot: ReplicaSlot, part: usize, keys: &[u64], tier: Tier) {
        let Some(replica) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        let Some(rp) = replica.parts.get_mut(part) else {
            return;
        };
        let Some(ps) = self.partitions.get_mut(rp.pid as usize) else {
            return;
        };
        let arena = &mut self.arena;
        let t2 = tier == Tier::T2;
        let pid = rp.pid;
        // Only tenants with a quota track the order their blocks arrived in.
        let mut fifo = if self.quotas.is_empty() {
            None
        } else {
            self.tenant_fifo.get_mut(&ps.key.tenant)
        };
        let room = self.max_blocks_per_stream.saturating_sub(replica.blocks);
        ps.blocks.prefetch(keys);
        let (mut added, mut t2_up, mut t2_down, mut refused) = (0usize, 0usize, 0usize, 0usize);
        let mut new_blocks = 0usize;
        for &key in keys {
            let pos = rp.keys.len() as u32;
            if added >= room {
                // At the per-stream cap: tier changes of held blocks still apply, new blocks
                // are not indexed.
                match ps.blocks.get_mut(key) {
                    Some(h) if h.find(arena, slot).is_some() => match h.set(arena, slot, t2, pos) {
                        SetOutcome::TierChanged if t2 => t2_up += 1,
                        SetOutcome::TierChanged => t2_down += 1,
                        _ => {}
                    },
                    _ => refused += 1,
                }
                continue;
            }
            let outcome = match ps
                .blocks
                .get_mut_or_insert(key, || Holders::one(holder(slot, t2, pos)))
            {
                Some(h) => h.set(arena, slot, t2, pos),
                None => {
                    // A new block of the partition (and so of its tenant).
                    if let Some(f) = fifo.as_mut() {
                        f.push(pid, key);
                        new_blocks += 1;
                    }
                    SetOutcome::Added
                }
            };
            match outcome {
                SetOutcome::Added => {
                    rp.keys.push(key);
                    added += 1;
                    t2_up += usize::from(t2);
                }
                SetOutcome::TierChanged if t2 => t2_up += 1,
                SetOutcome::TierChanged => t2_down += 1,
                SetOutcome::Unchanged => {}
            }
        }
        replica.blocks += added;
        replica.t2_blocks = (replica.t2_blocks + t2_up).saturating_sub(t2_down);
        if refused > 0 {
            let before = replica.effective_coverage().state;
            replica.limited = Some(coverage::STREAM_CAP_EXCEEDED);
            self.coverage_tally.moved(
                &replica.desc,
                Some(before),
                Some(replica.effective_coverage().state),
            );
            self.stream_cap_refusals += refused as u64;
        }
        self.entries += added;
        if new_blocks > 0 {
            let tenant = ps.key.tenant.clone();
            self.enforce_quota(&tenant);
        }
    }

    /// Drops `slot`'s copies of `keys` (in its part `part`); unknown keys are ignored.
    fn remove(&mut self, slot: ReplicaSlot, part: usize, keys: &[u64]) {
        let Some(replica) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        let Some(rp) = replica.parts.get_mut(part) else {
            return;
        };
        let Some(ps) = self.partitions.get_mut(rp.pid as usize) else {
            return;
        };
        let arena = &mut self.arena;
        ps.blocks.prefetch(keys);
        let (mut removed, mut t2_removed) = (0usize, 0usize);
        for &key in keys {
            // Unless it is the one removed, the last key of the replica's vector moves into the
            // hole and its holder learns the new position: fetch its slot too.
            if let Some(&last) = rp.keys.last() {
                ps.blocks.prefetch_key(last);
            }
            let Some(h) = ps.blocks.get_mut(key) else {
                continue;
            };
            let (gone, rest) = h.remove(arena, slot);
            let Some(gone) = gone else {
                continue;
            };
            match rest {
                Some(rest) => *h = rest,
                None => {
                    ps.blocks.remove(key);
                }
            }
            removed += 1;
            t2_removed += usize::from(is_t2(gone));
            // Swap-remove from the replica's key vector; the key moved into the hole learns its
            // new position.
            let pos = pos_of(gone) as usize;
            if pos < rp.keys.len() {
                rp.keys.swap_remove(pos);
                if let Some(&moved) = rp.keys.get(pos) {
                    if let Some(mh) = ps.blocks.get_mut(moved) {
                        mh.set_pos(arena, slot, pos as u32);
                    }
                }
            }
        }
        if rp.keys.capacity() > 4 * rp.keys.len() + 16 {
            rp.keys.shrink_to(2 * rp.keys.len());
        }
        replica.blocks = replica.blocks.saturating_sub(removed);
        replica.t2_blocks = replica.t2_blocks.saturating_sub(t2_removed);
        self.entries = self.entries.saturating_sub(removed);
    }

    fn clear_replica(&mut self, slot: ReplicaSlot) {
        let Some(replica) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        replica.t2_blocks = 0;
        replica.blocks = 0;
        // Nothing is held any more, so nothing the index dropped is missing.
        let before = replica.effective_coverage().state;
        replica.limited = None;
        self.coverage_tally.moved(
            &replica.desc,
            Some(before),
            Some(replica.effective_coverage().state),
        );
        for rp in replica.parts.iter_mut() {
            let Some(ps) = self.partitions.get_mut(rp.pid as usize) else {
                continue;
            };
            ps.blocks.prefetch(&rp.keys);
            for key in std::mem::take(&mut rp.keys) {
                let Some(h) = ps.blocks.get_mut(key) else {
                    continue;
                };
                let (gone, rest) = h.remove(&mut self.arena, slot);
                match rest {
                    Some(rest) => *h = rest,
                    None => {
                        ps.blocks.remove(key);
                    }
                }
                if gone.is_some() {
                    self.entries = self.entries.saturating_sub(1);
                }
            }
        }
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
    /// size) pairs: what the ingest caps count from (`ingest::scope::BlockSizeBudget`,
    /// issue 38 items 4 and 5). O(partitions).
    pub fn registered_block_sizes(&self) -> crate::ingest::scope::Registered {
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
