//! `AgentService.Connect`: the agents' single stream into the controller (DESIGN.md "Contracts").
//!
//! Protocol, per stream:
//! 1. the agent sends `Hello` first (anything else → `InvalidArgument`), within the handshake
//!    bounds of [`handshake`]: `--agent-hello-timeout-seconds` (`DeadlineExceeded`), at most
//!    `--agent-pre-auth-bytes` before it is accepted and `--agent-max-pending-hellos` streams
//!    waiting at once (`ResourceExhausted`);
//! 2. the agent sends a full `Resync` (or, when it is larger than one message may be, a series
//!    of `ResyncChunk`s applied together when the last arrives — `ic_shared::resync`); the index
//!    replaces every stream of that node;
//! 3. `KvDeltaBatch`es are applied stream by stream; each batch is acked. A delta whose seq does
//!    not follow, or of a stream the index does not know, is refused: the controller sends one
//!    `ResyncRequest` and ignores further deltas of that agent until the next `Resync`;
//! 4. `CheckReport`s replace the node's latest results.
//! 5. `CounterReport`s (the engines' tier-2 hit and lookup counters and LMCache cache bytes,
//!    scraped by the agent) are
//!    recorded per stream with [`crate::index::PrefixIndex::set_engine_counters`] — only for
//!    streams this connection owns (those of its last `Resync`); others are ignored. A `Resync`
//!    resets a stream's counters; the agent sends them again right after it. Their SGLang
//!    HiCache host-tier pair goes to [`host_tier::HostTierReadings`] (`Shared::host_tier`),
//!    which holds only current readings: a report without the pair, a `Resync` and the end of
//!    the stream remove them.
//!
//! When the stream ends the node is marked disconnected; its index entries stay until
//! `agent_expiry` passes without a reconnect (a restarted agent replaces them with its resync),
//! and read coverage Unknown / `AgentDisconnected` meanwhile.
//!
//! A newer stream from the same node supersedes the open one: the old stream is ended at once
//! with `Aborted` (so an agent that still runs reconnects instead of sending deltas nobody
//! acks), and a message that still arrives on it ends it the same way.
//!
//! In-cluster mode authenticates the Hello ([`auth`]: TokenReview, the agent's service account,
//! the token's node equal to `Hello.node`) before anything else happens; a refused stream ends
//! with `Unauthenticated`, `PermissionDenied` or `Unavailable` and leaves no trace in the
//! registry. Standalone runs without it ([`AgentIngest::new`]) and says so at start.
//!
//! Each accepted stream's sending half is registered ([`registry::NodeRegistry::attach`]), which
//! queues the node's current plan first; the plan publisher pushes later plans through the
//! same handle.
//!
//! **Per-pod subscribers** (`Hello.pod_subscriber`: `ic-agent subscribe`, the kvevent-subscriber
//! sidecar) follow the same protocol with three differences: in cluster they authenticate with
//! their pod's token ([`auth`], "Per-pod subscribers"); their state is filed under
//! `<node>/<namespace>/<pod>` ([`auth::PodScope::reporter_key`]) in the registry and the index,
//! so their resyncs replace only their own streams (never the node agent's or another pod's);
//! and every stream in their `Resync`s and deltas must be their pod's
//! ([`auth::PodScope::authorize`]; counters included) — one that is not ends the stream with `PermissionDenied`
//! before anything of that message is applied. They get no node plan; check reports from them
//! are ignored. Standalone mode holds them to the pod their Hello names.
//!
//! **Node scope and block sizes** ([`scope`]): once this replica has derived node plans (in
//! cluster, every replica does), a node agent's resync keeps only streams of engine pods the
//! plans place on its node, and its deltas of other streams are dropped — each counted in
//! `kv_streams_refused_total{reason="outside_node_scope"}`; entries and ops with a block size
//! over the caps are dropped too (`reason="block_size_cap"`, one per snapshot or delta cut),
//! and their stream reads Partial / `BlockSizeCapExceeded` until a resync or clear drops
//! nothing. Standalone derives no plans: node agents report what they see, as before.
//!
//! **Refused deltas** (a sequence gap, an unknown stream): the controller asks the agent for a
//! resync, drops the node's deltas until it arrives (`kv_deltas_refused_total{reason=
//! "awaiting_resync"}`, the rest of the refused batch included) and marks the node's replicas
//! Unknown / `ResyncRequested` meanwhile: their entries are as last applied.

