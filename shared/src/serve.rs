//! Connection limits for every listener of both binaries (docs/security.md "Connection
//! limits"): a cap on concurrent connections, a bound on how long a client may take to send a
//! request's headers (and so how long an idle keep-alive connection stays open), a bound on
//! each request's handling, and for gRPC a first-byte deadline plus HTTP/2 keep-alive pings.
//!
//! HTTP listeners are served by hyper-util's connection builder
//! ([`hyper_util::server::conn::auto::Builder`]: HTTP/1.1 `header_read_timeout` with
//! hyper-util's Tokio timer, HTTP/2 keep-alive pings, graceful shutdown by
//! [`hyper_util::server::graceful::GracefulShutdown`]); gRPC by
//! tonic's server builder over a capped incoming stream ([`grpc_incoming`],
//! [`ConnectionLimits::grpc_server`]).
//!
//! A connection accepted while the cap is reached is closed at once (its file descriptor is
//! released; the client sees the connection reset or closed) and counted in
//! [`ListenerStats::refused`].
//!
//! Listeners are bound by [`listen`], whose kernel accept queue (the `listen(2)` backlog) holds
//! as many connections as the cap allows ([`ConnectionLimits::listen_backlog`]): tokio's
//! `TcpListener::bind` asks for 1 024, and when thousands of agents reconnect at once (a
//! controller restart) the SYNs beyond a full queue are dropped (`TcpExt: ListenOverflows`) and
//! those clients wait out their SYN retransmit (1 s, 3 s, …) or their connect timeout.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

/// Default cap on concurrent connections per listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default time a client has to send a request's headers (HTTP/1.1; also the longest an idle
/// keep-alive connection stays open, since hyper starts the timer when a connection waits for
/// its next request) or its first byte (gRPC, TLS handshakes).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound on one HTTP request's handling, its body read included.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Default interval of the gRPC server's HTTP/2 keep-alive pings.
pub const DEFAULT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// Default time a gRPC peer has to answer a keep-alive ping before its connection is closed.
pub const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Default cap on concurrent HTTP/2 streams per connection (`SETTINGS_MAX_CONCURRENT_STREAMS`;
/// one more is reset with `REFUSED_STREAM`).
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 128;
/// Default time a connection may have no request in flight before it is closed (HTTP/2
/// keep-alive pings and other control frames do not count as requests).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default time an `AgentService.Connect` stream has to send its `Hello` once it is open.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound on the bytes an `AgentService.Connect` stream may send before its `Hello` is
/// accepted (the `Hello` itself included: a 1–2 KiB service-account token and a few names).
pub const DEFAULT_PRE_AUTH_BYTES: usize = 64 * 1024;
/// Default cap on connections of the separate health listener (`--health-addr`).
pub const DEFAULT_HEALTH_MAX_CONNECTIONS: usize = 32;
/// Longest header-read, request and idle bound of the health listener
/// ([`ConnectionLimits::health`]).
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap on `AgentService.Connect` streams awaiting their `Hello` or its authentication
/// at once, over all connections.
pub const DEFAULT_MAX_PENDING_HELLOS: usize = 1024;

/// The limits of one listener (`--*-max-connections`, `--*-header-read-timeout-seconds`, …;
/// chart `values.yaml` `connectionLimits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Concurrent connections at most; one more is closed at accept.
    pub max_connections: usize,
    /// HTTP/1.1: time to receive a request's headers, counted from when the connection starts
    /// waiting for the request — so it also closes idle keep-alive connections and slowloris
    /// header trickles. gRPC: time to the first byte after accept. TLS: the handshake.
    pub header_read_timeout: Duration,
    /// HTTP/1.1: time to answer one request once its headers are in (body read included); a
    /// request over it answers 408 and its connection is closed.
    pub request_timeout: Duration,
    /// gRPC: HTTP/2 keep-alive ping interval (dead or silent peers are found by the pings).
    pub keepalive_interval: Duration,
    /// gRPC: time to answer a ping before the connection is closed.
    pub keepalive_timeout: Duration,
    /// HTTP/2: concurrent streams per connection (`SETTINGS_MAX_CONCURRENT_STREAMS`); a client
    /// that opens one more gets `RST_STREAM(REFUSED_STREAM)` for it.
    pub max_concurrent_streams: u32,
    /// Time a connection may have no request in flight (HTTP/1.1 and HTTP/2; keep-alive pings
    /// and other control frames are not requests) before it is closed. Before its first
    /// request a connection has [`Self::header_read_timeout`] instead, counted from accept: a
    /// half-sent HTTP/2 preface, or a preface and no request, is cut then.
    pub idle_timeout: Duration,
    /// gRPC `AgentService.Connect`: time from the stream's start to its first message (the
    /// `Hello`; its TokenReview is bounded by the review limiter, not by this); the stream then
    /// ends with `DEADLINE_EXCEEDED`.
    pub hello_timeout: Duration,
    /// gRPC `AgentService.Connect`: bytes a stream may send before its `Hello` is accepted; a
    /// first message announcing more, or more bytes before acceptance, ends the stream with
    /// `RESOURCE_EXHAUSTED` (the full message limit applies once the `Hello` is accepted).
    pub pre_auth_bytes: usize,
    /// gRPC `AgentService.Connect`: streams awaiting their `Hello` or its authentication at
    /// once (all connections together); one more ends at once with `RESOURCE_EXHAUSTED`.
    pub max_pending_hellos: usize,
    /// Controller HTTP: a separate listener serving only `/healthz` and `/readyz` under its own
    /// connection budget, so the kubelet's probes are answered while data clients hold every
    /// slot of the HTTP listener; `None`: no such listener.
    pub health_addr: Option<SocketAddr>,
    /// Concurrent connections of the [`Self::health_addr`] listener.
    pub health_max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            keepalive_interval: DEFAULT_KEEPALIVE_INTERVAL,
            keepalive_timeout: DEFAULT_KEEPALIVE_TIMEOUT,
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            pre_auth_bytes: DEFAULT_PRE_AUTH_BYTES,
            max_pending_hellos: DEFAULT_MAX_PENDING_HELLOS,
            health_addr: None,
            health_max_connections: DEFAULT_HEALTH_MAX_CONNECTIONS,
        }
    }
}

