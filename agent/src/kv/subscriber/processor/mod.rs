//! The processor task of one stream: applies live messages in order, verifies attaches, runs
//! idle tail checks beside live processing, and publishes coverage (rules in the [`super`]
//! docs). Verification and healing by anchored replay: [`verify`].

mod verify;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::kv::decode::decode_batch;
use ic_shared::timing::{self, Stage};
use tokio::sync::mpsc;
use xxhash_rust::xxh3::xxh3_64;
use zeromq::ZmqMessage;

use std::sync::atomic::AtomicUsize;

use super::super::stream::{
    ApplyReport, LinkState, SeqCheck, CLEAR_ENGINE_RESTARTED, CLEAR_SEQUENCE_GAP,
};
use super::budget;
use super::clock::{corrected_lag, CLOCK_SKEW_FLAG_SECONDS};
use super::reader::{message_bytes, record_peer_drop, split_live, Queued};
use super::replay::{cut, judge_anchor, request_replay, ReplayError};
use super::{now_unix_ms, record_drop, Sink, StreamShared, SubscriberOptions, FLUSH_KEYS};

/// The processor of one stream (see the module docs).
struct Processor {
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    replay_ep: Option<String>,
    /// The connection epoch whose attachment was handled.
    handled_epoch: u64,
    /// `seq → digest` of batches applied from a replay and not yet seen live, so their live
    /// copies are skipped instead of read as an engine restart.
    replayed: BTreeMap<u64, u64>,
    last_live: Option<Instant>,
    last_check: Option<Instant>,
    /// An idle check ran since the last live message.
    tail_checked: bool,
    /// Queue-full drops counted when the last live message was applied.
    drops_at_last_live: u64,
    /// Without a replay endpoint: a held-back frame with an implausible seq.
    suspect: Option<u64>,
    /// The attach verification of the current connection has not succeeded: the retry
    /// schedule. Only an anchored replay ends it — never a live frame's sequence number.
    unverified: Option<AttachRetry>,
    coverage: Option<Coverage>,
    /// The heal schedule of a stream Partial for an incomplete history (a full replay from
    /// seq 0, retried with the attach back-off).
    heal: Option<AttachRetry>,
    /// The engine's buffer cannot heal this incarnation (it no longer starts at seq 0, is
    /// empty, or holds more than a replay accepts): no more heal tries until the state is known
    /// again.
    heal_hopeless: bool,
    /// The idle tail check in flight beside live processing.
    routine: Option<RoutineCheck>,
}

/// What an idle tail check's spawned replay brings back: the replies from the anchor, and —
/// when there are none — whether the engine holds older batches (it restarted) or nothing at
/// all.
type RoutineReplies = Result<(Vec<(u64, Vec<u8>)>, Option<bool>), ReplayError>;

/// An idle tail check running beside live processing.
struct RoutineCheck {
    /// `(seq, digest)` it is anchored at; a result is used only if the stream is still there.
    anchor: (u64, u64),
    started: Instant,
    /// It ran past its bound and set Healing.
    healing: bool,
}

/// The replay of an idle tail check, run as its own task (see [`RoutineReplies`]).
async fn routine_replay(
    ep: String,
    last: u64,
    topic: String,
    opts: SubscriberOptions,
) -> RoutineReplies {
    let replies = request_replay(&ep, last, u64::MAX, &topic, &opts).await?;
    if !replies.is_empty() {
        return Ok((replies, None));
    }
    let older = request_replay(&ep, 0, last, &topic, &opts).await?;
    Ok((replies, Some(!older.is_empty())))
}

