//! Subscriber streams over a real loopback gRPC connection.

use super::*;
use crate::state::LookupPolicy;
use ic_shared::proto::{
    agent_service_client::AgentServiceClient, controller_message, AgentMessage, BlockEntry,
    PodSubscriber, Resync, StreamDescriptor, StreamSnapshot,
};
use tokio_stream::wrappers::TcpListenerStream;

async fn serve(auth: Option<Arc<auth::AgentAuthenticator>>) -> (String, Arc<Shared>) {
    serve_state(Shared::new(LookupPolicy::default()).unwrap(), auth).await
}

async fn serve_state(
    shared: Shared,
    auth: Option<Arc<auth::AgentAuthenticator>>,
) -> (String, Arc<Shared>) {
    let shared = Arc::new(shared);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = match auth {
        Some(a) => AgentIngest::with_auth(shared.clone(), a),
        None => AgentIngest::new(shared.clone()),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc.into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), shared)
}

fn hello(node: &str, pod: Option<(&str, &str)>, token: &str) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Hello(proto::Hello {
            node: node.into(),
            version: "0.1.0".into(),
            token: token.into(),
            pod_subscriber: pod.map(|(ns, p)| PodSubscriber {
                namespace: ns.into(),
                pod: p.into(),
            }),
            ..Default::default()
        })),
    }
}

fn resync(streams: &[(&str, &str, &str)]) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Resync(Resync {
            streams: streams
                .iter()
                .map(|(tenant, pod, key)| StreamSnapshot {
                    stream: Some(StreamDescriptor {
                        stream_id: format!("{tenant}/{pod}#0"),
                        replica: pod.to_string(),
                        tenant: tenant.to_string(),
                        model: "m".into(),
                        hash_scheme: "vllm".into(),
                        ..Default::default()
                    }),
                    seq: 0,
                    entries: vec![BlockEntry {
                        adapter: String::new(),
                        block_size: 16,
                        content_key: u64::from_str_radix(key, 16).unwrap(),
                        tier: proto::Tier::T1 as i32,
                    }],
                    ..Default::default()
                })
                .collect(),
        })),
    }
}

/// Opens a stream with `first` queued; returns the inbound half (or the refusal) and the
/// sender.
async fn open(
    url: &str,
    first: AgentMessage,
) -> (
    Result<Streaming<ControllerMessage>, Status>,
    mpsc::Sender<AgentMessage>,
) {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = AgentServiceClient::new(channel);
    let (tx, rx) = mpsc::channel(8);
    tx.send(first).await.unwrap();
    let resp = client
        .connect(ReceiverStream::new(rx))
        .await
        .map(|r| r.into_inner());
    (resp, tx)
}

/// Reads `inbound` to its end: the status the controller closed the stream with.
async fn final_status(inbound: &mut Streaming<ControllerMessage>) -> Status {
    loop {
        match inbound.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream must end with a status"),
            Err(st) => return st,
        }
    }
}

/// Polls `f` for up to 30 s (a correctness wait, not a timing assertion: a debug build on a
/// busy 2-core machine needs seconds for a million-block resync).
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..3000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

fn big_snapshot(stream: &str, n: u64) -> StreamSnapshot {
    StreamSnapshot {
        stream: Some(StreamDescriptor {
            stream_id: stream.into(),
            replica: "vllm-0".into(),
            tenant: "ns".into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        }),
        seq: 4,
        entries: (0..n)
            .map(|k| BlockEntry {
                adapter: String::new(),
                block_size: 16,
                content_key: k.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                tier: proto::Tier::T1 as i32,
            })
            .collect(),
        coverage: proto::Coverage::Exact as i32,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_a_million_blocks_registers_through_chunks() {
    let (url, shared) = serve(None).await;
    let snap = big_snapshot("ns/vllm-0#0", 1_000_000);
    // In one message it is past the inbound limit: refused, nothing applied.
    let (inbound, tx) = open(&url, hello("n-one", None, "")).await;
    let mut inbound = inbound.unwrap();
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(Resync {
            streams: vec![snap.clone()],
        })),
    })
    .await
    .unwrap();
    let st = final_status(&mut inbound).await;
    assert_ne!(st.code(), tonic::Code::Ok, "{st:?}");
    assert!(shared.index.read().stream_entries("ns/vllm-0#0").is_none());
    // In the agent's chunks it arrives whole, and deltas continue from its seq.
    let (inbound, tx) = open(&url, hello("n-big", None, "")).await;
    let mut inbound = inbound.unwrap();
    let msgs = ic_shared::resync::chunk_resync(vec![snap]);
    assert!(msgs.len() > 4);
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    // Applied in slices: once the last one is in, every entry is there and the stream
    // reads Exact (Partial / ResyncApplying midway: index::tests).
    until("a million entries, Exact", || {
        let ix = shared.index.read();
        ix.entry_count() == 1_000_000 && ix.coverage_counts()[0].1 == 1
    })
    .await;
    assert_eq!(
        shared
            .index
            .read()
            .stream_entries("ns/vllm-0#0")
            .map(|e| e.len()),
        Some(1_000_000)
    );
    tx.send(AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: 1,
            deltas: vec![proto::StreamDelta {
                stream: big_snapshot("ns/vllm-0#0", 0).stream,
                seq: 5,
                ops: vec![proto::KvOp {
                    op: Some(proto::kv_op::Op::Clear(proto::ClearOp {
                        reason: "AllBlocksCleared".into(),
                    })),
                }],
                coverage: proto::Coverage::Exact as i32,
                ..Default::default()
            }],
        })),
    })
    .await
    .unwrap();
    loop {
        match inbound.message().await.unwrap().unwrap().msg {
            Some(controller_message::Msg::Ack(a)) => {
                assert_eq!(a.batch_id, 1);
                break;
            }
            Some(controller_message::Msg::ResyncRequest(r)) => panic!("{r:?}"),
            _ => {}
        }
    }
    assert_eq!(
        shared
            .index
            .read()
            .stream_entries("ns/vllm-0#0")
            .map(|e| e.len()),
        Some(0)
    );
}

