//! What an `AgentService.Connect` stream may cost before its `Hello` is accepted
//! (docs/security.md "Streams, handshakes and idle connections"): a deadline for the `Hello`
//! ([`HandshakeLimits::hello_timeout`]), a bound on the bytes buffered for it
//! ([`HandshakeLimits::pre_auth_bytes`], enforced on the request body by [`PreAuthGated`]
//! before tonic's decoder reserves or buffers anything), a cap on streams awaiting their
//! `Hello` or its authentication at once ([`HandshakeLimits::pending`]) and from one source
//! address at once ([`PendingBySource`], so one client cannot hold every slot), and bounds on
//! the `Hello`'s strings ([`check_hello_sizes`]). [`TokenFirst`] checks a `LookupRoute` caller's token
//! before its body is read.
//!
//! Without these, one client could open streams that never speak (≈ 12 KiB each: 100 000 on
//! one connection took the controller from 53 to 1 237 MB) or announce an 8 MiB first message
//! and send half of it (64 such streams: 25 → 588 MB), all before any token was reviewed.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::http;
use ic_shared::proto;
use ic_shared::serve::ConnectionLimits;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tonic::Status;

/// Length of a gRPC message's frame header: a compression flag and a 4-byte big-endian length.
const GRPC_HEADER_BYTES: usize = 5;

/// Most capabilities a `Hello` may list.
pub const MAX_HELLO_CAPABILITIES: usize = 64;

/// Default of `--agent-max-pending-hellos-per-source`: 64 streams, a sixteenth of the default
/// global cap (`--agent-max-pending-hellos`, 1 024). A node agent opens one stream at a time
/// and a node's per-pod subscribers one each, so a real source rarely has more than a few
/// awaiting their Hello; issue 38 D4 kept every agent out from one client with 8 connections
/// × 128 Hello-less streams.
pub const DEFAULT_MAX_PENDING_HELLOS_PER_SOURCE: usize = 64;

/// Streams awaiting their `Hello` (or its authentication) per source address
/// (`--agent-max-pending-hellos-per-source`). A source is the peer's IP address: an IPv4
/// address (IPv4-mapped IPv6 included) as is, an IPv6 address by its /64 prefix (one host is
/// usually given a whole /64). Streams without a peer address (not over TCP) are not counted
/// here; the global cap ([`HandshakeLimits::pending`]) still holds them. Entries are removed
/// when their count returns to 0, so the map holds at most one entry per pending stream.
#[derive(Debug)]
pub struct PendingBySource {
    max: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

impl PendingBySource {
    /// A tracker allowing `max` pending streams per source (0 raised to 1).
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(PendingBySource {
            max: max.max(1),
            counts: Mutex::new(HashMap::new()),
        })
    }

    /// The per-source cap.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The key `ip` is counted under: IPv4 (and IPv4-mapped IPv6) as is, other IPv6 by /64.
    pub fn source_key(ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V4(v4) => IpAddr::V4(v4),
            IpAddr::V6(v6) => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(std::net::Ipv6Addr::from(bits))
            }
        }
    }

    /// A slot for one more pending stream of `source`, held until the returned guard drops;
    /// `None` when `source` already has [`Self::max`] pending (the caller refuses the stream).
    pub fn try_acquire(self: &Arc<Self>, source: IpAddr) -> Option<SourceSlot> {
        let key = Self::source_key(source);
        let mut counts = self.counts.lock();
        let n = counts.entry(key).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(SourceSlot {
            owner: self.clone(),
            key,
        })
    }

    /// Streams of `source` pending now (tests, diagnostics).
    pub fn pending(&self, source: IpAddr) -> usize {
        self.counts
            .lock()
            .get(&Self::source_key(source))
            .copied()
            .unwrap_or(0)
    }
}

