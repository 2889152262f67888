//! The link tells the truth (issue 12): an agent whose delta batches go un-acked past
//! `LinkConfig::ack_timeout` reconnects and resyncs, instead of believing the controller
//! applied them. Real agent runtime, a replayed engine publisher, and a stand-in controller
//! that records everything and acks nothing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use ic_agent::kv::publish::{PublishError, PublishOptions, PublishReport};
use ic_agent::runtime::{self};
use ic_shared::proto::agent_message::Msg;
use support::{agent_following_replay, FakeController};

/// The real agent runtime following a replayed vLLM publisher (8 events, 50 ms apart), linked
/// to `grpc` with a 1 s ack timeout.
async fn agent_with_deltas(
    grpc: std::net::SocketAddr,
) -> (
    runtime::Running,
    tokio::task::JoinHandle<Result<PublishReport, PublishError>>,
) {
    agent_following_replay(
        "node-acks",
        grpc,
        PublishOptions {
            interval: Duration::from_millis(50),
            connect_wait: Duration::from_millis(1000),
            linger: Duration::from_secs(15),
            until_seq: Some(8),
            ..PublishOptions::default()
        },
        |link| {
            link.ack_timeout = Duration::from_secs(1);
            link.backoff_initial = Duration::from_millis(100);
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_deltas_make_the_agent_reconnect_and_resync() {
    let (_fake, grpc, mut received) = FakeController::start().await;
    let (running, publisher) = agent_with_deltas(grpc).await;
    // Hello, Resync, … deltas nobody acks …, then a new stream: Hello and a fresh Resync.
    let mut order = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while order.iter().filter(|m| **m == "hello").count() < 2 {
        let m = tokio::time::timeout_at(deadline, received.recv())
            .await
            .unwrap_or_else(|_| panic!("no reconnect; saw {order:?}"))
            .unwrap();
        order.push(match m.msg {
            Some(Msg::Hello(_)) => "hello",
            Some(Msg::Resync(_)) | Some(Msg::ResyncChunk(_)) => "resync",
            Some(Msg::KvDeltas(_)) => "deltas",
            _ => "other",
        });
    }
    let second = order.iter().rposition(|m| *m == "hello").unwrap();
    assert!(order[..second].contains(&"deltas"), "{order:?}");
    let next = tokio::time::timeout(Duration::from_secs(5), received.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(next.msg, Some(Msg::Resync(_))), "{next:?}");
    let link = running.state.link.read().clone();
    // The link says why it reconnected (or has already counted the new stream).
    assert!(
        link.endpoints.values().any(|e| e.connects >= 2
            || e.last_error
                .as_deref()
                .is_some_and(|m| m.contains("not acked"))),
        "{link:?}"
    );
    running.abort();
    publisher.abort();
}

/// A controller working through a resync queue (`ResyncProgress`, controller/src/ingest/turns.rs)
/// cannot ack batches sent after the agent's resync; while it says so, the ack clock restarts
/// and the agent keeps its stream (a reconnect would send it to the back of the queue). Once
/// the progress stops, the timeout applies again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_progress_keeps_the_stream_past_the_ack_timeout() {
    let (fake, grpc, mut received) = FakeController::start().await;
    let (running, publisher) = agent_with_deltas(grpc).await;
    let hello = tokio::time::timeout(Duration::from_secs(20), received.recv()).await;
    assert!(matches!(hello, Ok(Some(m)) if matches!(m.msg, Some(Msg::Hello(_)))));
    let mut deltas = false;
    let progress_until = tokio::time::Instant::now() + Duration::from_secs(4);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    // 4 s of progress, four ack timeouts: one stream, deltas un-acked all along.
    while tokio::time::Instant::now() < progress_until {
        tokio::select! {
            _ = tick.tick() => {
                fake.send(ic_shared::proto::controller_message::Msg::ResyncProgress(
                    ic_shared::proto::ResyncProgress::default(),
                ))
                .await;
            }
            m = received.recv() => match m.unwrap().msg {
                Some(Msg::Hello(_)) if deltas => panic!("reconnected while the controller reported resync progress"),
                Some(Msg::KvDeltas(_)) => deltas = true,
                _ => {}
            },
        }
    }
    assert!(
        deltas,
        "the publisher's events reached the controller as delta batches"
    );
    assert_eq!(
        running
            .state
            .link
            .read()
            .endpoints
            .values()
            .map(|e| e.connects)
            .sum::<u64>(),
        1
    );
    // Silence: the un-acked batch times out and the agent reconnects.
    let m = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(Msg::Hello(_)) = received.recv().await.unwrap().msg {
                return;
            }
        }
    })
    .await;
    assert!(m.is_ok(), "no reconnect after the progress stopped");
    running.abort();
    publisher.abort();
}