/// One resync turn, progress every 50 ms, a stalled holder cut off after `gap`.
async fn serve_one_turn(gap: Duration) -> (String, Arc<Shared>) {
    let shared = Shared::new(LookupPolicy::default())
        .unwrap()
        .with_resync_turns(turns::ResyncTurns::new(1).with_timing(Duration::from_millis(50), gap));
    serve_state(shared, None).await
}

fn pending(shared: &Shared, state: &str) -> i64 {
    shared
        .metrics
        .resyncs_pending
        .with_label_values(&[state])
        .get()
}

/// The next `ResyncProgress` on `inbound` (other messages skipped), within 10 s.
async fn next_progress(inbound: &mut Streaming<ControllerMessage>) -> proto::ResyncProgress {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(controller_message::Msg::ResyncProgress(p)) =
                inbound.message().await.unwrap().unwrap().msg
            {
                return p;
            }
        }
    })
    .await
    .expect("a ResyncProgress within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resyncs_take_turns_and_a_waiting_agent_hears_progress() {
    let (url, shared) = serve_one_turn(Duration::from_secs(20)).await;
    // Agent A takes the only turn and sends the first of its resync's chunks.
    let chunks = ic_shared::resync::chunk_resync(vec![big_snapshot("ns/vllm-0#0", 300_000)]);
    assert!(chunks.len() >= 2, "the resync is chunked");
    let (a_in, a_tx) = open(&url, hello("n-a", None, "")).await;
    let mut a_in = a_in.unwrap();
    a_tx.send(chunks[0].clone()).await.unwrap();
    until("A holds the turn", || pending(&shared, "applying") == 1).await;
    // Agent B's resync waits: B hears that it waits, and nothing of it is applied.
    let (b_in, b_tx) = open(&url, hello("n-b", None, "")).await;
    let mut b_in = b_in.unwrap();
    b_tx.send(resync(&[("ns", "b", "a1")])).await.unwrap();
    let p = next_progress(&mut b_in).await;
    assert!(!p.applying, "{p:?}");
    assert_eq!(pending(&shared, "waiting"), 1);
    assert!(shared.index.read().stream_entries("ns/b#0").is_none());
    // A finishes; then B's turn comes, in that order.
    for c in &chunks[1..] {
        a_tx.send(c.clone()).await.unwrap();
    }
    until("both resyncs applied", || {
        let ix = shared.index.read();
        ix.stream_entries("ns/b#0").is_some()
            && ix.stream_entries("ns/vllm-0#0").map(|e| e.len()) == Some(300_000)
    })
    .await;
    until("no resync pending", || {
        pending(&shared, "waiting") == 0 && pending(&shared, "applying") == 0
    })
    .await;
    // A was never told to wait: it held the turn from its Hello on.
    drop(a_tx);
    while let Ok(Some(m)) = a_in.message().await {
        assert!(
            !matches!(m.msg, Some(controller_message::Msg::ResyncProgress(ref p)) if !p.applying),
            "{m:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_turn_holder_is_cut_off_and_the_next_resync_proceeds() {
    let (url, shared) = serve_one_turn(Duration::from_millis(300)).await;
    let chunks = ic_shared::resync::chunk_resync(vec![big_snapshot("ns/vllm-0#0", 300_000)]);
    let (a_in, a_tx) = open(&url, hello("n-a", None, "")).await;
    let mut a_in = a_in.unwrap();
    a_tx.send(chunks[0].clone()).await.unwrap();
    until("A holds the turn", || pending(&shared, "applying") == 1).await;
    let (b_in, b_tx) = open(&url, hello("n-b", None, "")).await;
    let _b_in = b_in.unwrap();
    b_tx.send(resync(&[("ns", "b", "a1")])).await.unwrap();
    // A sends nothing more: cut off with DEADLINE_EXCEEDED, its half resync not applied.
    let st = tokio::time::timeout(Duration::from_secs(10), final_status(&mut a_in))
        .await
        .unwrap();
    assert_eq!(st.code(), tonic::Code::DeadlineExceeded, "{st:?}");
    assert!(st.message().contains("resync turn"), "{st:?}");
    until("B applied", || {
        shared.index.read().stream_entries("ns/b#0").is_some()
    })
    .await;
    assert!(shared.index.read().stream_entries("ns/vllm-0#0").is_none());
    drop(a_tx);
}

#[tokio::test]
async fn a_superseded_stream_is_ended_at_once() {
    let (url, shared) = serve(None).await;
    let (first, tx1) = open(&url, hello("n1", None, "")).await;
    let mut first = first.unwrap();
    tx1.send(resync(&[("ns", "pod-a", "a1")])).await.unwrap();
    until("the first resync", || {
        shared.index.read().stream_entries("ns/pod-a#0").is_some()
    })
    .await;
    // A second stream claims the node: the first ends with Aborted, without sending
    // anything more (so a live agent reconnects instead of waiting for acks).
    let (second, tx2) = open(&url, hello("n1", None, "")).await;
    let mut second = second.unwrap();
    // What the first stream reported is no longer vouched for: nothing applies its
    // events any more, and the second has not resynced.
    until("the takeover's coverage", || {
        coverage(&shared, "ns/pod-a#0") == Some(("Unknown", Some("AgentDisconnected")))
    })
    .await;
    let st = tokio::time::timeout(Duration::from_secs(2), final_status(&mut first))
        .await
        .expect("the superseded stream ends promptly");
    assert_eq!(st.code(), tonic::Code::Aborted, "{st:?}");
    // The first agent reconnects and takes over; the second (leaving) is ended too.
    let (third, tx3) = open(&url, hello("n1", None, "")).await;
    let mut third = third.unwrap();
    let st = tokio::time::timeout(Duration::from_secs(2), final_status(&mut second))
        .await
        .expect("the second stream ends");
    assert_eq!(st.code(), tonic::Code::Aborted);
    drop(tx2);
    drop(tx1);
    tx3.send(resync(&[("ns", "pod-a", "a2")])).await.unwrap();
    tx3.send(AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: 7,
            deltas: vec![],
        })),
    })
    .await
    .unwrap();
    loop {
        if let Some(controller_message::Msg::Ack(a)) = third.message().await.unwrap().unwrap().msg {
            assert_eq!(a.batch_id, 7);
            break;
        }
    }
    assert!(shared.nodes.lock().connected_count() == 1);
}

