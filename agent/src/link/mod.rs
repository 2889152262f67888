//! The agent's gRPC streams to the controller (DESIGN.md "Contracts between the two binaries").
//!
//! Every controller replica serves reads (router, snapshot), so every replica needs every node's
//! KV state: the agent resolves `--controller`'s host and keeps one stream per address it
//! resolves to (in cluster the chart points it at a headless Service), re-resolving every
//! [`LinkConfig::rediscover_interval`]. An IP literal or a ClusterIP name gives one stream.
//!
//! Per stream: Hello, then a full Resync of every KV stream (so that replica's index converges
//! after either side restarts), the engines' latest tier-2 counters (a Resync resets them in the
//! index) and the latest check pass; afterwards KV delta batches, every new check pass and the
//! counters whenever a scrape changed them ([`crate::engine_metrics`]). The controller may answer with a node plan (applied at once), acks, and resync
//! requests (answered with a fresh Resync). On any error the stream reconnects with capped
//! exponential backoff with jitter ([`reconnect_delays`]): after a controller restart thousands
//! of agents must not retry in lockstep.
//!
//! One *pump* task owns the hub's delta queue: it takes deltas as soon as the hub signals (the
//! subscribers signal on idle and on size, never on a timer) and broadcasts each batch to every
//! stream, and produces snapshots on request — each stream's pending ops are taken as a delta
//! and its snapshot in one hold of that stream's lock (`KvHub::take_deltas_and_snapshot`), and
//! the delta is broadcast, so a snapshot never swallows ops another stream still needs, even
//! when engine batches land while it is taken. A stream subscribes to the broadcast before it asks
//! for its snapshot and drops broadcast deltas the snapshot already covers (per-stream seq ≤ the
//! snapshot's), so each controller replica sees a gap-free sequence.
//!
//! Every stream also sends a `CoverageHeartbeat` every
//! [`ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL`] (1 s; Hello announces
//! `coverage-heartbeat`): coverage travels only when it changes, so the heartbeat is what tells
//! the controller this agent still vouches for its replicas — one that hears nothing for its
//! bound (5 s by default) stops routing them (docs/kv-events.md "Coverage age").

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::plan::NodePlan;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, controller_message,
    AgentMessage, KvDeltaBatch, StreamDelta, StreamSnapshot,
};
use ic_shared::timing::{self, Stage};
use thiserror::Error;
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, info, warn};

use crate::state::AgentState;

/// Link settings.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Controller gRPC URL(s), comma-separated, e.g. `http://127.0.0.1:50051` or a headless
    /// Service name that resolves to every replica.
    pub controller: String,
    /// File holding the projected service-account token (audience `inference-cache`); re-read
    /// on every connect because the kubelet rotates it. `None` in standalone mode.
    pub token_file: Option<std::path::PathBuf>,
    /// First reconnect delay; doubles per failure. Jitter adds up to as much again to each
    /// delay ([`reconnect_delays`]).
    pub backoff_initial: Duration,
    /// Reconnect delay cap before jitter (a delay is at most twice this).
    pub backoff_max: Duration,
    /// How often the controller host is re-resolved to find replicas.
    pub rediscover_interval: Duration,
    /// Set by `ic-agent subscribe` (the per-pod kvevent-subscriber): the pod the stream speaks
    /// for, sent in `Hello.pod_subscriber`. Such a link ignores node plans (the controller sends
    /// none to subscriber streams). `None` for the node agent.
    pub pod_subscriber: Option<proto::PodSubscriber>,
    /// A delta batch not acked within this long ends the stream, which reconnects and resyncs
    /// (a controller that stopped applying our deltas must not leave the index silently behind).
    /// A `ResyncProgress` from the controller (our resync is queued or being applied, so later
    /// batches cannot be acked yet) restarts the clock.
    pub ack_timeout: Duration,
}