impl ConnectionLimits {
    /// The `listen(2)` backlog of a listener under these limits: [`Self::max_connections`]
    /// (at most `u32::MAX`), so a burst of as many connections as the listener may hold queues
    /// in the kernel instead of being dropped at the SYN. The kernel caps it at
    /// `net.core.somaxconn` ([`listen`] warns when that is lower).
    pub fn listen_backlog(&self) -> u32 {
        u32::try_from(self.max_connections.max(1)).unwrap_or(u32::MAX)
    }
}

/// Binds a TCP listener on `addr` with the accept queue `limits` asks for
/// ([`ConnectionLimits::listen_backlog`]) and `SO_REUSEADDR` (what `TcpListener::bind` sets, so
/// a restarted process binds while the old connections linger in TIME_WAIT). Logs a warning
/// when the kernel's `net.core.somaxconn` caps the backlog below that. Errors: the socket
/// could not be created, bound or put into the listening state.
pub fn listen(addr: SocketAddr, limits: &ConnectionLimits) -> io::Result<TcpListener> {
    let backlog = limits.listen_backlog();
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    if let Some(cap) = somaxconn() {
        if cap < backlog {
            warn!(%addr, backlog, somaxconn = cap, "the kernel caps this listener's accept queue at net.core.somaxconn: a burst of more connections than that waits for SYN retransmits; raise net.core.somaxconn to at least --max-connections");
        }
    }
    socket.listen(backlog)
}

/// `net.core.somaxconn` (Linux), when readable.
fn somaxconn() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The command-line flags of the listeners' limits, flattened into both binaries' arguments
/// (`--max-connections`, `--header-read-timeout-seconds`, `--request-timeout-seconds`); each
/// listener applies them on its own.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionLimitArgs {
    /// Concurrent connections per listener; one more is closed at accept.
    #[arg(long, env = "IC_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers; also how long an idle keep-alive
    /// connection stays open, and the TLS handshake and gRPC first-byte deadline.
    #[arg(long, env = "IC_HEADER_READ_TIMEOUT_SECONDS", default_value_t = DEFAULT_HEADER_READ_TIMEOUT.as_secs())]
    pub header_read_timeout_seconds: u64,
    /// Seconds one HTTP request may take once its headers are in (body included): 408 after.
    #[arg(long, env = "IC_REQUEST_TIMEOUT_SECONDS", default_value_t = DEFAULT_REQUEST_TIMEOUT.as_secs())]
    pub request_timeout_seconds: u64,
}