/// Waits for the idle check's task (pending forever when there is none; guarded by the caller).
async fn join_routine(
    t: &mut Option<tokio::task::JoinHandle<RoutineReplies>>,
) -> Result<RoutineReplies, tokio::task::JoinError> {
    match t {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

pub(super) async fn process_loop(
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    mut rx: mpsc::Receiver<Queued>,
    queued: Arc<AtomicUsize>,
) {
    let mut p = Processor {
        replay_ep: shared.spec.replay_endpoint.clone(),
        shared,
        sink,
        opts,
        handled_epoch: 0,
        replayed: BTreeMap::new(),
        last_live: None,
        last_check: None,
        tail_checked: false,
        drops_at_last_live: 0,
        suspect: None,
        unverified: None,
        coverage: None,
        heal: None,
        heal_hopeless: false,
        routine: None,
    };
    p.observe();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The idle tail check's replay, beside live processing (issue 37 item 4).
    let mut routine: Option<tokio::task::JoinHandle<RoutineReplies>> = None;
    loop {
        let start = tokio::select! {
            m = rx.recv() => match m {
                Some((epoch, msg, permit)) => {
                    queued.fetch_sub(message_bytes(&msg), Ordering::Relaxed);
                    p.on_message(epoch, msg).await;
                    // Applied (or dropped): its charge goes back to the node's budget.
                    drop(permit);
                    None
                }
                None => {
                    if let Some(t) = routine.take() {
                        t.abort();
                    }
                    return;
                }
            },
            r = join_routine(&mut routine), if routine.is_some() => {
                routine = None;
                let r = r.unwrap_or_else(|e| Err(ReplayError::Socket(format!("tail check task: {e}"))));
                p.on_routine_done(r).await;
                None
            }
            _ = p.shared.link_changed.notified() => p.on_tick(rx.is_empty()).await,
            _ = tick.tick() => p.on_tick(rx.is_empty()).await,
        };
        if let Some((ep, anchor)) = start {
            if routine.is_none() {
                p.routine = Some(RoutineCheck {
                    anchor,
                    started: Instant::now(),
                    healing: false,
                });
                routine = Some(tokio::spawn(routine_replay(
                    ep,
                    anchor.0,
                    p.shared.spec.topic.clone(),
                    p.opts.clone(),
                )));
            }
        }
        // Flush on idle: the link is woken once the queue is drained (or the pending ops are
        // large), so a burst of batches leaves as one delta and a lone batch leaves at once.
        p.observe_queue(rx.is_empty());
    }
}

impl Processor {
    fn id(&self) -> &str {
        self.shared.id()
    }

    /// Publishes a coverage change: gauge, transition counter, log, and a wake-up for the link
    /// (a coverage change is sent even without ops).
    fn observe(&mut self) {
        self.observe_queue(true);
    }

    /// [`Processor::observe`] with the flush policy: pending ops wake the link (which sends
    /// them at once, no timer) when `queue_empty` (nothing more is waiting to be applied: flush
    /// on idle), when at least [`FLUSH_KEYS`] keys are pending (flush on size), or when the
    /// coverage changed.
    fn observe_queue(&mut self, queue_empty: bool) {
        let (cov, blocks, orphans, err) = {
            let g = self.shared.lock();
            (
                g.state.coverage(),
                g.state.blocks_held(),
                g.state.orphans(),
                g.stats.last_error.clone(),
            )
        };
        let mut changed = false;
        if self.coverage != Some(cov) {
            let id = self.shared.id();
            self.sink.metrics.set_coverage(id, self.coverage, cov);
            let from = self.coverage.map(|c| c.to_string());
            match (self.coverage, cov.state) {
                (None, _) => tracing::debug!(stream = %id, coverage = %cov, "kv events: coverage"),
                (Some(_), CoverageState::Exact) => {
                    // Recovered: the error that explained the inexact state is history (this
                    // line keeps it).
                    let was = self.shared.lock().stats.last_error.take();
                    tracing::info!(stream = %id, coverage = %cov, from = ?from, blocks, last_error = ?was, "kv events: coverage back to Exact")
                }
                (Some(_), _) => {
                    tracing::warn!(stream = %id, coverage = %cov, from = ?from, blocks, orphans, last_error = ?err, "kv events: stream not exact")
                }
            }
            self.coverage = Some(cov);
            changed = true;
        }
        let flush = {
            let g = self.shared.lock();
            g.state.has_pending()
                && (queue_empty || changed || g.state.pending_keys() >= FLUSH_KEYS)
        };
        if flush {
            self.sink.notify.notify_one();
        }
    }

    /// A replay begins: Healing (a stream Disconnected or not yet verified stays so: only a
    /// verified attach makes it routable, [`Processor::attach_done`]).
    fn begin_healing(&mut self) {
        {
            let mut g = self.shared.lock();
            if g.state.link() == LinkState::Up {
                g.state.set_link(LinkState::Healing);
            }
        }
        self.observe();
    }

    /// A replay ended: Up again after Healing. A stream Disconnected or not yet verified is
    /// left so: the attach decides ([`Processor::attach_done`]).
    fn end_healing(&self) {
        let mut g = self.shared.lock();
        if g.state.link() == LinkState::Healing {
            g.state.set_link(LinkState::Up);
        }
    }

    /// The attach of the current connection is settled (verified, rebuilt, or nothing held to
    /// verify): routable again while the socket is connected.
    fn attach_done(&mut self) {
        self.unverified = None;
        // The idle tail check runs from here even before a live batch arrives (a resumed
        // stream whose replay left a tail unchecked).
        self.last_live.get_or_insert_with(Instant::now);
        let connected = self.shared.connected.load(Ordering::Relaxed);
        let mut g = self.shared.lock();
        if matches!(
            g.state.link(),
            LinkState::Unverified | LinkState::Disconnected | LinkState::Healing
        ) {
            g.state.set_link(if connected {
                LinkState::Up
            } else {
                LinkState::Disconnected
            });
        }
    }

    /// The attach verification failed (or timed out): the stream stays unrouted and the next
    /// attempt is scheduled by the back-off.
    fn attach_failed(&mut self) {
        let retry = self
            .unverified
            .get_or_insert_with(|| AttachRetry::new(&self.opts));
        retry.schedule();
        let wait = retry.next_at.saturating_duration_since(Instant::now());
        let attempts = retry.attempts;
        self.shared.lock().state.set_link(LinkState::Unverified);
        tracing::warn!(stream = %self.id(), retry_in = ?wait, attempts, "kv events: attach verification failed; the replica is not routed until it succeeds");
    }

    fn count_replay(&self, result: &'static str) {
        self.sink
            .metrics
            .replays
            .with_label_values(&[self.id(), result])
            .inc();
        let mut g = self.shared.lock();
        if result == "failed" {
            g.stats.replays_failed += 1;
        } else {
            g.stats.replays += 1;
        }
    }

    fn count_clear(&self, reason: &'static str) {
        self.sink
            .metrics
            .resyncs
            .with_label_values(&[self.id(), reason])
            .inc();
        self.shared.lock().stats.resyncs += 1;
    }

    fn set_error(&self, e: String) {
        self.shared.lock().stats.last_error = Some(e);
    }

    /// Decodes and applies one batch; replayed batches are remembered so their live copies are
    /// skipped.
    fn apply(&mut self, seq: u64, payload: &[u8], live: bool) {
        let digest = xxh3_64(payload);
        if live {
            self.replayed = self.replayed.split_off(&seq.saturating_add(1));
            if self.suspect.take().is_some() {
                // The engine's sequence continued where it was: the held frame was not its.
                self.shared.lock().state.set_suspect(false);
            }
        } else {
            self.sink
                .metrics
                .received
                .with_label_values(&[self.id(), "replay"])
                .inc();
            self.shared.lock().stats.batches_replayed += 1;
            self.replayed.insert(seq, digest);
            while self.replayed.len() > self.opts.replay_max_batches.saturating_mul(2) {
                self.replayed.pop_first();
            }
        }
        apply_payload(&self.shared, &self.sink, seq, payload, digest, live);
        if live {
            timing::mark(Stage::KvApplied, seq);
        }
    }

    fn apply_all(&mut self, replies: &[(u64, Vec<u8>)]) {
        for (s, p) in replies {
            self.apply(*s, p, false);
        }
    }

    async fn on_message(&mut self, epoch: u64, msg: ZmqMessage) {
        let (seq, payload) = match split_live(msg) {
            Ok(x) => x,
            Err(reason) => {
                record_drop(&self.shared, &self.sink, reason, 1);
                return;
            }
        };
        if epoch > self.handled_epoch {
            self.on_attach(epoch).await;
        }
        self.last_live = Some(Instant::now());
        self.tail_checked = false;
        self.on_live(seq, payload).await;
        if self.replay_ep.is_none() {
            self.shared.lock().state.set_tail_unverified(false);
        }
        let drops = self.queue_drops();
        if drops > self.drops_at_last_live {
            // Messages were dropped (queue full, in-flight budget) since the last one applied:
            // what came after this one is not known until the next in-order batch or a tail
            // check — Stale TailUnverified, never a silent miss.
            self.shared.lock().state.set_tail_unverified(true);
        }
        self.drops_at_last_live = drops;
    }

    /// Live messages dropped before the processor saw them (`queue_full`, `inflight_budget`).
    fn queue_drops(&self) -> u64 {
        let g = self.shared.lock();
        ["queue_full", budget::DROP_REASON]
            .iter()
            .filter_map(|r| g.stats.dropped_by_reason.get(r))
            .sum()
    }

    async fn on_live(&mut self, seq: u64, payload: prost::bytes::Bytes) {
        if self.unverified.is_some() {
            // Nothing proves yet which incarnation sent this frame, and a restarted engine's
            // sequence can pass through our last seq + 1: it is not applied. The replay that
            // verifies the attach brings it (or shows another incarnation).
            self.sink
                .metrics
                .ignored
                .with_label_values(&[self.id(), "unverified"])
                .inc();
            return;
        }
        let digest = xxh3_64(&payload);
        for verified in [false, true] {
            if self.replayed.get(&seq) == Some(&digest) {
                self.sink
                    .metrics
                    .ignored
                    .with_label_values(&[self.id(), "replayed"])
                    .inc();
                return;
            }
            if self.shared.lock().state.last_digest() == Some((seq, digest)) {
                // The last frame again, byte for byte (a publisher or relay resend): a
                // duplicate, not a restart — a restarted engine's batch carries another
                // timestamp. (Older seqs are judged by the anchor: a stand-in publisher that
                // replays a recording does send the same bytes again after a restart.)
                self.sink
                    .metrics
                    .ignored
                    .with_label_values(&[self.id(), "duplicate"])
                    .inc();
                tracing::debug!(stream = %self.id(), seq, "kv events: duplicate frame skipped");
                return;
            }
            let check = self.shared.lock().state.check_seq(seq);
            match check {
                SeqCheck::InOrder => {
                    // The batch after the last applied: nothing was lost in between.
                    self.shared.lock().state.set_tail_unverified(false);
                    self.apply(seq, &payload, true);
                    return;
                }
                SeqCheck::First => {
                    if seq == 0 {
                        // A fresh engine: nothing came before.
                        self.shared.lock().state.set_incomplete(None);
                    }
                    self.bootstrap(Some(seq), coverage::BOOTSTRAP_INCOMPLETE)
                        .await;
                    self.apply(seq, &payload, true);
                    return;
                }
                SeqCheck::Gap { from } => {
                    self.on_gap(from, seq, &payload, digest).await;
                    return;
                }
                SeqCheck::Restarted if !verified && self.replay_ep.is_some() => {
                    // Behind what we applied, and not a replayed batch: ask the engine.
                    if self.verify(Check::Behind).await == Verdict::Same {
                        record_drop(&self.shared, &self.sink, "forged_seq", 1);
                        self.count_replay("forged");
                        tracing::warn!(stream = %self.id(), seq, "kv events: a frame behind the engine's own sequence was dropped (the engine still holds the batches we applied)");
                        return;
                    }
                    // The state was reset by the verification (or it failed): classify again.
                }
                SeqCheck::Restarted => {
                    tracing::info!(stream = %self.id(), seq, "kv events: engine restarted (seq went back)");
                    self.shared.lock().state.restart();
                    self.replayed.clear();
                    self.count_clear(CLEAR_ENGINE_RESTARTED);
                    self.bootstrap(Some(seq), coverage::BOOTSTRAP_INCOMPLETE)
                        .await;
                    self.apply(seq, &payload, true);
                    return;
                }
            }
        }
    }

    /// A new connection epoch: verify what we hold, or learn what the engine holds. A stream
    /// holding state reads Disconnected [`coverage::ATTACH_UNVERIFIED`] from here until its
    /// anchored replay succeeds (retried by [`Processor::on_tick`] with back-off).
    async fn on_attach(&mut self, epoch: u64) {
        self.handled_epoch = epoch;
        self.unverified = None;
        let last = self.shared.lock().state.last_digest();
        if let (Some((seq, _)), None) = (last, &self.replay_ep) {
            // Nothing can tell whether the engine restarted while the socket was away: what we
            // hold may include blocks it no longer has. Forget it (Partial SequenceGap).
            tracing::warn!(stream = %self.id(), last_seq = seq, "kv events: publisher reconnected without a replay endpoint to verify it; the replica is cleared");
            self.shared.lock().state.mark_gap(seq);
            self.count_clear(CLEAR_SEQUENCE_GAP);
            self.replayed.clear();
        } else if last.is_some() {
            // Not routed while the engine's incarnation is unproved (a quick reconnect within
            // the disconnect grace included).
            self.shared.lock().state.set_link(LinkState::Unverified);
            self.observe();
            if self.verify(Check::Attach).await == Verdict::Failed {
                self.attach_failed();
                return;
            }
        } else if self.replay_ep.is_some() {
            self.bootstrap(None, coverage::BOOTSTRAP_INCOMPLETE).await;
        } else {
            // No replay: whatever the engine stored before now is unknowable, until a batch at
            // seq 0 shows a fresh engine.
            self.shared
                .lock()
                .state
                .set_incomplete(Some(coverage::BOOTSTRAP_INCOMPLETE));
        }
        self.attach_done();
    }

    /// The periodic work: the disconnect grace, an attach not yet handled, the attach retry,
    /// the heal of a Partial stream, and the idle tail check — returned as `(replay endpoint,
    /// anchor)` for the caller to spawn beside live processing.
    async fn on_tick(&mut self, queue_empty: bool) -> Option<(String, (u64, u64))> {
        let connected = self.shared.connected.load(Ordering::Relaxed);
        if !connected {
            let since = self.shared.disconnected_at_ms.load(Ordering::Relaxed);
            let grace = self.opts.disconnect_grace.as_millis() as i64;
            if since > 0 && now_unix_ms() - since >= grace {
                let mut g = self.shared.lock();
                if matches!(
                    g.state.link(),
                    LinkState::Up | LinkState::Healing | LinkState::Unverified
                ) {
                    g.state.set_link(LinkState::Disconnected);
                }
            }
            return None;
        }
        let epoch = self.shared.epoch.load(Ordering::Relaxed);
        if epoch > self.handled_epoch && queue_empty {
            self.on_attach(epoch).await;
            return None;
        }
        if let Some(retry) = &self.unverified {
            // Live frames are not applied meanwhile, so the queue drains: no need to wait for
            // it to be empty.
            if Instant::now() >= retry.next_at {
                self.last_check = Some(Instant::now());
                if self.verify(Check::Attach).await == Verdict::Failed {
                    self.attach_failed();
                } else {
                    tracing::info!(stream = %self.id(), "kv events: attach verified after a retry");
                    self.attach_done();
                }
            }
            return None;
        }
        if let Some(r) = &mut self.routine {
            if !r.healing && r.started.elapsed() >= self.opts.routine_check_healing_after {
                r.healing = true;
                self.begin_healing();
            }
            return None;
        }
        if queue_empty && self.heal_due() {
            self.heal_now().await;
            return None;
        }
        let last = self.last_live?;
        if !queue_empty {
            return None;
        }
        let tail_unverified = self.shared.lock().state.tail_unverified();
        let due = if self.tail_checked {
            let every = if tail_unverified {
                self.opts.tail_retry_interval
            } else {
                self.opts.idle_verify_interval
            };
            self.last_check.is_some_and(|t| t.elapsed() >= every)
        } else {
            last.elapsed() >= self.opts.idle_verify_after
        };
        if !due {
            return None;
        }
        self.tail_checked = true;
        self.last_check = Some(Instant::now());
        if let Some(ep) = self.replay_ep.clone() {
            let anchor = self.shared.lock().state.last_digest()?;
            return Some((ep, anchor));
        } else if self.queue_drops() > self.drops_at_last_live {
            // We dropped messages after the last one we applied and cannot ask for them.
            self.shared.lock().state.set_tail_unverified(true);
        }
        None
    }

    /// The idle tail check's replay came back. Used only if the stream is still at the anchor
    /// it started from (a live batch applied meanwhile settled the tail itself, and a replay
    /// of the processor's own — a gap, an attach — decided more recently).
    async fn on_routine_done(&mut self, r: RoutineReplies) {
        let Some(check) = self.routine.take() else {
            return;
        };
        let current = self.shared.lock().state.last_digest();
        if let Err(ReplayError::PeerDropped(d)) = &r {
            record_peer_drop(&self.shared, &self.sink, "replay", *d);
        }
        let moved_on = self.unverified.is_some()
            || current != Some(check.anchor)
            || self.shared.epoch.load(Ordering::Relaxed) > self.handled_epoch;
        if moved_on {
            self.end_healing();
            return;
        }
        let (last, digest) = check.anchor;
        let anchored = match r {
            Ok((replies, older)) => Ok((last, judge_anchor(last, digest, replies, older))),
            Err(ReplayError::Unterminated(replies)) => {
                Ok((last, cut(judge_anchor(last, digest, replies, None))))
            }
            Err(e) => Err(e),
        };
        if let Some(ep) = self.replay_ep.clone() {
            self.settle(Check::Routine, &ep, anchored).await;
        }
        self.end_healing();
    }
}

/// Why [`Processor::verify`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// A new connection of a stream holding state: nothing is routed until it succeeds.
    Attach,
    /// A live frame behind the last applied seq that is not a replayed batch.
    Behind,
    /// The idle tail check.
    Routine,
}

/// The retry schedule of a failed attach verification: capped exponential back-off with
/// jitter ([`SubscriberOptions::attach_retry_initial`] doubling to
/// [`SubscriberOptions::attach_retry_max`]), never exhausted.
struct AttachRetry {
    delays: backon::ExponentialBackoff,
    /// When the next attempt is due.
    next_at: Instant,
    /// Failed attempts so far.
    attempts: u32,
    max: Duration,
}

impl AttachRetry {
    fn new(opts: &SubscriberOptions) -> Self {
        use backon::BackoffBuilder;
        let max = opts.attach_retry_max.max(opts.attach_retry_initial);
        AttachRetry {
            delays: backon::ExponentialBuilder::default()
                .with_min_delay(opts.attach_retry_initial)
                .with_max_delay(max)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
            next_at: Instant::now(),
            attempts: 0,
            max,
        }
    }

    /// Records a failed attempt and schedules the next.
    fn schedule(&mut self) {
        self.attempts = self.attempts.saturating_add(1);
        let wait = self.delays.next().unwrap_or(self.max);
        self.next_at = Instant::now() + wait;
    }
}

/// What [`Processor::verify`] found.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Same incarnation; any lost tail applied.
    Same,
    /// The replica was cleared and rebuilt (another incarnation, holes, an unverifiable anchor).
    Reset,
    /// No replay endpoint, or the replay failed.
    Failed,
}

