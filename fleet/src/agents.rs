//! Simulated node agents: one task and one HTTP/2 connection each, speaking
//! `AgentService.Connect` the way `ic-agent` does (`agent/src/link`): the same Hello and opening
//! resync (`ic_shared::link`), chunked by the same rule, a fresh resync on `ResyncRequest`, a
//! `CoverageHeartbeat` every second (Hello announces `coverage-heartbeat`, so the controller
//! holds the simulated agents to its heartbeat bound as it holds real ones), and the agent's
//! reconnect back-off (`backon`: 250 ms doubling to 5 s, each wait plus a random jitter of up to
//! as much again, afresh after a stream was up).
//!
//! Each agent's resync is built and protobuf-encoded once per epoch and kept as bytes
//! ([`Fleet::resync_frames`]); every (re)connect resends those bytes through
//! [`PreEncodedCodec`], so a reconnect storm costs the generator a copy per message, not a
//! rebuild and re-encode of every entry (what made the generator, not the controller, the
//! bound of the storm's wall clock).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_shared::proto::{
    agent_message::Msg, controller_message, AgentMessage, ControllerMessage, CoverageHeartbeat,
    KvDeltaBatch,
};
use parking_lot::Mutex;
use prost::bytes::BufMut;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;

use crate::spec::FleetSpec;

/// `ic-agent`'s `LinkConfig::new` reconnect back-off: the first wait (before jitter).
const BACKOFF_INITIAL: Duration = Duration::from_millis(250);
/// `ic-agent`'s `LinkConfig::new` reconnect back-off: the cap of the doubling (before jitter).
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The waits between one simulated agent's reconnect attempts, as `ic-agent`'s
/// `link::reconnect_delays` draws them for its default `LinkConfig`: [`BACKOFF_INITIAL`]
/// doubling per failure up to [`BACKOFF_MAX`], each plus a random jitter of up to the same
/// again (`backon`, seeded per schedule), never exhausted. Without the jitter every simulated
/// agent would come back in the same instant at each doubling after a controller restart, a
/// storm no real fleet sends.
pub fn reconnect_delays() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(BACKOFF_INITIAL)
        .with_max_delay(BACKOFF_MAX)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

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

/// One agent's resync: each message's protobuf encoding, in sending order.
pub type Frames = Arc<[Arc<[u8]>]>;

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
    /// Per agent: its encoded resync messages and the epoch they were built at.
    frames: Vec<Mutex<Option<(u64, Frames)>>>,
}

impl Fleet {
    /// A fleet at epoch 0.
    pub fn new(spec: FleetSpec) -> Arc<Self> {
        Arc::new(Fleet {
            epochs: (0..spec.agents).map(|_| AtomicU64::new(0)).collect(),
            frames: (0..spec.agents).map(|_| Mutex::new(None)).collect(),
            spec,
            stats: FleetStats::default(),
            churn_every_ms: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        })
    }

    /// Agent `a`'s full resync at its current epoch as encoded `AgentMessage`s, chunked as
    /// `ic_shared::link::opening` does (`ic_shared::resync::chunk_resync`): built and encoded on
    /// the first call of an epoch, the same bytes on every later one.
    pub fn resync_frames(&self, a: usize) -> Frames {
        let epoch = self.epochs[a].load(Ordering::Acquire);
        let Some(cell) = self.frames.get(a) else {
            return Arc::from(Vec::new());
        };
        let mut cell = cell.lock();
        if let Some((e, frames)) = cell.as_ref() {
            if *e == epoch {
                return frames.clone();
            }
        }
        let frames: Frames = ic_shared::resync::chunk_resync(self.spec.snapshots(a, epoch))
            .iter()
            .map(|m| Arc::from(m.encode_to_vec()))
            .collect();
        *cell = Some((epoch, frames.clone()));
        frames
    }
}

/// One outbound message of an agent stream: a message to encode, or one encoded before.
#[derive(Debug, Clone)]
pub enum Frame {
    /// Encoded on the way out (Hello, delta batches).
    Msg(AgentMessage),
    /// The protobuf encoding of an `AgentMessage` (a cached resync message).
    Encoded(Arc<[u8]>),
}

/// `AgentService.Connect`'s codec with pre-encoded outbound messages: [`Frame::Encoded`] bytes
/// are copied into the gRPC frame as they are (they are an `AgentMessage`'s protobuf encoding),
/// [`Frame::Msg`] is encoded by prost; inbound `ControllerMessage`s are decoded by prost.
#[derive(Debug, Clone, Copy, Default)]
pub struct PreEncodedCodec;

/// The encoder of [`PreEncodedCodec`].
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameEncoder;

/// The decoder of [`PreEncodedCodec`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ControllerDecoder;