impl LinkConfig {
    /// Defaults: 250 ms → 5 s backoff (plus jitter), re-resolve every 10 s.
    pub fn new(controller: impl Into<String>) -> Self {
        LinkConfig {
            controller: controller.into(),
            token_file: None,
            backoff_initial: Duration::from_millis(250),
            backoff_max: Duration::from_secs(5),
            rediscover_interval: Duration::from_secs(10),
            pod_subscriber: None,
            ack_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a connection ended.
#[derive(Debug, Error)]
pub enum LinkError {
    /// The URL is not a valid endpoint.
    #[error("invalid controller URL {url:?}: {}", error_chain(source))]
    Url {
        /// URL.
        url: String,
        /// Parser error.
        source: tonic::transport::Error,
    },
    /// TCP/HTTP2 connection failed. The message carries the cause under tonic's "transport
    /// error" (e.g. "connection refused at 127.0.0.1:50051: nothing listens there").
    #[error("cannot connect to {url}: {}", connect_cause(url, source))]
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
    /// The URL answers, but not with gRPC (e.g. the controller's HTTP port instead of its gRPC
    /// port): the response's `content-type` is not `application/grpc…`.
    #[error(
        "{url} is not a gRPC endpoint (it answered content-type {content_type:?}); is it the \
         controller's HTTP port? AgentService is on the gRPC port (50051 by default)"
    )]
    NotGrpc {
        /// URL.
        url: String,
        /// The `content-type` the server answered with (empty when none).
        content_type: String,
    },
    /// The outbound queue or the pump closed.
    #[error("outbound stream closed")]
    Closed,
    /// A delta batch went un-acked past [`LinkConfig::ack_timeout`].
    #[error("delta batch {batch_id} not acked within {waited_ms} ms")]
    AckTimeout {
        /// The oldest un-acked batch.
        batch_id: u64,
        /// How long it waited.
        waited_ms: u64,
    },
}

/// `e` and each of its sources, joined with ": " (tonic's own message is only "transport
/// error"; the cause — refused, timed out, DNS — is in its sources).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let m = s.to_string();
        if !out.ends_with(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        next = s.source();
    }
    out
}

/// A connect failure in words: a refused connection says that nothing listens at the address
/// (the usual mistakes: the controller is not running, or this is not its gRPC port); other
/// causes are the error's whole chain.
fn connect_cause(url: &str, e: &tonic::transport::Error) -> String {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = next {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                let at = url.split_once("://").map_or(url, |(_, rest)| rest);
                return format!(
                    "connection refused at {at}: nothing listens there (is the controller \
                     running, and is this its gRPC port, 50051 by default?)"
                );
            }
        }
        next = s.source();
    }
    error_chain(e)
}

/// Signals that a new check pass is available (its value is a counter).
pub type PassSignal = watch::Receiver<u64>;

/// Broadcast depth of delta batches; a stream that falls further behind resyncs.
const BATCH_FANOUT_DEPTH: usize = 1024;

/// Least depth of a stream's outbound queue (larger when the opening needs it).
const OUTBOUND_DEPTH: usize = 64;

/// A stream's outbound queue with `opening` (Hello and every resync chunk) already in it, and
/// room for the counters and checks that follow. The opening is queued before the stream opens
/// — nothing reads the queue yet — so the queue is sized to hold all of it: a node of 1 M
/// blocks is ≈ 250 chunks of 64 KiB, and a fixed depth below that would wait forever. tokio's
/// channel allocates its slots as they fill, not up front.
///
/// # Errors
/// [`LinkError::Closed`] if a message does not fit (it always does).
fn queue_opening(
    opening: Vec<AgentMessage>,
) -> Result<(mpsc::Sender<AgentMessage>, mpsc::Receiver<AgentMessage>), LinkError> {
    let (tx, rx) = mpsc::channel::<AgentMessage>(OUTBOUND_DEPTH.max(opening.len() + 2));
    for m in opening {
        tx.try_send(m).map_err(|_| LinkError::Closed)?;
    }
    Ok((tx, rx))
}

/// Handle to the pump task (cheap to clone).
#[derive(Clone)]
struct Pump {
    batches: broadcast::Sender<Arc<KvDeltaBatch>>,
    snapshots: mpsc::Sender<oneshot::Sender<Vec<StreamSnapshot>>>,
}

