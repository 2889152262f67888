//! One engine publisher's subscriber: a ZMQ SUB socket, a bounded queue, and a processor that
//! checks sequence numbers, heals gaps by replay and feeds [`StreamState`].
//!
//! Two tasks per stream:
//!
//! - the **reader** owns the SUB socket (subscribed to the topic prefix before it connects, and
//!   polled from the moment it exists, so the subscription always reaches the publisher). It
//!   connects with exponential backoff ([`SubscriberOptions::reconnect_initial`] doubling up to
//!   [`SubscriberOptions::reconnect_max`]); once connected, the socket itself reconnects after a
//!   publisher restart and re-sends the subscription. Each message goes into a bounded queue
//!   ([`SubscriberOptions::queue_capacity`]); when it is full the message is dropped and counted
//!   (`queue_full`) — the processor then sees a sequence gap and replays it.
//! - the **processor** takes messages `[topic, seq (8 bytes big-endian), payload]` and applies
//!   them in order: a gap is replayed from the replay endpoint (DEALER sends `["", start]`, replies
//!   `["", seq, payload]` or `["", topic, seq, payload]` up to an end marker of seq `u64::MAX`);
//!   the replay must cover every missing seq, else the replica is cleared (`SequenceGap`) and
//!   marked stale. A sequence at or below the last one clears it (`EngineRestarted`). The first
//!   message of an engine incarnation with seq > 0 triggers a *bootstrap* replay from 0 when a
//!   replay endpoint exists, so a subscriber that starts after the engine learns the blocks
//!   stored before it (the publisher sends nothing at start, only replay can tell).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use ic_shared::kv::decode::decode_batch;
use ic_shared::proto::StreamDescriptor;
use thiserror::Error;
use tokio::sync::{mpsc, Notify};
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::metrics::KvMetrics;
use super::stream::{
    ApplyReport, SeqCheck, StreamConfig, StreamState, CLEAR_ENGINE_RESTARTED, CLEAR_SEQUENCE_GAP,
};

/// Everything that identifies one planned stream; a change of any field restarts it.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSpec {
    /// Identity sent with deltas and snapshots.
    pub descriptor: StreamDescriptor,
    /// PUB endpoint the SUB connects to.
    pub endpoint: String,
    /// ROUTER replay endpoint, if the engine has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix filter (empty = everything).
    pub topic: String,
    /// State-machine configuration (plan facts and limits).
    pub config: StreamConfig,
}

/// Timing and sizing of subscribers.
#[derive(Debug, Clone)]
pub struct SubscriberOptions {
    /// Messages buffered between the socket and the processor before dropping (default 8192).
    pub queue_capacity: usize,
    /// Limit of one connect attempt (default 5 s).
    pub connect_timeout: Duration,
    /// First reconnect delay after a failed connect (default 200 ms), doubled per failure.
    pub reconnect_initial: Duration,
    /// Largest reconnect delay (default 5 s).
    pub reconnect_max: Duration,
    /// Longest wait for each replay reply, and for the replay connect (default 3 s).
    pub replay_timeout: Duration,
    /// Most batches accepted from one replay (default 20000; engines buffer 10000).
    pub replay_max_batches: usize,
    /// Replay from seq 0 when the first message of an engine incarnation has seq > 0 (default
    /// true).
    pub bootstrap_replay: bool,
}

impl Default for SubscriberOptions {
    fn default() -> Self {
        Self {
            queue_capacity: 8192,
            connect_timeout: Duration::from_secs(5),
            reconnect_initial: Duration::from_millis(200),
            reconnect_max: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(3),
            replay_max_batches: 20_000,
            bootstrap_replay: true,
        }
    }
}

/// Counters shown in `/v1/report`.
#[derive(Debug, Default, Clone)]
pub(crate) struct StreamStats {
    pub batches_received: u64,
    pub batches_replayed: u64,
    pub batches_decoded: u64,
    pub events_decoded: u64,
    pub dropped: u64,
    pub dropped_by_reason: std::collections::BTreeMap<&'static str, u64>,
    pub gaps: u64,
    pub replays: u64,
    pub replays_failed: u64,
    pub resyncs: u64,
    pub last_message_unix_ms: Option<i64>,
    pub reported_dp_rank: Option<u32>,
    pub last_error: Option<String>,
}

/// State shared by a stream's tasks and the hub.
pub(crate) struct StreamInner {
    pub state: StreamState,
    pub stats: StreamStats,
}

