//! The per-stream state machine: decoded engine events in, index ops out. Pure (no sockets, no
//! clock), so every rule below is unit-tested by feeding batches.
//!
//! One [`StreamState`] per engine publisher (pod × data-parallel rank). It keeps:
//!
//! - **blocks**: `(group, engine hash) → (content key, adapter, block size, media)` for the
//!   indexed KV-cache groups, so parent links and removals (which name engine hashes only) can be
//!   resolved to our content keys;
//! - **held**: per index entry `(adapter, block size, content key)` how many engine blocks hold it
//!   on GPU and on an offload medium. Several engine hashes can map to one content key (the same
//!   tokens under different cache salts, or several full-attention groups), so an entry is
//!   removed only when its last holder goes;
//! - the pending [`KvOp`]s not yet taken by the link, and the per-stream delta sequence.
//!
//! # Rules
//!
//! - **BlockStored** (tokens present): the run's blocks are split at the event's `block_size` (the
//!   plan's when the event says 0); block *i* gets `block_key(key of block i-1, tokens of block
//!   i)`, block 0 chains from the parent's key, or [`ROOT`] when `parent_block_hash` is null.
//!   Medium `GPU` (or none) makes the block held at T1; any other medium (`CPU`, `CPU_PINNED`,
//!   `STORAGE`…) marks an offload copy (T2). An entry's tier is T1 while any holder has it on GPU,
//!   else T2 while any holder has an offload copy. Ops are emitted only on tier transitions, so
//!   duplicate adds are idempotent.
//! - A run whose last block is shorter than the block size (SGLang's partial page, vLLM 0.33's
//!   partial block) or whose block size is below the plan's is tracked for parent links and
//!   removals but not indexed: lookups chunk at the plan's block size and could never match it.
//!   A run with too few or too many tokens for its hashes (hybrid models skipping masked blocks)
//!   is dropped (`token_mismatch`).
//! - **Unknown parent**: the chain cannot be computed, and guessing (e.g. treating the run as a
//!   root) would put wrong keys in the index. The run is *parked* as orphans keyed by the parent
//!   hash and indexed as soon as the parent becomes known (a later store of the parent, or a
//!   replay); descendants of orphans are parked too. Parked blocks are bounded
//!   ([`StreamConfig::max_orphans`], oldest evicted first). So a subscriber that starts late loses
//!   only what it cannot know, and never poisons the index.
//! - **Content-hashed pages** (SGLang ≤ 0.5.5, [`sglang::is_content_hashed`]: one hash per page
//!   content wherever it sits, and no parent on any radix node's first page): a parentless page
//!   is a prompt's first page only while the engine's cache is provably empty (followed from
//!   empty, nothing held); otherwise it and the pages chained to it are not indexed (Partial
//!   `ParentUnknown` until a clear). A parent hash is followed only to the page the event before
//!   stored. A page repeated at another depth is recorded under an alias id of its own; removing
//!   a hash held at several depths removes all of them (Partial `HashCollision`).
//! - **Placeholder BlockStored** (empty `token_ids`, offload connectors): a medium update of blocks
//!   already known; unknown hashes are ignored.
//! - **BlockRemoved**: GPU medium (or none) drops the GPU copy and, when the plan says the pod
//!   keeps an L2 (`keeps_l2`), records an offload copy instead (the entry goes to T2); another
//!   medium drops the offload copy. A block with no copy left is forgotten (its key is kept in a
//!   bounded tombstone list so a child stored later can still chain from it). Removal of an
//!   unknown hash is ignored.
//! - **AllBlocksCleared** is tier-scoped: unscoped or `GPU`, the GPU copies go (with `keeps_l2`
//!   the block stays at T2) and offload copies stay, unless the engine keeps them in its own host
//!   memory (`CPU_PINNED`, SGLang HiCache: a full clear); another medium drops only the offload
//!   copies. When nothing is left, the replica is cleared (one `Clear` op, reason
//!   `AllBlocksCleared`).
//! - **Hybrid models**: only full-prefix groups are indexed — events whose
//!   `kv_cache_spec_kind` is `full_attention`, `mla_attention` or `sink_full_attention`, or, when
//!   the kind is absent, group 0 (or no group). Sliding-window, Mamba, cross-attention groups are
//!   ignored (`other_group`). Chains are keyed by `(group, hash)`, never by bare hash, because the
//!   same hash appears in several groups.
//! - **Sequence numbers** ([`StreamState::check_seq`]): the caller classifies each live message.
//!   `seq = last + 1` is in order; above that is a gap; at or below `last` the engine restarted
//!   (it restarts at 0 and has no epoch). The caller heals gaps by replay and otherwise calls
//!   [`StreamState::mark_gap`] (clear `SequenceGap`, stale) or [`StreamState::restart`] (clear
//!   `EngineRestarted`).
//! - **Stale**: after an unhealed gap the stream is stale until a live batch newer than the one
//!   that revealed the gap is applied; a stale snapshot carries no entries, so leaving the state
//!   re-announces every held entry as `Store` ops to keep deltas and snapshots consistent.
//! - **Back-pressure**: pending ops are bounded ([`StreamConfig::max_pending_keys`]). On overflow
//!   they are discarded and the next delta skips one sequence number, which makes the controller
//!   ask for a resync (a snapshot) — never a silently diverging index.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use ic_shared::kv::content_key::{block_key, ROOT};
use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::kv::decode::{sglang, BlockRemoved, BlockStored, EventBatch, KvEvent};
use ic_shared::proto::{kv_op, BlockEntry, ClearOp, KvOp, RemoveOp, StoreOp, Tier};

/// The medium of SGLang HiCache's host pool (`BlockStored` of a write to host memory): offload
/// copies the engine keeps in its own memory.
pub const MEDIUM_CPU_PINNED: &str = "CPU_PINNED";

/// Clear reason for an engine `AllBlocksCleared` event.
pub const CLEAR_ALL_BLOCKS: &str = "AllBlocksCleared";
/// Clear reason when the engine's sequence went backwards (restart with an empty cache).
pub const CLEAR_ENGINE_RESTARTED: &str = "EngineRestarted";
/// Clear reason for a sequence gap that replay could not heal.
pub const CLEAR_SEQUENCE_GAP: &str = "SequenceGap";
/// Clear reason when the engine reports another data-parallel rank than planned.
pub const CLEAR_RANK_MISMATCH: &str = "RankMismatch";
/// Clear reason when a replay came back with holes and the replica is rebuilt.
pub const CLEAR_REPLAY_TRUNCATED: &str = "ReplayTruncated";
/// Clear reason: a Partial replica is rebuilt from a complete replay of the engine's buffer
/// (from seq 0) — the heal of issue 37 item 5. Not a resync (not counted in `resyncs_total`).
pub const CLEAR_REBUILT: &str = "Rebuilt";

/// What the subscriber knows of the publisher's socket, for [`StreamState::coverage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkState {
    /// Connected (or not yet known to be otherwise).
    #[default]
    Up,
    /// A replay is in flight.
    Healing,
    /// The SUB socket lost its publisher past the grace period.
    Disconnected,
    /// Connected, but the attach verification (an anchored replay proving the engine is the
    /// incarnation whose state is held) has not succeeded yet: not routed
    /// ([`coverage::ATTACH_UNVERIFIED`]), whatever the live sequence numbers say.
    Unverified,
    /// The engine process is known to be gone.
    EngineDown,
}