/// [`resync`] with every stream reported Exact.
fn exact_resync(streams: &[(&str, &str, &str)]) -> proto::Resync {
    let Some(Msg::Resync(mut r)) = resync(streams).msg else {
        unreachable!("resync builds a Resync")
    };
    for s in &mut r.streams {
        s.coverage = proto::Coverage::Exact as i32;
    }
    r
}

/// `(coverage, reason)` of `stream` in the index's snapshot.
fn coverage(shared: &Shared, stream: &str) -> Option<(&'static str, Option<&'static str>)> {
    shared
        .index
        .read()
        .snapshot()
        .replicas
        .iter()
        .find(|r| r.stream_id == stream)
        .map(|r| (r.coverage, r.coverage_reason))
}

#[tokio::test]
async fn a_refused_delta_leaves_the_node_resync_requested_and_counts_the_rest_of_its_batch() {
    let (url, shared) = serve(None).await;
    let (inbound, tx) = open(&url, hello("n1", None, "")).await;
    let mut inbound = inbound.unwrap();
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(exact_resync(&[
            ("ns", "pod-a", "a1"),
            ("ns", "pod-b", "b1"),
        ]))),
    })
    .await
    .unwrap();
    until("the resync", || {
        coverage(&shared, "ns/pod-b#0") == Some(("Exact", None))
    })
    .await;
    // seq 2 after 0 is a gap; the two deltas after it wait for the resync.
    tx.send(AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: 1,
            deltas: vec![
                delta("ns", "pod-a", 2, 0xa2),
                delta("ns", "pod-a", 1, 0xa3),
                delta("ns", "pod-b", 1, 0xb2),
            ],
        })),
    })
    .await
    .unwrap();
    loop {
        if let Some(controller_message::Msg::ResyncRequest(_)) =
            inbound.message().await.unwrap().unwrap().msg
        {
            break;
        }
    }
    let refused = |r: &str| {
        shared
            .metrics
            .kv_deltas_refused_total
            .with_label_values(&[r])
            .get()
    };
    assert_eq!(
        (refused("sequence_gap"), refused("awaiting_resync")),
        (1, 2)
    );
    for s in ["ns/pod-a#0", "ns/pod-b#0"] {
        assert_eq!(
            coverage(&shared, s),
            Some(("Unknown", Some("ResyncRequested"))),
            "{s}"
        );
    }
    // A gateway asking meanwhile is told the index does not vouch for both replicas.
    let router = crate::router::Router::new(shared.clone());
    let ask = || {
        router.lookup(&proto::LookupRouteRequest {
            tenant: "ns".into(),
            token_ids: (0..64).collect(),
            ..Default::default()
        })
    };
    let a = ask();
    assert_eq!(a.inexact_replicas, 2, "{a:?}");
    assert_eq!(
        a.warnings,
        vec![crate::router::INDEX_INCOMPLETE.to_string()]
    );
    // The resync the agent sends is vouched for again.
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(exact_resync(&[
            ("ns", "pod-a", "a4"),
            ("ns", "pod-b", "b4"),
        ]))),
    })
    .await
    .unwrap();
    until("the requested resync", || {
        coverage(&shared, "ns/pod-a#0") == Some(("Exact", None))
            && coverage(&shared, "ns/pod-b#0") == Some(("Exact", None))
    })
    .await;
    let a = ask();
    assert_eq!((a.inexact_replicas, a.warnings.len()), (0, 0), "{a:?}");
}

/// A restarted controller's index is empty until each agent resyncs, but its node plans
/// (derived from the pods before any agent reconnects) say which streams to expect:
/// answers of their scope say `IndexIncomplete` until the node's resync, and the gauge
/// counts them.
#[tokio::test]
async fn planned_streams_whose_agent_has_not_resynced_are_not_vouched_for() {
    let (url, shared) = serve_state(
        Shared::new(LookupPolicy::default()).unwrap().await_plans(),
        None,
    )
    .await;
    let engine = |pod: &str| ic_shared::plan::EnginePlan {
        namespace: "ns".into(),
        pod: pod.into(),
        model: "m".into(),
        hash_scheme: ic_shared::plan::HashScheme::Vllm,
        block_size: 16,
        kv_events: vec![ic_shared::plan::KvEventSource {
            endpoint: "tcp://10.0.0.5:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            dp_rank: 0,
        }],
        ..Default::default()
    };
    let plans = std::collections::BTreeMap::from([(
        "n1".to_string(),
        ic_shared::plan::NodePlan {
            engines: vec![engine("pod-a"), engine("pod-b")],
            ..Default::default()
        },
    )]);
    let router = crate::router::Router::new(shared.clone());
    let ask = || {
        router.lookup(&proto::LookupRouteRequest {
            tenant: "ns".into(),
            token_ids: (0..64).collect(),
            ..Default::default()
        })
    };
    // Before the first derivation the index does not even know what to expect.
    let a = ask();
    assert_eq!(a.inexact_replicas, 0, "{a:?}");
    assert_eq!(
        a.warnings,
        vec![crate::router::INDEX_INCOMPLETE.to_string()]
    );
    crate::reconcile::nodes::record_derived_plans(&shared, &plans);
    let a = ask();
    assert_eq!(a.decision, proto::Decision::NoHint as i32, "{a:?}");
    assert_eq!(a.inexact_replicas, 2, "{a:?}");
    assert_eq!(
        a.warnings,
        vec![crate::router::INDEX_INCOMPLETE.to_string()]
    );
    assert_eq!(shared.metrics.index_planned_streams_absent.get(), 2);
    let (_inbound, tx) = open(&url, hello("n1", None, "")).await;
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(exact_resync(&[
            ("ns", "pod-a", "a1"),
            ("ns", "pod-b", "b1"),
        ]))),
    })
    .await
    .unwrap();
    until("the resync", || {
        coverage(&shared, "ns/pod-a#0") == Some(("Exact", None))
            && coverage(&shared, "ns/pod-b#0") == Some(("Exact", None))
    })
    .await;
    let a = ask();
    assert_eq!((a.inexact_replicas, a.warnings.len()), (0, 0), "{a:?}");
    assert_eq!(shared.metrics.index_planned_streams_absent.get(), 0);
    // Deriving the same plans again changes nothing.
    crate::reconcile::nodes::record_derived_plans(&shared, &plans);
    assert_eq!(ask().inexact_replicas, 0);
}

