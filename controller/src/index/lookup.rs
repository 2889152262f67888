//! Longest-prefix lookup over the index (`RouterService.LookupRoute`).
//!
//! A query names its coordinates (tenant, model, hash scheme — each may be empty for "any" —
//! and the exact adapter) and carries either raw token ids, chunked into content keys at the
//! block size of every candidate partition (the size registered per hash scheme by the streams,
//! never one global value), or pre-computed content keys. Each candidate partition is walked
//! block by block; the deepest partition (in tokens) wins and partitions of equal depth merge.
//!
//! Policy: a request carrying fewer than `minimum_prefix_tokens` tokens, or whose deepest match
//! is shorter, answers NO_HINT (`BelowMinimumPrefixTokens`); a lookup past its `deadline`
//! answers NO_HINT (`LookupTimeout`) — fail open, the gateway routes by load.

use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use ic_shared::kv::content_key;
use ic_shared::kv::coverage::Coverage;

use super::holders::{is_t2, slot_of, Holder, Holders};
use super::{PartitionId, PrefixIndex, ReplicaSlot, Tier};

/// NO_HINT reason when the lookup ran past its budget.
pub const LOOKUP_TIMEOUT: &str = "LookupTimeout";

/// NO_HINT reason: no routable replica holds the request's first block, but one the index may
/// not route to does — its engine's publisher is gone (coverage `Disconnected`) or its engine
/// is down (`EngineDown`); `/snapshot` shows it with `routable: false`. Not a cold prefix.
pub const HOLDER_NOT_ROUTABLE: &str = "HolderNotRoutable";

/// Chain levels whose slots are loaded together (their cache misses overlap) before they are
/// intersected; also the deadline check interval.
const CHUNK: usize = 32;

/// What the router asks.
///
/// Empty `tenant`, `model` or `hash_scheme` match any value; `adapter` always matches exactly
/// (empty = the base model), so a LoRA request never routes to a base-model cache.
#[derive(Debug, Clone, Default)]
pub struct LookupQuery {
    /// Tenant (namespace) or empty for any.
    pub tenant: String,
    /// Model id or empty for any.
    pub model: String,
    /// `vllm` / `sglang` or empty for any.
    pub hash_scheme: String,
    /// LoRA adapter, empty for the base model.
    pub adapter: String,
    /// Raw prompt token ids; chunked at each candidate partition's block size.
    pub token_ids: Vec<u32>,
    /// Pre-computed content keys (first block first); used when `token_ids` is empty.
    pub content_keys: Vec<u64>,
    /// Only partitions of this block size (tokens); `None` = every registered size.
    pub block_size: Option<u32>,
    /// A request, or a best match, shorter than this many tokens answers NO_HINT
    /// (CachePolicy.minimumPrefixTokens).
    pub minimum_prefix_tokens: u32,
    /// Past this instant the lookup gives up with NO_HINT / `LookupTimeout`
    /// (CachePolicy.lookupTimeoutMs); `None` = no budget.
    pub deadline: Option<Instant>,
    /// Most replicas in the answer (the best ones); 0 = all.
    pub max_replicas: usize,
    /// Only partitions of these tenants (namespaces) are searched — the caller's grant
    /// (docs/security.md "Authenticated data plane"); `None` = every tenant. Applied before the
    /// best partition is chosen, so a replica of another tenant is never named and never
    /// displaces a visible one.
    pub visible_tenants: Option<Arc<BTreeSet<String>>>,
}

/// A replica's names as answers carry them, built once when its stream registers and shared
/// by every answer that lists it: listing a replica costs one reference-count increment under
/// the index lock, and the gRPC layer copies the names into the proto's strings after the lock
/// is released (`router::to_proto`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaNames {
    /// Replica id (pod name, `#rank` above rank 0).
    pub replica: String,
    /// Stream id `ns/pod#rank`.
    pub stream_id: String,
    /// Node whose agent reported it.
    pub node: String,
    /// CacheBackend that wired the replica, empty if unknown.
    pub backend: String,
}

/// One replica's match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaMatch {
    /// The replica's names (shared with the index; see [`ReplicaNames`]).
    pub names: Arc<ReplicaNames>,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Consecutive blocks matched from block 0.
    pub matched_blocks: u32,
    /// `matched_blocks × block_size`.
    pub matched_tokens: u32,
    /// Block size (tokens) of the partition this replica matched in; differs from the
    /// answer's only when partitions of several block sizes tie in depth.
    pub block_size: u32,
    /// T1 when every matched block is in GPU memory, else T2.
    pub tier: Tier,
    /// What the agent says of the replica's entries (never Disconnected or EngineDown here).
    pub coverage: Coverage,
    /// When the controller last heard from the replica's reporter, in [`super::mono_ms`]
    /// (`None`: not since it started). The answer's coverage age is `mono_ms() −` this
    /// (`ReplicaMatch.coverage_age_ms`, issue 37 item 2); kept as an instant so that two
    /// lookups of an unchanged index compare equal.
    pub heard_at_ms: Option<u64>,
}

impl ReplicaMatch {
    /// Milliseconds since the reporter was last heard at `now_ms` ([`super::mono_ms`]).
    pub fn coverage_age_ms(&self, now_ms: u64) -> Option<u64> {
        self.heard_at_ms.map(|t| now_ms.saturating_sub(t))
    }
}

impl ReplicaMatch {
    /// Replica id (pod name, `#rank` above rank 0).
    pub fn replica(&self) -> &str {
        &self.names.replica
    }

    /// Stream id `ns/pod#rank`.
    pub fn stream_id(&self) -> &str {
        &self.names.stream_id
    }

    /// Node whose agent reported it.
    pub fn node(&self) -> &str {
        &self.names.node
    }

    /// CacheBackend that wired the replica, empty if unknown.
    pub fn backend(&self) -> &str {
        &self.names.backend
    }
}

/// Lookup answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupResult {
    /// True for PREFIX_MATCH.
    pub prefix_match: bool,
    /// Matches, deepest first, T1 before T2, then by stream id.
    pub replicas: Vec<ReplicaMatch>,
    /// Block size of the best partition (0 when none matched the query's coordinates).
    pub block_size: u32,
    /// Full blocks in the request at that block size.
    pub request_blocks: u32,
    /// Why NO_HINT, empty on PREFIX_MATCH.
    pub reason: String,
    /// Replicas of the query's scope (tenant, model, hash scheme; wildcards widen it) whose
    /// entries may miss blocks their engine holds — coverage Healing, Partial, Disconnected or
    /// Unknown ([`PrefixIndex::inexact_replicas`]): they may hold more of the prefix than the
    /// answer shows. 0 when the index vouches for every replica it could have named.
    pub inexact_replicas: u32,
}