/// KV-cache spec kinds whose groups keep the whole prefix and are indexed.
pub const INDEXED_KINDS: &[&str] = &["full_attention", "mla_attention", "sink_full_attention"];

/// A stream's state as the agent keeps it on disk across its own restarts (`kv::persist`):
/// everything [`StreamState`] needs to resume where it was, in plain records.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PersistedState {
    /// Last applied engine seq.
    pub last_seq: Option<u64>,
    /// `(seq, xxh3 of the payload)` of the last applied batch: the replay anchor.
    pub last_digest: Option<(u64, u64)>,
    /// Delta seq of the last delta taken.
    pub delta_seq: u64,
    /// Unix ms of the newest applied engine batch.
    pub last_event_unix_ms: i64,
    /// Largest indexed block size seen.
    pub observed_block_size: u32,
    /// Seq of the batch that revealed an unhealed gap, while stale.
    pub stale: Option<u64>,
    /// The incomplete-history coverage reason, if any.
    pub incomplete: Option<String>,
    /// The engine reported another data-parallel rank.
    pub rank_mismatch: bool,
    /// One engine hash named two contents.
    pub collision: bool,
    /// An event or batch could not be read.
    #[serde(default)]
    pub events_lost: bool,
    /// The engine's whole cache has been followed from empty (content-hashed pages may be
    /// placed as prompt roots; see [`StreamState`]'s content-hashed rules).
    #[serde(default)]
    pub tree_known: bool,
    /// Content-hashed pages the engine holds could not be placed (not indexed).
    #[serde(default)]
    pub unplaced: bool,
    /// The engine keeps offload copies in its own host memory (`CPU_PINNED`, SGLang HiCache),
    /// which its cache reset wipes with the GPU tier.
    #[serde(default)]
    pub in_process_host_tier: bool,
    /// Adapter names; blocks refer to them by index.
    pub adapters: Vec<String>,
    /// `(group, engine hash, content key, adapter index or u32::MAX for a partial block, block
    /// size, GPU copies, offload copies)`.
    pub blocks: Vec<(u32, u64, u64, u32, u32, u32, u32)>,
    /// `(group, engine hash, content key)` of forgotten blocks, oldest first.
    pub tombstones: Vec<(u32, u64, u64)>,
    /// Parked blocks, oldest first.
    pub orphans: Vec<PersistedOrphan>,
}

/// A parked block in [`PersistedState`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PersistedOrphan {
    /// `(group, engine hash)`.
    pub id: (u32, u64),
    /// Parent engine hash.
    pub parent: u64,
    /// The block's token ids.
    pub tokens: Vec<u32>,
    /// Adapter index.
    pub adapter: u32,
    /// Block size.
    pub block_size: u32,
    /// Shorter than its block size.
    pub partial: bool,
    /// GPU copies.
    pub gpu: u32,
    /// Offload copies.
    pub offload: u32,
}

/// Limits and plan facts of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// BlockRemoved from GPU demotes to T2 instead of removing (the pod's backend keeps an L2).
    pub keeps_l2: bool,
    /// The engine's configured block size in tokens (plan `blockSize`): used when an event says 0,
    /// and blocks shorter than it are not indexed.
    pub block_size: u32,
    /// Most parked (unknown-parent) blocks kept; the oldest are evicted beyond it.
    pub max_orphans: usize,
    /// Most forgotten blocks whose content key is kept for parent links.
    pub max_tombstones: usize,
    /// Most content keys in pending ops before they are discarded in favour of a resync.
    pub max_pending_keys: usize,
    /// The plan's data-parallel rank: a batch that reports another rank is not indexed
    /// ([`coverage::RANK_MISMATCH`]). `None` accepts any rank.
    pub dp_rank: Option<u32>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            keeps_l2: false,
            block_size: 16,
            max_orphans: 65_536,
            max_tombstones: 65_536,
            max_pending_keys: 1_000_000,
            dp_rank: None,
        }
    }
}

/// How a live message's sequence number relates to what was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// Nothing applied yet in this engine incarnation.
    First,
    /// Exactly one above the last applied sequence number.
    InOrder,
    /// Batches `from..seq` are missing.
    Gap {
        /// First missing sequence number.
        from: u64,
    },
    /// At or below the last applied one: the engine restarted.
    Restarted,
}

/// Counts by bounded reason label.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally(pub Vec<(&'static str, u64)>);

impl Tally {
    /// Adds `n` to `reason`.
    pub fn add(&mut self, reason: &'static str, n: u64) {
        if n == 0 {
            return;
        }
        match self.0.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, c)) => *c += n,
            None => self.0.push((reason, n)),
        }
    }

    /// The count for `reason` (0 when never added).
    pub fn get(&self, reason: &str) -> u64 {
        self.0
            .iter()
            .find(|(r, _)| *r == reason)
            .map(|(_, c)| *c)
            .unwrap_or(0)
    }
}

/// What one [`StreamState::apply`] did, for metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Events applied, by tag (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
    pub events: Tally,
    /// Events or blocks dropped (information lost): `token_mismatch`, `orphan_evicted`, the
    /// decoder's reasons for skipped events, `pending_overflow`.
    pub dropped: Tally,
    /// Events or blocks deliberately ignored: `other_group`, `partial_block`, `unknown_hash`,
    /// `unknown_parent` (parked), `orphan_resolved` (parked blocks indexed later).
    pub ignored: Tally,
}

/// Bounded labels [`ApplyReport::dropped`] can carry (besides the decoder's reasons).
pub const DROP_REASONS: &[&str] = &[
    "token_mismatch",
    "orphan_evicted",
    "pending_overflow",
    "hash_collision",
    "rank_mismatch",
    "seq_unverified",
];
/// Bounded labels [`ApplyReport::ignored`] can carry.
pub const IGNORE_REASONS: &[&str] = &[
    "replayed",
    "other_group",
    "partial_block",
    "unknown_hash",
    "unknown_parent",
    "orphan_resolved",
    // A live frame that arrived while the attach was not yet verified (applied, if it belongs
    // to the incarnation held, by the verifying replay).
    "unverified",
    // A live frame with the seq and the bytes of one already applied (a repeated frame): a
    // duplicate, never an engine restart.
    "duplicate",
];

/// An index entry: what the controller keys a replica's block by (within the stream's tenant,
/// model and hash scheme).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct EntryKey {
    adapter: Arc<str>,
    block_size: u32,
    key: u64,
}

/// How many engine blocks hold an entry, per medium class.
#[derive(Debug, Default, Clone, Copy)]
struct Holders {
    gpu: u32,
    offload: u32,
}

impl Holders {
    fn tier(self) -> Option<Tier> {
        if self.gpu > 0 {
            Some(Tier::T1)
        } else if self.offload > 0 {
            Some(Tier::T2)
        } else {
            None
        }
    }
}

