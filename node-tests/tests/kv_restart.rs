//! Restart convergence of the KV pipeline (issue 3, "Agent → controller"): with a real ZMQ
//! publisher replaying genuine vLLM frames, an agent and a controller over loopback gRPC, kill
//! the agent, the controller, or the engine publisher in the middle of the stream and check that
//! the index converges to the ground truth within 5 s of the last frame.
//!
//! Ground truth = the content keys a fresh replay of the same frames produces: the engine
//! incarnation's frames fed, in order, through a fresh [`StreamState`] with the plan's settings.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::agent::AgentProc;
use support::stack::{free_port, kv_fixture, start_controller, wait_until};

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ic_agent::kv::publish::{publish_fixture, Fixture, PublishOptions};
use ic_agent::kv::{StreamConfig, StreamState};
use ic_controller::index::Tier;
use ic_shared::kv::decode::decode_batch;
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};

const FIXTURE: &str = "vllm-0.24.0.json";
const STREAM: &str = "default/vllm-0#0";
const NODE: &str = "node-restart";
/// Frames are this far apart, so a kill lands mid-stream.
const INTERVAL: Duration = Duration::from_millis(350);
const CONNECT_WAIT: Duration = Duration::from_millis(1500);
/// Convergence bound after the last frame.
const CONVERGE: Duration = Duration::from_secs(5);

type Entry = (String, u32, u64, i32);

/// What a fresh replay of `seqs` (dp0 frames, in order) gives: the stream's entries.
fn ground_truth(seqs: &[u64]) -> BTreeSet<Entry> {
    let fx = Fixture::load(&kv_fixture(FIXTURE)).unwrap();
    let mut st = StreamState::new(StreamConfig {
        keeps_l2: true,
        block_size: 16,
        ..StreamConfig::default()
    });
    for f in fx
        .frames("dp0")
        .into_iter()
        .filter(|f| seqs.contains(&f.seq))
    {
        st.apply(f.seq, &decode_batch(&f.payload).unwrap(), 0);
    }
    let (_, entries, stale) = st.snapshot();
    assert!(!stale);
    entries
        .into_iter()
        .map(|e| (e.adapter, e.block_size, e.content_key, e.tier))
        .collect()
}

fn index_entries(shared: &ic_controller::state::Shared) -> Option<BTreeSet<Entry>> {
    let ix = shared.index.read();
    let entries = ix.stream_entries(STREAM)?;
    Some(
        entries
            .into_iter()
            .map(|e| {
                let tier = match e.tier {
                    Tier::T1 => ic_shared::proto::Tier::T1,
                    Tier::T2 => ic_shared::proto::Tier::T2,
                } as i32;
                (e.adapter, e.block_size, e.content_key, tier)
            })
            .collect(),
    )
}

