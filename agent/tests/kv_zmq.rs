//! End to end over real ZeroMQ sockets on loopback: the fixture publisher (`publish_fixture`,
//! golden frames captured from the genuine engines) → `KvHub` (planned with `apply_plan`) →
//! deltas and snapshots carrying our content keys (= `chain` over the recorded token ids).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ic_agent::kv::{publish_fixture, Fixture, KvHub, PublishOptions, StreamStatus};
use ic_shared::kv::content_key::chain;
use ic_shared::kv::decode::{decode_batch, KvEvent};
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
use ic_shared::proto::{kv_op, StreamDelta, StreamSnapshot, Tier};

/// A golden recording of `testdata/kv-events`.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/kv-events")
        .join(name)
}

/// A free loopback TCP port (bound and released; loopback only).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn plan(scheme: HashScheme, pub_port: u16, replay_port: Option<u16>) -> NodePlan {
    NodePlan {
        engines: vec![EnginePlan {
            namespace: "team-a".into(),
            pod: "engine-0".into(),
            model: "model-x".into(),
            hash_scheme: scheme,
            block_size: 16,
            kv_events: vec![KvEventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                replay_endpoint: replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
                // The fixtures publish on topic "kv@pod-a@model-x": a prefix filter.
                topic: "kv@pod-a".into(),
                dp_rank: 0,
            }],
            ..EnginePlan::default()
        }],
        ..NodePlan::default()
    }
}

/// The recorded token ids of request A (seq 0 + seq 1) and request B (block 0 of A + seq 2), as
/// the fixture's dp0 frames carry them.
fn recorded_requests(name: &str) -> (Vec<u32>, Vec<u32>) {
    let fx = Fixture::load(&fixture(name)).unwrap();
    let tokens = |seq: u64| -> Vec<u32> {
        let f = fx.frames("dp0").into_iter().find(|f| f.seq == seq).unwrap();
        match &decode_batch(&f.payload).unwrap().events[0] {
            KvEvent::BlockStored(s) => s.token_ids.clone(),
            other => panic!("seq {seq}: {other:?}"),
        }
    };
    let a = [tokens(0), tokens(1)].concat();
    let b = [a[..16].to_vec(), tokens(2)].concat();
    (a, b)
}

struct Outcome {
    /// The SUB was connected while the publisher ran.
    connected: bool,
    deltas: Vec<StreamDelta>,
    snapshot: Vec<StreamSnapshot>,
    status: StreamStatus,
}

/// Plans one stream, publishes a fixture's dp0 frames, and collects deltas until the stream has
/// applied `last_seq` `passes` times (counted through `batches_decoded`).
async fn run(
    name: &str,
    scheme: HashScheme,
    with_replay: bool,
    opts: PublishOptions,
    decoded_target: u64,
) -> Outcome {
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    let (pub_port, replay_port) = (free_port(), free_port());
    hub.apply_plan(&plan(scheme, pub_port, with_replay.then_some(replay_port)));

    let path = fixture(name);
    let endpoint = format!("tcp://127.0.0.1:{pub_port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let publisher = tokio::spawn(async move {
        publish_fixture(
            &path,
            &endpoint,
            with_replay.then_some(replay.as_str()),
            &opts,
        )
        .await
    });

    let mut deltas = Vec::new();
    let mut connected = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(200), hub.changed()).await;
        deltas.extend(hub.take_deltas());
        let st = hub.status().remove(0);
        connected |= st.connected;
        if st.batches_decoded >= decoded_target {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {st:#?}");
    }
    // Let any trailing message land, then drain.
    tokio::time::sleep(Duration::from_millis(300)).await;
    deltas.extend(hub.take_deltas());
    let report = publisher.await.unwrap().unwrap();
    assert!(report.published > 0);
    let (rest, snapshot) = hub.take_deltas_and_snapshot();
    deltas.extend(rest);
    let status = hub.status().remove(0);
    // Metrics were registered and moved.
    let families = reg.gather();
    assert!(families
        .iter()
        .any(|f| f.name() == "inferencecache_agent_kv_batches_decoded_total"));
    Outcome {
        connected,
        deltas,
        snapshot,
        status,
    }
}

