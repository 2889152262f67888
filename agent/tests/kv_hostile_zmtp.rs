//! Issue 38 item 1: one engine must not crash (or bloat) the agent with a ZMTP frame header.
//!
//! A hostile peer on loopback speaks ZMTP 3 like an engine (greeting, NULL handshake with READY
//! naming its socket type) and then announces a frame of 1 TiB (a 9-byte header and nothing
//! more) or sends a real 256 MiB frame. Against it:
//!
//! - `ic-agent run` (the DaemonSet's process, a child here: an abort would kill the test
//!   process) with a plan of three engines — one whose publisher announces 1 TiB, one whose
//!   publisher sends 256 MiB frames, one genuine publisher (the vLLM 0.24.0 golden frames)
//!   whose *replay* socket sends 256 MiB frames — survives, stays under 128 MiB (VmHWM; half
//!   the chart's 256 Mi memory limit), counts each dropped peer by socket and reason on
//!   `/metrics`, and keeps decoding the genuine stream;
//! - `ic-agent subscribe` survives a publisher announcing 1 TiB and counts it;
//! - `ic-agent kv tail` ends with an error naming the drop (not an abort), and a hostile replay
//!   socket is reported as a failed replay while the live stream is still printed;
//! - in process, a hub with the 256 MiB publisher and replay socket beside a genuine stream:
//!   the process's peak RSS does not grow by the frame, and the genuine stream flows;
//! - the same over `ipc://` endpoints;
//! - the limit is the plan's engine family's: an 8 MiB frame is refused on a vLLM stream (4 MiB)
//!   and taken on an SGLang stream (16 MiB).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::{
    assert_alive, free_port, http_get, kv_engine, proc_status_bytes, sample, FakeController,
};

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_agent::kv::{publish_fixture, KvHub, PublishOptions};
use ic_shared::plan::{EnginePlan, HashScheme, NodePlan};

const BIN: &str = env!("CARGO_BIN_EXE_ic-agent");
const TIB: u64 = 1 << 40;
const BIG: usize = 256 << 20;
/// The bound a hostile peer must stay under: 128 MiB, half the chart's agent memory limit
/// (`resources.limits.memory: 256Mi`), which leaves the rest for the blocks the node holds.
const CHART_LIMIT_BYTES: u64 = 128 << 20;

/// What a hostile peer sends after its handshake, on every connection.
#[derive(Debug, Clone, Copy)]
enum Attack {
    /// A long-frame header announcing this many bytes, then nothing (the connection is held).
    Announce(u64),
    /// A real single-frame message of this many bytes.
    Frame(usize),
}

/// A hostile ZMTP 3 peer listening on loopback; counts the connections it attacked and the
/// frames it got through whole.
struct Hostile {
    port: u16,
    attacked: Arc<AtomicUsize>,
    delivered: Arc<AtomicUsize>,
}

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut frame = vec![0b100, body.len() as u8];
    frame.extend(body);
    frame
}

fn attack(
    mut s: impl Read + Write,
    socket_type: &'static str,
    attack: Attack,
    delivered: &AtomicUsize,
) -> std::io::Result<()> {
    s.write_all(&greeting())?;
    let mut peer = [0u8; 64];
    s.read_exact(&mut peer)?;
    s.write_all(&ready(socket_type))?;
    match attack {
        Attack::Announce(n) => {
            let mut h = vec![0b10u8];
            h.extend_from_slice(&n.to_be_bytes());
            s.write_all(&h)?;
            // Hold the connection until the agent drops it.
            let mut sink = [0u8; 4096];
            while s.read(&mut sink)? > 0 {}
        }
        Attack::Frame(n) => {
            let mut h = vec![0b10u8];
            h.extend_from_slice(&(n as u64).to_be_bytes());
            s.write_all(&h)?;
            // One shared chunk: the attackers allocate nothing per connection, so the in-process
            // test's peak RSS measures the agent's code alone.
            static CHUNK: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
            let chunk = CHUNK.get_or_init(|| vec![0x5Au8; 1 << 20]);
            let mut left = n;
            while left > 0 {
                let k = left.min(chunk.len());
                s.write_all(&chunk[..k])?;
                left -= k;
            }
            delivered.fetch_add(1, Ordering::SeqCst);
            let mut sink = [0u8; 4096];
            while s.read(&mut sink)? > 0 {}
        }
    }
    Ok(())
}

