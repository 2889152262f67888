//! Publish → visible: how long after vLLM's publisher hands a batch over does `LookupRoute`
//! route its new prefix.
//!
//! The stack runs over real sockets in this process, each part on its own tokio runtime with
//! named threads (so their CPU time is read per part from `/proc/self/task`):
//!
//! - **engine**: `node-tests/vllm-faults/engine.py` (a separate Python process) runs vLLM's own
//!   `vllm/distributed/kv_events.py` (`ZmqEventPublisher`, its PUB socket, sequence numbers
//!   and replay ROUTER, unchanged; `scripts/fetch-vllm.sh` unpacks it from the released wheel)
//!   over a prefix-caching block-pool model, paced to `--e2e-rate` block events per second
//!   (its `load` command). Every `--e2e-probe-ms` it prints, right after a batch was handed to
//!   `publish()`, the wall-clock time and the token prefix of the batch's deepest new run;
//! - **agent** (`ic-agent` threads): `ic_agent::runtime::start` with a one-engine plan, linked
//!   to the controller;
//! - **controller** (`ic-ctl` threads): `ic_controller::standalone::start` on loopback;
//! - **prober** (this thread, a current-thread runtime): for each probe, `LookupRoute` with the
//!   prefix's token ids until the engine's replica is listed with at least that many blocks,
//!   sleeping [`POLL`] between answers (`std::thread::sleep`: a tokio timer rounds up to its
//!   1 ms tick, which the prober's own resolution must not add); it waits for the engine's
//!   probe lines blocking, so it starts polling as soon as a line is written.
//!
//! Latency = first answer that lists it − publish time (one wall clock, the same host).
//! Agent CPU = the agent threads' user + system time over the load window / its length.
//!
//! **Stages.** The agent and the controller emit [`ic_shared::timing`] marks (received, applied,
//! batch taken, sent, received and applied by the controller); this process records them
//! ([`ic_shared::timing::Recorder`] as its global tracing subscriber) and splits every probe's
//! latency at them: publish → agent ZMQ receive (vLLM's publisher thread and queue, ZMQ) →
//! decoded and applied → taken into a delta batch → handed to the gRPC stream → received by the
//! controller → applied, write lock released → seen by the prober's next answer.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ic_agent::checks::{Checks, ChecksConfig};
use ic_agent::link::LinkConfig;
use ic_agent::runtime::{self, RunConfig};
use ic_agent::state::AgentState;
use ic_controller::standalone::{self, StandaloneConfig};
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
use ic_shared::proto::{router_service_client::RouterServiceClient, Decision, LookupRouteRequest};

use ic_shared::timing::{Mark, Recorder, Stage};

use crate::workload::percentile;

/// Block size of the engine model (tokens).
const BS: u32 = 16;
/// Thread-name prefixes of the runtimes whose CPU is reported.
const AGENT_THREADS: &str = "ic-agent";
const CONTROLLER_THREADS: &str = "ic-ctl";
/// A probe not visible within this long counts as lost.
const PROBE_LIMIT: Duration = Duration::from_secs(1);
/// The prober's pause between two answers that do not list the probe yet.
const POLL: Duration = Duration::from_micros(100);

/// What to run.
#[derive(Debug, Clone)]
pub struct E2eArgs {
    /// Block events per second the engine publishes.
    pub rate: u32,
    /// Seconds of load measured (after a warm-up).
    pub seconds: f64,
    /// Interval between probes (ms).
    pub probe_ms: u32,
    /// `IC_VLLM_DIR` (scripts/fetch-vllm.sh output): `venv/bin/python`, `<version>/vllm/…`.
    pub vllm_dir: PathBuf,
    /// vLLM version whose kv_events.py publishes.
    pub vllm_version: String,
    /// `node-tests/vllm-faults/engine.py`.
    pub engine_py: PathBuf,
}

/// The measurement.
#[derive(Debug, Clone, Default)]
pub struct E2eReport {
    /// Publish → visible, ns, sorted.
    pub latency_ns: Vec<u64>,
    /// Probes not visible within [`PROBE_LIMIT`].
    pub lost: usize,
    /// Block events and batches the engine published in the measured window, and its length.
    pub block_events: u64,
    pub batches: u64,
    pub seconds: f64,
    /// CPU seconds per wall second over the window.
    pub agent_cpu: f64,
    pub controller_cpu: f64,
    pub engine_cpu: f64,
    /// Per-probe stage split (empty when the marks could not be recorded).
    pub stages: Vec<ProbeStages>,
    /// Probes the marks did not cover (no agent receive of their seq, or no batch after it).
    pub unmatched: usize,
}