/// The gRPC server's HTTP/2 keep-alive flags (the controller's; flattened next to
/// [`ConnectionLimitArgs`]).
#[derive(Debug, Clone, clap::Args)]
pub struct GrpcKeepaliveArgs {
    /// Seconds between the gRPC server's HTTP/2 keep-alive pings.
    #[arg(long, env = "IC_GRPC_KEEPALIVE_SECONDS", default_value_t = DEFAULT_KEEPALIVE_INTERVAL.as_secs())]
    pub grpc_keepalive_seconds: u64,
    /// Seconds a gRPC peer has to answer a keep-alive ping before its connection is closed.
    #[arg(long, env = "IC_GRPC_KEEPALIVE_TIMEOUT_SECONDS", default_value_t = DEFAULT_KEEPALIVE_TIMEOUT.as_secs())]
    pub grpc_keepalive_timeout_seconds: u64,
}

/// The controller's bounds on HTTP/2 streams, idle connections, agent handshakes and the
/// health listener (docs/security.md "Streams, handshakes and idle connections"; flattened
/// next to [`ConnectionLimitArgs`]; [`ConnectionLimits::with_streams`]).
#[derive(Debug, Clone, clap::Args)]
pub struct StreamLimitArgs {
    /// Concurrent HTTP/2 streams per connection on every listener; a client that opens one
    /// more gets it reset with REFUSED_STREAM.
    #[arg(long, env = "IC_MAX_CONCURRENT_STREAMS", default_value_t = DEFAULT_MAX_CONCURRENT_STREAMS)]
    pub max_concurrent_streams: u32,
    /// Seconds a connection may have no request in flight before it is closed (HTTP/2
    /// keep-alive pings do not count); before its first request a connection has
    /// --header-read-timeout-seconds from accept.
    #[arg(long, env = "IC_IDLE_TIMEOUT_SECONDS", default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub idle_timeout_seconds: u64,
    /// Seconds an AgentService.Connect stream has to send its Hello; it then ends with
    /// DEADLINE_EXCEEDED.
    #[arg(long, env = "IC_AGENT_HELLO_TIMEOUT_SECONDS", default_value_t = DEFAULT_HELLO_TIMEOUT.as_secs())]
    pub agent_hello_timeout_seconds: u64,
    /// Bytes an AgentService.Connect stream may send before its Hello is accepted (the Hello
    /// included); more ends it with RESOURCE_EXHAUSTED before they are buffered.
    #[arg(long, env = "IC_AGENT_PRE_AUTH_BYTES", default_value_t = DEFAULT_PRE_AUTH_BYTES)]
    pub agent_pre_auth_bytes: usize,
    /// AgentService.Connect streams awaiting their Hello or its authentication at once (all
    /// connections together); one more ends at once with RESOURCE_EXHAUSTED.
    #[arg(long, env = "IC_AGENT_MAX_PENDING_HELLOS", default_value_t = DEFAULT_MAX_PENDING_HELLOS)]
    pub agent_max_pending_hellos: usize,
    /// Listen address of a separate listener serving only /healthz and /readyz under its own
    /// connection budget (the kubelet's probes answer while data clients fill the HTTP
    /// listener's slots); unset: none.
    #[arg(long, env = "IC_HEALTH_ADDR")]
    pub health_addr: Option<SocketAddr>,
    /// Concurrent connections of the --health-addr listener.
    #[arg(long, env = "IC_HEALTH_MAX_CONNECTIONS", default_value_t = DEFAULT_HEALTH_MAX_CONNECTIONS)]
    pub health_max_connections: usize,
}

impl ConnectionLimits {
    /// These limits with the stream, idle, handshake and health-listener bounds of `args` (a 0
    /// count or duration is raised to 1).
    pub fn with_streams(self, args: &StreamLimitArgs) -> ConnectionLimits {
        let secs = |s: u64| Duration::from_secs(s.max(1));
        ConnectionLimits {
            max_concurrent_streams: args.max_concurrent_streams.max(1),
            idle_timeout: secs(args.idle_timeout_seconds),
            hello_timeout: secs(args.agent_hello_timeout_seconds),
            pre_auth_bytes: args.agent_pre_auth_bytes.max(1),
            max_pending_hellos: args.agent_max_pending_hellos.max(1),
            health_addr: args.health_addr,
            health_max_connections: args.health_max_connections.max(1),
            ..self
        }
    }
}

impl ConnectionLimits {
    /// The limits of the separate health listener ([`Self::health_addr`]): its own
    /// [`Self::health_max_connections`] slots, and header-read, request and idle bounds of at
    /// most [`HEALTH_TIMEOUT`] (a probe is one short request), at most 8 streams per
    /// connection.
    pub fn health(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.health_max_connections.max(1),
            header_read_timeout: self.header_read_timeout.min(HEALTH_TIMEOUT),
            request_timeout: self.request_timeout.min(HEALTH_TIMEOUT),
            idle_timeout: self.idle_timeout.min(HEALTH_TIMEOUT),
            max_concurrent_streams: self.max_concurrent_streams.clamp(1, 8),
            ..*self
        }
    }
}

