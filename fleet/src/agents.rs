//! Simulated node agents: one task and one HTTP/2 connection each, speaking
//! `AgentService.Connect` the way `ic-agent` does (`agent/src/link`): the same Hello and opening
//! resync (`ic_shared::link`), chunked by the same rule, a fresh resync on `ResyncRequest`, and
//! the agent's reconnect backoff (250 ms doubling to 5 s, reset after a stream was up).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_shared::proto::{
    agent_message::Msg, agent_service_client::AgentServiceClient, controller_message, AgentMessage,
    KvDeltaBatch,
};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::spec::FleetSpec;

/// `ic-agent`'s `LinkConfig::new` reconnect backoff.
const BACKOFF_INITIAL: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What the fleet's agents saw, for the report.
#[derive(Debug, Default)]
pub struct FleetStats {
    /// Streams open now.
    pub connected: AtomicUsize,
    /// Streams opened so far.
    pub connects: AtomicU64,
    /// Streams that ended (for any reason) so far.
    pub ended: AtomicU64,
    /// Connection attempts that failed before a stream opened.
    pub connect_failures: AtomicU64,
    /// `ResyncRequest`s received.
    pub resync_requests: AtomicU64,
    /// Delta batches sent / acked.
    pub batches_sent: AtomicU64,
    /// Delta batches acked.
    pub batches_acked: AtomicU64,
    /// The last few distinct errors that ended a stream.
    pub errors: Mutex<Vec<String>>,
}

impl FleetStats {
    fn error(&self, e: String) {
        let mut v = self.errors.lock();
        if v.len() < 8 && !v.contains(&e) {
            v.push(e);
        }
    }
}

/// Agent-side state shared with the lookup client: the epoch of every agent (which prompts
/// are live).
pub struct Fleet {
    /// The fleet's shape.
    pub spec: FleetSpec,
    /// Per agent: prompts `epoch .. epoch + sequences` are live.
    pub epochs: Vec<AtomicU64>,
    /// Counters.
    pub stats: FleetStats,
    /// Churn: one prompt replaced per stream every this many ms (0 = none). Changed between
    /// phases.
    pub churn_every_ms: AtomicU64,
    /// Set to stop every agent.
    pub stop: AtomicBool,
}

impl Fleet {
    /// A fleet at epoch 0.
    pub fn new(spec: FleetSpec) -> Arc<Self> {
        Arc::new(Fleet {
            epochs: (0..spec.agents).map(|_| AtomicU64::new(0)).collect(),
            spec,
            stats: FleetStats::default(),
            churn_every_ms: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        })
    }
}

