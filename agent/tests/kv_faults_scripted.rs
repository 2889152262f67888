//! KV faults against a scripted engine (issue 12): a PUB and a replay ROUTER whose answers the
//! test controls (holes, hangs, an empty buffer) drive the real `KvHub`. Each case is a fault
//! an adversarial review found; each asserts the stream is exact or says it is not, and never
//! reads Exact while holding blocks the engine does not have.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ic_agent::kv::persist::StateDir;
use ic_agent::kv::{KvHub, StreamConfig, StreamStatus, SubscriberOptions};
use ic_shared::kv::decode::{encode_batch, BlockStored, EventBatch, EventShape, KvEvent};
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// A loopback port free now, picked below the kernel's ephemeral range (32768–60999 by default):
/// the engines here bind a port again after a restart, and a port from `:0` could meanwhile
/// become another connection's source port or another test's listener (seen under load).
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = (std::process::id() % 10_000) as u16;
    loop {
        let p = 21_000 + (base + NEXT.fetch_add(1, Ordering::Relaxed)) % 10_000;
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return p;
        }
    }
}

fn plan(pub_port: u16, replay_port: Option<u16>) -> NodePlan {
    NodePlan {
        engines: vec![EnginePlan {
            namespace: "ns".into(),
            pod: "e0".into(),
            model: "m".into(),
            hash_scheme: HashScheme::Vllm,
            block_size: 4,
            kv_events: vec![KvEventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                replay_endpoint: replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
                topic: String::new(),
                dp_rank: 0,
            }],
            ..EnginePlan::default()
        }],
        ..NodePlan::default()
    }
}

/// One root block per batch (hash h, 4 tokens).
fn store(h: u64, ts: f64) -> Vec<u8> {
    encode_batch(
        &EventBatch {
            ts,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![h],
                parent_block_hash: None,
                token_ids: vec![h as u32, 1, 2, 3],
                block_size: 4,
                ..Default::default()
            })],
            data_parallel_rank: None,
            skipped: vec![],
        },
        EventShape::Map,
    )
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Normal,
    OmitSeq(u64),
    Hang,
    /// Only the end marker (a replay buffer that holds nothing).
    Empty,
    /// The first reply comes after this wait (a replay socket answering in seconds), then the
    /// rest at once.
    Slow(Duration),
}

type Rule = Arc<Mutex<Box<dyn Fn(u64, usize) -> Mode + Send>>>;
/// The scripted engine's replay buffer: `(seq, payload)`.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

fn rule(f: impl Fn(u64, usize) -> Mode + Send + 'static) -> Rule {
    Arc::new(Mutex::new(Box::new(f)))
}

struct Engine {
    pub_sock: PubSocket,
    buffer: Buffer,
    _replay: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The engine exits: its replay socket with it.
        if let Some(h) = self._replay.take() {
            h.abort();
        }
    }
}

/// The engine's replay ROUTER on `port`, answering from `buffer` as `modes` says.
async fn serve_replay(port: u16, buffer: Buffer, modes: Rule) -> tokio::task::JoinHandle<()> {
    let mut r = RouterSocket::new();
    // A replay ROUTER just stopped on this port may still be letting it go.
    let mut tries = 0;
    while let Err(e) = r.bind(&format!("tcp://127.0.0.1:{port}")).await {
        tries += 1;
        assert!(tries < 100, "bind the replay port {port}: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let buf = buffer;
    let n = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let Ok(req) = r.recv().await else { continue };
            let parts = req.into_vec();
            let id = parts[0].clone();
            let start = u64::from_be_bytes(parts.last().unwrap().as_ref().try_into().unwrap());
            let i = n.fetch_add(1, Ordering::SeqCst);
            let mode = (modes.lock().unwrap())(start, i);
            eprintln!("replay request #{i} from {start}: {mode:?}");
            if let Mode::Hang = mode {
                continue;
            }
            if let Mode::Slow(d) = mode {
                tokio::time::sleep(d).await;
            }
            let items: Vec<_> = if let Mode::Empty = mode {
                vec![]
            } else {
                buf.lock().unwrap().clone()
            };
            for (s, p) in items.into_iter().filter(|(s, _)| *s >= start) {
                if let Mode::OmitSeq(o) = mode {
                    if o == s {
                        continue;
                    }
                }
                let mut m = ZmqMessage::from(id.clone());
                m.push_back(Vec::<u8>::new().into());
                m.push_back(s.to_be_bytes().to_vec().into());
                m.push_back(p.into());
                let _ = r.send(m).await;
            }
            let mut m = ZmqMessage::from(id.clone());
            m.push_back(Vec::<u8>::new().into());
            m.push_back(u64::MAX.to_be_bytes().to_vec().into());
            m.push_back(Vec::<u8>::new().into());
            let _ = r.send(m).await;
        }
    })
}

