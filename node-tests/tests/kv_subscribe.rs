//! The per-pod kvevent-subscriber (`ic-agent subscribe`) end to end over loopback: a standalone
//! controller in process, a real ZMQ publisher replaying genuine vLLM 0.24.0 frames (with its
//! replay ROUTER), and two subscribers started from the Pod webhook's exact command line through
//! the library entry point, each in its own runtime like a process:
//!
//! - `vllm-offload` with `--ignore-block-removed=true` (Offload: the backend keeps an L2), so the
//!   BlockRemoved of A3 re-reports it at T2;
//! - `vllm-events-only` without it (EventsOnly), so the same BlockRemoved evicts A3.
//!
//! The controller's index must hold both replicas with exactly the blocks and tiers a fresh
//! replay of the frames gives (ground truth through `StreamState`), filed apart from the node's
//! agent (`<node>/<namespace>/<pod>`); then the controller is killed mid-stream and a fresh one on
//! the same address must converge to the same state (the subscribers reconnect and resync).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::stack::{free_port, kv_fixture, start_controller, wait_until};

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ic_agent::kv::publish::{publish_fixture, Fixture, PublishOptions};
use ic_agent::kv::{StreamConfig, StreamState};
use ic_agent::subscribe::{self, Subscriber};
use ic_controller::index::Tier;
use ic_controller::state::Shared;
use ic_shared::kv::decode::decode_batch;

const FIXTURE: &str = "vllm-0.24.0.json";
const NODE: &str = "node-sub";
const NAMESPACE: &str = "team-a";
const OFFLOAD_POD: &str = "vllm-offload";
const EVENTS_ONLY_POD: &str = "vllm-events-only";
const INTERVAL: Duration = Duration::from_millis(300);
const CONNECT_WAIT: Duration = Duration::from_millis(1500);
/// Convergence bound after the last frame.
const CONVERGE: Duration = Duration::from_secs(5);
/// The recording ends with AllBlocksCleared (seq 9): withhold it to keep the state.
const FINAL_SEQ: u64 = 8;

type Entry = (String, u32, u64, Tier);

/// A fresh replay of the dp0 frames 0..=FINAL_SEQ with `keeps_l2`.
fn ground_truth(keeps_l2: bool) -> BTreeSet<Entry> {
    let fx = Fixture::load(&kv_fixture(FIXTURE)).unwrap();
    let mut st = StreamState::new(StreamConfig {
        keeps_l2,
        block_size: 16,
        ..StreamConfig::default()
    });
    for f in fx.frames("dp0").into_iter().filter(|f| f.seq <= FINAL_SEQ) {
        st.apply(f.seq, &decode_batch(&f.payload).unwrap(), 0);
    }
    let (_, entries, stale) = st.snapshot();
    assert!(!stale);
    entries
        .into_iter()
        .map(|e| {
            let tier = if e.tier == ic_shared::proto::Tier::T2 as i32 {
                Tier::T2
            } else {
                Tier::T1
            };
            (e.adapter, e.block_size, e.content_key, tier)
        })
        .collect()
}

fn stream_id(pod: &str) -> String {
    format!("{NAMESPACE}/{pod}#0")
}

fn index_entries(shared: &Shared, pod: &str) -> Option<BTreeSet<Entry>> {
    let entries = shared.index.read().stream_entries(&stream_id(pod))?;
    Some(
        entries
            .into_iter()
            .map(|e| (e.adapter, e.block_size, e.content_key, e.tier))
            .collect(),
    )
}

/// A subscriber "process": its own runtime, started from the sidecar's command line.
struct SubscriberProc {
    rt: Option<tokio::runtime::Runtime>,
    sub: Option<Subscriber>,
}

impl SubscriberProc {
    fn last_seq(&self) -> Option<u64> {
        let sub = self.sub.as_ref()?;
        sub.state.hub.status().first().and_then(|s| s.last_seq)
    }
}

impl Drop for SubscriberProc {
    fn drop(&mut self) {
        drop(self.sub.take());
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// `args` as the Pod webhook renders them (after the kubelet expands `$(POD_…)`), pointed at the
/// test's sockets.
fn start_subscriber(args: Vec<String>) -> SubscriberProc {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let mut cfg = subscribe::parse_args(args).unwrap().config().unwrap();
        cfg.backoff_initial = Duration::from_millis(100);
        cfg.backoff_max = Duration::from_millis(300);
        let sub = rt.block_on(subscribe::start(cfg)).unwrap();
        SubscriberProc {
            rt: Some(rt),
            sub: Some(sub),
        }
    })
    .join()
    .unwrap()
}

fn sidecar_args(
    pod: &str,
    pub_port: u16,
    replay_port: u16,
    grpc: SocketAddr,
    offload: bool,
) -> Vec<String> {
    let mut args = vec![
        "subscribe".to_string(),
        format!("--endpoint=tcp://127.0.0.1:{pub_port}"),
        "--hash-scheme=vllm".to_string(),
        "--block-size=16".to_string(),
        "--model-id=meta-llama/Llama-3.2-1B-Instruct".to_string(),
        format!("--tenant={NAMESPACE}"),
        format!("--replica-id={pod}"),
    ];
    if offload {
        args.push("--ignore-block-removed=true".to_string());
    }
    // The webhook's `--controller=HOST:PORT` form.
    args.push(format!("--controller={grpc}"));
    args.push(format!("--replay=tcp://127.0.0.1:{replay_port}"));
    args.push(format!("--node={NODE}"));
    // Standalone: no token file, so no token.
    args.push("--token-file=/nonexistent/inference-cache/token".to_string());
    args
}