/// Starts a hostile peer of `socket_type` (`PUB` for a publisher, `ROUTER` for a replay socket).
fn hostile(socket_type: &'static str, what: Attack) -> Hostile {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let attacked = Arc::new(AtomicUsize::new(0));
    let delivered = Arc::new(AtomicUsize::new(0));
    let (count, whole) = (attacked.clone(), delivered.clone());
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let (count, whole) = (count.clone(), whole.clone());
            std::thread::spawn(move || {
                count.fetch_add(1, Ordering::SeqCst);
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let _ = attack(s, socket_type, what, &whole);
            });
        }
    });
    Hostile {
        port,
        attacked,
        delivered,
    }
}

/// The same peer on a Unix socket at `path` (an `ipc://` endpoint); `port` is 0.
fn hostile_ipc(path: &Path, socket_type: &'static str, what: Attack) -> Hostile {
    let l = std::os::unix::net::UnixListener::bind(path).unwrap();
    let attacked = Arc::new(AtomicUsize::new(0));
    let delivered = Arc::new(AtomicUsize::new(0));
    let (count, whole) = (attacked.clone(), delivered.clone());
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let (count, whole) = (count.clone(), whole.clone());
            std::thread::spawn(move || {
                count.fetch_add(1, Ordering::SeqCst);
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let _ = attack(s, socket_type, what, &whole);
            });
        }
    });
    Hostile {
        port: 0,
        attacked,
        delivered,
    }
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events/vllm-0.24.0.json")
}

/// A genuine publisher (vLLM 0.24.0's golden frames) repeating its frames until aborted.
fn genuine(port: u16) -> tokio::task::JoinHandle<()> {
    genuine_at(format!("tcp://127.0.0.1:{port}"))
}

/// The same at any endpoint (`ipc://…`).
fn genuine_at(endpoint: String) -> tokio::task::JoinHandle<()> {
    let opts = PublishOptions {
        connect_wait: Duration::from_millis(300),
        interval: Duration::from_millis(20),
        repeat: 0,
        ..PublishOptions::default()
    };
    tokio::spawn(async move {
        let _ = publish_fixture(&fixture(), &endpoint, None, &opts).await;
    })
}

