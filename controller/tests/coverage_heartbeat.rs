//! Every Exact has an age (issue 37 item 2): through the controller's real gRPC ingest and
//! router, an agent that stops sending — its stream left open, as a SIGSTOPped or wedged agent
//! leaves it until the HTTP/2 keep-alive gives up ~50 s later — stops being routed within the
//! coverage heartbeat bound and reads Unknown / `HeartbeatMissed`; an agent whose heartbeats
//! run late (but within the bound) is never downgraded; a frozen agent heard again reads its
//! reported coverage again. `LookupRoute` and `/snapshot` carry each replica's coverage age.
//!
//! Before heartbeats, the silent agent's replica stayed Exact and routed for as long as the
//! connection stayed open (here: for good), so this test timed out waiting for the downgrade.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod agent_stream_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_stream_support::{connect_with, serve_ingest};
use ic_controller::router::Router;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::proto::{
    self, agent_message::Msg, router_service_client::RouterServiceClient,
    router_service_server::RouterServiceServer, AgentMessage, BlockEntry, CoverageHeartbeat,
    Decision, LookupRouteRequest, LookupRouteResponse, Resync, StreamDescriptor, StreamSnapshot,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::TcpListenerStream;

/// The controller's bound in this test (the flag's least legal value is just over 3 s).
const BOUND: Duration = Duration::from_secs(4);
/// The one block both replicas hold.
const KEY: u64 = 0x00c0_ffee;

async fn serve_router(shared: Arc<Shared>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RouterServiceServer::new(Router::new(shared)))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

fn descriptor(pod: &str) -> StreamDescriptor {
    StreamDescriptor {
        stream_id: format!("ns/{pod}#0"),
        replica: pod.into(),
        tenant: "ns".into(),
        model: "m".into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    }
}

/// An agent stream announcing `coverage-heartbeat`, its one replica `pod` Exact with [`KEY`].
/// Returns the sender (the stream stays open while it lives) and the inbound half.
async fn connect(
    grpc: &str,
    node: &str,
    pod: &str,
) -> (
    mpsc::Sender<AgentMessage>,
    tonic::Streaming<proto::ControllerMessage>,
) {
    let hello = proto::Hello {
        node: node.into(),
        capabilities: vec![
            "kv-events".into(),
            ic_shared::link::COVERAGE_HEARTBEAT.into(),
        ],
        ..Default::default()
    };
    let first = AgentMessage {
        msg: Some(Msg::Resync(Resync {
            streams: vec![StreamSnapshot {
                stream: Some(descriptor(pod)),
                entries: vec![BlockEntry {
                    block_size: 16,
                    content_key: KEY,
                    tier: proto::Tier::T1 as i32,
                    ..Default::default()
                }],
                coverage: proto::Coverage::Exact as i32,
                ..Default::default()
            }],
        })),
    };
    let s = connect_with(grpc, hello, first).await;
    (s.tx, s.inbound)
}

fn heartbeat() -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Heartbeat(CoverageHeartbeat { interval_ms: 1000 })),
    }
}