/// An engine block we can key.
#[derive(Debug, Clone)]
struct Block {
    key: u64,
    /// `None` for a partial block (tracked, not indexed).
    entry: Option<EntryKey>,
    /// Physical copies on GPU: vLLM's pool can hold one hash in several blocks, and stores and
    /// removes each, so a removal drops one copy, not the block.
    gpu: u32,
    /// Copies on an offload medium.
    offload: u32,
}

/// A block whose parent's content key is not known yet.
#[derive(Debug, Clone)]
struct Orphan {
    parent: u64,
    tokens: Vec<u32>,
    adapter: Arc<str>,
    block_size: u32,
    partial: bool,
    gpu: u32,
    offload: u32,
}

type BlockId = (u32, u64);

/// Most extra depths one content-hashed page is recorded at ([`alias_id`]).
const MAX_ALIASES: u32 = 64;

/// The record id of the `n`-th (≥ 1) extra depth at which a content-hashed page (SGLang ≤ 0.5.5:
/// one engine hash for one page content wherever it sits) is held: same group, a hash derived
/// from the engine hash and `n`.
fn alias_id((g, h): BlockId, n: u32) -> BlockId {
    (g, block_key(h, &[n, 0x616c_6961]))
}

/// Parent of the next block of a run.
#[derive(Clone, Copy)]
enum ParentRef {
    Known(u64),
    Pending(u64),
}

/// Pending ops, coalescing adjacent ops of the same kind, adapter, block size and tier.
#[derive(Debug, Default)]
struct OpBuffer {
    ops: Vec<KvOp>,
    keys: usize,
    overflowed: bool,
}

impl OpBuffer {
    fn store(&mut self, e: &EntryKey, tier: Tier) {
        self.keys += 1;
        if let Some(KvOp {
            op: Some(kv_op::Op::Store(s)),
        }) = self.ops.last_mut()
        {
            if s.tier == tier as i32 && s.block_size == e.block_size && *s.adapter == *e.adapter {
                s.content_keys.push(e.key);
                return;
            }
        }
        self.ops.push(KvOp {
            op: Some(kv_op::Op::Store(StoreOp {
                adapter: e.adapter.to_string(),
                block_size: e.block_size,
                tier: tier as i32,
                content_keys: vec![e.key],
            })),
        });
    }

    fn remove(&mut self, e: &EntryKey) {
        self.keys += 1;
        if let Some(KvOp {
            op: Some(kv_op::Op::Remove(r)),
        }) = self.ops.last_mut()
        {
            if r.block_size == e.block_size && *r.adapter == *e.adapter {
                r.content_keys.push(e.key);
                return;
            }
        }
        self.ops.push(KvOp {
            op: Some(kv_op::Op::Remove(RemoveOp {
                adapter: e.adapter.to_string(),
                block_size: e.block_size,
                content_keys: vec![e.key],
            })),
        });
    }

    /// A clear supersedes every pending op.
    fn clear(&mut self, reason: &str) {
        self.ops.clear();
        self.keys = 0;
        self.ops.push(KvOp {
            op: Some(kv_op::Op::Clear(ClearOp {
                reason: reason.to_string(),
            })),
        });
    }
}

/// State of one engine event stream. See the module documentation for the rules.
#[derive(Debug)]
pub struct StreamState {
    cfg: StreamConfig,
    blocks: HashMap<BlockId, Block>,
    held: HashMap<EntryKey, Holders>,
    tombstones: HashMap<BlockId, u64>,
    tombstone_order: VecDeque<BlockId>,
    orphans: HashMap<BlockId, Orphan>,
    waiting: HashMap<BlockId, Vec<u64>>,
    orphan_order: VecDeque<BlockId>,
    indexed_groups: BTreeSet<u32>,
    adapters: HashMap<String, Arc<str>>,
    pending: OpBuffer,
    delta_seq: u64,
    last_seq: Option<u64>,
    stale: Option<u64>,
    last_event_unix_ms: i64,
    observed_block_size: u32,
    /// Why blocks of this incarnation are known to be missing (sticky until a clear or
    /// restart makes the engine's state known again).
    incomplete: Option<&'static str>,
    rank_mismatch: bool,
    collision: bool,
    /// An event or batch could not be read (undecodable, skipped by the decoder, tokens that do
    /// not fit their hashes).
    events_lost: bool,
    tail_unverified: bool,
    suspect: bool,
    link: LinkState,
    /// Coverage carried by the last delta or snapshot taken.
    reported: Coverage,
    /// `(seq, xxh3 of the payload)` of the last batch applied: proves on a replay that the
    /// engine is still the incarnation we followed.
    last_digest: Option<(u64, u64)>,
    /// Content-hashed pages (SGLang ≤ 0.5.5, [`sglang::is_content_hashed`]): the engine's whole
    /// cache has been followed from empty (its first batch, or `AllBlocksCleared`), so while
    /// nothing is held a parentless page is provably a prompt's first page.
    tree_known: bool,
    /// Content-hashed pages the engine holds that could not be placed (a parentless page while
    /// other pages are held, and its followers): not indexed, Partial `ParentUnknown` until the
    /// cache is cleared.
    unplaced: bool,
    /// The content-hashed page stored by the event just before (engine id, its key when placed):
    /// the only parent such a page's link can name.
    prev_page: Option<(BlockId, Option<u64>)>,
    /// Offload copies live in the engine's own host memory (a `CPU_PINNED` store was seen:
    /// SGLang HiCache), so an unscoped `AllBlocksCleared` wipes them too.
    in_process_host_tier: bool,
}

impl StreamState {
    /// An empty stream (nothing held, no sequence seen, delta seq 0).
    pub fn new(cfg: StreamConfig) -> Self {
        Self {
            cfg,
            blocks: HashMap::new(),
            held: HashMap::new(),
            tombstones: HashMap::new(),
            tombstone_order: VecDeque::new(),
            orphans: HashMap::new(),
            waiting: HashMap::new(),
            orphan_order: VecDeque::new(),
            indexed_groups: BTreeSet::new(),
            adapters: HashMap::new(),
            pending: OpBuffer::default(),
            delta_seq: 0,
            last_seq: None,
            stale: None,
            last_event_unix_ms: 0,
            observed_block_size: 0,
            incomplete: None,
            rank_mismatch: false,
            collision: false,
            events_lost: false,
            tail_unverified: false,
            suspect: false,
            link: LinkState::Up,
            reported: Coverage::EXACT,
            last_digest: None,
            tree_known: false,
            unplaced: false,
            prev_page: None,
            in_process_host_tier: false,
        }
    }