fn engine(pod: &str, endpoint: String, replay: Option<String>) -> EnginePlan {
    kv_engine(pod, HashScheme::Vllm, endpoint, replay)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_survives_hostile_publishers_and_replay_sockets_within_its_memory_limit() {
    let (_fake, grpc, _received) = FakeController::start().await;
    let tib = hostile("PUB", Attack::Announce(TIB));
    let big = hostile("PUB", Attack::Frame(BIG));
    let big_replay = hostile("ROUTER", Attack::Frame(BIG));
    let good_port = free_port();
    let plan = NodePlan {
        engines: vec![
            engine("tib", format!("tcp://127.0.0.1:{}", tib.port), None),
            engine("big", format!("tcp://127.0.0.1:{}", big.port), None),
            engine(
                "good",
                format!("tcp://127.0.0.1:{good_port}"),
                Some(format!("tcp://127.0.0.1:{}", big_replay.port)),
            ),
        ],
        ..NodePlan::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, serde_json::to_vec(&plan).unwrap()).unwrap();
    let http = format!("127.0.0.1:{}", free_port());
    let stderr = dir.path().join("stderr");
    let publisher = genuine(good_port);
    let mut child = Command::new(BIN)
        .args(["run", "--controller", &format!("http://{grpc}"), "--plan"])
        .arg(&plan_path)
        .args(["--http-addr", &http, "--t2-scrape-interval-seconds", "0"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();

    let deadline = Instant::now() + Duration::from_secs(60);
    let dropped = "inferencecache_agent_kv_peers_dropped_total";
    let text = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_alive(&mut child, &stderr);
        if TcpStream::connect(&http).is_err() {
            assert!(Instant::now() < deadline, "no /metrics on {http}");
            continue;
        }
        let text = http_get(&http, "/metrics");
        let counted = |pod: &str, socket: &str| {
            sample(
                &text,
                dropped,
                &[
                    &format!("stream=\"team-a/{pod}#0\""),
                    &format!("socket=\"{socket}\""),
                    "reason=\"frame_too_large\"",
                ],
            )
        };
        let decoded = sample(
            &text,
            "inferencecache_agent_kv_batches_decoded_total",
            &["stream=\"team-a/good#0\""],
        );
        // Each hostile peer dropped more than once (the agent reconnects and drops it again),
        // and the genuine stream kept decoding meanwhile.
        if counted("tib", "events") >= 2.0
            && counted("big", "events") >= 2.0
            && counted("good", "replay") >= 1.0
            && decoded >= 20.0
        {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "not every hostile peer was counted, or the genuine stream stalled:\n{}\n{}",
            text.lines()
                .filter(|l| l.contains(dropped) && !l.ends_with(" 0") && !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n"),
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
    };
    assert_alive(&mut child, &stderr);
    let peak = proc_status_bytes(&pid, "VmHWM:");
    eprintln!("ic-agent run under attack: VmHWM {peak} bytes");
    let _ = child.kill();
    let _ = child.wait();
    publisher.abort();
    assert!(tib.attacked.load(Ordering::SeqCst) >= 2);
    assert!(
        peak < CHART_LIMIT_BYTES,
        "peak RSS {peak} bytes is over 128 Mi (half the chart's limit)"
    );
    // Nothing else was counted against the hostile peers (the reason is the frame's size).
    assert_eq!(
        sample(
            &text,
            dropped,
            &["stream=\"team-a/tib#0\"", "reason=\"bad_greeting\""]
        ),
        0.0
    );
    let log = std::fs::read_to_string(&stderr).unwrap();
    assert!(
        log.contains("engine connection dropped") && log.contains("1099511627776"),
        "no log line names the drop and the announced size:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_survives_a_publisher_announcing_one_tebibyte() {
    let (_fake, grpc, _received) = FakeController::start().await;
    let tib = hostile("PUB", Attack::Announce(TIB));
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "tok\n").unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let stderr = dir.path().join("stderr");
    let mut child = Command::new(BIN)
        .args([
            "subscribe".to_string(),
            format!("--endpoint=tcp://127.0.0.1:{}", tib.port),
            "--hash-scheme=vllm".into(),
            "--model-id=m".into(),
            "--tenant=team-a".into(),
            "--replica-id=vllm-0".into(),
            format!("--controller={grpc}"),
            format!("--token-file={}", token.display()),
            format!("--metrics-addr={metrics}"),
        ])
        .env("NODE_NAME", "node-1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_alive(&mut child, &stderr);
        if TcpStream::connect(&metrics).is_ok() {
            let text = http_get(&metrics, "/metrics");
            let n = sample(
                &text,
                "inferencecache_agent_kv_peers_dropped_total",
                &["socket=\"events\"", "reason=\"frame_too_large\""],
            );
            if n >= 3.0 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the hostile publisher was never counted"
        );
    }
    assert_alive(&mut child, &stderr);
    assert!(proc_status_bytes(&child.id().to_string(), "VmHWM:") < CHART_LIMIT_BYTES);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn kv_tail_ends_with_an_error_naming_the_oversize_frame() {
    let tib = hostile("PUB", Attack::Announce(TIB));
    let out = Command::new(BIN)
        .args(["kv", "tail", "--count", "1", "--timeout-seconds", "30"])
        .arg(format!("--endpoint=tcp://127.0.0.1:{}", tib.port))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {err}", out.status);
    assert!(
        err.contains("connection dropped") && err.contains("1099511627776"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_tail_reports_a_hostile_replay_socket_and_follows_the_live_stream() {
    let replay = hostile("ROUTER", Attack::Announce(TIB));
    let good_port = free_port();
    let publisher = genuine(good_port);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args(["kv", "tail", "--count", "3", "--json", "--from-seq", "0"])
            .args(["--timeout-seconds", "30"])
            .arg(format!("--endpoint=tcp://127.0.0.1:{good_port}"))
            .arg(format!("--replay=tcp://127.0.0.1:{}", replay.port))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    publisher.abort();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("connection dropped") && stdout.contains("frame"),
        "the failed replay is not reported:\n{stdout}"
    );
    let live = stdout
        .lines()
        .filter(|l| l.contains("\"source\":\"live\""))
        .count();
    assert_eq!(live, 3, "{stdout}");
}

/// Peak RSS of this test process, bytes.
fn own_hwm() -> u64 {
    proc_status_bytes("self", "VmHWM:")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_a_256_mib_frame_is_never_buffered_and_the_genuine_stream_flows() {
    let before = own_hwm();
    let big = hostile("PUB", Attack::Frame(BIG));
    let big_replay = hostile("ROUTER", Attack::Frame(BIG));
    let good_port = free_port();
    let publisher = genuine(good_port);
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    hub.apply_plan(&NodePlan {
        engines: vec![
            engine("big", format!("tcp://127.0.0.1:{}", big.port), None),
            engine(
                "good",
                format!("tcp://127.0.0.1:{good_port}"),
                Some(format!("tcp://127.0.0.1:{}", big_replay.port)),
            ),
        ],
        ..NodePlan::default()
    });
    let counter = |stream: &str, socket: &str| -> u64 {
        reg.gather()
            .iter()
            .filter(|f| f.name() == "inferencecache_agent_kv_peers_dropped_total")
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                let l = |n: &str| {
                    m.get_label()
                        .iter()
                        .find(|x| x.name() == n)
                        .map(|x| x.value().to_string())
                };
                l("stream").as_deref() == Some(stream)
                    && l("socket").as_deref() == Some(socket)
                    && l("reason").as_deref() == Some("frame_too_large")
            })
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = hub.take_deltas();
        let good = hub
            .status()
            .into_iter()
            .find(|s| s.stream_id == "team-a/good#0")
            .unwrap();
        // Each attacker was either dropped and came back (a second connection), or got its
        // whole frame through.
        let done = |h: &Hostile| {
            h.attacked.load(Ordering::SeqCst) >= 2 || h.delivered.load(Ordering::SeqCst) >= 1
        };
        if done(&big) && done(&big_replay) && good.batches_decoded >= 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the attackers never finished or the genuine stream stalled: {good:#?}"
        );
    }
    publisher.abort();
    let grown = own_hwm().saturating_sub(before);
    eprintln!("in process: VmHWM grew by {grown} bytes");
    assert!(
        grown < (64 << 20),
        "peak RSS grew by {grown} bytes: a 256 MiB frame was buffered"
    );
    assert_eq!(big.delivered.load(Ordering::SeqCst), 0);
    assert_eq!(big_replay.delivered.load(Ordering::SeqCst), 0);
    assert!(counter("team-a/big#0", "events") >= 1);
    assert!(counter("team-a/good#0", "replay") >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipc_publishers_go_through_the_same_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let bad_path = dir.path().join("bad.sock");
    let big = hostile_ipc(&bad_path, "PUB", Attack::Frame(BIG));
    let good = format!("ipc://{}", dir.path().join("good.sock").display());
    let publisher = genuine_at(good.clone());
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    hub.apply_plan(&NodePlan {
        engines: vec![
            engine("ipc-bad", format!("ipc://{}", bad_path.display()), None),
            engine("ipc-good", good, None),
        ],
        ..NodePlan::default()
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = hub.take_deltas();
        let status = hub.status();
        let decoded = status
            .iter()
            .find(|s| s.stream_id == "team-a/ipc-good#0")
            .map_or(0, |s| s.batches_decoded);
        let dropped = sample(
            &prometheus::TextEncoder::new()
                .encode_to_string(&reg.gather())
                .unwrap(),
            "inferencecache_agent_kv_peers_dropped_total",
            &["stream=\"team-a/ipc-bad#0\"", "reason=\"frame_too_large\""],
        );
        if dropped >= 2.0 && decoded >= 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ipc: dropped {dropped}, decoded {decoded}: {status:#?}"
        );
    }
    publisher.abort();
    assert_eq!(big.delivered.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_follows_the_plans_engine_family() {
    // 8 MiB: over vLLM's 4 MiB, within SGLang's 16 MiB.
    let to_vllm = hostile("PUB", Attack::Frame(8 << 20));
    let to_sglang = hostile("PUB", Attack::Frame(8 << 20));
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    let mut sglang = engine(
        "sglang",
        format!("tcp://127.0.0.1:{}", to_sglang.port),
        None,
    );
    sglang.hash_scheme = HashScheme::Sglang;
    hub.apply_plan(&NodePlan {
        engines: vec![
            engine("vllm", format!("tcp://127.0.0.1:{}", to_vllm.port), None),
            sglang,
        ],
        ..NodePlan::default()
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&reg.gather())
            .unwrap();
        let received = hub
            .status()
            .iter()
            .find(|s| s.stream_id == "team-a/sglang#0")
            .map_or(0, |s| s.events_received);
        let vllm_dropped = sample(
            &text,
            "inferencecache_agent_kv_peers_dropped_total",
            &["stream=\"team-a/vllm#0\"", "reason=\"frame_too_large\""],
        );
        if vllm_dropped >= 1.0 && received >= 1 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "vLLM dropped {vllm_dropped}, SGLang received {received}"
        );
    };
    // SGLang's stream took the frame whole (and dropped it as a malformed message, one frame).
    assert_eq!(
        sample(
            &text,
            "inferencecache_agent_kv_peers_dropped_total",
            &["stream=\"team-a/sglang#0\""],
        ),
        0.0
    );
    assert!(to_sglang.delivered.load(Ordering::SeqCst) >= 1);
    assert_eq!(to_vllm.delivered.load(Ordering::SeqCst), 0);
}
