//! A stream's state as kept on disk across agent restarts (`kv::persist` stores it): the plain
//! records of [`PersistedState`] and the conversions to and from [`StreamState`].

use std::collections::HashMap;
use std::sync::Arc;

use ic_shared::kv::coverage;

use super::{copies, Block, EntryKey, Orphan, StreamConfig, StreamState, PARTIAL};

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

impl StreamState {
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
                let (ai, bs) = match b
                    .entry()
                    .and_then(|e| self.classes.list.get(e.class as usize))
                {
                    Some((adapter, bs)) => (adapter_ix(adapter), *bs),
                    None => (u32::MAX, 0),
                };
                (g, h, b.key, ai, bs, u32::from(b.gpu), u32::from(b.offload))
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
                    class: st.classes.of(adapters.get(ai as usize)?, bs),
                    key,
                })
            };
            if let Some(e) = &entry {
                let hd = st.held.entry(*e).or_default();
                hd.gpu += u32::from(gpu > 0);
                hd.offload += u32::from(offload > 0);
            }
            st.indexed_groups.insert(g);
            st.blocks.insert(
                (g, h),
                Block {
                    key,
                    class: entry.map_or(PARTIAL, |e| e.class),
                    gpu: copies(gpu),
                    offload: copies(offload),
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
}
