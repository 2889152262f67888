//! The agent's single gRPC stream to the controller (DESIGN.md "Contracts between the two
//! binaries").
//!
//! Per connection: Hello, then a full Resync of every KV stream (so the controller's index
//! converges after either side restarts), then the latest check pass; afterwards KV delta batches
//! as the hub produces them and every new check pass. The controller may answer with a node plan
//! (applied at once), acks, and resync requests (answered with a fresh Resync). On any error the
//! agent reconnects with capped exponential backoff.

use std::sync::Arc;
use std::time::Duration;

use ic_shared::plan::NodePlan;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, controller_message,
    AgentMessage,
};
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info, warn};

use crate::state::AgentState;

/// Link settings.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Controller gRPC URL, e.g. `http://127.0.0.1:50051`.
    pub controller: String,
    /// File holding the projected service-account token (audience `inference-cache`); re-read
    /// on every connect because the kubelet rotates it. `None` in standalone mode.
    pub token_file: Option<std::path::PathBuf>,
    /// First reconnect delay; doubles per failure.
    pub backoff_initial: Duration,
    /// Reconnect delay cap.
    pub backoff_max: Duration,
    /// How long deltas are gathered into one batch after the hub signals.
    pub batch_window: Duration,
}

impl LinkConfig {
    /// Defaults: 250 ms → 5 s backoff, 20 ms batching window.
    pub fn new(controller: impl Into<String>) -> Self {
        LinkConfig {
            controller: controller.into(),
            token_file: None,
            backoff_initial: Duration::from_millis(250),
            backoff_max: Duration::from_secs(5),
            batch_window: Duration::from_millis(20),
        }
    }
}

/// Why a connection ended.
#[derive(Debug, Error)]
pub enum LinkError {
    /// The URL is not a valid endpoint.
    #[error("invalid controller URL {url:?}: {source}")]
    Url {
        /// URL.
        url: String,
        /// Parser error.
        source: tonic::transport::Error,
    },
    /// TCP/HTTP2 connection failed.
    #[error("cannot connect to {url}: {source}")]
    Connect {
        /// URL.
        url: String,
        /// Transport error.
        source: tonic::transport::Error,
    },
    /// The controller refused or ended the stream with a status.
    #[error("controller: {0}")]
    Status(#[from] tonic::Status),
    /// The token file could not be read.
    #[error("cannot read token file {path}: {source}")]
    Token {
        /// File path.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// The outbound queue closed (the request stream ended).
    #[error("outbound stream closed")]
    Closed,
}

/// Signals that a new check pass is available (its value is a counter).
pub type PassSignal = watch::Receiver<u64>;

/// Runs the link forever: connect, stream, reconnect with backoff.
/// `plan_applied` is notified whenever a controller plan was applied (the check loop reruns).
pub async fn run(
    cfg: LinkConfig,
    state: Arc<AgentState>,
    mut passes: PassSignal,
    plan_applied: Arc<tokio::sync::Notify>,
) {
    state.link.write().controller = cfg.controller.clone();
    let mut delay = cfg.backoff_initial;
    loop {
        let result = session(&cfg, &state, &mut passes, &plan_applied).await;
        let was_up = {
            let mut l = state.link.write();
            let was = l.connected;
            l.connected = false;
            l.last_error = result.as_ref().err().map(|e| e.to_string());
            was
        };
        state.metrics.link_connected.set(0);
        match result {
            Ok(()) => info!("controller closed the stream; reconnecting"),
            Err(e) => {
                warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "controller link down")
            }
        }
        if was_up {
            delay = cfg.backoff_initial;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(cfg.backoff_max);
    }
}

fn hello(state: &AgentState, token: &str) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Hello(proto::Hello {
            node: state.node.clone(),
            boot_id: read_boot_id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            capabilities: vec!["checks".into(), "kv-events".into()],
            token: token.to_string(),
            agent_instance: instance_id().to_string(),
        })),
    }
}

fn resync(state: &AgentState) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Resync(proto::Resync {
            streams: state.hub.snapshot(),
        })),
    }
}