    /// The stream's coverage now, by precedence: EngineDown, Disconnected (the publisher gone, or
    /// the attach not yet verified: [`LinkState::Unverified`]), Healing, Partial RankMismatch
    /// (nothing indexed), then Stale (EventsDropped, SequenceUnverified, TailUnverified: a
    /// removal may have been missed), then Partial (the incomplete-history reason,
    /// HashCollision, ParentUnknown while blocks are parked), else Exact.
    pub fn coverage(&self) -> Coverage {
        match self.link {
            LinkState::EngineDown => {
                return Coverage::new(CoverageState::EngineDown, coverage::PUBLISHER_DISCONNECTED)
            }
            LinkState::Disconnected => {
                return Coverage::new(
                    CoverageState::Disconnected,
                    coverage::PUBLISHER_DISCONNECTED,
                )
            }
            LinkState::Unverified => {
                return Coverage::new(CoverageState::Disconnected, coverage::ATTACH_UNVERIFIED)
            }
            LinkState::Healing => {
                return Coverage::new(CoverageState::Healing, coverage::REPLAYING)
            }
            LinkState::Up => {}
        }
        let partial = |r| Coverage::new(CoverageState::Partial, r);
        let stale = |r| Coverage::new(CoverageState::Stale, r);
        // What may hold blocks the engine no longer has (a missed removal) is Stale — before
        // any Partial reason, which promises a subset.
        if self.rank_mismatch {
            partial(coverage::RANK_MISMATCH)
        } else if self.events_lost {
            stale(coverage::EVENTS_DROPPED)
        } else if self.suspect {
            stale(coverage::SEQUENCE_UNVERIFIED)
        } else if self.tail_unverified {
            stale(coverage::TAIL_UNVERIFIED)
        } else if let Some(r) = self.incomplete {
            partial(r)
        } else if self.collision {
            partial(coverage::HASH_COLLISION)
        } else if !self.orphans.is_empty() || self.unplaced {
            partial(coverage::PARENT_UNKNOWN)
        } else {
            Coverage::EXACT
        }
    }

    /// The coverage carried by the last delta or snapshot taken.
    pub fn reported_coverage(&self) -> Coverage {
        self.reported
    }

    /// Sets what the subscriber knows of the publisher's socket.
    pub fn set_link(&mut self, link: LinkState) {
        self.link = link;
    }

    /// The subscriber's socket state last set.
    pub fn link(&self) -> LinkState {
        self.link
    }

    /// Records that blocks of this incarnation are missing for `reason` (one of the coverage
    /// reasons; `None` when the engine's state is known again); kept until a clear or restart.
    pub fn set_incomplete(&mut self, reason: Option<&'static str>) {
        self.incomplete = reason;
    }

