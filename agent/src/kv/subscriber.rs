//! One engine publisher's subscriber: a ZMQ SUB socket, a bounded queue, and a processor that
//! checks sequence numbers, verifies and heals by replay, and feeds [`StreamState`].
//!
//! Two tasks per stream:
//!
//! - the **reader** owns the SUB socket (subscribed to the topic prefix before it connects, and
//!   polled from the moment it exists, so the subscription always reaches the publisher). The
//!   socket never talks to the engine directly: it connects to a one-shot loopback relay
//!   ([`zmtp_guard`]) that drops an engine announcing a frame or message over the stream's
//!   limit ([`stream_max_message_bytes`]);
//!   replay DEALERs go through the same relay. It
//!   connects with exponential backoff ([`SubscriberOptions::reconnect_initial`] doubling up to
//!   [`SubscriberOptions::reconnect_max`], 1 s by default, so a restarted local engine is
//!   re-attached within about a second). When the publisher goes away it drops the socket and
//!   connects a fresh one the same way (the ZMQ library's own reconnect backs off to 30 s).
//!   Every connection has an *epoch*; each message goes into a bounded queue
//!   ([`SubscriberOptions::queue_capacity`]) tagged with it. When the queue is full the message
//!   is dropped and counted (`queue_full`) — the processor then sees a gap, or checks the tail.
//! - the **processor** applies messages `[topic, seq (8 bytes big-endian), payload]` in order.
//!   Every replay (DEALER sends `["", start]`, replies `["", seq, payload]` or
//!   `["", topic, seq, payload]` up to an end marker of seq `u64::MAX`) is *anchored*: it starts
//!   at the last applied seq `L`, and the engine's batch `L` must be byte-identical (xxh3 of the
//!   payload) to the one applied — proof that the engine is still the incarnation we followed,
//!   whatever its sequence numbers say. Then:
//!   - **gap** (`seq > L + 1`): the anchored replay fills `L+1..seq`. Holes (vLLM < 0.33 under
//!     load): the contiguous run after `L` is applied and the replay asked again from the new
//!     anchor (3 times); holes left rebuild the replica from seq 0 (exact while the engine's
//!     buffer still holds it, else Partial `ReplayTruncated`); a replay that ends before `seq` asks the engine for `seq`
//!     itself, and a frame the engine never sent is dropped (`forged_seq`) instead of clearing
//!     anything. Another incarnation clears (`EngineRestarted`) and bootstraps.
//!   - **seq at or below `L`**: a batch already applied (from a replay, or live with the same
//!     bytes: a repeated frame is a duplicate) is skipped; otherwise the anchor decides (same incarnation: the frame is dropped as forged; another: restart).
//!   - **first message** of an incarnation with seq > 0: *bootstrap* replay from 0; if the
//!     engine's buffer no longer holds seq 0 (or there is no replay endpoint) the replica is
//!     Partial `BootstrapIncomplete` until the engine's state is known again.
//!   - **attach** (a new epoch of a stream that holds state: a reconnect, or the first
//!     connection after a restart from kept state): the stream reads Disconnected
//!     `AttachUnverified` (not routed) until its anchored replay succeeds; live frames are not
//!     applied meanwhile — a restarted engine's sequence can pass through `L + 1`, so sequence
//!     order proves nothing — and a failed check (slow or unreachable replay socket, each attempt
//!     bounded by [`SubscriberOptions::attach_verify_deadline`]) is retried with capped
//!     exponential back-off and jitter until it succeeds. An empty replay buffer cannot vouch
//!     for anything: the replica is cleared (Partial `SequenceGap`).
//!   - **reconnect** (a new epoch), **idle** ([`SubscriberOptions::idle_verify_after`] after the
//!     last live message, then every [`SubscriberOptions::idle_verify_interval`]): an anchored
//!     replay from `L` applies a lost tail and detects an engine that restarted while we were
//!     away — so a burst that overflowed the publisher's high-water mark heals as soon as the
//!     engine goes idle. The idle check runs beside live processing (a spawned replay; live
//!     batches keep flowing, and a live batch applied meanwhile settles the tail, so its result
//!     is dropped); one that runs past [`SubscriberOptions::routine_check_healing_after`] shows
//!     Healing. A failed check makes the stream Stale `TailUnverified` (not routed: a lost
//!     removal would leave a block indexed), checked again every
//!     [`SubscriberOptions::tail_retry_interval`]. Holes in a check's replay after a verified
//!     anchor keep the state: the contiguous run is applied, the rest is a tail to check.
//!   - **heal**: a stream Partial for an incomplete history (`BootstrapIncomplete`,
//!     `ReplayTruncated`, `SequenceGap`) asks, with the attach back-off, for a full replay from
//!     seq 0; complete (from 0, no holes) → rebuilt from it, Exact. A buffer that no longer
//!     starts at 0 (or holds nothing, or more than a replay accepts) cannot heal it: no more
//!     tries until the engine's state is known again.
//!   - **without a replay endpoint** an unhealed gap clears the replica (`SequenceGap`, stale
//!     until a newer batch), except a jump beyond [`SubscriberOptions::suspicious_seq_jump`]:
//!     that frame is held back (Stale `SequenceUnverified`) until the next frame shows whether
//!     the engine's sequence really moved there.
//! - a publisher socket gone for [`SubscriberOptions::disconnect_grace`] makes the stream
//!   Disconnected (no PREFIX_MATCH) until it is back and verified.
//!
//! Every coverage transition is counted, exported as a gauge and logged: WARN out of Exact, INFO
//! back to it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::kv::decode::decode_batch;
use ic_shared::plan::HashScheme;
use ic_shared::proto::StreamDescriptor;
use ic_shared::timing::{self, Stage};
use thiserror::Error;
use tokio::sync::{mpsc, Notify};
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use std::sync::atomic::AtomicUsize;

use super::metrics::KvMetrics;
use super::stream::{
    ApplyReport, LinkState, SeqCheck, StreamConfig, StreamState, CLEAR_ENGINE_RESTARTED,
    CLEAR_REBUILT, CLEAR_REPLAY_TRUNCATED, CLEAR_SEQUENCE_GAP,
};
use super::zmtp_guard::{self, Dropped, GuardListener, Guarded, OnDrop, ZmtpLimits};