impl Engine {
    async fn start(pub_port: u16, replay_port: Option<u16>, modes: Rule) -> Engine {
        let buffer: Buffer = Arc::default();
        let replay = match replay_port {
            Some(p) => Some(serve_replay(p, buffer.clone(), modes).await),
            None => None,
        };
        let mut pub_sock = PubSocket::new();
        // A restarted engine's predecessor on this port may still be letting it go (its socket
        // closes in the background; slower on a loaded machine).
        let mut tries = 0;
        while let Err(e) = pub_sock.bind(&format!("tcp://127.0.0.1:{pub_port}")).await {
            tries += 1;
            assert!(tries < 200, "bind the publisher port {pub_port}: {e}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Engine {
            pub_sock,
            buffer,
            _replay: replay,
        }
    }

    /// Publishes batch `seq` (live unless `live` is false; always buffered for replay).
    async fn publish(&mut self, seq: u64, payload: Vec<u8>, live: bool) {
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if live {
            let mut m = ZmqMessage::from(Vec::<u8>::new());
            m.push_back(seq.to_be_bytes().to_vec().into());
            m.push_back(payload.into());
            self.pub_sock.send(m).await.unwrap();
        }
    }
}

fn st(hub: &KvHub) -> StreamStatus {
    hub.status().remove(0)
}

async fn until(hub: &KvHub, what: &str, f: impl Fn(&StreamStatus) -> bool) -> StreamStatus {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = st(hub);
        if f(&s) {
            return s;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}: {s:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn hub() -> KvHub {
    let reg = prometheus::Registry::new();
    KvHub::with_options(&reg, SubscriberOptions::default(), StreamConfig::default()).unwrap()
}

/// Without replay: a huge jump is held, the next frame (held + 1) should confirm it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_sequence_jump_without_replay_is_applied() {
    let p = free_port();
    let mut eng = Engine::start(p, None, rule(|_, _| Mode::Normal)).await;
    let hub = hub();
    hub.apply_plan(&plan(p, None));
    until(&hub, "connected", |s| s.connected).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(0, store(100, 1.0), true).await;
    until(&hub, "seq 0", |s| s.last_seq == Some(0)).await;
    let base = 5_000_000u64;
    for i in 0..5 {
        eng.publish(base + i, store(200 + i, 2.0 + i as f64), true)
            .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = st(&hub);
    eprintln!(
        "after 5 consecutive frames {base}..{}: last_seq={:?} coverage={}/{:?} blocks={} dropped={:?}",
        base + 4,
        s.last_seq,
        s.coverage,
        s.coverage_reason,
        s.blocks_held,
        s.dropped_by_reason
    );
    assert_eq!(
        s.last_seq,
        Some(base + 4),
        "the engine's sequence really moved: the frames after the held one should be applied"
    );
}

/// Without replay: the engine exits and a fresh (empty, idle) incarnation comes back on the same
/// port; then the agent restarts from kept state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_reconnect_or_restart_never_reads_exact_with_ghosts() {
    let dir = tempfile::tempdir().unwrap();
    let p = free_port();
    let mut eng = Engine::start(p, None, rule(|_, _| Mode::Normal)).await;
    let hub1 = hub();
    hub1.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub1.apply_plan(&plan(p, None));
    until(&hub1, "connected", |s| s.connected).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(0, store(100, 1.0), true).await;
    eng.publish(1, store(101, 1.1), true).await;
    let s = until(&hub1, "seq 1", |s| s.last_seq == Some(1)).await;
    eprintln!(
        "before engine exit: coverage={} blocks={}",
        s.coverage, s.blocks_held
    );
    drop(eng);
    until(&hub1, "disconnected", |s| s.coverage == "Disconnected").await;
    // A restarted engine: empty cache, idle.
    let _eng2 = Engine::start(p, None, rule(|_, _| Mode::Normal)).await;
    let s = until(&hub1, "reconnected", |s| {
        s.connected && s.coverage != "Disconnected"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s2 = st(&hub1);
    eprintln!(
        "after the engine restarted (empty): coverage={}/{:?} blocks={} (first seen: {})",
        s2.coverage, s2.coverage_reason, s2.blocks_held, s.coverage
    );
    // Agent restart from kept state.
    hub1.shutdown();
    let hub2 = hub();
    hub2.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub2.apply_plan(&plan(p, None));
    until(&hub2, "restored+connected", |s| s.connected).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s3 = st(&hub2);
    eprintln!(
        "restored agent: coverage={}/{:?} blocks={} snapshot entries={}",
        s3.coverage,
        s3.coverage_reason,
        s3.blocks_held,
        hub2.take_deltas_and_snapshot().1[0].entries.len()
    );
    assert!(
        !(s2.coverage == "Exact" && s2.blocks_held > 0),
        "reconnect: Exact with {} blocks the restarted engine does not hold",
        s2.blocks_held
    );
    assert!(
        s3.coverage != "Exact" || hub2.take_deltas_and_snapshot().1[0].entries.is_empty(),
        "restore without replay: {s3:?}"
    );
}

/// With replay: a gap whose replay has holes clears and rebuilds; SIGTERM while the rebuild's
/// replay is in flight keeps the cleared state with the old anchor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_saved_mid_rebuild_does_not_resume_exact() {
    let dir = tempfile::tempdir().unwrap();
    let (p, r) = (free_port(), free_port());
    // The gap's anchored replay (from 1) misses seq 2; the rebuild's replay from 0 hangs.
    let modes = rule(|start, i| match start {
        1 => Mode::OmitSeq(2),
        0 if i > 0 => Mode::Hang,
        _ => Mode::Normal,
    });
    let mut eng = Engine::start(p, Some(r), modes.clone()).await;
    let hub1 = hub();
    hub1.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub1.apply_plan(&plan(p, Some(r)));
    until(&hub1, "connected", |s| s.connected).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(0, store(100, 1.0), true).await;
    eng.publish(1, store(101, 1.1), true).await;
    let s = until(&hub1, "seq 1", |s| s.last_seq == Some(1)).await;
    assert_eq!((s.coverage, s.blocks_held), ("Exact", 2));
    // 2 and 3 lost live; 4 arrives: gap 2..4, replay from 1 misses 2 (holes) -> rebuild.
    eng.publish(2, store(102, 1.2), false).await;
    eng.publish(3, store(103, 1.3), false).await;
    eng.publish(4, store(104, 1.4), true).await;
    until(&hub1, "healing", |s| s.coverage == "Healing").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = st(&hub1);
    eprintln!(
        "mid-rebuild: coverage={} blocks={} last_seq={:?}",
        s.coverage, s.blocks_held, s.last_seq
    );
    hub1.shutdown(); // SIGTERM path: saves every stream
    *modes.lock().unwrap() = Box::new(|_, _| Mode::Normal);
    let hub2 = hub();
    hub2.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub2.apply_plan(&plan(p, Some(r)));
    let _s = until(&hub2, "verified", |s| {
        s.connected && s.coverage != "Disconnected" && s.coverage != "Healing"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = st(&hub2);
    eprintln!(
        "restored agent: coverage={}/{:?} blocks={} last_seq={:?} (engine holds 5 blocks: 100..104)",
        s.coverage, s.coverage_reason, s.blocks_held, s.last_seq
    );
    assert!(
        !(s.coverage == "Exact" && s.blocks_held < 5),
        "Exact while missing {} of the engine's 5 blocks",
        5 - s.blocks_held
    );
}

/// A replay endpoint that answers with no batches (buffer disabled / wrong endpoint): every idle
/// check reads "another incarnation", clears, bootstraps nothing and reports Exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_replay_buffer_neither_wipes_nor_claims_exact() {
    let (p, r) = (free_port(), free_port());
    let mut eng = Engine::start(p, Some(r), rule(|_, _| Mode::Empty)).await;
    let hub = hub();
    hub.apply_plan(&plan(p, Some(r)));
    until(&hub, "connected", |s| {
        s.connected && s.coverage != "Disconnected"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(0, store(100, 1.0), true).await;
    eng.publish(1, store(101, 1.1), true).await;
    let s = until(&hub, "seq 1", |s| s.last_seq == Some(1)).await;
    eprintln!("applied: coverage={} blocks={}", s.coverage, s.blocks_held);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let s = st(&hub);
    eprintln!(
        "after the idle check: coverage={}/{:?} blocks={} resyncs={} last_seq={:?}",
        s.coverage, s.coverage_reason, s.blocks_held, s.resyncs, s.last_seq
    );
    assert!(
        !(s.coverage == "Exact" && s.blocks_held < 2),
        "Exact with {} of the engine's 2 blocks",
        s.blocks_held
    );
    assert_eq!(s.blocks_held, 2, "an empty replay buffer wipes nothing");
    // An empty buffer can never vouch for a tail: like an engine without a replay endpoint,
    // only a loss seen locally (queue drops) makes it unverified (Stale, unrouted); none here.
    assert_eq!((s.coverage, s.coverage_reason), ("Exact", None));
}

/// A restored stream whose first anchored replay fails is never checked again while the engine
/// is idle (the tail check needs a live message in this process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attach_verification_is_retried_and_unrouted_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let (p, r) = (free_port(), free_port());
    let modes = rule(|_, _| Mode::Normal);
    let mut eng = Engine::start(p, Some(r), modes.clone()).await;
    let hub1 = hub();
    hub1.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub1.apply_plan(&plan(p, Some(r)));
    until(&hub1, "connected", |s| {
        s.connected && s.coverage != "Disconnected"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(0, store(100, 1.0), true).await;
    eng.publish(1, store(101, 1.1), true).await;
    until(&hub1, "seq 1", |s| s.last_seq == Some(1)).await;
    hub1.shutdown();
    // The replay hangs once (slow engine), then works.
    let once = std::sync::atomic::AtomicBool::new(true);
    *modes.lock().unwrap() = Box::new(move |_, _| {
        if once.swap(false, Ordering::SeqCst) {
            Mode::Hang
        } else {
            Mode::Normal
        }
    });
    let hub2 = hub();
    hub2.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub2.apply_plan(&plan(p, Some(r)));
    let s = until(&hub2, "attach verify failed", |s| s.replays_failed >= 1).await;
    eprintln!(
        "after the failed verify: {}/{:?}",
        s.coverage, s.coverage_reason
    );
    assert_eq!(
        s.coverage, "Disconnected",
        "unverified entries are not routed"
    );
    tokio::time::sleep(Duration::from_secs(8)).await;
    let s = st(&hub2);
    eprintln!(
        "8 s later (replay healthy, engine idle): {}/{:?} replays={} failed={}",
        s.coverage, s.coverage_reason, s.replays, s.replays_failed
    );
    assert_eq!(s.coverage, "Exact", "never re-checked");
}

/// The content key of [`store`]'s block `h`.
fn key(h: u64) -> u64 {
    ic_shared::kv::content_key::chain(&[h as u32, 1, 2, 3], 4)[0]
}

fn snapshot_keys(hub: &KvHub) -> std::collections::BTreeSet<u64> {
    hub.take_deltas_and_snapshot().1[0]
        .entries
        .iter()
        .map(|e| e.content_key)
        .collect()
}

/// How the replay socket misbehaves while the agent re-attaches (issue 37 item 1).
#[derive(Clone, Copy, Debug)]
enum ReplayFault {
    /// Its first reply comes after 4 s (the agent waits 3 s per reply).
    Slow,
    /// Nothing listens on it.
    Unreachable,
}

/// The engine restarts while the agent is down (its own restart, from kept state) and the new
/// incarnation has published exactly as far as the old one (seqs 0..=2); the agent re-attaches
/// while the replay socket is slow or unreachable, then the new engine publishes seq 3 — the
/// old last seq + 1. That frame proves nothing: the stream stays unrouted (Disconnected
/// `AttachUnverified`), applies nothing of it, retries, and once the replay answers finds the
/// other incarnation and reads Exact with the new engine's blocks only.
async fn restart_during_agent_restart_with_replay(fault: ReplayFault) {
    let dir = tempfile::tempdir().unwrap();
    let (p, r) = (free_port(), free_port());
    let mut eng = Engine::start(p, Some(r), rule(|_, _| Mode::Normal)).await;
    let hub1 = hub();
    hub1.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub1.apply_plan(&plan(p, Some(r)));
    until(&hub1, "connected", |s| {
        s.connected && s.coverage != "Disconnected"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3u64 {
        eng.publish(i, store(100 + i, 1.0 + i as f64), true).await;
    }
    let s = until(&hub1, "seq 2", |s| s.last_seq == Some(2)).await;
    assert_eq!((s.coverage, s.blocks_held), ("Exact", 3));
    hub1.shutdown(); // saves the kept state at seq 2
    drop(eng);
    // The engine restarts (another cache) and publishes seqs 0..=2 while the agent is away.
    let modes = rule(move |_, _| match fault {
        ReplayFault::Slow => Mode::Slow(Duration::from_secs(4)),
        ReplayFault::Unreachable => Mode::Normal,
    });
    let replay_port = match fault {
        ReplayFault::Slow => Some(r),
        ReplayFault::Unreachable => None,
    };
    let mut eng = Engine::start(p, replay_port, modes.clone()).await;
    for i in 0..3u64 {
        eng.publish(i, store(200 + i, 10.0 + i as f64), true).await;
    }
    let hub2 = hub();
    hub2.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub2.apply_plan(&plan(p, Some(r)));
    let s = until(&hub2, "the attach verification to fail", |s| {
        s.connected && s.replays_failed >= 1
    })
    .await;
    eprintln!(
        "{fault:?}: after the failed attach verification: {}/{:?} blocks={}",
        s.coverage, s.coverage_reason, s.blocks_held
    );
    assert_eq!(
        s.coverage, "Disconnected",
        "an unverified attach is not routed"
    );
    // The new incarnation's next frame carries the old last seq + 1.
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(3, store(203, 13.0), true).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s = st(&hub2);
    eprintln!(
        "{fault:?}: after seq 3 (old last + 1): {}/{:?} blocks={} last_seq={:?} failed={}",
        s.coverage, s.coverage_reason, s.blocks_held, s.last_seq, s.replays_failed
    );
    assert_eq!(
        (s.coverage, s.coverage_reason),
        ("Disconnected", Some("AttachUnverified")),
        "an in-order seq is no proof of the engine's incarnation"
    );
    assert_eq!(
        s.last_seq,
        Some(2),
        "nothing of an unverified engine is applied"
    );
    // The replay socket answers again: the retry finds the other incarnation.
    match fault {
        ReplayFault::Slow => *modes.lock().unwrap() = Box::new(|_, _| Mode::Normal),
        ReplayFault::Unreachable => {
            eng._replay = Some(serve_replay(r, eng.buffer.clone(), modes.clone()).await);
        }
    }
    let s = until(&hub2, "Exact after the replay answers", |s| {
        s.coverage == "Exact" && s.last_seq == Some(3)
    })
    .await;
    let want: std::collections::BTreeSet<u64> = (200..204).map(key).collect();
    assert_eq!(
        snapshot_keys(&hub2),
        want,
        "{fault:?}: Exact with the old incarnation's blocks: {s:#?}"
    );
    assert!(s.resyncs >= 1, "the old incarnation was cleared: {s:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_order_seq_after_a_slow_attach_replay_is_no_proof_of_incarnation() {
    restart_during_agent_restart_with_replay(ReplayFault::Slow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_order_seq_after_an_unreachable_attach_replay_is_no_proof_of_incarnation() {
    restart_during_agent_restart_with_replay(ReplayFault::Unreachable).await;
}

/// The same engine, idle, reconnected while its replay socket is unreachable: nothing is
/// routed until the retried verification succeeds, then the entries are kept (not rebuilt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_reattach_after_an_unreachable_replay_keeps_the_entries() {
    let dir = tempfile::tempdir().unwrap();
    let (p, r) = (free_port(), free_port());
    let mut eng = Engine::start(p, Some(r), rule(|_, _| Mode::Normal)).await;
    let hub1 = hub();
    hub1.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub1.apply_plan(&plan(p, Some(r)));
    until(&hub1, "connected", |s| {
        s.connected && s.coverage != "Disconnected"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3u64 {
        eng.publish(i, store(100 + i, 1.0 + i as f64), true).await;
    }
    until(&hub1, "seq 2", |s| s.last_seq == Some(2)).await;
    hub1.shutdown();
    // The replay ROUTER goes away; the engine (same incarnation) goes on.
    let buffer = eng.buffer.clone();
    if let Some(h) = eng._replay.take() {
        h.abort();
        let _ = h.await;
    }
    let hub2 = hub();
    hub2.set_state_dir(StateDir::open(dir.path()).unwrap());
    hub2.apply_plan(&plan(p, Some(r)));
    until(&hub2, "the attach verification to fail", |s| {
        s.connected && s.replays_failed >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    eng.publish(3, store(103, 4.0), true).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let s = st(&hub2);
    assert_eq!(
        (s.coverage, s.coverage_reason),
        ("Disconnected", Some("AttachUnverified")),
        "{s:#?}"
    );
    eng._replay = Some(serve_replay(r, buffer, rule(|_, _| Mode::Normal)).await);
    let s = until(&hub2, "Exact after the replay answers", |s| {
        s.coverage == "Exact" && s.last_seq == Some(3)
    })
    .await;
    let want: std::collections::BTreeSet<u64> = (100..104).map(key).collect();
    assert_eq!(snapshot_keys(&hub2), want);
    assert_eq!(
        s.resyncs, 0,
        "the kept entries were verified, not rebuilt: {s:#?}"
    );
}

/// Issue 37 item 8: an engine whose clock is 6 h ahead of the agent's. The stream lag must read
/// the real delay (under a minute here), not -21 600 s, and the skew is exported and reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_clock_six_hours_ahead_is_flagged_and_not_read_as_lag() {
    let (p, r) = (free_port(), free_port());
    let mut eng = Engine::start(p, Some(r), rule(|_, _| Mode::Normal)).await;
    let reg = prometheus::Registry::new();
    let hub =
        KvHub::with_options(&reg, SubscriberOptions::default(), StreamConfig::default()).unwrap();
    hub.apply_plan(&plan(p, Some(r)));
    until(&hub, "connected", |s| {
        s.connected && s.coverage != "Disconnected"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ahead = 21_600.0;
    for i in 0..5u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        eng.publish(i, store(100 + i, now + ahead), true).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = until(&hub, "seq 4", |s| s.last_seq == Some(4)).await;
    let gauge = |name: &str| -> f64 {
        reg.gather()
            .iter()
            .find(|f| f.name() == name)
            .and_then(|f| f.get_metric().first().map(|m| m.get_gauge().get_value()))
            .unwrap_or_else(|| panic!("{name} has no series"))
    };
    let lag = gauge("inferencecache_agent_kv_stream_lag_seconds");
    eprintln!(
        "engine 6 h ahead: lag {lag} s, skew {:?}",
        s.engine_clock_skew_seconds
    );
    assert!(lag.abs() < 60.0, "skew read as lag: {lag} s");
    let skew = gauge("inferencecache_agent_kv_engine_clock_skew_seconds");
    assert!((skew - ahead).abs() < 60.0, "skew gauge {skew}");
    assert!(s
        .engine_clock_skew_seconds
        .is_some_and(|k| (k - ahead).abs() < 60.0));
}
