//! How the processor verifies and heals by anchored replay: gap fill, attach and tail checks,
//! holes narrowed, rebuild from seq 0 and bootstrap (rules in the [`super::super`] docs).

use std::time::Instant;

use ic_shared::kv::coverage::{self};
use xxhash_rust::xxh3::xxh3_64;

use super::super::super::stream::{
    LinkState, CLEAR_ENGINE_RESTARTED, CLEAR_REBUILT, CLEAR_REPLAY_TRUNCATED, CLEAR_SEQUENCE_GAP,
};
use super::super::reader::record_peer_drop;
use super::super::record_drop;
use super::super::replay::{
    classify_run, contiguous_len, cut, judge_anchor, request_replay, tail_run, Anchored,
    ReplayError, Run,
};
use super::{AttachRetry, Check, Processor, Verdict};

impl Processor {
    /// Whether a heal try is due: the stream is Partial for an incomplete history that a full
    /// replay from seq 0 could make whole, and its back-off has passed.
    pub(super) fn heal_due(&mut self) -> bool {
        let (incomplete, link) = {
            let g = self.shared.lock();
            (g.state.incomplete(), g.state.link())
        };
        let healable = matches!(
            incomplete,
            Some(
                coverage::BOOTSTRAP_INCOMPLETE
                    | coverage::REPLAY_TRUNCATED
                    | coverage::SEQUENCE_GAP
            )
        );
        if !healable {
            self.heal = None;
            self.heal_hopeless = false;
            return false;
        }
        if self.heal_hopeless
            || self.replay_ep.is_none()
            || !self.opts.bootstrap_replay
            || link != LinkState::Up
        {
            return false;
        }
        let opts = &self.opts;
        let heal = self.heal.get_or_insert_with(|| {
            let mut h = AttachRetry::new(opts);
            h.schedule();
            h.attempts = 0;
            h
        });
        Instant::now() >= heal.next_at
    }

    /// One heal try: a full replay from seq 0. Complete (from 0, no holes) → the replica is
    /// rebuilt from it and Exact (`replays_total{result="healed"}`); holes or a failure → tried
    /// again with back-off; a buffer that starts after 0, holds nothing, or is more than a
    /// replay accepts → no more tries for this incarnation.
    pub(super) async fn heal_now(&mut self) {
        let Some(ep) = self.replay_ep.clone() else {
            return;
        };
        let reason = self.shared.lock().state.incomplete();
        let replies = self.replay(&ep, 0, u64::MAX, &self.shared.spec.topic).await;
        let retry = |p: &mut Self| {
            if let Some(h) = &mut p.heal {
                h.schedule();
            }
        };
        match replies {
            Err(
                e @ (ReplayError::TooMany(_)
                | ReplayError::TooLarge(_)
                | ReplayError::TopicMismatch { .. }),
            ) => {
                tracing::info!(stream = %self.id(), error = %e, "kv events: the engine's buffer cannot heal the replica");
                self.heal_hopeless = true;
            }
            Err(e) => {
                self.count_replay("failed");
                self.set_error(format!("heal replay from 0: {e}"));
                retry(self);
            }
            Ok(r) => {
                let (start, holes) = tail_run(&r, None);
                let complete =
                    start == Some(0) && !holes && r.first().is_some_and(|(s, _)| *s == 0);
                if complete {
                    {
                        let mut g = self.shared.lock();
                        g.state.start_over(CLEAR_REBUILT);
                    }
                    self.replayed.clear();
                    self.suspect = None;
                    self.apply_all(&r);
                    self.count_replay("healed");
                    self.heal = None;
                    tracing::info!(stream = %self.id(), was = ?reason, batches = r.len(), "kv events: replica rebuilt from a complete replay of the engine's buffer");
                } else if holes {
                    retry(self);
                } else {
                    tracing::info!(stream = %self.id(), was = ?reason, first = ?r.first().map(|(s, _)| *s), "kv events: the engine's buffer no longer starts at seq 0; the replica stays Partial until its cache is known again");
                    self.heal_hopeless = true;
                }
            }
        }
    }

