//! Resync turns: how many agent resyncs the controller reads and applies at once.
//!
//! After a controller restart every agent reconnects and sends its whole resync (docs/scaling.md:
//! 5 000 agents, 100 M entries). Applied all at once, every session advances one slice per
//! round, every resync finishes near the end, thousands of decoded resyncs sit in memory, and
//! the runtime's workers are so busy that connection tasks (keep-alive pings, lookups) wait
//! seconds. Taking turns — a FIFO semaphore of about one turn per core — applies resyncs one
//! after another at the same total CPU cost: the first agents are exact after milliseconds, the
//! waiting ones have sent only their `Hello` (the rest waits in their connection's HTTP/2 flow
//! control window), and the workers stay free for other tasks.
//!
//! A waiting or applying session tells its agent every [`PROGRESS_EVERY`] with a
//! `ResyncProgress` message (its delta batches cannot be acked before the resync is applied;
//! the agent does not count that time against its ack timeout). A session that holds a turn
//! and receives nothing for `--resync-turn-idle-ms` (default [`TURN_IDLE`]) hands the turn to the next session (issue 38 item 8:
//! stalled resyncs held the single turn 10 s each, and three stallers delayed another node by
//! 31.6 s); a resync that then receives nothing for [`RESYNC_CHUNK_GAP`] since its last message
//! ends its stream. Its next message queues for a turn again, at the back.

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntGaugeVec;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How often a session whose resync waits or is being applied sends `ResyncProgress`.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Longest a session holding a turn waits for the next message of its resync before it ends
/// the stream (`DEADLINE_EXCEEDED`; the agent reconnects and resends).
pub const RESYNC_CHUNK_GAP: Duration = Duration::from_secs(10);

/// Default of `--resync-turn-idle-ms` ([`crate::state::LookupPolicy::resync_turn_idle`]):
/// longest a session holds a turn while its stream sends nothing (an agent sends its resync
/// right after its Hello, chunk after chunk, from its connection's flow-control window): then
/// the turn goes to the next session in line.
pub const TURN_IDLE: Duration = Duration::from_secs(1);

/// Most turns [`ResyncTurns::for_this_machine`] gives, whatever the core count: beyond a few,
/// more concurrent applies only contend for the index write lock.
const MAX_TURNS: usize = 4;

/// A FIFO semaphore of resync turns with the `resyncs_pending{state}` gauge.
#[derive(Debug)]
pub struct ResyncTurns {
    sem: Arc<Semaphore>,
    progress_every: Duration,
    chunk_gap: Duration,
    turn_idle: Duration,
}

impl ResyncTurns {
    /// `size` turns (at least 1).
    pub fn new(size: usize) -> Self {
        ResyncTurns {
            sem: Arc::new(Semaphore::new(size.max(1))),
            progress_every: PROGRESS_EVERY,
            chunk_gap: RESYNC_CHUNK_GAP,
            turn_idle: TURN_IDLE,
        }
    }

    /// The same turns, handed on after `turn_idle` without a message (`--resync-turn-idle-ms`;
    /// tests). Used up to [`Self::chunk_gap`] at most.
    pub fn with_turn_idle(mut self, turn_idle: Duration) -> Self {
        self.turn_idle = turn_idle;
        self
    }

    /// How long a turn holder may be silent before the turn goes to the next session
    /// (`--resync-turn-idle-ms`, default [`TURN_IDLE`]; the session uses at most
    /// [`Self::chunk_gap`]).
    pub fn turn_idle(&self) -> Duration {
        self.turn_idle
    }

    /// The same turns with other timings (tests: `ResyncProgress` every `progress_every`, a
    /// stalled turn holder cut off after `chunk_gap`).
    pub fn with_timing(mut self, progress_every: Duration, chunk_gap: Duration) -> Self {
        self.progress_every = progress_every;
        self.chunk_gap = chunk_gap;
        self
    }

    /// How often a waiting or applying session sends `ResyncProgress` ([`PROGRESS_EVERY`]).
    pub fn progress_every(&self) -> Duration {
        self.progress_every
    }

    /// How long a turn holder may go without a message ([`RESYNC_CHUNK_GAP`]).
    pub fn chunk_gap(&self) -> Duration {
        self.chunk_gap
    }

    /// Half the cores this process may run on, at least 1, at most [`MAX_TURNS`]. The index
    /// takes one writer at a time and its lock blocks the thread: turns beyond that only
    /// overlap decoding with applying, while every applier parked on the lock is a runtime
    /// worker that cannot poll lookups or connections (on 2 cores, 2 appliers stalled storm
    /// lookups by milliseconds; docs/scaling.md).
    pub fn for_this_machine() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::new((cores / 2).clamp(1, MAX_TURNS))
    }

    /// Waits for a turn, in arrival order. While waiting the session counts as `waiting` in
    /// `pending`, then as `applying` until the returned [`Turn`] is dropped.
    pub async fn take(&self, pending: &IntGaugeVec) -> Turn {
        let waiting = pending.with_label_values(&["waiting"]);
        waiting.inc();
        let _left = Dec(waiting);
        // The semaphore is never closed, so acquiring fails only if it were; a session then
        // proceeds without one (no worse than before turns existed).
        let permit = self.sem.clone().acquire_owned().await.ok();
        let applying = pending.with_label_values(&["applying"]);
        applying.inc();
        Turn {
            _permit: permit,
            _applying: Dec(applying),
        }
    }
}

/// A held resync turn; dropping it hands the turn to the next session.
#[derive(Debug)]
pub struct Turn {
    _permit: Option<OwnedSemaphorePermit>,
    _applying: Dec,
}

/// Decrements a gauge when dropped (a cancelled wait leaves the gauge right).
#[derive(Debug)]
struct Dec(prometheus::IntGauge);

impl Drop for Dec {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use prometheus::Opts;

    fn gauge() -> IntGaugeVec {
        IntGaugeVec::new(Opts::new("pending", "test"), &["state"]).unwrap()
    }

    #[tokio::test]
    async fn turns_are_handed_out_in_arrival_order_and_counted() {
        let turns = Arc::new(ResyncTurns::new(1));
        let pending = gauge();
        let first = turns.take(&pending).await;
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..3 {
            let (turns, pending, order) = (turns.clone(), pending.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let t = turns.take(&pending).await;
                order.lock().push(i);
                tokio::task::yield_now().await;
                drop(t);
            }));
            // Let each waiter queue before the next one arrives.
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(pending.with_label_values(&["waiting"]).get(), 3);
        assert_eq!(pending.with_label_values(&["applying"]).get(), 1);
        drop(first);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*order.lock(), vec![0, 1, 2]);
        assert_eq!(pending.with_label_values(&["waiting"]).get(), 0);
        assert_eq!(pending.with_label_values(&["applying"]).get(), 0);
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_the_gauge_and_the_queue_right() {
        let turns = ResyncTurns::new(1);
        let pending = gauge();
        let held = turns.take(&pending).await;
        let r = tokio::time::timeout(Duration::from_millis(20), turns.take(&pending)).await;
        assert!(r.is_err(), "no second turn while the only one is held");
        assert_eq!(pending.with_label_values(&["waiting"]).get(), 0);
        drop(held);
        let _again = turns.take(&pending).await;
        assert_eq!(pending.with_label_values(&["applying"]).get(), 1);
    }
}