/// A replica's match before names are attached: what [`PrefixIndex::score`] returns, the
/// equivalent of other indexers' per-worker overlap scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaScore {
    /// Internal replica slot (stable while the stream is known).
    pub slot: u32,
    /// Consecutive blocks matched from block 0.
    pub matched_blocks: u32,
    /// Block size of the partition matched.
    pub block_size: u32,
    /// True when every matched block is in GPU memory.
    pub t1: bool,
}

impl ReplicaScore {
    fn tokens(&self) -> u32 {
        self.matched_blocks.saturating_mul(self.block_size)
    }
}

/// The scoring pass of a lookup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scores {
    /// Per replica with ≥ 1 matched block, in the deepest partition(s); unordered.
    pub replicas: Vec<ReplicaScore>,
    /// Block size of the best partition (0 when no partition matched the coordinates).
    pub block_size: u32,
    /// Full blocks in the request at that block size.
    pub request_blocks: u32,
    /// True when no partition matched the query's coordinates.
    pub no_partition: bool,
}

/// [`PrefixIndex::score`]'s answer and what the router's answer selects with.
#[derive(Debug)]
struct Scored {
    /// The scores; when `depth_one` is `Some`, without that group's (which come before all of
    /// them in walk order).
    scores: Scores,
    /// The replicas that matched exactly one block, kept implicitly ([`DepthOne`]); `Some` only
    /// when `shallowest_first`.
    depth_one: Option<DepthOne>,
    /// The deepest score's matched tokens (0 when none).
    deepest: u32,
    /// True when the scores (`depth_one`'s, then `scores.replicas`) are one walk's scores, all
    /// T1: in the order replicas dropped out, so sorted by primary key ([`primary`]) from worst
    /// to best.
    shallowest_first: bool,
}

/// The replicas of one walk that matched block 0 but not block 1, without a score apiece: the
/// routable holders of block 0 (`first`) minus the holders of block 1 (`second`; `None` when
/// the walk stopped at block 0). On a shared system prompt that is nearly the whole fleet,
/// and a capped answer reads only the few of them it lists ([`PrefixIndex::best_of_depth_one`]).
#[derive(Debug, Clone, Copy)]
struct DepthOne {
    first: Holders,
    second: Option<Holders>,
    /// Block size of the partition walked.
    block_size: u32,
    /// How many replicas the group holds (≥ 1 when it exists).
    len: usize,
}

/// What [`PrefixIndex::walk`] found in one partition.
#[derive(Debug, Default)]
struct Walked {
    /// The replicas that matched exactly one block (listed before `scores` in walk order).
    depth_one: Option<DepthOne>,
    /// Every other replica with ≥ 1 matched block (≥ 2 when `depth_one` is `Some`), in the
    /// order they dropped out: by matched depth, shallowest first.
    scores: Vec<ReplicaScore>,
    /// False when every matched block of every score is T1 (all scores T1: no offload chunk
    /// rounding to do).
    any_t2: bool,
}

/// The lookup ran past its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut;

/// Whether partition `k` can answer `q`: its tenant (when named, and visible to the caller),
/// model, hash scheme, adapter and block size (when named) are the query's.
fn partition_matches(q: &LookupQuery, k: &super::Partition) -> bool {
    (q.tenant.is_empty() || k.tenant == q.tenant)
        && q.visible_tenants
            .as_ref()
            .is_none_or(|v| v.contains(&k.tenant))
        && (q.model.is_empty() || k.model == q.model)
        && (q.hash_scheme.is_empty() || k.hash_scheme == q.hash_scheme)
        && k.adapter == q.adapter
        && q.block_size.is_none_or(|b| b == k.block_size)
}

fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

fn no_hint(reason: &str, block_size: u32, request_blocks: u32) -> LookupResult {
    LookupResult {
        prefix_match: false,
        replicas: Vec::new(),
        block_size,
        request_blocks,
        reason: reason.to_string(),
        inexact_replicas: 0,
    }
}

impl PrefixIndex {
    /// Finds, for every replica, the longest cached prefix of the query, and decides
    /// PREFIX_MATCH / NO_HINT (see the module docs for the policy gates); says how many replicas
    /// of the query's scope the index does not vouch for ([`LookupResult::inexact_replicas`]).
    pub fn lookup(&self, q: &LookupQuery) -> LookupResult {
        let mut r = self.decide(q);
        r.inexact_replicas = self.inexact_replicas(
            &q.tenant,
            &q.model,
            &q.hash_scheme,
            q.visible_tenants.as_deref(),
        );
        r
    }

    /// Whether partitions of more than one tenant could answer `q` (a lookup without a tenant
    /// then chooses among namespaces; the router says so, issue 38 item 6). O(partitions).
    pub fn spans_tenants(&self, q: &LookupQuery) -> bool {
        let mut first: Option<&str> = None;
        for p in self
            .partitions
            .iter()
            .filter(|p| !p.blocks.is_empty() && partition_matches(q, &p.key))
        {
            match first {
                None => first = Some(p.key.tenant.as_str()),
                Some(t) if t != p.key.tenant => return true,
                Some(_) => {}
            }
        }
        false
    }

    /// Replicas of (tenant, model, hash scheme) — an empty one matches any; `visible` narrows
    /// the tenants — whose coverage says their entries may miss blocks (anything but Exact and
    /// EngineDown). O(scopes with such replicas), from a tally kept as coverage changes.
    pub fn inexact_replicas(
        &self,
        tenant: &str,
        model: &str,
        hash_scheme: &str,
        visible: Option<&BTreeSet<String>>,
    ) -> u32 {
        if self.coverage_tally.inexact.is_empty() {
            // Steady state: every replica Exact (or its engine down).
            return 0;
        }
        let matches = |(t, m, h): &(String, String, String)| {
            (tenant.is_empty() || t == tenant)
                && visible.is_none_or(|v| v.contains(t))
                && (model.is_empty() || m == model)
                && (hash_scheme.is_empty() || h == hash_scheme)
        };
        if !tenant.is_empty() && !model.is_empty() && !hash_scheme.is_empty() {
            let key = (
                tenant.to_string(),
                model.to_string(),
                hash_scheme.to_string(),
            );
            return match self.coverage_tally.inexact.get(&key) {
                Some(n) if matches(&key) => *n,
                _ => 0,
            };
        }
        self.coverage_tally
            .inexact
            .iter()
            .filter(|(k, _)| matches(k))
            .map(|(_, n)| *n)
            .sum()
    }

