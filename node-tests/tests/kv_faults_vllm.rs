//! The KV-event fault suite (issue 12): vLLM's own publisher (`vllm/distributed/kv_events.py`
//! from the 0.33.0 and 0.24.0 wheels, fetched by `scripts/fetch-vllm.sh`) driven by a model of
//! vLLM's prefix-caching block pool (`node-tests/vllm-faults/engine.py`), against the real agent
//! (in-process, its own runtime, so "kill" stops everything it runs) and a standalone controller
//! over loopback gRPC. The pool model is the ground truth: after each fault the index must hold
//! exactly the model's blocks — every key looked up one by one through the index's lookup, and
//! no key more — or the replica must say, in every surface, that it is not exact (and then hold
//! a subset of the truth, never a block the engine does not have).
//!
//! Needs the fetched files (`scripts/fetch-vllm.sh`, which `scripts/setup.sh` runs); without them the
//! tests fail naming the script — they never skip.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::agent::AgentProc;
use support::stack::{free_port, start_controller, wait_until, Controller};

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Lines, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use ic_controller::index::LookupQuery;
use ic_shared::kv::content_key::chain;
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
use serde_json::{json, Value};

const NODE: &str = "node-faults";
const BS: u32 = 16;

/// Where `scripts/fetch-vllm.sh` put vLLM's publisher and the venv.
fn vllm_dir() -> PathBuf {
    let dir = std::env::var("IC_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ci-cache/vllm")
        });
    assert!(
        dir.join("venv/bin/python").exists(),
        "{} has no vLLM publisher venv: run scripts/fetch-vllm.sh (or set IC_VLLM_DIR)",
        dir.display()
    );
    dir
}

fn kv_events_py(version: &str) -> PathBuf {
    let p = vllm_dir()
        .join(version)
        .join("vllm/distributed/kv_events.py");
    assert!(
        p.exists(),
        "{} missing: run scripts/fetch-vllm.sh",
        p.display()
    );
    p
}

/// One engine process: vLLM's publisher over the pool model.
struct Engine {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    prompts: HashMap<u64, Vec<u32>>,
}

struct EngineOpts {
    version: &'static str,
    buffer_steps: u32,
    num_blocks: u32,
    seed: u64,
}

impl Engine {
    fn start(o: &EngineOpts, pub_port: u16, replay_port: u16) -> Engine {
        let mut child = Command::new(vllm_dir().join("venv/bin/python"))
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("vllm-faults/engine.py"))
            .arg("--kv-events")
            .arg(kv_events_py(o.version))
            .args(["--endpoint", &format!("tcp://*:{pub_port}")])
            .args(["--replay-endpoint", &format!("tcp://*:{replay_port}")])
            .args(["--buffer-steps", &o.buffer_steps.to_string()])
            .args(["--num-blocks", &o.num_blocks.to_string()])
            .args(["--seed", &o.seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python runs");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        Engine {
            child,
            stdin,
            stdout,
            prompts: HashMap::new(),
        }
    }

    fn cmd(&mut self, v: Value) -> Value {
        writeln!(self.stdin, "{v}").unwrap();
        self.stdin.flush().unwrap();
        let line = self
            .stdout
            .next()
            .expect("the engine answers")
            .expect("readable");
        serde_json::from_str(&line).unwrap()
    }

    /// Runs `n` scheduler steps; returns the last seq published.
    fn steps(&mut self, n: u32, per_step: u32, dup: bool) -> i64 {
        let r = self.cmd(json!({"cmd": "steps", "n": n, "per_step": per_step, "dup": dup}));
        self.cmd(json!({"cmd": "drain"}));
        r["seq"].as_i64().unwrap()
    }