/// One probe: the engine's seq and publish time, and when each stage saw it (Unix ns).
#[derive(Debug, Clone, Copy, Default)]
pub struct Probe {
    pub seq: u64,
    /// Right after `publish()` returned (vLLM's queue took the batch).
    pub published: u64,
    /// When vLLM's publisher thread handed it to its PUB socket (engine.py's `sent_ns`).
    pub sent: Option<u64>,
    pub visible: u64,
}

/// Where one probe's publish → visible time went, ns per step (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProbeStages {
    /// Publish → visible.
    pub total: u64,
    /// [`STAGE_NAMES`] order.
    pub steps: [u64; 8],
}

/// Names of [`ProbeStages::steps`].
pub const STAGE_NAMES: [&str; 8] = [
    "publish() → vLLM's publisher thread sends",
    "PUB send → agent ZMQ receive",
    "receive → applied",
    "applied → batch taken",
    "taken → handed to gRPC",
    "handed → controller received",
    "received → applied in index",
    "applied → prober saw it",
];

/// Splits each probe at the recorded marks. `marks` are in emission order: a batch taken after
/// a seq was applied carries it (or an earlier batch did).
pub fn split_stages(probes: &[Probe], marks: &[Mark]) -> (Vec<ProbeStages>, usize) {
    use std::collections::HashMap;
    let mut first: HashMap<(Stage, u64), (usize, u64)> = HashMap::new();
    for (i, m) in marks.iter().enumerate() {
        first.entry((m.stage, m.id)).or_insert((i, m.unix_ns));
    }
    // Batch taken marks in emission order, to find the first one after a seq was applied.
    let taken: Vec<(usize, u64, u64)> = marks
        .iter()
        .enumerate()
        .filter(|(_, m)| m.stage == Stage::BatchTaken)
        .map(|(i, m)| (i, m.id, m.unix_ns))
        .collect();
    let mut out = Vec::with_capacity(probes.len());
    let mut unmatched = 0;
    for p in probes {
        let got = (|| {
            let (_, recv) = *first.get(&(Stage::KvReceived, p.seq))?;
            let (applied_i, applied) = *first.get(&(Stage::KvApplied, p.seq))?;
            let k = taken.partition_point(|(i, _, _)| *i < applied_i);
            let &(_, batch, taken_at) = taken.get(k)?;
            let (_, sent) = *first.get(&(Stage::BatchSent, batch))?;
            let (_, ctl_recv) = *first.get(&(Stage::BatchReceived, batch))?;
            let (_, ctl_applied) = *first.get(&(Stage::BatchApplied, batch))?;
            let points = [
                p.published,
                p.sent.unwrap_or(p.published),
                recv,
                applied,
                taken_at,
                sent,
                ctl_recv,
                ctl_applied,
                p.visible,
            ];
            let mut steps = [0u64; 8];
            for (s, w) in steps.iter_mut().zip(points.windows(2)) {
                *s = w[1].saturating_sub(w[0]);
            }
            Some(ProbeStages {
                total: p.visible.saturating_sub(p.published),
                steps,
            })
        })();
        match got {
            Some(s) => out.push(s),
            None => unmatched += 1,
        }
    }
    (out, unmatched)
}

impl E2eReport {
    /// Percentile in ms.
    pub fn ms(&self, q: f64) -> f64 {
        percentile(&self.latency_ns, q) as f64 / 1e6
    }