impl ConnectionLimitArgs {
    /// The limits these flags name, with the default keep-alive (a 0 count or duration is
    /// raised to 1).
    pub fn limits(&self) -> ConnectionLimits {
        let secs = |s: u64| Duration::from_secs(s.max(1));
        ConnectionLimits {
            max_connections: self.max_connections.max(1),
            header_read_timeout: secs(self.header_read_timeout_seconds),
            request_timeout: secs(self.request_timeout_seconds),
            ..ConnectionLimits::default()
        }
    }

    /// The limits with the gRPC keep-alive of `grpc`.
    pub fn with_keepalive(&self, grpc: &GrpcKeepaliveArgs) -> ConnectionLimits {
        let secs = |s: u64| Duration::from_secs(s.max(1));
        ConnectionLimits {
            keepalive_interval: secs(grpc.grpc_keepalive_seconds),
            keepalive_timeout: secs(grpc.grpc_keepalive_timeout_seconds),
            ..self.limits()
        }
    }
}

/// Counters of one listener (tests read them; [`ListenerMetrics`] exports them as
/// `…_listener_connections_closed_total{listener, reason}`).
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections closed at accept because the cap was reached.
    pub refused: AtomicU64,
    /// Connections closed because the header-read (or first-byte, or handshake, or
    /// first-request) deadline passed, hyper's own HTTP/1.1 header-read timeout on a
    /// keep-alive connection included.
    pub timed_out: AtomicU64,
    /// Connections closed after [`ConnectionLimits::idle_timeout`] with no request in flight.
    pub idle_closed: AtomicU64,
}

impl ListenerStats {
    /// Connections refused at the cap so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
    /// Connections closed for a missed header/first-byte/handshake/first-request deadline so
    /// far.
    pub fn timed_out(&self) -> u64 {
        self.timed_out.load(Ordering::Relaxed)
    }
    /// Connections closed for having no request in flight for the idle timeout so far.
    pub fn idle_closed(&self) -> u64 {
        self.idle_closed.load(Ordering::Relaxed)
    }
}

/// The `reason` label values of `…_listener_connections_closed_total`, in the order of
/// [`ListenerStats`]' counters: `connection_cap` ([`ListenerStats::refused`]),
/// `header_read_timeout` ([`ListenerStats::timed_out`]), `idle_timeout`
/// ([`ListenerStats::idle_closed`]).
pub const CLOSE_REASONS: [&str; 3] = ["connection_cap", "header_read_timeout", "idle_timeout"];

/// The listeners of one binary exported on its registry as the counter
/// `{prefix}listener_connections_closed_total{listener, reason}` (connections; reasons
/// [`CLOSE_REASONS`]), read from each listener's [`ListenerStats`] at every scrape. Every
/// listener's series exist at 0 from when it is added. Streams that hyper's HTTP/2 server
/// refuses itself (`RST_STREAM(REFUSED_STREAM)` beyond
/// [`ConnectionLimits::max_concurrent_streams`]) are not counted: hyper and h2 do not report
/// them to the application (docs/security.md "Streams, handshakes and idle connections").
#[derive(Clone)]
pub struct ListenerMetrics {
    closed: prometheus::IntCounterVec,
    listeners: Arc<std::sync::Mutex<Named>>,
}

/// Listeners by name ([`ListenerMetrics`]).
type Named = Vec<(&'static str, Arc<ListenerStats>)>;

impl std::fmt::Debug for ListenerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerMetrics").finish_non_exhaustive()
    }
}