impl Pump {
    /// Starts the pump. It flushes as soon as the hub signals — no batching timer: the
    /// subscribers signal when their queue is drained or their pending ops are large
    /// (`kv::subscriber::FLUSH_KEYS`), so batches form from what arrived while the previous
    /// flush was on its way, and a lone engine batch leaves at once.
    fn start(state: Arc<AgentState>) -> (Pump, tokio::task::JoinHandle<()>) {
        let (batches, _) = broadcast::channel(BATCH_FANOUT_DEPTH);
        let (snapshots, mut requests) = mpsc::channel::<oneshot::Sender<Vec<StreamSnapshot>>>(16);
        let tx = batches.clone();
        let task = tokio::spawn(async move {
            let mut batch_id = 0u64;
            let send = |batch_id: &mut u64, deltas: Vec<StreamDelta>| {
                if deltas.is_empty() {
                    return;
                }
                *batch_id += 1;
                timing::mark(Stage::BatchTaken, *batch_id);
                // No receiver = no stream connected: the next snapshot carries the state.
                let _ = tx.send(Arc::new(KvDeltaBatch {
                    batch_id: *batch_id,
                    deltas,
                }));
                state.metrics.kv_batches_sent_total.inc();
            };
            loop {
                tokio::select! {
                    _ = state.hub.changed() => send(&mut batch_id, state.hub.take_deltas()),
                    req = requests.recv() => {
                        let Some(reply) = req else { return };
                        // Each stream's pending ops and its snapshot are taken in one hold of
                        // its lock: the ops go to every controller stream as deltas (the one
                        // that asked drops them, its snapshot holds them), and nothing that
                        // lands meanwhile is in the snapshot alone.
                        let (deltas, snap) = state.hub.take_deltas_and_snapshot();
                        send(&mut batch_id, deltas);
                        let _ = reply.send(snap);
                    }
                }
            }
        });
        (Pump { batches, snapshots }, task)
    }

    async fn snapshot(&self) -> Result<Vec<StreamSnapshot>, LinkError> {
        let (tx, rx) = oneshot::channel();
        self.snapshots
            .send(tx)
            .await
            .map_err(|_| LinkError::Closed)?;
        rx.await.map_err(|_| LinkError::Closed)
    }
}

/// Runs the link forever: resolve the controller's replicas, keep one stream per replica.
/// `plan_applied` is notified whenever a controller plan was applied (the check loop reruns).
pub async fn run(
    cfg: LinkConfig,
    state: Arc<AgentState>,
    passes: PassSignal,
    plan_applied: Arc<Notify>,
) {
    state.link.write().controller = cfg.controller.clone();
    let (pump, pump_task) = Pump::start(state.clone());
    let mut streams: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        let mut urls = Vec::new();
        for one in cfg
            .controller
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
        {
            urls.extend(resolve(one).await);
        }
        urls.sort();
        urls.dedup();
        streams.retain(|url, task| {
            let keep = urls.contains(url) && !task.is_finished();
            if !keep {
                task.abort();
                state.link.write().endpoints.remove(url);
                info!(controller = %url, "controller replica gone; closing its stream");
            }
            keep
        });
        for url in urls {
            if streams.contains_key(&url) {
                continue;
            }
            let task = tokio::spawn(endpoint_loop(
                url.clone(),
                cfg.clone(),
                state.clone(),
                pump.clone(),
                passes.clone(),
                plan_applied.clone(),
            ));
            streams.insert(url, task);
        }
        tokio::time::sleep(cfg.rediscover_interval).await;
        if pump_task.is_finished() {
            warn!("KV delta pump stopped; link exits");
            return;
        }
    }
}

