//! `--stable`: the same phases as the wall-clock table, each run alone in its own process under
//! valgrind's callgrind with cache and branch simulation, so the figures count work, not
//! seconds: the machine's load cannot move them (issue 41).
//!
//! The driver ([`drive`]) starts one `valgrind --tool=callgrind --instr-atstart=no …
//! ic-bench --stable-phase <phase>` per phase. The child ([`run_phase`]) builds its inputs with
//! instrumentation off (valgrind runs it at a few times native cost), switches instrumentation
//! on with a callgrind client request around the measured code only, and dumps:
//!
//! - ingest phases: one dump for the whole replay of the workload's events (per block op =
//!   that dump / block operations);
//! - lookup phases: one warm-up pass over every query (the simulated caches start empty when
//!   instrumentation starts), then one dump per lookup, so the p50 / p99 are of per-lookup costs.
//!
//! Each dump's `totals:` line gives instructions (`Ir`), L1 misses (`I1mr + D1mr + D1mw`),
//! last-level misses (`ILmr + DLmr + DLmw`) and mispredicts (`Bcm + Bim`); the cycle estimate
//! is `Ir + 10 × (L1 misses + mispredicts) + 100 × LL misses`. The simulated caches are pinned
//! (see [`CACHE_ARGS`]) so the figure does not depend on the host's cache sizes either.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crabgrind::callgrind;
use dynamo_kv_router::indexer::KvIndexerInterface;
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree, SyncIndexer, ThreadPoolIndexer};
use ic_controller::index::{LookupQuery, PrefixIndex};
use ic_shared::proto::{StreamDelta, StreamSnapshot};

use crate::workload::{percentile, Workload};

/// The simulated caches: 32 KiB 8-way L1 instruction and data caches and a 32 MiB 16-way last
/// level, 64-byte lines (the L1 of current x86 server cores and a server L3). Pinned so that two
/// hosts with different caches measure the same figure; `IC_BENCH_VALGRIND_ARGS` appends other
/// valgrind options (a later `--LL=…` wins).
pub const CACHE_ARGS: [&str; 3] = [
    "--I1=32768,8,64",
    "--D1=32768,8,64",
    "--LL=33554432,16,64",
];

/// One measured phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Our `PrefixIndex::apply_delta`, one delta per event.
    IngestOurs,
    /// dynamo `RadixTree::apply_event`.
    IngestRadix,
    /// dynamo CRTC behind a one-thread `ThreadPoolIndexer`: `enqueue_event`, then `flush`.
    IngestCrtc,
    /// Our `PrefixIndex::score` (per-replica depths).
    ScoreOurs,
    /// Our `PrefixIndex::lookup` as the router calls it (named, ordered, ≤ 32 replicas).
    AnswerOurs,
    /// dynamo `RadixTree::find_matches(…, false)`.
    ScoreRadix,
    /// dynamo CRTC `find_matches(…, false)`.
    ScoreCrtc,
}

impl Phase {
    /// Every phase, in the order the table prints them.
    pub const ALL: [Phase; 7] = [
        Phase::IngestOurs,
        Phase::IngestRadix,
        Phase::IngestCrtc,
        Phase::ScoreOurs,
        Phase::AnswerOurs,
        Phase::ScoreRadix,
        Phase::ScoreCrtc,
    ];

    /// The flag value (`--stable-phase <name>`, `--stable-phases a,b`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::IngestOurs => "ingest-ours",
            Phase::IngestRadix => "ingest-radix",
            Phase::IngestCrtc => "ingest-crtc",
            Phase::ScoreOurs => "score-ours",
            Phase::AnswerOurs => "answer-ours",
            Phase::ScoreRadix => "score-radix",
            Phase::ScoreCrtc => "score-crtc",
        }
    }

    /// Parses a flag value; `Err` names the valid ones.
    pub fn parse(s: &str) -> Result<Phase, String> {
        Phase::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
                format!("unknown phase {s:?} (one of {})", names.join(", "))
            })
    }

    fn is_ingest(self) -> bool {
        matches!(
            self,
            Phase::IngestOurs | Phase::IngestRadix | Phase::IngestCrtc
        )
    }

    fn label(self) -> &'static str {
        match self {
            Phase::IngestOurs => "ours",
            Phase::IngestRadix | Phase::ScoreRadix => "dynamo RadixTree",
            Phase::IngestCrtc | Phase::ScoreCrtc => "dynamo CRTC (1 thread)",
            Phase::ScoreOurs => "ours (score)",
            Phase::AnswerOurs => "ours (router answer, ≤ 32, named, ordered)",
        }
    }
}

