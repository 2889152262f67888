//! Issue 38 D2 and D4 against the `ic-controller` binary on loopback (docs/security.md
//! "Streams, handshakes and idle connections"):
//!
//! - D2: a chunked resync was assembled whole before any cap applied — 1 000 000 one-entry
//!   streams took the controller to 811 MiB. Now a chunked resync naming more than
//!   `--max-streams-per-reporter` distinct streams is refused at the chunk that passes it
//!   (`RESOURCE_EXHAUSTED`), and one carrying more than `--max-resync-entries` entries likewise;
//!   the binary's peak resident memory (`VmHWM`) is read around the attack.
//! - D4: one client kept every agent out by holding all `--agent-max-pending-hellos` slots with
//!   Hello-less streams. Now one source address holds at most
//!   `--agent-max-pending-hellos-per-source` of them: while 127.0.0.1 floods, an agent
//!   connecting from 127.0.0.2 (its socket bound there) is accepted.
//!
//! `IC_TEST_CONTROLLER_BIN` runs another build of the binary (e.g. an older release, to see
//! these tests fail on it); unset, the one cargo built for this test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod h2_raw_support;
mod process_support;
use h2_raw_support::{connect_headers, frame, PREFACE};
use process_support::{free_port, status_kib, KillOnDrop};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ic_shared::proto::agent_message::Msg;
use ic_shared::proto::agent_service_client::AgentServiceClient;
use ic_shared::proto::{
    self, AgentMessage, BlockEntry, ResyncChunk, StreamDescriptor, StreamSnapshot,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Generous guard for "the server answers or refuses it".
const GUARD: Duration = Duration::from_secs(60);

// ---- the binary ---------------------------------------------------------------------------

struct Controller {
    child: KillOnDrop,
    grpc: SocketAddr,
    http: SocketAddr,
}

/// Starts `ic-controller standalone` on free loopback ports with `extra` flags and waits for
/// `/readyz`.
async fn controller(extra: &[&str]) -> Controller {
    let (grpc, http) = (free_port(), free_port());
    let bin = std::env::var("IC_TEST_CONTROLLER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_ic-controller").to_string());
    let child = std::process::Command::new(bin)
        .arg("standalone")
        .arg(format!("--grpc-addr=127.0.0.1:{grpc}"))
        .arg(format!("--http-addr=127.0.0.1:{http}"))
        .args(extra)
        .env("MIMALLOC_PURGE_DELAY", "0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let c = Controller {
        child: KillOnDrop(child),
        grpc: format!("127.0.0.1:{grpc}").parse().unwrap(),
        http: format!("127.0.0.1:{http}").parse().unwrap(),
    };
    let deadline = Instant::now() + GUARD;
    while http_get(c.http, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "the controller did not start");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c
}

/// One HTTP/1.1 GET on a fresh connection: the status (0 when none) and the body.
async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(GUARD, s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// The sum of the `/metrics` samples whose line starts with `prefix` (name and labels).
async fn metric(c: &Controller, prefix: &str) -> u64 {
    let (_, body) = http_get(c.http, "/metrics").await;
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn hello(node: &str) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Hello(proto::Hello {
            node: node.into(),
            version: "0.1.0".into(),
            agent_instance: format!("{node}-i"),
            ..Default::default()
        })),
    }
}

