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
use std::time::Duration;

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
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            keepalive_interval: DEFAULT_KEEPALIVE_INTERVAL,
            keepalive_timeout: DEFAULT_KEEPALIVE_TIMEOUT,
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

/// Counters of one listener (tests and logs read them).
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections closed at accept because the cap was reached.
    pub refused: AtomicU64,
    /// Connections closed because the header-read (or first-byte, or handshake) deadline passed.
    pub timed_out: AtomicU64,
}

impl ListenerStats {
    /// Connections refused at the cap so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
    /// Connections closed for a missed header/first-byte/handshake deadline so far.
    pub fn timed_out(&self) -> u64 {
        self.timed_out.load(Ordering::Relaxed)
    }
}

/// A connection that holds one of its listener's permits until it is dropped.
#[derive(Debug)]
pub struct Limited<T> {
    inner: T,
    _permit: OwnedSemaphorePermit,
}

impl<T> Limited<T> {
    /// The wrapped connection.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
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

impl tonic::transport::server::Connected for Limited<TcpStream> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        tonic::transport::server::Connected::connect_info(&self.inner)
    }
}

/// Accepts the next connection that fits under the cap; connections over it are closed at
/// once and counted. Transient accept errors (EMFILE, ECONNABORTED) are retried after a short
/// pause so a full descriptor table does not spin the loop.
async fn accept_limited(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    stats: &ListenerStats,
) -> (Limited<TcpStream>, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => match permits.clone().try_acquire_owned() {
                Ok(permit) => {
                    let _ = stream.set_nodelay(true);
                    return (
                        Limited {
                            inner: stream,
                            _permit: permit,
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
        .keep_alive_interval(limits.keepalive_interval)
        .keep_alive_timeout(limits.keepalive_timeout);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            c = accept_limited(&listener, &permits, &stats) => c,
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
            let (io, read_any) = FirstRead::new(io);
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    async move {
                        match tokio::time::timeout(
                            request_timeout,
                            app.oneshot(req.map(axum::body::Body::new)),
                        )
                        .await
                        {
                            Ok(r) => r,
                            Err(_) => Ok(request_timed_out(request_timeout)),
                        }
                    }
                });
            let conn = watcher.watch(builder.serve_connection(TokioIo::new(io), service));
            // hyper's header-read timer starts once the HTTP version is known; a connection
            // that sends nothing at all is closed here.
            let silent = async {
                tokio::time::sleep(header_timeout).await;
                if read_any.load(Ordering::Acquire) {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                r = conn => if let Err(e) = r {
                    debug!(%peer, error = %e, "HTTP connection ended with an error");
                },
                _ = silent => {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    debug!(%peer, "connection sent nothing before its header-read deadline; closed");
                }
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

/// A stream that records whether any byte was read from it.
struct FirstRead<T> {
    inner: T,
    read_any: Arc<AtomicBool>,
}

impl<T> FirstRead<T> {
    fn new(inner: T) -> (Self, Arc<AtomicBool>) {
        let read_any = Arc::new(AtomicBool::new(false));
        (
            FirstRead {
                inner,
                read_any: read_any.clone(),
            },
            read_any,
        )
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FirstRead<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.read_any.store(true, Ordering::Release);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FirstRead<T> {
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
                c = accept_limited(&listener, &permits, &stats) => c,
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
    /// not answer within `keepalive_timeout` is disconnected).
    pub fn grpc_server(&self) -> tonic::transport::Server {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
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