#[tokio::test]
async fn entries_the_block_size_caps_drop_leave_their_stream_partial() {
    let (url, shared) = serve(None).await;
    let (_inbound, tx) = open(&url, hello("n1", None, "")).await;
    let mut r = exact_resync(&[("ns", "pod-a", "a1"), ("ns", "pod-b", "b1")]);
    // pod-a's block size is above the cap.
    r.streams[0].entries[0].block_size = ic_shared::limits::MAX_BLOCK_SIZE * 2;
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(r)),
    })
    .await
    .unwrap();
    until("the resync", || {
        coverage(&shared, "ns/pod-b#0") == Some(("Exact", None))
    })
    .await;
    assert_eq!(
        coverage(&shared, "ns/pod-a#0"),
        Some(("Partial", Some("BlockSizeCapExceeded")))
    );
    let cut = || {
        shared
            .metrics
            .kv_streams_refused_total
            .with_label_values(&["block_size_cap"])
            .get()
    };
    assert_eq!(cut(), 1);
    // A later Exact delta of a size the index takes does not make it Exact: what was cut
    // is still missing.
    tx.send(AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: 1,
            deltas: vec![proto::StreamDelta {
                coverage: proto::Coverage::Exact as i32,
                ..delta("ns", "pod-a", 1, 0xa2)
            }],
        })),
    })
    .await
    .unwrap();
    until("the delta", || {
        shared
            .index
            .read()
            .stream_entries("ns/pod-a#0")
            .is_some_and(|e| e.len() == 1)
    })
    .await;
    assert_eq!(
        coverage(&shared, "ns/pod-a#0"),
        Some(("Partial", Some("BlockSizeCapExceeded")))
    );
    assert_eq!(cut(), 1);
}

#[tokio::test]
async fn subscribers_and_the_node_agent_keep_their_own_streams() {
    let (url, shared) = serve(None).await;
    let (sub_a, tx_a) = open(&url, hello("n1", Some(("ns", "pod-a")), "")).await;
    let _sub_a = sub_a.unwrap();
    tx_a.send(resync(&[("ns", "pod-a", "a1")])).await.unwrap();
    let (sub_b, tx_b) = open(&url, hello("n1", Some(("ns", "pod-b")), "")).await;
    let _sub_b = sub_b.unwrap();
    tx_b.send(resync(&[("ns", "pod-b", "b1")])).await.unwrap();
    // The node's agent resyncs its (other) stream: the subscribers' streams stay.
    let (agent, tx_agent) = open(&url, hello("n1", None, "")).await;
    let _agent = agent.unwrap();
    tx_agent
        .send(resync(&[("ns", "pod-c", "c1")]))
        .await
        .unwrap();
    until("three streams", || {
        ["ns/pod-a#0", "ns/pod-b#0", "ns/pod-c#0"]
            .iter()
            .all(|s| shared.index.read().stream_entries(s).is_some())
    })
    .await;
    let snap = shared.index.read().snapshot();
    let mut nodes: Vec<(String, String)> = snap
        .replicas
        .iter()
        .map(|r| (r.stream_id.clone(), r.node.clone()))
        .collect();
    nodes.sort();
    assert_eq!(
        nodes,
        vec![
            ("ns/pod-a#0".to_string(), "n1/ns/pod-a".to_string()),
            ("ns/pod-b#0".to_string(), "n1/ns/pod-b".to_string()),
            ("ns/pod-c#0".to_string(), "n1".to_string()),
        ]
    );
    let reg = shared.nodes.lock();
    assert_eq!((reg.connected_count(), reg.connected_subscribers()), (1, 2));
}

fn plan_with(engines: &[(&str, &str)]) -> ic_shared::plan::NodePlan {
    let engines = engines
        .iter()
        .map(|(ns, pod)| {
            serde_json::from_value(serde_json::json!({"namespace": ns, "pod": pod})).unwrap()
        })
        .collect();
    ic_shared::plan::NodePlan {
        engines,
        ..Default::default()
    }
}