// ---------------------------------------------------------------- child

/// Runs `f` with callgrind's instrumentation on and dumps its cost (one dump).
fn measured<R>(f: impl FnOnce() -> R) -> R {
    callgrind::start_instrumentation();
    callgrind::zero_stats();
    let r = f();
    callgrind::dump_stats(None);
    callgrind::stop_instrumentation();
    r
}

/// One warm-up pass over `items`, then one dump per item: the cost of `f(item)` (its result
/// dropped inside the measured window, as an answer is).
fn per_op<T, R>(items: &[T], mut f: impl FnMut(&T) -> R) {
    callgrind::start_instrumentation();
    for it in items {
        std::hint::black_box(f(it));
    }
    for it in items {
        callgrind::zero_stats();
        let r = f(it);
        drop(std::hint::black_box(r));
        callgrind::dump_stats(None);
    }
    callgrind::stop_instrumentation();
}

/// The child side of `--stable`: builds the phase's inputs uninstrumented and measures only the
/// phase (see the module docs). Without valgrind the client requests do nothing and this simply
/// runs the phase.
#[allow(clippy::too_many_arguments)]
pub fn run_phase(
    phase: Phase,
    w: &Workload,
    picks: &[usize],
    deltas: &[StreamDelta],
    snaps: &[StreamSnapshot],
    rt: &tokio::runtime::Runtime,
) -> Result<(), String> {
    let bs = w.config.block_size;
    let ours = || {
        let (ix, _, _) = crate::build_ours(deltas, snaps);
        ix
    };
    let dynamo_events = || crate::dynamo_events(w, &crate::seq_hashes(w));
    match phase {
        Phase::IngestOurs => {
            let mut ix = PrefixIndex::new();
            ix.resync_node("bench", snaps);
            let refused = measured(|| {
                let mut refused = 0u64;
                for d in deltas {
                    if ix.apply_delta("bench", d).is_err() {
                        refused += 1;
                    }
                }
                refused
            });
            check_entries(ix.entry_count() as u64, w, refused)?;
        }
        Phase::IngestRadix => {
            let owned = dynamo_events();
            let mut tree = RadixTree::new();
            measured(|| {
                for e in owned {
                    let _ = tree.apply_event(e);
                }
            });
            std::hint::black_box(&tree);
        }
        Phase::IngestCrtc => {
            let owned = dynamo_events();
            let idx = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, bs);
            let failed = measured(|| {
                let mut failed = 0u64;
                for e in owned {
                    if idx.enqueue_event(e).is_err() {
                        failed += 1;
                    }
                }
                rt.block_on(idx.flush());
                failed
            });
            idx.shutdown();
            if failed > 0 {
                return Err(format!("CRTC refused {failed} events"));
            }
        }
        Phase::ScoreOurs => {
            let ix = ours();
            let queries = crate::ours_queries(w, picks);
            per_op(&queries, |q| ix.score(q));
        }
        Phase::AnswerOurs => {
            let ix = ours();
            let capped: Vec<LookupQuery> = crate::ours_queries(w, picks)
                .into_iter()
                .map(|q| LookupQuery {
                    max_replicas: ic_controller::router::DEFAULT_MAX_REPLICAS,
                    ..q
                })
                .collect();
            per_op(&capped, |q| ix.lookup(q));
        }
        Phase::ScoreRadix => {
            let (tree, _) = crate::build_radix(&dynamo_events());
            let seqs = crate::dynamo_seqs(w, picks);
            // RadixTree::find_matches takes the sequence by value: each copy is made outside
            // the measured window (so not through `per_op`, which measures all of `f`).
            callgrind::start_instrumentation();
            for s in &seqs {
                std::hint::black_box(tree.find_matches(s.clone(), false));
            }
            for s in &seqs {
                let input = s.clone();
                callgrind::zero_stats();
                let r = tree.find_matches(input, false);
                drop(std::hint::black_box(r));
                callgrind::dump_stats(None);
            }
            callgrind::stop_instrumentation();
        }
        Phase::ScoreCrtc => {
            let (idx, _, _) = crate::build_crtc(rt, &dynamo_events(), bs);
            let seqs = crate::dynamo_seqs(w, picks);
            per_op(&seqs, |s| idx.backend().find_matches(s, false));
            idx.shutdown();
        }
    }
    Ok(())
}

