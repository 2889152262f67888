//! One accepted `AgentService.Connect` stream after its Hello: the session of a node agent or
//! a per-pod subscriber. Its read loop (waiting for and holding a resync turn, handing the
//! turn on after `--resync-turn-idle-ms` of silence, the chunk gap), the handling of each
//! message (resyncs and their chunks, delta batches, counters, check reports), its end (the
//! final status to the agent) and the disconnect bookkeeping. How a resync is applied lives
//! in [`resync`].

mod resync;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::proto::{self, agent_message::Msg, controller_message, ControllerMessage};
use ic_shared::timing::{self, Stage};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};
use tracing::{info, warn};

use super::registry::StreamTicket;
use super::{auth, heartbeat, scope, superseded_status, turns};
use crate::state::{now_unix_ms, Shared, WriteHold};

/// Runs the session of a stream whose Hello was accepted until the stream ends, then marks
/// its reporter disconnected (the task [`super::AgentIngest`]'s `connect` spawns). `tx` is the
/// stream's outbound half, `heard` its reporter's heartbeat cell, `inbound` the rest of the
/// stream after the Hello.
pub(super) async fn run(
    shared: Arc<Shared>,
    ticket: StreamTicket,
    tx: mpsc::Sender<Result<ControllerMessage, Status>>,
    heard: Arc<crate::index::Heard>,
    mut inbound: Streaming<proto::AgentMessage>,
) {
    let mut session = Session {
        shared: shared.clone(),
        ticket: ticket.clone(),
        tx,
        awaiting_resync: false,
        owned: HashSet::new(),
        chunks: ic_shared::resync::ResyncAssembler::new(shared.policy.resync_entries()),
        chunk_streams: HashSet::new(),
        turn: None,
        handed_on: None,
        opening_pending: true,
        heard,
        heard_paused: false,
        heartbeat_warned: false,
    };
    let mut stopping = shared.stopping.subscribe();
    let end = loop {
        if session.turn.is_none() {
            session.resume_heard();
        }
        // The opening resync follows Hello: wait for a turn before reading it, so a
        // waiting agent's resync stays in its connection's flow-control window.
        // (Not after a turn was handed on for want of a message: the next one takes it.)
        if session.opening_pending && session.turn.is_none() && session.handed_on.is_none() {
            if let Err(e) = session.take_turn().await {
                break session.finish(e).await;
            }
        }
        // Holding a turn, the stream may be silent for `turn_idle` only: then the turn
        // goes to the next session (one staller cannot delay the others by the whole
        // gap, issue 38 item 8); a resync in flight still ends `chunk_gap` after its
        // last message.
        let gap = shared.resync_turns.chunk_gap();
        let wait = if session.turn.is_some() {
            Some(shared.resync_turns.turn_idle().min(gap))
        } else {
            session.handed_on.map(|at| gap.saturating_sub(at.elapsed()))
        };
        tokio::select! {
            msg = next_message(&mut inbound, wait) => match msg {
                None if session.turn.is_some() => {
                    let idle_ms = shared.resync_turns.turn_idle().min(gap).as_millis() as u64;
                    info!(node = %session.ticket.node, idle_ms, "no resync message while holding a resync turn; handing the turn on");
                    session.turn = None;
                    session.handed_on = Some(
                        tokio::time::Instant::now()
                            .checked_sub(shared.resync_turns.turn_idle().min(gap))
                            .unwrap_or_else(tokio::time::Instant::now),
                    );
                    continue;
                }
                None => {
                    let gap_ms = gap.as_millis() as u64;
                    warn!(node = %session.ticket.node, gap_ms, "no resync message within the gap; closing the stream");
                    let _ = session.tx.try_send(Err(Status::deadline_exceeded(format!(
                        "the controller waited {gap_ms} ms for the next message of this stream's resync (its resync turn was handed on meanwhile); reconnect and resend it"
                    ))));
                    break "resync stalled";
                }
                Some(Ok(Some(msg))) => {
                    session.handed_on = None;
                    if let Err(e) = session.handle(msg).await {
                        break session.finish(e).await;
                    }
                }
                Some(Ok(None)) => break "agent closed the stream",
                Some(Err(e)) => {
                    // Tell the agent why (e.g. a message above the size limit), so
                    // the stream never ends "OK" with nothing applied.
                    warn!(node = %session.ticket.node, error = %e, "agent stream failed");
                    let _ = session.tx.try_send(Err(Status::new(e.code(), e.message().to_string())));
                    break "stream error";
                }
            },
            _ = async { stopping.wait_for(|s| *s).await.map(|_| ()) } => {
                break session.finish(SessionEnd::ShuttingDown).await;
            }
        }
    };
    {
        let mut nodes = shared.nodes.lock();
        if nodes.is_current(&ticket) {
            let mut ix = shared.index_write(WriteHold::Disconnect);
            ix.mark_node_unreported(&ticket.node);
            shared.update_index_gauges(&ix);
            // Host-tier readings are current ones only: none without the connection.
            shared.host_tier.write().forget_reporter(&ticket.node);
            drop(ix);
        }
        if nodes.disconnect(&ticket, now_unix_ms()) {
            match &ticket.scope {
                Some(s) => {
                    info!(pod = %s.pod_ref(), node = %s.node, why = end, "pod subscriber disconnected")
                }
                None => info!(node = %ticket.node, why = end, "agent disconnected"),
            }
        }
        shared
            .metrics
            .agents_connected
            .set(nodes.connected_count() as i64);
    }
    if ticket.scope.is_none() {
        shared.notify_node_change();
    }
}