    /// [`request_replay`] with this stream's options; a replay peer dropped by the guard is
    /// counted and logged.
    pub(super) async fn replay(
        &self,
        ep: &str,
        start: u64,
        upto: u64,
        topic: &str,
    ) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
        let r = request_replay(ep, start, upto, topic, &self.opts).await;
        if let Err(ReplayError::PeerDropped(d)) = &r {
            record_peer_drop(&self.shared, &self.sink, "replay", *d);
        }
        r
    }

    /// Replays from our last applied seq and checks the anchor (see [`Anchored`]).
    pub(super) async fn anchored_replay(
        &self,
        ep: &str,
        upto: Option<u64>,
    ) -> Result<(u64, Anchored), ReplayError> {
        let Some((last, digest)) = self.shared.lock().state.last_digest() else {
            return Ok((0, Anchored::Unverifiable));
        };
        let topic = &self.shared.spec.topic;
        let replies = match self.replay(ep, last, upto.unwrap_or(u64::MAX), topic).await {
            Ok(r) => r,
            Err(ReplayError::Unterminated(r)) => {
                return Ok((last, cut(judge_anchor(last, digest, r, None))));
            }
            Err(e) => return Err(e),
        };
        let older = if replies.is_empty() {
            Some(!self.replay(ep, 0, last, topic).await?.is_empty())
        } else {
            None
        };
        Ok((last, judge_anchor(last, digest, replies, older)))
    }

    /// Holes in a replay after a verified anchor, or a replay cut short (vLLM < 0.33 loses
    /// replies past its ROUTER's send high-water mark): applies the contiguous run after `last`
    /// and asks again from the new anchor, up to 3 times while that makes progress. Returns the
    /// last answer with its anchor: the caller classifies it again (holes may be left).
    pub(super) async fn narrow_holes(
        &mut self,
        ep: &str,
        mut last: u64,
        mut a: Anchored,
        upto: Option<u64>,
    ) -> (u64, Anchored) {
        for _ in 0..3 {
            let (mut rest, was_cut) = match std::mem::replace(&mut a, Anchored::Silent) {
                Anchored::Cut(r) => (r, true),
                Anchored::Same(r) if classify_run(last + 1, &r, upto) == Run::Holes => (r, false),
                other => {
                    a = other;
                    break;
                }
            };
            let n = contiguous_len(last + 1, &rest);
            if n == 0 {
                a = if was_cut {
                    Anchored::Cut(rest)
                } else {
                    Anchored::Same(rest)
                };
                break;
            }
            rest.truncate(n);
            self.apply_all(&rest);
            let applied = last + n as u64;
            match self.anchored_replay(ep, upto).await {
                Ok((l, next @ (Anchored::Same(_) | Anchored::Cut(_)))) => {
                    last = l;
                    a = next;
                }
                _ => return (applied, Anchored::Cut(Vec::new())),
            }
        }
        (last, a)
    }

    /// Checks the engine's tail (and incarnation) by an anchored replay. A
    /// [`Check::Routine`] (idle check) does not show Healing; a [`Check::Attach`] is bounded by
    /// [`SubscriberOptions::attach_verify_deadline`] and leaves the link as it is (the caller
    /// decides). Returns what it found.
    pub(super) async fn verify(&mut self, check: Check) -> Verdict {
        let Some(ep) = self.replay_ep.clone() else {
            return Verdict::Failed;
        };
        if check != Check::Routine {
            self.begin_healing();
        }
        let anchored = if check == Check::Attach {
            // The replay itself stops at the attach deadline and keeps what it received (a
            // verified anchor and the run after it are progress, not thrown away); the outer
            // bound only guards a second request.
            let saved = self.opts.replay_deadline;
            self.opts.replay_deadline = saved.min(self.opts.attach_verify_deadline);
            let r = match tokio::time::timeout(
                self.opts.attach_verify_deadline + self.opts.replay_timeout,
                self.anchored_replay(&ep, None),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(ReplayError::Timeout),
            };
            self.opts.replay_deadline = saved;
            r
        } else {
            self.anchored_replay(&ep, None).await
        };
        let verdict = self.settle(check, &ep, anchored).await;
        self.end_healing();
        verdict
    }

    /// Acts on an anchored replay's answer (see [`Processor::verify`]).
    pub(super) async fn settle(
        &mut self,
        check: Check,
        ep: &str,
        anchored: Result<(u64, Anchored), ReplayError>,
    ) -> Verdict {
        match anchored {
            Ok((last, a @ (Anchored::Same(_) | Anchored::Cut(_)))) => {
                match self.narrow_holes(ep, last, a, None).await {
                    (last, Anchored::Cut(rest)) => self.settle_same(last, rest, true),
                    (last, Anchored::Same(rest)) => self.settle_same(last, rest, false),
                    // narrow_holes answers Same or Cut only.
                    (last, _) => self.settle_same(last, Vec::new(), true),
                }
            }
            Ok((last, Anchored::Other)) => {
                tracing::warn!(stream = %self.id(), last_seq = last, "kv events: the engine no longer holds the batches we applied: it restarted");
                self.shared.lock().state.restart();
                self.replayed.clear();
                self.count_clear(CLEAR_ENGINE_RESTARTED);
                self.count_replay("restart_detected");
                self.bootstrap(None, coverage::BOOTSTRAP_INCOMPLETE).await;
                Verdict::Reset
            }
            Ok((last, Anchored::Unverifiable)) => {
                tracing::warn!(stream = %self.id(), last_seq = last, "kv events: the engine's replay buffer starts after our last batch; rebuilding the replica");
                self.shared.lock().state.clear(CLEAR_SEQUENCE_GAP);
                self.count_clear(CLEAR_SEQUENCE_GAP);
                self.replayed.clear();
                self.bootstrap(None, coverage::SEQUENCE_GAP).await;
                Verdict::Reset
            }
            Ok((last, Anchored::Silent)) if check == Check::Attach => {
                // The engine's replay holds nothing at all: a restarted engine that has published
                // nothing yet, or a buffer that is off. Neither can vouch for what we hold, and
                // waiting proves nothing: forget it, as without a replay endpoint.
                self.count_replay("failed");
                self.set_error(
                    "attach: the engine's replay buffer is empty; the replica is cleared".into(),
                );
                tracing::warn!(stream = %self.id(), last_seq = last, "kv events: the engine's replay buffer is empty on attach: nothing can verify the replica; it is cleared");
                self.shared.lock().state.mark_gap(last);
                self.count_clear(CLEAR_SEQUENCE_GAP);
                self.replayed.clear();
                Verdict::Reset
            }
            Ok((_, Anchored::Silent)) => {
                // The engine's buffer is off or empty: no check can ever succeed, so only a
                // loss we saw ourselves (the queue's drops) makes the tail unverified — as
                // without a replay endpoint.
                self.count_replay("failed");
                self.set_error("tail check: the engine's replay buffer is empty".into());
                let lost = self.queue_drops() > self.drops_at_last_live;
                self.shared.lock().state.set_tail_unverified(lost);
                Verdict::Failed
            }
            Err(e) if check == Check::Attach => {
                self.count_replay("failed");
                self.set_error(format!("attach verification: {e}"));
                Verdict::Failed
            }
            Err(e) => {
                self.count_replay("failed");
                self.set_error(format!("tail check: {e}"));
                self.shared.lock().state.set_tail_unverified(true);
                Verdict::Failed
            }
        }
    }

    /// A replay from a verified anchor `last`: applies the contiguous run of `rest`; what is
    /// left after a hole is a tail still to check (Stale `TailUnverified`, checked again within
    /// [`SubscriberOptions::tail_retry_interval`]) — the verified state is kept, never rebuilt
    /// for holes.
    pub(super) fn settle_same(
        &mut self,
        last: u64,
        rest: Vec<(u64, Vec<u8>)>,
        cut: bool,
    ) -> Verdict {
        let n = contiguous_len(last + 1, &rest);
        if n > 0 {
            tracing::info!(stream = %self.id(), from = last + 1, batches = n, "kv events: lost tail recovered by replay");
        }
        self.apply_all(&rest[..n]);
        if n < rest.len() || cut {
            tracing::warn!(stream = %self.id(), after = last + n as u64, "kv events: replay came back with holes (or cut short); the rest is checked again");
            self.count_replay("truncated");
            self.set_error(format!(
                "replay from {last}: holes after seq {}",
                last + n as u64
            ));
            self.shared.lock().state.set_tail_unverified(true);
        } else {
            self.count_replay("verified");
            self.shared.lock().state.set_tail_unverified(false);
        }
        Verdict::Same
    }

    /// A gap `from..seq` before live batch `seq`.
    pub(super) async fn on_gap(&mut self, from: u64, seq: u64, payload: &[u8], digest: u64) {
        tracing::info!(stream = %self.id(), from, to = seq, "kv events: sequence gap");
        self.sink.metrics.gaps.with_label_values(&[self.id()]).inc();
        self.shared.lock().stats.gaps += 1;
        let Some(ep) = self.replay_ep.clone() else {
            self.gap_without_replay(from, seq, payload);
            return;
        };
        self.begin_healing();
        let anchored = match self.anchored_replay(&ep, Some(seq)).await {
            Ok((last, a @ (Anchored::Same(_) | Anchored::Cut(_)))) => {
                // Still cut short after narrowing: a failed replay (cleared; healed later).
                Ok(self.narrow_holes(&ep, last, a, Some(seq)).await)
            }
            other => other,
        };
        match anchored {
            Ok((last, Anchored::Same(rest))) => match classify_run(last + 1, &rest, Some(seq)) {
                Run::Complete => {
                    self.shared.lock().state.set_tail_unverified(false);
                    self.apply_all(&rest);
                    self.count_replay("healed");
                    self.apply(seq, payload, true);
                }
                Run::EndedEarly => {
                    if self.engine_sent(&ep, seq, digest).await {
                        // The engine has the frame but its replay stopped short: truncated.
                        self.rebuild(Some(seq)).await;
                        self.apply(seq, payload, true);
                    } else {
                        self.apply_all(&rest);
                        record_drop(&self.shared, &self.sink, "forged_seq", 1);
                        self.count_replay("forged");
                        tracing::warn!(stream = %self.id(), seq, "kv events: a frame whose seq the engine never sent was dropped");
                    }
                }
                Run::Holes => {
                    tracing::warn!(stream = %self.id(), from, to = seq, "kv events: gap replay came back with holes; rebuilding the replica");
                    self.rebuild(Some(seq)).await;
                    self.apply(seq, payload, true);
                }
            },
            Ok((_, Anchored::Other)) => {
                tracing::warn!(stream = %self.id(), seq, "kv events: the gap hides an engine restart (its replay shows another incarnation)");
                self.shared.lock().state.restart();
                self.replayed.clear();
                self.count_clear(CLEAR_ENGINE_RESTARTED);
                self.count_replay("restart_detected");
                self.bootstrap(Some(seq), coverage::BOOTSTRAP_INCOMPLETE)
                    .await;
                self.apply(seq, payload, true);
            }
            Ok((_, Anchored::Unverifiable)) => {
                tracing::warn!(stream = %self.id(), from, to = seq, "kv events: the gap reaches past the engine's replay buffer; rebuilding the replica");
                self.shared.lock().state.clear(CLEAR_SEQUENCE_GAP);
                self.count_clear(CLEAR_SEQUENCE_GAP);
                self.replayed.clear();
                self.bootstrap(Some(seq), coverage::SEQUENCE_GAP).await;
                self.apply(seq, payload, true);
            }
            Ok((_, Anchored::Silent)) => {
                self.count_replay("failed");
                self.set_error(format!(
                    "replay from {from}: the engine's replay buffer is empty"
                ));
                tracing::warn!(stream = %self.id(), from, to = seq, "kv events: gap replay came back empty; the replica is cleared");
                self.shared.lock().state.mark_gap(seq);
                self.count_clear(CLEAR_SEQUENCE_GAP);
                self.apply(seq, payload, true);
            }
            Ok((_, Anchored::Cut(r))) => {
                self.gap_replay_failed(from, seq, payload, ReplayError::Unterminated(r));
            }
            Err(e) => self.gap_replay_failed(from, seq, payload, e),
        }
        self.end_healing();
    }

    /// A gap replay failed: the replica is cleared (Partial `SequenceGap`, healed by a full
    /// replay once the engine answers again) and batch `seq` applied.
    pub(super) fn gap_replay_failed(
        &mut self,
        from: u64,
        seq: u64,
        payload: &[u8],
        e: ReplayError,
    ) {
        self.count_replay("failed");
        self.set_error(format!("replay from {from}: {e}"));
        tracing::warn!(stream = %self.id(), from, to = seq, error = %e, "kv events: gap replay failed; the replica is cleared");
        self.shared.lock().state.mark_gap(seq);
        self.count_clear(CLEAR_SEQUENCE_GAP);
        self.apply(seq, payload, true);
    }

    /// Whether the engine's replay holds batch `seq` with this digest.
    pub(super) async fn engine_sent(&self, ep: &str, seq: u64, digest: u64) -> bool {
        match self
            .replay(ep, seq, seq.saturating_add(1), &self.shared.spec.topic)
            .await
        {
            Ok(r) => r
                .first()
                .is_some_and(|(s, p)| *s == seq && xxh3_64(p) == digest),
            Err(_) => true,
        }
    }

    pub(super) fn gap_without_replay(&mut self, from: u64, seq: u64, payload: &[u8]) {
        let mut confirmed = false;
        if let Some(held) = self.suspect {
            if held.checked_add(1) == Some(seq) {
                // The engine's sequence really moved there: a gap after all.
                self.suspect = None;
                self.shared.lock().state.set_suspect(false);
                confirmed = true;
            }
        }
        let jump = seq - from;
        if !confirmed && self.suspect.is_none() && jump > self.opts.suspicious_seq_jump {
            self.suspect = Some(seq);
            self.shared.lock().state.set_suspect(true);
            record_drop(&self.shared, &self.sink, "forged_seq", 1);
            tracing::warn!(stream = %self.id(), seq, expected = from, "kv events: implausible sequence jump held back until the next frame confirms it");
            return;
        }
        if self.suspect == Some(seq) {
            return;
        }
        self.shared.lock().state.mark_gap(seq);
        self.count_clear(CLEAR_SEQUENCE_GAP);
        tracing::warn!(stream = %self.id(), from, to = seq, "kv events: gap without a replay endpoint; the replica is cleared");
        self.apply(seq, payload, true);
    }

    /// A replay had holes: clear and rebuild from seq 0 (exact while the engine's buffer still
    /// holds it).
    pub(super) async fn rebuild(&mut self, upto: Option<u64>) {
        self.count_replay("truncated");
        self.shared.lock().state.clear(CLEAR_REPLAY_TRUNCATED);
        self.count_clear(CLEAR_REPLAY_TRUNCATED);
        self.replayed.clear();
        self.bootstrap(upto, coverage::REPLAY_TRUNCATED).await;
    }

    /// Learns what the engine stored before `upto` (`None`: everything its buffer holds) by a
    /// replay from seq 0. Complete (from 0, no holes) keeps the stream exact; otherwise the
    /// contiguous run that connects to `upto` is applied and the stream is marked incomplete
    /// (`BootstrapIncomplete` when the buffer starts after 0, `holes_reason` when it had holes —
    /// tried twice, since vLLM < 0.33 truncates under load).
    pub(super) async fn bootstrap(&mut self, upto: Option<u64>, holes_reason: &'static str) {
        let Some(ep) = self.replay_ep.clone() else {
            if upto != Some(0) {
                self.shared
                    .lock()
                    .state
                    .set_incomplete(Some(coverage::BOOTSTRAP_INCOMPLETE));
            }
            return;
        };
        if upto == Some(0) {
            return;
        }
        if !self.opts.bootstrap_replay {
            self.shared
                .lock()
                .state
                .set_incomplete(Some(coverage::BOOTSTRAP_INCOMPLETE));
            return;
        }
        self.begin_healing();
        // Until the replay proves complete, the stream is incomplete: a state saved (or an
        // agent stopped) while it is in flight must not read Exact.
        let before = {
            let mut g = self.shared.lock();
            let before = g.state.incomplete();
            g.state.set_incomplete(Some(holes_reason));
            before
        };
        for attempt in 0..2 {
            let replies = match self
                .replay(&ep, 0, upto.unwrap_or(u64::MAX), &self.shared.spec.topic)
                .await
            {
                Ok(r) => r,
                Err(e) => {
                    // A topic mismatch: nothing live will ever pass the filter, so nothing is
                    // indexed, and the reason says why.
                    let (reason, what) = match e {
                        ReplayError::TopicMismatch { .. } => (
                            coverage::TOPIC_MISMATCH,
                            "the plan's topic does not match the engine's; no live event reaches this stream",
                        ),
                        _ => (
                            coverage::BOOTSTRAP_INCOMPLETE,
                            "bootstrap replay failed; blocks stored before now are unknown",
                        ),
                    };
                    self.count_replay("failed");
                    self.set_error(format!("bootstrap replay: {e}"));
                    tracing::warn!(stream = %self.id(), error = %e, "kv events: {what}");
                    self.shared.lock().state.set_incomplete(Some(reason));
                    break;
                }
            };
            let (start, holes) = tail_run(&replies, upto);
            let complete = match start {
                Some(0) => !holes && replies.first().is_some_and(|(s, _)| *s == 0),
                Some(_) => false,
                None => replies.is_empty() && upto.is_none(),
            };
            if complete {
                self.apply_all(&replies);
                self.shared.lock().state.set_incomplete(before);
                self.count_replay("bootstrap");
                break;
            }
            if holes && attempt == 0 {
                continue;
            }
            let first = replies.first().map(|(s, _)| *s);
            let reason = if holes {
                holes_reason
            } else {
                coverage::BOOTSTRAP_INCOMPLETE
            };
            self.shared.lock().state.set_incomplete(Some(reason));
            if let Some(i) = start {
                let run: Vec<_> = replies.into_iter().skip(i).collect();
                self.apply_all(&run);
            }
            self.count_replay("bootstrap_incomplete");
            let msg = format!(
                "bootstrap replay incomplete ({reason}): the engine's buffer starts at seq {first:?}{}",
                if holes { ", with holes" } else { "" }
            );
            tracing::warn!(stream = %self.id(), "kv events: {msg}; blocks stored before it are unknown");
            self.set_error(msg);
            self.shared.lock().state.set_incomplete(Some(reason));
            break;
        }
        self.end_healing();
    }
}