    fn decide(&self, q: &LookupQuery) -> LookupResult {
        let q_bs = q.block_size.unwrap_or(0);
        if q.minimum_prefix_tokens > 0 {
            let carried = if q.token_ids.is_empty() {
                q.block_size
                    .map(|b| (q.content_keys.len() as u64).saturating_mul(u64::from(b)))
            } else {
                Some(q.token_ids.len() as u64)
            };
            if carried.is_some_and(|t| t < u64::from(q.minimum_prefix_tokens)) {
                return no_hint("BelowMinimumPrefixTokens", q_bs, 0);
            }
        }
        let Scored {
            scores,
            depth_one,
            deepest,
            shallowest_first,
        } = match self.score_deepest(q) {
            Ok(s) => s,
            Err(TimedOut) => return no_hint(LOOKUP_TIMEOUT, q_bs, 0),
        };
        if scores.no_partition {
            return no_hint("NoBlockSizeRegistered", q_bs, 0);
        }
        let prefix_match = deepest > 0 && deepest >= q.minimum_prefix_tokens;
        if !prefix_match {
            let reason = if scores.request_blocks == 0 {
                "RequestShorterThanOneBlock"
            } else if deepest == 0 && self.first_block_held_unroutable(q) {
                HOLDER_NOT_ROUTABLE
            } else if deepest == 0 {
                "NoReplicaHoldsPrefix"
            } else {
                "BelowMinimumPrefixTokens"
            };
            return no_hint(reason, scores.block_size, scores.request_blocks);
        }
        if past(q.deadline) {
            return no_hint(LOOKUP_TIMEOUT, scores.block_size, scores.request_blocks);
        }
        LookupResult {
            prefix_match,
            replicas: self.answer(scores.replicas, depth_one, q.max_replicas, shallowest_first),
            block_size: scores.block_size,
            request_blocks: scores.request_blocks,
            reason: String::new(),
            inexact_replicas: 0,
        }
    }

    /// True when a replica the lookup may not route to (coverage Disconnected or EngineDown)
    /// holds the request's first block in a partition the query matches: the miss is then
    /// not a cold prefix. Only asked on a miss while some replica is unroutable (O(partitions)).
    fn first_block_held_unroutable(&self, q: &LookupQuery) -> bool {
        if self.unroutable_count == 0 {
            return false;
        }
        let mut buf: [Holder; 1] = [0; 1];
        self.partitions.iter().any(|p| {
            let k = &p.key;
            let matches = partition_matches(q, k);
            if !matches || p.blocks.is_empty() {
                return false;
            }
            let first = if q.token_ids.is_empty() {
                q.content_keys.first().copied()
            } else {
                content_key::chain(
                    &q.token_ids[..q.token_ids.len().min(k.block_size as usize)],
                    k.block_size as usize,
                )
                .first()
                .copied()
            };
            first.and_then(|key| p.blocks.get(key)).is_some_and(|b| {
                b.holders(&self.arena, &mut buf)
                    .iter()
                    .any(|&h| !self.routable(slot_of(h)))
            })
        })
    }

    /// The scoring pass alone: per replica, matched blocks in the deepest candidate partition
    /// (partitions of equal depth in tokens merge). No names, no ordering, no policy gates.
    ///
    /// # Errors
    /// [`TimedOut`] when `q.deadline` passes during the walk.
    pub fn score(&self, q: &LookupQuery) -> Result<Scores, TimedOut> {
        let s = self.score_deepest(q)?;
        Ok(Scores {
            replicas: self.with_depth_one(s.depth_one, s.scores.replicas),
            ..s.scores
        })
    }

    /// [`Self::score`], with the deepest score's matched tokens and whether the scores are in
    /// walk order with every score T1 ([`Scored::shallowest_first`]).
    fn score_deepest(&self, q: &LookupQuery) -> Result<Scored, TimedOut> {
        let mut chains: HashMap<u32, Vec<u64>> = HashMap::new();
        let mut best = Scores {
            no_partition: true,
            block_size: q.block_size.unwrap_or(0),
            ..Scores::default()
        };
        let mut best_depth = 0u32;
        // The depth-one group of `best` while it is one walk's scores, all T1.
        let mut best_depth_one: Option<DepthOne> = None;
        // True once `best` holds the replicas of more than one partition (may list a slot twice).
        let mut merged = false;
        // True while `best` is one walk's scores, all T1 (so shallowest first).
        let mut best_all_t1 = true;
        for (pid, p) in self.partitions.iter().enumerate() {
            // A partition nobody holds blocks in any more (streams gone, probe streams) is not a
            // registered block size.
            if p.blocks.is_empty() {
                continue;
            }
            let k = &p.key;
            let matches = partition_matches(q, k);
            if !matches {
                continue;
            }
            if past(q.deadline) {
                return Err(TimedOut);
            }
            let bs = k.block_size;
            let keys: &[u64] = if q.token_ids.is_empty() {
                &q.content_keys
            } else {
                chains
                    .entry(bs)
                    .or_insert_with(|| content_key::chain(&q.token_ids, bs as usize))
            };
            let walked = self.walk(pid as PartitionId, keys, bs, q.deadline)?;
            let mut found = walked.scores;
            let mut depth_one = walked.depth_one;
            let depth = if walked.any_t2 {
                found = self.with_depth_one(depth_one.take(), found);
                self.whole_offload_chunks(pid as PartitionId, keys, &mut found);
                found.iter().map(ReplicaScore::tokens).max()
            } else {
                // All T1 (no chunk rounding), and a walk lists the deepest last.
                found
                    .last()
                    .map(ReplicaScore::tokens)
                    .or(depth_one.map(|_| bs))
            }
            .unwrap_or(0);
            // With no match anywhere, the answer speaks of the partition the request has the
            // most blocks in (the smallest block size): "shorter than one block" only when it
            // is shorter than every registered size, whichever partition came first.
            let fewer_blocks =
                depth == 0 && best_depth == 0 && keys.len() > best.request_blocks as usize;
            if best.no_partition || depth > best_depth || fewer_blocks {
                best = Scores {
                    replicas: found,
                    block_size: bs,
                    request_blocks: keys.len() as u32,
                    no_partition: false,
                };
                best_depth = depth;
                best_depth_one = depth_one;
                merged = false;
                best_all_t1 = !walked.any_t2;
            } else if depth > 0 && depth == best_depth {
                // Same depth in another partition (e.g. another tenant under a wildcard): merge.
                let replicas = std::mem::take(&mut best.replicas);
                best.replicas = self.with_depth_one(best_depth_one.take(), replicas);
                best.replicas.extend(self.with_depth_one(depth_one, found));
                merged = true;
            }
        }
        if merged {
            // A replica in two of the merged partitions (two block sizes) keeps its best score
            // of them: deeper in tokens, then T1; on a tie the first partition's. One sort and
            // one pass: a wildcard over tenants that share a system prompt merges thousands of
            // replicas, where a scan per replica would be quadratic.
            best.replicas
                .sort_by_key(|s| (s.slot, std::cmp::Reverse(s.tokens()), !s.t1));
            best.replicas.dedup_by_key(|s| s.slot);
        }
        Ok(Scored {
            scores: best,
            depth_one: best_depth_one,
            deepest: best_depth,
            shallowest_first: best_all_t1 && !merged,
        })
    }