async fn lookup(
    router: &mut RouterServiceClient<tonic::transport::Channel>,
) -> LookupRouteResponse {
    router
        .lookup_route(LookupRouteRequest {
            content_keys: vec![KEY],
            block_size: 16,
            hash_scheme: "vllm".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

fn matched<'a>(r: &'a LookupRouteResponse, pod: &str) -> Option<&'a proto::ReplicaMatch> {
    r.replicas.iter().find(|m| m.replica == pod)
}

/// The late-but-live agent's replica: matched, Exact, its age under the bound.
fn assert_late_routed(r: &LookupRouteResponse, at: &str) {
    let m = matched(r, "late-0")
        .unwrap_or_else(|| panic!("{at}: the live (late) agent's replica is not routed: {r:?}"));
    assert_eq!(
        (m.coverage, m.coverage_reason.as_str()),
        (proto::Coverage::Exact as i32, ""),
        "{at}: {m:?}"
    );
    let age = m.coverage_age_ms.expect("a routed replica carries its age");
    assert!(age < BOUND.as_millis() as u64, "{at}: age {age} ms: {m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_stops_routing_within_the_bound_and_a_late_live_one_never_flaps() {
    let shared = Arc::new(
        Shared::new(LookupPolicy {
            coverage_heartbeat_bound: Some(BOUND),
            ..Default::default()
        })
        .unwrap(),
    );
    let grpc = serve_ingest(shared.clone()).await;
    let channel = tonic::transport::Endpoint::from_shared(serve_router(shared.clone()).await)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut router = RouterServiceClient::new(channel);

    // The late agent heartbeats for the whole test, each one late by up to 1.6 s (gaps of up
    // to 2.6 s against a 1 s cadence and a 4 s bound): lagging, but live.
    let (late_tx, _late_in) = connect(&grpc, "node-late", "late-0").await;
    let late = tokio::spawn(async move {
        let gaps = [1000u64, 2600, 400, 1800, 2200, 1000, 2600];
        for g in gaps.iter().cycle() {
            tokio::time::sleep(Duration::from_millis(*g)).await;
            if late_tx.send(heartbeat()).await.is_err() {
                return;
            }
        }
    });
    // The frozen agent sends its Hello and resync and then nothing; the stream stays open.
    let sent = Instant::now();
    let (frozen_tx, _frozen_in) = connect(&grpc, "node-frozen", "frozen-0").await;

    // Both are routed, Exact, with an age.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = lookup(&mut router).await;
        if r.replicas.len() == 2 {
            assert_eq!(r.decision, Decision::PrefixMatch as i32);
            for m in &r.replicas {
                assert_eq!(m.coverage, proto::Coverage::Exact as i32, "{m:?}");
                assert!(m.coverage_age_ms.is_some(), "{m:?}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "both replicas never routed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The frozen one stops being routed: not before the bound after its last message, and
    // within the bound plus the watcher's period and generous slack for this shared machine.
    let stopped = loop {
        let r = lookup(&mut router).await;
        assert_late_routed(&r, "while the frozen agent is silent");
        if matched(&r, "frozen-0").is_none() {
            break sent.elapsed();
        }
        assert!(
            sent.elapsed() < Duration::from_secs(30),
            "the silent agent's replica is still routed {:?} after its last message (bound {BOUND:?}): {r:?}",
            sent.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "silent agent's replica stopped routing {stopped:?} after its last message was sent (bound {BOUND:?})"
    );
    assert!(
        stopped + Duration::from_millis(5) >= BOUND,
        "downgraded {stopped:?} after its last message, before the bound {BOUND:?}"
    );
    assert!(
        stopped <= BOUND + Duration::from_secs(3),
        "downgraded only {stopped:?} after its last message (bound {BOUND:?})"
    );

    // /snapshot and the answer's inexact count say why.
    {
        let snap = shared.index.read().snapshot();
        let f = snap
            .replicas
            .iter()
            .find(|r| r.replica == "frozen-0")
            .expect("the frozen agent's replica is kept (entries as last reported)");
        assert_eq!(
            (f.coverage, f.coverage_reason, f.routable, f.prefix_count),
            ("Unknown", Some("HeartbeatMissed"), false, 1),
            "{f:?}"
        );
        assert!(
            f.coverage_age_ms.unwrap() >= BOUND.as_millis() as u64,
            "{f:?}"
        );
        let l = snap
            .replicas
            .iter()
            .find(|r| r.replica == "late-0")
            .unwrap();
        assert_eq!((l.coverage, l.routable), ("Exact", true), "{l:?}");
        assert!(
            l.coverage_age_ms.unwrap() < BOUND.as_millis() as u64,
            "{l:?}"
        );
    }
    let r = lookup(&mut router).await;
    assert!(r.inexact_replicas >= 1, "{r:?}");

    // Two more bounds of late heartbeats: the live agent is never downgraded.
    let until = Instant::now() + BOUND * 2;
    while Instant::now() < until {
        let r = lookup(&mut router).await;
        assert_late_routed(&r, "later");
        assert!(matched(&r, "frozen-0").is_none(), "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Heard again: the frozen agent's replica reads what it reported (Exact) and is routed.
    frozen_tx.send(heartbeat()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = lookup(&mut router).await;
        if let Some(m) = matched(&r, "frozen-0") {
            assert_eq!(
                (m.coverage, m.coverage_reason.as_str()),
                (proto::Coverage::Exact as i32, ""),
                "{m:?}"
            );
            assert!(
                m.coverage_age_ms.unwrap() < BOUND.as_millis() as u64,
                "{m:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the frozen agent, heard again, is still not routed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    late.abort();
}

/// An agent that does not announce `coverage-heartbeat` (an older agent mid-upgrade) is not
/// held to the bound: its idle replica stays routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_without_the_capability_is_not_held_to_the_bound() {
    let bound = Duration::from_millis(3100);
    let shared = Arc::new(
        Shared::new(LookupPolicy {
            coverage_heartbeat_bound: Some(bound),
            ..Default::default()
        })
        .unwrap(),
    );
    let grpc = serve_ingest(shared.clone()).await;
    let engines = agent_stream_support::Engines {
        namespace: "ns",
        model: "m",
        hash_scheme: "vllm",
        backend: "",
        block_size: 16,
        key_base: KEY,
    };
    let _old =
        agent_stream_support::connect(&grpc, "node-old", engines.resync(&["old-0"], 1)).await;
    agent_stream_support::until("the old agent's resync", || {
        shared.index.read().snapshot().replicas.len() == 1
    })
    .await;
    tokio::time::sleep(bound * 2).await;
    let snap = shared.index.read().snapshot();
    let r = &snap.replicas[0];
    assert!(r.routable, "{r:?}");
    assert_ne!(r.coverage_reason, Some("HeartbeatMissed"), "{r:?}");
    assert!(
        r.coverage_age_ms.unwrap() >= bound.as_millis() as u64,
        "{r:?}"
    );
}