pub mod auth;
pub mod handshake;
pub mod heartbeat;
pub mod host_tier;
pub mod registry;
pub mod scope;
pub mod turns;

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_server, agent_service_server::AgentService,
    controller_message, ControllerMessage,
};
use ic_shared::timing::{self, Stage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::state::{now_unix_ms, Shared, WriteHold};
use registry::StreamTicket;

/// Outbound queue depth per agent stream.
const OUTBOUND_DEPTH: usize = 64;

/// Most entries one node's resync may carry (all chunks together): 16 M, sixteen times the
/// largest node we plan for (1 M blocks), ≈ 0.5 GiB while assembled.
pub const MAX_RESYNC_ENTRIES: usize = 16 * 1024 * 1024;

/// Entries of a node's resync applied under one hold of the index write lock
/// (a node's resync, `Session::apply_resync`): ≈ 0.1–0.5 ms of work, so a lookup waits at most
/// about that long behind a resync (docs/scaling.md). Large block tables the slice would grow
/// are grown before it, while lookups still read (`PrefixIndex::grow_ahead`).
pub const RESYNC_SLICE_ENTRIES: usize = 2048;

/// Inbound message limit of `AgentService`: a `ResyncChunk` is at most
/// `ic_shared::resync::CHUNK_BUDGET_BYTES` plus framing; 8 MiB leaves room for a large check
/// report while bounding what one caller can make the controller buffer.
pub const MAX_AGENT_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// The gRPC service.
#[derive(Clone)]
pub struct AgentIngest {
    shared: Arc<Shared>,
    auth: Option<Arc<auth::AgentAuthenticator>>,
    handshake: handshake::HandshakeLimits,
    /// Set once [`heartbeat::watch`] runs for `shared` (started by the first accepted stream).
    heartbeat_watch: Arc<std::sync::OnceLock<()>>,
}

impl AgentIngest {
    /// A service over the shared state that accepts every Hello (standalone mode), with the
    /// default handshake bounds ([`Self::with_limits`]).
    pub fn new(shared: Arc<Shared>) -> Self {
        AgentIngest {
            shared,
            auth: None,
            handshake: handshake::HandshakeLimits::default(),
            heartbeat_watch: Arc::default(),
        }
    }

    /// This service with the handshake bounds of `limits` (`hello_timeout`, `pre_auth_bytes`,
    /// `max_pending_hellos`; [`handshake`]).
    pub fn with_limits(mut self, limits: &ic_shared::serve::ConnectionLimits) -> Self {
        self.handshake = handshake::HandshakeLimits::new(limits);
        self
    }

    /// The tonic server for this service, with the inbound limit [`MAX_AGENT_MESSAGE_BYTES`]
    /// (resyncs above it arrive as chunks) once a stream's Hello is accepted, and
    /// `pre_auth_bytes` before ([`handshake::PreAuthGated`]).
    pub fn into_server(
        self,
    ) -> handshake::PreAuthGated<agent_service_server::AgentServiceServer<Self>> {
        let cap = self.handshake.pre_auth_bytes;
        handshake::PreAuthGated::new(
            agent_service_server::AgentServiceServer::new(self)
                .max_decoding_message_size(MAX_AGENT_MESSAGE_BYTES),
            cap,
        )
    }

    /// A service that authenticates every Hello with `auth` (in-cluster mode).
    pub fn with_auth(shared: Arc<Shared>, auth: Arc<auth::AgentAuthenticator>) -> Self {
        AgentIngest {
            shared,
            auth: Some(auth),
            handshake: handshake::HandshakeLimits::default(),
            heartbeat_watch: Arc::default(),
        }
    }

    /// In cluster: `scope`'s pod must be an engine pod the node plans place on its node, and,
    /// when the plan knows its UID, the token's pod UID must be that one (a pod replaced under
    /// the same name is another pod). Refusals are counted in
    /// `kv_streams_refused_total{reason="subscriber_not_planned"}`.
    fn check_planned(
        &self,
        scope: &auth::PodScope,
        token_pod_uid: Option<&str>,
    ) -> Result<(), auth::AuthError> {
        let nodes = self.shared.nodes.lock();
        let result = match nodes.planned_pod(&scope.node, &scope.namespace, &scope.pod) {
            Ok(None) => Err(auth::AuthError::PlansPending(scope.pod_ref())),
            Err(why) => Err(auth::AuthError::NotPlanned(why)),
            Ok(Some(planned)) => match (planned.uid.as_deref(), token_pod_uid) {
                (Some(want), Some(got)) if want != got => Err(auth::AuthError::NotPlanned(
                    format!(
                        "the token is bound to pod {} with UID {got:?}, but the planned engine pod of that name has UID {want:?}",
                        scope.pod_ref()
                    ),
                )),
                _ => Ok(()),
            },
        };
        drop(nodes);
        if result.is_err() {
            self.shared
                .metrics
                .kv_streams_refused_total
                .with_label_values(&["subscriber_not_planned"])
                .inc();
        }
        result
    }

    fn reject(&self, status: Status) -> Status {
        self.shared
            .metrics
            .agent_streams_total
            .with_label_values(&["rejected"])
            .inc();
        status
    }
}

type OutStream = Pin<Box<dyn Stream<Item = Result<ControllerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for AgentIngest {
    type ConnectStream = OutStream;

    async fn connect(
        &self,
        request: Request<Streaming<proto::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        // Until the Hello is accepted the stream holds one of the pending-Hello permits, may
        // have sent at most `pre_auth_bytes` (the gate) and has `hello_timeout` to send it.
        let gate = request
            .extensions()
            .get::<handshake::PreAuthGate>()
            .cloned();
        let source = request.remote_addr().map(|a| a.ip());
        let pending = self
            .handshake
            .pending
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                self.reject(Status::resource_exhausted(format!(
                    "{} AgentService.Connect streams are awaiting their Hello or its \
                     authentication (--agent-max-pending-hellos); retry shortly",
                    self.handshake.max_pending
                )))
            })?;
        let mut inbound = request.into_inner();
        let first = handshake::first_message(self.handshake.hello_timeout, inbound.message())
            .await
            .map_err(|s| {
                if s.code() == tonic::Code::DeadlineExceeded {
                    warn!("an agent stream sent no Hello within its deadline; closed");
                }
                self.reject(s)
            })?;
        let hello = match first.and_then(|m| m.msg) {
            Some(Msg::Hello(h)) if !h.node.trim().is_empty() => {
                handshake::check_hello_sizes(&h).map_err(|s| self.reject(s))?;
                h
            }
            Some(Msg::Hello(_)) => {
                self.shared
                    .metrics
                    .agent_streams_total
                    .with_label_values(&["rejected"])
                    .inc();
                return Err(Status::invalid_argument("Hello.node must not be empty"));
            }
            _ => {
                self.shared
                    .metrics
                    .agent_streams_total
                    .with_label_values(&["rejected"])
                    .inc();
                return Err(Status::invalid_argument(
                    "the first message on AgentService.Connect must be Hello",
                ));
            }
        };
        let refuse = |e: auth::AuthError| {
            self.shared
                .metrics
                .agent_streams_total
                .with_label_values(&["rejected"])
                .inc();
            warn!(node = %hello.node, error = %e, "agent stream refused");
            e.to_status()
        };
        let scope = auth::PodScope::from_hello(&hello).map_err(refuse)?;
        if let Some(auth) = &self.auth {
            let id = auth
                .authenticate_from(&hello, source)
                .await
                .map_err(refuse)?;
            // In cluster a subscriber speaks only for an engine pod the node plans know, bound
            // by its own token (docs/security.md "Only planned engine pods report").
            if let Some(scope) = &scope {
                self.check_planned(scope, id.pod_uid.as_deref())
                    .map_err(refuse)?;
            }
        }
        // Accepted: full-size messages from here on.
        if let Some(gate) = gate {
            gate.open();
        }
        drop(pending);
        let (tx, rx) = mpsc::channel(OUTBOUND_DEPTH);
        let bound = self.shared.policy.heartbeat_bound();
        heartbeat::start_once(&self.heartbeat_watch, &self.shared, bound);
        let heard_capable = hello
            .capabilities
            .iter()
            .any(|c| c == crate::index::HEARTBEAT_CAPABILITY);
        let (ticket, plan_generation, heard) = {
            let mut nodes = self.shared.nodes.lock();
            let (ticket, plan_generation) = match &scope {
                Some(scope) => (
                    nodes.connect_subscriber(&hello, scope, tx.clone(), now_unix_ms()),
                    None,
                ),
                None => {
                    let ticket = nodes.connect(&hello, now_unix_ms());
                    let generation = nodes.attach(&ticket, tx.clone());
                    (ticket, generation)
                }
            };
            // This stream supersedes any open one of the node (or pod): what that one reported
            // is as last reported until this one resyncs, and a resync of it still being
            // applied stops (under the registry lock, so the old stream's end, which checks
            // it, cannot race this).
            // The Hello is a message: the reporter is heard now, silent no more.
            let heard = {
                let mut ix = self.shared.index_write(WriteHold::Connect);
                ix.supersede_node(&ticket.node);
                let heard = ix.heard_cell(&ticket.node);
                heard.open(heard_capable);
                ix.set_node_silent(&ticket.node, false, crate::index::mono_ms(), bound);
                self.shared.update_index_gauges(&ix);
                heard
            };
            self.shared
                .metrics
                .agents_connected
                .set(nodes.connected_count() as i64);
            (ticket, plan_generation, heard)
        };
        self.shared
            .metrics
            .agent_streams_total
            .with_label_values(&["accepted"])
            .inc();
        match &scope {
            Some(scope) => {
                info!(node = %hello.node, pod = %scope.pod_ref(), version = %hello.version, instance = %hello.agent_instance, "pod subscriber connected")
            }
            None => {
                self.shared.notify_node_change();
                info!(node = %hello.node, version = %hello.version, instance = %hello.agent_instance, plan_generation = ?plan_generation, "agent connected")
            }
        }

        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut session = Session {
                shared: shared.clone(),
                ticket: ticket.clone(),
                tx,
                awaiting_resync: false,
                owned: HashSet::new(),
                chunks: ic_shared::resync::ResyncAssembler::new(MAX_RESYNC_ENTRIES),
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
                if session.opening_pending && session.turn.is_none() && session.handed_on.is_none()
                {
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
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
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

/// The status a superseded stream ends with.
pub fn superseded_status() -> Status {
    Status::aborted("superseded by a newer stream of this node; reconnect")
}

/// Why [`Session::handle`] ends a stream.
enum SessionEnd {
    /// The outbound half is gone.
    Closed,
    /// A newer stream of the same node (or pod) took over.
    Superseded,
    /// A chunked resync exceeded [`MAX_RESYNC_ENTRIES`].
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
    /// A chunked resync being put back together.
    chunks: ic_shared::resync::ResyncAssembler,
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
                self.authorize(r.streams.iter().map(|s| s.stream.as_ref()))?;
                self.take_turn().await?;
                self.apply_resync(r.streams).await;
            }
            Some(Msg::ResyncChunk(c)) => {
                self.authorize(c.streams.iter().map(|s| s.stream.as_ref()))?;
                self.take_turn().await?;
                match self.chunks.push(c) {
                    Ok(Some(streams)) => self.apply_resync(streams).await,
                    Ok(None) => {}
                    Err(e @ ic_shared::resync::AssembleError::TooLarge { .. }) => {
                        return Err(SessionEnd::TooLarge(e.to_string()));
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

impl Session {
    /// A node agent's deltas without those of streams outside its node's scope (counted);
    /// subscribers' deltas pass (they are held to their pod by [`Session::authorize`]).
    fn in_scope_deltas(&self, deltas: Vec<proto::StreamDelta>) -> Vec<proto::StreamDelta> {
        if self.ticket.scope.is_some() {
            return deltas;
        }
        let nodes = self.shared.nodes.lock();
        let before = deltas.len();
        let kept: Vec<proto::StreamDelta> = deltas
            .into_iter()
            .filter(|d| {
                d.stream
                    .as_ref()
                    .is_none_or(|desc| nodes.node_may_report(&self.ticket.node, desc).is_ok())
            })
            .collect();
        drop(nodes);
        let dropped = before - kept.len();
        if dropped > 0 {
            let m = &self.shared.metrics;
            m.kv_streams_refused_total
                .with_label_values(&["outside_node_scope"])
                .inc_by(dropped as u64);
            m.kv_deltas_refused_total
                .with_label_values(&["outside_node_scope"])
                .inc_by(dropped as u64);
            warn!(node = %self.ticket.node, dropped, "KV deltas of streams outside the node's scope were dropped");
        }
        kept
    }

    /// A node agent's resync without the streams outside its node's scope (counted, with the
    /// first reason logged).
    fn in_scope_snapshots(
        &self,
        streams: Vec<proto::StreamSnapshot>,
    ) -> Vec<proto::StreamSnapshot> {
        if self.ticket.scope.is_some() {
            return streams;
        }
        let nodes = self.shared.nodes.lock();
        let mut first = None;
        let before = streams.len();
        let kept: Vec<proto::StreamSnapshot> = streams
            .into_iter()
            .filter(|s| match s.stream.as_ref() {
                None => true,
                Some(desc) => match nodes.node_may_report(&self.ticket.node, desc) {
                    Ok(()) => true,
                    Err(e) => {
                        first.get_or_insert(e);
                        false
                    }
                },
            })
            .collect();
        drop(nodes);
        if let Some(why) = first {
            let dropped = before - kept.len();
            self.shared
                .metrics
                .kv_streams_refused_total
                .with_label_values(&["outside_node_scope"])
                .inc_by(dropped as u64);
            warn!(node = %self.ticket.node, dropped, first = %why, "resync streams outside the node's scope were left out");
        }
        kept
    }

    /// The resync's first `--max-streams-per-reporter` distinct streams; the rest are left out
    /// and counted (`kv_streams_refused_total{reason="stream_cap"}`). Bounds what one agent or
    /// pod token can register (issue 38 item 4: 200 000 one-entry streams held the index write
    /// lock 7.4 s in one `begin_resync`), and so the streams one resync registers under one
    /// hold of the lock.
    fn within_stream_cap(
        &self,
        mut streams: Vec<proto::StreamSnapshot>,
    ) -> Vec<proto::StreamSnapshot> {
        let cap = self.shared.policy.streams_per_reporter();
        let mut seen: HashSet<&str> = HashSet::new();
        let mut keep = streams.len();
        for (i, s) in streams.iter().enumerate() {
            seen.insert(s.stream.as_ref().map_or("", |d| d.stream_id.as_str()));
            if seen.len() > cap {
                keep = i;
                break;
            }
        }
        if keep < streams.len() {
            let dropped = streams.len() - keep;
            streams.truncate(keep);
            self.shared
                .metrics
                .kv_streams_refused_total
                .with_label_values(&["stream_cap"])
                .inc_by(dropped as u64);
            warn!(node = %self.ticket.node, cap, dropped, "resync carried more streams than one reporter may register (--max-streams-per-reporter); the rest were left out");
        }
        streams
    }

    /// The index write lock for `what` while this stream is still its node's (or pod's)
    /// current one; `None` once a newer one took over. Checked under the registry lock, which
    /// a newer stream's connect holds while it supersedes this one's replicas
    /// ([`crate::index::PrefixIndex::supersede_node`]), so nothing this stream applies lands
    /// after that.
    fn index_write_if_current(&self, what: WriteHold) -> Option<crate::state::IndexWrite<'_>> {
        let nodes = self.shared.nodes.lock();
        if !nodes.is_current(&self.ticket) {
            return None;
        }
        let ix = self.shared.index_write(what);
        drop(nodes);
        Some(ix)
    }

    /// Replaces the node's streams with a whole resync, applied in slices of
    /// [`RESYNC_SLICE_ENTRIES`] entries ([`crate::index::PrefixIndex::begin_resync`]): the index
    /// write lock is released and the task yields between slices, so lookups and other agents'
    /// writes interleave with a large resync (a restart storm applies thousands at once). Until
    /// the last slice the node's streams read Partial / `ResyncApplying`. A newer stream of the
    /// node taking over stops the apply (the newer stream's resync replaces these streams).
    async fn apply_resync(&mut self, streams: Vec<proto::StreamSnapshot>) {
        let m = &self.shared.metrics;
        let trigger = if self.awaiting_resync {
            "requested"
        } else {
            "connect"
        };
        let streams = self.within_stream_cap(self.in_scope_snapshots(streams));
        let mut streams = with_node(streams, self.ticket.reporting_node());
        let mut apply = {
            let Some(mut ix) = self.index_write_if_current(WriteHold::ResyncBegin) else {
                info!(node = %self.ticket.node, "a newer stream of the node took over before its resync was applied");
                self.turn = None;
                return;
            };
            let mut budget = scope::BlockSizeBudget::new(ix.registered_block_sizes());
            let mut capped: Vec<String> = Vec::new();
            for s in streams.iter_mut() {
                if scope::cap_snapshot(s, &mut budget) > 0 {
                    capped.extend(s.stream.as_ref().map(|d| d.stream_id.clone()));
                }
            }
            m.kv_streams_refused_total
                .with_label_values(&["block_size_cap"])
                .inc_by(capped.len() as u64);
            let apply = ix.begin_resync(&self.ticket.node, &streams);
            // What the cap dropped is not in the index: those streams read Partial whatever
            // their snapshot says, until a resync or clear drops nothing.
            for id in &capped {
                ix.limit_stream(id, ic_shared::kv::coverage::BLOCK_SIZE_CAP_EXCEEDED);
            }
            self.shared.update_index_gauges(&ix);
            // The agent sends its counters again right after a resync.
            self.shared
                .host_tier
                .write()
                .forget_reporter(&self.ticket.node);
            drop(ix);
            apply
        };
        let total: u64 = streams.iter().map(|s| s.entries.len() as u64).sum();
        let mut told = tokio::time::Instant::now();
        loop {
            let (done, replaced) = {
                // Large tables this slice could grow are grown first under an upgradable read
                // lock (lookups go on), then swapped in; the slice itself never grows one.
                let ix = self.shared.index.upgradable_read();
                let grown = ix.grow_ahead(&apply, &streams, RESYNC_SLICE_ENTRIES);
                let mut ix = self.shared.index_upgrade(ix, WriteHold::ResyncSlice);
                let replaced = ix.install_grown(grown);
                let done = ix.resync_step(&mut apply, &streams, RESYNC_SLICE_ENTRIES);
                self.shared.update_index_gauges(&ix);
                drop(ix);
                (done, replaced)
            };
            // The replaced tables are freed outside the lock.
            drop(replaced);
            if done {
                break;
            }
            if !self.shared.nodes.lock().is_current(&self.ticket) {
                info!(node = %self.ticket.node, "a newer stream of the node took over during its resync; stopped applying it");
                self.turn = None;
                return;
            }
            if told.elapsed() >= self.shared.resync_turns.progress_every() {
                told = tokio::time::Instant::now();
                let _ = self.progress(proto::ResyncProgress {
                    applying: true,
                    entries_applied: apply.entries_done(&streams),
                    entries_total: total,
                });
            }
            tokio::task::yield_now().await;
        }
        self.turn = None;
        self.opening_pending = false;
        self.owned = streams
            .iter()
            .filter_map(|s| s.stream.as_ref().map(|d| d.stream_id.clone()))
            .collect();
        m.kv_resyncs_total.with_label_values(&[trigger]).inc();
        self.awaiting_resync = false;
    }
}

/// Stamps the reporting node into each stream descriptor.
fn with_node(mut streams: Vec<proto::StreamSnapshot>, node: &str) -> Vec<proto::StreamSnapshot> {
    for s in &mut streams {
        if let Some(d) = s.stream.as_mut() {
            d.node = node.to_string();
        }
    }
    streams
}

/// Forgets nodes whose agent stayed away longer than `expiry`, with their index entries. Runs
/// until the task is dropped; checks every `expiry / 4` (at least once a second).
pub async fn expire_nodes(shared: Arc<Shared>, expiry: Duration) {
    let period = (expiry / 4).max(Duration::from_secs(1));
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let gone = shared
            .nodes
            .lock()
            .expire(now_unix_ms(), expiry.as_millis() as i64);
        if gone.is_empty() {
            continue;
        }
        let mut ix = shared.index_write(WriteHold::Expire);
        for n in &gone {
            info!(node = %n, "agent stayed away past the expiry; dropping its index entries");
            ix.remove_node(n);
        }
        shared.update_index_gauges(&ix);
        drop(ix);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    //! Subscriber streams over a real loopback gRPC connection.

    use super::*;
    use crate::state::LookupPolicy;
    use ic_shared::proto::{
        agent_service_client::AgentServiceClient, AgentMessage, BlockEntry, PodSubscriber, Resync,
        StreamDescriptor, StreamSnapshot,
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
            .with_resync_turns(
                turns::ResyncTurns::new(1).with_timing(Duration::from_millis(50), gap),
            );
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
            if let Some(controller_message::Msg::Ack(a)) =
                third.message().await.unwrap().unwrap().msg
            {
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
            if let Some(controller_message::Msg::Ack(a)) =
                inbound.message().await.unwrap().unwrap().msg
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
        let verifier = auth::FakeTokenVerifier::new().with_pod_token(
            "tok-a",
            &engine,
            Some("n1"),
            Some("pod-a"),
        );
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
        let (accepted, tx) =
            open(&url, hello("n1", Some(("team-a", "vllm-a")), "tok-engine")).await;
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
}