fn check_entries(got: u64, w: &Workload, refused: u64) -> Result<(), String> {
    if refused > 0 || got != w.final_entries {
        return Err(format!(
            "ours: {got} entries after ingest (expected {}), {refused} deltas refused",
            w.final_entries
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------- driver

/// One dump's counts.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cost {
    /// Instructions executed.
    pub ir: u64,
    /// L1 instruction + data read + data write misses.
    pub l1: u64,
    /// Last-level instruction + data read + data write misses.
    pub ll: u64,
    /// Conditional + indirect branch mispredicts.
    pub mispredicts: u64,
}

impl Cost {
    /// `Ir + 10 × (L1 misses + mispredicts) + 100 × LL misses`.
    pub fn cycles(&self) -> u64 {
        self.ir + 10 * (self.l1 + self.mispredicts) + 100 * self.ll
    }

    fn add(&mut self, o: &Cost) {
        self.ir += o.ir;
        self.l1 += o.l1;
        self.ll += o.ll;
        self.mispredicts += o.mispredicts;
    }
}

/// Reads a callgrind dump's `events:` and `totals:` (or `summary:`) lines.
pub fn parse_dump(text: &str) -> Result<Cost, String> {
    let mut events: Vec<&str> = Vec::new();
    let mut totals: Option<Vec<u64>> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("events:") {
            events = rest.split_whitespace().collect();
        } else if let Some(rest) = line
            .strip_prefix("totals:")
            .or_else(|| line.strip_prefix("summary:"))
        {
            let v: Result<Vec<u64>, _> = rest.split_whitespace().map(str::parse).collect();
            totals = Some(v.map_err(|e| format!("totals line {rest:?}: {e}"))?);
        }
    }
    let totals = totals.ok_or("no totals: line")?;
    let get = |name: &str| -> u64 {
        events
            .iter()
            .position(|e| *e == name)
            .and_then(|i| totals.get(i).copied())
            .unwrap_or(0)
    };
    if !events.contains(&"Ir") || !events.contains(&"D1mr") || !events.contains(&"Bcm") {
        return Err(format!(
            "events {events:?}: run with --cache-sim=yes --branch-sim=yes"
        ));
    }
    Ok(Cost {
        ir: get("Ir"),
        l1: get("I1mr") + get("D1mr") + get("D1mw"),
        ll: get("ILmr") + get("DLmr") + get("DLmw"),
        mispredicts: get("Bcm") + get("Bim"),
    })
}

/// A phase's result: the summed cost, the per-op cycle estimates (lookups) and the op count.
#[derive(Debug, Clone, Default)]
pub struct PhaseCost {
    /// Sum over the phase.
    pub total: Cost,
    /// Ops the total is divided by (block ops for ingest, lookups for lookups).
    pub ops: u64,
    /// Per-lookup cycle estimates, sorted (empty for ingest).
    pub per_op_cycles: Vec<u64>,
    /// Seconds the valgrind run took.
    pub wall_s: f64,
}

impl PhaseCost {
    fn per_op(&self, x: u64) -> f64 {
        x as f64 / self.ops.max(1) as f64
    }
    fn mean_cycles(&self) -> f64 {
        self.per_op(self.total.cycles())
    }
    fn p(&self, q: f64) -> u64 {
        percentile(&self.per_op_cycles, q)
    }
}

/// The dump files of one run (`<base>.1`, `<base>.2`, … and `<base>` itself), in dump order.
fn dumps(base: &Path) -> Result<Vec<PathBuf>, String> {
    let dir = base.parent().ok_or("dump base has no folder")?;
    let stem = base
        .file_name()
        .and_then(|s| s.to_str())
        .ok_or("dump base has no name")?;
    let mut numbered: Vec<(u64, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let p = e.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let name = p.file_name().and_then(|s| s.to_str()).unwrap_or("");
        if let Some(n) = name
            .strip_prefix(stem)
            .and_then(|r| r.strip_prefix('.'))
            .and_then(|r| r.parse::<u64>().ok())
        {
            numbered.push((n, p));
        }
    }
    numbered.sort();
    Ok(numbered.into_iter().map(|(_, p)| p).collect())
}

/// Runs one phase under callgrind and reads its dumps.
fn run_one(
    phase: Phase,
    dir: &Path,
    child_args: &[String],
    block_ops: u64,
) -> Result<PhaseCost, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let base = dir.join(format!("{}.callgrind", phase.name()));
    for old in dumps(&base)? {
        std::fs::remove_file(&old).map_err(|e| format!("{}: {e}", old.display()))?;
    }
    let _ = std::fs::remove_file(&base);
    let mut cmd = Command::new(std::env::var("IC_BENCH_VALGRIND").unwrap_or("valgrind".into()));
    cmd.args([
        "--tool=callgrind",
        "--cache-sim=yes",
        "--branch-sim=yes",
        "--instr-atstart=no",
    ])
    .args(CACHE_ARGS)
    .arg(format!("--callgrind-out-file={}", base.display()));
    if !phase.is_ingest() {
        // One small dump per lookup: function-level costs only.
        cmd.args(["--dump-instr=no", "--dump-line=no"]);
    }
    if let Ok(extra) = std::env::var("IC_BENCH_VALGRIND_ARGS") {
        cmd.args(extra.split_whitespace());
    }
    cmd.arg(&exe)
        .args(child_args)
        .args(["--stable-phase", phase.name(), "--prefault-mib", "0"]);
    let t = Instant::now();
    let out = cmd
        .output()
        .map_err(|e| format!("valgrind (IC_BENCH_VALGRIND names another): {e}"))?;
    let wall_s = t.elapsed().as_secs_f64();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: String = err.lines().rev().take(15).collect::<Vec<_>>().join("\n");
        return Err(format!("{} exited {}: {tail}", phase.name(), out.status));
    }
    let files = dumps(&base)?;
    let mut total = Cost::default();
    let mut per_op_cycles = Vec::with_capacity(files.len());
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let c = parse_dump(&text).map_err(|e| format!("{}: {e}", f.display()))?;
        total.add(&c);
        per_op_cycles.push(c.cycles());
    }
    if files.is_empty() {
        return Err(format!("{}: no dump under {}", phase.name(), dir.display()));
    }
    let ops = if phase.is_ingest() {
        per_op_cycles.clear();
        block_ops
    } else {
        // The per-lookup dumps are only read for their totals: remove them.
        for f in &files {
            let _ = std::fs::remove_file(f);
        }
        per_op_cycles.sort_unstable();
        per_op_cycles.len() as u64
    };
    let _ = std::fs::remove_file(&base);
    Ok(PhaseCost {
        total,
        ops,
        per_op_cycles,
        wall_s,
    })
}