fn start_publisher(pub_port: u16, replay_port: u16) -> (tokio::task::JoinHandle<()>, Instant) {
    let fx = Fixture::load(&kv_fixture(FIXTURE)).unwrap();
    let skip: Vec<u64> = fx
        .frames("dp0")
        .iter()
        .map(|f| f.seq)
        .filter(|s| *s > FINAL_SEQ)
        .collect();
    let live = FINAL_SEQ as u32 + 1;
    let opts = PublishOptions {
        connect_wait: CONNECT_WAIT,
        interval: INTERVAL,
        linger: Duration::from_secs(60),
        skip_seqs: skip.into_iter().collect(),
        ..Default::default()
    };
    let last = Instant::now() + CONNECT_WAIT + INTERVAL * (live - 1);
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

/// After the last frame (and both subscribers having applied it), the index must equal the
/// truths within [`CONVERGE`].
async fn assert_converges(
    shared: &Shared,
    subs: &[&SubscriberProc],
    truths: &[(&str, &BTreeSet<Entry>)],
    last_frame: Instant,
) -> Duration {
    tokio::time::sleep_until(tokio::time::Instant::from_std(last_frame)).await;
    wait_until(
        "the subscribers to apply the last frame",
        Duration::from_secs(20),
        || subs.iter().all(|s| s.last_seq() == Some(FINAL_SEQ)),
    )
    .await;
    let start = Instant::now();
    loop {
        let got: Vec<Option<BTreeSet<Entry>>> = truths
            .iter()
            .map(|(pod, _)| index_entries(shared, pod))
            .collect();
        if got
            .iter()
            .zip(truths)
            .all(|(g, (_, t))| g.as_ref() == Some(*t))
        {
            return start.elapsed();
        }
        if start.elapsed() > CONVERGE {
            panic!("index did not converge within {CONVERGE:?} of the last frame:\n  index: {got:?}\n  truth: {truths:?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn subscribers_stream_one_engine_each_with_tier_aware_evictions_and_survive_a_controller_restart(
) {
    let offload_truth = ground_truth(true);
    let events_only_truth = ground_truth(false);
    // The recording's BlockRemoved (A3) is what tells the modes apart.
    let t2: Vec<&Entry> = offload_truth.iter().filter(|e| e.3 == Tier::T2).collect();
    assert!(!t2.is_empty(), "Offload keeps the evicted block at T2");
    assert!(events_only_truth.iter().all(|e| e.3 == Tier::T1));
    assert!(events_only_truth.len() < offload_truth.len());
    assert!(events_only_truth.len() >= 4, "{events_only_truth:?}");

    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;
    let (pub_port, replay_port) = (free_port(), free_port());
    let offload = start_subscriber(sidecar_args(OFFLOAD_POD, pub_port, replay_port, grpc, true));
    let events_only = start_subscriber(sidecar_args(
        EVENTS_ONLY_POD,
        pub_port,
        replay_port,
        grpc,
        false,
    ));
    let (publisher, last_frame) = start_publisher(pub_port, replay_port);

    // Kill the controller mid-stream, once both replicas are in its index.
    wait_until(
        "both replicas in the index with seq 3 applied",
        Duration::from_secs(20),
        || {
            offload.last_seq().is_some_and(|s| s >= 3)
                && events_only.last_seq().is_some_and(|s| s >= 3)
                && index_entries(&controller.shared, OFFLOAD_POD).is_some_and(|e| !e.is_empty())
                && index_entries(&controller.shared, EVENTS_ONLY_POD).is_some_and(|e| !e.is_empty())
        },
    )
    .await;
    {
        // Filed apart from the node's agent, under the pod; the replica id is the pod.
        let snap = controller.shared.index.read().snapshot();
        for pod in [OFFLOAD_POD, EVENTS_ONLY_POD] {
            let r = snap
                .replicas
                .iter()
                .find(|r| r.stream_id == stream_id(pod))
                .unwrap();
            assert_eq!(r.replica, pod);
            assert_eq!(r.tenant, NAMESPACE);
            assert_eq!(r.hash_scheme, "vllm");
            assert_eq!(r.model, "meta-llama/Llama-3.2-1B-Instruct");
            assert_eq!(r.node, format!("{NODE}/{NAMESPACE}/{pod}"));
        }
        let reg = controller.shared.nodes.lock();
        assert_eq!(reg.connected_subscribers(), 2);
        assert_eq!(reg.connected_count(), 0, "no node agent record");
    }
    controller.stop().await;
    let controller = start_controller(grpc).await;
    assert!(index_entries(&controller.shared, OFFLOAD_POD).is_none());

    let took = assert_converges(
        &controller.shared,
        &[&offload, &events_only],
        &[
            (OFFLOAD_POD, &offload_truth),
            (EVENTS_ONLY_POD, &events_only_truth),
        ],
        last_frame,
    )
    .await;
    eprintln!("controller restarted mid-stream; converged {took:?} after the last frame");

    // The router sees the Offload replica's evicted block at T2 and the events-only one not at all.
    let by_tier = |pod: &str, tier: Tier| {
        controller
            .shared
            .index
            .read()
            .stream_entries(&stream_id(pod))
            .unwrap()
            .iter()
            .filter(|e| e.tier == tier)
            .count()
    };
    assert_eq!(by_tier(OFFLOAD_POD, Tier::T2), t2.len());
    assert_eq!(by_tier(EVENTS_ONLY_POD, Tier::T2), 0);

    publisher.abort();
    drop(offload);
    drop(events_only);
    controller.stop().await;
}