    /// Credits an offload-only match in whole chunks of the replica's offload tier (issue 39
    /// item 12; docs/kv-events.md, "Chunked offload tiers").
    ///
    /// An offload tier that stores and loads whole chunks of `C` tokens (LMCache's
    /// `chunk_size`, the descriptor's `offload_chunk_tokens`) may announce each chunk as several
    /// engine-sized blocks (4 × 16 for a 64-token chunk); a prompt matching only the first of
    /// them cannot load anything from that chunk. So a score with an offload-only (T2) block
    /// keeps `max(g, ⌊d / C⌋ · C)` tokens, where `d` is its matched depth and `g` the depth
    /// of its leading run of GPU (T1) blocks (GPU-tier depth is unaffected), rounded down to
    /// whole blocks of `keys`' block size. A score left with no block is dropped (scores list
    /// replicas with ≥ 1 matched block); one cut back to its GPU run reads T1 again.
    ///
    /// Replicas with no chunk size (0), a chunk no longer than the block, and all-T1 scores
    /// are untouched; only the few scores rounded cost a second look at their blocks.
    fn whole_offload_chunks(&self, pid: PartitionId, keys: &[u64], found: &mut Vec<ReplicaScore>) {
        let Some(part) = self.partitions.get(pid as usize) else {
            return;
        };
        found.retain_mut(|s| {
            if s.t1 || s.block_size == 0 {
                return true;
            }
            let chunk = self
                .replicas
                .get(s.slot as usize)
                .and_then(Option::as_ref)
                .map_or(0, |r| r.desc.offload_chunk_tokens);
            if chunk <= s.block_size {
                return true;
            }
            let tokens = s.tokens();
            let whole = tokens - tokens % chunk;
            if whole == tokens {
                return true;
            }
            // The leading run of blocks this replica holds on GPU.
            let gpu = keys
                .iter()
                .take(s.matched_blocks as usize)
                .take_while(|k| {
                    part.blocks
                        .get(**k)
                        .and_then(|h| h.find(&self.arena, s.slot))
                        .is_some_and(|h| !is_t2(h))
                })
                .count() as u32;
            let blocks = gpu.max(whole / s.block_size);
            s.t1 = blocks <= gpu;
            s.matched_blocks = blocks;
            blocks > 0
        });
    }