/// The URLs of every address `controller`'s host resolves to; the URL itself when it names an IP,
/// does not parse, or does not resolve (the connect error then says why).
pub async fn resolve(controller: &str) -> Vec<String> {
    let Some((scheme, rest)) = controller.split_once("://") else {
        return vec![controller.to_string()];
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let Some((host, port)) = authority.rsplit_once(':') else {
        return vec![controller.to_string()];
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<IpAddr>().is_ok() || port.parse::<u16>().is_err() {
        return vec![controller.to_string()];
    }
    match tokio::net::lookup_host(authority).await {
        Ok(addrs) => {
            let mut urls: Vec<String> = addrs
                .map(|a| match a.ip() {
                    IpAddr::V4(ip) => format!("{scheme}://{ip}:{}", a.port()),
                    IpAddr::V6(ip) => format!("{scheme}://[{ip}]:{}", a.port()),
                })
                .collect();
            urls.sort();
            urls.dedup();
            if urls.is_empty() {
                vec![controller.to_string()]
            } else {
                urls
            }
        }
        Err(_) => vec![controller.to_string()],
    }
}

/// One controller replica: connect, stream, reconnect with backoff, forever.
async fn endpoint_loop(
    url: String,
    cfg: LinkConfig,
    state: Arc<AgentState>,
    pump: Pump,
    mut passes: PassSignal,
    plan_applied: Arc<Notify>,
) {
    let mut delays = reconnect_delays(&cfg);
    loop {
        let result = session(&url, &cfg, &state, &pump, &mut passes, &plan_applied).await;
        let was_up = {
            let mut link = state.link.write();
            let ep = link.endpoints.entry(url.clone()).or_default();
            let was = ep.connected;
            ep.connected = false;
            ep.last_error = result.as_ref().err().map(|e| e.to_string());
            link.refresh();
            was
        };
        state
            .metrics
            .link_connected
            .set(state.link.read().connected_count() as i64);
        if was_up {
            delays = reconnect_delays(&cfg);
        }
        let delay = delays
            .next()
            .unwrap_or_else(|| cfg.backoff_max.max(cfg.backoff_initial));
        match result {
            Ok(()) => info!(controller = %url, "controller closed the stream; reconnecting"),
            Err(e) => {
                warn!(controller = %url, error = %e, retry_in_ms = delay.as_millis() as u64, "controller link down")
            }
        }
        tokio::time::sleep(delay).await;
    }
}

/// The waits between one replica stream's reconnect attempts, afresh after a stream that was
/// up: [`LinkConfig::backoff_initial`] doubling per failure up to [`LinkConfig::backoff_max`]
/// (at least the initial delay), each plus a random jitter of up to the same again (the
/// `backon` crate, seeded per schedule), never exhausted. The jitter spreads the reconnects of
/// every agent of a cluster after a controller restart over the window instead of sending them
/// all at once each doubling (issue 42 item 4).
pub fn reconnect_delays(cfg: &LinkConfig) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(cfg.backoff_initial)
        .with_max_delay(cfg.backoff_max.max(cfg.backoff_initial))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

fn hello(
    state: &AgentState,
    token: &str,
    pod_subscriber: Option<&proto::PodSubscriber>,
) -> AgentMessage {
    let mut m = ic_shared::link::hello(ic_shared::link::HelloFields {
        node: &state.node,
        boot_id: &read_boot_id(),
        version: env!("CARGO_PKG_VERSION"),
        token,
        agent_instance: instance_id(),
        pod_subscriber,
    });
    // This link sends a heartbeat every second (`session`): the controller may hold us to it.
    if let Some(Msg::Hello(h)) = m.msg.as_mut() {
        h.capabilities
            .push(ic_shared::link::COVERAGE_HEARTBEAT.to_string());
    }
    m
}

/// The `CoverageHeartbeat` sent every [`ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL`].
fn heartbeat() -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Heartbeat(proto::CoverageHeartbeat {
            interval_ms: u32::try_from(ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL.as_millis())
                .unwrap_or(u32::MAX),
        })),
    }
}

/// The engines' latest tier-2 counters; `None` when no engine exposes them.
fn counters(state: &AgentState) -> Option<AgentMessage> {
    state.engine_counters.report().map(|r| AgentMessage {
        msg: Some(Msg::Counters(r)),
    })
}

fn checks(state: &AgentState) -> Option<AgentMessage> {
    let pass = state.latest.read().clone()?;
    Some(AgentMessage {
        msg: Some(Msg::Checks(proto::CheckReport {
            observed_at_unix_ms: pass.observed_at_unix_ms,
            results: pass.results.iter().map(proto::CheckResult::from).collect(),
            plan_generation: pass.plan_generation,
            interval_seconds: pass.interval_seconds,
            age_ms: u64::try_from(
                ic_shared::now_unix_ms().saturating_sub(pass.observed_at_unix_ms),
            )
            .unwrap_or(0),
        })),
    })
}

/// Per-stream delta seq each controller replica already has from its last Resync.
#[derive(Debug, Default)]
struct Covered(BTreeMap<String, u64>);

impl Covered {
    fn from_snapshot(snap: &[StreamSnapshot]) -> Self {
        Covered(
            snap.iter()
                .filter_map(|s| s.stream.as_ref().map(|d| (d.stream_id.clone(), s.seq)))
                .collect(),
        )
    }