fn plan(pub_port: u16, replay_port: u16) -> NodePlan {
    NodePlan {
        engines: vec![EnginePlan {
            namespace: "default".into(),
            pod: "vllm-0".into(),
            model: "demo-model".into(),
            hash_scheme: HashScheme::Vllm,
            block_size: 16,
            keeps_l2: true,
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

fn start_agent(grpc: SocketAddr, plan: &NodePlan) -> AgentProc {
    support::agent::start_agent(grpc, NODE, plan, None, Duration::from_secs(5))
}

/// A publisher task replaying the fixture's dp0 frames once, withholding `skip`; returns the task
/// and the instant its last live frame goes out (approximately: binding time is not counted,
/// which only makes the bound stricter).
fn start_publisher(
    pub_port: u16,
    replay_port: u16,
    skip: &[u64],
) -> (tokio::task::JoinHandle<()>, Instant) {
    let fx = Fixture::load(&kv_fixture(FIXTURE)).unwrap();
    let live = fx
        .frames("dp0")
        .iter()
        .filter(|f| !skip.contains(&f.seq))
        .count() as u32;
    let opts = PublishOptions {
        connect_wait: CONNECT_WAIT,
        interval: INTERVAL,
        linger: Duration::from_secs(60),
        skip_seqs: skip.iter().copied().collect(),
        ..Default::default()
    };
    let last = Instant::now() + CONNECT_WAIT + INTERVAL * live.saturating_sub(1);
    let task = tokio::spawn(async move {
        let r = publish_fixture(
            &kv_fixture(FIXTURE),
            &format!("tcp://127.0.0.1:{pub_port}"),
            Some(&format!("tcp://127.0.0.1:{replay_port}")),
            &opts,
        )
        .await;
        if let Err(e) = r {
            eprintln!("publisher: {e}");
        }
    });
    (task, last)
}

/// Waits for the last frame (its scheduled time, and the agent having applied `final_seq`), then
/// for the index to equal `truth`; returns how long that took after the last frame.
async fn assert_converges(
    shared: &ic_controller::state::Shared,
    agent: &AgentProc,
    truth: &BTreeSet<Entry>,
    last_frame: Instant,
    final_seq: u64,
) -> Duration {
    tokio::time::sleep_until(tokio::time::Instant::from_std(last_frame)).await;
    wait_until(
        "the agent to apply the last frame",
        Duration::from_secs(20),
        || last_seq(agent) == Some(final_seq),
    )
    .await;
    let start = Instant::now();
    loop {
        let got = index_entries(shared);
        if got.as_ref() == Some(truth) {
            return start.elapsed();
        }
        if start.elapsed() > CONVERGE {
            panic!(
                "index did not converge within {CONVERGE:?} of the last frame:\n  index: {got:?}\n  truth: {truth:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Every withheld frame: the recording's final AllBlocksCleared (seq 9) keeps the state.
const KEEP_STATE: &[u64] = &[9];

fn last_seq(agent: &AgentProc) -> Option<u64> {
    agent.state().hub.status().first().and_then(|s| s.last_seq)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_agent_mid_stream_converges_to_the_ground_truth() {
    let truth = ground_truth(&(0..=8).collect::<Vec<_>>());
    assert!(truth.len() >= 4, "{truth:?}");
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let (pub_port, replay_port) = (free_port(), free_port());
    let plan = plan(pub_port, replay_port);
    let agent = start_agent(grpc, &plan);
    let (publisher, last_frame) = start_publisher(pub_port, replay_port, KEEP_STATE);

    wait_until("the agent to apply seq 3", Duration::from_secs(15), || {
        last_seq(&agent).is_some_and(|s| s >= 3)
    })
    .await;
    let killed_at = last_seq(&agent);
    agent.terminate();
    // A new agent process on the same node: it bootstraps by replay and resyncs the node.
    let agent = start_agent(grpc, &plan);
    let took = assert_converges(&controller.shared, &agent, &truth, last_frame, 8).await;
    eprintln!("agent killed after seq {killed_at:?}; converged {took:?} after the last frame");
    assert!(
        agent.state().hub.status()[0].replays >= 1,
        "bootstrap replay ran"
    );

    publisher.abort();
    agent.terminate();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_controller_mid_stream_converges_to_the_ground_truth() {
    let truth = ground_truth(&(0..=8).collect::<Vec<_>>());
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let (pub_port, replay_port) = (free_port(), free_port());
    let plan = plan(pub_port, replay_port);
    let agent = start_agent(grpc, &plan);
    let (publisher, last_frame) = start_publisher(pub_port, replay_port, KEEP_STATE);

    wait_until(
        "the index to hold seq 3's state",
        Duration::from_secs(15),
        || {
            last_seq(&agent).is_some_and(|s| s >= 3)
                && index_entries(&controller.shared).is_some_and(|e| !e.is_empty())
        },
    )
    .await;
    controller.stop().await;
    // A fresh controller on the same address starts empty; the agent reconnects and resyncs.
    let controller = start_controller(grpc).await;
    assert!(index_entries(&controller.shared).is_none());
    let took = assert_converges(&controller.shared, &agent, &truth, last_frame, 8).await;
    eprintln!("controller restarted mid-stream; converged {took:?} after the last frame");

    publisher.abort();
    agent.terminate();
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_engine_publisher_mid_stream_converges_to_the_new_incarnation() {
    // The restarted engine starts empty and replays only its first three batches, so a stale
    // block of the old incarnation (e.g. A3, removed by the old seq 3 and kept at T2) would show.
    let new_skip: Vec<u64> = (3..=9).collect();
    let truth = ground_truth(&[0, 1, 2]);
    let old_truth = ground_truth(&(0..=8).collect::<Vec<_>>());
    assert_ne!(truth, old_truth);
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let (pub_port, replay_port) = (free_port(), free_port());
    let plan = plan(pub_port, replay_port);
    let agent = start_agent(grpc, &plan);
    let (publisher, _) = start_publisher(pub_port, replay_port, KEEP_STATE);

    wait_until("the agent to apply seq 4", Duration::from_secs(15), || {
        last_seq(&agent).is_some_and(|s| s >= 4)
    })
    .await;
    publisher.abort();
    let _ = publisher.await;
    // The engine comes back on the same ports with an empty cache; its seqs restart at 0.
    let (publisher, last_frame) = start_publisher(pub_port, replay_port, &new_skip);
    let took = assert_converges(&controller.shared, &agent, &truth, last_frame, 2).await;
    eprintln!("publisher restarted mid-stream; converged {took:?} after the last frame");
    let status = &agent.state().hub.status()[0];
    assert!(
        status.resyncs >= 1,
        "the restart cleared the replica: {status:?}"
    );

    publisher.abort();
    agent.terminate();
    controller.stop().await;
}