    /// Walks the chain in one partition; returns every replica with ≥ 1 matched block
    /// (unordered). Levels are fetched in chunks (independent loads, so their misses overlap).
    /// The replicas still matching are kept as a slot-sorted vector; each level intersects it
    /// with the level's holders (also sorted by slot). A level held by exactly the replicas
    /// still matching — every level of a shared system prompt — costs one sequential compare
    /// of the two slot lists; otherwise the smaller side is walked and each element found in
    /// the other by a galloping search from the last match. A replica that drops out is scored
    /// with the depth it reached, so the scores come shallowest first and the deepest last.
    fn walk(
        &self,
        pid: PartitionId,
        keys: &[u64],
        block_size: u32,
        deadline: Option<Instant>,
    ) -> Result<Walked, TimedOut> {
        let Some(part) = self.partitions.get(pid as usize) else {
            return Ok(Walked::default());
        };
        let Some(first) = keys.first().and_then(|k| part.blocks.get(*k)) else {
            return Ok(Walked::default());
        };
        let mut buf: [Holder; 1] = [0; 1];
        let list = first.holders(&self.arena, &mut buf);
        // Replicas whose engine or publisher is gone are never matched. Any routable holder of
        // block 0 at T2 makes some score T2 (the holder bits of the slots and positions do not
        // reach the tier bit, so one OR over the list tells).
        let (routable, mut saw_t2) = if self.unroutable_count == 0 {
            (list.len(), is_t2(list.iter().fold(0, |a, &h| a | h)))
        } else {
            list.iter()
                .filter(|h| self.routable(slot_of(**h)))
                .fold((0, false), |(n, t2), &h| (n + 1, t2 | is_t2(h)))
        };
        if keys.len() > 1 && past(deadline) {
            return Err(TimedOut);
        }
        // Block 1: the replicas still matching after it (slots, sorted, and whether every block
        // so far is T1) are block 0's routable holders that hold it too. Block 0's other
        // routable holders drop out at depth 1 and are not listed one by one ([`DepthOne`]).
        let second = keys.get(1).and_then(|k| part.blocks.get(*k));
        let mut buf2: [Holder; 1] = [0; 1];
        let list2: &[Holder] = match &second {
            Some(h) => h.holders(&self.arena, &mut buf2),
            None => &[],
        };
        let mut slots: Vec<u32> = Vec::with_capacity(list2.len().min(list.len()));
        let mut t1: Vec<bool> = Vec::with_capacity(slots.capacity());
        let (small, large, small_is_first) = if list2.len() <= list.len() {
            (list2, list, false)
        } else {
            (list, list2, true)
        };
        let mut j = 0usize;
        for &w in small {
            j = gallop(large, j, slot_of(w), |h| slot_of(*h));
            match large.get(j) {
                Some(&h) if slot_of(h) == slot_of(w) && self.routable(slot_of(w)) => {
                    let (at0, at1) = if small_is_first { (w, h) } else { (h, w) };
                    slots.push(slot_of(w));
                    t1.push(!is_t2(at0) && !is_t2(at1));
                    saw_t2 |= is_t2(at1);
                }
                _ => {}
            }
        }
        let depth_one = (routable > slots.len()).then_some(DepthOne {
            first,
            second,
            block_size,
            len: routable - slots.len(),
        });
        let mut out: Vec<ReplicaScore> = Vec::with_capacity(slots.len());
        let score = |slot: u32, depth: usize, t1: bool| ReplicaScore {
            slot,
            matched_blocks: depth as u32,
            block_size,
            t1,
        };
        let mut next_slots: Vec<u32> = Vec::with_capacity(slots.len());
        let mut next_t1: Vec<bool> = Vec::with_capacity(slots.len());
        let mut level: [Option<Holders>; CHUNK] = [None; CHUNK];
        let mut depth = 2usize;
        'walk: while depth < keys.len() && !slots.is_empty() {
            if past(deadline) {
                return Err(TimedOut);
            }
            let end = (depth + CHUNK).min(keys.len());
            let chunk = keys.get(depth..end).unwrap_or(&[]);
            // Every level's slot is requested before the first is read, and every spilled
            // holder list before the first is intersected: the chunk's misses overlap instead
            // of following one another (the deepest chains of a trace are its p99).
            part.blocks.prefetch(chunk);
            for (cell, key) in level.iter_mut().zip(chunk) {
                *cell = part.blocks.get(*key);
                if let Some(h) = cell {
                    h.prefetch_list(&self.arena);
                }
            }
            for cell in level.iter().take(chunk.len()) {
                let Some(h) = cell else {
                    break 'walk;
                };
                if let ([slot], Some(t)) = (&slots[..], t1.first_mut()) {
                    // The common tail: one replica left, one holder check per level.
                    match h.find(&self.arena, *slot) {
                        Some(x) => {
                            *t &= !is_t2(x);
                            saw_t2 |= is_t2(x);
                            depth += 1;
                            continue;
                        }
                        None => break 'walk,
                    }
                }
                let mut buf: [Holder; 1] = [0; 1];
                let holders = h.holders(&self.arena, &mut buf);
                if holders.len() == slots.len()
                    && holders.iter().zip(&slots).all(|(w, s)| slot_of(*w) == *s)
                {
                    if holders.iter().any(|w| is_t2(*w)) {
                        saw_t2 = true;
                        for (w, t) in holders.iter().zip(t1.iter_mut()) {
                            *t &= !is_t2(*w);
                        }
                    }
                    depth += 1;
                    continue;
                }
                next_slots.clear();
                next_t1.clear();
                if slots.len() <= holders.len() {
                    let mut j = 0usize;
                    for (&s, &t) in slots.iter().zip(&t1) {
                        j = gallop(holders, j, s, |w| slot_of(*w));
                        match holders.get(j) {
                            Some(&w) if slot_of(w) == s => {
                                next_slots.push(s);
                                next_t1.push(t && !is_t2(w));
                                saw_t2 |= is_t2(w);
                            }
                            _ => out.push(score(s, depth, t)),
                        }
                    }
                } else {
                    // `k`: the first replica not yet decided at this level.
                    let mut k = 0usize;
                    for &w in holders {
                        let at = gallop(&slots, k, slot_of(w), |s| *s);
                        for (&s, &t) in slots
                            .get(k..at)
                            .unwrap_or(&[])
                            .iter()
                            .zip(t1.get(k..at).unwrap_or(&[]))
                        {
                            out.push(score(s, depth, t));
                        }
                        k = at;
                        match (slots.get(at), t1.get(at)) {
                            (Some(&s), Some(&t)) if s == slot_of(w) => {
                                next_slots.push(s);
                                next_t1.push(t && !is_t2(w));
                                saw_t2 |= is_t2(w);
                                k = at + 1;
                            }
                            (Some(_), _) => {}
                            _ => break,
                        }
                    }
                    let rest = slots.get(k..).unwrap_or(&[]);
                    for (&s, &t) in rest.iter().zip(t1.get(k..).unwrap_or(&[])) {
                        out.push(score(s, depth, t));
                    }
                }
                std::mem::swap(&mut slots, &mut next_slots);
                std::mem::swap(&mut t1, &mut next_t1);
                if slots.is_empty() {
                    break 'walk;
                }
                depth += 1;
            }
        }
        out.extend(slots.iter().zip(&t1).map(|(&s, &t)| score(s, depth, t)));
        Ok(Walked {
            depth_one,
            scores: out,
            any_t2: saw_t2,
        })
    }

    /// Orders scores (deepest first, T1 before T2, then by stream id), keeps the best `max`
    /// (0 = all) and attaches names. `deeper` are the scores; `depth_one` the replicas that
    /// matched one block, not listed in `deeper` ([`Scored::depth_one`]).
    ///
    /// Only the kept replicas are dereferenced (see [`select_answer`]); their names are shared,
    /// not copied.
    ///
    /// `shallowest_first`: the scores are sorted by primary key, worst first
    /// ([`Scored::shallowest_first`]), which lets [`select_sorted_answer`] read only the
    /// deepest scores and the labels of those tied at the cut. Then every depth-one replica is
    /// worse than every score in `deeper` (fewer blocks, all T1), so a capped answer takes the
    /// best of `deeper` and, when they are fewer than `max`, the rest from the depth-one group by
    /// label alone ([`Self::best_of_depth_one`]) — without listing the group.
    fn answer(
        &self,
        deeper: Vec<ReplicaScore>,
        depth_one: Option<DepthOne>,
        max: usize,
        shallowest_first: bool,
    ) -> Vec<ReplicaMatch> {
        let label = |slot| self.order.label(slot);
        let chosen: Vec<ReplicaScore> = match depth_one {
            Some(g) if shallowest_first && max > 0 => {
                let mut chosen: Vec<ReplicaScore> = select_sorted_answer(&deeper, max, label)
                    .into_iter()
                    .filter_map(|i| deeper.get(i).copied())
                    .collect();
                let need = max.saturating_sub(chosen.len());
                if need > 0 {
                    chosen.extend(self.best_of_depth_one(&g, need));
                }
                chosen
            }
            g => {
                let scores = self.with_depth_one(g, deeper);
                let order = if shallowest_first {
                    select_sorted_answer(&scores, max, label)
                } else {
                    select_answer(&scores, max, label)
                };
                order
                    .into_iter()
                    .filter_map(|i| scores.get(i).copied())
                    .collect()
            }
        };
        self.name(&chosen)
    }

    /// Calls `f(slot, t1)` for every replica of `g`, in slot order (the order a walk lists
    /// them in).
    fn each_depth_one(&self, g: &DepthOne, mut f: impl FnMut(u32, bool)) {
        let mut buf: [Holder; 1] = [0; 1];
        let mut buf2: [Holder; 1] = [0; 1];
        let first = g.first.holders(&self.arena, &mut buf);
        let second: &[Holder] = match &g.second {
            Some(h) => h.holders(&self.arena, &mut buf2),
            None => &[],
        };
        let mut j = 0usize;
        for &h in first {
            let s = slot_of(h);
            j = gallop(second, j, s, |w| slot_of(*w));
            if second.get(j).is_some_and(|w| slot_of(*w) == s) || !self.routable(s) {
                continue;
            }
            f(s, !is_t2(h));
        }
    }

    /// `deeper` with the scores of `g` (one block each) listed before them, as a walk lists
    /// them.
    fn with_depth_one(&self, g: Option<DepthOne>, deeper: Vec<ReplicaScore>) -> Vec<ReplicaScore> {
        let Some(g) = g else {
            return deeper;
        };
        let mut out = Vec::with_capacity(g.len + deeper.len());
        self.each_depth_one(&g, |slot, t1| {
            out.push(ReplicaScore {
                slot,
                matched_blocks: 1,
                block_size: g.block_size,
                t1,
            });
        });
        out.extend(deeper);
        out
    }

    /// The `need` best replicas of `g` (all T1: one primary key) — least (label, walk order)
    /// first, as [`select_sorted_answer`] orders ties — from a bounded heap fed in slot order;
    /// a replica whose label is not below the heap's greatest costs one compare.
    fn best_of_depth_one(&self, g: &DepthOne, need: usize) -> Vec<ReplicaScore> {
        let mut kept: BinaryHeap<(u64, usize, u32)> = BinaryHeap::with_capacity(need);
        let mut worst = u64::MAX;
        let mut i = 0usize;
        self.each_depth_one(g, |slot, _| {
            let l = self.order.label(slot);
            if kept.len() < need {
                kept.push((l, i, slot));
                worst = kept.peek().map_or(u64::MAX, |w| w.0);
            } else if l < worst {
                if let Some(mut w) = kept.peek_mut() {
                    *w = (l, i, slot);
                }
                worst = kept.peek().map_or(u64::MAX, |w| w.0);
            }
            i += 1;
        });
        let mut kept = kept.into_vec();
        kept.sort_unstable();
        kept.into_iter()
            .map(|(_, _, slot)| ReplicaScore {
                slot,
                matched_blocks: 1,
                block_size: g.block_size,
                t1: true,
            })
            .collect()
    }

    /// The answer's entries for `chosen` (in that order): names, coverage and when the
    /// reporter was last heard.
    fn name(&self, chosen: &[ReplicaScore]) -> Vec<ReplicaMatch> {
        let mut out = Vec::with_capacity(chosen.len());
        // Replicas of one reporter are usually listed together: its heard cell is looked up
        // once (a string hash) per run of them.
        let mut heard: Option<(&str, Option<u64>)> = None;
        for s in chosen {
            let Some(r) = self.replica(s.slot as ReplicaSlot) else {
                continue;
            };
            let heard_at_ms = match heard {
                Some((node, at)) if node == r.node => at,
                _ => {
                    let at = self.heard_at_ms(&r.node);
                    heard = Some((&r.node, at));
                    at
                }
            };
            out.push(ReplicaMatch {
                names: r.names.clone(),
                dp_rank: r.desc.dp_rank,
                matched_blocks: s.matched_blocks,
                matched_tokens: s.tokens(),
                block_size: s.block_size,
                tier: if s.t1 { Tier::T1 } else { Tier::T2 },
                coverage: r.effective_coverage(),
                heard_at_ms,
            });
        }
        out
    }

    /// Stream id of a scored slot (for callers of [`PrefixIndex::score`]).
    pub fn stream_of(&self, slot: u32) -> Option<&str> {
        self.replica(slot as ReplicaSlot)
            .map(|r| r.desc.stream_id.as_str())
    }
}