/// One stream as the hub holds it.
pub(crate) struct StreamShared {
    pub spec: StreamSpec,
    pub inner: Mutex<StreamInner>,
    pub connected: AtomicBool,
}

impl StreamShared {
    pub fn new(spec: StreamSpec) -> Self {
        let state = StreamState::new(spec.config.clone());
        Self {
            spec,
            inner: Mutex::new(StreamInner {
                state,
                stats: StreamStats::default(),
            }),
            connected: AtomicBool::new(false),
        }
    }

    /// Locks the state; a poisoned lock (a panic elsewhere) is taken over as is.
    pub fn lock(&self) -> MutexGuard<'_, StreamInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn id(&self) -> &str {
        &self.spec.descriptor.stream_id
    }
}

/// Everything a stream's tasks report to.
#[derive(Clone)]
pub(crate) struct Sink {
    pub metrics: KvMetrics,
    pub notify: Arc<Notify>,
}

/// Handles of a running stream's tasks; dropping it stops them (and closes the sockets).
pub(crate) struct Running {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts the reader and processor of one stream on `rt`.
pub(crate) fn spawn(
    rt: &tokio::runtime::Handle,
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
) -> Running {
    let (tx, rx) = mpsc::channel(opts.queue_capacity.max(1));
    let reader = rt.spawn(read_loop(shared.clone(), sink.clone(), opts.clone(), tx));
    let processor = rt.spawn(process_loop(shared, sink, opts, rx));
    Running {
        tasks: vec![reader, processor],
    }
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn set_connected(shared: &StreamShared, sink: &Sink, on: bool) {
    shared.connected.store(on, Ordering::Relaxed);
    sink.metrics
        .connected
        .with_label_values(&[shared.id()])
        .set(i64::from(on));
}

fn record_drop(shared: &StreamShared, sink: &Sink, reason: &'static str, n: u64) {
    if n == 0 {
        return;
    }
    sink.metrics
        .dropped
        .with_label_values(&[shared.id(), reason])
        .inc_by(n);
    let mut g = shared.lock();
    g.stats.dropped += n;
    *g.stats.dropped_by_reason.entry(reason).or_default() += n;
}

async fn read_loop(
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    tx: mpsc::Sender<ZmqMessage>,
) {
    let id = shared.id().to_string();
    let mut backoff = opts.reconnect_initial;
    set_connected(&shared, &sink, false);
    // Connect with backoff; once connected, the socket reconnects by itself (re-sending the
    // subscription) whenever the publisher goes away.
    let (mut sock, mut monitor) = loop {
        let mut zopts = SocketOptions::default();
        zopts.connect_timeout(opts.connect_timeout);
        let mut sock = SubSocket::with_options(zopts);
        let monitor = sock.monitor();
        if let Err(e) = sock.subscribe(&shared.spec.topic).await {
            shared.lock().stats.last_error = Some(format!("subscribe: {e}"));
        }
        let attempt = tokio::time::timeout(
            opts.connect_timeout + Duration::from_secs(1),
            sock.connect(&shared.spec.endpoint),
        )
        .await;
        let error = match attempt {
            Ok(Ok(())) => break (sock, monitor),
            Ok(Err(e)) => format!("connect {}: {e}", shared.spec.endpoint),
            Err(_) => format!("connect {}: timed out", shared.spec.endpoint),
        };
        tracing::debug!(stream = %id, "kv events: {error}");
        shared.lock().stats.last_error = Some(error);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(opts.reconnect_max);
    };
    tracing::info!(stream = %id, endpoint = %shared.spec.endpoint, "kv events: connected");
    set_connected(&shared, &sink, true);
    {
        let mut monitor_open = true;
        loop {
            tokio::select! {
                msg = sock.recv() => match msg {
                    Ok(m) => {
                        sink.metrics.received.with_label_values(&[&id, "live"]).inc();
                        {
                            let mut g = shared.lock();
                            g.stats.batches_received += 1;
                            g.stats.last_message_unix_ms = Some(now_unix_ms());
                        }
                        match tx.try_send(m) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(_)) => {
                                record_drop(&shared, &sink, "queue_full", 1);
                            }
                            Err(mpsc::error::TrySendError::Closed(_)) => return,
                        }
                    }
                    Err(e) => {
                        shared.lock().stats.last_error = Some(format!("recv: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                ev = monitor.next(), if monitor_open => match ev {
                    Some(SocketEvent::Disconnected(_)) => set_connected(&shared, &sink, false),
                    Some(SocketEvent::Connected(_, _)) => set_connected(&shared, &sink, true),
                    Some(_) => {}
                    None => monitor_open = false,
                },
            }
        }
    }
}

/// A message's engine seq and payload, or the drop reason.
fn split_live(msg: ZmqMessage) -> Result<(u64, Vec<u8>), &'static str> {
    let frames = msg.into_vec();
    if frames.len() != 3 {
        return Err("bad_frames");
    }
    let seq: [u8; 8] = frames[1].as_ref().try_into().map_err(|_| "bad_seq")?;
    Ok((u64::from_be_bytes(seq), frames[2].to_vec()))
}

async fn process_loop(
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    mut rx: mpsc::Receiver<ZmqMessage>,
) {
    let id = shared.id().to_string();
    while let Some(msg) = rx.recv().await {
        let (seq, payload) = match split_live(msg) {
            Ok(x) => x,
            Err(reason) => {
                record_drop(&shared, &sink, reason, 1);
                continue;
            }
        };
        let check = shared.lock().state.check_seq(seq);
        let replay_ep = shared.spec.replay_endpoint.clone();
        match check {
            SeqCheck::InOrder => {}
            SeqCheck::Restarted => {
                tracing::info!(stream = %id, seq, "kv events: engine restarted (seq went back)");
                {
                    let mut g = shared.lock();
                    g.state.restart();
                    g.stats.resyncs += 1;
                }
                sink.metrics
                    .resyncs
                    .with_label_values(&[&id, CLEAR_ENGINE_RESTARTED])
                    .inc();
                bootstrap(&shared, &sink, &opts, replay_ep.as_deref(), seq).await;
            }
            SeqCheck::First => {
                bootstrap(&shared, &sink, &opts, replay_ep.as_deref(), seq).await;
            }
            SeqCheck::Gap { from } => {
                tracing::info!(stream = %id, from, to = seq, "kv events: sequence gap");
                sink.metrics.gaps.with_label_values(&[&id]).inc();
                shared.lock().stats.gaps += 1;
                let healed = match replay_ep.as_deref() {
                    Some(ep) => heal(&shared, &sink, &opts, ep, from, seq).await,
                    None => false,
                };
                if !healed {
                    {
                        let mut g = shared.lock();
                        g.state.mark_gap(seq);
                        g.stats.resyncs += 1;
                    }
                    sink.metrics
                        .resyncs
                        .with_label_values(&[&id, CLEAR_SEQUENCE_GAP])
                        .inc();
                }
            }
        }
        apply_payload(&shared, &sink, seq, &payload, true);
        if shared.lock().state.has_pending() {
            sink.notify.notify_one();
        }
    }
}

/// Replays `[0, seq)` for a stream that starts mid-incarnation; applies the contiguous run it
/// gets. Failure is not an error: the stream simply starts from `seq`.
async fn bootstrap(
    shared: &StreamShared,
    sink: &Sink,
    opts: &SubscriberOptions,
    replay_ep: Option<&str>,
    seq: u64,
) {
    let Some(ep) = replay_ep else { return };
    if seq == 0 || !opts.bootstrap_replay {
        return;
    }
    let id = shared.id();
    match request_replay(ep, 0, seq, opts).await {
        Ok(batches) => {
            sink.metrics
                .replays
                .with_label_values(&[id, "bootstrap"])
                .inc();
            shared.lock().stats.replays += 1;
            let mut next: Option<u64> = None;
            for (r, payload) in batches {
                if r >= seq || next.is_some_and(|n| r != n) {
                    break;
                }
                count_replayed(shared, sink);
                apply_payload(shared, sink, r, &payload, false);
                next = Some(r + 1);
            }
        }
        Err(e) => {
            sink.metrics
                .replays
                .with_label_values(&[id, "failed"])
                .inc();
            let mut g = shared.lock();
            g.stats.replays_failed += 1;
            g.stats.last_error = Some(format!("bootstrap replay: {e}"));
        }
    }
}

/// Replays `[from, upto)`; applies it and returns true only if every missing batch came back.
async fn heal(
    shared: &StreamShared,
    sink: &Sink,
    opts: &SubscriberOptions,
    ep: &str,
    from: u64,
    upto: u64,
) -> bool {
    let id = shared.id();
    let result = request_replay(ep, from, upto, opts).await;
    let batches = match result {
        Ok(b) => b,
        Err(e) => {
            sink.metrics
                .replays
                .with_label_values(&[id, "failed"])
                .inc();
            let mut g = shared.lock();
            g.stats.replays_failed += 1;
            g.stats.last_error = Some(format!("replay from {from}: {e}"));
            return false;
        }
    };
    let mut expected = from;
    let mut keep = Vec::new();
    for (r, payload) in batches {
        if r < expected {
            continue;
        }
        if r >= upto {
            break;
        }
        if r != expected {
            break;
        }
        keep.push((r, payload));
        expected += 1;
    }
    if expected != upto {
        sink.metrics
            .replays
            .with_label_values(&[id, "failed"])
            .inc();
        let mut g = shared.lock();
        g.stats.replays_failed += 1;
        g.stats.last_error = Some(format!(
            "replay from {from}: not contiguous up to {upto} (stopped before {expected})"
        ));
        return false;
    }
    sink.metrics
        .replays
        .with_label_values(&[id, "healed"])
        .inc();
    shared.lock().stats.replays += 1;
    for (r, payload) in keep {
        count_replayed(shared, sink);
        apply_payload(shared, sink, r, &payload, false);
    }
    true
}

fn count_replayed(shared: &StreamShared, sink: &Sink) {
    sink.metrics
        .received
        .with_label_values(&[shared.id(), "replay"])
        .inc();
    shared.lock().stats.batches_replayed += 1;
}

/// Decodes and applies one batch, recording metrics. `live` batches (not replayed ones) set the
/// stream-lag gauge.
fn apply_payload(shared: &StreamShared, sink: &Sink, seq: u64, payload: &[u8], live: bool) {
    let id = shared.id();
    match decode_batch(payload) {
        Ok(batch) => {
            sink.metrics.decoded.with_label_values(&[id]).inc();
            if live && batch.ts.is_finite() && batch.ts > 0.0 {
                let lag = now_unix_ms() as f64 / 1000.0 - batch.ts;
                sink.metrics.lag.with_label_values(&[id]).set(lag);
            }
            let (report, held) = {
                let mut g = shared.lock();
                let report = g.state.apply(seq, &batch, now_unix_ms());
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
            shared.lock().state.note_undecodable(seq);
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

/// Why a replay request failed.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// The replay socket could not be reached.
    #[error("connect: {0}")]
    Connect(String),
    /// Sending the request or receiving a reply failed.
    #[error("socket: {0}")]
    Socket(String),
    /// No reply (or no end marker) within the timeout.
    #[error("timed out waiting for replies")]
    Timeout,
    /// A reply had fewer than 2 frames or a seq frame that is not 8 bytes.
    #[error("malformed reply")]
    BadReply,
    /// More batches than [`SubscriberOptions::replay_max_batches`].
    #[error("more than {0} batches")]
    TooMany(usize),
}

/// Requests a replay from `start` on a fresh DEALER connected to `endpoint` and collects
/// `(seq, payload)` pairs up to the end marker. Replies at or past `upto` are not needed, so
/// collection stops at the first one (the engine keeps sending; the socket is then closed).
pub async fn request_replay(
    endpoint: &str,
    start: u64,
    upto: u64,
    opts: &SubscriberOptions,
) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
    let mut zopts = SocketOptions::default();
    zopts.connect_timeout(opts.replay_timeout);
    let mut sock = DealerSocket::with_options(zopts);
    match tokio::time::timeout(
        opts.replay_timeout + Duration::from_millis(500),
        sock.connect(endpoint),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(ReplayError::Connect(e.to_string())),
        Err(_) => return Err(ReplayError::Connect("timed out".into())),
    }
    let mut req = ZmqMessage::from(Vec::<u8>::new());
    req.push_back(start.to_be_bytes().to_vec().into());
    sock.send(req)
        .await
        .map_err(|e| ReplayError::Socket(e.to_string()))?;
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(opts.replay_timeout, sock.recv())
            .await
            .map_err(|_| ReplayError::Timeout)?
            .map_err(|e| ReplayError::Socket(e.to_string()))?;
        let frames = msg.into_vec();
        let n = frames.len();
        if n < 2 {
            return Err(ReplayError::BadReply);
        }
        let seq: [u8; 8] = frames[n - 2]
            .as_ref()
            .try_into()
            .map_err(|_| ReplayError::BadReply)?;
        let seq = u64::from_be_bytes(seq);
        if seq == u64::MAX {
            break;
        }
        out.push((seq, frames[n - 1].to_vec()));
        if seq.saturating_add(1) >= upto {
            break;
        }
        if out.len() > opts.replay_max_batches {
            return Err(ReplayError::TooMany(opts.replay_max_batches));
        }
    }
    Ok(out)
}