/// Everything that identifies one planned stream; a change of any field restarts it.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSpec {
    /// Identity sent with deltas and snapshots.
    pub descriptor: StreamDescriptor,
    /// PUB endpoint the SUB connects to; `@tcp://host:port` binds the SUB there instead
    /// ([`bound_endpoint`]).
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
    /// First reconnect delay after a failed connect (default 100 ms), doubled per failure.
    pub reconnect_initial: Duration,
    /// Largest reconnect delay (default 1 s).
    pub reconnect_max: Duration,
    /// Longest wait for each replay reply, and for the replay connect (default 3 s).
    pub replay_timeout: Duration,
    /// Most batches accepted from one replay (default 20000; engines buffer 10000).
    pub replay_max_batches: usize,
    /// Longest a whole replay may take, however fast each reply comes (default 30 s): a
    /// trickling endpoint cannot hold the stream in Healing.
    pub replay_deadline: Duration,
    /// Replay from seq 0 when the first message of an engine incarnation has seq > 0 (default
    /// true).
    pub bootstrap_replay: bool,
    /// Quiet time after the last live message before the tail is checked by replay (default
    /// 300 ms).
    pub idle_verify_after: Duration,
    /// How often an idle stream is checked again (default 5 s).
    pub idle_verify_interval: Duration,
    /// How long a lost publisher socket is tolerated before the stream reads Disconnected and
    /// stops being routed (default 1 s).
    pub disconnect_grace: Duration,
    /// Without a replay endpoint, a forward jump larger than this is held back as suspicious
    /// instead of clearing the replica (default 1 000 000 batches, 100× the engine's buffer).
    pub suspicious_seq_jump: u64,
    /// Ceiling of the longest ZMQ message (all frames) accepted from an engine's publisher or
    /// replay socket, bytes (default and maximum [`zmtp_guard::HARD_MAX_MESSAGE_BYTES`], 16 MiB);
    /// each stream takes the smaller of this and its engine's limit
    /// ([`stream_max_message_bytes`]). A peer that announces more is dropped before
    /// anything of that size is allocated ([`zmtp_guard`]).
    pub max_message_bytes: usize,
    /// Payload bytes buffered between the socket and the processor before messages are
    /// dropped as `queue_full` (default 32 MiB): bounds memory while the processor is busy
    /// (a replay) however large the messages are.
    pub queue_max_bytes: usize,
    /// Most payload bytes accepted from one replay (default 64 MiB): beyond it the replay
    /// fails ([`ReplayError::TooLarge`]) like one with too many batches.
    pub replay_max_bytes: usize,
    /// Longest one attach verification may take, however its replies trickle in (default
    /// 30 s): the anchored replay that proves, on every (re)connection of a stream that holds
    /// state, that the engine is still the incarnation followed. Until one succeeds the stream
    /// reads Disconnected [`coverage::ATTACH_UNVERIFIED`] (not routed) and its live batches are
    /// not applied.
    pub attach_verify_deadline: Duration,
    /// First wait before a failed attach verification is tried again (default 250 ms); the
    /// waits double, with jitter (the `backon` crate), up to
    /// [`SubscriberOptions::attach_retry_max`], and never give up.
    pub attach_retry_initial: Duration,
    /// Longest wait between attach verification attempts (default 2 s; jitter adds up to as
    /// much again). The heal of a Partial stream (a full replay from seq 0) is retried on the
    /// same schedule.
    pub attach_retry_max: Duration,
    /// How long an idle tail check may run beside live processing before the stream shows
    /// Healing (default 1 s).
    pub routine_check_healing_after: Duration,
    /// How often a stream that is Stale `TailUnverified` (a failed tail check) is checked again
    /// (default 1 s; an idle stream otherwise every
    /// [`SubscriberOptions::idle_verify_interval`]).
    pub tail_retry_interval: Duration,
}