/// Stream `i` of a resync: `entries` one-block entries.
fn snapshot(i: u64, entries: u64) -> StreamSnapshot {
    StreamSnapshot {
        stream: Some(StreamDescriptor {
            stream_id: format!("t/p{i}#0"),
            replica: format!("p{i}"),
            tenant: "t".into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        }),
        entries: (0..entries)
            .map(|k| BlockEntry {
                block_size: 16,
                content_key: i * entries + k + 1,
                tier: proto::Tier::T1 as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// A resync of `streams` streams × `entries` entries, as `ResyncChunk`s of `per_chunk`
/// streams, made one at a time as the stream takes them (the client holds at most a few).
/// Returns the call's end (its status when refused, `Ok` while it stays open until `GUARD`)
/// and how many chunks were taken.
async fn chunked_resync(
    grpc: SocketAddr,
    node: &str,
    streams: u64,
    entries: u64,
    per_chunk: u64,
) -> (Result<(), tonic::Status>, u64) {
    let (tx, rx) = mpsc::channel::<AgentMessage>(2);
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = sent.clone();
    tx.send(hello(node)).await.unwrap();
    let feeder = tokio::spawn(async move {
        let n = streams.div_ceil(per_chunk);
        for chunk in 0..n {
            let snaps = (chunk * per_chunk..((chunk + 1) * per_chunk).min(streams))
                .map(|i| snapshot(i, entries))
                .collect();
            let msg = AgentMessage {
                msg: Some(Msg::ResyncChunk(ResyncChunk {
                    chunk: chunk as u32,
                    last: chunk + 1 == n,
                    streams: snaps,
                })),
            };
            if tx.send(msg).await.is_err() {
                return;
            }
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Hold the stream open after the last chunk.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        drop(tx);
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = AgentServiceClient::new(channel).max_decoding_message_size(64 * 1024 * 1024);
    let end = tokio::time::timeout(GUARD, async {
        let mut replies = client.connect(ReceiverStream::new(rx)).await?.into_inner();
        loop {
            match replies.message().await? {
                Some(_) => continue,
                None => return Ok(()),
            }
        }
    })
    .await
    .unwrap_or(Ok(()));
    feeder.abort();
    (end, sent.load(std::sync::atomic::Ordering::Relaxed))
}

/// Issue 38 D2: a chunked resync of 1 000 000 one-entry streams (250 chunks of 4 000) was
/// assembled whole — 811 MiB resident — before the 256-stream cap kept 256 of them. Now the
/// first chunk passing the cap ends the stream with RESOURCE_EXHAUSTED naming the flag, only
/// a few chunks ever leave the client, and the controller's peak resident memory grows by
/// less than 48 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_stream_chunked_resync_is_refused_at_the_chunk_passing_the_stream_cap() {
    let c = controller(&[]).await;
    let pid = c.child.0.id();
    let before = status_kib(pid, "VmRSS:");
    let (end, sent) = chunked_resync(c.grpc, "big-node", 1_000_000, 1, 4_000).await;
    let (after, peak) = (status_kib(pid, "VmRSS:"), status_kib(pid, "VmHWM:"));
    eprintln!(
        "controller RSS {before} KiB -> peak {peak} KiB, {after} KiB after; {sent} of 250 chunks taken; end {end:?}"
    );
    let err = end.expect_err("the 1 000 000-stream resync was not refused");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("--max-streams-per-reporter"),
        "{err}"
    );
    assert!(sent < 50, "{sent} chunks were taken before the refusal");
    let grown_mib = peak.saturating_sub(before) / 1024;
    assert!(
        grown_mib < 48,
        "the controller's peak grew by {grown_mib} MiB ({before} -> {peak} KiB)"
    );
    assert_eq!(
        metric(
            &c,
            "inferencecache_controller_kv_streams_refused_total{reason=\"resync_stream_cap\"}"
        )
        .await,
        1
    );
    assert_eq!(
        metric(&c, "inferencecache_controller_index_replicas ").await,
        0
    );
    assert_eq!(http_get(c.http, "/healthz").await.0, 200);
}

/// `--max-resync-entries` bounds the entries of one resync, all chunks together: 16 streams ×
/// 10 000 entries against a bound of 100 000 are refused (RESOURCE_EXHAUSTED naming the flag,
/// counted); 8 × 10 000 from another node are applied whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_over_the_entry_bound_is_refused_and_one_within_it_is_applied() {
    let c = controller(&["--max-resync-entries=100000"]).await;
    let (end, _) = chunked_resync(c.grpc, "over", 16, 10_000, 2).await;
    let err = end.expect_err("the 160 000-entry resync was not refused");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("--max-resync-entries"), "{err}");
    assert_eq!(
        metric(
            &c,
            "inferencecache_controller_kv_streams_refused_total{reason=\"resync_entry_cap\"}"
        )
        .await,
        1
    );

    // Within the bound: applied (the stream stays open; its entries reach the index).
    let within = tokio::spawn(chunked_resync(c.grpc, "within", 8, 10_000, 2));
    let deadline = Instant::now() + GUARD;
    while metric(&c, "inferencecache_controller_index_entries ").await != 80_000 {
        assert!(
            Instant::now() < deadline,
            "the 80 000-entry resync was not applied"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    within.abort();
}

// ---- D4: pending Hellos per source ----------------------------------------------------------

/// A raw HTTP/2 connection from 127.0.0.1 opening `streams` Hello-less Connect streams; the
/// task holds it (reading what the server sends) until aborted.
async fn hello_less_flood(addr: SocketAddr, streams: u32) -> tokio::task::JoinHandle<()> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(0x4, 0, 0, &[])).await.unwrap();
    let mut burst = Vec::new();
    for i in 0..streams {
        burst.extend(connect_headers(2 * i + 1));
    }
    s.write_all(&burst).await.unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        let mut acked = false;
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) if !acked => {
                    // Acknowledge the server's SETTINGS (sent first), or it closes us.
                    acked = true;
                    if s.write_all(&frame(0x4, 0x1, 0, &[])).await.is_err() {
                        return;
                    }
                }
                Ok(_) => {}
            }
        }
    })
}