impl Codec for PreEncodedCodec {
    type Encode = Frame;
    type Decode = ControllerMessage;
    type Encoder = FrameEncoder;
    type Decoder = ControllerDecoder;
    fn encoder(&mut self) -> FrameEncoder {
        FrameEncoder
    }
    fn decoder(&mut self) -> ControllerDecoder {
        ControllerDecoder
    }
}

impl Encoder for FrameEncoder {
    type Item = Frame;
    type Error = tonic::Status;
    fn encode(&mut self, item: Frame, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        match item {
            Frame::Msg(m) => m
                .encode(dst)
                .map_err(|e| tonic::Status::internal(format!("encode: {e}"))),
            Frame::Encoded(b) => {
                dst.put_slice(&b);
                Ok(())
            }
        }
    }
}

impl Decoder for ControllerDecoder {
    type Item = ControllerMessage;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut DecodeBuf<'_>,
    ) -> Result<Option<ControllerMessage>, tonic::Status> {
        ControllerMessage::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(format!("decode: {e}")))
    }
}

/// The method path of `AgentService.Connect` (as the generated client names it).
const CONNECT_PATH: &str = "/inferencecache.v1alpha1.AgentService/Connect";

/// Runs agent `a` against `url` until [`Fleet::stop`].
pub async fn run_agent(fleet: Arc<Fleet>, a: usize, url: String) {
    let instance = format!("fleet-{:x}-{a}", std::process::id());
    let node = fleet.spec.node(a);
    let mut delays = reconnect_delays();
    while !fleet.stop.load(Ordering::Relaxed) {
        let (was_up, result) = session(&fleet, a, &url, &node, &instance).await;
        if let Err(e) = result {
            fleet.stats.error(e);
        }
        if was_up {
            delays = reconnect_delays();
        }
        tokio::time::sleep(delays.next().unwrap_or(BACKOFF_MAX)).await;
    }
}

/// The agent's Hello (`ic_shared::link::hello`, as `ic-agent` sends it in standalone mode: no
/// token), announcing [`ic_shared::link::COVERAGE_HEARTBEAT`] as `ic-agent`'s link does: every
/// stream sends [`heartbeat`] each [`ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL`].
fn hello(node: &str, instance: &str) -> AgentMessage {
    let mut m = ic_shared::link::hello(ic_shared::link::HelloFields {
        node,
        boot_id: "fleet-boot",
        version: env!("CARGO_PKG_VERSION"),
        token: "",
        agent_instance: instance,
        pod_subscriber: None,
    });
    if let Some(Msg::Hello(h)) = m.msg.as_mut() {
        h.capabilities
            .push(ic_shared::link::COVERAGE_HEARTBEAT.to_string());
    }
    m
}