impl Default for SubscriberOptions {
    fn default() -> Self {
        Self {
            queue_capacity: 8192,
            connect_timeout: Duration::from_secs(5),
            reconnect_initial: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(1),
            replay_timeout: Duration::from_secs(3),
            replay_max_batches: 20_000,
            replay_deadline: Duration::from_secs(30),
            bootstrap_replay: true,
            idle_verify_after: Duration::from_millis(300),
            idle_verify_interval: Duration::from_secs(5),
            disconnect_grace: Duration::from_secs(1),
            suspicious_seq_jump: 1_000_000,
            max_message_bytes: zmtp_guard::HARD_MAX_MESSAGE_BYTES,
            queue_max_bytes: 32 << 20,
            replay_max_bytes: 64 << 20,
            attach_verify_deadline: Duration::from_secs(30),
            attach_retry_initial: Duration::from_millis(250),
            attach_retry_max: Duration::from_secs(2),
            routine_check_healing_after: Duration::from_secs(1),
            tail_retry_interval: Duration::from_secs(1),
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
    /// The engine's clock skew estimate.
    pub clock: ClockSkew,
}

/// Engine clock minus agent clock beyond which the skew is flagged (a WARN) and taken out of
/// the stream lag, seconds. NTP keeps nodes within milliseconds; a batch's own delay is
/// milliseconds too.
pub const CLOCK_SKEW_FLAG_SECONDS: f64 = 2.0;
/// Minutes of live batches the skew estimate looks back over.
const CLOCK_SKEW_WINDOW_MINUTES: i64 = 10;

/// The estimate of one stream's engine clock skew (issue 37 item 8). A live batch's
/// `ts − arrival` is the engine clock's lead over the agent's minus the batch's delay (≥ 0), so
/// its largest value over a window is the skew less the smallest delay — milliseconds on a
/// healthy stream. Kept as one maximum per minute of agent time, over the last
/// [`CLOCK_SKEW_WINDOW_MINUTES`]: a clock corrected by NTP leaves the estimate within that.
/// A stream whose every batch of the window arrived seconds late reads the same as skew.
#[derive(Debug, Default, Clone)]
pub(crate) struct ClockSkew {
    /// `(minute of agent time, max of ts − arrival in seconds)`, oldest first.
    minutes: std::collections::VecDeque<(i64, f64)>,
    /// The skew was beyond [`CLOCK_SKEW_FLAG_SECONDS`] at the last sample.
    pub flagged: bool,
}

impl ClockSkew {
    /// Adds a live batch's engine `ts` (unix seconds) arriving at `now_ms` (agent unix ms);
    /// returns the estimate, seconds.
    pub fn observe(&mut self, now_ms: i64, ts: f64) -> f64 {
        let minute = now_ms.div_euclid(60_000);
        let sample = ts - now_ms as f64 / 1000.0;
        if self.minutes.back().is_some_and(|(m, _)| *m > minute) {
            // The agent's own clock went back: start over.
            self.minutes.clear();
        }
        match self.minutes.back_mut() {
            Some((m, v)) if *m == minute => *v = v.max(sample),
            _ => self.minutes.push_back((minute, sample)),
        }
        while self
            .minutes
            .front()
            .is_some_and(|(m, _)| *m <= minute - CLOCK_SKEW_WINDOW_MINUTES)
        {
            self.minutes.pop_front();
        }
        self.estimate().unwrap_or(sample)
    }

    /// The estimate (engine − agent, seconds), `None` before any sample.
    pub fn estimate(&self) -> Option<f64> {
        self.minutes.iter().map(|(_, v)| *v).reduce(f64::max)
    }
}

/// The stream lag of a live batch: agent time − engine `ts`, plus the `skew` (engine − agent)
/// when it is flagged, so an engine clock hours off does not read as hours of lag.
pub(crate) fn corrected_lag(now_ms: i64, ts: f64, skew: f64) -> f64 {
    let raw = now_ms as f64 / 1000.0 - ts;
    if skew.abs() > CLOCK_SKEW_FLAG_SECONDS {
        raw + skew
    } else {
        raw
    }
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
    /// Connection epoch: +1 each time the reader connects a SUB socket.
    epoch: AtomicU64,
    /// Unix ms the publisher socket was lost (0 while connected or never connected).
    disconnected_at_ms: AtomicI64,
    /// Wakes the processor when the connection changes.
    link_changed: Notify,
}

impl StreamShared {
    pub fn new(spec: StreamSpec) -> Self {
        let mut state = StreamState::new(spec.config.clone());
        // Nothing is known of the engine until the first connection.
        state.set_link(LinkState::Disconnected);
        Self {
            spec,
            inner: Mutex::new(StreamInner {
                state,
                stats: StreamStats::default(),
            }),
            connected: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            disconnected_at_ms: AtomicI64::new(0),
            link_changed: Notify::new(),
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

/// Pending keys that wake the link even while more batches are queued (flush on size): bounds
/// one delta (≈ 10 bytes per key on the wire) and the delay a long burst adds to its first
/// blocks.
pub const FLUSH_KEYS: usize = 4096;

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

/// The longest message one stream's sockets accept, bytes: the engine family's limit
/// ([`ZmtpLimits::for_scheme`] of the descriptor's `hash_scheme`: vLLM 4 MiB, SGLang 16 MiB;
/// the hard cap for an unknown scheme), at most [`SubscriberOptions::max_message_bytes`]. It is
/// not part of [`StreamConfig`], so the kept-state fingerprint of a stream stays as it was.
pub fn stream_max_message_bytes(spec: &StreamSpec, opts: &SubscriberOptions) -> usize {
    let engine = HashScheme::parse(&spec.descriptor.hash_scheme)
        .map_or(zmtp_guard::HARD_MAX_MESSAGE_BYTES, |s| {
            ZmtpLimits::for_scheme(s).max_message_bytes
        });
    engine
        .min(opts.max_message_bytes)
        .min(zmtp_guard::HARD_MAX_MESSAGE_BYTES)
}

/// Starts the reader and processor of one stream on `rt`.
pub(crate) fn spawn(
    rt: &tokio::runtime::Handle,
    shared: Arc<StreamShared>,
    sink: Sink,
    mut opts: SubscriberOptions,
) -> Running {
    opts.max_message_bytes = stream_max_message_bytes(&shared.spec, &opts);
    let (tx, rx) = mpsc::channel(opts.queue_capacity.max(1));
    let queued = Arc::new(AtomicUsize::new(0));
    let reader = rt.spawn(read_loop(
        shared.clone(),
        sink.clone(),
        opts.clone(),
        Queue {
            tx,
            bytes: queued.clone(),
        },
    ));
    let processor = rt.spawn(process_loop(shared, sink, opts, rx, queued));
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

/// The endpoint a SUB binds when the plan writes it `@tcp://host:port` (CZMQ's convention):
/// the engine's PUB connects to it (vLLM connects any endpoint that is not a wildcard).
pub fn bound_endpoint(endpoint: &str) -> Option<&str> {
    endpoint.strip_prefix('@')
}

/// The limits of one stream's sockets (see [`zmtp_guard`]).
fn limits(opts: &SubscriberOptions) -> ZmtpLimits {
    ZmtpLimits {
        max_message_bytes: opts.max_message_bytes,
        ..ZmtpLimits::default()
    }
    .clamped()
}

/// Counts and logs an engine peer dropped by the guard: `socket` is `events` (the publisher)
/// or `replay`.
fn record_peer_drop(shared: &StreamShared, sink: &Sink, socket: &'static str, d: Dropped) {
    let id = shared.id();
    sink.metrics
        .peers_dropped
        .with_label_values(&[id, socket, d.violation.reason()])
        .inc();
    let endpoint = match socket {
        "replay" => shared.spec.replay_endpoint.as_deref().unwrap_or(""),
        _ => shared.spec.endpoint.as_str(),
    };
    tracing::warn!(
        stream = %id,
        socket,
        endpoint,
        reason = d.violation.reason(),
        announced = d.announced,
        limit = d.limit,
        "kv events: engine connection dropped: {d}"
    );
    shared.lock().stats.last_error = Some(format!(
        "{socket} socket {endpoint}: connection dropped: {d}"
    ));
}

/// Connects a SUB socket (subscribed first) through the guard ([`zmtp_guard`]) with capped
/// exponential backoff; for an `@…` endpoint ([`bound_endpoint`]) binds the guard's listener
/// there instead and returns once a publisher has connected. The returned [`Guarded`] relay
/// must live as long as the socket. `backoff` is the wait after the next failure; the caller
/// resets it once a connection delivered a message, so a publisher that is dropped before its
/// first message (a hostile one) is retried at most every [`SubscriberOptions::reconnect_max`].
async fn connect_sub(
    shared: &Arc<StreamShared>,
    sink: &Sink,
    opts: &SubscriberOptions,
    backoff: &mut Duration,
) -> (
    SubSocket,
    futures::channel::mpsc::Receiver<SocketEvent>,
    Guarded,
) {
    let id = shared.id();
    let on_drop: OnDrop = {
        let (shared, sink) = (shared.clone(), sink.clone());
        Arc::new(move |d| record_peer_drop(&shared, &sink, "events", d))
    };
    loop {
        let guarded = if let Some(ep) = bound_endpoint(&shared.spec.endpoint) {
            match GuardListener::bind(&super::publish::bind_endpoint(ep)).await {
                Ok(l) => {
                    l.accept(limits(opts), opts.connect_timeout, on_drop.clone())
                        .await
                }
                Err(e) => Err(e),
            }
        } else {
            zmtp_guard::connect(
                &shared.spec.endpoint,
                limits(opts),
                opts.connect_timeout,
                on_drop.clone(),
            )
            .await
        };
        let error = match guarded {
            Err(e) => e,
            Ok(guarded) => {
                let mut zopts = SocketOptions::default();
                zopts.connect_timeout(opts.connect_timeout);
                let mut sock = SubSocket::with_options(zopts);
                let monitor = sock.monitor();
                if let Err(e) = sock.subscribe(&shared.spec.topic).await {
                    shared.lock().stats.last_error = Some(format!("subscribe: {e}"));
                }
                let attempt = tokio::time::timeout(
                    opts.connect_timeout + Duration::from_secs(1),
                    sock.connect(guarded.endpoint()),
                )
                .await;
                match attempt {
                    Ok(Ok(())) => return (sock, monitor, guarded),
                    Ok(Err(e)) => format!("connect {}: {e}", shared.spec.endpoint),
                    Err(_) => format!("connect {}: timed out", shared.spec.endpoint),
                }
            }
        };
        tracing::debug!(stream = %id, "kv events: {error}");
        shared.lock().stats.last_error = Some(error);
        tokio::time::sleep(*backoff).await;
        *backoff = next_backoff(*backoff, opts);
    }
}

fn next_backoff(backoff: Duration, opts: &SubscriberOptions) -> Duration {
    (backoff * 2).min(opts.reconnect_max.max(opts.reconnect_initial))
}

/// The reader's end of the queue: messages and the payload bytes they hold.
struct Queue {
    tx: mpsc::Sender<(u64, ZmqMessage)>,
    bytes: Arc<AtomicUsize>,
}

/// Bytes of a message's frames.
fn message_bytes(m: &ZmqMessage) -> usize {
    m.iter().map(|f| f.len()).sum()
}

async fn read_loop(shared: Arc<StreamShared>, sink: Sink, opts: SubscriberOptions, queue: Queue) {
    let id = shared.id().to_string();
    set_connected(&shared, &sink, false);
    let mut backoff = opts.reconnect_initial;
    loop {
        // `_relay` carries the engine's bytes to `sock`; dropping it closes the connection.
        let (mut sock, mut monitor, _relay) =
            connect_sub(&shared, &sink, &opts, &mut backoff).await;
        let received_before = shared.lock().stats.batches_received;
        let epoch = shared.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(stream = %id, endpoint = %shared.spec.endpoint, epoch, "kv events: connected");
        // The connect errors before this connection are history: /v1/report's lastError shows
        // what is wrong now.
        shared.lock().stats.last_error = None;
        shared.disconnected_at_ms.store(0, Ordering::Relaxed);
        set_connected(&shared, &sink, true);
        shared.link_changed.notify_one();
        let mut monitor_open = true;
        let forward = |m: ZmqMessage| -> bool {
            if let Some(seq) = m.get(1).and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()) {
                timing::mark(Stage::KvReceived, u64::from_be_bytes(seq));
            }
            sink.metrics
                .received
                .with_label_values(&[&id, "live"])
                .inc();
            {
                let mut g = shared.lock();
                g.stats.batches_received += 1;
                g.stats.last_message_unix_ms = Some(now_unix_ms());
            }
            let size = message_bytes(&m);
            if queue.bytes.load(Ordering::Relaxed).saturating_add(size) > opts.queue_max_bytes {
                record_drop(&shared, &sink, "queue_full", 1);
                return true;
            }
            queue.bytes.fetch_add(size, Ordering::Relaxed);
            match queue.tx.try_send((epoch, m)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    queue.bytes.fetch_sub(size, Ordering::Relaxed);
                    record_drop(&shared, &sink, "queue_full", 1);
                    true
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        };
        loop {
            tokio::select! {
                msg = sock.recv() => match msg {
                    Ok(m) => {
                        if !forward(m) {
                            return;
                        }
                    }
                    Err(e) => {
                        shared.lock().stats.last_error = Some(format!("recv: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                ev = monitor.next(), if monitor_open => match ev {
                    Some(SocketEvent::Disconnected(_)) => break,
                    Some(_) => {}
                    None => monitor_open = false,
                },
            }
        }
        // Take what the socket still holds, then connect afresh: our backoff, not the
        // library's (which grows to 30 s).
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(5), sock.recv()).await {
            if !forward(m) {
                return;
            }
        }
        drop(sock);
        shared
            .disconnected_at_ms
            .store(now_unix_ms().max(1), Ordering::Relaxed);
        set_connected(&shared, &sink, false);
        shared.link_changed.notify_one();
        tracing::info!(stream = %id, endpoint = %shared.spec.endpoint, "kv events: publisher gone; reconnecting");
        if shared.lock().stats.batches_received > received_before {
            backoff = opts.reconnect_initial;
        } else {
            // Nothing came on that connection (an engine dropped by the guard at its first
            // header, or one that keeps going away): wait before the next one, longer each time.
            tokio::time::sleep(backoff).await;
            backoff = next_backoff(backoff, &opts);
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

/// What an anchored replay (from the last applied seq) showed.
enum Anchored {
    /// The engine's batch at our last seq is the one we applied; the replies after it follow.
    Same(Vec<(u64, Vec<u8>)>),
    /// As `Same`, but the replay ended without its end marker (replies lost past the engine's
    /// send high-water mark, vLLM < 0.33): the replies received after the anchor; the rest of
    /// the tail is unknown.
    Cut(Vec<(u64, Vec<u8>)>),
    /// The engine holds another batch at that seq, or nothing from it on: another incarnation.
    Other,
    /// The engine's buffer starts after our last seq: it cannot be told.
    Unverifiable,
    /// The engine's replay holds nothing at all (buffer off or empty): it cannot be told, and
    /// nothing was lost that a replay could give back.
    Silent,
}

/// How a run of replies continues from `next`.
#[derive(Debug, PartialEq, Eq)]
enum Run {
    /// Contiguous up to (excluding) the wanted end.
    Complete,
    /// Contiguous, but ended (end marker) before the wanted end.
    EndedEarly,
    /// A seq is missing inside the run.
    Holes,
}

/// Classifies `replies` (seqs ascending) as a continuation from `next` up to `upto` (`None`: to
/// the end of the engine's buffer).
fn classify_run(next: u64, replies: &[(u64, Vec<u8>)], upto: Option<u64>) -> Run {
    let mut expected = next;
    for (s, _) in replies {
        if upto.is_some_and(|u| *s >= u) {
            break;
        }
        if *s != expected {
            return Run::Holes;
        }
        expected += 1;
    }
    match upto {
        Some(u) if expected < u => Run::EndedEarly,
        _ => Run::Complete,
    }
}

/// The longest contiguous suffix of `replies` that ends at `upto - 1` (or at the last reply
/// when `upto` is `None`), and whether the replies had holes. Returns the index it starts at.
fn tail_run(replies: &[(u64, Vec<u8>)], upto: Option<u64>) -> (Option<usize>, bool) {
    let end = match upto {
        Some(u) => replies.iter().take_while(|(s, _)| *s < u).count(),
        None => replies.len(),
    };
    if end == 0 {
        return (None, false);
    }
    let mut start = end - 1;
    let mut holes = false;
    for i in (1..end).rev() {
        if replies[i].0 != replies[i - 1].0.wrapping_add(1) {
            holes = true;
            break;
        }
        start = i - 1;
    }
    if !holes {
        start = 0;
    }
    let connects = match upto {
        Some(u) => replies[end - 1].0.checked_add(1) == Some(u),
        None => true,
    };
    (connects.then_some(start), holes)
}

/// The processor of one stream (see the module docs).
struct Processor {
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    replay_ep: Option<String>,
    /// The connection epoch whose attachment was handled.
    handled_epoch: u64,
    /// `seq → digest` of batches applied from a replay and not yet seen live, so their live
    /// copies are skipped instead of read as an engine restart.
    replayed: BTreeMap<u64, u64>,
    last_live: Option<Instant>,
    last_check: Option<Instant>,
    /// An idle check ran since the last live message.
    tail_checked: bool,
    /// Queue-full drops counted when the last live message was applied.
    drops_at_last_live: u64,
    /// Without a replay endpoint: a held-back frame with an implausible seq.
    suspect: Option<u64>,
    /// The attach verification of the current connection has not succeeded: the retry
    /// schedule. Only an anchored replay ends it — never a live frame's sequence number.
    unverified: Option<AttachRetry>,
    coverage: Option<Coverage>,
    /// The heal schedule of a stream Partial for an incomplete history (a full replay from
    /// seq 0, retried with the attach back-off).
    heal: Option<AttachRetry>,
    /// The engine's buffer cannot heal this incarnation (it no longer starts at seq 0, is
    /// empty, or holds more than a replay accepts): no more heal tries until the state is known
    /// again.
    heal_hopeless: bool,
    /// The idle tail check in flight beside live processing.
    routine: Option<RoutineCheck>,
}

/// What an idle tail check's spawned replay brings back: the replies from the anchor, and —
/// when there are none — whether the engine holds older batches (it restarted) or nothing at
/// all.
type RoutineReplies = Result<(Vec<(u64, Vec<u8>)>, Option<bool>), ReplayError>;

/// An idle tail check running beside live processing.
struct RoutineCheck {
    /// `(seq, digest)` it is anchored at; a result is used only if the stream is still there.
    anchor: (u64, u64),
    started: Instant,
    /// It ran past its bound and set Healing.
    healing: bool,
}

/// The replay of an idle tail check, run as its own task (see [`RoutineReplies`]).
async fn routine_replay(
    ep: String,
    last: u64,
    topic: String,
    opts: SubscriberOptions,
) -> RoutineReplies {
    let replies = request_replay(&ep, last, u64::MAX, &topic, &opts).await?;
    if !replies.is_empty() {
        return Ok((replies, None));
    }
    let older = request_replay(&ep, 0, last, &topic, &opts).await?;
    Ok((replies, Some(!older.is_empty())))
}

/// Judges replies from `last` against the anchor digest (see [`Anchored`]); `older`: for an
/// empty reply, whether the engine holds batches before `last`.
fn judge_anchor(
    last: u64,
    digest: u64,
    mut replies: Vec<(u64, Vec<u8>)>,
    older: Option<bool>,
) -> Anchored {
    match replies.first() {
        // Nothing at or after our last seq. The engine keeps its newest batches, so if it
        // holds any at all it has restarted (all of them are older than ours); if it holds
        // none, its replay buffer is off or empty and tells nothing.
        None if older == Some(true) => Anchored::Other,
        None => Anchored::Silent,
        Some((s, p)) if *s == last && xxh3_64(p) == digest => {
            replies.remove(0);
            Anchored::Same(replies)
        }
        Some((s, _)) if *s <= last => Anchored::Other,
        Some(_) => Anchored::Unverifiable,
    }
}

/// A verified anchor from a replay that ended without its end marker is [`Anchored::Cut`].
fn cut(a: Anchored) -> Anchored {
    match a {
        Anchored::Same(r) => Anchored::Cut(r),
        other => other,
    }
}

/// Waits for the idle check's task (pending forever when there is none; guarded by the caller).
async fn join_routine(
    t: &mut Option<tokio::task::JoinHandle<RoutineReplies>>,
) -> Result<RoutineReplies, tokio::task::JoinError> {
    match t {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// How many replies continue contiguously from `next`.
fn contiguous_len(next: u64, replies: &[(u64, Vec<u8>)]) -> usize {
    replies
        .iter()
        .enumerate()
        .take_while(|(i, (s, _))| next.checked_add(*i as u64) == Some(*s))
        .count()
}

async fn process_loop(
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    mut rx: mpsc::Receiver<(u64, ZmqMessage)>,
    queued: Arc<AtomicUsize>,
) {
    let mut p = Processor {
        replay_ep: shared.spec.replay_endpoint.clone(),
        shared,
        sink,
        opts,
        handled_epoch: 0,
        replayed: BTreeMap::new(),
        last_live: None,
        last_check: None,
        tail_checked: false,
        drops_at_last_live: 0,
        suspect: None,
        unverified: None,
        coverage: None,
        heal: None,
        heal_hopeless: false,
        routine: None,
    };
    p.observe();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The idle tail check's replay, beside live processing (issue 37 item 4).
    let mut routine: Option<tokio::task::JoinHandle<RoutineReplies>> = None;
    loop {
        let start = tokio::select! {
            m = rx.recv() => match m {
                Some((epoch, msg)) => {
                    queued.fetch_sub(message_bytes(&msg), Ordering::Relaxed);
                    p.on_message(epoch, msg).await;
                    None
                }
                None => {
                    if let Some(t) = routine.take() {
                        t.abort();
                    }
                    return;
                }
            },
            r = join_routine(&mut routine), if routine.is_some() => {
                routine = None;
                let r = r.unwrap_or_else(|e| Err(ReplayError::Socket(format!("tail check task: {e}"))));
                p.on_routine_done(r).await;
                None
            }
            _ = p.shared.link_changed.notified() => p.on_tick(rx.is_empty()).await,
            _ = tick.tick() => p.on_tick(rx.is_empty()).await,
        };
        if let Some((ep, anchor)) = start {
            if routine.is_none() {
                p.routine = Some(RoutineCheck {
                    anchor,
                    started: Instant::now(),
                    healing: false,
                });
                routine = Some(tokio::spawn(routine_replay(
                    ep,
                    anchor.0,
                    p.shared.spec.topic.clone(),
                    p.opts.clone(),
                )));
            }
        }
        // Flush on idle: the link is woken once the queue is drained (or the pending ops are
        // large), so a burst of batches leaves as one delta and a lone batch leaves at once.
        p.observe_queue(rx.is_empty());
    }
}

impl Processor {
    fn id(&self) -> &str {
        self.shared.id()
    }

    /// Publishes a coverage change: gauge, transition counter, log, and a wake-up for the link
    /// (a coverage change is sent even without ops).
    fn observe(&mut self) {
        self.observe_queue(true);
    }

    /// [`Processor::observe`] with the flush policy: pending ops wake the link (which sends
    /// them at once, no timer) when `queue_empty` (nothing more is waiting to be applied: flush
    /// on idle), when at least [`FLUSH_KEYS`] keys are pending (flush on size), or when the
    /// coverage changed.
    fn observe_queue(&mut self, queue_empty: bool) {
        let (cov, blocks, orphans, err) = {
            let g = self.shared.lock();
            (
                g.state.coverage(),
                g.state.blocks_held(),
                g.state.orphans(),
                g.stats.last_error.clone(),
            )
        };
        let mut changed = false;
        if self.coverage != Some(cov) {
            let id = self.shared.id();
            self.sink.metrics.set_coverage(id, self.coverage, cov);
            let from = self.coverage.map(|c| c.to_string());
            match (self.coverage, cov.state) {
                (None, _) => tracing::debug!(stream = %id, coverage = %cov, "kv events: coverage"),
                (Some(_), CoverageState::Exact) => {
                    // Recovered: the error that explained the inexact state is history (this
                    // line keeps it).
                    let was = self.shared.lock().stats.last_error.take();
                    tracing::info!(stream = %id, coverage = %cov, from = ?from, blocks, last_error = ?was, "kv events: coverage back to Exact")
                }
                (Some(_), _) => {
                    tracing::warn!(stream = %id, coverage = %cov, from = ?from, blocks, orphans, last_error = ?err, "kv events: stream not exact")
                }
            }
            self.coverage = Some(cov);
            changed = true;
        }
        let flush = {
            let g = self.shared.lock();
            g.state.has_pending()
                && (queue_empty || changed || g.state.pending_keys() >= FLUSH_KEYS)
        };
        if flush {
            self.sink.notify.notify_one();
        }
    }

    /// A replay begins: Healing (a stream Disconnected or not yet verified stays so: only a
    /// verified attach makes it routable, [`Processor::attach_done`]).
    fn begin_healing(&mut self) {
        {
            let mut g = self.shared.lock();
            if g.state.link() == LinkState::Up {
                g.state.set_link(LinkState::Healing);
            }
        }
        self.observe();
    }

    /// A replay ended: Up again after Healing. A stream Disconnected or not yet verified is
    /// left so: the attach decides ([`Processor::attach_done`]).
    fn end_healing(&self) {
        let mut g = self.shared.lock();
        if g.state.link() == LinkState::Healing {
            g.state.set_link(LinkState::Up);
        }
    }

    /// The attach of the current connection is settled (verified, rebuilt, or nothing held to
    /// verify): routable again while the socket is connected.
    fn attach_done(&mut self) {
        self.unverified = None;
        // The idle tail check runs from here even before a live batch arrives (a resumed
        // stream whose replay left a tail unchecked).
        self.last_live.get_or_insert_with(Instant::now);
        let connected = self.shared.connected.load(Ordering::Relaxed);
        let mut g = self.shared.lock();
        if matches!(
            g.state.link(),
            LinkState::Unverified | LinkState::Disconnected | LinkState::Healing
        ) {
            g.state.set_link(if connected {
                LinkState::Up
            } else {
                LinkState::Disconnected
            });
        }
    }

    /// The attach verification failed (or timed out): the stream stays unrouted and the next
    /// attempt is scheduled by the back-off.
    fn attach_failed(&mut self) {
        let retry = self
            .unverified
            .get_or_insert_with(|| AttachRetry::new(&self.opts));
        retry.schedule();
        let wait = retry.next_at.saturating_duration_since(Instant::now());
        let attempts = retry.attempts;
        self.shared.lock().state.set_link(LinkState::Unverified);
        tracing::warn!(stream = %self.id(), retry_in = ?wait, attempts, "kv events: attach verification failed; the replica is not routed until it succeeds");
    }

    fn count_replay(&self, result: &'static str) {
        self.sink
            .metrics
            .replays
            .with_label_values(&[self.id(), result])
            .inc();
        let mut g = self.shared.lock();
        if result == "failed" {
            g.stats.replays_failed += 1;
        } else {
            g.stats.replays += 1;
        }
    }

    fn count_clear(&self, reason: &'static str) {
        self.sink
            .metrics
            .resyncs
            .with_label_values(&[self.id(), reason])
            .inc();
        self.shared.lock().stats.resyncs += 1;
    }

    fn set_error(&self, e: String) {
        self.shared.lock().stats.last_error = Some(e);
    }

    /// Decodes and applies one batch; replayed batches are remembered so their live copies are
    /// skipped.
    fn apply(&mut self, seq: u64, payload: &[u8], live: bool) {
        let digest = xxh3_64(payload);
        if live {
            self.replayed = self.replayed.split_off(&seq.saturating_add(1));
            if self.suspect.take().is_some() {
                // The engine's sequence continued where it was: the held frame was not its.
                self.shared.lock().state.set_suspect(false);
            }
        } else {
            self.sink
                .metrics
                .received
                .with_label_values(&[self.id(), "replay"])
                .inc();
            self.shared.lock().stats.batches_replayed += 1;
            self.replayed.insert(seq, digest);
            while self.replayed.len() > self.opts.replay_max_batches.saturating_mul(2) {
                self.replayed.pop_first();
            }
        }
        apply_payload(&self.shared, &self.sink, seq, payload, digest, live);
        if live {
            timing::mark(Stage::KvApplied, seq);
        }
    }

    fn apply_all(&mut self, replies: &[(u64, Vec<u8>)]) {
        for (s, p) in replies {
            self.apply(*s, p, false);
        }
    }

    async fn on_message(&mut self, epoch: u64, msg: ZmqMessage) {
        let (seq, payload) = match split_live(msg) {
            Ok(x) => x,
            Err(reason) => {
                record_drop(&self.shared, &self.sink, reason, 1);
                return;
            }
        };
        if epoch > self.handled_epoch {
            self.on_attach(epoch).await;
        }
        self.last_live = Some(Instant::now());
        self.tail_checked = false;
        self.on_live(seq, payload).await;
        self.drops_at_last_live = self.queue_drops();
        if self.replay_ep.is_none() {
            self.shared.lock().state.set_tail_unverified(false);
        }
    }

    fn queue_drops(&self) -> u64 {
        self.shared
            .lock()
            .stats
            .dropped_by_reason
            .get("queue_full")
            .copied()
            .unwrap_or(0)
    }

    async fn on_live(&mut self, seq: u64, payload: Vec<u8>) {
        if self.unverified.is_some() {
            // Nothing proves yet which incarnation sent this frame, and a restarted engine's
            // sequence can pass through our last seq + 1: it is not applied. The replay that
            // verifies the attach brings it (or shows another incarnation).
            self.sink
                .metrics
                .ignored
                .with_label_values(&[self.id(), "unverified"])
                .inc();
            return;
        }
        let digest = xxh3_64(&payload);
        for verified in [false, true] {
            if self.replayed.get(&seq) == Some(&digest) {
                self.sink
                    .metrics
                    .ignored
                    .with_label_values(&[self.id(), "replayed"])
                    .inc();
                return;
            }
            if self.shared.lock().state.last_digest() == Some((seq, digest)) {
                // The last frame again, byte for byte (a publisher or relay resend): a
                // duplicate, not a restart — a restarted engine's batch carries another
                // timestamp. (Older seqs are judged by the anchor: a stand-in publisher that
                // replays a recording does send the same bytes again after a restart.)
                self.sink
                    .metrics
                    .ignored
                    .with_label_values(&[self.id(), "duplicate"])
                    .inc();
                tracing::debug!(stream = %self.id(), seq, "kv events: duplicate frame skipped");
                return;
            }
            let check = self.shared.lock().state.check_seq(seq);
            match check {
                SeqCheck::InOrder => {
                    // The batch after the last applied: nothing was lost in between.
                    self.shared.lock().state.set_tail_unverified(false);
                    self.apply(seq, &payload, true);
                    return;
                }
                SeqCheck::First => {
                    if seq == 0 {
                        // A fresh engine: nothing came before.
                        self.shared.lock().state.set_incomplete(None);
                    }
                    self.bootstrap(Some(seq), coverage::BOOTSTRAP_INCOMPLETE)
                        .await;
                    self.apply(seq, &payload, true);
                    return;
                }
                SeqCheck::Gap { from } => {
                    self.on_gap(from, seq, &payload, digest).await;
                    return;
                }
                SeqCheck::Restarted if !verified && self.replay_ep.is_some() => {
                    // Behind what we applied, and not a replayed batch: ask the engine.
                    if self.verify(Check::Behind).await == Verdict::Same {
                        record_drop(&self.shared, &self.sink, "forged_seq", 1);
                        self.count_replay("forged");
                        tracing::warn!(stream = %self.id(), seq, "kv events: a frame behind the engine's own sequence was dropped (the engine still holds the batches we applied)");
                        return;
                    }
                    // The state was reset by the verification (or it failed): classify again.
                }
                SeqCheck::Restarted => {
                    tracing::info!(stream = %self.id(), seq, "kv events: engine restarted (seq went back)");
                    self.shared.lock().state.restart();
                    self.replayed.clear();
                    self.count_clear(CLEAR_ENGINE_RESTARTED);
                    self.bootstrap(Some(seq), coverage::BOOTSTRAP_INCOMPLETE)
                        .await;
                    self.apply(seq, &payload, true);
                    return;
                }
            }
        }
    }

    /// A new connection epoch: verify what we hold, or learn what the engine holds. A stream
    /// holding state reads Disconnected [`coverage::ATTACH_UNVERIFIED`] from here until its
    /// anchored replay succeeds (retried by [`Processor::on_tick`] with back-off).
    async fn on_attach(&mut self, epoch: u64) {
        self.handled_epoch = epoch;
        self.unverified = None;
        let last = self.shared.lock().state.last_digest();
        if let (Some((seq, _)), None) = (last, &self.replay_ep) {
            // Nothing can tell whether the engine restarted while the socket was away: what we
            // hold may include blocks it no longer has. Forget it (Partial SequenceGap).
            tracing::warn!(stream = %self.id(), last_seq = seq, "kv events: publisher reconnected without a replay endpoint to verify it; the replica is cleared");
            self.shared.lock().state.mark_gap(seq);
            self.count_clear(CLEAR_SEQUENCE_GAP);
            self.replayed.clear();
        } else if last.is_some() {
            // Not routed while the engine's incarnation is unproved (a quick reconnect within
            // the disconnect grace included).
            self.shared.lock().state.set_link(LinkState::Unverified);
            self.observe();
            if self.verify(Check::Attach).await == Verdict::Failed {
                self.attach_failed();
                return;
            }
        } else if self.replay_ep.is_some() {
            self.bootstrap(None, coverage::BOOTSTRAP_INCOMPLETE).await;
        } else {
            // No replay: whatever the engine stored before now is unknowable, until a batch at
            // seq 0 shows a fresh engine.
            self.shared
                .lock()
                .state
                .set_incomplete(Some(coverage::BOOTSTRAP_INCOMPLETE));
        }
        self.attach_done();
    }

    /// The periodic work: the disconnect grace, an attach not yet handled, the attach retry,
    /// the heal of a Partial stream, and the idle tail check — returned as `(replay endpoint,
    /// anchor)` for the caller to spawn beside live processing.
    async fn on_tick(&mut self, queue_empty: bool) -> Option<(String, (u64, u64))> {
        let connected = self.shared.connected.load(Ordering::Relaxed);
        if !connected {
            let since = self.shared.disconnected_at_ms.load(Ordering::Relaxed);
            let grace = self.opts.disconnect_grace.as_millis() as i64;
            if since > 0 && now_unix_ms() - since >= grace {
                let mut g = self.shared.lock();
                if matches!(
                    g.state.link(),
                    LinkState::Up | LinkState::Healing | LinkState::Unverified
                ) {
                    g.state.set_link(LinkState::Disconnected);
                }
            }
            return None;
        }
        let epoch = self.shared.epoch.load(Ordering::Relaxed);
        if epoch > self.handled_epoch && queue_empty {
            self.on_attach(epoch).await;
            return None;
        }
        if let Some(retry) = &self.unverified {
            // Live frames are not applied meanwhile, so the queue drains: no need to wait for
            // it to be empty.
            if Instant::now() >= retry.next_at {
                self.last_check = Some(Instant::now());
                if self.verify(Check::Attach).await == Verdict::Failed {
                    self.attach_failed();
                } else {
                    tracing::info!(stream = %self.id(), "kv events: attach verified after a retry");
                    self.attach_done();
                }
            }
            return None;
        }
        if let Some(r) = &mut self.routine {
            if !r.healing && r.started.elapsed() >= self.opts.routine_check_healing_after {
                r.healing = true;
                self.begin_healing();
            }
            return None;
        }
        if queue_empty && self.heal_due() {
            self.heal_now().await;
            return None;
        }
        let last = self.last_live?;
        if !queue_empty {
            return None;
        }
        let tail_unverified = self.shared.lock().state.tail_unverified();
        let due = if self.tail_checked {
            let every = if tail_unverified {
                self.opts.tail_retry_interval
            } else {
                self.opts.idle_verify_interval
            };
            self.last_check.is_some_and(|t| t.elapsed() >= every)
        } else {
            last.elapsed() >= self.opts.idle_verify_after
        };
        if !due {
            return None;
        }
        self.tail_checked = true;
        self.last_check = Some(Instant::now());
        if let Some(ep) = self.replay_ep.clone() {
            let anchor = self.shared.lock().state.last_digest()?;
            return Some((ep, anchor));
        } else if self.queue_drops() > self.drops_at_last_live {
            // We dropped messages after the last one we applied and cannot ask for them.
            self.shared.lock().state.set_tail_unverified(true);
        }
        None
    }

    /// The idle tail check's replay came back. Used only if the stream is still at the anchor
    /// it started from (a live batch applied meanwhile settled the tail itself, and a replay
    /// of the processor's own — a gap, an attach — decided more recently).
    async fn on_routine_done(&mut self, r: RoutineReplies) {
        let Some(check) = self.routine.take() else {
            return;
        };
        let current = self.shared.lock().state.last_digest();
        if let Err(ReplayError::PeerDropped(d)) = &r {
            record_peer_drop(&self.shared, &self.sink, "replay", *d);
        }
        let moved_on = self.unverified.is_some()
            || current != Some(check.anchor)
            || self.shared.epoch.load(Ordering::Relaxed) > self.handled_epoch;
        if moved_on {
            self.end_healing();
            return;
        }
        let (last, digest) = check.anchor;
        let anchored = match r {
            Ok((replies, older)) => Ok((last, judge_anchor(last, digest, replies, older))),
            Err(ReplayError::Unterminated(replies)) => {
                Ok((last, cut(judge_anchor(last, digest, replies, None))))
            }
            Err(e) => Err(e),
        };
        if let Some(ep) = self.replay_ep.clone() {
            self.settle(Check::Routine, &ep, anchored).await;
        }
        self.end_healing();
    }

    /// Whether a heal try is due: the stream is Partial for an incomplete history that a full
    /// replay from seq 0 could make whole, and its back-off has passed.
    fn heal_due(&mut self) -> bool {
        let (incomplete, link) = {
            let g = self.shared.lock();
            (g.state.incomplete(), g.state.link())
        };
        let healable = matches!(
            incomplete,
            Some(coverage::BOOTSTRAP_INCOMPLETE | coverage::REPLAY_TRUNCATED | coverage::SEQUENCE_GAP)
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
    async fn heal_now(&mut self) {
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
            Err(e @ (ReplayError::TooMany(_) | ReplayError::TooLarge(_) | ReplayError::TopicMismatch { .. })) => {
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
    async fn replay(
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
    async fn anchored_replay(
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
    async fn narrow_holes(
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
    async fn verify(&mut self, check: Check) -> Verdict {
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
    async fn settle(
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
    fn settle_same(&mut self, last: u64, rest: Vec<(u64, Vec<u8>)>, cut: bool) -> Verdict {
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
    async fn on_gap(&mut self, from: u64, seq: u64, payload: &[u8], digest: u64) {
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
    fn gap_replay_failed(&mut self, from: u64, seq: u64, payload: &[u8], e: ReplayError) {
        self.count_replay("failed");
        self.set_error(format!("replay from {from}: {e}"));
        tracing::warn!(stream = %self.id(), from, to = seq, error = %e, "kv events: gap replay failed; the replica is cleared");
        self.shared.lock().state.mark_gap(seq);
        self.count_clear(CLEAR_SEQUENCE_GAP);
        self.apply(seq, payload, true);
    }

    /// Whether the engine's replay holds batch `seq` with this digest.
    async fn engine_sent(&self, ep: &str, seq: u64, digest: u64) -> bool {
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

    fn gap_without_replay(&mut self, from: u64, seq: u64, payload: &[u8]) {
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
    async fn rebuild(&mut self, upto: Option<u64>) {
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
    async fn bootstrap(&mut self, upto: Option<u64>, holes_reason: &'static str) {
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

/// Why [`Processor::verify`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// A new connection of a stream holding state: nothing is routed until it succeeds.
    Attach,
    /// A live frame behind the last applied seq that is not a replayed batch.
    Behind,
    /// The idle tail check.
    Routine,
}

/// The retry schedule of a failed attach verification: capped exponential back-off with
/// jitter ([`SubscriberOptions::attach_retry_initial`] doubling to
/// [`SubscriberOptions::attach_retry_max`]), never exhausted.
struct AttachRetry {
    delays: backon::ExponentialBackoff,
    /// When the next attempt is due.
    next_at: Instant,
    /// Failed attempts so far.
    attempts: u32,
    max: Duration,
}

impl AttachRetry {
    fn new(opts: &SubscriberOptions) -> Self {
        use backon::BackoffBuilder;
        let max = opts.attach_retry_max.max(opts.attach_retry_initial);
        AttachRetry {
            delays: backon::ExponentialBuilder::default()
                .with_min_delay(opts.attach_retry_initial)
                .with_max_delay(max)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
            next_at: Instant::now(),
            attempts: 0,
            max,
        }
    }

    /// Records a failed attempt and schedules the next.
    fn schedule(&mut self) {
        self.attempts = self.attempts.saturating_add(1);
        let wait = self.delays.next().unwrap_or(self.max);
        self.next_at = Instant::now() + wait;
    }
}

/// What [`Processor::verify`] found.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Same incarnation; any lost tail applied.
    Same,
    /// The replica was cleared and rebuilt (another incarnation, holes, an unverifiable anchor).
    Reset,
    /// No replay endpoint, or the replay failed.
    Failed,
}

/// Decodes and applies one batch, recording metrics. The batch's `digest` (the replay anchor)
/// is recorded under the same lock as its effects, so a state saved at any moment names the
/// batch it reflects. `live` batches (not replayed ones) set the stream-lag gauge.
fn apply_payload(
    shared: &StreamShared,
    sink: &Sink,
    seq: u64,
    payload: &[u8],
    digest: u64,
    live: bool,
) {
    let id = shared.id();
    match decode_batch(payload) {
        Ok(batch) => {
            sink.metrics.decoded.with_label_values(&[id]).inc();
            if live && batch.ts.is_finite() && batch.ts > 0.0 {
                let now = now_unix_ms();
                let (skew, was) = {
                    let mut g = shared.lock();
                    let was = g.stats.clock.flagged;
                    let skew = g.stats.clock.observe(now, batch.ts);
                    g.stats.clock.flagged = skew.abs() > CLOCK_SKEW_FLAG_SECONDS;
                    (skew, was)
                };
                let flagged = skew.abs() > CLOCK_SKEW_FLAG_SECONDS;
                if flagged && !was {
                    tracing::warn!(stream = %id, skew_seconds = skew, "kv events: the engine's clock is {skew:.1} s off the agent's (positive: ahead); the stream lag leaves it out — check the engine node's time sync");
                } else if was && !flagged {
                    tracing::info!(stream = %id, skew_seconds = skew, "kv events: the engine's clock agrees with the agent's again");
                }
                sink.metrics.clock_skew.with_label_values(&[id]).set(skew);
                sink.metrics
                    .lag
                    .with_label_values(&[id])
                    .set(corrected_lag(now, batch.ts, skew));
            }
            let (report, held) = {
                let mut g = shared.lock();
                let report = g.state.apply(seq, &batch, now_unix_ms());
                g.state.record_digest(seq, digest);
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
            {
                let mut g = shared.lock();
                g.state.note_undecodable(seq);
                g.state.record_digest(seq, digest);
            }
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
    /// Replies came, then none (and no end marker) within the timeout: what was received,
    /// seqs ascending (vLLM < 0.33 drops replies, the end marker included, past its ROUTER's
    /// send high-water mark).
    #[error("timed out after {} replies without the end marker", .0.len())]
    Unterminated(Vec<(u64, Vec<u8>)>),
    /// A reply had fewer than 2 frames or a seq frame that is not 8 bytes.
    #[error("malformed reply")]
    BadReply,
    /// More batches than [`SubscriberOptions::replay_max_batches`].
    #[error("more than {0} batches")]
    TooMany(usize),
    /// More payload bytes than [`SubscriberOptions::replay_max_bytes`].
    #[error("more than {0} bytes of batches")]
    TooLarge(usize),
    /// The replay socket's peer broke the ZMTP limits and was dropped ([`zmtp_guard`]).
    #[error("connection dropped: {0}")]
    PeerDropped(Dropped),
    /// The engine's replies carry a topic the subscription's prefix does not match: its live
    /// messages never pass this SUB socket's filter.
    #[error("the engine publishes under topic {engine:?}, which the subscription to {subscribed:?} filters out")]
    TopicMismatch {
        /// The topic of the engine's replies.
        engine: String,
        /// The topic prefix subscribed to.
        subscribed: String,
    },
}

/// Requests a replay from `start` on a fresh DEALER connected to `endpoint` (through the guard,
/// [`zmtp_guard`], at [`SubscriberOptions::max_message_bytes`]) and collects
/// `(seq, payload)` pairs up to the end marker. Replies at or past `upto` are not needed, so
/// collection stops at the first one (the engine keeps sending; the socket is then closed).
/// Replies that carry a topic (vLLM ≥ 0.26, SGLang ≥ 0.5.22: `["", topic, seq, payload]`) must
/// start with `topic`, the live subscription's prefix: otherwise the live messages are being
/// filtered out, and the replay is refused with [`ReplayError::TopicMismatch`]. At most
/// [`SubscriberOptions::replay_max_batches`] batches and
/// [`SubscriberOptions::replay_max_bytes`] payload bytes are collected.
///
/// # Errors
/// [`ReplayError`]; [`ReplayError::PeerDropped`] when the endpoint sent a frame or message over
/// the limit (or not ZMTP at all).
pub async fn request_replay(
    endpoint: &str,
    start: u64,
    upto: u64,
    topic: &str,
    opts: &SubscriberOptions,
) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
    let dropped = Arc::new(Mutex::new(None::<Dropped>));
    let wake = Arc::new(Notify::new());
    let on_drop: OnDrop = {
        let (dropped, wake) = (dropped.clone(), wake.clone());
        Arc::new(move |d| {
            *dropped.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
            wake.notify_one();
        })
    };
    let guarded = zmtp_guard::connect(
        endpoint,
        limits(opts),
        opts.replay_timeout + Duration::from_millis(500),
        on_drop,
    )
    .await
    .map_err(ReplayError::Connect)?;
    let peer_dropped = || {
        dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(ReplayError::PeerDropped)
    };
    let mut zopts = SocketOptions::default();
    zopts.connect_timeout(opts.replay_timeout);
    let mut sock = DealerSocket::with_options(zopts);
    match tokio::time::timeout(
        opts.replay_timeout + Duration::from_millis(500),
        sock.connect(guarded.endpoint()),
    )
    .await
    {
        Ok(Ok(())) => {}
        // The guard may have dropped the peer during the handshake.
        Ok(Err(e)) => return Err(peer_dropped().unwrap_or(ReplayError::Connect(e.to_string()))),
        Err(_) => return Err(peer_dropped().unwrap_or(ReplayError::Connect("timed out".into()))),
    }
    let mut req = ZmqMessage::from(Vec::<u8>::new());
    req.push_back(start.to_be_bytes().to_vec().into());
    sock.send(req)
        .await
        .map_err(|e| ReplayError::Socket(e.to_string()))?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    let deadline = tokio::time::Instant::now() + opts.replay_deadline;
    loop {
        let wait = (tokio::time::Instant::now() + opts.replay_timeout).min(deadline);
        let msg = tokio::select! {
            m = tokio::time::timeout_at(wait, sock.recv()) => m,
            () = wake.notified() => {
                return Err(peer_dropped().unwrap_or(ReplayError::Timeout));
            }
        };
        let msg = match msg {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(peer_dropped().unwrap_or(ReplayError::Socket(e.to_string()))),
            Err(_) => {
                return Err(peer_dropped().unwrap_or(if out.is_empty() {
                    ReplayError::Timeout
                } else {
                    ReplayError::Unterminated(out)
                }))
            }
        };
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
        if n >= 4 && !frames[n - 3].starts_with(topic.as_bytes()) {
            return Err(ReplayError::TopicMismatch {
                engine: String::from_utf8_lossy(&frames[n - 3]).into_owned(),
                subscribed: topic.to_string(),
            });
        }
        bytes = bytes.saturating_add(frames[n - 1].len());
        if bytes > opts.replay_max_bytes {
            return Err(ReplayError::TooLarge(opts.replay_max_bytes));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scheme: &str) -> StreamSpec {
        StreamSpec {
            descriptor: StreamDescriptor {
                hash_scheme: scheme.into(),
                ..StreamDescriptor::default()
            },
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            config: StreamConfig::default(),
        }
    }

    #[test]
    fn clock_skew_is_estimated_from_the_fastest_batch_and_left_out_of_the_lag() {
        let mut c = ClockSkew::default();
        let t0 = 1_767_225_600_000i64;
        // An engine 6 h ahead; batches arrive 5 ms to 2 s after they were stamped.
        let ahead = 21_600.0;
        for (i, delay_ms) in [2000i64, 5, 300, 40].iter().enumerate() {
            let now = t0 + i as i64 * 1000;
            let ts = (now - delay_ms) as f64 / 1000.0 + ahead;
            c.observe(now, ts);
        }
        let skew = c.estimate().unwrap();
        assert!((skew - (ahead - 0.005)).abs() < 1e-3, "{skew}");
        // A batch 300 ms late reads 300 ms of lag, not -6 h.
        let now = t0 + 10_000;
        let lag = corrected_lag(now, (now - 300) as f64 / 1000.0 + ahead, skew);
        assert!((lag - 0.295).abs() < 1e-3, "{lag}");
        // Without skew the lag is the raw difference, whatever the estimate's milliseconds.
        assert!((corrected_lag(now, (now - 300) as f64 / 1000.0, -0.004) - 0.3).abs() < 1e-6);
        // The window forgets: 10 minutes later a corrected clock reads as such.
        let later = t0 + 11 * 60_000;
        let s = c.observe(later, (later - 5) as f64 / 1000.0);
        assert!(s.abs() < 0.01, "{s}");
        // An engine behind by 2 h.
        let mut c = ClockSkew::default();
        c.observe(t0, (t0 - 10) as f64 / 1000.0 - 7200.0);
        assert!((c.estimate().unwrap() + 7200.01).abs() < 1e-3);
    }

    #[test]
    fn each_engine_family_has_its_message_limit_within_the_hard_cap() {
        let opts = SubscriberOptions::default();
        assert_eq!(
            stream_max_message_bytes(&spec("vllm"), &opts),
            zmtp_guard::VLLM_MAX_MESSAGE_BYTES
        );
        assert_eq!(
            stream_max_message_bytes(&spec("sglang"), &opts),
            zmtp_guard::SGLANG_MAX_MESSAGE_BYTES
        );
        assert_eq!(
            stream_max_message_bytes(&spec("trtllm"), &opts),
            zmtp_guard::HARD_MAX_MESSAGE_BYTES
        );
        let lower = SubscriberOptions {
            max_message_bytes: 1 << 20,
            ..SubscriberOptions::default()
        };
        assert_eq!(stream_max_message_bytes(&spec("sglang"), &lower), 1 << 20);
        let higher = SubscriberOptions {
            max_message_bytes: usize::MAX,
            ..SubscriberOptions::default()
        };
        assert_eq!(
            stream_max_message_bytes(&spec("sglang"), &higher),
            zmtp_guard::HARD_MAX_MESSAGE_BYTES
        );
    }
}