impl ListenerMetrics {
    /// Registers `{prefix}listener_connections_closed_total` on `registry` (`prefix`:
    /// `inferencecache_controller_`, `inferencecache_agent_`).
    ///
    /// # Errors
    /// The registry's, when the name is registered already.
    pub fn register(
        registry: &prometheus::Registry,
        prefix: &str,
    ) -> Result<Self, prometheus::Error> {
        let closed = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("{prefix}listener_connections_closed_total"),
                "Connections a listener closed on its own, by listener and reason \
                 (connection_cap: refused at accept with every slot taken; header_read_timeout: \
                 no request headers, gRPC first byte, TLS handshake or first HTTP/2 request \
                 within the header-read deadline; idle_timeout: no request in flight for the \
                 idle timeout, HTTP/2 pings not counting).",
            ),
            &["listener", "reason"],
        )?;
        let m = ListenerMetrics {
            closed,
            listeners: Arc::default(),
        };
        registry.register(Box::new(m.clone()))?;
        Ok(m)
    }

    /// New stats for the listener `listener` (`grpc`, `http`, `health`, `webhook`, `metrics`),
    /// exported from now on.
    pub fn stats(&self, listener: &'static str) -> Arc<ListenerStats> {
        let stats = Arc::new(ListenerStats::default());
        self.add(listener, stats.clone());
        stats
    }

    /// Exports `stats` under `listener` from now on.
    pub fn add(&self, listener: &'static str, stats: Arc<ListenerStats>) {
        for reason in CLOSE_REASONS {
            self.closed.with_label_values(&[listener, reason]);
        }
        self.lock().push((listener, stats));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Named> {
        self.listeners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl prometheus::core::Collector for ListenerMetrics {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.closed.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        // Held while the counters catch up with the stats, so two scrapes cannot both add.
        let listeners = self.lock();
        // Listeners that share a name (a restarted server's, a test's stacks) add up.
        let mut sums: std::collections::BTreeMap<(&str, &str), u64> = Default::default();
        for (listener, stats) in listeners.iter() {
            let now = [stats.refused(), stats.timed_out(), stats.idle_closed()];
            for (reason, now) in CLOSE_REASONS.iter().zip(now) {
                *sums.entry((listener, reason)).or_default() += now;
            }
        }
        for ((listener, reason), now) in sums {
            let c = self.closed.with_label_values(&[listener, reason]);
            let have = c.get();
            if now > have {
                c.inc_by(now - have);
            }
        }
        self.closed.collect()
    }
}

/// What one connection has in flight: requests (HTTP/1.1 requests, HTTP/2 streams the service
/// was called for) from the call until their response body is done or dropped. Control frames
/// (pings, settings, window updates) never reach the service, so they do not count.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicU64,
    served_any: AtomicBool,
    /// Milliseconds from `accepted` to when the last request ended.
    idle_since_ms: AtomicU64,
    accepted: Instant,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            in_flight: AtomicU64::new(0),
            served_any: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            accepted: Instant::now(),
        })
    }

    /// Counts one request in flight until the returned guard is dropped.
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.served_any.store(true, Ordering::Release);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// When the connection is due to be closed: `None` while a request is in flight; before
    /// the first request, `first_request` after accept; after it, `idle` after the last
    /// request ended. The `bool` is whether a request was ever served.
    fn deadline(&self, first_request: Duration, idle: Duration) -> Option<(Instant, bool)> {
        if self.in_flight() > 0 {
            return None;
        }
        if !self.served_any.load(Ordering::Acquire) {
            return Some((self.accepted + first_request, false));
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some((self.accepted + since + idle, true))
    }
}

/// One request in flight on its connection ([`Activity::begin`]); dropping it ends it.
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let ms = u64::try_from(self.0.accepted.elapsed().as_millis()).unwrap_or(u64::MAX);
        // The idle clock starts when the last request ends (set before the count drops, so
        // the reader never sees 0 in flight with an old idle start).
        self.0.idle_since_ms.fetch_max(ms, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted in flight until it is done or dropped.
pub struct GuardedBody<B> {
    inner: Pin<Box<B>>,
    guard: Option<InFlight>,
}

impl<B> GuardedBody<B> {
    /// `inner`, counted in flight by `guard` until its end.
    pub fn new(inner: B, guard: InFlight) -> Self {
        GuardedBody {
            inner: Box::pin(inner),
            guard: Some(guard),
        }
    }
}

impl<B: hyper::body::Body> hyper::body::Body for GuardedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let r = self.inner.as_mut().poll_frame(cx);
        if let Poll::Ready(None) = r {
            self.guard = None;
        }
        r
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A connection that holds one of its listener's permits until it is dropped, and ends itself
/// (reads end of stream) when its [`Activity`] says it is due: no request by
/// `header_read_timeout` after accept (a silent client, a half-sent HTTP/2 preface, a preface
/// and nothing after), or no request in flight for `idle_timeout`.
pub struct Limited<T> {
    inner: T,
    _permit: OwnedSemaphorePermit,
    activity: Arc<Activity>,
    first_request: Duration,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    cut: bool,
    stats: Arc<ListenerStats>,
}

impl<T: std::fmt::Debug> std::fmt::Debug for Limited<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limited")
            .field("inner", &self.inner)
            .field("activity", &self.activity)
            .finish_non_exhaustive()
    }
}