    /// The batch minus deltas the last snapshot already covers; `None` when nothing is left.
    fn filter(&self, batch: &KvDeltaBatch) -> Option<KvDeltaBatch> {
        let deltas: Vec<_> = batch
            .deltas
            .iter()
            .filter(|d| {
                let covered = d
                    .stream
                    .as_ref()
                    .and_then(|s| self.0.get(&s.stream_id))
                    .is_some_and(|seq| d.seq <= *seq);
                !covered
            })
            .cloned()
            .collect();
        (!deltas.is_empty()).then_some(KvDeltaBatch {
            batch_id: batch.batch_id,
            deltas,
        })
    }
}

async fn session(
    url: &str,
    cfg: &LinkConfig,
    state: &Arc<AgentState>,
    pump: &Pump,
    passes: &mut PassSignal,
    plan_applied: &Notify,
) -> Result<(), LinkError> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|source| LinkError::Url {
            url: url.to_string(),
            source,
        })?
        .connect_timeout(Duration::from_secs(3))
        // A delta batch is one small write the controller waits for: never held back by Nagle
        // (tonic's default, stated so that no change of it slows publish → visible).
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_while_idle(true);
    let channel = endpoint
        .connect()
        .await
        .map_err(|source| LinkError::Connect {
            url: url.to_string(),
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
    // Subscribe before the snapshot so no batch falls between the two.
    let mut batches = pump.batches.subscribe();
    let mut counter_changes = state.engine_counters.subscribe();
    let snap = pump.snapshot().await?;
    let mut covered = Covered::from_snapshot(&snap);
    // Queue Hello + Resync + the latest pass before opening: the controller reads Hello first.
    let (tx, rx) = queue_opening(ic_shared::link::opening(
        hello(state, &token, cfg.pod_subscriber.as_ref()),
        snap,
    ))?;
    let send = |m: AgentMessage| {
        let tx = tx.clone();
        async move { tx.send(m).await.map_err(|_| LinkError::Closed) }
    };
    counter_changes.mark_unchanged();
    if let Some(m) = counters(state) {
        send(m).await?;
    }
    passes.mark_unchanged();
    if let Some(m) = checks(state) {
        send(m).await?;
    }
    let response = client.connect(ReceiverStream::new(rx)).await?;
    // tonic hands back a streaming response before the status is known; an HTTP server that
    // answers 404 looks connected until the first read. A gRPC server always answers
    // `application/grpc…`: anything else is not the controller's AgentService.
    let content_type = response
        .metadata()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    if !content_type.starts_with("application/grpc") {
        return Err(LinkError::NotGrpc {
            url: url.to_string(),
            content_type,
        });
    }
    let mut inbound = response.into_inner();
    {
        let mut link = state.link.write();
        let ep = link.endpoints.entry(url.to_string()).or_default();
        ep.connected = true;
        ep.connects += 1;
        ep.last_error = None;
        link.refresh();
    }
    state
        .metrics
        .link_connected
        .set(state.link.read().connected_count() as i64);
    state.metrics.link_connects_total.inc();
    info!(controller = %url, node = %state.node, "connected to controller");

    // The oldest batch sent and not yet acked, with when it was sent.
    let mut unacked: Option<(u64, std::time::Instant)> = None;
    let mut last_sent_batch = 0u64;
    let mut ack_tick = tokio::time::interval(Duration::from_millis(500));
    ack_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Heartbeats at a fixed cadence, whatever else is sent: the controller's clock of this
    // stream's liveness. A late tick is sent once, not in a burst.
    let mut heartbeat_tick = tokio::time::interval(ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL);
    heartbeat_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = inbound.message() => {
                let Some(msg) = msg? else { return Ok(()) };
                match msg.msg {
                    Some(controller_message::Msg::Plan(p)) if cfg.pod_subscriber.is_some() => {
                        warn!(controller = %url, generation = p.generation, "ignoring a node plan sent to a per-pod subscriber");
                    }
                    Some(controller_message::Msg::Plan(p)) => {
                        apply_controller_plan(state, &p);
                        plan_applied.notify_one();
                    }
                    Some(controller_message::Msg::ResyncRequest(r)) => {
                        info!(controller = %url, reason = %r.reason, "controller requested a resync");
                        let snap = pump.snapshot().await?;
                        covered = Covered::from_snapshot(&snap);
                        for m in ic_shared::resync::chunk_resync(snap) {
                            send(m).await?;
                        }
                        if let Some(m) = counters(state) {
                            send(m).await?;
                        }
                    }
                    Some(controller_message::Msg::ResyncProgress(p)) => {
                        // Our resync waits for its turn or is being applied: batches sent
                        // after it cannot be acked before it is, and the controller is alive
                        // and working through its queue, so the ack clock restarts.
                        debug!(controller = %url, applying = p.applying, applied = p.entries_applied, total = p.entries_total, "controller is working through our resync");
                        if let Some((oldest, _)) = unacked {
                            unacked = Some((oldest, std::time::Instant::now()));
                        }
                    }
                    Some(controller_message::Msg::Ack(a)) => {
                        if a.batch_id >= last_sent_batch {
                            unacked = None;
                        } else if let Some((oldest, _)) = unacked {
                            if a.batch_id >= oldest {
                                // Later batches are still in flight: the clock restarts now.
                                unacked = Some((a.batch_id + 1, std::time::Instant::now()));
                            }
                        }
                    }
                    None => {}
                }
            }
            batch = batches.recv() => match batch {
                Ok(batch) => {
                    if let Some(b) = covered.filter(&batch) {
                        last_sent_batch = b.batch_id;
                        unacked.get_or_insert((b.batch_id, std::time::Instant::now()));
                        let id = b.batch_id;
                        send(AgentMessage { msg: Some(Msg::KvDeltas(b)) }).await?;
                        timing::mark(Stage::BatchSent, id);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    warn!(controller = %url, missed = n, "stream fell behind the delta fan-out; resyncing");
                    let snap = pump.snapshot().await?;
                    covered = Covered::from_snapshot(&snap);
                    for m in ic_shared::resync::chunk_resync(snap) {
                        send(m).await?;
                    }
                    if let Some(m) = counters(state) {
                        send(m).await?;
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return Err(LinkError::Closed),
            },
            _ = heartbeat_tick.tick() => {
                // try_send: a full outbound queue means the stream is busy sending (the
                // controller hears those messages); a heartbeat behind them adds nothing.
                if let Err(mpsc::error::TrySendError::Closed(_)) = tx.try_send(heartbeat()) {
                    return Err(LinkError::Closed);
                }
            }
            _ = ack_tick.tick() => {
                if let Some((batch_id, since)) = unacked {
                    if since.elapsed() >= cfg.ack_timeout {
                        return Err(LinkError::AckTimeout {
                            batch_id,
                            waited_ms: since.elapsed().as_millis() as u64,
                        });
                    }
                }
            }
            changed = counter_changes.changed() => {
                if changed.is_err() {
                    return Err(LinkError::Closed);
                }
                if let Some(m) = counters(state) {
                    send(m).await?;
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

/// Applies a plan pushed by the controller; a malformed plan is logged and ignored, and a plan
/// equal to the current one (several replicas push the same plan) changes nothing. Fields this
/// agent does not know (a newer controller, mid-upgrade) are ignored with a warning that names
/// them, so the rest of the plan still applies.
fn apply_controller_plan(state: &AgentState, update: &proto::NodePlanUpdate) {
    match NodePlan::parse_pushed(&update.plan_json, "controller plan") {
        Ok((mut plan, ignored)) => {
            plan.generation = update.generation;
            if *state.plan.read() == plan {
                return;
            }
            if !ignored.is_empty() {
                warn!(
                    generation = update.generation,
                    fields = %ignored.join(", "),
                    "the controller's node plan has fields this agent does not know (the \
                     controller is newer): they are ignored; upgrade the agent"
                );
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use ic_shared::proto::{StreamDelta, StreamDescriptor};

    /// The reconnect schedule starts at the initial delay, doubles up to the cap, never gives
    /// up, and adds to each delay a jitter of up to as much again — drawn afresh per schedule:
    /// two agents (two schedules) must not wait alike, or a controller restart brings every
    /// agent back in the same instant at each doubling. (Without its `std` feature, `backon`
    /// seeds every schedule with one constant: all agents jittered identically.)
    #[test]
    fn reconnect_delays_double_to_the_cap_with_jitter_drawn_per_schedule() {
        let mut cfg = LinkConfig::new("http://127.0.0.1:1");
        cfg.backoff_initial = Duration::from_millis(250);
        cfg.backoff_max = Duration::from_secs(5);
        let a: Vec<Duration> = reconnect_delays(&cfg).take(40).collect();
        assert_eq!(a.len(), 40, "never exhausted");
        for (i, d) in a.iter().enumerate() {
            // Without jitter: 250 ms, 500 ms, 1 s, 2 s, 4 s, then 5 s.
            let base = (cfg.backoff_initial * 2u32.pow(i.min(10) as u32)).min(cfg.backoff_max);
            assert!(
                *d >= base && *d <= 2 * base,
                "delay {i} is {d:?}, outside [{base:?}, 2 × {base:?}]: {a:?}"
            );
        }
        let b: Vec<Duration> = reconnect_delays(&cfg).take(40).collect();
        assert_ne!(a, b, "two schedules drew the same jitter");
    }

    fn delta(stream: &str, seq: u64) -> StreamDelta {
        StreamDelta {
            stream: Some(StreamDescriptor {
                stream_id: stream.into(),
                ..Default::default()
            }),
            seq,
            ops: vec![],
            ..Default::default()
        }
    }

    /// A node of 1 M blocks over 8 GPUs: its opening is hundreds of 64 KiB chunks, all queued
    /// before the stream opens (nothing reads yet); every one fits, in order, with room for
    /// counters and checks after. A fixed 64-deep queue hung here at ≈ 270 k entries.
    #[test]
    fn a_million_block_opening_fits_the_queue_before_the_stream_opens() {
        use ic_shared::proto::BlockEntry;
        let snaps: Vec<StreamSnapshot> = (0..8u64)
            .map(|g| StreamSnapshot {
                stream: Some(StreamDescriptor {
                    stream_id: format!("ns/pod#{g}"),
                    ..Default::default()
                }),
                entries: (0..125_000u64)
                    .map(|k| BlockEntry {
                        adapter: String::new(),
                        block_size: 16,
                        content_key: g << 32 | k,
                        tier: 1,
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        let hello = AgentMessage {
            msg: Some(Msg::Hello(Default::default())),
        };
        let opening = ic_shared::link::opening(hello, snaps);
        let n = opening.len();
        assert!(n > 200, "{n} messages");
        let (tx, mut rx) = queue_opening(opening).unwrap();
        // Counters and checks still fit without a reader.
        for _ in 0..2 {
            tx.try_send(AgentMessage::default()).unwrap();
        }
        let mut got = 0usize;
        let mut chunk = 0u32;
        while let Ok(m) = rx.try_recv() {
            match m.msg {
                Some(Msg::ResyncChunk(c)) => {
                    assert_eq!(c.chunk, chunk);
                    chunk += 1;
                }
                Some(Msg::Hello(_)) => assert_eq!(got, 0),
                _ => {}
            }
            got += 1;
        }
        assert_eq!(got, n + 2);
        assert_eq!(chunk as usize, n - 1);
    }

    #[test]
    fn covered_drops_exactly_what_the_snapshot_holds() {
        let snap = vec![StreamSnapshot {
            stream: Some(StreamDescriptor {
                stream_id: "a".into(),
                ..Default::default()
            }),
            seq: 5,
            ..Default::default()
        }];
        let c = Covered::from_snapshot(&snap);
        let batch = KvDeltaBatch {
            batch_id: 9,
            deltas: vec![delta("a", 5), delta("a", 6), delta("b", 1)],
        };
        let out = c.filter(&batch).unwrap();
        assert_eq!(out.batch_id, 9);
        let kept: Vec<(String, u64)> = out
            .deltas
            .iter()
            .map(|d| (d.stream.as_ref().unwrap().stream_id.clone(), d.seq))
            .collect();
        assert_eq!(kept, vec![("a".into(), 6), ("b".into(), 1)]);
        let stale = KvDeltaBatch {
            batch_id: 1,
            deltas: vec![delta("a", 4)],
        };
        assert!(c.filter(&stale).is_none());
    }

    #[tokio::test]
    async fn resolve_keeps_ip_literals_and_expands_names() {
        assert_eq!(
            resolve("http://127.0.0.1:50051").await,
            vec!["http://127.0.0.1:50051".to_string()]
        );
        assert_eq!(
            resolve("http://[::1]:50051").await,
            vec!["http://[::1]:50051".to_string()]
        );
        let local = resolve("http://localhost:50051").await;
        assert!(!local.is_empty());
        assert!(local
            .iter()
            .all(|u| u == "http://127.0.0.1:50051" || u == "http://[::1]:50051"));
        assert_eq!(resolve("not a url").await, vec!["not a url".to_string()]);
    }
}