/// The first index `i ≥ from` with `slot(v[i]) ≥ target` (`v.len()` if none), for `v` sorted by
/// `slot`: probes `from`, `from + 1`, `from + 3`, … doubling the step, then binary-searches the
/// last step. O(log (i − from)) comparisons; 1 when `v[from]` is already there.
#[inline]
fn gallop<T>(v: &[T], from: usize, target: u32, slot: impl Fn(&T) -> u32) -> usize {
    let below = |i: usize| v.get(i).is_some_and(|x| slot(x) < target);
    if !below(from) {
        return from.min(v.len());
    }
    // Invariant: slot(v[lo]) < target; hi is past the answer or at it.
    let mut lo = from;
    let mut step = 1usize;
    let hi = loop {
        let probe = lo.saturating_add(step);
        if probe >= v.len() {
            break v.len();
        }
        if !below(probe) {
            break probe;
        }
        lo = probe;
        step = step.saturating_mul(2);
    };
    let tail = v.get(lo + 1..hi).unwrap_or(&[]);
    lo + 1 + tail.partition_point(|x| slot(x) < target)
}

/// The primary order key of a score: deeper (in tokens) first, then T1 before T2.
#[inline]
fn primary(s: &ReplicaScore) -> u64 {
    (u64::from(u32::MAX - s.tokens()) << 1) | u64::from(!s.t1)
}