    /// The stage split as the bench prints it: per step p50 / p99 / max over every probe, and
    /// the mean per step over the slowest 1 % (at least one probe): where the tail is spent.
    pub fn stage_lines(&self) -> Vec<String> {
        if self.stages.is_empty() {
            return vec!["publish → visible by stage: no stage marks recorded".into()];
        }
        let ms = |ns: u64| ns as f64 / 1e6;
        let mut lines = vec![format!(
            "publish → visible by stage, ms ({} probes split, {} not matched to marks): p50 / p99 / max",
            self.stages.len(),
            self.unmatched
        )];
        for (i, name) in STAGE_NAMES.iter().enumerate() {
            let mut v: Vec<u64> = self.stages.iter().map(|s| s.steps[i]).collect();
            v.sort_unstable();
            lines.push(format!(
                "- {name}: {:.3} / {:.3} / {:.3}",
                ms(percentile(&v, 50.0)),
                ms(percentile(&v, 99.0)),
                ms(percentile(&v, 100.0))
            ));
        }
        let mut by_total: Vec<&ProbeStages> = self.stages.iter().collect();
        by_total.sort_unstable_by_key(|s| std::cmp::Reverse(s.total));
        let n = by_total.len().div_ceil(100).max(1);
        let tail = &by_total[..n.min(by_total.len())];
        let mean = |f: &dyn Fn(&ProbeStages) -> u64| {
            tail.iter().map(|s| ms(f(s))).sum::<f64>() / tail.len() as f64
        };
        let parts: Vec<String> = STAGE_NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| format!("{name} {:.2}", mean(&|s| s.steps[i])))
            .collect();
        lines.push(format!(
            "slowest {} probe(s), mean {:.2} ms: {}",
            tail.len(),
            mean(&|s| s.total),
            parts.join(", ")
        ));
        lines
    }

    /// Counts per latency bucket (upper bounds in ms), as the bench prints them.
    pub fn histogram(&self) -> Vec<(String, usize)> {
        let bounds = [0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0];
        let mut out: BTreeMap<usize, usize> = BTreeMap::new();
        for ns in &self.latency_ns {
            let ms = *ns as f64 / 1e6;
            let i = bounds.iter().position(|b| ms <= *b).unwrap_or(bounds.len());
            *out.entry(i).or_default() += 1;
        }
        (0..=bounds.len())
            .map(|i| {
                let label = match (i.checked_sub(1).and_then(|j| bounds.get(j)), bounds.get(i)) {
                    (None, Some(hi)) => format!("≤ {hi} ms"),
                    (Some(lo), Some(hi)) => format!("{lo}–{hi} ms"),
                    (Some(lo), None) => format!("> {lo} ms"),
                    (None, None) => String::new(),
                };
                (label, out.get(&i).copied().unwrap_or(0))
            })
            .collect()
    }
}

/// CPU seconds (user + system) of this process's threads whose name starts with `prefix`.
pub(crate) fn threads_cpu(prefix: &str) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut total = 0u64;
    for t in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        // pid (comm) state … : comm may hold spaces, so split after the last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat
            .get(open + 1..close)
            .is_some_and(|c| c.starts_with(prefix))
        {
            continue;
        }
        let fields: Vec<&str> = stat.get(close + 2..).unwrap_or("").split(' ').collect();
        // utime and stime are fields 14 and 15 of stat: 12 and 13 after the state field.
        let num = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        total += num(11) + num(12);
    }
    total as f64 / tick
}

/// CPU seconds (user + system) of another process.
fn process_cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = stat.get(close + 2..).unwrap_or("").split(' ').collect();
    let num = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (num(11) + num(12)) as f64 / 100.0
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("free port: {e}"))
}

fn runtime(name: &'static str, threads: usize) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| format!("{name} runtime: {e}"))
}

/// One engine process and its stdout lines (read on a thread).
struct Engine {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<serde_json::Value>,
}

