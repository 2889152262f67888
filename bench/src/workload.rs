//! The benchmark workload: the Mooncake FAST'25 conversation trace replayed as KV-cache store and
//! remove events of simulated engine workers, identical for every indexer under test.
//!
//! Shared by `controller/benches/index.rs` (criterion, our index) and the `bench/` crate (our
//! index and `dynamo-kv-router` side by side); it depends only on `std`, `serde_json` and
//! `xxhash-rust`.
//!
//! Model:
//!
//! - The trace (`hash_ids` per request; one id = one 512-token block; equal ids = a shared prefix
//!   block) is read once and may be duplicated `copies` times with disjoint ids (copy *c* adds
//!   `c × (max id + 1)` to every id except block 0 of each request — the shared system prompt).
//! - Request *i* goes to worker `splitmix64(seed ^ i) % workers` (random routing, so popular
//!   prefixes land on many workers).
//! - Each worker caches at most `capacity` blocks with LRU eviction; a request's blocks are
//!   touched leaf first so its root is the most recent (engines evict leaves before roots).
//!   Missing blocks are stored as runs (one **store** event per run of consecutive missing
//!   blocks, with its parent); evictions are one **remove** event per request.
//! - Content keys are chained over the ids exactly as the agent chains over token ids
//!   (`XXH3-64(id as 8 LE bytes, seed = parent key)`, root seed `ROOT`).

use std::collections::{HashMap, VecDeque};
use std::path::Path;

/// The content-key chain root (ic_shared::kv::content_key::ROOT).
pub const ROOT: u64 = 0x6963_2d6b_762d_7631;

/// Workload knobs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Simulated engine workers (replicas).
    pub workers: usize,
    /// Blocks each worker can cache (LRU).
    pub capacity: usize,
    /// Trace copies with disjoint ids.
    pub copies: usize,
    /// Routing seed.
    pub seed: u64,
    /// Tokens per block (512 for this trace).
    pub block_size: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers: 1000,
            capacity: 1024,
            copies: 4,
            seed: 0x5eed,
            block_size: 512,
        }
    }
}

/// One block of an event: the trace id (what a hash-of-tokens indexer gets as its local block
/// hash) and our chained content key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// Global block id (trace id plus copy offset).
    pub id: u64,
    /// Our chained content key.
    pub key: u64,
}

/// One engine event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A run of newly cached blocks; `parent` is the block before the run (None at block 0).
    Store {
        /// Worker index.
        worker: usize,
        /// Block before the run.
        parent: Option<Block>,
        /// The run, first block first; `position` is the run's first block index in the chain.
        blocks: Vec<Block>,
        /// Chain position of the first block of the run.
        position: usize,
    },
    /// Evicted blocks.
    Remove {
        /// Worker index.
        worker: usize,
        /// Evicted blocks.
        blocks: Vec<Block>,
    },
}

/// The generated workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Events in order.
    pub events: Vec<Event>,
    /// Every request's chain (ids and keys), in trace order (all copies).
    pub requests: Vec<Vec<Block>>,
    /// Block stores (blocks, not events).
    pub stored_blocks: u64,
    /// Block removes.
    pub removed_blocks: u64,
    /// (block, worker) entries held at the end.
    pub final_entries: u64,
    /// Distinct blocks held at the end.
    pub final_blocks: u64,
    /// The config used.
    pub config: Config,
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Content key of block `id` under `parent`.
pub fn key(parent: u64, id: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&id.to_le_bytes(), parent)
}

/// Reads the trace's `hash_ids` (one JSON object per line).
pub fn load_trace(path: &Path) -> Result<Vec<Vec<u64>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        let ids = v
            .get("hash_ids")
            .and_then(|h| h.as_array())
            .ok_or_else(|| format!("line {}: no hash_ids", i + 1))?
            .iter()
            .map(|x| x.as_u64().ok_or_else(|| format!("line {}: bad id", i + 1)))
            .collect::<Result<Vec<u64>, String>>()?;
        out.push(ids);
    }
    Ok(out)
}