/// Indices into `scores` of the answer, best first: deepest (tokens) first, T1 before T2, then
/// by stream id — `label(slot)` is the slot's stream-order label ([`super::order`]), whose
/// order is the stream ids' order. At most `max` (0 = all).
///
/// Two passes, no per-score allocation, labels read only where they decide:
///
/// 1. The `max`-th best primary key (depth, tier) `P*`, from a bounded max-heap of primary keys
///    alone, fed from the end of `scores`: a walk lists replicas in the order they drop out,
///    shallowest first, so the deepest fill the heap and every shallower score is rejected by
///    one compare, without a heap operation.
/// 2. Every score strictly better than `P*` is in the answer (fewer than `max` of them); of
///    those tied at `P*` — on a shared system prompt, the whole fleet at depth 1 — the
///    `max − better` with the least (label, index) are kept by a second bounded heap. Only the
///    tied scores read their label.
///
/// The kept (at most `max`) are then sorted. O(n + k log k) when the scores come shallowest
/// first and the ties in label order, O(n log k) at worst. Equal to sorting every score by
/// (primary, label, index) and truncating (a property test holds them equal).
pub(super) fn select_answer(
    scores: &[ReplicaScore],
    max: usize,
    label: impl Fn(u32) -> u64,
) -> Vec<usize> {
    let key = |i: usize, s: &ReplicaScore| (primary(s), label(s.slot), i);
    if max == 0 || scores.len() <= max {
        let mut all: Vec<(u64, u64, usize)> =
            scores.iter().enumerate().map(|(i, s)| key(i, s)).collect();
        all.sort_unstable();
        return all.into_iter().map(|(_, _, i)| i).collect();
    }
    // Pass 1: the `max` least primary keys; the greatest of them is P*. `top` caches the
    // heap's greatest, so a rejected score costs one compare.
    let mut least: BinaryHeap<u64> = BinaryHeap::with_capacity(max);
    let mut top = u64::MAX;
    for s in scores.iter().rev() {
        let p = primary(s);
        if least.len() < max {
            least.push(p);
            top = least.peek().copied().unwrap_or(u64::MAX);
        } else if p < top {
            if let Some(mut t) = least.peek_mut() {
                *t = p;
            }
            top = least.peek().copied().unwrap_or(u64::MAX);
        }
    }
    let cut = top;
    let better = least.iter().filter(|p| **p < cut).count();
    let need = max.saturating_sub(better);
    // Pass 2: all better than P*, and the `need` least (label, index) tied at P*. Ties come in
    // index order, so a later tie with the worst kept label never replaces it: `worst` caches
    // the heap's greatest label.
    let mut kept: Vec<(u64, u64, usize)> = Vec::with_capacity(max);
    let mut tied: BinaryHeap<(u64, usize)> = BinaryHeap::with_capacity(need);
    let mut worst = u64::MAX;
    for (i, s) in scores.iter().enumerate() {
        let p = primary(s);
        if p > cut {
            continue;
        }
        let l = label(s.slot);
        if p < cut {
            kept.push((p, l, i));
        } else if tied.len() < need {
            tied.push((l, i));
            worst = tied.peek().map_or(u64::MAX, |w| w.0);
        } else if l < worst {
            if let Some(mut w) = tied.peek_mut() {
                *w = (l, i);
            }
            worst = tied.peek().map_or(u64::MAX, |w| w.0);
        }
    }
    kept.extend(tied.into_iter().map(|(l, i)| (cut, l, i)));
    kept.sort_unstable();
    kept.into_iter().map(|(_, _, i)| i).collect()
}