/// The driver: every phase in `phases` under callgrind, then one Markdown table.
/// `child_args` are this run's workload flags, passed on to each child.
pub fn drive(
    phases: &[Phase],
    dir: &Path,
    child_args: &[String],
    w: &Workload,
    lookups: usize,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let block_ops = w.stored_blocks + w.removed_blocks;
    let mut results: Vec<(Phase, PhaseCost)> = Vec::new();
    for &p in phases {
        eprintln!("stable: {} under callgrind …", p.name());
        let r = run_one(p, dir, child_args, block_ops)?;
        eprintln!(
            "stable: {} took {:.0} s; {:.0} cycle-estimate per op",
            p.name(),
            r.wall_s,
            r.mean_cycles()
        );
        results.push((p, r));
    }
    let get = |p: Phase| results.iter().find(|(q, _)| *q == p).map(|(_, r)| r);
    println!(
        "Stable measure (callgrind, cache + branch simulation: I1/D1 32 KiB 8-way, LL 32 MiB 16-way, 64 B lines) — \
         FAST'25 trace × {}, {} workers, {} blocks/worker LRU; {} block ops, {} lookups; each phase alone in its own process",
        w.config.copies, w.config.workers, w.config.capacity, block_ops, lookups
    );
    println!("cycle estimate = Ir + 10 × (L1 misses + mispredicts) + 100 × LL misses");
    println!();
    println!("| phase | indexer | per | Ir | L1 misses | LL misses | mispredicts | cycle estimate (mean) | p50 | p99 | valgrind s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (p, r) in &results {
        let (what, per) = if p.is_ingest() {
            ("ingest", "block op")
        } else {
            ("lookup", "lookup")
        };
        let (p50, p99) = if p.is_ingest() {
            ("—".to_string(), "—".to_string())
        } else {
            (r.p(50.0).to_string(), r.p(99.0).to_string())
        };
        println!(
            "| {what} | {} | {per} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} | {p50} | {p99} | {:.0} |",
            p.label(),
            r.per_op(r.total.ir),
            r.per_op(r.total.l1),
            r.per_op(r.total.ll),
            r.per_op(r.total.mispredicts),
            r.mean_cycles(),
            r.wall_s
        );
    }
    println!();
    // Ratios against the best peer that ran.
    let best = |a: Option<&PhaseCost>, b: Option<&PhaseCost>, f: &dyn Fn(&PhaseCost) -> f64| {
        [a, b]
            .into_iter()
            .flatten()
            .map(f)
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))))
    };
    if let (Some(o), Some(peer)) = (
        get(Phase::IngestOurs),
        best(get(Phase::IngestRadix), get(Phase::IngestCrtc), &|r| {
            r.mean_cycles()
        }),
    ) {
        let ratio = peer / o.mean_cycles().max(1e-9);
        println!(
            "ingest: best dynamo {:.1} / ours {:.1} cycle estimate per block op = **{:.2}×** (target ≥ 2×: {})",
            peer,
            o.mean_cycles(),
            ratio,
            if ratio >= 2.0 { "met" } else { "not met" }
        );
    }
    let peer_p99 = best(get(Phase::ScoreRadix), get(Phase::ScoreCrtc), &|r| {
        r.p(99.0) as f64
    });
    if let Some(peer) = peer_p99 {
        if let Some(o) = get(Phase::ScoreOurs) {
            let ratio = o.p(99.0) as f64 / peer.max(1.0);
            println!(
                "scoring lookup p99: ours {} / best dynamo {:.0} cycle estimate = **{:.2}×** (target ≤ 0.5×: {})",
                o.p(99.0),
                peer,
                ratio,
                if ratio <= 0.5 { "met" } else { "not met" }
            );
        }
        if let Some(o) = get(Phase::AnswerOurs) {
            let ratio = o.p(99.0) as f64 / peer.max(1.0);
            println!(
                "router answer p99 against dynamo's best scoring p99: {} / {:.0} = **{:.2}×** (target ≤ 0.5×: {}; ≤ 1×: {})",
                o.p(99.0),
                peer,
                ratio,
                if ratio <= 0.5 { "met" } else { "not met" },
                if ratio <= 1.0 { "met" } else { "not met" }
            );
        }
    }
    if get(Phase::IngestOurs).is_some() {
        eprintln!(
            "stable: our ingest profile is {} (callgrind_annotate it)",
            dir.join(format!("{}.callgrind.1", Phase::IngestOurs.name()))
                .display()
        );
    }
    Ok(())
}
