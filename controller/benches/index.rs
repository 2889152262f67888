//! KV-prefix index benchmarks (issue 3 item 9) on the Mooncake FAST'25 conversation trace
//! (`testdata/traces/`, 512-token blocks; `bench/src/workload.rs` turns it into the
//! store/remove events of 1 000 simulated workers with LRU caches), plus the decoder on genuine
//! engine frames.
//!
//! `cargo bench -p ic-controller --bench index` — criterion's statistics for:
//!
//! - `index/ingest`: every event of the workload through `PrefixIndex::apply_delta` (one
//!   `StreamDelta` per event) into a fresh index; throughput in block operations;
//! - `index/score` and `index/lookup`: one request's chain against the final state (per-replica
//!   depths; and the named, ordered answer `LookupRoute` returns, capped like the router),
//!   cycling through the trace;
//! - `decode/golden_frames`: `decode_batch` over every live frame of the golden fixtures;
//!   throughput in block events.
//!
//! Knobs: `IC_BENCH_WORKERS` (1000), `IC_BENCH_CAPACITY` (1024 blocks per worker),
//! `IC_BENCH_COPIES` (1 trace copy). The comparison with dynamo-kv-router, the memory per entry
//! and the percentiles are in the `bench/` crate: `scripts/bench-kv.sh` prints that table.

// A benchmark harness, like a test: failing loudly on a broken setup is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../bench/src/workload.rs"]
#[allow(dead_code)]
mod workload;

use std::path::Path;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput};
use ic_controller::index::{LookupQuery, PrefixIndex};
use ic_shared::kv::decode::{decode_batch, KvEvent};
use ic_shared::proto::{self, kv_op::Op, KvOp, StreamDelta, StreamDescriptor, StreamSnapshot};
use workload::Event;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn descriptor(i: usize) -> StreamDescriptor {
    StreamDescriptor {
        stream_id: format!("bench/worker-{i:04}#0"),
        replica: format!("worker-{i:04}"),
        dp_rank: 0,
        tenant: "bench".into(),
        model: "mooncake".into(),
        hash_scheme: "vllm".into(),
        backend: String::new(),
        node: String::new(),
        offload_chunk_tokens: 0,
    }
}

fn golden_payloads() -> Vec<Vec<u8>> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = manifest.join("../testdata/kv-events");
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "json") || p.ends_with("hash-vectors.json") {
            continue;
        }
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for l in doc["live"].as_array().unwrap() {
            let h = l["frames_hex"][2].as_str().unwrap();
            out.push(
                (0..h.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
                    .collect(),
            );
        }
    }
    out
}

fn main() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let trace = workload::find_trace(manifest).expect("Mooncake trace (IC_TRACE)");
    let trace = workload::load_trace(&trace).unwrap();
    let w = workload::generate(
        &trace,
        workload::Config {
            workers: env_or("IC_BENCH_WORKERS", 1000),
            capacity: env_or("IC_BENCH_CAPACITY", 1024),
            copies: env_or("IC_BENCH_COPIES", 1),
            ..workload::Config::default()
        },
    );
    let bs = w.config.block_size;
    println!(
        "workload: {} events, {} block stores + {} removes, {} workers, final {} entries",
        w.events.len(),
        w.stored_blocks,
        w.removed_blocks,
        w.config.workers,
        w.final_entries
    );
    let descs: Vec<StreamDescriptor> = (0..w.config.workers).map(descriptor).collect();
    let snaps: Vec<StreamSnapshot> = descs
        .iter()
        .map(|d| StreamSnapshot {
            stream: Some(d.clone()),
            coverage: proto::Coverage::Exact as i32,
            ..Default::default()
        })
        .collect();
    let mut seqs = vec![0u64; w.config.workers];
    let deltas: Vec<StreamDelta> = w
        .events
        .iter()
        .map(|e| {
            let (worker, op) = match e {
                Event::Store { worker, blocks, .. } => (
                    *worker,
                    Op::Store(proto::StoreOp {
                        adapter: String::new(),
                        block_size: bs,
                        tier: proto::Tier::T1 as i32,
                        content_keys: blocks.iter().map(|b| b.key).collect(),
                    }),
                ),
                Event::Remove { worker, blocks } => (
                    *worker,
                    Op::Remove(proto::RemoveOp {
                        adapter: String::new(),
                        block_size: bs,
                        content_keys: blocks.iter().map(|b| b.key).collect(),
                    }),
                ),
            };
            seqs[worker] += 1;
            StreamDelta {
                stream: Some(descs[worker].clone()),
                seq: seqs[worker],
                ops: vec![KvOp { op: Some(op) }],
                last_event_unix_ms: 0,
                coverage: proto::Coverage::Exact as i32,
                coverage_reason: String::new(),
            }
        })
        .collect();
    let build = || {
        let mut ix = PrefixIndex::new();
        ix.resync_node("bench", &snaps);
        ix
    };

    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(20)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1));
    {
        let mut g = c.benchmark_group("index");
        g.throughput(Throughput::Elements(w.stored_blocks + w.removed_blocks));
        g.bench_function("ingest", |b| {
            b.iter_batched(
                build,
                |mut ix| {
                    for d in &deltas {
                        ix.apply_delta("bench", d).unwrap();
                    }
                    ix
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();
    }
    let mut ix = build();
    for d in &deltas {
        ix.apply_delta("bench", d).unwrap();
    }
    assert_eq!(ix.entry_count() as u64, w.final_entries);
    let queries: Vec<LookupQuery> = w
        .requests
        .iter()
        .map(|r| LookupQuery {
            tenant: "bench".into(),
            model: "mooncake".into(),
            hash_scheme: "vllm".into(),
            content_keys: r.iter().map(|b| b.key).collect(),
            block_size: Some(bs),
            ..Default::default()
        })
        .collect();
    {
        let mut g = c.benchmark_group("index");
        g.throughput(Throughput::Elements(1));
        let mut i = 0usize;
        g.bench_function("score", |b| {
            b.iter(|| {
                i = (i + 1) % queries.len();
                ix.score(&queries[i]).unwrap()
            })
        });
        let capped: Vec<LookupQuery> = queries
            .iter()
            .map(|q| LookupQuery {
                max_replicas: ic_controller::router::DEFAULT_MAX_REPLICAS,
                ..q.clone()
            })
            .collect();
        let mut i = 0usize;
        g.bench_function("lookup", |b| {
            b.iter(|| {
                i = (i + 1) % capped.len();
                ix.lookup(&capped[i])
            })
        });
        g.finish();
    }
    {
        let payloads = golden_payloads();
        let blocks: u64 = payloads
            .iter()
            .filter_map(|p| decode_batch(p).ok())
            .map(|b| {
                b.events
                    .iter()
                    .map(|e| match e {
                        KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
                        KvEvent::BlockRemoved(r) => r.block_hashes.len() as u64,
                        KvEvent::AllBlocksCleared { .. } => 1,
                    })
                    .sum::<u64>()
            })
            .sum();
        let mut g = c.benchmark_group("decode");
        g.throughput(Throughput::Elements(blocks));
        g.bench_function("golden_frames", |b| {
            b.iter(|| {
                for p in &payloads {
                    std::hint::black_box(decode_batch(std::hint::black_box(p)).ok());
                }
            })
        });
        g.finish();
    }
    c.final_summary();
}