/// [`select_answer`] for `scores` sorted by [`primary`] key from worst to best (one walk's
/// scores, all T1: shallowest first). The cut `P*` is the primary key of the `max`-th score
/// from the end; the scores after the last tie are in the answer, and only those tied at `P*`
/// (a contiguous run, found by binary search) read their label, keeping the `need` least
/// (label, index) in a bounded heap. O(log n + ties + k log k); the same indices as
/// [`select_answer`] (a property test holds them equal).
pub(super) fn select_sorted_answer(
    scores: &[ReplicaScore],
    max: usize,
    label: impl Fn(u32) -> u64,
) -> Vec<usize> {
    let n = scores.len();
    if max == 0 || n <= max {
        return select_answer(scores, max, label);
    }
    let Some(cut) = scores.get(n - max).map(primary) else {
        return Vec::new();
    };
    // Scores before `lo` are worse than the cut, from `hi` on better.
    let lo = scores.partition_point(|s| primary(s) > cut);
    let hi = lo
        + scores
            .get(lo..)
            .unwrap_or(&[])
            .partition_point(|s| primary(s) >= cut);
    let need = max.saturating_sub(n - hi);
    let mut tied: BinaryHeap<(u64, usize)> = BinaryHeap::with_capacity(need);
    let mut worst = u64::MAX;
    for (i, s) in scores.iter().enumerate().take(hi).skip(lo) {
        let l = label(s.slot);
        if tied.len() < need {
            tied.push((l, i));
            worst = tied.peek().map_or(u64::MAX, |w| w.0);
        } else if l < worst {
            if let Some(mut w) = tied.peek_mut() {
                *w = (l, i);
            }
            worst = tied.peek().map_or(u64::MAX, |w| w.0);
        }
    }
    let mut kept: Vec<(u64, u64, usize)> = scores
        .iter()
        .enumerate()
        .skip(hi)
        .map(|(i, s)| (primary(s), label(s.slot), i))
        .collect();
    kept.extend(tied.into_iter().map(|(l, i)| (cut, l, i)));
    kept.sort_unstable();
    kept.into_iter().map(|(_, _, i)| i).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{gallop, select_answer, select_sorted_answer, LookupQuery, ReplicaScore};
    use crate::index::{PrefixIndex, Tier};
    use ic_shared::kv::content_key::chain;
    use ic_shared::proto::{self, kv_op::Op};
    use proptest::prelude::*;

    fn desc(pod: &str) -> proto::StreamDescriptor {
        proto::StreamDescriptor {
            stream_id: format!("default/{pod}#0"),
            replica: pod.to_string(),
            tenant: "default".into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        }
    }

    fn delta(
        pod: &str,
        seq: u64,
        ops: Vec<proto::KvOp>,
        cov: proto::Coverage,
    ) -> proto::StreamDelta {
        proto::StreamDelta {
            coverage: cov as i32,
            stream: Some(desc(pod)),
            seq,
            ops,
            ..Default::default()
        }
    }

    fn store(keys: &[u64], tier: proto::Tier) -> proto::KvOp {
        proto::KvOp {
            op: Some(Op::Store(proto::StoreOp {
                adapter: String::new(),
                block_size: 4,
                tier: tier as i32,
                content_keys: keys.to_vec(),
            })),
        }
    }

    /// A fleet sharing block 0 — most replicas hold only it, a few go deeper — registered out
    /// of stream-id order (slot order is not label order), with replicas offloaded at block 0
    /// or 1 and replicas unroutable (publisher gone) in some rounds: the router's capped answer
    /// equals a naive model's full sort by (depth, tier, stream id) truncated, and the scoring
    /// pass lists every routable replica with its depth and tier. The depth-one group is kept
    /// implicitly by the walk; this holds its enumeration (exclusion of block 1's holders and
    /// of unroutable ones) and its top-k by label to the model.
    #[test]
    fn shared_first_block_answers_equal_a_naive_model() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let keys = chain(&(0..4 * 12).collect::<Vec<u32>>(), 4);
        for round in 0..12 {
            let n = 40 + (next() % 260) as usize;
            let with_t2 = round % 3 == 1;
            let with_down = round % 2 == 1;
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            // (pod, depth stored, index of a T2 block, routable)
            let fleet: Vec<(String, usize, Option<usize>, bool)> = (0..n)
                .map(|i| {
                    let depth = if next() % 100 < 85 {
                        1
                    } else {
                        2 + (next() % 10) as usize
                    };
                    let t2 = (with_t2 && next() % 10 == 0).then(|| (next() % 2) as usize);
                    let up = !(with_down && next() % 8 == 0);
                    (format!("p{i:03}"), depth, t2, up)
                })
                .collect();
            let mut ix = PrefixIndex::new();
            let snaps: Vec<proto::StreamSnapshot> = order
                .iter()
                .map(|&i| proto::StreamSnapshot {
                    coverage: proto::Coverage::Exact as i32,
                    stream: Some(desc(&fleet[i].0)),
                    ..Default::default()
                })
                .collect();
            ix.resync_node("n1", &snaps);
            for &i in &order {
                let (pod, depth, t2, up) = &fleet[i];
                let mut ops = vec![store(&keys[..*depth], proto::Tier::T1)];
                if let Some(j) = t2.filter(|j| j < depth) {
                    ops.push(store(&keys[j..=j], proto::Tier::T2));
                }
                ix.apply_delta("n1", &delta(pod, 1, ops, proto::Coverage::Exact))
                    .unwrap();
                if !up {
                    ix.apply_delta("n1", &delta(pod, 2, vec![], proto::Coverage::Disconnected))
                        .unwrap();
                }
            }
            for (len, max) in [
                (1, 32),
                (2, 32),
                (12, 32),
                (12, 1),
                (12, 0),
                (5, 7),
                (12, 400),
            ] {
                let q = LookupQuery {
                    content_keys: keys[..len].to_vec(),
                    block_size: Some(4),
                    max_replicas: max,
                    ..Default::default()
                };
                let mut want: Vec<(std::cmp::Reverse<u32>, Tier, String)> = fleet
                    .iter()
                    .filter(|(.., up)| *up)
                    .map(|(pod, depth, t2, _)| {
                        let d = (*depth).min(len);
                        let tier = if t2.is_some_and(|j| j < d) {
                            Tier::T2
                        } else {
                            Tier::T1
                        };
                        (
                            std::cmp::Reverse(d as u32),
                            tier,
                            format!("default/{pod}#0"),
                        )
                    })
                    .collect();
                want.sort();
                let mut scored: Vec<(std::cmp::Reverse<u32>, Tier, String)> = ix
                    .score(&q)
                    .unwrap()
                    .replicas
                    .iter()
                    .map(|s| {
                        let tier = if s.t1 { Tier::T1 } else { Tier::T2 };
                        (
                            std::cmp::Reverse(s.matched_blocks),
                            tier,
                            ix.stream_of(s.slot).unwrap().to_string(),
                        )
                    })
                    .collect();
                scored.sort();
                assert_eq!(scored, want, "round {round}, score of {len} blocks");
                if max > 0 {
                    want.truncate(max);
                }
                let got: Vec<(std::cmp::Reverse<u32>, Tier, String)> = ix
                    .lookup(&q)
                    .replicas
                    .iter()
                    .map(|m| {
                        (
                            std::cmp::Reverse(m.matched_blocks),
                            m.tier,
                            m.stream_id().to_string(),
                        )
                    })
                    .collect();
                assert_eq!(got, want, "round {round}, {len} blocks, max {max}");
            }
        }
    }

    proptest! {
        /// `gallop` equals a linear scan for the first element at or above the target.
        #[test]
        fn gallop_finds_what_a_linear_scan_finds(
            mut v in prop::collection::vec(0..200u32, 0..120),
            from in 0..130usize,
            target in 0..210u32,
        ) {
            v.sort_unstable();
            let want = (from..v.len()).find(|&i| v[i] >= target).unwrap_or(v.len().max(from.min(v.len())));
            prop_assert_eq!(gallop(&v, from, target, |x| *x), want);
        }

        /// On scores in walk order (all T1, shallowest first), the sorted selection picks
        /// what sorting every score by (depth, label, index) and truncating picks.
        #[test]
        fn sorted_selection_equals_a_full_sort(
            mut depths in prop::collection::vec(1..6u32, 0..300),
            labels in prop::collection::vec(0..50u64, 300),
            max in 0..40usize,
        ) {
            depths.sort_unstable();
            let scores: Vec<ReplicaScore> = depths
                .iter()
                .enumerate()
                .map(|(i, d)| ReplicaScore { slot: i as u32, matched_blocks: *d, block_size: 16, t1: true })
                .collect();
            let label = |s: u32| labels[s as usize];
            let mut want: Vec<usize> = (0..scores.len()).collect();
            want.sort_by_key(|&i| (std::cmp::Reverse(depths[i]), labels[i], i));
            if max > 0 {
                want.truncate(max);
            }
            prop_assert_eq!(select_sorted_answer(&scores, max, label), want.clone());
            prop_assert_eq!(select_answer(&scores, max, label), want);
        }
    }
}
