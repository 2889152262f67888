//! `AgentService.Connect`: the agents' single stream into the controller (DESIGN.md "Contracts").
//!
//! Protocol, per stream:
//! 1. the agent sends `Hello` first (anything else → `InvalidArgument`), within the handshake
//!    bounds of [`handshake`]: `--agent-hello-timeout-seconds` (`DeadlineExceeded`), at most
//!    `--agent-pre-auth-bytes` before it is accepted, `--agent-max-pending-hellos` streams
//!    waiting at once and `--agent-max-pending-hellos-per-source` of them from one source
//!    address (`ResourceExhausted`);
//! 2. the agent sends a full `Resync` (or, when it is larger than one message may be, a series
//!    of `ResyncChunk`s applied together when the last arrives — `ic_shared::resync`); the index
//!    replaces every stream of that node. A resync of more than `--max-resync-entries` entries,
//!    or a chunked one whose chunks name more than `--max-streams-per-reporter` distinct
//!    streams, is refused as soon as the chunk that crosses the bound arrives: the partial
//!    resync is dropped and the stream ends with `ResourceExhausted` naming the flag (counted in
//!    `kv_streams_refused_total{reason="resync_entry_cap"|"resync_stream_cap"}`, one per refused
//!    resync). A single `Resync` message over the stream cap (bounded by the message limit)
//!    keeps its first streams and counts the rest (`reason="stream_cap"`);
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
//!
//! This file holds the service and the acceptance of a stream's Hello ([`AgentIngest`]); an
//! accepted stream's session (its read loop and message handling) is in `session`, and how a
//! resync is applied in slices in `session::resync`.

pub mod auth;
pub mod handshake;
pub mod heartbeat;
pub mod host_tier;
pub mod registry;
pub mod scope;
mod session;
pub mod turns;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_server, agent_service_server::AgentService,
    ControllerMessage,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::metrics::labels::StreamRejection;
use crate::state::{now_unix_ms, Shared, WriteHold};

/// Outbound queue depth per agent stream.
const OUTBOUND_DEPTH: usize = 64;

/// Default of `--max-resync-entries` ([`crate::state::DEFAULT_MAX_RESYNC_ENTRIES`]).
pub use crate::state::DEFAULT_MAX_RESYNC_ENTRIES;

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
    /// Streams awaiting their Hello per source address (`--agent-max-pending-hellos-per-source`,
    /// from `shared.policy`).
    per_source: Arc<handshake::PendingBySource>,
    /// Set once [`heartbeat::watch`] runs for `shared` (started by the first accepted stream).
    heartbeat_watch: Arc<std::sync::OnceLock<()>>,
}

impl AgentIngest {
    /// A service over the shared state that accepts every Hello (standalone mode), with the
    /// default handshake bounds ([`Self::with_limits`]).
    pub fn new(shared: Arc<Shared>) -> Self {
        AgentIngest {
            per_source: handshake::PendingBySource::new(shared.policy.pending_hellos_per_source()),
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
            per_source: handshake::PendingBySource::new(shared.policy.pending_hellos_per_source()),
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

    fn reject(&self, reason: StreamRejection, status: Status) -> Status {
        self.shared.metrics.stream_rejected(reason);
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
        // One source may hold only its share of the pending slots (issue 38 D4: one client
        // with 8 connections × 128 Hello-less streams kept every agent out).
        let source_slot = match source {
            Some(ip) => Some(self.per_source.try_acquire(ip).ok_or_else(|| {
                self.shared
                    .metrics
                    .stream_rejected(StreamRejection::PendingPerSourceFull);
                Status::resource_exhausted(format!(
                    "{} AgentService.Connect streams from this source address are awaiting \
                     their Hello or its authentication (--agent-max-pending-hellos-per-source); \
                     retry shortly",
                    self.per_source.max()
                ))
            })?),
            None => None,
        };
        let pending = self
            .handshake
            .pending
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                self.reject(
                    StreamRejection::PendingHellosFull,
                    Status::resource_exhausted(format!(
                        "{} AgentService.Connect streams are awaiting their Hello or its \
                         authentication (--agent-max-pending-hellos); retry shortly",
                        self.handshake.max_pending
                    )),
                )
            })?;
        let mut inbound = request.into_inner();
        let first = handshake::first_message(self.handshake.hello_timeout, inbound.message())
            .await
            .map_err(|s| {
                if s.code() == tonic::Code::DeadlineExceeded {
                    warn!("an agent stream sent no Hello within its deadline; closed");
                }
                self.reject(StreamRejection::of_first_message(&s), s)
            })?;
        let hello = match first.and_then(|m| m.msg) {
            Some(Msg::Hello(h)) if !h.node.trim().is_empty() => {
                handshake::check_hello_sizes(&h)
                    .map_err(|s| self.reject(StreamRejection::InvalidHello, s))?;
                h
            }
            Some(Msg::Hello(_)) => {
                return Err(self.reject(
                    StreamRejection::InvalidHello,
                    Status::invalid_argument("Hello.node must not be empty"),
                ));
            }
            _ => {
                self.shared
                    .metrics
                    .stream_rejected(StreamRejection::NoHello);
                return Err(Status::invalid_argument(
                    "the first message on AgentService.Connect must be Hello",
                ));
            }
        };
        let refuse = |e: auth::AuthError| {
            self.shared.metrics.stream_rejected(e.rejection());
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
        drop(source_slot);
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
        self.shared.metrics.stream_accepted();
        match &scope {
            Some(scope) => {
                info!(node = %hello.node, pod = %scope.pod_ref(), version = %hello.version, instance = %hello.agent_instance, "pod subscriber connected")
            }
            None => {
                self.shared.notify_node_change();
                info!(node = %hello.node, version = %hello.version, instance = %hello.agent_instance, plan_generation = ?plan_generation, "agent connected")
            }
        }

        tokio::spawn(session::run(
            self.shared.clone(),
            ticket,
            tx,
            heard,
            inbound,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The status a superseded stream ends with.
pub fn superseded_status() -> Status {
    Status::aborted("superseded by a newer stream of this node; reconnect")
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
mod tests;