impl<T> Limited<T> {
    /// The wrapped connection.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// This connection's requests in flight ([`Activity::begin`] counts one).
    pub fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// Whether the connection is due to be closed; arms the timer for the next check
    /// otherwise.
    fn poll_due(&mut self, cx: &mut Context<'_>) -> bool {
        if self.cut {
            return true;
        }
        loop {
            let now = Instant::now();
            match self.activity.deadline(self.first_request, self.idle) {
                Some((due, served)) if due <= now => {
                    self.cut = true;
                    if served {
                        self.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                        debug!("connection had no request in flight for its idle timeout; closed");
                    } else {
                        self.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                        debug!(
                            "connection sent no request before its header-read deadline; closed"
                        );
                    }
                    return true;
                }
                Some((due, _)) => {
                    if self.timer.deadline().into_std() != due {
                        self.timer.as_mut().reset(due.into());
                    }
                }
                None => {
                    // In flight: look again one idle period from now.
                    if self.timer.deadline().into_std() <= now {
                        self.timer.as_mut().reset((now + self.idle).into());
                    }
                }
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.poll_due(cx) {
            // End of stream: the HTTP connection ends as if the client had closed it.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Limited<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// What a gRPC request learns of its connection (tonic puts it in the request's extensions):
/// the addresses, and the connection's [`Activity`] that [`InFlightLayer`] counts requests in.
#[derive(Debug, Clone)]
pub struct LimitedConnectInfo {
    /// The TCP addresses (also put in the request as tonic's own `TcpConnectInfo` by
    /// [`InFlightLayer`], so `Request::remote_addr` works).
    pub tcp: tonic::transport::server::TcpConnectInfo,
    /// The connection's requests in flight.
    pub activity: Arc<Activity>,
}

impl tonic::transport::server::Connected for Limited<TcpStream> {
    type ConnectInfo = LimitedConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        LimitedConnectInfo {
            tcp: tonic::transport::server::Connected::connect_info(&self.inner),
            activity: self.activity.clone(),
        }
    }
}

/// The tonic layer that counts each gRPC request in flight on its connection
/// ([`LimitedConnectInfo`]) until its response ends, so [`ConnectionLimits::idle_timeout`]
/// sees long-lived streams as activity and keep-alive pings as none.
#[derive(Debug, Clone, Copy, Default)]
pub struct InFlightLayer;

impl<S> tower::Layer<S> for InFlightLayer {
    type Service = InFlightService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        InFlightService { inner }
    }
}

/// The service of [`InFlightLayer`].
#[derive(Debug, Clone)]
pub struct InFlightService<S> {
    inner: S,
}

impl<S, ReqB, ResB> tower::Service<axum::http::Request<ReqB>> for InFlightService<S>
where
    S: tower::Service<axum::http::Request<ReqB>, Response = axum::http::Response<ResB>>,
    S::Future: Send + 'static,
    ResB: hyper::body::Body,
{
    type Response = axum::http::Response<GuardedBody<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: axum::http::Request<ReqB>) -> Self::Future {
        let info = req.extensions().get::<LimitedConnectInfo>().cloned();
        let guard = info.map(|i| {
            req.extensions_mut().insert(i.tcp.clone());
            i.activity.begin()
        });
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(match guard {
                Some(g) => resp.map(|b| GuardedBody::new(b, g)),
                // Not served by this module's listener: count nothing (a detached guard).
                None => resp.map(|b| GuardedBody::new(b, Activity::new().begin())),
            })
        })
    }
}