/// One pending stream's place in [`PendingBySource`]; dropping it frees the place.
#[derive(Debug)]
pub struct SourceSlot {
    owner: Arc<PendingBySource>,
    key: IpAddr,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut counts = self.owner.counts.lock();
        if let Some(n) = counts.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// The pre-authentication bounds of one `AgentService` (from [`ConnectionLimits`]).
#[derive(Debug, Clone)]
pub struct HandshakeLimits {
    /// Time from the stream's start to its first message (`--agent-hello-timeout-seconds`).
    pub hello_timeout: Duration,
    /// Bytes a stream may send before its `Hello` is accepted (`--agent-pre-auth-bytes`).
    pub pre_auth_bytes: usize,
    /// Permits of streams awaiting their `Hello` or its authentication
    /// (`--agent-max-pending-hellos`).
    pub pending: Arc<Semaphore>,
    /// The cap `pending` was made with (for messages).
    pub max_pending: usize,
}

impl HandshakeLimits {
    /// The bounds `limits` names (counts of 0 raised to 1).
    pub fn new(limits: &ConnectionLimits) -> Self {
        let max_pending = limits.max_pending_hellos.max(1);
        HandshakeLimits {
            hello_timeout: limits.hello_timeout,
            pre_auth_bytes: limits.pre_auth_bytes.max(GRPC_HEADER_BYTES + 1),
            pending: Arc::new(Semaphore::new(max_pending)),
            max_pending,
        }
    }
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        HandshakeLimits::new(&ConnectionLimits::default())
    }
}

/// Opens a stream's body to full-size messages once its `Hello` is accepted; found in the
/// request's extensions when the service runs behind [`PreAuthGated`].
#[derive(Debug, Clone, Default)]
pub struct PreAuthGate(Arc<AtomicBool>);

