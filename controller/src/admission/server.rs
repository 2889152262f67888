//! The HTTPS admission server (axum on hyper-util + rustls/ring, under the listener's
//! [`ConnectionLimits`]: a cap on connections, the TLS handshake and each request's headers
//! within the header-read timeout, each review within the request timeout).
//!
//! Routes: `POST /mutate-cachebackend`, `POST /validate-cachebackend`, `POST /mutate-pod` (each
//! takes and returns an `admission.k8s.io/v1` AdmissionReview, always HTTP 200), and
//! `GET /healthz` (`ok`). Certificates: [`TlsSource`] — PEM files hot-reloaded on change
//! (cert-manager), or a self-signed pair whose CA PEM is returned in [`RunningServer::ca_pem`]
//! for the webhook configurations' `caBundle`.
//!
//! [`WebhookClient`] is a minimal HTTPS/1.1 keep-alive client for this server, used by the tests,
//! the benchmark and readiness checks on loopback.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use axum_server::tls_rustls::RustlsConfig;
use ic_shared::serve::{self, ConnectionLimits, ListenerStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

use super::tls::{self, TlsError, TlsSource};
use super::{Admission, Route};

/// Largest AdmissionReview body accepted (a Pod review is typically a few tens of KiB; the
/// apiserver caps objects at about 3 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Listen address (`0.0.0.0:9443` in cluster; `127.0.0.1:0` in tests).
    pub addr: SocketAddr,
    /// Certificate source.
    pub tls: TlsSource,
    /// Request body limit in bytes.
    pub max_body_bytes: usize,
    /// Connection limits (docs/security.md "Connection limits").
    pub limits: ConnectionLimits,
    /// Set to the serving certificate's `notAfter` (Unix seconds) at start and on every reload
    /// (`inferencecache_controller_webhook_cert_expiry_timestamp_seconds`); `None`: no metric.
    pub cert_expiry: Option<prometheus::IntGauge>,
}

impl ServerConfig {
    /// Settings with the default body limit.
    pub fn new(addr: SocketAddr, tls: TlsSource) -> Self {
        ServerConfig {
            addr,
            tls,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            limits: ConnectionLimits::default(),
            cert_expiry: None,
        }
    }
}

/// Server errors.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Certificates could not be loaded or generated.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Binding the listener failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The server stopped with an I/O error.
    #[error("admission server: {0}")]
    Serve(std::io::Error),
    /// The server task panicked or was cancelled.
    #[error("admission server task: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// The axum router over `admission` (no TLS; [`start`] wraps it).
pub fn router(admission: Arc<Admission>, max_body_bytes: usize) -> Router {
    let mut r = Router::new().route("/healthz", get(|| async { "ok" }));
    for route in Route::ALL {
        r = r.route(
            route.path(),
            post(
                move |State(a): State<Arc<Admission>>, body: Bytes| async move {
                    review_response(&a, route, &body)
                },
            ),
        );
    }
    r.layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(admission)
}

fn review_response(a: &Admission, route: Route, body: &[u8]) -> Response {
    let handled = a.handle_bytes(route, body);
    let status = StatusCode::from_u16(handled.status).unwrap_or(StatusCode::OK);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        handled.body,
    )
        .into_response()
}

/// A running server.
pub struct RunningServer {
    /// The bound address (the real port when `addr` had port 0).
    pub local_addr: SocketAddr,
    /// Self-signed mode: the CA PEM to put into the webhook configurations' `caBundle`
    /// (see [`tls::set_ca_bundle`]); in PEM mode the CA given; `None` in file mode.
    pub ca_pem: Option<String>,
    /// The live TLS configuration (reloads swap into it).
    pub rustls: RustlsConfig,
    /// Connections refused at the cap or closed for a missed deadline.
    pub stats: Arc<ListenerStats>,
    stop: tokio::sync::watch::Sender<bool>,
    server: JoinHandle<std::io::Result<()>>,
    reloader: Option<JoinHandle<()>>,
}

