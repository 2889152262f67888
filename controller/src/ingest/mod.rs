//! `AgentService.Connect`: the agents' single stream into the controller (DESIGN.md "Contracts").
//!
//! Protocol, per stream:
//! 1. the agent sends `Hello` first (anything else → `InvalidArgument`);
//! 2. the agent sends a full `Resync`; the index replaces every stream of that node;
//! 3. `KvDeltaBatch`es are applied stream by stream; each batch is acked. A delta whose seq does
//!    not follow, or of a stream the index does not know, is refused: the controller sends one
//!    `ResyncRequest` and ignores further deltas of that agent until the next `Resync`;
//! 4. `CheckReport`s replace the node's latest results.
//!
//! When the stream ends the node is marked disconnected; its index entries stay until
//! `agent_expiry` passes without a reconnect (a restarted agent replaces them with its resync).
//!
//! In-cluster mode authenticates the Hello ([`auth`]: TokenReview, the agent's service account,
//! the token's node equal to `Hello.node`) before anything else happens; a refused stream ends
//! with `Unauthenticated`, `PermissionDenied` or `Unavailable` and leaves no trace in the
//! registry. Standalone runs without it ([`AgentIngest::new`]) and says so at start.
//!
//! Each accepted stream's sending half is registered ([`registry::NodeRegistry::attach`]), which
//! queues the node's current plan first; the plan publisher pushes later plans through the
//! same handle.

pub mod auth;
pub mod registry;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_server::AgentService, controller_message,
    ControllerMessage,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::state::{now_unix_ms, Shared};
use registry::StreamTicket;

/// Outbound queue depth per agent stream.
const OUTBOUND_DEPTH: usize = 64;

/// The gRPC service.
#[derive(Clone)]
pub struct AgentIngest {
    shared: Arc<Shared>,
    auth: Option<Arc<auth::AgentAuthenticator>>,
}

impl AgentIngest {
    /// A service over the shared state that accepts every Hello (standalone mode).
    pub fn new(shared: Arc<Shared>) -> Self {
        AgentIngest { shared, auth: None }
    }

    /// A service that authenticates every Hello with `auth` (in-cluster mode).
    pub fn with_auth(shared: Arc<Shared>, auth: Arc<auth::AgentAuthenticator>) -> Self {
        AgentIngest {
            shared,
            auth: Some(auth),
        }
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
        let mut inbound = request.into_inner();
        let first = inbound.message().await?;
        let hello = match first.and_then(|m| m.msg) {
            Some(Msg::Hello(h)) if !h.node.trim().is_empty() => h,
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
        if let Some(auth) = &self.auth {
            if let Err(e) = auth.authenticate(&hello).await {
                self.shared
                    .metrics
                    .agent_streams_total
                    .with_label_values(&["rejected"])
                    .inc();
                warn!(node = %hello.node, error = %e, "agent stream refused");
                return Err(e.to_status());
            }
        }
        let (tx, rx) = mpsc::channel(OUTBOUND_DEPTH);
        let (ticket, plan_generation) = {
            let mut nodes = self.shared.nodes.lock();
            let ticket = nodes.connect(&hello, now_unix_ms());
            let plan_generation = nodes.attach(&ticket, tx.clone());
            self.shared
                .metrics
                .agents_connected
                .set(nodes.connected_count() as i64);
            (ticket, plan_generation)
        };
        self.shared
            .metrics
            .agent_streams_total
            .with_label_values(&["accepted"])
            .inc();
        self.shared.notify_node_change();
        info!(node = %hello.node, version = %hello.version, instance = %hello.agent_instance, plan_generation = ?plan_generation, "agent connected");

        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut session = Session {
                shared: shared.clone(),
                ticket: ticket.clone(),
                tx,
                awaiting_resync: false,
            };
            let mut stopping = shared.stopping.subscribe();
            let end = loop {
                tokio::select! {
                    msg = inbound.message() => match msg {
                        Ok(Some(msg)) => {
                            if session.handle(msg).await.is_err() {
                                break "controller side closed";
                            }
                        }
                        Ok(None) => break "agent closed the stream",
                        Err(_) => break "stream error",
                    },
                    _ = async { stopping.wait_for(|s| *s).await.map(|_| ()) } => {
                        let _ = session
                            .tx
                            .send(Err(Status::unavailable("controller shutting down")))
                            .await;
                        break "controller shutting down";
                    }
                }
            };
            {
                let mut nodes = shared.nodes.lock();
                if nodes.disconnect(&ticket, now_unix_ms()) {
                    info!(node = %ticket.node, why = end, "agent disconnected");
                }
                shared
                    .metrics
                    .agents_connected
                    .set(nodes.connected_count() as i64);
            }
            shared.notify_node_change();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// One open agent stream.
struct Session {
    shared: Arc<Shared>,
    ticket: StreamTicket,
    tx: mpsc::Sender<Result<ControllerMessage, Status>>,
    awaiting_resync: bool,
}

impl Session {
    async fn send(&self, msg: controller_message::Msg) -> Result<(), ()> {
        self.tx
            .send(Ok(ControllerMessage { msg: Some(msg) }))
            .await
            .map_err(|_| ())
    }

    async fn handle(&mut self, msg: proto::AgentMessage) -> Result<(), ()> {
        let now = now_unix_ms();
        if !self.shared.nodes.lock().is_current(&self.ticket) {
            // A newer stream from the same node took over; this one only drains.
            return Ok(());
        }
        self.shared.nodes.lock().touch(&self.ticket, now);
        let m = &self.shared.metrics;
        match msg.msg {
            Some(Msg::Hello(_)) | None => {}
            Some(Msg::Resync(r)) => {
                let trigger = if self.awaiting_resync {
                    "requested"
                } else {
                    "connect"
                };
                {
                    let mut ix = self.shared.index.write();
                    ix.resync_node(&self.ticket.node, &with_node(r.streams, &self.ticket.node));
                    self.shared.update_index_gauges(&ix);
                }
                m.kv_resyncs_total.with_label_values(&[trigger]).inc();
                self.awaiting_resync = false;
            }
            Some(Msg::KvDeltas(batch)) => {
                m.kv_batches_total.inc();
                let mut refused = None;
                if self.awaiting_resync {
                    m.kv_deltas_refused_total
                        .with_label_values(&["awaiting_resync"])
                        .inc_by(batch.deltas.len() as u64);
                } else {
                    let mut ix = self.shared.index.write();
                    for d in &batch.deltas {
                        match ix.apply_delta(&self.ticket.node, d) {
                            Ok(()) => m.kv_deltas_applied_total.inc(),
                            Err(e) => {
                                m.kv_deltas_refused_total
                                    .with_label_values(&[e.reason()])
                                    .inc();
                                refused = Some(e);
                                break;
                            }
                        }
                    }
                    self.shared.update_index_gauges(&ix);
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
            Some(Msg::Checks(report)) => {
                m.check_reports_total.inc();
                self.shared.nodes.lock().report(&self.ticket, &report);
                self.shared.notify_node_change();
            }
        }
        Ok(())
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
        let mut ix = shared.index.write();
        for n in &gone {
            info!(node = %n, "agent stayed away past the expiry; dropping its index entries");
            ix.remove_node(n);
        }
        shared.update_index_gauges(&ix);
    }
}