/// Accepts the next connection that fits under the cap; connections over it are closed at
/// once and counted. Transient accept errors (EMFILE, ECONNABORTED) are retried after a short
/// pause so a full descriptor table does not spin the loop.
async fn accept_limited(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    stats: &Arc<ListenerStats>,
    limits: &ConnectionLimits,
) -> (Limited<TcpStream>, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => match permits.clone().try_acquire_owned() {
                Ok(permit) => {
                    let _ = stream.set_nodelay(true);
                    let activity = Activity::new();
                    let first = activity.accepted + limits.header_read_timeout;
                    return (
                        Limited {
                            inner: stream,
                            _permit: permit,
                            activity,
                            first_request: limits.header_read_timeout,
                            idle: limits.idle_timeout,
                            timer: Box::pin(tokio::time::sleep_until(first.into())),
                            cut: false,
                            stats: stats.clone(),
                        },
                        peer,
                    );
                }
                Err(_) => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    debug!(%peer, "connection refused: the listener's connection cap is reached");
                    drop(stream);
                }
            },
            Err(e) => {
                debug!(error = %e, "accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves `app` as HTTP/1.1 (or HTTP/2, for TLS clients that negotiate it) on `listener` under `limits` until `shutdown` resolves, then lets
/// open requests finish for up to `drain` and returns. `handshake` turns each accepted TCP
/// connection into the stream HTTP is spoken over (identity for plain HTTP, a TLS accept for
/// HTTPS); it must finish within `limits.header_read_timeout`.
pub async fn serve_http<H, HF, IO>(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnectionLimits,
    stats: Arc<ListenerStats>,
    handshake: H,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> io::Result<()>
where
    H: Fn(Limited<TcpStream>) -> HF + Clone + Send + Sync + 'static,
    HF: Future<Output = io::Result<IO>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use tower::ServiceExt;
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams.max(1))
        .keep_alive_interval(limits.keepalive_interval)
        .keep_alive_timeout(limits.keepalive_timeout);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            c = accept_limited(&listener, &permits, &stats, &limits) => c,
            _ = &mut shutdown => break,
        };
        let handshake = handshake.clone();
        let app = app.clone();
        let builder = builder.clone();
        let stats = stats.clone();
        let watcher = graceful.watcher();
        let request_timeout = limits.request_timeout;
        let header_timeout = limits.header_read_timeout;
        tokio::spawn(async move {
            let activity = stream.activity();
            let io = match tokio::time::timeout(header_timeout, handshake(stream)).await {
                Ok(Ok(io)) => io,
                Ok(Err(e)) => {
                    debug!(%peer, error = %e, "connection handshake failed");
                    return;
                }
                Err(_) => {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    debug!(%peer, "connection handshake timed out");
                    return;
                }
            };
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    // Counted in flight until its response body ends (the idle timeout).
                    let guard = activity.begin();
                    async move {
                        let resp = match tokio::time::timeout(
                            request_timeout,
                            app.oneshot(req.map(axum::body::Body::new)),
                        )
                        .await
                        {
                            Ok(Ok(r)) => r,
                            Ok(Err(never)) => match never {},
                            Err(_) => request_timed_out(request_timeout),
                        };
                        Ok::<_, std::convert::Infallible>(
                            resp.map(|b| axum::body::Body::new(GuardedBody::new(b, guard))),
                        )
                    }
                });
            // The connection ends itself (Limited) when no request starts within the
            // header-read deadline — a silent client, a half-sent HTTP/2 preface — or none is
            // in flight for the idle timeout (HTTP/2 pings do not count).
            let conn = watcher.watch(builder.serve_connection(TokioIo::new(io), service));
            if let Err(e) = conn.await {
                // hyper's HTTP/1.1 header-read timeout on a keep-alive connection.
                if e.downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout)
                {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                }
                debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(drain, graceful.shutdown()).await;
    Ok(())
}

fn request_timed_out(limit: Duration) -> axum::response::Response {
    let mut resp = axum::response::Response::new(axum::body::Body::from(format!(
        "request not handled within {} s\n",
        limit.as_secs()
    )));
    *resp.status_mut() = axum::http::StatusCode::REQUEST_TIMEOUT;
    resp.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    resp
}