impl RunningServer {
    /// Starts a graceful shutdown (in-flight reviews get up to 5 s).
    pub fn shutdown(&self) {
        self.stop.send_replace(true);
    }

    /// Waits for the server to stop (after [`RunningServer::shutdown`]).
    pub async fn wait(self) -> Result<(), ServerError> {
        let res = self.server.await;
        if let Some(r) = self.reloader {
            r.abort();
        }
        res?.map_err(ServerError::Serve)
    }
}

/// Binds `cfg.addr`, loads or generates the certificate, and serves `admission` over HTTPS in a
/// background task. In file mode a watcher reloads the certificate when the files change.
///
/// Errors: certificate loading/generation ([`ServerError::Tls`]), binding
/// ([`ServerError::Bind`]).
pub async fn start(
    admission: Arc<Admission>,
    cfg: ServerConfig,
) -> Result<RunningServer, ServerError> {
    let (rustls, ca_pem, watch) = match &cfg.tls {
        TlsSource::Files {
            cert,
            key,
            reload_interval,
        } => {
            let sc = tls::server_config_from_files(cert, key)?;
            if let Ok(pem) = std::fs::read(cert) {
                tls::record_not_after(cfg.cert_expiry.as_ref(), &pem);
            }
            (
                RustlsConfig::from_config(Arc::new(sc)),
                None,
                Some((cert.clone(), key.clone(), *reload_interval)),
            )
        }
        TlsSource::SelfSigned(opts) => {
            let bundle = tls::generate_self_signed(&opts.subject_alt_names)?;
            if let Some(dir) = &opts.write_dir {
                tls::write_bundle(dir, &bundle)?;
            }
            let sc =
                tls::server_config_from_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())?;
            tls::record_not_after(cfg.cert_expiry.as_ref(), bundle.cert_pem.as_bytes());
            (
                RustlsConfig::from_config(Arc::new(sc)),
                Some(bundle.ca_pem),
                None,
            )
        }
        TlsSource::Pem {
            cert_pem,
            key_pem,
            ca_pem,
        } => {
            let sc = tls::server_config_from_pem(cert_pem.as_bytes(), key_pem.as_bytes())?;
            tls::record_not_after(cfg.cert_expiry.as_ref(), cert_pem.as_bytes());
            (
                RustlsConfig::from_config(Arc::new(sc)),
                ca_pem.clone(),
                None,
            )
        }
    };
    let bind_err = |source| ServerError::Bind {
        addr: cfg.addr,
        source,
    };
    let listener = serve::listen(cfg.addr, &cfg.limits).map_err(bind_err)?;
    let local_addr = listener.local_addr().map_err(bind_err)?;
    let app = router(admission, cfg.max_body_bytes);
    let stats = Arc::new(ListenerStats::default());
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let live = rustls.clone();
    // Each connection takes the configuration current at accept (reloads swap it).
    let handshake = move |stream: serve::Limited<tokio::net::TcpStream>| {
        let acceptor = tokio_rustls::TlsAcceptor::from(live.get_inner());
        async move { acceptor.accept(stream).await }
    };
    let server = tokio::spawn(serve::serve_http(
        listener,
        app,
        cfg.limits,
        stats.clone(),
        handshake,
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        },
        Duration::from_secs(5),
    ));
    let reloader = watch.map(|(cert, key, interval)| {
        tls::spawn_reloader(rustls.clone(), cert, key, interval, cfg.cert_expiry.clone())
    });
    tracing::info!(addr = %local_addr, "admission webhooks listening (HTTPS)");
    Ok(RunningServer {
        local_addr,
        ca_pem,
        rustls,
        stats,
        stop,
        server,
        reloader,
    })
}

/// Errors of [`WebhookClient`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The CA PEM does not parse or holds no certificate.
    #[error("CA PEM: {0}")]
    Ca(String),
    /// The server name is not a valid DNS name or IP.
    #[error("server name {0:?} is invalid")]
    ServerName(String),
    /// TLS setup failed.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// Connect, write or read failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The response is not HTTP/1.1 as expected.
    #[error("malformed HTTP response: {0}")]
    Http(String),
}