/// A tonic channel whose connections leave from `source` (a loopback address).
async fn channel_from(source: &str, to: SocketAddr) -> tonic::transport::Channel {
    let source: SocketAddr = format!("{source}:0").parse().unwrap();
    tonic::transport::Endpoint::from_shared(format!("http://{to}"))
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: http::Uri| async move {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(source)?;
            let tcp = socket.connect(to).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
        }))
        .await
        .unwrap()
}

/// Issue 38 D4: 8 connections × 128 Hello-less streams from one client held all 1 024
/// pending-Hello slots and every real agent was refused RESOURCE_EXHAUSTED. Here 4 × 64 such
/// streams from 127.0.0.1 against a global cap of 128: that source keeps 64 (the per-source
/// default), the other 192 are refused at once and counted, a 65th from it is refused naming
/// the flag, and an agent connecting from 127.0.0.2 is accepted meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_flooding_hello_less_streams_does_not_keep_another_source_out() {
    let c = controller(&[
        "--agent-max-pending-hellos=128",
        "--agent-hello-timeout-seconds=300",
    ])
    .await;
    let mut floods = Vec::new();
    for _ in 0..4 {
        floods.push(hello_less_flood(c.grpc, 64).await);
    }
    // Every stream past the slots it may hold is refused (old code: past the global 128).
    let deadline = Instant::now() + GUARD;
    while metric(
        &c,
        "inferencecache_controller_agent_streams_total{outcome=\"rejected",
    )
    .await
        < 128
    {
        assert!(Instant::now() < deadline, "the flood was not refused");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Another source gets in.
    let (tx, rx) = mpsc::channel::<AgentMessage>(4);
    tx.send(hello("real-node")).await.unwrap();
    let other = AgentServiceClient::new(channel_from("127.0.0.2", c.grpc).await)
        .connect(ReceiverStream::new(rx))
        .await;
    assert!(
        other.is_ok(),
        "an agent from 127.0.0.2 was kept out: {:?}",
        other.err()
    );
    let deadline = Instant::now() + GUARD;
    while metric(&c, "inferencecache_controller_agents_connected ").await != 1 {
        assert!(Instant::now() < deadline, "the agent did not connect");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The flooding source is held at its share, refused at once, counted.
    let (_tx1, rx1) = mpsc::channel::<AgentMessage>(1);
    let err = tokio::time::timeout(
        GUARD,
        AgentServiceClient::new(channel_from("127.0.0.1", c.grpc).await)
            .connect(ReceiverStream::new(rx1)),
    )
    .await
    .expect("a stream over the per-source cap was held, not refused")
    .expect_err("a stream over the per-source cap was accepted");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    assert!(
        err.message()
            .contains("--agent-max-pending-hellos-per-source"),
        "{err}"
    );
    assert_eq!(
        metric(
            &c,
            "inferencecache_controller_agent_streams_total{outcome=\"rejected\",reason=\"pending_per_source_full\"}"
        )
        .await,
        193
    );
    for f in floods {
        f.abort();
    }
    drop(tx);
}