/// The incoming-connection stream of a gRPC listener under `limits`: at most
/// `limits.max_connections` open at once (one more is closed at accept), and a connection that
/// sends nothing within `limits.header_read_timeout` is closed before tonic sees it. Pair with
/// [`ConnectionLimits::grpc_server`] for the HTTP/2 keep-alive pings.
pub fn grpc_incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
    stats: Arc<ListenerStats>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Limited<TcpStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        loop {
            let (stream, peer) = tokio::select! {
                c = accept_limited(&listener, &permits, &stats, &limits) => c,
                _ = tx.closed() => break,
            };
            let tx = tx.clone();
            let stats = stats.clone();
            let deadline = limits.header_read_timeout;
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                match tokio::time::timeout(deadline, stream.get_ref().peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(_) => {}
                    Err(_) => {
                        stats.timed_out.fetch_add(1, Ordering::Relaxed);
                        debug!(%peer, "gRPC connection sent nothing before its deadline; closed");
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

impl ConnectionLimits {
    /// A tonic server builder with this listener's HTTP/2 keep-alive pings (a peer that does
    /// not answer within `keepalive_timeout` is disconnected), its cap on concurrent streams
    /// per connection (`max_concurrent_streams`), and [`InFlightLayer`], which counts each
    /// request on its connection so a connection served from [`grpc_incoming`] closes after
    /// `idle_timeout` with none in flight.
    pub fn grpc_server(
        &self,
    ) -> tonic::transport::Server<
        tower::layer::util::Stack<InFlightLayer, tower::layer::util::Identity>,
    > {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .max_concurrent_streams(Some(self.max_concurrent_streams.max(1)))
            .layer(InFlightLayer)
    }
}

/// The identity handshake of plain HTTP listeners (for [`serve_http`]).
pub async fn plain(stream: Limited<TcpStream>) -> io::Result<Limited<TcpStream>> {
    Ok(stream)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Connects to `addr` one client at a time while nobody accepts, until one connect does
    /// not complete within 300 ms (its SYN was dropped: the accept queue is full); returns how
    /// many completed and the held streams.
    async fn fill_accept_queue(addr: SocketAddr, at_most: usize) -> (usize, Vec<TcpStream>) {
        let mut held = Vec::new();
        while held.len() < at_most {
            match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
                Ok(Ok(s)) => held.push(s),
                _ => break,
            }
        }
        (held.len(), held)
    }

    #[tokio::test]
    async fn the_accept_queue_holds_as_many_connections_as_the_cap() {
        let limits = |n: usize| ConnectionLimits {
            max_connections: n,
            ..Default::default()
        };
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        // A small cap: the kernel queues backlog + 1 connections, then drops SYNs (tokio's
        // `TcpListener::bind` would queue 1 024 here).
        let small = listen(loopback, &limits(8)).unwrap();
        let (queued, _held) = fill_accept_queue(small.local_addr().unwrap(), 200).await;
        assert!(
            (8..=9).contains(&queued),
            "{queued} connections queued with a backlog of 8"
        );
        // A larger cap queues all of a burst its size (when somaxconn allows, as by default).
        let large = listen(loopback, &limits(100)).unwrap();
        let (queued, _held) = fill_accept_queue(large.local_addr().unwrap(), 100).await;
        assert_eq!(
            queued, 100,
            "a burst of the cap's size was not queued whole"
        );
        assert_eq!(limits(0).listen_backlog(), 1);
        assert_eq!(limits(usize::MAX).listen_backlog(), u32::MAX);
    }

    /// Each listener's stats reach the registry at a scrape, by listener and reason; listeners
    /// of one name add up; every series exists at 0 from the listener's start.
    #[test]
    fn listener_stats_are_exported_by_listener_and_reason() {
        let registry = prometheus::Registry::new();
        let m = ListenerMetrics::register(&registry, "test_").unwrap();
        let grpc = m.stats("grpc");
        let text = || crate::telemetry::encode_metrics(&registry);
        let line = |l: &str, r: &str| {
            format!("test_listener_connections_closed_total{{listener=\"{l}\",reason=\"{r}\"}}")
        };
        for r in CLOSE_REASONS {
            assert!(
                text().contains(&format!("{} 0", line("grpc", r))),
                "{}",
                text()
            );
        }
        grpc.refused.fetch_add(3, Ordering::Relaxed);
        grpc.idle_closed.fetch_add(1, Ordering::Relaxed);
        m.stats("http").timed_out.fetch_add(2, Ordering::Relaxed);
        let again = Arc::new(ListenerStats::default());
        again.refused.fetch_add(1, Ordering::Relaxed);
        m.add("grpc", again);
        let t = text();
        assert!(
            t.contains(&format!("{} 4", line("grpc", "connection_cap"))),
            "{t}"
        );
        assert!(
            t.contains(&format!("{} 1", line("grpc", "idle_timeout"))),
            "{t}"
        );
        assert!(
            t.contains(&format!("{} 2", line("http", "header_read_timeout"))),
            "{t}"
        );
        // A second scrape adds nothing twice.
        assert!(text().contains(&format!("{} 4", line("grpc", "connection_cap"))));
        // The name is the registry's once.
        assert!(ListenerMetrics::register(&registry, "test_").is_err());
    }

    /// A gRPC connection the listener hands to tonic has Nagle's algorithm off: an ack or a
    /// LookupRoute answer is one small write, which Nagle would hold until the peer's delayed
    /// ACK (up to 40 ms on Linux).
    #[tokio::test]
    async fn accepted_grpc_connections_have_nagle_off() {
        use tokio::io::AsyncWriteExt;
        use tokio_stream::StreamExt;
        let limits = ConnectionLimits::default();
        let listener = listen(SocketAddr::from(([127, 0, 0, 1], 0)), &limits).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = grpc_incoming(listener, limits, Arc::default());
        let mut client = TcpStream::connect(addr).await.unwrap();
        client.write_all(b"P").await.unwrap();
        let accepted = tokio::time::timeout(Duration::from_secs(5), incoming.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(accepted.get_ref().nodelay().unwrap());
    }
}