/// Decodes and applies one batch, recording metrics. The batch's `digest` (the replay anchor)
/// is recorded under the same lock as its effects, so a state saved at any moment names the
/// batch it reflects. `live` batches (not replayed ones) set the stream-lag gauge.
fn apply_payload(
    shared: &StreamShared,
    sink: &Sink,
    seq: u64,
    payload: &[u8],
    digest: u64,
    live: bool,
) {
    let id = shared.id();
    match decode_batch(payload) {
        Ok(batch) => {
            sink.metrics.decoded.with_label_values(&[id]).inc();
            if live && batch.ts.is_finite() && batch.ts > 0.0 {
                let now = now_unix_ms();
                let (skew, was) = {
                    let mut g = shared.lock();
                    let was = g.stats.clock.flagged;
                    let skew = g.stats.clock.observe(now, batch.ts);
                    g.stats.clock.flagged = skew.abs() > CLOCK_SKEW_FLAG_SECONDS;
                    (skew, was)
                };
                let flagged = skew.abs() > CLOCK_SKEW_FLAG_SECONDS;
                if flagged && !was {
                    tracing::warn!(stream = %id, skew_seconds = skew, "kv events: the engine's clock is {skew:.1} s off the agent's (positive: ahead); the stream lag leaves it out — check the engine node's time sync");
                } else if was && !flagged {
                    tracing::info!(stream = %id, skew_seconds = skew, "kv events: the engine's clock agrees with the agent's again");
                }
                sink.metrics.clock_skew.with_label_values(&[id]).set(skew);
                sink.metrics
                    .lag
                    .with_label_values(&[id])
                    .set(corrected_lag(now, batch.ts, skew));
            }
            let (report, held) = {
                let mut g = shared.lock();
                let report = g.state.apply(seq, &batch, now_unix_ms());
                g.state.record_digest(seq, digest);
                g.stats.batches_decoded += 1;
                g.stats.events_decoded += batch.events.len() as u64;
                if batch.data_parallel_rank.is_some() {
                    g.stats.reported_dp_rank = batch.data_parallel_rank;
                }
                let cleared = report.events.get("AllBlocksCleared");
                g.stats.resyncs += cleared;
                (report, g.state.blocks_held())
            };
            record_report(shared, sink, &report);
            sink.metrics
                .blocks
                .with_label_values(&[id])
                .set(held as i64);
        }
        Err(e) => {
            {
                let mut g = shared.lock();
                g.state.note_undecodable(seq);
                g.state.record_digest(seq, digest);
            }
            record_drop(shared, sink, e.reason(), 1);
        }
    }
}

fn record_report(shared: &StreamShared, sink: &Sink, r: &ApplyReport) {
    let id = shared.id();
    for (t, n) in &r.events.0 {
        sink.metrics.events.with_label_values(&[id, t]).inc_by(*n);
        if *t == "AllBlocksCleared" {
            sink.metrics
                .resyncs
                .with_label_values(&[id, "AllBlocksCleared"])
                .inc_by(*n);
        }
    }
    for (reason, n) in &r.dropped.0 {
        record_drop(shared, sink, reason, *n);
    }
    for (reason, n) in &r.ignored.0 {
        sink.metrics
            .ignored
            .with_label_values(&[id, reason])
            .inc_by(*n);
    }
}