fn checks(state: &AgentState) -> Option<AgentMessage> {
    let pass = state.latest.read().clone()?;
    Some(AgentMessage {
        msg: Some(Msg::Checks(proto::CheckReport {
            observed_at_unix_ms: pass.observed_at_unix_ms,
            results: pass.results.iter().map(proto::CheckResult::from).collect(),
            plan_generation: pass.plan_generation,
        })),
    })
}

async fn session(
    cfg: &LinkConfig,
    state: &Arc<AgentState>,
    passes: &mut PassSignal,
    plan_applied: &tokio::sync::Notify,
) -> Result<(), LinkError> {
    let endpoint = tonic::transport::Endpoint::from_shared(cfg.controller.clone())
        .map_err(|source| LinkError::Url {
            url: cfg.controller.clone(),
            source,
        })?
        .connect_timeout(Duration::from_secs(3))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_while_idle(true);
    let channel = endpoint
        .connect()
        .await
        .map_err(|source| LinkError::Connect {
            url: cfg.controller.clone(),
            source,
        })?;
    let token = match &cfg.token_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|source| LinkError::Token {
                path: path.display().to_string(),
                source,
            })?
            .trim()
            .to_string(),
        None => String::new(),
    };
    let mut client = AgentServiceClient::new(channel);
    let (tx, rx) = mpsc::channel::<AgentMessage>(64);
    // Queue Hello + Resync + the latest pass before opening: the controller reads Hello first.
    let send = |m: AgentMessage| {
        let tx = tx.clone();
        async move { tx.send(m).await.map_err(|_| LinkError::Closed) }
    };
    send(hello(state, &token)).await?;
    send(resync(state)).await?;
    passes.mark_unchanged();
    if let Some(m) = checks(state) {
        send(m).await?;
    }
    let mut inbound = client.connect(ReceiverStream::new(rx)).await?.into_inner();
    {
        let mut l = state.link.write();
        l.connected = true;
        l.connects += 1;
        l.last_error = None;
    }
    state.metrics.link_connected.set(1);
    state.metrics.link_connects_total.inc();
    info!(controller = %cfg.controller, node = %state.node, "connected to controller");

    let mut batch_id: u64 = 0;
    loop {
        tokio::select! {
            msg = inbound.message() => {
                let Some(msg) = msg? else { return Ok(()) };
                match msg.msg {
                    Some(controller_message::Msg::Plan(p)) => {
                        apply_controller_plan(state, &p);
                        plan_applied.notify_one();
                    }
                    Some(controller_message::Msg::ResyncRequest(r)) => {
                        info!(reason = %r.reason, "controller requested a resync");
                        send(resync(state)).await?;
                    }
                    Some(controller_message::Msg::Ack(_)) | None => {}
                }
            }
            _ = state.hub.changed() => {
                tokio::time::sleep(cfg.batch_window).await;
                let deltas = state.hub.take_deltas();
                if !deltas.is_empty() {
                    batch_id += 1;
                    send(AgentMessage { msg: Some(Msg::KvDeltas(proto::KvDeltaBatch { batch_id, deltas })) }).await?;
                    state.metrics.kv_batches_sent_total.inc();
                }
            }
            changed = passes.changed() => {
                if changed.is_err() {
                    return Err(LinkError::Closed);
                }
                if let Some(m) = checks(state) {
                    send(m).await?;
                }
            }
        }
    }
}

/// Applies a plan pushed by the controller; a malformed plan is logged and ignored.
fn apply_controller_plan(state: &AgentState, update: &proto::NodePlanUpdate) {
    match NodePlan::parse(&update.plan_json, "controller plan") {
        Ok(mut plan) => {
            plan.generation = update.generation;
            state.hub.apply_plan(&plan);
            *state.plan.write() = plan;
            info!(
                generation = update.generation,
                "applied node plan from controller"
            );
        }
        Err(e) => warn!(error = %e, generation = update.generation, "ignoring malformed node plan"),
    }
}

/// `/proc/sys/kernel/random/boot_id`, empty where unreadable.
fn read_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A random id for this agent process, stable for its lifetime.
fn instance_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let pid = std::process::id();
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!("{pid:x}-{t:x}")
    })
}
