//! Lookups racing ingest, through the controller's own shared state
//! (`ic_controller::state::Shared`: the index behind its `RwLock`, the gauges refreshed per
//! batch as the ingest service does).
//!
//! - **racing**: one thread replays the workload's deltas flat out (`batch` deltas per write
//!   lock, like one agent `KvDeltaBatch`; each pass continues every stream's seq, on top of the
//!   full state), while another thread runs the router's lookups back to back (read lock, then
//!   `PrefixIndex::lookup`, capped at `DEFAULT_MAX_REPLICAS`). Reported: lookup p50 / p99 /
//!   max including the lock wait, and the ingest rate reached meanwhile.
//! - **resync stall**: an index of `nodes × per_node` streams; one thread resyncs node after
//!   node (each stream with 8 blocks of a request chain after its shared block 0) while lookups
//!   from block 1 run. Reported: how long each resync holds the write lock (p50 / p99 / max)
//!   and the lookup p99 / max meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ic_controller::index::LookupQuery;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::proto::{self, StreamDelta, StreamDescriptor, StreamSnapshot};

use crate::workload::percentile;

/// Lookup latencies (sorted ns) and what ran beside them.
#[derive(Debug, Default)]
pub struct RaceReport {
    /// Lookup latency including the read-lock wait, sorted ns.
    pub lookup_ns: Vec<u64>,
    /// Block operations per second the writer applied meanwhile.
    pub ingest_rate: f64,
    /// Write-lock hold per writer step, sorted ns.
    pub hold_ns: Vec<u64>,
    /// Streams in the index (the resync scenario).
    pub streams: usize,
}

impl RaceReport {
    /// Lookup percentile, µs.
    pub fn lookup_us(&self, q: f64) -> f64 {
        percentile(&self.lookup_ns, q) as f64 / 1e3
    }
    /// Write-lock hold percentile, µs.
    pub fn hold_us(&self, q: f64) -> f64 {
        percentile(&self.hold_ns, q) as f64 / 1e3
    }
}

fn shared() -> Result<Arc<Shared>, String> {
    Shared::new(LookupPolicy::default())
        .map(Arc::new)
        .map_err(|e| format!("shared state: {e}"))
}

/// Runs the lookups on this thread until `lookups` ran, while `writer` runs on another.
fn race(
    shared: &Arc<Shared>,
    queries: &[LookupQuery],
    lookups: usize,
    writer: impl FnOnce(&AtomicBool) + Send,
) -> Vec<u64> {
    let stop = AtomicBool::new(false);
    let mut ns = Vec::with_capacity(lookups);
    std::thread::scope(|s| {
        s.spawn(|| writer(&stop));
        for q in queries.iter().cycle().take(lookups) {
            let t = Instant::now();
            let r = shared.index.read().lookup(q);
            ns.push(t.elapsed().as_nanos() as u64);
            std::hint::black_box(r);
        }
        stop.store(true, Ordering::Relaxed);
    });
    ns.sort_unstable();
    ns
}

/// Lookups while the workload's deltas are applied flat out (see the module docs).
pub fn racing(
    deltas: &[StreamDelta],
    snaps: &[StreamSnapshot],
    queries: &[LookupQuery],
    block_ops_per_pass: u64,
    batch: usize,
    lookups: usize,
) -> Result<RaceReport, String> {
    let shared = shared()?;
    // Start from the full state, so lookups see what they would see in steady state.
    {
        let mut ix = shared.index.write();
        ix.resync_node("bench", snaps);
        for d in deltas {
            let _ = ix.apply_delta("bench", d);
        }
    }
    // Deltas per stream in one pass: pass k continues each stream's seq where pass k-1 ended,
    // so the replay runs on top of the full state (stores of held blocks, then the workload's
    // evictions) and lookups see the steady state throughout.
    let mut per_stream: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for d in deltas {
        if let Some(s) = d.stream.as_ref() {
            *per_stream.entry(s.stream_id.as_str()).or_default() += 1;
        }
    }
    let mut ops_done = 0u64;
    let mut busy = 0f64;
    let mut holds = Vec::new();
    let lookup_ns = race(&shared, queries, lookups, |stop| {
        let started = Instant::now();
        let mut pass = 1u64;
        'passes: while !stop.load(Ordering::Relaxed) {
            for chunk in deltas.chunks(batch.max(1)) {
                if stop.load(Ordering::Relaxed) {
                    break 'passes;
                }
                let chunk: Vec<StreamDelta> = chunk
                    .iter()
                    .map(|d| {
                        let n = d
                            .stream
                            .as_ref()
                            .and_then(|s| per_stream.get(s.stream_id.as_str()))
                            .copied()
                            .unwrap_or(0);
                        StreamDelta {
                            seq: d.seq + pass * n,
                            ..d.clone()
                        }
                    })
                    .collect();
                let t = Instant::now();
                {
                    let mut ix = shared.index.write();
                    for d in &chunk {
                        let _ = ix.apply_delta("bench", d);
                    }
                    shared.update_index_gauges(&ix);
                }
                holds.push(t.elapsed().as_nanos() as u64);
            }
            ops_done += block_ops_per_pass;
            pass += 1;
        }
        busy = started.elapsed().as_secs_f64();
    });
    holds.sort_unstable();
    Ok(RaceReport {
        lookup_ns,
        ingest_rate: ops_done as f64 / busy.max(1e-9),
        hold_ns: holds,
        streams: snaps.len(),
    })
}