/// Finds the trace file: `$IC_TRACE`, else `$IC_FIXTURES_DIR/traces/…`, else
/// `testdata/traces/mooncake-fast25-conversation.jsonl` in an ancestor of `start` (the repository).
pub fn find_trace(start: &Path) -> Option<std::path::PathBuf> {
    if let Ok(p) = std::env::var("IC_TRACE") {
        return Some(p.into());
    }
    if let Ok(dir) = std::env::var("IC_FIXTURES_DIR") {
        return Some(Path::new(&dir).join("traces/mooncake-fast25-conversation.jsonl"));
    }
    start
        .ancestors()
        .map(|a| a.join("testdata/traces/mooncake-fast25-conversation.jsonl"))
        .find(|p| p.is_file())
}

/// A worker's LRU cache of block ids.
#[derive(Default)]
struct Lru {
    stamp: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    clock: u64,
}

impl Lru {
    fn touch(&mut self, id: u64) {
        self.clock += 1;
        self.stamp.insert(id, self.clock);
        self.order.push_back((self.clock, id));
    }

    fn evict(&mut self) -> Option<u64> {
        while let Some((t, id)) = self.order.pop_front() {
            if self.stamp.get(&id) == Some(&t) {
                self.stamp.remove(&id);
                return Some(id);
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.stamp.len()
    }
}

/// Generates the workload from the trace's requests.
pub fn generate(trace: &[Vec<u64>], config: Config) -> Workload {
    let max_id = trace.iter().flatten().copied().max().unwrap_or(0);
    let mut keys: HashMap<u64, u64> = HashMap::new();
    let mut requests = Vec::with_capacity(trace.len() * config.copies);
    for copy in 0..config.copies as u64 {
        for ids in trace {
            let mut parent = ROOT;
            let chain: Vec<Block> = ids
                .iter()
                .enumerate()
                .map(|(pos, id)| {
                    let gid = if pos == 0 {
                        *id
                    } else {
                        id + copy * (max_id + 1)
                    };
                    let k = *keys.entry(gid).or_insert_with(|| key(parent, gid));
                    parent = k;
                    Block { id: gid, key: k }
                })
                .collect();
            requests.push(chain);
        }
    }
    let by_id: HashMap<u64, u64> = keys;
    let mut lrus: Vec<Lru> = (0..config.workers).map(|_| Lru::default()).collect();
    let mut events = Vec::new();
    let (mut stored, mut removed) = (0u64, 0u64);
    for (i, chain) in requests.iter().enumerate() {
        let worker = (splitmix64(config.seed ^ i as u64) % config.workers as u64) as usize;
        let lru = &mut lrus[worker];
        // Runs of missing blocks, each with its parent.
        let mut run: Vec<Block> = Vec::new();
        let mut run_start = 0usize;
        for (pos, b) in chain.iter().enumerate() {
            if lru.stamp.contains_key(&b.id) {
                if !run.is_empty() {
                    stored += run.len() as u64;
                    events.push(Event::Store {
                        worker,
                        parent: run_start.checked_sub(1).map(|p| chain[p]),
                        blocks: std::mem::take(&mut run),
                        position: run_start,
                    });
                }
            } else {
                if run.is_empty() {
                    run_start = pos;
                }
                run.push(*b);
            }
        }
        if !run.is_empty() {
            stored += run.len() as u64;
            events.push(Event::Store {
                worker,
                parent: run_start.checked_sub(1).map(|p| chain[p]),
                blocks: run,
                position: run_start,
            });
        }
        for b in chain.iter().rev() {
            lru.touch(b.id);
        }
        let mut gone = Vec::new();
        while lru.len() > config.capacity {
            match lru.evict() {
                Some(id) => gone.push(Block {
                    id,
                    key: by_id.get(&id).copied().unwrap_or(0),
                }),
                None => break,
            }
        }
        if !gone.is_empty() {
            removed += gone.len() as u64;
            events.push(Event::Remove {
                worker,
                blocks: gone,
            });
        }
    }
    let final_entries: u64 = lrus.iter().map(|l| l.len() as u64).sum();
    let mut distinct = std::collections::HashSet::new();
    for l in &lrus {
        distinct.extend(l.stamp.keys().copied());
    }
    Workload {
        events,
        requests,
        stored_blocks: stored,
        removed_blocks: removed,
        final_entries,
        final_blocks: distinct.len() as u64,
        config,
    }
}

/// Nearest-rank percentile of sorted nanosecond samples.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