/// The next message of `inbound`; `None` when nothing arrived within `gap` (set while the
/// session holds a resync turn, [`turns::RESYNC_CHUNK_GAP`]).
async fn next_message(
    inbound: &mut Streaming<proto::AgentMessage>,
    gap: Option<Duration>,
) -> Option<Result<Option<proto::AgentMessage>, Status>> {
    match gap {
        Some(gap) => tokio::time::timeout(gap, inbound.message()).await.ok(),
        None => Some(inbound.message().await),
    }
}

/// Why [`Session::handle`] ends a stream.
enum SessionEnd {
    /// The outbound half is gone.
    Closed,
    /// A newer stream of the same node (or pod) took over.
    Superseded,
    /// A resync exceeded `--max-resync-entries`, or a chunked one `--max-streams-per-reporter`.
    TooLarge(String),
    /// A subscriber reported a stream outside its pod.
    Refused(auth::AuthError),
    /// The controller is shutting down.
    ShuttingDown,
}

/// One open agent stream.
struct Session {
    shared: Arc<Shared>,
    ticket: StreamTicket,
    tx: mpsc::Sender<Result<ControllerMessage, Status>>,
    awaiting_resync: bool,
    /// Stream ids of this connection's last applied `Resync`: the streams it may report
    /// counters for.
    owned: HashSet<String>,
    /// A chunked resync being put back together (at most `--max-resync-entries` entries).
    chunks: ic_shared::resync::ResyncAssembler,
    /// The distinct stream ids of the chunked resync in [`Self::chunks`]: at most
    /// `--max-streams-per-reporter` (a chunk that would pass it ends the stream before it is
    /// buffered, [`Session::check_chunk_streams`]).
    chunk_streams: HashSet<String>,
    /// The resync turn this session holds ([`turns`]), from before its resync is read until
    /// it is applied.
    turn: Option<turns::Turn>,
    /// The opening resync (which follows Hello) has not been applied yet.
    opening_pending: bool,
    /// When the reporter was last heard ([`heartbeat`]): stamped by every message.
    heard: Arc<crate::index::Heard>,
    /// The bound is suspended while the session waits for or holds a resync turn.
    heard_paused: bool,
    /// The agent's heartbeat interval was found too long for the bound (warned once).
    heartbeat_warned: bool,
    /// When this session's last message arrived, once its resync turn was handed on for want
    /// of a message ([`turns::ResyncTurns::turn_idle`]); cleared by the next message.
    handed_on: Option<tokio::time::Instant>,
}

impl Session {
    /// The session reads its stream again after a resync turn: the heartbeat bound runs from
    /// now ([`crate::index::Heard::resume`]).
    fn resume_heard(&mut self) {
        if self.heard_paused {
            self.heard.resume();
            self.heard_paused = false;
        }
    }