fn delta(tenant: &str, pod: &str, seq: u64, key: u64) -> proto::StreamDelta {
    proto::StreamDelta {
        stream: Some(StreamDescriptor {
            stream_id: format!("{tenant}/{pod}#0"),
            replica: pod.to_string(),
            tenant: tenant.to_string(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        }),
        seq,
        ops: vec![proto::KvOp {
            op: Some(proto::kv_op::Op::Store(proto::StoreOp {
                adapter: String::new(),
                block_size: 16,
                tier: proto::Tier::T1 as i32,
                content_keys: vec![key],
            })),
        }],
        ..Default::default()
    }
}

#[tokio::test]
async fn a_node_agent_may_report_only_engine_pods_its_node_runs() {
    let (url, shared) = serve(None).await;
    // The plans place team-a/vllm-a on n1 and team-b/vllm-b on n2.
    shared.nodes.lock().set_node_scope(
        &[
            ("n1".to_string(), plan_with(&[("team-a", "vllm-a")])),
            ("n2".to_string(), plan_with(&[("team-b", "vllm-b")])),
        ]
        .into(),
    );
    // n2's own agent reports its pod.
    let (a2, tx2) = open(&url, hello("n2", None, "")).await;
    let _in2 = a2.unwrap();
    tx2.send(resync(&[("team-b", "vllm-b", "b1")]))
        .await
        .unwrap();
    until("n2's stream", || {
        shared
            .index
            .read()
            .stream_entries("team-b/vllm-b#0")
            .is_some()
    })
    .await;
    // A compromised n1 reports its own pod, n2's pod, and a made-up one of another tenant.
    let (a1, tx1) = open(&url, hello("n1", None, "")).await;
    let mut in1 = a1.unwrap();
    tx1.send(resync(&[
        ("team-a", "vllm-a", "a1"),
        ("team-b", "vllm-b", "ee"),
        ("team-c", "ghost", "cc"),
    ]))
    .await
    .unwrap();
    until("n1's own stream", || {
        shared
            .index
            .read()
            .stream_entries("team-a/vllm-a#0")
            .is_some()
    })
    .await;
    let refused = || {
        shared
            .metrics
            .kv_streams_refused_total
            .with_label_values(&["outside_node_scope"])
            .get()
    };
    assert_eq!(refused(), 2);
    assert!(shared
        .index
        .read()
        .stream_entries("team-c/ghost#0")
        .is_none());
    // n2's stream still holds n2's block, and is still n2's.
    let b: Vec<u64> = shared
        .index
        .read()
        .stream_entries("team-b/vllm-b#0")
        .unwrap()
        .into_iter()
        .map(|e| e.content_key)
        .collect();
    assert_eq!(b, vec![0xb1]);
    // Deltas for n2's stream from n1 are dropped, n1's own apply.
    tx1.send(AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: 7,
            deltas: vec![
                delta("team-b", "vllm-b", 1, 0xdead),
                delta("team-a", "vllm-a", 1, 0xa2),
            ],
        })),
    })
    .await
    .unwrap();
    loop {
        match in1.message().await.unwrap().unwrap().msg {
            Some(controller_message::Msg::Ack(a)) if a.batch_id == 7 => break,
            _ => continue,
        }
    }
    assert_eq!(refused(), 3);
    let keys = |s: &str| -> Vec<u64> {
        let mut k: Vec<u64> = shared
            .index
            .read()
            .stream_entries(s)
            .unwrap()
            .into_iter()
            .map(|e| e.content_key)
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys("team-b/vllm-b#0"), vec![0xb1]);
    assert_eq!(keys("team-a/vllm-a#0"), vec![0xa1, 0xa2]);
}

/// The timing marks of the delta path (`ic_shared::timing`, what ic-bench splits publish →
/// visible at): received when the batch arrives, applied once the write lock is released
/// with the batch in the index; a batch refused while a resync is awaited is received and
/// never applied. One thread (the test's runtime) runs the server, so a thread-local
/// recorder sees every mark.
#[tokio::test]
async fn delta_batches_are_marked_received_then_applied() {
    use ic_shared::timing::{Recorder, Stage};
    let rec = Recorder::new();
    let _guard = tracing::subscriber::set_default(rec.subscriber());
    let (url, shared) = serve(None).await;
    let (inbound, tx) = open(&url, hello("n-timing", None, "")).await;
    let mut inbound = inbound.unwrap();
    tx.send(resync(&[("ns", "p", "a1")])).await.unwrap();
    let batch = |id: u64, seq: u64, key: u64| AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: id,
            deltas: vec![delta("ns", "p", seq, key)],
        })),
    };
    // 3 applies, 4 skips a seq (refused: a resync is requested), 5 arrives while the
    // resync is awaited.
    for m in [batch(3, 1, 0xa2), batch(4, 3, 0xa3), batch(5, 4, 0xa4)] {
        tx.send(m).await.unwrap();
    }
    let mut acked = Vec::new();
    while acked.len() < 3 {
        if let Some(controller_message::Msg::Ack(a)) = inbound.message().await.unwrap().unwrap().msg
        {
            acked.push(a.batch_id);
        }
    }
    assert_eq!(acked, vec![3, 4, 5]);
    let keys: Vec<u64> = shared
        .index
        .read()
        .stream_entries("ns/p#0")
        .unwrap()
        .into_iter()
        .map(|e| e.content_key)
        .collect();
    assert!(keys.contains(&0xa2) && !keys.contains(&0xa4), "{keys:?}");
    let marks: Vec<(Stage, u64)> = rec.take().into_iter().map(|m| (m.stage, m.id)).collect();
    assert_eq!(
        marks,
        vec![
            (Stage::BatchReceived, 3),
            (Stage::BatchApplied, 3),
            (Stage::BatchReceived, 4),
            (Stage::BatchApplied, 4),
            (Stage::BatchReceived, 5),
        ]
    );
    // Every write-lock hold was timed: the resync's registration and its one slice, and
    // the two batches that took the lock (4 was refused there; 5 waited for the resync and
    // took none).
    let holds = |what: &str| {
        shared
            .metrics
            .index_write_hold_seconds
            .with_label_values(&[what])
            .get_sample_count()
    };
    assert_eq!(
        (
            holds("resync_begin"),
            holds("resync_slice"),
            holds("deltas")
        ),
        (1, 1, 2)
    );
}

#[tokio::test]
async fn without_node_plans_node_agents_report_what_they_see() {
    // Standalone derives no plans: no node scope, today's behaviour.
    let (url, shared) = serve(None).await;
    assert!(!shared.nodes.lock().has_node_scope());
    let (a1, tx1) = open(&url, hello("n1", None, "")).await;
    let _in1 = a1.unwrap();
    tx1.send(resync(&[
        ("team-a", "vllm-a", "a1"),
        ("team-b", "vllm-b", "b1"),
    ]))
    .await
    .unwrap();
    until("both streams", || {
        ["team-a/vllm-a#0", "team-b/vllm-b#0"]
            .iter()
            .all(|s| shared.index.read().stream_entries(s).is_some())
    })
    .await;
}

