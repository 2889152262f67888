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
//!   Each message is also charged, from the socket until it is applied, against the node-wide
//!   [`budget`] (its bytes plus what decoding it may allocate); a message the budget cannot
//!   take is dropped the same way (`inflight_budget`), and its stream reads Stale
//!   `TailUnverified` until the gap is healed.
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
//!
//! # Files
//!
//! - this file: a stream's spec, options, shared state and the two tasks' wiring ([`spawn`]);
//! - [`reader`]: the SUB socket through the ZMTP guard, its reconnect back-off and the queue;
//! - [`processor`]: the processor task — live messages, attach, idle tail checks, coverage;
//!   its verification and healing by anchored replay live in `processor/verify.rs`;
//! - [`budget`]: the node-wide budget of message bytes in flight (all streams);
//! - [`replay`]: the replay client (DEALER request, replies up to the end marker) and what a
//!   replay's replies show (anchor judgment, contiguous runs);
//! - [`clock`]: the engine clock's skew, left out of the stream lag.

pub mod budget;
mod clock;
mod processor;
mod reader;
pub mod replay;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ic_shared::plan::HashScheme;
use ic_shared::proto::StreamDescriptor;
use tokio::sync::{mpsc, Notify};

use std::sync::atomic::AtomicUsize;

use super::metrics::KvMetrics;
use super::stream::{LinkState, StreamConfig, StreamState};
use super::zmtp_guard::{self, ZmtpLimits};

use clock::ClockSkew;
use processor::process_loop;
use reader::{read_loop, Queue};

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
    /// dropped as `queue_full` (default 32 MiB): bounds one stream's queue while its processor
    /// is busy (a replay) however large the messages are. Every stream's messages together are
    /// bounded by the node-wide [`budget`] (`--kv-inflight-bytes`).
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
    /// The node-wide budget of message bytes in flight, shared by every stream ([`budget`]).
    pub budget: Arc<budget::InflightBudget>,
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