impl PreAuthGate {
    /// Lifts the pre-authentication byte bound of this stream.
    pub fn open(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// `AgentServiceServer` behind the pre-authentication byte bound: each request's body is
/// [`PreAuthBody`], and its [`PreAuthGate`] is put in the request's extensions for the
/// handler to open.
#[derive(Debug, Clone)]
pub struct PreAuthGated<S> {
    inner: S,
    pre_auth_bytes: usize,
}

impl<S> PreAuthGated<S> {
    /// `inner` with at most `pre_auth_bytes` read of each stream before its gate opens.
    pub fn new(inner: S, pre_auth_bytes: usize) -> Self {
        PreAuthGated {
            inner,
            pre_auth_bytes,
        }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for PreAuthGated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<tonic::body::Body>> for PreAuthGated<S>
where
    S: tonic::codegen::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let gate = PreAuthGate::default();
        let (mut parts, body) = req.into_parts();
        parts.extensions.insert(gate.clone());
        let body = tonic::body::Body::new(PreAuthBody {
            inner: Box::pin(body),
            gate: gate.0,
            cap: self.pre_auth_bytes,
            seen: 0,
            header: [0; GRPC_HEADER_BYTES],
            header_len: 0,
        });
        self.inner.call(http::Request::from_parts(parts, body))
    }
}

/// A request body that yields at most `cap` bytes until its gate opens: the first gRPC
/// message's announced length is checked against it before tonic sees the header (tonic
/// reserves the announced length at once), and no further data is read once `cap` bytes have
/// passed (at most one HTTP/2 DATA frame, 16 KiB by default, beyond it). Over either: the
/// body fails with `RESOURCE_EXHAUSTED`, which ends the stream.
struct PreAuthBody<B> {
    inner: Pin<Box<B>>,
    gate: Arc<AtomicBool>,
    cap: usize,
    seen: usize,
    header: [u8; GRPC_HEADER_BYTES],
    header_len: usize,
}

impl<B> PreAuthBody<B> {
    fn over_cap(&self) -> Status {
        Status::resource_exhausted(format!(
            "more than {} bytes arrived on AgentService.Connect before its Hello was accepted \
             (--agent-pre-auth-bytes); send the Hello alone first",
            self.cap
        ))
    }
}

impl<B> hyper::body::Body for PreAuthBody<B>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Data = Bytes;
    type Error = tonic::codegen::StdError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let open = self.gate.load(Ordering::Acquire);
        if !open && self.seen >= self.cap {
            return Poll::Ready(Some(Err(Box::new(self.over_cap()))));
        }
        let frame = match self.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if open {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(data) = frame.data_ref() {
            // The first message's header: refuse an announced length over the cap before
            // tonic reserves it.
            if self.header_len < GRPC_HEADER_BYTES {
                let take = (GRPC_HEADER_BYTES - self.header_len).min(data.len());
                let at = self.header_len;
                self.header[at..at + take].copy_from_slice(&data[..take]);
                self.header_len += take;
                if self.header_len == GRPC_HEADER_BYTES {
                    let h = self.header;
                    let announced = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
                    if announced.saturating_add(GRPC_HEADER_BYTES) > self.cap {
                        return Poll::Ready(Some(Err(Box::new(Status::resource_exhausted(
                            format!(
                                "the first message on AgentService.Connect announces {announced} \
                                 bytes; before its Hello is accepted a stream may send at most {} \
                                 (--agent-pre-auth-bytes)",
                                self.cap
                            ),
                        )))));
                    }
                }
            }
            self.seen = self.seen.saturating_add(data.len());
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// What `message` (a stream's first `Streaming::message()`) resolves to, or
/// `DEADLINE_EXCEEDED` naming `--agent-hello-timeout-seconds` when it does not resolve within
/// `timeout`.
pub async fn first_message<F>(
    timeout: Duration,
    message: F,
) -> Result<Option<proto::AgentMessage>, Status>
where
    F: Future<Output = Result<Option<proto::AgentMessage>, Status>>,
{
    match tokio::time::timeout(timeout, message).await {
        Ok(r) => r,
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no Hello arrived on AgentService.Connect within {} s of the stream's start \
             (--agent-hello-timeout-seconds); send the Hello first",
            timeout.as_secs()
        ))),
    }
}

/// Refuses a `Hello` whose names are longer than [`ic_shared::limits::MAX_NAME_BYTES`] or
/// which lists more than [`MAX_HELLO_CAPABILITIES`] capabilities (`INVALID_ARGUMENT`, naming the
/// field); the token is bounded by the pre-authentication byte cap only.
pub fn check_hello_sizes(hello: &proto::Hello) -> Result<(), Status> {
    let max = ic_shared::limits::MAX_NAME_BYTES;
    let mut fields: Vec<(&str, &str)> = vec![
        ("node", &hello.node),
        ("boot_id", &hello.boot_id),
        ("version", &hello.version),
        ("agent_instance", &hello.agent_instance),
    ];
    if let Some(p) = &hello.pod_subscriber {
        fields.push(("pod_subscriber.namespace", &p.namespace));
        fields.push(("pod_subscriber.pod", &p.pod));
    }
    for c in &hello.capabilities {
        fields.push(("capabilities[]", c));
    }
    if hello.capabilities.len() > MAX_HELLO_CAPABILITIES {
        return Err(Status::invalid_argument(format!(
            "Hello.capabilities lists {} entries; at most {MAX_HELLO_CAPABILITIES} are accepted",
            hello.capabilities.len()
        )));
    }
    for (name, value) in fields {
        if value.len() > max {
            return Err(Status::invalid_argument(format!(
                "Hello.{name} is {} bytes; at most {max} are accepted",
                value.len()
            )));
        }
    }
    Ok(())
}

/// `RouterService` (or any unary gRPC service) behind a bearer-token check that runs on the
/// request's headers, before tonic decodes its body: a `LookupRoute` without a token our
/// TokenReview accepts is answered (`UNAUTHENTICATED`, or `UNAVAILABLE` when no review can be
/// had) without a byte of its body being read, so an unauthenticated caller cannot make the
/// controller buffer up to the 4 MiB message limit per stream. The handler checks the token
/// again (a cache hit) and its grants as before. `None`: no check (standalone).
#[derive(Clone)]
pub struct TokenFirst<S> {
    inner: S,
    auth: Option<Arc<crate::access::CallerAuth>>,
}

impl<S> TokenFirst<S> {
    /// `inner`, its callers authenticated by `auth` first.
    pub fn new(inner: S, auth: Option<Arc<crate::access::CallerAuth>>) -> Self {
        TokenFirst { inner, auth }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for TokenFirst<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<tonic::body::Body>> for TokenFirst<S>
where
    S: tonic::codegen::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, std::convert::Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        // The ready service goes with this call; a fresh clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let auth = self.auth.clone();
        Box::pin(async move {
            if let Some(auth) = auth {
                let authorization = req
                    .headers()
                    .get(http::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                if let Err(e) = auth.authenticate(authorization).await {
                    return Ok(e.to_status().into_http());
                }
            }
            inner.call(req).await
        })
    }
}