#[tokio::test]
async fn a_subscriber_reporting_another_pod_is_cut_off_with_permission_denied() {
    let (url, shared) = serve(None).await;
    let (sub, tx) = open(&url, hello("n1", Some(("ns", "pod-a")), "")).await;
    let mut inbound = sub.unwrap();
    tx.send(resync(&[("ns", "pod-a", "a1"), ("ns", "pod-b", "b1")]))
        .await
        .unwrap();
    let status = final_status(&mut inbound).await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("\"ns/pod-b#0\"") && status.message().contains("replica"),
        "{}",
        status.message()
    );
    assert!(
        shared.index.read().stream_entries("ns/pod-a#0").is_none(),
        "nothing of the refused resync was applied"
    );
}

fn counters(streams: &[(&str, &str, u64, u64)]) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Counters(proto::CounterReport {
            streams: streams
                .iter()
                .map(|(tenant, pod, hits, queries)| proto::StreamCounters {
                    stream: Some(StreamDescriptor {
                        stream_id: format!("{tenant}/{pod}#0"),
                        replica: pod.to_string(),
                        tenant: tenant.to_string(),
                        ..Default::default()
                    }),
                    t2_hits: *hits,
                    t2_queries: *queries,
                    observed_at_unix_ms: 1,
                    ..Default::default()
                })
                .collect(),
        })),
    }
}

fn t2(shared: &Shared, stream: &str) -> Option<(Option<u64>, Option<u64>)> {
    shared
        .index
        .read()
        .snapshot()
        .replicas
        .into_iter()
        .find(|r| r.stream_id == stream)
        .map(|r| (r.t2_hits, r.t2_queries))
}

#[tokio::test]
async fn counters_apply_only_to_streams_the_connection_owns_until_its_next_resync() {
    let (url, shared) = serve(None).await;
    let (a, tx_a) = open(&url, hello("n1", None, "")).await;
    let _a = a.unwrap();
    tx_a.send(resync(&[("ns", "pod-a", "a1")])).await.unwrap();
    let (b, tx_b) = open(&url, hello("n2", None, "")).await;
    let _b = b.unwrap();
    tx_b.send(resync(&[("ns", "pod-b", "b1")])).await.unwrap();
    until("both streams", || {
        t2(&shared, "ns/pod-a#0").is_some() && t2(&shared, "ns/pod-b#0").is_some()
    })
    .await;
    // n1 reports its own stream and n2's: only its own lands.
    tx_a.send(counters(&[("ns", "pod-a", 25, 100), ("ns", "pod-b", 1, 1)]))
        .await
        .unwrap();
    until("pod-a's counters", || {
        t2(&shared, "ns/pod-a#0") == Some((Some(25), Some(100)))
    })
    .await;
    assert_eq!(t2(&shared, "ns/pod-b#0"), Some((None, None)));
    // A resync resets them (the agent sends them again right after).
    tx_a.send(resync(&[("ns", "pod-a", "a1")])).await.unwrap();
    until("the reset", || {
        t2(&shared, "ns/pod-a#0") == Some((None, None))
    })
    .await;
    tx_a.send(counters(&[("ns", "pod-a", 30, 120)]))
        .await
        .unwrap();
    until("the new counters", || {
        t2(&shared, "ns/pod-a#0") == Some((Some(30), Some(120)))
    })
    .await;
}

#[tokio::test]
async fn a_subscriber_reporting_counters_of_another_pod_is_cut_off() {
    let (url, shared) = serve(None).await;
    let (sub, tx) = open(&url, hello("n1", Some(("ns", "pod-a")), "")).await;
    let mut inbound = sub.unwrap();
    tx.send(resync(&[("ns", "pod-a", "a1")])).await.unwrap();
    tx.send(counters(&[("ns", "pod-a", 1, 2), ("ns", "pod-b", 3, 4)]))
        .await
        .unwrap();
    let status = final_status(&mut inbound).await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("\"ns/pod-b#0\""),
        "{}",
        status.message()
    );
    assert_eq!(
        t2(&shared, "ns/pod-a#0"),
        Some((None, None)),
        "nothing of the refused report was applied"
    );
}

#[tokio::test]
async fn in_cluster_a_subscriber_needs_its_own_pods_token() {
    let engine: auth::ServiceAccountRef = "ns:engine".parse().unwrap();
    let agent: auth::ServiceAccountRef = "ic:agent".parse().unwrap();
    let verifier =
        auth::FakeTokenVerifier::new().with_pod_token("tok-a", &engine, Some("n1"), Some("pod-a"));
    let authn = Arc::new(auth::AgentAuthenticator::new(
        Arc::new(verifier),
        auth::DEFAULT_AUDIENCE,
        agent,
    ));
    let (url, shared) = serve(Some(authn)).await;
    shared
        .nodes
        .lock()
        .set_node_scope(&[("n1".to_string(), plan_with(&[("ns", "pod-a")]))].into());
    let (refused, _tx) = open(&url, hello("n1", Some(("ns", "pod-b")), "tok-a")).await;
    let st = refused.err().unwrap();
    assert_eq!(st.code(), tonic::Code::PermissionDenied);
    assert!(
        st.message().contains("pod \"ns/pod-b\""),
        "{}",
        st.message()
    );
    // Without the subscriber claim the engine's token is not the agent's.
    let (refused, _tx) = open(&url, hello("n1", None, "tok-a")).await;
    assert_eq!(refused.err().unwrap().code(), tonic::Code::PermissionDenied);

    let (accepted, tx) = open(&url, hello("n1", Some(("ns", "pod-a")), "tok-a")).await;
    let _inbound = accepted.unwrap();
    tx.send(resync(&[("ns", "pod-a", "a1")])).await.unwrap();
    until("the subscriber's stream", || {
        shared.index.read().stream_entries("ns/pod-a#0").is_some()
    })
    .await;
    assert_eq!(shared.nodes.lock().subscribers()[0].pod, "pod-a");
}

