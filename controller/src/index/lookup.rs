//! Longest-prefix lookup over the index (`RouterService.LookupRoute`).

use std::collections::HashMap;

use ic_shared::kv::content_key;

use super::{PartitionId, PrefixIndex, ReplicaSlot, Tier};

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
    /// A match shorter than this many tokens answers NO_HINT (CachePolicy.minimumPrefixTokens).
    pub minimum_prefix_tokens: u32,
}

/// One replica's match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaMatch {
    /// Replica id (pod name, `#rank` above rank 0).
    pub replica: String,
    /// Stream id `ns/pod#rank`.
    pub stream_id: String,
    /// Node whose agent reported it.
    pub node: String,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Consecutive blocks matched from block 0.
    pub matched_blocks: u32,
    /// `matched_blocks × block_size`.
    pub matched_tokens: u32,
    /// T1 when every matched block is in GPU memory, else T2.
    pub tier: Tier,
    /// CacheBackend that wired the replica, if known.
    pub backend: String,
}

/// Lookup answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupResult {
    /// True for PREFIX_MATCH.
    pub prefix_match: bool,
    /// Matches, deepest first, T1 before T2, then by replica id.
    pub replicas: Vec<ReplicaMatch>,
    /// Block size of the best partition (0 when none matched the query's coordinates).
    pub block_size: u32,
    /// Full blocks in the request at that block size.
    pub request_blocks: u32,
    /// Why NO_HINT, empty on PREFIX_MATCH.
    pub reason: String,
}

impl PrefixIndex {
    /// Finds, for every replica, the longest cached prefix of the query.
    pub fn lookup(&self, q: &LookupQuery) -> LookupResult {
        let candidates: Vec<PartitionId> = self
            .partitions
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                (q.tenant.is_empty() || p.tenant == q.tenant)
                    && (q.model.is_empty() || p.model == q.model)
                    && (q.hash_scheme.is_empty() || p.hash_scheme == q.hash_scheme)
                    && p.adapter == q.adapter
                    && q.block_size.is_none_or(|b| b == p.block_size)
            })
            .map(|(i, _)| i as PartitionId)
            .collect();
        if candidates.is_empty() {
            return LookupResult {
                prefix_match: false,
                replicas: Vec::new(),
                block_size: q.block_size.unwrap_or(0),
                request_blocks: 0,
                reason: "NoBlockSizeRegistered".to_string(),
            };
        }

        let mut chains: HashMap<u32, Vec<u64>> = HashMap::new();
        let mut best: Option<(u32, u32, Vec<ReplicaMatch>)> = None; // (block_size, blocks, matches)
        for pid in candidates {
            let bs = self.partitions[pid as usize].block_size;
            let keys = if q.token_ids.is_empty() {
                &q.content_keys
            } else {
                chains
                    .entry(bs)
                    .or_insert_with(|| content_key::chain(&q.token_ids, bs as usize))
            };
            let matches = self.walk(pid, keys, bs);
            let depth = matches.first().map(|m| m.matched_tokens).unwrap_or(0);
            let better = match &best {
                None => true,
                Some((_, _, b)) => depth > b.first().map(|m| m.matched_tokens).unwrap_or(0),
            };
            if better {
                best = Some((bs, keys.len() as u32, matches));
            } else if let Some((_, _, b)) = best.as_mut() {
                // Same depth in another partition (e.g. another tenant under a wildcard): merge.
                if depth > 0 && b.first().map(|m| m.matched_tokens) == Some(depth) {
                    b.extend(matches);
                    sort_matches(b);
                }
            }
        }
        let (block_size, request_blocks, replicas) = best.unwrap_or_default();
        let deepest = replicas.first().map(|m| m.matched_tokens).unwrap_or(0);
        let prefix_match = deepest > 0 && deepest >= q.minimum_prefix_tokens;
        let reason = if prefix_match {
            String::new()
        } else if request_blocks == 0 {
            "RequestShorterThanOneBlock".to_string()
        } else if deepest == 0 {
            "NoReplicaHoldsPrefix".to_string()
        } else {
            "BelowMinimumPrefixTokens".to_string()
        };
        LookupResult {
            prefix_match,
            replicas: if prefix_match { replicas } else { Vec::new() },
            block_size,
            request_blocks,
            reason,
        }
    }

    /// Walks the chain in one partition; returns every replica with ≥ 1 matched block.
    fn walk(&self, pid: PartitionId, keys: &[u64], block_size: u32) -> Vec<ReplicaMatch> {
        // slot -> (depth, all T1 so far)
        let mut alive: HashMap<ReplicaSlot, (u32, bool)> = HashMap::new();
        let mut done: Vec<(ReplicaSlot, u32, bool)> = Vec::new();
        for (depth, key) in keys.iter().enumerate() {
            let holders = self
                .entries
                .get(&(pid, *key))
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            if depth == 0 {
                for h in holders {
                    alive.insert(h.replica, (1, h.tier == Tier::T1));
                }
            } else {
                alive.retain(
                    |slot, (d, t1)| match holders.iter().find(|h| h.replica == *slot) {
                        Some(h) => {
                            *d += 1;
                            *t1 &= h.tier == Tier::T1;
                            true
                        }
                        None => {
                            done.push((*slot, *d, *t1));
                            false
                        }
                    },
                );
            }
            if alive.is_empty() {
                break;
            }
        }
        done.extend(alive.into_iter().map(|(s, (d, t1))| (s, d, t1)));
        let mut out: Vec<ReplicaMatch> = done
            .into_iter()
            .filter_map(|(slot, depth, t1)| {
                let r = self.replicas.get(&slot)?;
                Some(ReplicaMatch {
                    replica: r.desc.replica.clone(),
                    stream_id: r.desc.stream_id.clone(),
                    node: r.node.clone(),
                    dp_rank: r.desc.dp_rank,
                    matched_blocks: depth,
                    matched_tokens: depth.saturating_mul(block_size),
                    tier: if t1 { Tier::T1 } else { Tier::T2 },
                    backend: r.desc.backend.clone(),
                })
            })
            .collect();
        sort_matches(&mut out);
        out
    }
}

fn sort_matches(v: &mut [ReplicaMatch]) {
    v.sort_by(|a, b| {
        b.matched_tokens
            .cmp(&a.matched_tokens)
            .then(a.tier.cmp(&b.tier))
            .then_with(|| a.stream_id.cmp(&b.stream_id))
    });
}