    /// Ends the stream for `e` (its final status to the agent); returns why, for the log.
    async fn finish(&self, e: SessionEnd) -> &'static str {
        match e {
            SessionEnd::Closed => "controller side closed",
            SessionEnd::Superseded => {
                let _ = self.tx.try_send(Err(superseded_status()));
                "superseded by a newer stream of the node"
            }
            SessionEnd::TooLarge(e) => {
                warn!(node = %self.ticket.node, error = %e, "resync refused; closing the stream");
                let _ = self.tx.send(Err(Status::resource_exhausted(e))).await;
                "resync too large"
            }
            SessionEnd::Refused(e) => {
                warn!(node = %self.ticket.node, error = %e, "stream reported outside its scope; closing it");
                let _ = self.tx.send(Err(e.to_status())).await;
                "refused: stream outside the subscriber's pod"
            }
            SessionEnd::ShuttingDown => {
                let _ = self
                    .tx
                    .send(Err(Status::unavailable("controller shutting down")))
                    .await;
                "controller shutting down"
            }
        }
    }

    /// Sends `ResyncProgress` unless the outbound queue is full (the agent is not reading;
    /// a later one will do).
    fn progress(&self, p: proto::ResyncProgress) -> Result<(), SessionEnd> {
        match self.tx.try_send(Ok(ControllerMessage {
            msg: Some(controller_message::Msg::ResyncProgress(p)),
        })) {
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SessionEnd::Closed),
            _ => Ok(()),
        }
    }

    /// Waits for a resync turn ([`turns::ResyncTurns::take`]), telling the agent every
    /// [`turns::ResyncTurns::progress_every`] that its resync waits. Ends when a newer stream of the node
    /// takes over or the controller shuts down.
    async fn take_turn(&mut self) -> Result<(), SessionEnd> {
        if self.turn.is_some() {
            return Ok(());
        }
        // Nothing of the stream is read until the resync is applied: not the agent's silence.
        self.heard.pause();
        self.heard_paused = true;
        let shared = self.shared.clone();
        let take = shared.resync_turns.take(&shared.metrics.resyncs_pending);
        tokio::pin!(take);
        let every = shared.resync_turns.progress_every();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let mut stopping = shared.stopping.subscribe();
        let turn = loop {
            tokio::select! {
                t = &mut take => break t,
                _ = tick.tick() => {
                    if !shared.nodes.lock().is_current(&self.ticket) {
                        return Err(SessionEnd::Superseded);
                    }
                    self.progress(proto::ResyncProgress::default())?;
                }
                _ = stopping.wait_for(|s| *s) => return Err(SessionEnd::ShuttingDown),
            }
        };
        self.turn = Some(turn);
        Ok(())
    }

    async fn send(&self, msg: controller_message::Msg) -> Result<(), SessionEnd> {
        self.tx
            .send(Ok(ControllerMessage { msg: Some(msg) }))
            .await
            .map_err(|_| SessionEnd::Closed)
    }

    /// For a subscriber stream: every descriptor must be its pod's.
    fn authorize<'a>(
        &self,
        descriptors: impl IntoIterator<Item = Option<&'a proto::StreamDescriptor>>,
    ) -> Result<(), SessionEnd> {
        let Some(scope) = &self.ticket.scope else {
            return Ok(());
        };
        // In cluster, the ranks the plan gives the pod (issue 38 item 4: any rank was accepted).
        let ranks = self
            .shared
            .nodes
            .lock()
            .planned_pod(&scope.node, &scope.namespace, &scope.pod)
            .ok()
            .flatten()
            .map(|p| p.ranks.clone());
        for d in descriptors.into_iter().flatten() {
            scope.authorize(d).map_err(SessionEnd::Refused)?;
            if let Some(ranks) = &ranks {
                if !ranks.contains(&d.dp_rank) {
                    self.shared
                        .metrics
                        .kv_streams_refused_total
                        .with_label_values(&["rank_not_planned"])
                        .inc();
                    return Err(SessionEnd::Refused(auth::AuthError::StreamOutOfScope {
                        pod: scope.pod_ref(),
                        stream_id: d.stream_id.clone(),
                        field: "data-parallel rank",
                        got: d.dp_rank.to_string(),
                        want: format!("one of the plan's ranks {ranks:?}"),
                    }));
                }
            }
        }
        Ok(())
    }

    /// Refuses `chunk` when the distinct streams of the chunked resync so far and of `chunk`
    /// together are more than `--max-streams-per-reporter`: the partial resync is dropped
    /// before `chunk` is buffered and the stream ends (issue 38 D2: the cap was applied only
    /// to the whole assembled resync, and 1 000 000 one-entry streams took the controller to
    /// 811 MiB first). Otherwise records `chunk`'s new stream ids.
    fn check_chunk_streams(&mut self, chunk: &proto::ResyncChunk) -> Result<(), SessionEnd> {
        let cap = self.shared.policy.streams_per_reporter();
        for s in &chunk.streams {
            let id = s.stream.as_ref().map_or("", |d| d.stream_id.as_str());
            if self.chunk_streams.contains(id) {
                continue;
            }
            if self.chunk_streams.len() >= cap {
                self.drop_refused_resync("resync_stream_cap");
                return Err(SessionEnd::TooLarge(format!(
                    "the chunked resync names more than {cap} distinct streams \
                     (--max-streams-per-reporter); it was refused at chunk {} before being \
                     buffered",
                    chunk.chunk
                )));
            }
            self.chunk_streams.insert(id.to_string());
        }
        Ok(())
    }

    /// The refusal of a resync of more than `--max-resync-entries` entries (counted in
    /// `kv_streams_refused_total{reason="resync_entry_cap"}`); the partial resync is dropped.
    fn entry_cap_refusal(&mut self) -> SessionEnd {
        self.drop_refused_resync("resync_entry_cap");
        SessionEnd::TooLarge(format!(
            "the resync carries more than {} block entries (--max-resync-entries); it was \
             refused and nothing of it was applied",
            self.shared.policy.resync_entries()
        ))
    }

    /// Drops a refused resync's buffered chunks, its stream ids and its turn, and counts it in
    /// `kv_streams_refused_total{reason}`.
    fn drop_refused_resync(&mut self, reason: &str) {
        self.chunks.reset();
        self.chunk_streams.clear();
        self.turn = None;
        self.shared
            .metrics
            .kv_streams_refused_total
            .with_label_values(&[reason])
            .inc();
    }

    async fn handle(&mut self, msg: proto::AgentMessage) -> Result<(), SessionEnd> {
        let now = now_unix_ms();
        if !self.shared.nodes.lock().is_current(&self.ticket) {
            // A newer stream from the same node took over: end this one so its agent (if it
            // still runs) reconnects instead of sending deltas nobody applies.
            return Err(SessionEnd::Superseded);
        }
        self.shared.nodes.lock().touch(&self.ticket, now);
        self.heard.touch();
        heartbeat::lift_silence(
            &self.shared,
            &self.ticket.node,
            &self.heard,
            self.shared.policy.heartbeat_bound(),
        );
        let m = &self.shared.metrics;
        match msg.msg {
            Some(Msg::Hello(_)) | None => {}
            Some(Msg::Heartbeat(h)) => heartbeat::check_interval(
                &self.ticket.node,
                h.interval_ms,
                self.shared.policy.heartbeat_bound(),
                &mut self.heartbeat_warned,
            ),
            Some(Msg::Resync(r)) => {
                self.chunks.reset();
                self.chunk_streams.clear();
                self.authorize(r.streams.iter().map(|s| s.stream.as_ref()))?;
                let entries: usize = r.streams.iter().map(|s| s.entries.len()).sum();
                if entries > self.shared.policy.resync_entries() {
                    return Err(self.entry_cap_refusal());
                }
                self.take_turn().await?;
                self.apply_resync(r.streams).await;
            }
            Some(Msg::ResyncChunk(c)) => {
                self.authorize(c.streams.iter().map(|s| s.stream.as_ref()))?;
                self.take_turn().await?;
                self.check_chunk_streams(&c)?;
                let pushed = self.chunks.push(c);
                if !matches!(pushed, Ok(None)) {
                    // Applied or discarded: the next chunked resync starts afresh.
                    self.chunk_streams.clear();
                }
                match pushed {
                    Ok(Some(streams)) => self.apply_resync(streams).await,
                    Ok(None) => {}
                    Err(ic_shared::resync::AssembleError::TooLarge { .. }) => {
                        return Err(self.entry_cap_refusal());
                    }
                    Err(e) => {
                        warn!(node = %self.ticket.node, error = %e, "resync chunk out of order; requesting a resync");
                        self.turn = None;
                        self.awaiting_resync = true;
                        self.send(controller_message::Msg::ResyncRequest(
                            proto::ResyncRequest {
                                reason: e.to_string(),
                            },
                        ))
                        .await?;
                    }
                }
            }
            Some(Msg::KvDeltas(batch)) => {
                timing::mark(Stage::BatchReceived, batch.batch_id);
                self.authorize(batch.deltas.iter().map(|d| d.stream.as_ref()))?;
                m.kv_batches_total.inc();
                let mut refused = None;
                if self.awaiting_resync {
                    m.kv_deltas_refused_total
                        .with_label_values(&["awaiting_resync"])
                        .inc_by(batch.deltas.len() as u64);
                } else {
                    let mut deltas = self.in_scope_deltas(batch.deltas);
                    let Some(mut ix) = self.index_write_if_current(WriteHold::Deltas) else {
                        return Err(SessionEnd::Superseded);
                    };
                    let mut budget = scope::BlockSizeBudget::new(ix.registered_block_sizes());
                    let capped: Vec<bool> = deltas
                        .iter_mut()
                        .map(|d| scope::cap_delta(d, &mut budget) > 0)
                        .collect();
                    for (i, d) in deltas.iter().enumerate() {
                        match ix.apply_delta(&self.ticket.node, d) {
                            Ok(()) => {
                                m.kv_deltas_applied_total.inc();
                                if capped.get(i) == Some(&true) {
                                    m.kv_streams_refused_total
                                        .with_label_values(&["block_size_cap"])
                                        .inc();
                                    if let Some(desc) = &d.stream {
                                        ix.limit_stream(
                                            &desc.stream_id,
                                            ic_shared::kv::coverage::BLOCK_SIZE_CAP_EXCEEDED,
                                        );
                                    }
                                }
                            }
                            Err(e) => {
                                m.kv_deltas_refused_total
                                    .with_label_values(&[e.reason()])
                                    .inc();
                                // The rest of the batch waits for the resync like every later
                                // delta; meanwhile no entry of the node is vouched for.
                                m.kv_deltas_refused_total
                                    .with_label_values(&["awaiting_resync"])
                                    .inc_by((deltas.len() - i - 1) as u64);
                                ix.mark_node_awaiting_resync(&self.ticket.node);
                                refused = Some(e);
                                break;
                            }
                        }
                    }
                    self.shared.update_index_gauges(&ix);
                    drop(ix);
                    timing::mark(Stage::BatchApplied, batch.batch_id);
                }
                self.send(controller_message::Msg::Ack(proto::Ack {
                    batch_id: batch.batch_id,
                }))
                .await?;
                if let Some(e) = refused {
                    warn!(node = %self.ticket.node, error = %e, "KV delta refused; requesting a resync");
                    self.awaiting_resync = true;
                    self.send(controller_message::Msg::ResyncRequest(
                        proto::ResyncRequest {
                            reason: e.to_string(),
                        },
                    ))
                    .await?;
                }
            }
            Some(Msg::Counters(report)) => {
                self.authorize(report.streams.iter().map(|c| c.stream.as_ref()))?;
                let mut ignored = 0usize;
                let mut ix = self.shared.index_write(WriteHold::Counters);
                let mut owned = Vec::with_capacity(report.streams.len());
                for c in &report.streams {
                    match c.stream.as_ref().map(|d| d.stream_id.as_str()) {
                        Some(id) if self.owned.contains(id) => {
                            ix.set_engine_counters(
                                id,
                                crate::index::EngineReport::from_counters(c),
                            );
                            owned.push((id, c));
                        }
                        _ => ignored += 1,
                    }
                }
                drop(ix);
                self.shared
                    .host_tier
                    .write()
                    .record_report(&self.ticket.node, owned);
                if ignored > 0 {
                    tracing::debug!(node = %self.ticket.node, ignored, "engine counters of streams this connection does not own were ignored");
                }
            }
            Some(Msg::Checks(_)) if self.ticket.scope.is_some() => {}
            Some(Msg::Checks(report)) => {
                m.check_reports_total.inc();
                self.shared.nodes.lock().report(&self.ticket, &report, now);
                self.shared.notify_node_change();
            }
        }
        Ok(())
    }
}