/// Issue 38 item 6: a valid pod-bound token of a pod the plans do not know (a non-engine
/// pod of the tenant, under another service account) is refused, so it cannot outrank the
/// tenant's engine; before plans exist the stream is refused UNAVAILABLE.
#[tokio::test]
async fn in_cluster_only_planned_engine_pods_may_subscribe() {
    let engine: auth::ServiceAccountRef = "team-a:engine".parse().unwrap();
    let other: auth::ServiceAccountRef = "team-a:other".parse().unwrap();
    let verifier = auth::FakeTokenVerifier::new()
        .with_pod_token("tok-engine", &engine, Some("n1"), Some("vllm-a"))
        .with_pod_token("tok-other", &other, Some("n1"), Some("sidecar-x"));
    let authn = Arc::new(auth::AgentAuthenticator::new(
        Arc::new(verifier),
        auth::DEFAULT_AUDIENCE,
        "ic:agent".parse().unwrap(),
    ));
    let (url, shared) = serve(Some(authn)).await;
    let (refused, _tx) = open(
        &url,
        hello("n1", Some(("team-a", "sidecar-x")), "tok-other"),
    )
    .await;
    assert_eq!(refused.err().unwrap().code(), tonic::Code::Unavailable);
    shared
        .nodes
        .lock()
        .set_node_scope(&[("n1".to_string(), plan_with(&[("team-a", "vllm-a")]))].into());
    let (refused, _tx) = open(
        &url,
        hello("n1", Some(("team-a", "sidecar-x")), "tok-other"),
    )
    .await;
    let st = refused.err().unwrap();
    assert_eq!(st.code(), tonic::Code::PermissionDenied);
    assert!(
        st.message().contains("not an engine pod"),
        "{}",
        st.message()
    );
    let (accepted, tx) = open(&url, hello("n1", Some(("team-a", "vllm-a")), "tok-engine")).await;
    let _inbound = accepted.unwrap();
    tx.send(resync(&[("team-a", "vllm-a", "a1")]))
        .await
        .unwrap();
    until("the engine's stream", || {
        shared
            .index
            .read()
            .stream_entries("team-a/vllm-a#0")
            .is_some()
    })
    .await;
    assert!(shared
        .index
        .read()
        .stream_entries("team-a/sidecar-x#0")
        .is_none());
}

fn ranked(tenant: &str, pod: &str, ranks: std::ops::Range<u32>) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Resync(Resync {
            streams: ranks
                .map(|r| StreamSnapshot {
                    stream: Some(StreamDescriptor {
                        stream_id: format!("{tenant}/{pod}#{r}"),
                        replica: if r == 0 {
                            pod.to_string()
                        } else {
                            format!("{pod}#{r}")
                        },
                        dp_rank: r,
                        tenant: tenant.to_string(),
                        model: "m".into(),
                        hash_scheme: "vllm".into(),
                        ..Default::default()
                    }),
                    entries: vec![BlockEntry {
                        adapter: String::new(),
                        block_size: 16,
                        content_key: u64::from(r) + 1,
                        tier: proto::Tier::T1 as i32,
                    }],
                    ..Default::default()
                })
                .collect(),
        })),
    }
}

fn refused(shared: &Shared, reason: &str) -> u64 {
    shared
        .metrics
        .kv_streams_refused_total
        .with_label_values(&[reason])
        .get()
}

/// Issue 38 item 4: one pod token registered 200 000 streams (any rank was accepted), and
/// 200 000 one-entry streams held the index write lock 7.4 s. Now a reporter registers at
/// most `--max-streams-per-reporter` streams per resync, and with node plans only the
/// ranks the plan has.
#[tokio::test]
async fn streams_per_reporter_are_capped_and_ranks_follow_the_plan() {
    let shared = Shared::new(LookupPolicy {
        max_streams_per_reporter: Some(8),
        ..Default::default()
    })
    .unwrap();
    let (url, shared) = serve_state(shared, None).await;
    // Standalone: a subscriber claiming 1 000 ranks registers 8 of them.
    let (accepted, tx) = open(&url, hello("n1", Some(("ns", "pod-a")), "")).await;
    let _a = accepted.unwrap();
    tx.send(ranked("ns", "pod-a", 0..1000)).await.unwrap();
    until("the capped resync", || {
        refused(&shared, "stream_cap") == 992
    })
    .await;
    until("8 streams", || {
        shared.index.read().stream_entries("ns/pod-a#7").is_some()
    })
    .await;
    assert!(shared.index.read().stream_entries("ns/pod-a#8").is_none());
    // A node agent is held to the same cap.
    let (accepted, tx) = open(&url, hello("n2", None, "")).await;
    let _b = accepted.unwrap();
    tx.send(ranked("ns", "pod-b", 0..20)).await.unwrap();
    until("the node's capped resync", || {
        refused(&shared, "stream_cap") == 1004
    })
    .await;

    // With node plans: the plan has rank 0 only; rank 1 of the node agent is left out.
    shared
        .nodes
        .lock()
        .set_node_scope(&[("n3".to_string(), plan_with(&[("ns", "pod-c")]))].into());
    let before = refused(&shared, "outside_node_scope");
    let (accepted, tx) = open(&url, hello("n3", None, "")).await;
    let _c = accepted.unwrap();
    tx.send(ranked("ns", "pod-c", 0..2)).await.unwrap();
    until("rank 0 applied", || {
        shared.index.read().stream_entries("ns/pod-c#0").is_some()
    })
    .await;
    assert!(shared.index.read().stream_entries("ns/pod-c#1").is_none());
    assert_eq!(refused(&shared, "outside_node_scope"), before + 1);
    // A subscriber of a planned pod reporting an unplanned rank is cut off.
    let (accepted, tx) = open(&url, hello("n3", Some(("ns", "pod-c")), "")).await;
    let mut inbound = accepted.unwrap();
    tx.send(ranked("ns", "pod-c", 3..4)).await.unwrap();
    let st = final_status(&mut inbound).await;
    assert_eq!(st.code(), tonic::Code::PermissionDenied);
    assert!(
        st.message().contains("data-parallel rank"),
        "{}",
        st.message()
    );
    assert_eq!(refused(&shared, "rank_not_planned"), 1);
}