/// A minimal HTTPS/1.1 client for the admission server (loopback tests, benchmark, readiness).
#[derive(Clone)]
pub struct WebhookClient {
    connector: tokio_rustls::TlsConnector,
    addr: SocketAddr,
    server_name: rustls::pki_types::ServerName<'static>,
}

impl WebhookClient {
    /// A client for the server at `addr` that trusts only `ca_pem` and verifies the certificate
    /// for `server_name` (e.g. `127.0.0.1` or `localhost`).
    pub fn new(addr: SocketAddr, ca_pem: &str, server_name: &str) -> Result<Self, ClientError> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        let mut n = 0;
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            let cert = cert.map_err(|e| ClientError::Ca(e.to_string()))?;
            roots.add(cert)?;
            n += 1;
        }
        if n == 0 {
            return Err(ClientError::Ca("no certificate found".to_string()));
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let server_name = rustls::pki_types::ServerName::try_from(server_name.to_string())
            .map_err(|_| ClientError::ServerName(server_name.to_string()))?;
        Ok(WebhookClient {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            addr,
            server_name,
        })
    }

    /// Opens a keep-alive connection (TCP + TLS handshake).
    pub async fn connect(&self) -> Result<WebhookConnection, ClientError> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        tcp.set_nodelay(true)?;
        let stream = self
            .connector
            .connect(self.server_name.clone(), tcp)
            .await?;
        Ok(WebhookConnection {
            stream,
            buf: Vec::with_capacity(16 * 1024),
        })
    }
}

/// One keep-alive HTTPS connection.
pub struct WebhookConnection {
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    buf: Vec<u8>,
}

impl WebhookConnection {
    /// The DER of the certificate the server presented.
    pub fn peer_certificate(&self) -> Option<Vec<u8>> {
        self.stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec())
    }

    /// `POST path` with a JSON body; returns (status, body).
    pub async fn post(&mut self, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), ClientError> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: webhook\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let mut req = Vec::with_capacity(head.len() + body.len());
        req.extend_from_slice(head.as_bytes());
        req.extend_from_slice(body);
        self.stream.write_all(&req).await?;
        self.stream.flush().await?;
        self.read_response().await
    }

    /// `GET path`; returns (status, body).
    pub async fn get(&mut self, path: &str) -> Result<(u16, Vec<u8>), ClientError> {
        let head = format!("GET {path} HTTP/1.1\r\nhost: webhook\r\n\r\n");
        self.stream.write_all(head.as_bytes()).await?;
        self.stream.flush().await?;
        self.read_response().await
    }

    async fn read_response(&mut self) -> Result<(u16, Vec<u8>), ClientError> {
        let header_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            self.fill().await?;
        };
        let head = String::from_utf8_lossy(&self.buf[..header_end]).to_string();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| ClientError::Http(format!("status line {status_line:?}")))?;
        let mut content_length = None;
        for line in lines {
            if let Some((k, v)) = line.split_once(':') {
                if k.trim().eq_ignore_ascii_case("content-length") {
                    content_length = v.trim().parse::<usize>().ok();
                } else if k.trim().eq_ignore_ascii_case("transfer-encoding") {
                    return Err(ClientError::Http(format!(
                        "unsupported transfer-encoding {v:?}"
                    )));
                }
            }
        }
        let len =
            content_length.ok_or_else(|| ClientError::Http("no content-length".to_string()))?;
        let start = header_end + 4;
        while self.buf.len() < start + len {
            self.fill().await?;
        }
        let body = self.buf[start..start + len].to_vec();
        self.buf.drain(..start + len);
        Ok((status, body))
    }

    async fn fill(&mut self) -> Result<(), ClientError> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(ClientError::Http("connection closed".to_string()));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