fn stream(node: usize, i: usize) -> StreamDescriptor {
    StreamDescriptor {
        stream_id: format!("ns-{node:04}/pod-{i:03}#0"),
        replica: format!("pod-{i:03}"),
        dp_rank: 0,
        tenant: "bench".into(),
        model: "mooncake".into(),
        hash_scheme: "vllm".into(),
        backend: String::new(),
        node: format!("node-{node:04}"),
        offload_chunk_tokens: 0,
    }
}

/// Snapshots of one node's streams, each holding `keys_per` keys of a workload chain.
fn node_snaps(
    node: usize,
    per_node: usize,
    chains: &[Vec<u64>],
    block_size: u32,
    keys_per: usize,
) -> Vec<StreamSnapshot> {
    (0..per_node)
        .map(|i| {
            let chain = chains
                .get((node * per_node + i) % chains.len().max(1))
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            StreamSnapshot {
                stream: Some(stream(node, i)),
                seq: 0,
                entries: chain
                    .iter()
                    .take(keys_per)
                    .map(|k| proto::BlockEntry {
                        adapter: String::new(),
                        block_size,
                        content_key: *k,
                        tier: proto::Tier::T1 as i32,
                    })
                    .collect(),
                last_event_unix_ms: 0,
                stale: false,
                coverage: proto::Coverage::Exact as i32,
                coverage_reason: String::new(),
            }
        })
        .collect()
}

/// Resyncs node after node of a `nodes × per_node`-stream index while lookups run.
pub fn resync_stall(
    chains: &[Vec<u64>],
    block_size: u32,
    queries: &[LookupQuery],
    nodes: usize,
    per_node: usize,
    lookups: usize,
) -> Result<RaceReport, String> {
    const KEYS_PER_STREAM: usize = 8;
    let shared = shared()?;
    // Each stream holds blocks 1..=8 of a request's chain, and lookups start at block 1: the
    // trace's block 0 (a system prompt every request shares) would make every lookup list
    // all streams.
    let tails: Vec<Vec<u64>> = chains
        .iter()
        .filter(|c| c.len() > 1)
        .map(|c| c.get(1..).unwrap_or(&[]).to_vec())
        .collect();
    let queries: Vec<LookupQuery> = queries
        .iter()
        .filter(|q| q.content_keys.len() > 1)
        .map(|q| LookupQuery {
            content_keys: q.content_keys.get(1..).unwrap_or(&[]).to_vec(),
            ..q.clone()
        })
        .collect();
    let chains = tails.as_slice();
    let all: Vec<Vec<StreamSnapshot>> = (0..nodes)
        .map(|n| node_snaps(n, per_node, chains, block_size, KEYS_PER_STREAM))
        .collect();
    {
        let mut ix = shared.index.write();
        for (n, snaps) in all.iter().enumerate() {
            ix.resync_node(&format!("node-{n:04}"), snaps);
        }
        shared.update_index_gauges(&ix);
    }
    let streams = shared.index.read().replica_count();
    let mut holds = Vec::new();
    let lookup_ns = race(&shared, &queries, lookups, |stop| {
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let Some(snaps) = all.get(n % nodes.max(1)) else {
                break;
            };
            let t = Instant::now();
            {
                let mut ix = shared.index.write();
                ix.resync_node(&format!("node-{:04}", n % nodes.max(1)), snaps);
                shared.update_index_gauges(&ix);
            }
            holds.push(t.elapsed().as_nanos() as u64);
            n += 1;
        }
    });
    holds.sort_unstable();
    Ok(RaceReport {
        lookup_ns,
        ingest_rate: 0.0,
        hold_ns: holds,
        streams,
    })
}
