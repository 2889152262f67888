//! The link flushes on idle, not on a timer (issue 18 item 3): a batch the engine publishes
//! reaches the controller as a delta within a few milliseconds, instead of after a batching
//! window. Real agent runtime, a replayed engine publisher that stamps each batch with the
//! time it sends it, and a stand-in controller that timestamps what it receives.
//!
//! The same run checks the agent's timing marks (`ic_shared::timing`, what ic-bench splits
//! publish → visible at): each engine batch is marked received, then applied, and a delta
//! batch taken after it is marked taken, then sent, before the controller has it. The recorder
//! is this binary's global tracing subscriber (the agent's tasks run on other threads), so this
//! file holds one test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use ic_agent::kv::publish::PublishOptions;
use ic_shared::proto::agent_message::Msg;
use ic_shared::timing::{Recorder, Stage};
use support::{agent_following_replay, FakeController};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_batch_reaches_the_controller_without_a_batching_delay() {
    let rec = Recorder::new();
    tracing::subscriber::set_global_default(rec.subscriber()).unwrap();
    let (_fake, grpc, mut received) = FakeController::start().await;
    let (running, publisher) = agent_following_replay(
        "node-flush",
        grpc,
        PublishOptions {
            // Far apart, so every batch leaves as its own delta.
            interval: Duration::from_millis(150),
            connect_wait: Duration::from_millis(1000),
            linger: Duration::from_secs(15),
            until_seq: Some(8),
            retime: true,
            ..PublishOptions::default()
        },
        |link| link.backoff_initial = Duration::from_millis(100),
    )
    .await;
    // Publish → received, per delta carrying ops: now − the batch's engine timestamp.
    let mut delays_ms = Vec::new();
    let mut batches = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while delays_ms.len() < 4 {
        let m = tokio::time::timeout_at(deadline, received.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} deltas with ops arrived", delays_ms.len()))
            .unwrap();
        let now = ic_shared::now_unix_ms();
        if let Some(Msg::KvDeltas(b)) = m.msg {
            batches.push(b.batch_id);
            for d in b.deltas.iter().filter(|d| !d.ops.is_empty()) {
                delays_ms.push(now - d.last_event_unix_ms);
            }
        }
    }
    // The best of several: a loaded machine may delay some, but a timer of 20 ms (what the
    // link had) would delay every one by at least that.
    let best = delays_ms.iter().copied().min().unwrap();
    assert!(
        (0..15).contains(&best),
        "publish → delta took at least {best} ms: {delays_ms:?}"
    );
    // Marks: every batch the controller got was taken, then sent; an engine batch the agent
    // applied live was received before (a batch its bootstrap replay delivered first is
    // applied from the replay, unmarked, and its live copy skipped); a delta batch was taken
    // after the first one applied.
    // The agent marks a batch sent once its send returns, which can be after the controller
    // already holds it: gather marks until every received batch has both (or 5 s pass).
    let mut marks = rec.take();
    let sent_all = |marks: &[ic_shared::timing::Mark]| {
        batches.iter().all(|b| {
            marks
                .iter()
                .any(|m| m.stage == Stage::BatchSent && m.id == *b)
        })
    };
    let gather_until = tokio::time::Instant::now() + Duration::from_secs(5);
    while !sent_all(&marks) && tokio::time::Instant::now() < gather_until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        marks.extend(rec.take());
    }
    let at = |stage: Stage, id: u64| marks.iter().position(|m| m.stage == stage && m.id == id);
    for b in &batches {
        let (taken, sent) = (at(Stage::BatchTaken, *b), at(Stage::BatchSent, *b));
        assert!(
            taken.is_some() && sent.is_some() && taken < sent,
            "batch {b}: taken {taken:?}, sent {sent:?} in {marks:?}"
        );
    }
    let applied: Vec<(u64, usize)> = marks
        .iter()
        .enumerate()
        .filter(|(_, m)| m.stage == Stage::KvApplied)
        .map(|(i, m)| (m.id, i))
        .collect();
    assert!(applied.len() >= 2, "{marks:?}");
    for (seq, i) in &applied {
        let r = at(Stage::KvReceived, *seq);
        assert!(r.is_some_and(|r| r < *i), "engine batch {seq}: {marks:?}");
    }
    assert!(
        marks[applied[0].1..]
            .iter()
            .any(|m| m.stage == Stage::BatchTaken),
        "no batch taken after the first applied engine batch: {marks:?}"
    );
    running.abort();
    publisher.abort();
}