/// Runs agent `a` against `url` until [`Fleet::stop`].
pub async fn run_agent(fleet: Arc<Fleet>, a: usize, url: String) {
    let instance = format!("fleet-{:x}-{a}", std::process::id());
    let node = fleet.spec.node(a);
    let mut delay = BACKOFF_INITIAL;
    while !fleet.stop.load(Ordering::Relaxed) {
        let (was_up, result) = session(&fleet, a, &url, &node, &instance).await;
        if let Err(e) = result {
            fleet.stats.error(e);
        }
        if was_up {
            delay = BACKOFF_INITIAL;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(BACKOFF_MAX);
    }
}

/// The agent's Hello (`ic_shared::link::hello`, as `ic-agent` sends it in standalone mode: no
/// token).
fn hello(node: &str, instance: &str) -> AgentMessage {
    ic_shared::link::hello(ic_shared::link::HelloFields {
        node,
        boot_id: "fleet-boot",
        version: env!("CARGO_PKG_VERSION"),
        token: "",
        agent_instance: instance,
        pod_subscriber: None,
    })
}

/// The agent's full resync at its current epoch, chunked as `ic_shared::link::opening` does.
fn resync(fleet: &Fleet, a: usize) -> Vec<AgentMessage> {
    let epoch = fleet.epochs[a].load(Ordering::Acquire);
    ic_shared::resync::chunk_resync(fleet.spec.snapshots(a, epoch))
}

/// One stream: (whether it opened, why it ended).
async fn session(
    fleet: &Arc<Fleet>,
    a: usize,
    url: &str,
    node: &str,
    instance: &str,
) -> (bool, Result<(), String>) {
    let stats = &fleet.stats;
    let endpoint = match tonic::transport::Endpoint::from_shared(url.to_string()) {
        Ok(e) => e
            .connect_timeout(Duration::from_secs(3))
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_while_idle(true),
        Err(e) => return (false, Err(format!("bad URL: {e}"))),
    };
    let channel = match endpoint.connect().await {
        Ok(c) => c,
        Err(e) => {
            stats.connect_failures.fetch_add(1, Ordering::Relaxed);
            return (false, Err(format!("connect: {e}")));
        }
    };
    let mut client = AgentServiceClient::new(channel).max_decoding_message_size(64 * 1024 * 1024);
    // Depth 1: the resync is built once the stream has taken Hello (a storm of 5 000 agents
    // must not hold 5 000 decoded resyncs in the generator while their connections queue).
    let (tx, rx) = mpsc::channel::<AgentMessage>(1);
    let feed = {
        let tx = tx.clone();
        let fleet = fleet.clone();
        let hello = hello(node, instance);
        tokio::spawn(async move {
            if tx.send(hello).await.is_err() {
                return;
            }
            let Ok(permit) = tx.reserve().await else {
                return;
            };
            let mut msgs = resync(&fleet, a).into_iter();
            if let Some(first) = msgs.next() {
                permit.send(first);
            }
            for m in msgs {
                if tx.send(m).await.is_err() {
                    return;
                }
            }
        })
    };
    let response = match client.connect(ReceiverStream::new(rx)).await {
        Ok(r) => r,
        Err(e) => {
            feed.abort();
            stats.connect_failures.fetch_add(1, Ordering::Relaxed);
            return (false, Err(format!("Connect: {}", e.message())));
        }
    };
    let mut inbound = response.into_inner();
    stats.connected.fetch_add(1, Ordering::Relaxed);
    stats.connects.fetch_add(1, Ordering::Relaxed);
    let end = stream_loop(fleet, a, &tx, &mut inbound).await;
    stats.connected.fetch_sub(1, Ordering::Relaxed);
    stats.ended.fetch_add(1, Ordering::Relaxed);
    feed.abort();
    (true, end)
}

async fn stream_loop(
    fleet: &Fleet,
    a: usize,
    tx: &mpsc::Sender<AgentMessage>,
    inbound: &mut tonic::Streaming<ic_shared::proto::ControllerMessage>,
) -> Result<(), String> {
    let stats = &fleet.stats;
    let mut batch_id = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_churn = tokio::time::Instant::now();
    loop {
        if fleet.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(m)) => match m.msg {
                    Some(controller_message::Msg::ResyncRequest(_)) => {
                        stats.resync_requests.fetch_add(1, Ordering::Relaxed);
                        for m in resync(fleet, a) {
                            tx.send(m).await.map_err(|_| "outbound closed".to_string())?;
                        }
                    }
                    Some(controller_message::Msg::Ack(_)) => {
                        stats.batches_acked.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                },
                Ok(None) => return Err("controller closed the stream".into()),
                Err(st) => return Err(format!("{:?}: {}", st.code(), st.message())),
            },
            _ = tick.tick() => {
                let every = fleet.churn_every_ms.load(Ordering::Relaxed);
                if every == 0 || last_churn.elapsed() < Duration::from_millis(every) {
                    continue;
                }
                last_churn = tokio::time::Instant::now();
                let epoch = fleet.epochs[a].load(Ordering::Acquire);
                batch_id += 1;
                let batch = KvDeltaBatch { batch_id, deltas: fleet.spec.churn(a, epoch) };
                tx.send(AgentMessage { msg: Some(Msg::KvDeltas(batch)) })
                    .await
                    .map_err(|_| "outbound closed".to_string())?;
                fleet.epochs[a].store(epoch + 1, Ordering::Release);
                stats.batches_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