impl Engine {
    fn start(a: &E2eArgs, pub_port: u16, replay_port: u16) -> Result<Engine, String> {
        let kv = a
            .vllm_dir
            .join(&a.vllm_version)
            .join("vllm/distributed/kv_events.py");
        let python = a.vllm_dir.join("venv/bin/python");
        for p in [&kv, &python, &a.engine_py] {
            if !p.exists() {
                return Err(format!(
                    "{} is missing (run scripts/fetch-vllm.sh, set IC_VLLM_DIR)",
                    p.display()
                ));
            }
        }
        let mut child = Command::new(python)
            .arg(&a.engine_py)
            .arg("--kv-events")
            .arg(kv)
            .args(["--endpoint", &format!("tcp://*:{pub_port}")])
            .args(["--replay-endpoint", &format!("tcp://*:{replay_port}")])
            .args([
                "--num-blocks",
                "16384",
                "--user-blocks",
                "40",
                "--block-size",
            ])
            .arg(BS.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("engine.py: {e}"))?;
        let stdin = child.stdin.take().ok_or("engine stdin")?;
        let stdout = child.stdout.take().ok_or("engine stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                match serde_json::from_str(&line) {
                    Ok(v) => {
                        if tx.send(v).is_err() {
                            return;
                        }
                    }
                    Err(e) => eprintln!("engine.py: unreadable line ({e}): {line}"),
                }
            }
        });
        Ok(Engine {
            child,
            stdin,
            lines,
        })
    }

    fn send(&mut self, v: serde_json::Value) -> Result<(), String> {
        writeln!(self.stdin, "{v}")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| format!("engine.py stdin: {e}"))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn plan(pub_port: u16, replay_port: u16) -> NodePlan {
    NodePlan {
        engines: vec![EnginePlan {
            namespace: "default".into(),
            pod: "vllm-0".into(),
            model: "m".into(),
            hash_scheme: HashScheme::Vllm,
            block_size: BS,
            kv_events: vec![KvEventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
                topic: String::new(),
                dp_rank: 0,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Whether one `LookupRoute` answer lists the engine's replica with `blocks` blocks of `tokens`
/// (`None`: the call failed).
async fn listed(
    client: &mut RouterServiceClient<tonic::transport::Channel>,
    tokens: &[u32],
    blocks: u32,
) -> Option<bool> {
    let r = client
        .lookup_route(LookupRouteRequest {
            tenant: "default".into(),
            model: "m".into(),
            token_ids: tokens.to_vec(),
            block_size: BS,
            ..Default::default()
        })
        .await
        .ok()?
        .into_inner();
    Some(
        r.decision == Decision::PrefixMatch as i32
            && r.replicas
                .iter()
                .any(|m| m.replica == "vllm-0" && m.matched_blocks >= blocks),
    )
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A probe the prober still waits for.
struct Pending {
    seq: Option<u64>,
    published: u64,
    tokens: Vec<u32>,
    blocks: u32,
    since: Instant,
}

impl Pending {
    fn parse(p: &serde_json::Value) -> Pending {
        Pending {
            seq: p["seq"].as_u64(),
            published: p["t_ns"].as_u64().unwrap_or(0),
            blocks: p["blocks"].as_u64().unwrap_or(0) as u32,
            tokens: p["tokens"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|t| t.as_u64())
                        .map(|t| t as u32)
                        .collect()
                })
                .unwrap_or_default(),
            since: Instant::now(),
        }
    }
}

/// Reads probes until the engine's final reply, and watches every probe not yet visible at
/// once: each round asks `LookupRoute` once per pending probe, then sleeps [`POLL`]
/// (`std::thread::sleep`, blocking on purpose: nothing else runs on the prober's runtime, and a
/// tokio timer would round 100 µs up to its 1 ms tick). A probe that waits behind a slow one
/// is still seen within a round of becoming visible. With nothing pending the next line is
/// awaited blocking, so polling starts as soon as the engine writes it.
async fn probe_until_done(
    engine: &Engine,
    client: &mut RouterServiceClient<tonic::transport::Channel>,
    report: &mut E2eReport,
    probes: &mut Vec<Probe>,
) -> Result<serde_json::Value, String> {
    let mut pending: Vec<Pending> = Vec::new();
    let mut done = None;
    loop {
        if pending.is_empty() && done.is_none() {
            match engine.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(m) => match m.get("probe") {
                    Some(p) => pending.push(Pending::parse(p)),
                    None => done = Some(m),
                },
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err("engine.py wrote nothing for 30 s".into())
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err("engine.py exited".into()),
            }
        }
        while done.is_none() {
            match engine.lines.try_recv() {
                Ok(m) => match m.get("probe") {
                    Some(p) => pending.push(Pending::parse(p)),
                    None => done = Some(m),
                },
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return Err("engine.py exited".into()),
            }
        }
        if pending.is_empty() {
            if let Some(m) = done {
                return Ok(m);
            }
            continue;
        }
        let mut i = 0;
        while i < pending.len() {
            let p = &pending[i];
            let seen = listed(client, &p.tokens, p.blocks).await;
            let now = unix_ns();
            if seen == Some(true) {
                report.latency_ns.push(now.saturating_sub(p.published));
                if let Some(seq) = p.seq {
                    probes.push(Probe {
                        seq,
                        published: p.published,
                        sent: None,
                        visible: now,
                    });
                }
                pending.swap_remove(i);
            } else if seen.is_none() || p.since.elapsed() >= PROBE_LIMIT {
                report.lost += 1;
                pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if !pending.is_empty() {
            std::thread::sleep(POLL);
        }
    }
}

/// Runs the stack and the load; see the module docs.
pub fn run(a: &E2eArgs) -> Result<E2eReport, String> {
    let (pub_port, replay_port) = (free_port()?, free_port()?);
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()?)
        .parse()
        .map_err(|e| format!("{e}"))?;
    // The stage marks of the agent and the controller (module docs); without them (another
    // global subscriber is installed) the stage split is left out.
    let recorder = Recorder::new();
    let recording = tracing::subscriber::set_global_default(recorder.subscriber()).is_ok();
    let ctl_rt = runtime(CONTROLLER_THREADS, 1)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let controller = ctl_rt
        .block_on(standalone::start(
            StandaloneConfig {
                grpc_addr: grpc,
                ..StandaloneConfig::ephemeral()
            },
            async move {
                let mut rx = stopped;
                let _ = rx.wait_for(|s| *s).await;
            },
        ))
        .map_err(|e| format!("controller: {e}"))?;
    let mut engine = Engine::start(a, pub_port, replay_port)?;
    let agent_rt = runtime(AGENT_THREADS, 1)?;
    let agent = agent_rt.block_on(async {
        let state = AgentState::new("bench-node".into(), plan(pub_port, replay_port))
            .map_err(|e| format!("agent state: {e}"))?;
        let mut link = LinkConfig::new(format!("http://{grpc}"));
        link.backoff_initial = Duration::from_millis(50);
        link.backoff_max = Duration::from_millis(200);
        runtime::start(
            RunConfig {
                link: Some(link),
                http_addr: "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
                metrics_addr: None,
                check_interval: Duration::from_secs(3600),
                limits: Default::default(),
                http_bearer_token_file: None,
            },
            state,
            Checks::new(&ChecksConfig::default()),
        )
        .await
        .map_err(|e| format!("agent: {e}"))
    })?;
    let probe_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("prober runtime: {e}"))?;
    let result = probe_rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
            .map_err(|e| format!("{e}"))?
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut client = RouterServiceClient::new(channel);
        // Warm-up: the agent attaches (bootstrap replay), the first batches are visible.
        let mut warm = E2eReport::default();
        let deadline = Instant::now() + Duration::from_secs(20);
        while warm.latency_ns.is_empty() {
            if Instant::now() > deadline {
                return Err("warm-up: nothing the engine published became visible in 20 s".into());
            }
            engine.send(serde_json::json!({
                "cmd": "load", "seconds": 1, "blocks_per_s": 2000, "per_step": 4, "probe_ms": 100
            }))?;
            probe_until_done(&engine, &mut client, &mut warm, &mut Vec::new()).await?;
        }
        let mut report = E2eReport::default();
        let mut probes = Vec::new();
        let (agent0, ctl0) = (threads_cpu(AGENT_THREADS), threads_cpu(CONTROLLER_THREADS));
        let engine0 = process_cpu(engine.child.id());
        let t0 = Instant::now();
        engine.send(serde_json::json!({
            "cmd": "load", "seconds": a.seconds, "blocks_per_s": a.rate, "per_step": 4,
            "probe_ms": a.probe_ms
        }))?;
        let done = probe_until_done(&engine, &mut client, &mut report, &mut probes).await?;
        let wall = t0.elapsed().as_secs_f64();
        report.agent_cpu = (threads_cpu(AGENT_THREADS) - agent0) / wall;
        report.controller_cpu = (threads_cpu(CONTROLLER_THREADS) - ctl0) / wall;
        report.engine_cpu = (process_cpu(engine.child.id()) - engine0) / wall;
        report.block_events = done["block_events"].as_u64().unwrap_or(0);
        report.batches = done["batches"].as_u64().unwrap_or(0);
        report.seconds = done["seconds"].as_f64().unwrap_or(wall);
        report.latency_ns.sort_unstable();
        let sent: std::collections::HashMap<u64, u64> = done["sent_ns"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| Some((x.get(0)?.as_u64()?, x.get(1)?.as_u64()?)))
                    .collect()
            })
            .unwrap_or_default();
        for p in &mut probes {
            p.sent = sent.get(&p.seq).copied();
        }
        if recording {
            let (stages, unmatched) = split_stages(&probes, &recorder.take());
            report.stages = stages;
            report.unmatched = unmatched + report.latency_ns.len() - probes.len();
        }
        Ok(report)
    });
    let _ = engine.send(serde_json::json!({"cmd": "exit"}));
    agent.abort();
    agent_rt.shutdown_background();
    let _ = stop.send(true);
    ctl_rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(5), controller.wait()).await;
    });
    result
}

/// `IC_VLLM_DIR`, else the repository's `target/ci-cache/vllm` (what scripts/fetch-vllm.sh
/// writes), searched upwards from `here`.
pub fn find_vllm_dir(here: &Path) -> Option<PathBuf> {
    if let Ok(d) = std::env::var("IC_VLLM_DIR") {
        return Some(PathBuf::from(d));
    }
    here.ancestors()
        .map(|a| a.join("target/ci-cache/vllm"))
        .find(|p| p.join("venv/bin/python").exists())
}

/// `node-tests/vllm-faults/engine.py` of the repository, searched upwards from `here`.
pub fn find_engine_py(here: &Path) -> Option<PathBuf> {
    here.ancestors()
        .map(|a| a.join("node-tests/vllm-faults/engine.py"))
        .find(|p| p.exists())
}
