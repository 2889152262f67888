//! The simulated fleet: which nodes, engine streams and blocks exist, derived from a few numbers
//! so that every agent can rebuild its state (for a resync) and the lookup client can ask for a
//! prefix it knows a replica holds, without storing a single key.
//!
//! Each node runs `streams_per_agent` engine pods (one per GPU, data-parallel rank 0), in the
//! namespace (tenant) `tenant-NN` of its node. A stream holds `sequences` cached prompts; each
//! prompt's block chain is the tenant's shared system prompt (`shared_prefix` blocks, held by
//! every replica of the tenant) followed by `seq_blocks` blocks of its own. Keys are splitmix64 of
//! the position under a per-stream (or per-tenant) seed: uniform like our content keys.
//! Churn evicts a stream's oldest prompt and stores a new one (an epoch counter per agent).

use ic_shared::plan::EnginePlan;
use ic_shared::proto::{self, BlockEntry, StreamDescriptor, StreamSnapshot};

/// splitmix64 of `x ^ seed`: uniform 64-bit keys, like our XXH3 content keys, at a few
/// instructions each (the generator builds 100 M of them per storm).
fn mix(x: u64, seed: u64) -> u64 {
    let mut z = (x ^ seed.wrapping_mul(0xd6e8_feb8_6659_fd93)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Model id every engine serves.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// vLLM's default block size, tokens.
pub const BLOCK_SIZE: u32 = 16;

/// Shape of the fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Node agents.
    pub agents: usize,
    /// Engine streams (GPUs) per node.
    pub streams_per_agent: usize,
    /// Tenants (namespaces) the nodes are spread over, round robin.
    pub tenants: usize,
    /// Blocks of each tenant's shared system prompt.
    pub shared_prefix: usize,
    /// Blocks of each prompt after the shared prefix.
    pub seq_blocks: usize,
    /// Prompts per stream.
    pub sequences: usize,
}

impl FleetSpec {
    /// A spec with about `entries_per_agent` (block, replica) entries per node.
    pub fn new(
        agents: usize,
        entries_per_agent: usize,
        streams_per_agent: usize,
        tenants: usize,
        shared_prefix: usize,
        seq_blocks: usize,
    ) -> Self {
        let per_stream = entries_per_agent / streams_per_agent.max(1);
        let sequences = (per_stream.saturating_sub(shared_prefix) / seq_blocks.max(1)).max(1);
        FleetSpec {
            agents,
            streams_per_agent: streams_per_agent.max(1),
            tenants: tenants.max(1),
            shared_prefix,
            seq_blocks: seq_blocks.max(1),
            sequences,
        }
    }

    /// Entries one stream holds.
    pub fn entries_per_stream(&self) -> usize {
        self.shared_prefix + self.sequences * self.seq_blocks
    }

    /// Entries of the whole fleet: what the index holds once every agent has resynced.
    pub fn total_entries(&self) -> u64 {
        (self.agents * self.streams_per_agent * self.entries_per_stream()) as u64
    }

    /// Node name of agent `a`.
    pub fn node(&self, a: usize) -> String {
        format!("fleet-{a:05}")
    }

    /// Tenant (namespace) of agent `a`'s pods.
    pub fn tenant(&self, a: usize) -> String {
        format!("tenant-{:02}", a % self.tenants)
    }

    /// The engine pod of agent `a`'s GPU `g`.
    pub fn engine(&self, a: usize, g: usize) -> EnginePlan {
        EnginePlan {
            namespace: self.tenant(a),
            pod: format!("vllm-{a:05}-{g}"),
            model: MODEL.to_string(),
            ..Default::default()
        }
    }

    fn descriptor(&self, a: usize, g: usize) -> StreamDescriptor {
        let e = self.engine(a, g);
        StreamDescriptor {
            stream_id: e.stream_id(0),
            replica: e.replica_id(0),
            dp_rank: 0,
            tenant: e.namespace,
            model: e.model,
            hash_scheme: "vllm".into(),
            backend: String::new(),
            node: String::new(),
            offload_chunk_tokens: 0,
        }
    }

    /// Block `b` of the shared prefix of agent `a`'s tenant.
    fn shared_key(&self, a: usize, b: usize) -> u64 {
        mix(b as u64, 0x5eed_0000 + (a % self.tenants) as u64)
    }

    /// Block `b` of prompt `s` (counted since the stream started: churn moves the window).
    fn own_key(&self, a: usize, g: usize, s: u64, b: usize) -> u64 {
        let seed = ((a as u64) << 20) | ((g as u64) << 8) | 0x01;
        mix((s << 16) | b as u64, seed)
    }

    /// The block chain of prompt `s` of stream (a, g): shared prefix, then its own blocks.
    pub fn chain(&self, a: usize, g: usize, s: u64) -> Vec<u64> {
        (0..self.shared_prefix)
            .map(|b| self.shared_key(a, b))
            .chain((0..self.seq_blocks).map(|b| self.own_key(a, g, s, b)))
            .collect()
    }

    /// Keys of prompt `s` of stream (a, g) after the shared prefix (what churn stores/removes).
    pub fn own_keys(&self, a: usize, g: usize, s: u64) -> Vec<u64> {
        (0..self.seq_blocks)
            .map(|b| self.own_key(a, g, s, b))
            .collect()
    }

    /// Agent `a`'s full state at `epoch` (prompts `epoch .. epoch + sequences` live), every
    /// stream's snapshot at delta seq `epoch`.
    pub fn snapshots(&self, a: usize, epoch: u64) -> Vec<StreamSnapshot> {
        (0..self.streams_per_agent)
            .map(|g| {
                let mut entries = Vec::with_capacity(self.entries_per_stream());
                let entry = |k: u64| BlockEntry {
                    adapter: String::new(),
                    block_size: BLOCK_SIZE,
                    content_key: k,
                    tier: proto::Tier::T1 as i32,
                };
                entries.extend((0..self.shared_prefix).map(|b| entry(self.shared_key(a, b))));
                for s in epoch..epoch + self.sequences as u64 {
                    entries.extend((0..self.seq_blocks).map(|b| entry(self.own_key(a, g, s, b))));
                }
                StreamSnapshot {
                    stream: Some(self.descriptor(a, g)),
                    seq: epoch,
                    entries,
                    last_event_unix_ms: ic_shared::now_unix_ms(),
                    stale: false,
                    coverage: proto::Coverage::Exact as i32,
                    coverage_reason: String::new(),
                }
            })
            .collect()
    }

    /// The delta taking every stream of agent `a` from `epoch` to `epoch + 1`: the oldest
    /// prompt removed, a new one stored.
    pub fn churn(&self, a: usize, epoch: u64) -> Vec<proto::StreamDelta> {
        use proto::kv_op::Op;
        (0..self.streams_per_agent)
            .map(|g| proto::StreamDelta {
                stream: Some(self.descriptor(a, g)),
                seq: epoch + 1,
                ops: vec![
                    proto::KvOp {
                        op: Some(Op::Remove(proto::RemoveOp {
                            adapter: String::new(),
                            block_size: BLOCK_SIZE,
                            content_keys: self.own_keys(a, g, epoch),
                        })),
                    },
                    proto::KvOp {
                        op: Some(Op::Store(proto::StoreOp {
                            adapter: String::new(),
                            block_size: BLOCK_SIZE,
                            tier: proto::Tier::T1 as i32,
                            content_keys: self.own_keys(a, g, epoch + self.sequences as u64),
                        })),
                    },
                ],
                last_event_unix_ms: ic_shared::now_unix_ms(),
                coverage: proto::Coverage::Exact as i32,
                coverage_reason: String::new(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_hold_what_the_totals_say_and_churn_keeps_the_count() {
        let s = FleetSpec::new(3, 1000, 4, 2, 8, 16);
        assert_eq!(s.entries_per_stream(), 8 + 15 * 16);
        let snaps = s.snapshots(1, 0);
        assert_eq!(snaps.len(), 4);
        assert!(snaps
            .iter()
            .all(|x| x.entries.len() == s.entries_per_stream()));
        // The chain of a live prompt is in the snapshot, shared prefix first.
        let chain = s.chain(1, 2, 3);
        let keys: std::collections::HashSet<u64> =
            snaps[2].entries.iter().map(|e| e.content_key).collect();
        assert!(chain.iter().all(|k| keys.contains(k)));
        // Agents of one tenant share the prefix, other tenants do not.
        assert_eq!(s.chain(0, 0, 0)[..8], s.chain(2, 1, 5)[..8]);
        assert_ne!(s.chain(0, 0, 0)[0], s.chain(1, 0, 0)[0]);
        let d = s.churn(1, 0);
        assert_eq!(d[0].seq, 1);
        let after: std::collections::HashSet<u64> = s.snapshots(1, 1)[0]
            .entries
            .iter()
            .map(|e| e.content_key)
            .collect();
        assert_eq!(after.len(), s.entries_per_stream());
        assert!(!after.contains(&s.own_keys(1, 0, 0)[0]));
        assert!(after.contains(&s.own_keys(1, 0, 15)[0]));
    }
}