    /// The content keys of every block the pool holds.
    fn truth(&mut self) -> BTreeSet<u64> {
        let t = self.cmd(json!({"cmd": "truth"}));
        for (id, toks) in t["prompts"].as_object().unwrap() {
            let toks: Vec<u32> = toks
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            self.prompts.insert(id.parse().unwrap(), toks);
        }
        t["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                let pid = b[0].as_u64().unwrap();
                let n = b[1].as_u64().unwrap() as usize;
                chain(&self.prompts[&pid], BS as usize)[n - 1]
            })
            .collect()
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_agent(
    grpc: SocketAddr,
    plan: &NodePlan,
    state_dir: Option<&std::path::Path>,
) -> AgentProc {
    support::agent::start_agent(grpc, NODE, plan, state_dir, Duration::from_secs(30))
}

/// Planned engines `vllm-0..n` on their own port pairs.
fn plan(ports: &[(u16, u16)]) -> NodePlan {
    NodePlan {
        engines: ports
            .iter()
            .enumerate()
            .map(|(i, (p, r))| EnginePlan {
                namespace: "default".into(),
                pod: format!("vllm-{i}"),
                model: "m".into(),
                hash_scheme: HashScheme::Vllm,
                block_size: BS,
                kv_events: vec![KvEventSource {
                    endpoint: format!("tcp://127.0.0.1:{p}"),
                    replay_endpoint: Some(format!("tcp://127.0.0.1:{r}")),
                    topic: String::new(),
                    dp_rank: 0,
                }],
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn stream(i: usize) -> String {
    format!("default/vllm-{i}#0")
}

/// A port for an engine to bind, below the kernel's ephemeral range (32768–60999 by default):
/// outgoing connections of the tests running alongside (ZMQ, gRPC) take their source ports from
/// that range, and could take an engine's port between this check and the engine's bind — or
/// between an engine's exit and its restart on the same port.
fn engine_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let base = (std::process::id() % 1000) * 10;
    loop {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = 20_000 + ((base + n) % 12_000) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
}

fn ports(n: usize) -> Vec<(u16, u16)> {
    (0..n).map(|_| (engine_port(), engine_port())).collect()
}

/// The stream's keys in the controller's index (`None` when it is not registered).
fn index_keys(c: &Controller, i: usize) -> Option<BTreeSet<u64>> {
    let entries = c.shared.index.read().stream_entries(&stream(i))?;
    Some(entries.into_iter().map(|e| e.content_key).collect())
}

/// `(coverage, reason)` of the stream in the controller's `/snapshot`.
fn coverage(c: &Controller, i: usize) -> Option<(String, Option<String>)> {
    let snap = c.shared.index.read().snapshot();
    let r = snap
        .replicas
        .into_iter()
        .find(|r| r.stream_id == stream(i))?;
    Some((
        r.coverage.to_string(),
        r.coverage_reason.map(str::to_string),
    ))
}

/// Every truth key, looked up alone, matches replica `vllm-i` with its coverage; returns that
/// coverage.
fn lookup_each(c: &Controller, i: usize, truth: &BTreeSet<u64>) -> Vec<String> {
    let ix = c.shared.index.read();
    let replica = format!("vllm-{i}");
    let mut seen = BTreeSet::new();
    for k in truth {
        let r = ix.lookup(&LookupQuery {
            content_keys: vec![*k],
            block_size: Some(BS),
            ..Default::default()
        });
        let m = r.replicas.iter().find(|m| m.replica() == replica);
        assert!(m.is_some(), "key {k:#x} of {replica} not routed: {r:?}");
        seen.insert(m.unwrap().coverage.state.as_str().to_string());
    }
    seen.into_iter().collect()
}

/// Waits until stream `i` is exactly `truth` and Exact; returns how long it took.
async fn converge(c: &Controller, i: usize, truth: &BTreeSet<u64>, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let keys = index_keys(c, i);
        let cov = coverage(c, i);
        if keys.as_ref() == Some(truth) && cov.as_ref().map(|c| c.0.as_str()) == Some("Exact") {
            break;
        }
        if start.elapsed() > limit {
            let keys = keys.unwrap_or_default();
            panic!(
                "stream {i} not exact after {limit:?}: coverage {cov:?}, {} keys vs {} true ({} missing, {} extra)",
                keys.len(),
                truth.len(),
                truth.difference(&keys).count(),
                keys.difference(truth).count()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let took = start.elapsed();
    assert_eq!(lookup_each(c, i, truth), vec!["Exact".to_string()]);
    took
}

fn opts(version: &'static str, buffer_steps: u32, seed: u64) -> EngineOpts {
    EngineOpts {
        version,
        buffer_steps,
        num_blocks: 2048,
        seed,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restarts_resume_every_stream_exactly_from_kept_state() {
    // Three engines older than their replay buffers (1 500 batches, buffer 1 000): the agent
    // is killed (-9), terminated, and killed with the controller, while the engines go on.
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut controller = start_controller(grpc).await;
    let ps = ports(3);
    let plan = plan(&ps);
    let dir = tempfile::tempdir().unwrap();
    let mut engines: Vec<Engine> = ps
        .iter()
        .enumerate()
        .map(|(i, (p, r))| Engine::start(&opts("0.33.0", 1000, 10 + i as u64), *p, *r))
        .collect();
    let mut agent = start_agent(grpc, &plan, Some(dir.path()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for e in engines.iter_mut() {
        e.steps(1500, 2, false);
    }
    for (i, e) in engines.iter_mut().enumerate() {
        let t = e.truth();
        converge(&controller, i, &t, Duration::from_secs(10)).await;
    }
    for round in ["kill -9", "SIGTERM", "agent and controller"] {
        // A periodic save of every stream's current state happened (on a loaded machine the
        // save can trail the apply by more than its period: wait for it, don't assume it).
        wait_until(
            "every stream's kept state to reach its last seq",
            Duration::from_secs(15),
            || {
                agent
                    .state()
                    .hub
                    .status()
                    .iter()
                    .all(|st| st.last_seq.is_some() && st.kept_seq == st.last_seq)
            },
        )
        .await;
        match round {
            "SIGTERM" => agent.terminate(),
            "agent and controller" => {
                agent.kill9();
                let old = controller;
                old.stop().await;
                // The engines go on while both are away (within their buffers).
                for e in engines.iter_mut() {
                    e.steps(300, 2, false);
                }
                controller = start_controller(grpc).await;
            }
            _ => agent.kill9(),
        }
        if round != "agent and controller" {
            // The engines go on while the agent is away (within their buffers).
            for e in engines.iter_mut() {
                e.steps(300, 2, false);
            }
        }
        agent = start_agent(grpc, &plan, Some(dir.path()));
        for (i, e) in engines.iter_mut().enumerate() {
            let t = e.truth();
            let took = converge(&controller, i, &t, Duration::from_secs(5)).await;
            eprintln!("{round}: stream {i} exact {took:?} after the agent came back");
        }
        for st in agent.state().hub.status() {
            assert!(st.replays >= 1, "{st:?}");
            assert_eq!(st.coverage, "Exact", "{st:?}");
        }
    }
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_on_engines_older_than_their_buffers_reads_partial_everywhere() {
    // No kept state: what the engine stored before its buffer's first batch is unknowable.
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(&opts("0.33.0", 500, 3), ps[0].0, ps[0].1);
    std::thread::sleep(Duration::from_millis(300));
    engine.steps(1500, 2, false);
    let truth = engine.truth();
    let agent = start_agent(grpc, &plan(&ps), None);
    wait_until(
        "the stream to read Partial in the index",
        Duration::from_secs(5),
        || coverage(&controller, 0).is_some_and(|c| c.0 == "Partial"),
    )
    .await;
    assert_eq!(
        coverage(&controller, 0).unwrap().1.as_deref(),
        Some("BootstrapIncomplete")
    );
    let st = &agent.state().hub.status()[0];
    assert_eq!(
        (st.coverage, st.coverage_reason),
        ("Partial", Some("BootstrapIncomplete"))
    );
    assert!(st
        .last_error
        .as_deref()
        .unwrap_or("")
        .contains("buffer starts at seq"));
    // Whatever it holds is true (a subset), and a lookup says Partial.
    let keys = index_keys(&controller, 0).unwrap();
    assert!(
        keys.is_subset(&truth),
        "{} keys not in the pool",
        keys.difference(&truth).count()
    );
    assert!(keys.len() < truth.len());
    let held: BTreeSet<u64> = keys.iter().copied().collect();
    if !held.is_empty() {
        assert_eq!(
            lookup_each(&controller, 0, &held),
            vec!["Partial".to_string()]
        );
    }
    let metrics = agent.state().metrics.registry.gather();
    let fam = metrics
        .iter()
        .find(|f| f.name() == "inferencecache_agent_kv_coverage")
        .unwrap();
    assert!(fam.get_metric().iter().any(|m| m
        .get_label()
        .iter()
        .any(|l| l.value() == "BootstrapIncomplete")));
    // The engine's cache reset makes its state known again: Exact.
    engine.cmd(json!({"cmd": "clear"}));
    engine.steps(50, 2, false);
    let truth = engine.truth();
    converge(&controller, 0, &truth, Duration::from_secs(5)).await;
    agent.kill9();
    controller.stop().await;
}

async fn engine_restart_overtaking(version: &'static str) {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(&opts(version, 10_000, 5), ps[0].0, ps[0].1);
    let agent = start_agent(grpc, &plan(&ps), None);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(300, 2, false);
    let old = engine.truth();
    converge(&controller, 0, &old, Duration::from_secs(10)).await;
    engine.kill();
    // The new incarnation publishes past the old seq before the agent re-attaches.
    let mut engine = Engine::start(&opts(version, 10_000, 77), ps[0].0, ps[0].1);
    engine.steps(600, 2, false);
    let new = engine.truth();
    let took = converge(&controller, 0, &new, Duration::from_secs(5)).await;
    eprintln!("{version}: the new incarnation exact {took:?} after it published");
    let keys = index_keys(&controller, 0).unwrap();
    assert!(
        old.difference(&new).all(|k| !keys.contains(k)),
        "dead blocks stayed"
    );
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_whose_seq_overtakes_the_old_one_drops_the_dead_blocks_033() {
    engine_restart_overtaking("0.33.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_whose_seq_overtakes_the_old_one_drops_the_dead_blocks_024() {
    engine_restart_overtaking("0.24.0").await;
}

async fn tail_loss(version: &'static str) {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(&opts(version, 10_000, 9), ps[0].0, ps[0].1);
    let agent = start_agent(grpc, &plan(&ps), None);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(200, 2, false);
    let t = engine.truth();
    converge(&controller, 0, &t, Duration::from_secs(10)).await;
    // A burst whose last batches the PUB drops (they stay in the replay buffer), then idle.
    engine.steps(100, 2, false);
    engine.cmd(json!({"cmd": "drop", "n": 8}));
    engine.steps(8, 3, false);
    let t = engine.truth();
    let took = converge(&controller, 0, &t, Duration::from_secs(2)).await;
    eprintln!("{version}: a lost tail healed {took:?} after the engine went idle");
    let st = &agent.state().hub.status()[0];
    assert_eq!(st.gaps, 0, "no later frame revealed the loss: {st:?}");
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_lost_to_the_high_water_mark_heals_when_the_engine_goes_idle_033() {
    tail_loss("0.33.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_lost_to_the_high_water_mark_heals_when_the_engine_goes_idle_024() {
    tail_loss("0.24.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_physical_blocks_are_counted_like_the_engine_counts_them() {
    // Identical block-aligned prompts in one step hold one hash in two physical blocks; a small
    // pool evicts them one copy at a time.
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(
        &EngineOpts {
            num_blocks: 300,
            ..opts("0.33.0", 10_000, 21)
        },
        ps[0].0,
        ps[0].1,
    );
    let agent = start_agent(grpc, &plan(&ps), None);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for _ in 0..4 {
        engine.steps(150, 4, true);
        let t = engine.truth();
        converge(&controller, 0, &t, Duration::from_secs(5)).await;
    }
    let copies = engine.cmd(json!({"cmd": "truth"}))["copies"]
        .as_u64()
        .unwrap();
    let keys = index_keys(&controller, 0).unwrap();
    assert!(
        copies > keys.len() as u64,
        "the scenario held duplicates ({copies} copies)"
    );
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_stops_being_routed_within_two_seconds() {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(&opts("0.33.0", 10_000, 4), ps[0].0, ps[0].1);
    let agent = start_agent(grpc, &plan(&ps), None);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(100, 2, false);
    let t = engine.truth();
    converge(&controller, 0, &t, Duration::from_secs(10)).await;
    let killed = Instant::now();
    engine.kill();
    let probe = *t.iter().next().unwrap();
    wait_until(
        "no PREFIX_MATCH for the dead engine",
        Duration::from_secs(2),
        || {
            let r = controller.shared.index.read().lookup(&LookupQuery {
                content_keys: vec![probe],
                block_size: Some(BS),
                ..Default::default()
            });
            !r.prefix_match
        },
    )
    .await;
    eprintln!("dead engine unrouted {:?} after it died", killed.elapsed());
    assert_eq!(coverage(&controller, 0).unwrap().0, "Disconnected");
    assert_eq!(agent.state().hub.status()[0].coverage, "Disconnected");
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_sequence_number_does_not_wipe_the_replica() {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(&opts("0.33.0", 10_000, 8), ps[0].0, ps[0].1);
    let agent = start_agent(grpc, &plan(&ps), None);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(100, 2, false);
    let t = engine.truth();
    converge(&controller, 0, &t, Duration::from_secs(10)).await;
    // An AllBlocksCleared frame at seq 2^63 - 1 the engine never produced.
    engine.cmd(json!({"cmd": "forge", "seq": (1u64 << 63) - 1}));
    wait_until(
        "the forged frame to be judged",
        Duration::from_secs(5),
        || {
            agent.state().hub.status()[0]
                .dropped_by_reason
                .get("forged_seq")
                .is_some_and(|n| *n >= 1)
        },
    )
    .await;
    assert_eq!(index_keys(&controller, 0).unwrap(), t);
    engine.steps(20, 2, false);
    let t = engine.truth();
    converge(&controller, 0, &t, Duration::from_secs(5)).await;
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_024_bootstrap_is_exact_or_says_it_is_not() {
    // vLLM 0.24's replay ROUTER keeps ZMQ's default send HWM (1 000): a 3 000-batch bootstrap
    // replay can lose batches although the end marker arrives.
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let mut engine = Engine::start(&opts("0.24.0", 5000, 6), ps[0].0, ps[0].1);
    std::thread::sleep(Duration::from_millis(300));
    engine.steps(3000, 2, false);
    let truth = engine.truth();
    let agent = start_agent(grpc, &plan(&ps), None);
    wait_until("the bootstrap to settle", Duration::from_secs(30), || {
        coverage(&controller, 0).is_some_and(|c| c.0 == "Exact" || c.0 == "Partial")
            && agent.state().hub.status()[0].replays >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (state, reason) = coverage(&controller, 0).unwrap();
    let keys = index_keys(&controller, 0).unwrap();
    eprintln!(
        "0.24 bootstrap: {state} {reason:?}, {} of {} keys",
        keys.len(),
        truth.len()
    );
    match state.as_str() {
        "Exact" => assert_eq!(keys, truth),
        "Partial" => {
            assert!(matches!(
                reason.as_deref(),
                Some("ReplayTruncated") | Some("BootstrapIncomplete")
            ));
            assert!(keys.is_subset(&truth));
        }
        other => panic!("coverage {other}"),
    }
    agent.kill9();
    controller.stop().await;
}

/// What a TCP relay in front of the engine's replay ROUTER does to new connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayPath {
    /// Relays both ways.
    Pass,
    /// Every chunk the engine sends reaches the agent 4 s late (the agent waits 3 s per reply).
    Slow,
    /// Accepts and closes at once: the replay socket cannot be reached.
    Unreachable,
    /// Reads the engine's replies 1 KiB per 5 ms: a long replay backs up in the engine's
    /// ROUTER, which drops what passes its send high-water mark (vLLM 0.24: holes).
    Throttled,
}

/// A loopback TCP relay planned as the stream's replay endpoint, forwarding to the engine's
/// replay port; its mode applies to each new connection.
struct ReplayRelay {
    port: u16,
    mode: std::sync::Arc<std::sync::Mutex<ReplayPath>>,
    task: tokio::task::JoinHandle<()>,
}

impl ReplayRelay {
    async fn start(upstream: u16) -> ReplayRelay {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = std::sync::Arc::new(std::sync::Mutex::new(ReplayPath::Pass));
        let m = mode.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let mode = *m.lock().unwrap();
                if mode == ReplayPath::Unreachable {
                    drop(client);
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(engine) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut er, mut ew) = engine.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut ew).await;
                    });
                    let mut buf = vec![0u8; 64 << 10];
                    let chunk = if mode == ReplayPath::Throttled {
                        1 << 10
                    } else {
                        buf.len()
                    };
                    loop {
                        if mode == ReplayPath::Throttled {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        let n = match er.read(&mut buf[..chunk]).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if mode == ReplayPath::Slow {
                            tokio::time::sleep(Duration::from_secs(4)).await;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    up.abort();
                });
            }
        });
        ReplayRelay { port, mode, task }
    }

    fn set(&self, mode: ReplayPath) {
        *self.mode.lock().unwrap() = mode;
    }
}

impl Drop for ReplayRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Issue 37 item 1: the engine restarts while the agent itself restarts (kill -9, kept state),
/// and the new incarnation has published exactly as far as the old one (seq `L`) when the agent
/// re-attaches through a slow or unreachable replay socket. Its next batch is `L + 1`: in order,
/// and no proof of anything. The replica must not be routed while the attach is unverified (no
/// dead block answers a lookup), and once the replay answers the index must hold exactly the new
/// engine's blocks and read Exact.
async fn restart_during_agent_restart(version: &'static str, fault: ReplayPath) {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let relay = ReplayRelay::start(ps[0].1).await;
    let plan = plan(&[(ps[0].0, relay.port)]);
    let dir = tempfile::tempdir().unwrap();
    let mut engine = Engine::start(&opts(version, 10_000, 5), ps[0].0, ps[0].1);
    let agent = start_agent(grpc, &plan, Some(dir.path()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(300, 2, false);
    let old = engine.truth();
    converge(&controller, 0, &old, Duration::from_secs(10)).await;
    wait_until(
        "the kept state to reach the last seq",
        Duration::from_secs(15),
        || {
            let st = &agent.state().hub.status()[0];
            st.last_seq.is_some() && st.kept_seq == st.last_seq
        },
    )
    .await;
    let last = agent.state().hub.status()[0].last_seq.unwrap() as i64;
    agent.kill9();
    engine.kill();
    // The new incarnation publishes seqs 0..=last while no agent listens.
    let mut engine = Engine::start(&opts(version, 10_000, 77), ps[0].0, ps[0].1);
    std::thread::sleep(Duration::from_millis(300));
    let mut seq = -1;
    while seq < last {
        seq = engine.steps((last - seq) as u32, 2, false);
    }
    assert_eq!(
        seq, last,
        "the new engine stops exactly at the old last seq"
    );
    relay.set(fault);
    let agent = start_agent(grpc, &plan, Some(dir.path()));
    wait_until(
        "the attach verification to fail",
        Duration::from_secs(30),
        || {
            let st = &agent.state().hub.status()[0];
            st.connected && st.replays_failed >= 1
        },
    )
    .await;
    // The new engine's next batches: last + 1, last + 2, …
    engine.steps(50, 2, false);
    let new = engine.truth();
    let dead: BTreeSet<u64> = old.difference(&new).copied().collect();
    assert!(!dead.is_empty());
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let st = agent.state().hub.status()[0].clone();
    eprintln!(
        "{version} {fault:?}: after the in-order batch: agent {}/{:?} last_seq {:?} (old last {last}); index {:?}",
        st.coverage,
        st.coverage_reason,
        st.last_seq,
        coverage(&controller, 0)
    );
    {
        let ix = controller.shared.index.read();
        let routed = dead
            .iter()
            .filter(|k| {
                ix.lookup(&LookupQuery {
                    content_keys: vec![**k],
                    block_size: Some(BS),
                    ..Default::default()
                })
                .replicas
                .iter()
                .any(|m| m.replica() == "vllm-0")
            })
            .count();
        assert_eq!(
            routed,
            0,
            "{version} {fault:?}: {routed} of {} dead blocks routed ({:?})",
            dead.len(),
            coverage(&controller, 0)
        );
    }
    assert_eq!(
        (st.coverage, st.coverage_reason),
        ("Disconnected", Some("AttachUnverified"))
    );
    // The replay socket answers again: the retried verification finds the new incarnation.
    let back = Instant::now();
    relay.set(ReplayPath::Pass);
    let took = converge(&controller, 0, &new, Duration::from_secs(30)).await;
    eprintln!(
        "{version} {fault:?}: Exact with the new engine's blocks {:?} after the replay answered again",
        back.elapsed().max(took)
    );
    let keys = index_keys(&controller, 0).unwrap();
    assert!(dead.iter().all(|k| !keys.contains(k)), "dead blocks stayed");
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_during_an_agent_restart_with_a_slow_replay_is_never_routed_as_the_old_one_033(
) {
    restart_during_agent_restart("0.33.0", ReplayPath::Slow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_during_an_agent_restart_with_a_slow_replay_is_never_routed_as_the_old_one_024(
) {
    restart_during_agent_restart("0.24.0", ReplayPath::Slow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_during_an_agent_restart_with_an_unreachable_replay_is_never_routed_as_the_old_one_033(
) {
    restart_during_agent_restart("0.33.0", ReplayPath::Unreachable).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_during_an_agent_restart_with_an_unreachable_replay_is_never_routed_as_the_old_one_024(
) {
    restart_during_agent_restart("0.24.0", ReplayPath::Unreachable).await;
}

// ---- Issue 37 items 3, 4 and 5: no stale entry routed, tail checks off the hot path, and
// every Partial state heals once the engine answers again.

/// The index keys of stream `i` that the engine no longer holds and a lookup still routes to
/// `vllm-i` (a wrong answer), and how many such keys the index holds at all.
fn routed_stale(c: &Controller, i: usize, truth: &BTreeSet<u64>) -> (usize, usize) {
    let keys = index_keys(c, i).unwrap_or_default();
    let extra: Vec<u64> = keys.difference(truth).copied().collect();
    let ix = c.shared.index.read();
    let replica = format!("vllm-{i}");
    let routed = extra
        .iter()
        .filter(|k| {
            ix.lookup(&LookupQuery {
                content_keys: vec![**k],
                block_size: Some(BS),
                ..Default::default()
            })
            .replicas
            .iter()
            .any(|m| m.replica() == replica)
        })
        .count();
    (routed, extra.len())
}

/// Item 5: once recovered, the stream's `lastError` is gone (the history keeps it).
fn assert_error_cleared(agent: &AgentProc) {
    let st = &agent.state().hub.status()[0];
    assert!(
        st.last_error.is_none(),
        "lastError outlived the recovery: {:?}",
        st.last_error
    );
}

/// One engine behind a replay relay the test controls, an agent (with a state dir), a
/// controller; the engine has run `warm` steps and the index is exact.
async fn relayed(
    version: &'static str,
    num_blocks: u32,
    seed: u64,
    warm: u32,
) -> (
    Controller,
    Engine,
    ReplayRelay,
    AgentProc,
    NodePlan,
    tempfile::TempDir,
) {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let relay = ReplayRelay::start(ps[0].1).await;
    let plan = plan(&[(ps[0].0, relay.port)]);
    let dir = tempfile::tempdir().unwrap();
    let mut engine = Engine::start(
        &EngineOpts {
            num_blocks,
            ..opts(version, 10_000, seed)
        },
        ps[0].0,
        ps[0].1,
    );
    let agent = start_agent(grpc, &plan, Some(dir.path()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(warm, 2, false);
    let t = engine.truth();
    converge(&controller, 0, &t, Duration::from_secs(10)).await;
    (controller, engine, relay, agent, plan, dir)
}

/// Item 3: a tail lost to the HWM (batches with removals) while the replay socket is
/// unreachable. The tail check fails; the entries still hold blocks the engine evicted in the
/// lost batches, so the replica must not be routed (today: Partial TailUnverified, routed). Once
/// the replay answers, the next check makes it Exact.
async fn tail_loss_unverifiable(version: &'static str) {
    let (controller, mut engine, relay, agent, _plan, _dir) = relayed(version, 300, 31, 150).await;
    relay.set(ReplayPath::Unreachable);
    engine.cmd(json!({"cmd": "drop", "n": 10}));
    engine.steps(10, 3, false);
    let t = engine.truth();
    wait_until("the tail check to fail", Duration::from_secs(30), || {
        agent.state().hub.status()[0].replays_failed >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (routed, extra) = routed_stale(&controller, 0, &t);
    let st = agent.state().hub.status()[0].clone();
    eprintln!(
        "{version}: tail lost, check failed: agent {}/{:?}, index {:?}, {extra} keys the engine evicted, {routed} routed",
        st.coverage,
        st.coverage_reason,
        coverage(&controller, 0)
    );
    assert!(extra > 0, "the lost batches evicted indexed blocks");
    assert_eq!(
        routed,
        0,
        "{routed} of {extra} evicted blocks routed under {:?}",
        coverage(&controller, 0)
    );
    let back = Instant::now();
    relay.set(ReplayPath::Pass);
    let took = converge(&controller, 0, &t, Duration::from_secs(30)).await;
    eprintln!(
        "{version}: Exact {:?} after the replay answered again",
        back.elapsed().max(took)
    );
    assert_error_cleared(&agent);
    agent.kill9();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_tail_that_cannot_be_checked_is_not_routed_and_heals_033() {
    tail_loss_unverifiable("0.33.0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_tail_that_cannot_be_checked_is_not_routed_and_heals_024() {
    tail_loss_unverifiable("0.24.0").await;
}

/// Item 5: the publisher sends its last frame again (same seq, same bytes) while the replay
/// socket is unreachable. A duplicate is no restart: nothing is cleared, and the stream stays
/// Exact as the engine goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_sequence_number_is_a_duplicate_not_a_restart() {
    let (controller, mut engine, relay, agent, _plan, _dir) =
        relayed("0.33.0", 2048, 32, 100).await;
    relay.set(ReplayPath::Unreachable);
    let resyncs = agent.state().hub.status()[0].resyncs;
    engine.cmd(json!({"cmd": "repeat"}));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    engine.steps(20, 2, false);
    let t = engine.truth();
    let took = converge(&controller, 0, &t, Duration::from_secs(10)).await;
    eprintln!("repeated seq: Exact {took:?} after the next batches");
    let st = &agent.state().hub.status()[0];
    assert_eq!(
        st.resyncs, resyncs,
        "a duplicate cleared the replica: {st:?}"
    );
    agent.kill9();
    controller.stop().await;
}

/// Item 5: a gap whose replay fails (the replay socket unreachable) leaves the replica Partial;
/// once the replay answers again, it is Exact by itself (a full replay from seq 0, which the
/// engine's buffer still holds), with `lastError` cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_gap_replay_heals_once_the_replay_answers_again() {
    let (controller, mut engine, relay, agent, _plan, _dir) =
        relayed("0.33.0", 2048, 33, 100).await;
    relay.set(ReplayPath::Unreachable);
    engine.cmd(json!({"cmd": "drop", "n": 5}));
    engine.steps(25, 2, false);
    wait_until("the gap replay to fail", Duration::from_secs(30), || {
        let st = &agent.state().hub.status()[0];
        st.gaps >= 1 && st.replays_failed >= 1
    })
    .await;
    let t = engine.truth();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (routed, _) = routed_stale(&controller, 0, &t);
    assert_eq!(routed, 0, "stale blocks routed after a failed gap replay");
    eprintln!("failed gap replay: {:?}", coverage(&controller, 0));
    let back = Instant::now();
    relay.set(ReplayPath::Pass);
    let took = converge(&controller, 0, &t, Duration::from_secs(30)).await;
    eprintln!(
        "failed gap replay: Exact {:?} after the replay answered again",
        back.elapsed().max(took)
    );
    assert_error_cleared(&agent);
    agent.kill9();
    controller.stop().await;
}

/// Item 5: an agent resumed from kept state 6 000 batches behind a vLLM 0.24 engine, through a
/// replay path slower than the engine sends (its ROUTER keeps the default send HWM of 1 000),
/// gets a replay that does not finish within the attach deadline. The kept state is verified by
/// its anchor and must not be thrown away, nor the run already received (before: every attempt
/// ran into the deadline and was discarded — never verified, never routed); it is Exact once the
/// rest is replayed from later anchors, and nothing was cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_024_resume_whose_replay_has_holes_keeps_its_state_and_becomes_exact() {
    let (controller, mut engine, relay, agent, plan, dir) = relayed("0.24.0", 2048, 34, 200).await;
    wait_until(
        "the kept state to reach the last seq",
        Duration::from_secs(15),
        || {
            let st = &agent.state().hub.status()[0];
            st.last_seq.is_some() && st.kept_seq == st.last_seq
        },
    )
    .await;
    agent.kill9();
    engine.steps(6000, 2, false);
    let t = engine.truth();
    relay.set(ReplayPath::Throttled);
    let back = Instant::now();
    let grpc = controller.grpc;
    let agent = start_agent(grpc, &plan, Some(dir.path()));
    let took = converge(&controller, 0, &t, Duration::from_secs(90)).await;
    let st = agent.state().hub.status()[0].clone();
    eprintln!(
        "0.24 resume 6 000 batches behind, throttled replay: Exact {:?} after the agent started ({} replays, {} resyncs)",
        back.elapsed().max(took),
        st.replays,
        st.resyncs
    );
    assert_eq!(st.resyncs, 0, "the kept state was thrown away: {st:?}");
    agent.kill9();
    controller.stop().await;
}

/// Item 5: an agent that starts while the engine's replay socket is unreachable cannot
/// bootstrap (Partial BootstrapIncomplete); once the replay answers, a complete bootstrap makes
/// it Exact (today: Partial for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_bootstrap_followed_by_a_complete_one_is_exact() {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let ps = ports(1);
    let relay = ReplayRelay::start(ps[0].1).await;
    let plan = plan(&[(ps[0].0, relay.port)]);
    let mut engine = Engine::start(&opts("0.33.0", 10_000, 35), ps[0].0, ps[0].1);
    std::thread::sleep(Duration::from_millis(300));
    engine.steps(200, 2, false);
    relay.set(ReplayPath::Unreachable);
    let agent = start_agent(grpc, &plan, None);
    wait_until("the bootstrap to fail", Duration::from_secs(30), || {
        agent.state().hub.status()[0].replays_failed >= 1
    })
    .await;
    engine.steps(5, 2, false);
    let t = engine.truth();
    tokio::time::sleep(Duration::from_millis(500)).await;
    eprintln!("failed bootstrap: {:?}", coverage(&controller, 0));
    let back = Instant::now();
    relay.set(ReplayPath::Pass);
    let took = converge(&controller, 0, &t, Duration::from_secs(30)).await;
    eprintln!(
        "failed bootstrap: Exact {:?} after the replay answered again",
        back.elapsed().max(took)
    );
    assert_error_cleared(&agent);
    agent.kill9();
    controller.stop().await;
}

/// Item 4: a routine tail check whose replay answers slowly (4 s per chunk) must not hold back
/// live batches: the engine's next batches are indexed while it waits, and the check shows
/// Healing once it runs past its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tail_check_does_not_hold_back_live_batches() {
    let (controller, mut engine, relay, agent, _plan, _dir) =
        relayed("0.33.0", 2048, 36, 100).await;
    relay.set(ReplayPath::Slow);
    // One batch, then idle past the first tail check (300 ms), which waits on the slow replay
    // (4 s per chunk; the agent gives up after 3 s per reply).
    engine.steps(1, 2, false);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let during = agent.state().hub.status()[0].clone();
    engine.steps(20, 2, false);
    let t = engine.truth();
    let sent = Instant::now();
    wait_until(
        "the new batches to be indexed",
        Duration::from_secs(30),
        || index_keys(&controller, 0).as_ref() == Some(&t),
    )
    .await;
    let took = sent.elapsed();
    let after = agent.state().hub.status()[0].clone();
    eprintln!(
        "slow tail check: coverage {} while it ran; live batches indexed {took:?} after they were sent (failed checks {} -> {})",
        during.coverage, during.replays_failed, after.replays_failed
    );
    assert_eq!(
        during.coverage, "Healing",
        "a check past its bound shows Healing"
    );
    assert_eq!(
        after.replays_failed, during.replays_failed,
        "the live batches waited for the slow check to give up ({took:?})"
    );
    relay.set(ReplayPath::Pass);
    converge(&controller, 0, &t, Duration::from_secs(30)).await;
    agent.kill9();
    controller.stop().await;
}