/// Issue 38 item 8: a stream that holds the only resync turn and sends nothing (three such
/// delayed another node by 31.6 s) hands the turn on after `turn_idle`, long before its
/// chunk gap ends it; the next node's resync is applied while the staller is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_turn_holder_hands_the_turn_on() {
    let shared = Shared::new(LookupPolicy::default())
        .unwrap()
        .with_resync_turns(
            turns::ResyncTurns::new(1)
                .with_timing(Duration::from_millis(50), Duration::from_secs(120))
                .with_turn_idle(Duration::from_millis(200)),
        );
    let (url, shared) = serve_state(shared, None).await;
    let mut stallers = Vec::new();
    for i in 0..3 {
        let (s_in, s_tx) = open(&url, hello(&format!("staller-{i}"), None, "")).await;
        stallers.push((s_in.unwrap(), s_tx));
    }
    let (b_in, b_tx) = open(&url, hello("n-b", None, "")).await;
    let _b_in = b_in.unwrap();
    b_tx.send(resync(&[("ns", "b", "a1")])).await.unwrap();
    until("B applied", || {
        shared.index.read().stream_entries("ns/b#0").is_some()
    })
    .await;
    // The stallers were not cut off (their gap is 120 s): they only lost the turn.
    assert_eq!(shared.nodes.lock().connected_count(), 4);
    // A staller that then sends its resync gets a turn and is applied.
    let (_, s_tx) = &stallers[0];
    s_tx.send(resync(&[("ns", "s0", "a2")])).await.unwrap();
    until("the late resync applied", || {
        shared.index.read().stream_entries("ns/s0#0").is_some()
    })
    .await;
}

/// `--resync-turn-idle-ms` (`LookupPolicy::resync_turn_idle`) sets how long a silent turn
/// holder keeps the only turn: at 5 s, another agent's resync waits behind a silent holder
/// well past the 1 s default, and is applied once the 5 s have passed.
#[tokio::test]
async fn the_resync_turn_idle_flag_sets_how_long_a_silent_holder_keeps_the_turn() {
    let idle = Duration::from_secs(5);
    let shared = Shared::new(LookupPolicy {
        resync_turns: Some(1),
        resync_turn_idle: Some(idle),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(shared.resync_turns.turn_idle(), idle);
    let (url, shared) = serve_state(shared, None).await;
    // The staller takes the only turn with its Hello and sends nothing more: it holds it
    // until at least `idle` after this instant.
    let start = tokio::time::Instant::now();
    let (s_in, _s_tx) = open(&url, hello("staller", None, "")).await;
    let _s_in = s_in.unwrap();
    until("the staller holds the turn", || {
        pending(&shared, "applying") == 1
    })
    .await;
    let (b_in, b_tx) = open(&url, hello("n-b", None, "")).await;
    let _b_in = b_in.unwrap();
    b_tx.send(resync(&[("ns", "b", "a1")])).await.unwrap();
    // With the default (1 s) the turn would have been handed on and B applied long before;
    // with 5 s the staller still holds it 4 s after it took it.
    tokio::time::sleep_until(start + Duration::from_secs(4)).await;
    assert!(
        shared.index.read().stream_entries("ns/b#0").is_none(),
        "B's resync was applied while the silent staller still had {idle:?} of its turn"
    );
    until("B applied once the staller's turn is handed on", || {
        shared.index.read().stream_entries("ns/b#0").is_some()
    })
    .await;
}

/// Issue 38 Deliver 4 (breaker D3): a tenant that registered 64 vLLM block sizes (none of
/// them 16) left another tenant's genuine size-16 stream at 0 entries, Partial /
/// `BlockSizeCapExceeded`, counted under `block_size_cap` against the victim. A tenant's first
/// sizes are now its own whatever other tenants registered.
#[tokio::test]
async fn a_tenant_with_64_block_sizes_does_not_refuse_another_tenants_stream() {
    let (url, shared) = serve(None).await;
    let (_attacker, tx) = open(&url, hello("n1", None, "")).await;
    let mut r = exact_resync(&[("evil", "pod-x", "e1")]);
    let first = r.streams[0].entries[0].clone();
    r.streams[0].entries = (0..ic_shared::limits::MAX_BLOCK_SIZES as u32)
        .map(|i| BlockEntry {
            block_size: 100 + i,
            content_key: 0xe000 + u64::from(i),
            ..first.clone()
        })
        .collect();
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(r)),
    })
    .await
    .unwrap();
    until("the attacker's 64 sizes", || {
        shared.index.read().block_sizes().get("vllm").map(Vec::len)
            == Some(ic_shared::limits::MAX_BLOCK_SIZES)
    })
    .await;
    assert_eq!(refused(&shared, "block_size_cap"), 0);
    let (_victim, tx) = open(&url, hello("n2", None, "")).await;
    tx.send(AgentMessage {
        msg: Some(Msg::Resync(exact_resync(&[("team-a", "pod-a", "a1")]))),
    })
    .await
    .unwrap();
    until("the victim's resync", || {
        coverage(&shared, "team-a/pod-a#0").is_some()
    })
    .await;
    assert_eq!(
        coverage(&shared, "team-a/pod-a#0"),
        Some(("Exact", None)),
        "another tenant's sizes must not refuse team-a's first size"
    );
    assert_eq!(
        shared
            .index
            .read()
            .stream_entries("team-a/pod-a#0")
            .map(|e| e.len()),
        Some(1)
    );
    assert_eq!(refused(&shared, "block_size_cap"), 0);
    // A delta of team-a's own size keeps it Exact and lands.
    tx.send(AgentMessage {
        msg: Some(Msg::KvDeltas(proto::KvDeltaBatch {
            batch_id: 1,
            deltas: vec![proto::StreamDelta {
                coverage: proto::Coverage::Exact as i32,
                ..delta("team-a", "pod-a", 1, 0xa2)
            }],
        })),
    })
    .await
    .unwrap();
    until("the delta", || {
        shared
            .index
            .read()
            .stream_entries("team-a/pod-a#0")
            .is_some_and(|e| e.len() == 2)
    })
    .await;
    assert_eq!(refused(&shared, "block_size_cap"), 0);
}