/// Replays the ops of a stream's deltas onto an index keyed by (adapter, content key) → tier.
fn fold(deltas: &[StreamDelta]) -> (BTreeMap<(String, u64), i32>, Vec<String>) {
    let mut index = BTreeMap::new();
    let mut clears = Vec::new();
    for (i, d) in deltas.iter().enumerate() {
        assert_eq!(d.seq, i as u64 + 1, "delta seqs are contiguous from 1");
        let desc = d.stream.as_ref().unwrap();
        assert_eq!(desc.stream_id, "team-a/engine-0#0");
        assert_eq!(desc.replica, "engine-0");
        assert_eq!(desc.tenant, "team-a");
        assert_eq!(desc.model, "model-x");
        for op in &d.ops {
            match op.op.as_ref().unwrap() {
                kv_op::Op::Store(s) => {
                    assert_eq!(s.block_size, 16);
                    for k in &s.content_keys {
                        index.insert((s.adapter.clone(), *k), s.tier);
                    }
                }
                kv_op::Op::Remove(r) => {
                    for k in &r.content_keys {
                        index.remove(&(r.adapter.clone(), *k));
                    }
                }
                kv_op::Op::Clear(c) => {
                    index.clear();
                    clears.push(c.reason.clone());
                }
            }
        }
    }
    (index, clears)
}

fn snapshot_index(s: &[StreamSnapshot]) -> BTreeMap<(String, u64), i32> {
    assert_eq!(s.len(), 1);
    s[0].entries
        .iter()
        .map(|e| ((e.adapter.clone(), e.content_key), e.tier))
        .collect()
}

const T1: i32 = Tier::T1 as i32;

fn skip(seqs: &[u64]) -> BTreeSet<u64> {
    seqs.iter().copied().collect()
}