/// The `CoverageHeartbeat` `ic-agent` sends every
/// [`ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL`] (its `interval_ms` is that interval).
fn heartbeat() -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Heartbeat(CoverageHeartbeat {
            interval_ms: u32::try_from(ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL.as_millis())
                .unwrap_or(u32::MAX),
        })),
    }
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
    let mut client = tonic::client::Grpc::new(channel).max_decoding_message_size(64 * 1024 * 1024);
    // Depth 1: the resync is queued once the stream has taken Hello (its first build happens
    // then, not while 5 000 connections queue).
    let (tx, rx) = mpsc::channel::<Frame>(1);
    let feed = {
        let tx = tx.clone();
        let fleet = fleet.clone();
        let hello = hello(node, instance);
        tokio::spawn(async move {
            if tx.send(Frame::Msg(hello)).await.is_err() {
                return;
            }
            let Ok(permit) = tx.reserve().await else {
                return;
            };
            let frames = fleet.resync_frames(a);
            let mut msgs = frames.iter();
            if let Some(first) = msgs.next() {
                permit.send(Frame::Encoded(first.clone()));
            }
            for m in msgs {
                if tx.send(Frame::Encoded(m.clone())).await.is_err() {
                    return;
                }
            }
        })
    };
    if let Err(e) = client.ready().await {
        feed.abort();
        stats.connect_failures.fetch_add(1, Ordering::Relaxed);
        return (false, Err(format!("connect: {e}")));
    }
    let response = match client
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            PathAndQuery::from_static(CONNECT_PATH),
            PreEncodedCodec,
        )
        .await
    {
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
    tx: &mpsc::Sender<Frame>,
    inbound: &mut tonic::Streaming<ControllerMessage>,
) -> Result<(), String> {
    let stats = &fleet.stats;
    let mut batch_id = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_churn = tokio::time::Instant::now();
    // Heartbeats at a fixed cadence, whatever else is sent (as `ic-agent`'s link): the
    // controller's clock of this stream's liveness. A late tick is sent once, not in a burst.
    let mut heartbeat_tick = tokio::time::interval(ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL);
    heartbeat_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if fleet.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(m)) => match m.msg {
                    Some(controller_message::Msg::ResyncRequest(_)) => {
                        stats.resync_requests.fetch_add(1, Ordering::Relaxed);
                        for m in fleet.resync_frames(a).iter() {
                            tx.send(Frame::Encoded(m.clone()))
                                .await
                                .map_err(|_| "outbound closed".to_string())?;
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
            _ = heartbeat_tick.tick() => {
                // try_send, as `ic-agent` does: a full outbound queue means the stream is busy
                // sending (the controller hears those messages); a heartbeat behind them adds
                // nothing.
                if let Err(mpsc::error::TrySendError::Closed(_)) =
                    tx.try_send(Frame::Msg(heartbeat()))
                {
                    return Err("outbound closed".into());
                }
            }
            _ = tick.tick() => {
                let every = fleet.churn_every_ms.load(Ordering::Relaxed);
                if every == 0 || last_churn.elapsed() < Duration::from_millis(every) {
                    continue;
                }
                last_churn = tokio::time::Instant::now();
                let epoch = fleet.epochs[a].load(Ordering::Acquire);
                batch_id += 1;
                let batch = KvDeltaBatch { batch_id, deltas: fleet.spec.churn(a, epoch) };
                tx.send(Frame::Msg(AgentMessage { msg: Some(Msg::KvDeltas(batch)) }))
                    .await
                    .map_err(|_| "outbound closed".to_string())?;
                fleet.epochs[a].store(epoch + 1, Ordering::Release);
                stats.batches_sent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn cached_resync_bytes_are_the_agents_resync_and_follow_its_epoch() {
        // Large enough to be chunked (several messages), as the real agent chunks it.
        let fleet = Fleet::new(FleetSpec::new(2, 400_000, 8, 2, 32, 32));
        let frames = fleet.resync_frames(1);
        let want = ic_shared::resync::chunk_resync(fleet.spec.snapshots(1, 0));
        assert!(want.len() > 1, "the resync is chunked");
        let decoded: Vec<AgentMessage> = frames
            .iter()
            .map(|b| AgentMessage::decode(&b[..]).unwrap())
            .collect();
        // The same messages but for the snapshot timestamp (taken when each was built).
        let strip = |mut m: AgentMessage| {
            if let Some(Msg::ResyncChunk(c)) = m.msg.as_mut() {
                c.streams.iter_mut().for_each(|s| s.last_event_unix_ms = 0);
            }
            if let Some(Msg::Resync(r)) = m.msg.as_mut() {
                r.streams.iter_mut().for_each(|s| s.last_event_unix_ms = 0);
            }
            m
        };
        assert_eq!(
            decoded.into_iter().map(strip).collect::<Vec<_>>(),
            want.into_iter().map(strip).collect::<Vec<_>>()
        );
        // The same bytes on the next call; new ones once the agent's epoch moves (churn).
        assert!(Arc::ptr_eq(&frames, &fleet.resync_frames(1)));
        fleet.epochs[1].store(1, Ordering::Release);
        let next = fleet.resync_frames(1);
        assert!(!Arc::ptr_eq(&frames, &next));
        let first = AgentMessage::decode(&next[0][..]).unwrap();
        let Some(Msg::ResyncChunk(c)) = first.msg else {
            panic!("not a chunk");
        };
        assert_eq!(c.streams[0].seq, 1);
    }

    /// The simulated agent announces and sends the heartbeat as `ic-agent` does: without the
    /// capability the controller would not hold it to its bound, and a fleet run would not
    /// carry the heartbeat traffic a real fleet sends.
    #[test]
    fn hello_announces_the_heartbeat_that_the_stream_sends() {
        let Some(Msg::Hello(h)) = hello("n", "i").msg else {
            panic!("not a Hello");
        };
        assert!(
            h.capabilities
                .iter()
                .any(|c| c == ic_shared::link::COVERAGE_HEARTBEAT),
            "{:?}",
            h.capabilities
        );
        let Some(Msg::Heartbeat(hb)) = heartbeat().msg else {
            panic!("not a heartbeat");
        };
        assert_eq!(hb.interval_ms, 1000);
    }

    /// The reconnect schedule is `ic-agent`'s: 250 ms doubling to 5 s, never exhausted, each
    /// wait plus a jitter of up to as much again, drawn afresh per schedule (two simulated
    /// agents must not wait alike).
    #[test]
    fn reconnect_delays_double_to_the_cap_with_jitter_drawn_per_schedule() {
        let a: Vec<Duration> = reconnect_delays().take(40).collect();
        assert_eq!(a.len(), 40, "never exhausted");
        for (i, d) in a.iter().enumerate() {
            let base = (BACKOFF_INITIAL * 2u32.pow(i.min(10) as u32)).min(BACKOFF_MAX);
            assert!(
                *d >= base && *d <= base * 2,
                "delay {i}: {d:?} outside [{base:?}, {:?}]",
                base * 2
            );
        }
        let b: Vec<Duration> = reconnect_delays().take(40).collect();
        assert_ne!(a, b, "two schedules drew the same jitter");
    }
}