    /// The incomplete-history reason, if any.
    pub fn incomplete(&self) -> Option<&'static str> {
        self.incomplete
    }

    /// Messages may have been lost after the last one received and no replay could check.
    pub fn set_tail_unverified(&mut self, on: bool) {
        self.tail_unverified = on;
    }

    /// Whether the tail is unverified ([`Self::set_tail_unverified`]).
    pub fn tail_unverified(&self) -> bool {
        self.tail_unverified
    }

    /// A frame with an implausible sequence number is held back, unverified.
    pub fn set_suspect(&mut self, on: bool) {
        self.suspect = on;
    }

    /// Records the payload digest of batch `seq` (just applied or noted undecodable).
    pub fn record_digest(&mut self, seq: u64, digest: u64) {
        self.last_digest = Some((seq, digest));
    }

    /// `(seq, digest)` of the last batch applied in this incarnation.
    pub fn last_digest(&self) -> Option<(u64, u64)> {
        self.last_digest
    }

    /// The state to keep across an agent restart (pending ops are not kept: the controller gets
    /// a full resync when the agent reconnects).
    pub fn to_persisted(&self) -> PersistedState {
        let mut adapters: Vec<String> = Vec::new();
        let mut index: HashMap<Arc<str>, u32> = HashMap::new();
        let mut adapter_ix = |a: &Arc<str>| -> u32 {
            if let Some(i) = index.get(a) {
                return *i;
            }
            let i = adapters.len() as u32;
            adapters.push(a.to_string());
            index.insert(a.clone(), i);
            i
        };
        let blocks = self
            .blocks
            .iter()
            .map(|(&(g, h), b)| {
                let (ai, bs) = match &b.entry {
                    Some(e) => (adapter_ix(&e.adapter), e.block_size),
                    None => (u32::MAX, 0),
                };
                (g, h, b.key, ai, bs, b.gpu, b.offload)
            })
            .collect();
        let orphans = self
            .orphan_order
            .iter()
            .filter_map(|id| {
                let o = self.orphans.get(id)?;
                Some(PersistedOrphan {
                    id: *id,
                    parent: o.parent,
                    tokens: o.tokens.clone(),
                    adapter: adapter_ix(&o.adapter),
                    block_size: o.block_size,
                    partial: o.partial,
                    gpu: o.gpu,
                    offload: o.offload,
                })
            })
            .collect();
        let tombstones = self
            .tombstone_order
            .iter()
            .filter_map(|id| self.tombstones.get(id).map(|k| (id.0, id.1, *k)))
            .collect();
        PersistedState {
            last_seq: self.last_seq,
            last_digest: self.last_digest,
            delta_seq: self.delta_seq,
            last_event_unix_ms: self.last_event_unix_ms,
            observed_block_size: self.observed_block_size,
            stale: self.stale,
            incomplete: self.incomplete.map(str::to_string),
            rank_mismatch: self.rank_mismatch,
            collision: self.collision,
            events_lost: self.events_lost,
            tree_known: self.tree_known,
            unplaced: self.unplaced,
            in_process_host_tier: self.in_process_host_tier,
            adapters,
            blocks,
            tombstones,
            orphans,
        }
    }

    /// Rebuilds a stream from its kept state. `None` when the records contradict each other
    /// (an adapter index out of range, an anchor that is not the last seq): the caller starts
    /// fresh.
    pub fn from_persisted(cfg: StreamConfig, p: PersistedState) -> Option<Self> {
        // The anchor must name the batch the records reflect, or a resume would replay (and
        // count twice) what they already hold.
        if p.last_digest.map(|(seq, _)| seq) != p.last_seq {
            return None;
        }
        let mut st = StreamState::new(cfg);
        let adapters: Vec<Arc<str>> = p.adapters.iter().map(|a| Arc::from(a.as_str())).collect();
        for (name, a) in p.adapters.iter().zip(&adapters) {
            st.adapters.insert(name.clone(), a.clone());
        }
        for (g, h, key, ai, bs, gpu, offload) in p.blocks {
            let entry = if ai == u32::MAX {
                None
            } else {
                Some(EntryKey {
                    adapter: adapters.get(ai as usize)?.clone(),
                    block_size: bs,
                    key,
                })
            };
            if let Some(e) = &entry {
                let hd = st.held.entry(e.clone()).or_default();
                hd.gpu += u32::from(gpu > 0);
                hd.offload += u32::from(offload > 0);
            }
            st.indexed_groups.insert(g);
            st.blocks.insert(
                (g, h),
                Block {
                    key,
                    entry,
                    gpu,
                    offload,
                },
            );
        }
        st.held.retain(|_, h| h.tier().is_some());
        for (g, h, k) in p.tombstones {
            st.indexed_groups.insert(g);
            if st.tombstones.insert((g, h), k).is_none() {
                st.tombstone_order.push_back((g, h));
            }
        }
        for o in p.orphans {
            st.indexed_groups.insert(o.id.0);
            let adapter = adapters.get(o.adapter as usize)?.clone();
            let parent = (o.id.0, o.parent);
            if st
                .orphans
                .insert(
                    o.id,
                    Orphan {
                        parent: o.parent,
                        tokens: o.tokens,
                        adapter,
                        block_size: o.block_size,
                        partial: o.partial,
                        gpu: o.gpu,
                        offload: o.offload,
                    },
                )
                .is_none()
            {
                st.orphan_order.push_back(o.id);
                st.waiting.entry(parent).or_default().push(o.id.1);
            }
        }
        st.last_seq = p.last_seq;
        st.last_digest = p.last_digest;
        st.delta_seq = p.delta_seq;
        st.last_event_unix_ms = p.last_event_unix_ms;
        st.observed_block_size = p.observed_block_size;
        st.stale = p.stale;
        st.incomplete = p
            .incomplete
            .as_deref()
            .and_then(|r| coverage::REASONS.iter().copied().find(|x| *x == r));
        st.rank_mismatch = p.rank_mismatch;
        st.collision = p.collision;
        st.events_lost = p.events_lost;
        st.tree_known = p.tree_known;
        st.unplaced = p.unplaced;
        st.in_process_host_tier = p.in_process_host_tier;
        Some(st)
    }

    /// Classifies a live message's engine sequence number (does not change state).
    pub fn check_seq(&self, seq: u64) -> SeqCheck {
        match self.last_seq {
            None => SeqCheck::First,
            Some(last) if Some(seq) == last.checked_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap { from: last + 1 },
            Some(_) => SeqCheck::Restarted,
        }
    }

    /// Last applied engine sequence number of this incarnation.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// True while the state is uncertain after an unhealed gap.
    pub fn is_stale(&self) -> bool {
        self.stale.is_some()
    }

    /// Index entries currently held (at any tier).
    pub fn blocks_held(&self) -> usize {
        self.held.len()
    }

    /// Blocks parked for an unknown parent.
    pub fn orphans(&self) -> usize {
        self.orphans.len()
    }

    /// Largest block size seen on this stream's indexed events (0 before any).
    pub fn observed_block_size(&self) -> u32 {
        self.observed_block_size
    }

    /// Unix ms of the newest applied engine batch (0 before any).
    pub fn last_event_unix_ms(&self) -> i64 {
        self.last_event_unix_ms
    }

    /// The delta sequence number of the last delta taken (or snapshot).
    pub fn delta_seq(&self) -> u64 {
        self.delta_seq
    }

    /// Keys (stored or removed blocks) in the pending ops.
    pub fn pending_keys(&self) -> usize {
        self.pending.keys
    }

    /// True when ops or a coverage change wait to be taken ([`Self::take_delta`]).
    pub fn has_pending(&self) -> bool {
        !self.pending.ops.is_empty() || self.pending.overflowed || self.coverage() != self.reported
    }

    /// Continues the delta numbering of a replaced stream of the same id whose last delta seq was
    /// `prev`: the first delta taken skips one number, so the controller sees a gap and asks for a
    /// resync instead of applying new deltas on top of the old stream's entries.
    pub fn continue_after(&mut self, prev: u64) {
        self.delta_seq = prev;
        self.pending.overflowed = true;
    }

    /// Records that batch `seq` arrived but could not be decoded: the sequence advances, nothing
    /// else changes.
    pub fn note_undecodable(&mut self, seq: u64) {
        // Whatever the batch said is lost — a removal among it would leave a block indexed that
        // the engine no longer holds.
        self.events_lost = true;
        self.last_seq = Some(seq);
    }

    /// Clears the replica: one `Clear` op with `reason` replaces all pending ops, and every block,
    /// orphan and tombstone is forgotten. The sequence position is kept.
    pub fn clear(&mut self, reason: &'static str) {
        self.blocks.clear();
        self.held.clear();
        self.tombstones.clear();
        self.tombstone_order.clear();
        self.orphans.clear();
        self.waiting.clear();
        self.orphan_order.clear();
        self.pending.clear(reason);
        // The engine's state is known again (empty, or rebuilt by the caller, who marks what it
        // cannot know).
        self.incomplete = None;
        self.collision = false;
        self.events_lost = false;
        self.tail_unverified = false;
        // Only an engine's own reset says its cache is empty; other clears say we do not know it.
        self.tree_known = reason == CLEAR_ALL_BLOCKS;
        self.unplaced = false;
        self.prev_page = None;
    }

    /// The engine restarted with an empty cache: clear (`EngineRestarted`) and forget the
    /// sequence position, so the next message is [`SeqCheck::First`].
    pub fn restart(&mut self) {
        self.clear(CLEAR_ENGINE_RESTARTED);
        self.last_seq = None;
        self.stale = None;
        self.last_digest = None;
        self.rank_mismatch = false;
        self.suspect = false;
    }

    /// Starts over before a rebuild from a complete replay of the engine's buffer (from seq 0):
    /// clears with `reason` and forgets the sequence position, the anchor, the stale mark and
    /// every incomplete-history fact, since the replay about to be applied describes the
    /// engine's whole cache.
    pub fn start_over(&mut self, reason: &'static str) {
        self.clear(reason);
        self.last_seq = None;
        self.stale = None;
        self.last_digest = None;
        self.rank_mismatch = false;
        self.suspect = false;
    }

    /// A gap could not be healed: clear (`SequenceGap`) and stay stale until a live batch newer
    /// than `seq` (the one that revealed the gap) is applied.
    pub fn mark_gap(&mut self, seq: u64) {
        self.clear(CLEAR_SEQUENCE_GAP);
        self.stale = Some(seq);
        self.incomplete = Some(coverage::SEQUENCE_GAP);
    }

    /// Applies batch `seq`. `now_unix_ms` stands in for a missing or absurd engine timestamp.
    pub fn apply(&mut self, seq: u64, batch: &EventBatch, now_unix_ms: i64) -> ApplyReport {
        let mut report = ApplyReport::default();
        if self.last_seq.is_none() && seq == 0 {
            // A fresh engine's first batch: its cache starts empty.
            self.tree_known = true;
        }
        self.prev_page = None;
        self.last_seq = Some(seq);
        self.last_event_unix_ms = if batch.ts.is_finite() && batch.ts > 0.0 && batch.ts < 1.0e11 {
            (batch.ts * 1000.0) as i64
        } else {
            now_unix_ms
        };
        if let (Some(got), Some(planned)) = (batch.data_parallel_rank, self.cfg.dp_rank) {
            if got != planned {
                // Never index a stream under a rank it does not report.
                if !self.rank_mismatch {
                    self.clear(CLEAR_RANK_MISMATCH);
                    self.rank_mismatch = true;
                }
                report.dropped.add("rank_mismatch", 1);
                return report;
            }
        }
        for s in &batch.skipped {
            report.dropped.add(s.error.reason(), 1);
            self.events_lost = true;
        }
        for ev in &batch.events {
            report.events.add(ev.tag(), 1);
            match ev {
                KvEvent::BlockStored(s) => self.on_stored(s, &mut report),
                KvEvent::BlockRemoved(r) => {
                    self.prev_page = None;
                    self.on_removed(r, &mut report)
                }
                KvEvent::AllBlocksCleared { medium } => {
                    self.on_cleared(medium.as_deref(), &mut report)
                }
            }
        }
        if let Some(gap_seq) = self.stale {
            if seq > gap_seq {
                self.stale = None;
                let entries: Vec<(EntryKey, Tier)> = self
                    .held
                    .iter()
                    .filter_map(|(e, h)| h.tier().map(|t| (e.clone(), t)))
                    .collect();
                for (e, t) in entries {
                    self.push_store(&e, t, &mut report);
                }
            }
        }
        report
    }

    /// Takes the pending ops as the next delta: `(delta seq, ops, last event unix ms)`, or `None`
    /// when nothing is pending. After an overflow the seq skips one number (see module docs).
    pub fn take_delta(&mut self) -> Option<(u64, Vec<KvOp>, i64)> {
        if !self.has_pending() {
            return None;
        }
        if self.pending.overflowed {
            self.delta_seq += 1;
        }
        self.delta_seq += 1;
        let ops = std::mem::take(&mut self.pending.ops);
        self.pending = OpBuffer::default();
        self.reported = self.coverage();
        Some((self.delta_seq, ops, self.last_event_unix_ms))
    }

    /// Full state: `(delta seq, entries, stale)`. Pending ops are discarded (the snapshot includes
    /// them); deltas taken afterwards continue at seq + 1. A stale stream has no entries.
    pub fn snapshot(&mut self) -> (u64, Vec<BlockEntry>, bool) {
        self.pending = OpBuffer::default();
        self.reported = self.coverage();
        let entries = if self.stale.is_some() {
            Vec::new()
        } else {
            let mut v: Vec<BlockEntry> = self
                .held
                .iter()
                .filter_map(|(e, h)| {
                    h.tier().map(|t| BlockEntry {
                        adapter: e.adapter.to_string(),
                        block_size: e.block_size,
                        content_key: e.key,
                        tier: t as i32,
                    })
                })
                .collect();
            v.sort_by(|a, b| {
                (&a.adapter, a.block_size, a.content_key).cmp(&(
                    &b.adapter,
                    b.block_size,
                    b.content_key,
                ))
            });
            v
        };
        (self.delta_seq, entries, self.stale.is_some())
    }

    fn adapter(&mut self, s: &BlockStored) -> Arc<str> {
        let name = match (&s.lora_name, s.lora_id) {
            (Some(n), _) => n.clone(),
            (None, Some(id)) => id.to_string(),
            (None, None) => String::new(),
        };
        if let Some(a) = self.adapters.get(&name) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(name.as_str());
        if self.adapters.len() < 1024 {
            self.adapters.insert(name, a.clone());
        }
        a
    }

    /// Groups a removal or placeholder without `group_idx` may refer to.
    fn groups_for(&self, group: Option<u32>) -> Vec<u32> {
        match group {
            Some(g) => vec![g],
            None if self.indexed_groups.is_empty() => vec![0],
            None => self.indexed_groups.iter().copied().collect(),
        }
    }

    /// Why a hash named by a removal or placeholder was not found: its group is not indexed, or
    /// the block is unknown.
    fn miss_reason(&self, group: Option<u32>) -> &'static str {
        match group {
            Some(g) if !self.indexed_groups.is_empty() && !self.indexed_groups.contains(&g) => {
                "other_group"
            }
            _ => "unknown_hash",
        }
    }

    fn on_stored(&mut self, s: &BlockStored, report: &mut ApplyReport) {
        let gpu_medium = is_gpu(s.medium.as_deref());
        if s.medium.as_deref() == Some(MEDIUM_CPU_PINNED) {
            self.in_process_host_tier = true;
        }
        if s.token_ids.is_empty() {
            // Placeholder: medium update of known blocks (of any indexed group; placeholders
            // may lack the kind).
            for h in &s.block_hashes {
                let mut found = false;
                for g in self.groups_for(s.group_idx) {
                    let id = (g, *h);
                    if self.blocks.contains_key(&id) || self.orphans.contains_key(&id) {
                        found = true;
                        self.update_media(id, report, |gpu, off| {
                            if gpu_medium {
                                *gpu += 1;
                            } else {
                                *off += 1;
                            }
                        });
                    }
                }
                if !found {
                    report.ignored.add(self.miss_reason(s.group_idx), 1);
                }
            }
            return;
        }
        if !indexed(s) {
            report.ignored.add("other_group", 1);
            return;
        }
        let g = s.group_idx.unwrap_or(0);
        self.indexed_groups.insert(g);
        let bs = if s.block_size > 0 {
            s.block_size
        } else {
            self.cfg.block_size
        };
        let Some(slices) = split_blocks(s.block_hashes.len(), &s.token_ids, bs as usize) else {
            report.dropped.add("token_mismatch", 1);
            self.events_lost = true;
            return;
        };
        let adapter = self.adapter(s);
        let content_hashed = sglang::is_content_hashed(s);
        let placed = if content_hashed {
            let Some(k) = self.content_hashed_parent(g, s.parent_block_hash) else {
                // Its position is unknowable: never a prompt root, never under a guessed parent.
                self.unplaced = true;
                self.prev_page = s.block_hashes.last().map(|h| ((g, *h), None));
                report
                    .ignored
                    .add("unknown_parent", s.block_hashes.len() as u64);
                return;
            };
            Some(k)
        } else {
            None
        };
        let mut parent = match s.parent_block_hash {
            _ if placed.is_some() => ParentRef::Known(placed.unwrap_or(ROOT)),
            None => ParentRef::Known(ROOT),
            Some(p) => {
                if let Some(b) = self.blocks.get(&(g, p)) {
                    ParentRef::Known(b.key)
                } else if let Some(k) = self.tombstones.get(&(g, p)) {
                    ParentRef::Known(*k)
                } else {
                    if !self.orphans.contains_key(&(g, p)) {
                        report.ignored.add("unknown_parent", 1);
                    }
                    ParentRef::Pending(p)
                }
            }
        };
        let (gpu, offload) = (u32::from(gpu_medium), u32::from(!gpu_medium));
        for (h, toks) in s.block_hashes.iter().zip(slices) {
            let id = (g, *h);
            let partial = toks.len() < bs as usize || bs < self.cfg.block_size;
            if partial {
                report.ignored.add("partial_block", 1);
            } else {
                self.observed_block_size = self.observed_block_size.max(bs);
            }
            match parent {
                ParentRef::Known(pk) => {
                    let key = block_key(pk, toks);
                    let entry = (!partial).then(|| EntryKey {
                        adapter: adapter.clone(),
                        block_size: bs,
                        key,
                    });
                    if content_hashed {
                        // The same page content at another depth has the same engine hash: each
                        // position gets its own record, the link names the page just stored.
                        let at = self.position_id(id, key);
                        self.store_block(at, key, entry, gpu, offload, report);
                        self.prev_page = Some((id, Some(key)));
                    } else {
                        self.store_block(id, key, entry, gpu, offload, report);
                        self.resolve_waiting(id, key, report);
                    }
                    parent = ParentRef::Known(key);
                }
                ParentRef::Pending(ph) => {
                    if let Some(b) = self.blocks.get(&id) {
                        // Known already (e.g. a duplicate store): its key anchors the rest.
                        let key = b.key;
                        self.update_media(id, report, |g_, o_| {
                            *g_ += gpu;
                            *o_ += offload;
                        });
                        parent = ParentRef::Known(key);
                    } else {
                        self.park(
                            id,
                            Orphan {
                                parent: ph,
                                tokens: toks.to_vec(),
                                adapter: adapter.clone(),
                                block_size: bs,
                                partial,
                                gpu,
                                offload,
                            },
                            report,
                        );
                        parent = ParentRef::Pending(*h);
                    }
                }
            }
        }
    }

    /// `AllBlocksCleared`, scoped to the tier `medium` names (issue 39 item 12):
    ///
    /// - unscoped or `GPU`: the engine's GPU cache was reset. Every GPU copy goes; with the
    ///   plan's `keeps_l2` the block keeps an offload copy (the L2 still holds it, as for a GPU
    ///   `BlockRemoved`); offload copies from events stay (the reset does not reach an offload
    ///   tier) — except when the engine keeps them in its own host memory
    ///   ([`MEDIUM_CPU_PINNED`], SGLang HiCache, whose reset clears it too): a full clear;
    /// - another medium: only offload copies go; GPU copies stay.
    ///
    /// Entries move by ordinary ops (`Store` T2, `Remove`); when nothing is left the replica is
    /// cleared (one `Clear` op) and its state is known again.
    fn on_cleared(&mut self, medium: Option<&str>, report: &mut ApplyReport) {
        let gpu_tier = is_gpu(medium);
        self.prev_page = None;
        if gpu_tier && self.in_process_host_tier && medium.is_none() {
            self.clear(CLEAR_ALL_BLOCKS);
            return;
        }
        let keeps_l2 = self.cfg.keeps_l2;
        let ids: Vec<BlockId> = self
            .blocks
            .keys()
            .chain(self.orphans.keys())
            .copied()
            .collect();
        for id in ids {
            self.update_media(id, report, |gpu, off| {
                if gpu_tier {
                    if *gpu > 0 {
                        *gpu = 0;
                        if keeps_l2 {
                            *off = (*off).max(1);
                        }
                    }
                } else {
                    *off = 0;
                }
            });
        }
        if self.blocks.is_empty() && self.orphans.is_empty() {
            self.clear(CLEAR_ALL_BLOCKS);
        }
    }

    fn on_removed(&mut self, r: &BlockRemoved, report: &mut ApplyReport) {
        let gpu_medium = is_gpu(r.medium.as_deref());
        let keeps_l2 = self.cfg.keeps_l2;
        for h in &r.block_hashes {
            let mut found = false;
            for g in self.groups_for(r.group_idx) {
                // A content-hashed page held at several depths: which one went is unknowable,
                // so every position goes (a subset, never a guess) and the stream says so.
                let ids = self.positions_of((g, *h));
                if ids.len() > 1 {
                    self.collision = true;
                }
                for id in ids {
                    found = true;
                    // One physical copy goes per removal (the engine's pool counts copies).
                    self.update_media(id, report, |gpu, off| {
                        if gpu_medium {
                            if *gpu > 0 {
                                *gpu -= 1;
                                if *gpu == 0 && keeps_l2 {
                                    *off = (*off).max(1);
                                }
                            }
                        } else {
                            *off = off.saturating_sub(1);
                        }
                    });
                }
            }
            if !found {
                report.ignored.add(self.miss_reason(r.group_idx), 1);
            }
        }
    }

    /// The content key a content-hashed page (SGLang ≤ 0.5.5) chains from, or `None` when its
    /// position cannot be known: a `None` parent is a prompt's first page only while the engine's
    /// cache is provably empty (followed from empty, nothing held, nothing unplaced or lost);
    /// a parent hash counts only when it names the page the event before stored (the engine
    /// sends a node's pages in order, and the same hash may name that content at other depths).
    fn content_hashed_parent(&self, g: u32, parent: Option<u64>) -> Option<u64> {
        match parent {
            None => (self.tree_known
                && !self.unplaced
                && !self.events_lost
                && self.incomplete.is_none()
                && self.stale.is_none()
                && self.blocks.is_empty()
                && self.orphans.is_empty())
            .then_some(ROOT),
            Some(p) => match self.prev_page {
                Some((id, key)) if id == (g, p) => key,
                _ => None,
            },
        }
    }

    /// Where a content-hashed page with engine id `id` and content key `key` is recorded: `id`
    /// itself unless that holds another content, else the first alias id
    /// ([`alias_id`]) that is free or holds `key`.
    fn position_id(&self, id: BlockId, key: u64) -> BlockId {
        let mut at = id;
        let mut n = 0u32;
        while let Some(b) = self.blocks.get(&at) {
            if b.key == key || n >= MAX_ALIASES {
                break;
            }
            n += 1;
            at = alias_id(id, n);
        }
        at
    }

    /// The records of engine id `id`: itself (when known) and its alias ids in use.
    fn positions_of(&self, id: BlockId) -> Vec<BlockId> {
        let mut out = Vec::new();
        if self.blocks.contains_key(&id) || self.orphans.contains_key(&id) {
            out.push(id);
        }
        let mut n = 1u32;
        while n <= MAX_ALIASES && self.blocks.contains_key(&alias_id(id, n)) {
            out.push(alias_id(id, n));
            n += 1;
        }
        out
    }

    /// Inserts or replaces a keyed block, moving its holder counts. A store of a hash already
    /// held with the same content adds its copies (a second physical block); one with another
    /// content (an engine that hashes pages by content alone) replaces the old entry and marks
    /// the stream Partial ([`coverage::HASH_COLLISION`]): which copy a later removal means is
    /// unknowable, so the older entry is dropped rather than guessed.
    fn store_block(
        &mut self,
        id: BlockId,
        key: u64,
        entry: Option<EntryKey>,
        gpu: u32,
        offload: u32,
        report: &mut ApplyReport,
    ) {
        self.drop_orphan(id);
        let (gpu, offload) = match self.blocks.get(&id) {
            Some(old) if old.key == key && old.entry == entry => (
                old.gpu.saturating_add(gpu),
                old.offload.saturating_add(offload),
            ),
            Some(old) if old.key != key => {
                self.collision = true;
                report.dropped.add("hash_collision", 1);
                (gpu, offload)
            }
            _ => (gpu, offload),
        };
        let old = self.blocks.remove(&id);
        match (old.as_ref().and_then(|o| o.entry.clone()), &entry) {
            (Some(oe), Some(ne)) if oe == *ne => {
                let (og, oo) = old.as_ref().map(|o| (o.gpu, o.offload)).unwrap_or_default();
                self.adjust(ne, has(gpu) - has(og), has(offload) - has(oo), report);
            }
            (oe, ne) => {
                if let (Some(oe), Some(o)) = (oe, old.as_ref()) {
                    self.adjust(&oe, -has(o.gpu), -has(o.offload), report);
                }
                if let Some(ne) = ne {
                    self.adjust(ne, has(gpu), has(offload), report);
                }
            }
        }
        self.blocks.insert(
            id,
            Block {
                key,
                entry,
                gpu,
                offload,
            },
        );
    }

    /// Changes the media of a known block or orphan; forgets it when no copy is left.
    fn update_media(
        &mut self,
        id: BlockId,
        report: &mut ApplyReport,
        f: impl FnOnce(&mut u32, &mut u32),
    ) {
        if let Some(o) = self.orphans.get_mut(&id) {
            f(&mut o.gpu, &mut o.offload);
            if o.gpu == 0 && o.offload == 0 {
                self.drop_orphan(id);
            }
            return;
        }
        let Some(b) = self.blocks.get(&id) else {
            return;
        };
        let (old_gpu, old_off) = (b.gpu, b.offload);
        let (mut gpu, mut off) = (old_gpu, old_off);
        f(&mut gpu, &mut off);
        if (gpu, off) == (old_gpu, old_off) {
            return;
        }
        let entry = b.entry.clone();
        let key = b.key;
        if let Some(e) = &entry {
            self.adjust(e, has(gpu) - has(old_gpu), has(off) - has(old_off), report);
        }
        if gpu > 0 || off > 0 {
            if let Some(b) = self.blocks.get_mut(&id) {
                b.gpu = gpu;
                b.offload = off;
            }
        } else {
            self.blocks.remove(&id);
            self.tombstone(id, key);
        }
    }

    /// Moves an entry's holder counts by `dgpu` / `doff` (each -1, 0 or 1) in one step and emits
    /// an op when the entry's tier changes.
    fn adjust(&mut self, e: &EntryKey, dgpu: i32, doff: i32, report: &mut ApplyReport) {
        if dgpu == 0 && doff == 0 {
            return;
        }
        let h = self.held.entry(e.clone()).or_default();
        let before = h.tier();
        let step = |n: u32, d: i32| -> u32 {
            match d.signum() {
                1 => n.saturating_add(1),
                -1 => n.saturating_sub(1),
                _ => n,
            }
        };
        h.gpu = step(h.gpu, dgpu);
        h.offload = step(h.offload, doff);
        let after = h.tier();
        if after.is_none() {
            self.held.remove(e);
        }
        if before != after {
            match after {
                Some(t) => self.push_store(e, t, report),
                None => {
                    self.pending.remove(e);
                    self.check_overflow(report);
                }
            }
        }
    }

    fn push_store(&mut self, e: &EntryKey, t: Tier, report: &mut ApplyReport) {
        self.pending.store(e, t);
        self.check_overflow(report);
    }

    fn check_overflow(&mut self, report: &mut ApplyReport) {
        if self.pending.keys > self.cfg.max_pending_keys {
            self.pending.ops.clear();
            self.pending.keys = 0;
            self.pending.overflowed = true;
            report.dropped.add("pending_overflow", 1);
        }
    }

    fn tombstone(&mut self, id: BlockId, key: u64) {
        if self.cfg.max_tombstones == 0 {
            return;
        }
        if self.tombstones.insert(id, key).is_none() {
            self.tombstone_order.push_back(id);
        }
        while self.tombstones.len() > self.cfg.max_tombstones {
            match self.tombstone_order.pop_front() {
                Some(old) => {
                    self.tombstones.remove(&old);
                }
                None => break,
            }
        }
    }

    fn park(&mut self, id: BlockId, o: Orphan, report: &mut ApplyReport) {
        let parent = (id.0, o.parent);
        if self.orphans.insert(id, o).is_none() {
            self.orphan_order.push_back(id);
            self.waiting.entry(parent).or_default().push(id.1);
        }
        while self.orphans.len() > self.cfg.max_orphans {
            let Some(old) = self.orphan_order.pop_front() else {
                break;
            };
            if self.orphans.contains_key(&old) {
                self.drop_orphan(old);
                report.dropped.add("orphan_evicted", 1);
            }
        }
    }

    fn drop_orphan(&mut self, id: BlockId) {
        if let Some(o) = self.orphans.remove(&id) {
            let parent = (id.0, o.parent);
            if let Some(list) = self.waiting.get_mut(&parent) {
                list.retain(|c| *c != id.1);
                if list.is_empty() {
                    self.waiting.remove(&parent);
                }
            }
        }
    }

    /// Indexes every parked descendant of a block whose key just became known.
    fn resolve_waiting(&mut self, id: BlockId, key: u64, report: &mut ApplyReport) {
        let mut stack = vec![(id, key)];
        while let Some((pid, pkey)) = stack.pop() {
            let Some(children) = self.waiting.remove(&pid) else {
                continue;
            };
            for c in children {
                let cid = (pid.0, c);
                let Some(o) = self.orphans.remove(&cid) else {
                    continue;
                };
                let ckey = block_key(pkey, &o.tokens);
                let entry = (!o.partial).then(|| EntryKey {
                    adapter: o.adapter.clone(),
                    block_size: o.block_size,
                    key: ckey,
                });
                self.store_block(cid, ckey, entry, o.gpu, o.offload, report);
                report.ignored.add("orphan_resolved", 1);
                stack.push((cid, ckey));
            }
        }
    }
}