fn fast(skip_seqs: BTreeSet<u64>, repeat: u32) -> PublishOptions {
    PublishOptions {
        interval: Duration::from_millis(20),
        connect_wait: Duration::from_millis(1000),
        linger: Duration::from_millis(200),
        skip_seqs,
        repeat,
        ..PublishOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_map_frames_become_content_keys() {
    // vLLM 0.26 (map events, topic in replay replies). The recording ends before seq 9
    // (AllBlocksCleared) so the final state is observable: A0..A2 and B1 on GPU (A3 was
    // removed), C0,C1 under the LoRA; the hybrid groups 1 and 2 (seq 6..8) are not indexed.
    let (a, b) = recorded_requests("vllm-0.26.0.json");
    let out = run(
        "vllm-0.26.0.json",
        HashScheme::Vllm,
        true,
        PublishOptions {
            until_seq: Some(8),
            ..fast(skip(&[]), 1)
        },
        9,
    )
    .await;
    let ka = chain(&a, 16);
    let kb = chain(&b, 16);
    let mut expected = BTreeMap::new();
    for k in [ka[0], ka[1], ka[2], kb[1]] {
        expected.insert((String::new(), k), T1);
    }
    for k in chain(&a[..32], 16) {
        expected.insert(("sql-lora".to_string(), k), T1);
    }
    let (from_deltas, clears) = fold(&out.deltas);
    assert!(clears.is_empty(), "{clears:?}");
    assert_eq!(from_deltas, expected);
    assert_eq!(snapshot_index(&out.snapshot), expected);
    assert_eq!(out.snapshot[0].seq, out.deltas.len() as u64);
    assert!(!out.snapshot[0].stale);
    assert_eq!(out.status.last_seq, Some(8));
    assert_eq!(out.status.gaps, 0);
    assert!(out.connected);
    assert_eq!(out.status.observed_block_size, 16);
    assert_eq!(out.status.blocks_held, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_array_frames_with_i64_hashes_become_content_keys() {
    // SGLang 0.5.18 (array events, signed hashes). Seq 6 (clear) withheld. B is removed at seq
    // 3; the salted request at seq 5 shares A0's content key; its partial page is not indexed.
    let (a, _) = recorded_requests("sglang-0.5.18.json");
    let out = run(
        "sglang-0.5.18.json",
        HashScheme::Sglang,
        false,
        fast(skip(&[6]), 1),
        6,
    )
    .await;
    let expected: BTreeMap<_, _> = chain(&a, 16)
        .into_iter()
        .map(|k| ((String::new(), k), T1))
        .collect();
    let (from_deltas, clears) = fold(&out.deltas);
    assert!(clears.is_empty(), "{clears:?}");
    assert_eq!(from_deltas, expected);
    assert_eq!(snapshot_index(&out.snapshot), expected);
    assert_eq!(out.status.last_seq, Some(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_healed_from_the_replay_router() {
    // vLLM 0.14: seq 2 (request B's divergent block) is never sent live; the subscriber sees 3
    // after 1, asks the replay ROUTER from 2 and applies it before 3. The recording ends
    // before its AllBlocksCleared (seq 6).
    let (a, b) = recorded_requests("vllm-0.14.0.json");
    let out = run(
        "vllm-0.14.0.json",
        HashScheme::Vllm,
        true,
        PublishOptions {
            until_seq: Some(5),
            ..fast(skip(&[2]), 1)
        },
        6,
    )
    .await;
    let (from_deltas, clears) = fold(&out.deltas);
    assert!(clears.is_empty(), "healed gaps do not clear: {clears:?}");
    let kb = chain(&b, 16);
    assert_eq!(from_deltas.get(&(String::new(), kb[1])), Some(&T1));
    let ka = chain(&a, 16);
    assert_eq!(from_deltas.get(&(String::new(), ka[3])), None, "A3 removed");
    assert_eq!(snapshot_index(&out.snapshot), from_deltas);
    assert_eq!(out.status.gaps, 1);
    assert!(out.status.replays >= 1);
    assert_eq!(out.status.replays_failed, 0);
    assert!(!out.status.stale);
    assert_eq!(out.status.last_seq, Some(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_without_replay_clears_the_replica() {
    let out = run(
        "vllm-0.14.0.json",
        HashScheme::Vllm,
        false,
        fast(skip(&[2, 6]), 1),
        5,
    )
    .await;
    let (_, clears) = fold(&out.deltas);
    assert_eq!(clears, vec!["SequenceGap".to_string()]);
    assert_eq!(out.status.gaps, 1);
    assert_eq!(out.status.resyncs, 1);
    // Fresh batches after the gap (4, 5) ended the stale period.
    assert!(!out.status.stale);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_restart_at_zero_clears_the_replica() {
    // Two passes over vLLM 0.24's frames: the second starts again at seq 0, as a restarted
    // engine does; the replica is cleared and rebuilt to the same state.
    let (a, b) = recorded_requests("vllm-0.24.0.json");
    let out = run(
        "vllm-0.24.0.json",
        HashScheme::Vllm,
        false,
        fast(skip(&[9]), 2),
        18,
    )
    .await;
    let (from_deltas, clears) = fold(&out.deltas);
    assert_eq!(clears, vec!["EngineRestarted".to_string()]);
    let ka = chain(&a, 16);
    let kb = chain(&b, 16);
    for k in [ka[0], ka[1], ka[2], kb[1]] {
        assert_eq!(from_deltas.get(&(String::new(), k)), Some(&T1));
    }
    assert_eq!(snapshot_index(&out.snapshot), from_deltas);
    assert_eq!(out.status.resyncs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_learns_earlier_blocks_by_bootstrap_replay() {
    // The publisher runs before the agent follows it (an agent restart): the first live message
    // the subscriber sees has seq > 0, so it replays from 0 and ends with the full state.
    let (a, b) = recorded_requests("vllm-0.26.0.json");
    let (hub, publisher) = follow_a_running_publisher(|_| {}).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while hub.status()[0].last_seq != Some(8) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:#?}",
            hub.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = hub.status().remove(0);
    assert!(status.replays >= 1, "{status:#?}");
    assert!(status.batches_replayed >= 1, "{status:#?}");
    let ka = chain(&a, 16);
    let kb = chain(&b, 16);
    let snap = snapshot_index(&hub.take_deltas_and_snapshot().1);
    for k in [ka[0], ka[1], ka[2], kb[1]] {
        assert_eq!(snap.get(&(String::new(), k)), Some(&T1));
    }
    assert_eq!(snap.len(), 6);
    publisher.await.unwrap().unwrap();
}

/// A vLLM 0.26 publisher (the recording's seqs 0..=8, 100 ms apart, with its replay socket)
/// already running, and 350 ms later a hub that follows it with the plan `adjust` makes of
/// [`plan`]'s: the first live message it sees has seq > 0, so it replays from 0.
async fn follow_a_running_publisher(
    adjust: impl FnOnce(&mut NodePlan),
) -> (
    KvHub,
    tokio::task::JoinHandle<Result<ic_agent::kv::PublishReport, ic_agent::kv::PublishError>>,
) {
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    let (pub_port, replay_port) = (free_port(), free_port());
    let path = fixture("vllm-0.26.0.json");
    let endpoint = format!("tcp://127.0.0.1:{pub_port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let opts = PublishOptions {
        interval: Duration::from_millis(100),
        connect_wait: Duration::ZERO,
        linger: Duration::from_secs(2),
        until_seq: Some(8),
        ..PublishOptions::default()
    };
    let publisher =
        tokio::spawn(async move { publish_fixture(&path, &endpoint, Some(&replay), &opts).await });
    tokio::time::sleep(Duration::from_millis(350)).await;
    let mut p = plan(HashScheme::Vllm, pub_port, Some(replay_port));
    adjust(&mut p);
    hub.apply_plan(&p);
    (hub, publisher)
}

/// The plan subscribes to another topic than the engine publishes on: no live message passes
/// the SUB filter. The bootstrap replay (which carries the engine's topic) shows it, and the
/// stream reads Partial / TopicMismatch with nothing indexed — not Exact with what the engine
/// held at attach time, frozen while the engine moves on.
#[tokio::test]
async fn a_topic_the_engine_does_not_publish_is_partial_with_nothing_indexed() {
    // The engine publishes on "kv@pod-a@model-x".
    let (hub, publisher) =
        follow_a_running_publisher(|p| p.engines[0].kv_events[0].topic = "kv@pod-b".into()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while hub.status()[0].coverage_reason != Some("TopicMismatch") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:#?}",
            hub.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publisher.await.unwrap().unwrap();
    let status = hub.status().remove(0);
    assert_eq!(status.coverage, "Partial", "{status:#?}");
    assert!(
        status
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("kv@pod-a@model-x")),
        "{status:#?}"
    );
    assert!(snapshot_index(&hub.take_deltas_and_snapshot().1).is_empty());
}

/// An engine whose PUB connects to `tcp://127.0.0.1:<port>` and publishes seqs 0..=8 once.
fn connecting_publisher(
    port: u16,
) -> tokio::task::JoinHandle<Result<ic_agent::kv::PublishReport, ic_agent::kv::PublishError>> {
    let path = fixture("vllm-0.26.0.json");
    let endpoint = format!(">tcp://127.0.0.1:{port}");
    tokio::spawn(async move {
        publish_fixture(
            &path,
            &endpoint,
            None,
            &PublishOptions {
                until_seq: Some(8),
                connect_wait: Duration::from_millis(800),
                ..fast(skip(&[]), 1)
            },
        )
        .await
    })
}

/// vLLM connects its PUB to any non-wildcard endpoint (llm-d's pattern, or a loopback endpoint
/// the pod's own kvevent-subscriber serves): a stream planned as `@tcp://…` binds its SUB there
/// and receives a publisher that connects (`>tcp://…`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_binds_receives_a_publisher_that_connects() {
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    let port = free_port();
    let mut p = plan(HashScheme::Vllm, port, None);
    p.engines[0].kv_events[0].endpoint = format!("@tcp://127.0.0.1:{port}");
    hub.apply_plan(&p);
    // The hub binds before the engine starts connecting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let publisher = connecting_publisher(port);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut connected = false;
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(200), hub.changed()).await;
        let st = hub.status().remove(0);
        connected |= st.connected;
        if st.batches_decoded >= 9 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {st:#?}");
    }
    assert!(connected);
    assert!(publisher.await.unwrap().unwrap().published > 0);
    let st = hub.status().remove(0);
    assert_eq!(st.last_seq, Some(8));
    assert_eq!(st.gaps, 0);

    // The engine restarts: its PUB goes away and a new one connects. The bound SUB is reported
    // disconnected, binds afresh and follows the new incarnation (seq from 0 again).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while hub.status().remove(0).connected {
        let _ = tokio::time::timeout(Duration::from_millis(200), hub.changed()).await;
        assert!(tokio::time::Instant::now() < deadline, "still connected");
    }
    let restarted = connecting_publisher(port);
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(200), hub.changed()).await;
        let st = hub.status().remove(0);
        if st.batches_decoded >= 18 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {st:#?}");
    }
    assert!(restarted.await.unwrap().unwrap().published > 0);
    assert_eq!(hub.status().remove(0).last_seq, Some(8));
}

/// A stream planned before its engine is up reports the connect error; once the publisher is up
/// and the SUB connected, the old error is gone from its status (`/v1/report` `lastError`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_error_is_cleared_once_the_stream_connects() {
    let reg = prometheus::Registry::new();
    let hub = KvHub::new(&reg).unwrap();
    let pub_port = free_port();
    hub.apply_plan(&plan(HashScheme::Vllm, pub_port, None));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let st = hub.status().remove(0);
        if st
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("connect"))
        {
            assert!(!st.connected);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no connect error: {st:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let path = fixture("vllm-0.24.0.json");
    let endpoint = format!("tcp://127.0.0.1:{pub_port}");
    let publisher = tokio::spawn(async move {
        let opts = PublishOptions {
            linger: Duration::from_secs(10),
            ..PublishOptions::default()
        };
        publish_fixture(&path, &endpoint, None, &opts).await
    });
    loop {
        let st = hub.status().remove(0);
        if st.connected {
            assert_eq!(st.last_error, None, "{st:#?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never connected: {st:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publisher.abort();
}
