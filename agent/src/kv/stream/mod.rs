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
//!   tombstone list, bounded by a quarter of the blocks held and at least 4 096, so a child
//!   stored just after its parent was evicted can still chain from it). Removal of an
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
//!
//! # Files
//!
//! - this file: the stream's vocabulary (config, sequence checks, reports, clear reasons) and
//!   [`StreamState`]'s lifecycle: apply a batch, classify sequence numbers, clear, coverage;
//! - [`blocks`]: block events (BlockStored, BlockRemoved, AllBlocksCleared) to holder counts and
//!   tier transitions;
//! - [`orphans`]: runs whose parent is not known yet (parked) and forgotten blocks' keys
//!   (tombstones);
//! - [`sglang_pages`]: where a content-hashed page (SGLang ≤ 0.5.5) sits in the radix tree;
//! - [`ops`]: the pending ops handed to the link — coalesced, bounded, taken as deltas or
//!   snapshots;
//! - [`persisted`]: the state kept on disk across agent restarts
//!   ([`persisted::PersistedState`]).
//!
//! [`KvOp`]: ic_shared::proto::KvOp
//! [`ROOT`]: ic_shared::kv::content_key::ROOT
//! [`sglang::is_content_hashed`]: ic_shared::kv::decode::sglang::is_content_hashed

mod blocks;
mod ops;
mod orphans;
pub mod persisted;
mod sglang_pages;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use ops::OpBuffer;

use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::kv::decode::{EventBatch, KvEvent};
use ic_shared::proto::Tier;

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
    /// Most forgotten blocks whose content key is kept for parent links; a stream keeps at
    /// most a quarter of the blocks it holds (at least 4 096) below this.
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
/// model and hash scheme): the entry class (adapter and block size, looked up in the stream's
/// [`Classes`]) and the content key. 16 bytes, no reference count to move per store or removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct EntryKey {
    class: u32,
    key: u64,
}

/// [`Block::class`] of a partial block (tracked for parent links and removals, not indexed).
const PARTIAL: u32 = u32::MAX;

/// Fewest classes a stream keeps before it looks for unused ones ([`Classes::collect`]).
const CLASSES_COLLECT_AT: usize = 1024;

/// The stream's entry classes, `(adapter, block size in tokens)`, numbered: [`EntryKey::class`]
/// and [`Block::class`] index `list`. Unused numbers are found and reused by
/// [`StreamState::collect_classes`] (between batches, once the table reaches `collect_at`), so a
/// publisher naming ever new adapters cannot grow it past what its held blocks use.
#[derive(Debug)]
struct Classes {
    list: Vec<(Arc<str>, u32)>,
    index: HashMap<(Arc<str>, u32), u32>,
    free: Vec<u32>,
    collect_at: usize,
}

impl Default for Classes {
    fn default() -> Self {
        Self {
            list: Vec::new(),
            index: HashMap::new(),
            free: Vec::new(),
            collect_at: CLASSES_COLLECT_AT,
        }
    }
}

impl Classes {
    /// The number of `(adapter, block_size)`, given one if new.
    fn of(&mut self, adapter: &Arc<str>, block_size: u32) -> u32 {
        let k = (adapter.clone(), block_size);
        if let Some(c) = self.index.get(&k) {
            return *c;
        }
        let c = match self.free.pop() {
            Some(c) => {
                if let Some(slot) = self.list.get_mut(c as usize) {
                    *slot = k.clone();
                }
                c
            }
            None => {
                self.list.push(k.clone());
                (self.list.len() - 1) as u32
            }
        };
        self.index.insert(k, c);
        c
    }

    /// `(adapter, block size)` of class `c` (`None` for [`PARTIAL`] or a number never given).
    fn get(&self, c: u32) -> Option<(&str, u32)> {
        self.list.get(c as usize).map(|(a, bs)| (&**a, *bs))
    }
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

/// An engine block we can key (32 bytes).
#[derive(Debug, Clone, Copy)]
struct Block {
    key: u64,
    /// The entry class ([`Classes`]); [`PARTIAL`] for a partial block (tracked, not indexed).
    class: u32,
    /// Physical copies on GPU: vLLM's pool can hold one hash in several blocks, and stores and
    /// removes each, so a removal drops one copy, not the block. Saturates at `u16::MAX`.
    gpu: u16,
    /// Copies on an offload medium (saturates at `u16::MAX`).
    offload: u16,
}

impl Block {
    /// The index entry the block holds (`None` when partial).
    fn entry(&self) -> Option<EntryKey> {
        (self.class != PARTIAL).then_some(EntryKey {
            class: self.class,
            key: self.key,
        })
    }
}

/// Before an insert into a table with no room left: rebuilds it clean at the size its entries
/// need (plus an eighth), instead of letting the insert grow it. Under churn, removals leave
/// removed-slot markers that count against the table's room, and the standard table rehashes in
/// place only below half load and doubles above it — so a churning table of a steady size
/// would settle at 2–4.6 slots per entry (issue 41 item 5). The rebuild costs what a growth
/// costs, at most once per eighth of the entries inserted.
fn make_room<K: Eq + std::hash::Hash, V>(m: &mut HashMap<K, V>) {
    if m.len() < m.capacity() || m.len() < 64 {
        return;
    }
    let old = std::mem::take(m);
    let need = old.len() + old.len() / 8 + 1;
    let mut fresh = HashMap::with_capacity_and_hasher(need, old.hasher().clone());
    fresh.extend(old);
    *m = fresh;
}

/// A copy count as kept in a [`Block`] (saturating).
fn copies(n: u32) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
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
    classes: Classes,
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
    /// Content-hashed pages (SGLang ≤ 0.5.5, [`is_content_hashed`]): the engine's whole
    /// cache has been followed from empty (its first batch, or `AllBlocksCleared`), so while
    /// nothing is held a parentless page is provably a prompt's first page.
    ///
    /// [`is_content_hashed`]: ic_shared::kv::decode::sglang::is_content_hashed
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
            classes: Classes::default(),
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
        self.classes = Classes::default();
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
        if self.classes.index.len() >= self.classes.collect_at {
            self.collect_classes();
        }
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
                    .filter_map(|(e, h)| h.tier().map(|t| (*e, t)))
                    .collect();
                for (e, t) in entries {
                    self.push_store(&e, t, &mut report);
                }
            }
        }
        report
    }

    /// Frees the class numbers no held block or entry uses (they are given again by
    /// [`Classes::of`]); the next collection waits until the table is twice what is in use.
    fn collect_classes(&mut self) {
        let used: std::collections::HashSet<u32> = self
            .blocks
            .values()
            .map(|b| b.class)
            .chain(self.held.keys().map(|e| e.class))
            .collect();
        let classes = &mut self.classes;
        classes.index.retain(|_, c| used.contains(c));
        classes.free.clear();
        let in_use: std::collections::HashSet<u32> = classes.index.values().copied().collect();
        for (i, slot) in classes.list.iter_mut().enumerate() {
            if !in_use.contains(&(i as u32)) {
                *slot = (Arc::from(""), 0);
                classes.free.push(i as u32);
            }
        }
        classes.collect_at = CLASSES_COLLECT_AT.max(2 * classes.index.len());
    }
}