/// 1 when at least one copy is held.
fn has(copies: u32) -> i32 {
    i32::from(copies > 0)
}

/// Medium `None` or `GPU…` (any case) is the engine's HBM.
fn is_gpu(medium: Option<&str>) -> bool {
    match medium {
        None => true,
        Some(m) => m.len() >= 3 && m[..3].eq_ignore_ascii_case("gpu"),
    }
}

/// Whether a stored event's group is indexed (see module docs).
fn indexed(s: &BlockStored) -> bool {
    match s.kv_cache_spec_kind.as_deref() {
        Some(kind) => INDEXED_KINDS.contains(&kind),
        None => s.group_idx.unwrap_or(0) == 0,
    }
}

/// Splits a run's tokens into one slice per hash: all full except possibly the last (partial).
/// `None` when the token count cannot belong to `n` blocks of `bs`.
fn split_blocks(n: usize, tokens: &[u32], bs: usize) -> Option<Vec<&[u32]>> {
    if n == 0 {
        return Some(Vec::new());
    }
    if bs == 0 {
        return None;
    }
    let full = (n - 1).checked_mul(bs)?;
    let rem = tokens.len().checked_sub(full)?;
    if rem == 0 || rem > bs {
        return None;
    }
    let mut out: Vec<&[u32]> = tokens[..full].chunks_exact(bs).collect();
    out.push(&tokens[full..]);
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::kv::content_key::chain;

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
        let mk = |group: u32,
                  kind: &str,
                  hashes: &[u64],
                  parent: Option<u64>,
                  t: std::ops::Range<u32>| {
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

    #[test]
    fn split_blocks_rules() {
        let t: Vec<u32> = (0..36).collect();
        assert_eq!(split_blocks(3, &t, 16).map(|v| v.len()), Some(3));
        assert_eq!(split_blocks(2, &t, 16), None);
        assert_eq!(split_blocks(4, &t, 16), None);
        assert_eq!(split_blocks(0, &t, 16).map(|v| v.len()), Some(0));
        assert_eq!(split_blocks(1, &t, 0), None);
    }
}
