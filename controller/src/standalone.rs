//! `ic-controller standalone`: the index, agent ingest, router and HTTP endpoints on one machine,
//! without a cluster (DESIGN.md "Modes").

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_shared::proto::agent_service_server::AgentServiceServer;
use ic_shared::proto::router_service_server::RouterServiceServer;
use ic_shared::serve::{self, ConnectionLimits, ListenerStats};
use thiserror::Error;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::http::{self, HttpState};
use crate::ingest::{self, AgentIngest};
use crate::router::Router;
use crate::state::{LookupPolicy, Shared};
use crate::tokenize::{self, DuplicateModel, TokenizerConfig, Tokenizers};

/// Settings of the standalone stack.
#[derive(Debug, Clone)]
pub struct StandaloneConfig {
    /// gRPC listen address (AgentService, RouterService, grpc.health.v1).
    pub grpc_addr: SocketAddr,
    /// HTTP listen address (`/healthz`, `/readyz`, `/metrics`, `/snapshot`, `/v1/nodes`).
    pub http_addr: SocketAddr,
    /// How long a disconnected agent's index entries are kept.
    pub agent_expiry: Duration,
    /// Lookup defaults.
    pub policy: LookupPolicy,
    /// Connection limits, applied to each listener on its own (docs/security.md).
    pub limits: ConnectionLimits,
    /// Listen beyond loopback although nothing is authenticated
    /// (`--allow-unauthenticated-non-loopback`); without it such an address is refused.
    pub allow_unauthenticated_non_loopback: bool,
    /// Per-model tokenizers of LookupRoute `prompt_text` (`--tokenizer`).
    pub tokenizers: TokenizerConfig,
}

impl StandaloneConfig {
    /// Loopback listeners on ports the OS picks (`127.0.0.1:0`), 60 s agent expiry, default
    /// lookup policy and limits, no tokenizers: what tests and benchmarks start.
    pub fn ephemeral() -> Self {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        StandaloneConfig {
            grpc_addr: loopback,
            http_addr: loopback,
            agent_expiry: Duration::from_secs(60),
            policy: LookupPolicy::default(),
            limits: ConnectionLimits::default(),
            allow_unauthenticated_non_loopback: false,
            tokenizers: TokenizerConfig::default(),
        }
    }
}

/// Why the stack could not start or stopped with an error.
#[derive(Debug, Error)]
pub enum ServeError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// A listen address beyond loopback without `allow_unauthenticated_non_loopback`.
    #[error("standalone mode authenticates nobody (agent streams, LookupRoute, /snapshot, /v1/nodes are open): refusing to listen on {addr}, which is not a loopback address; pass --allow-unauthenticated-non-loopback to do it anyway")]
    Unauthenticated {
        /// The address.
        addr: SocketAddr,
    },
    /// Metrics registration failed.
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Two `--tokenizer` flags name one model.
    #[error(transparent)]
    Tokenizers(#[from] DuplicateModel),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(std::io::Error),
    /// A server task panicked or was cancelled.
    #[error("server task: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// A started stack.
pub struct Running {
    /// Bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// Bound HTTP address.
    pub http_addr: SocketAddr,
    /// Shared state (tests read the index directly).
    pub shared: Arc<Shared>,
    /// Connections the gRPC listener refused at its cap or closed for a missed deadline.
    pub grpc_stats: Arc<ListenerStats>,
    /// The same for the HTTP listener.
    pub http_stats: Arc<ListenerStats>,
    /// Bound address of the separate health listener (`limits.health_addr`), if any.
    pub health_addr: Option<SocketAddr>,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    http: JoinHandle<Result<(), std::io::Error>>,
    expiry: JoinHandle<()>,
    tokenizers: JoinHandle<()>,
    health: Option<JoinHandle<Result<(), std::io::Error>>>,
}

impl Running {
    /// Waits until both servers stop (after the shutdown future resolves).
    pub async fn wait(self) -> Result<(), ServeError> {
        let grpc = self.grpc.await;
        let http = self.http.await;
        if let Some(h) = self.health {
            h.await?.map_err(ServeError::Http)?;
        }
        self.expiry.abort();
        self.tokenizers.abort();
        grpc??;
        http?.map_err(ServeError::Http)?;
        Ok(())
    }
}

/// Binds both listeners and starts serving until `shutdown` resolves. Nothing is
/// authenticated in standalone mode, so an address beyond loopback is refused
/// ([`ServeError::Unauthenticated`]) unless `cfg.allow_unauthenticated_non_loopback`.
pub async fn start<F>(cfg: StandaloneConfig, shutdown: F) -> Result<Running, ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    for addr in [cfg.grpc_addr, cfg.http_addr]
        .into_iter()
        .chain(cfg.limits.health_addr)
    {
        if !addr.ip().is_loopback() && !cfg.allow_unauthenticated_non_loopback {
            return Err(ServeError::Unauthenticated { addr });
        }
    }
    let tokenizers = Arc::new(Tokenizers::new(&cfg.tokenizers.specs)?);
    let shared = Arc::new(Shared::new(cfg.policy)?.with_tokenizers(tokenizers.clone()));
    // Accept queues sized from the connection cap: a restart's reconnect storm queues in the
    // kernel instead of losing SYNs (docs/scaling.md "Connection limits").
    let grpc_listener =
        serve::listen(cfg.grpc_addr, &cfg.limits).map_err(|source| ServeError::Bind {
            addr: cfg.grpc_addr,
            source,
        })?;
    let http_listener =
        serve::listen(cfg.http_addr, &cfg.limits).map_err(|source| ServeError::Bind {
            addr: cfg.http_addr,
            source,
        })?;
    let health_listener = match cfg.limits.health_addr {
        Some(addr) => {
            let bind = |source| ServeError::Bind { addr, source };
            let l = serve::listen(addr, &cfg.limits.health()).map_err(bind)?;
            let local = l.local_addr().map_err(bind)?;
            Some((l, local))
        }
        None => None,
    };
    let grpc_addr = grpc_listener
        .local_addr()
        .map_err(|source| ServeError::Bind {
            addr: cfg.grpc_addr,
            source,
        })?;
    let http_addr = http_listener
        .local_addr()
        .map_err(|source| ServeError::Bind {
            addr: cfg.http_addr,
            source,
        })?;

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<AgentServiceServer<AgentIngest>>()
        .await;
    health.set_serving::<RouterServiceServer<Router>>().await;

    // One shutdown signal fans out to both servers.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopping = shared.stopping.clone();
    tokio::spawn(async move {
        shutdown.await;
        // End agent streams first, so both servers can drain.
        stopping.send_replace(true);
        let _ = stop_tx.send(true);
    });
    let mut grpc_stop = stop_rx.clone();
    let mut http_stop = stop_rx.clone();
    let mut health_stop = stop_rx;

    if !cfg.grpc_addr.ip().is_loopback() {
        warn!(addr = %grpc_addr, "standalone mode accepts agent streams WITHOUT authentication on a non-loopback address");
    } else {
        info!("standalone mode: agent streams are not authenticated (loopback only)");
    }

    let grpc_stats = shared.metrics.listeners.stats("grpc");
    let http_stats = shared.metrics.listeners.stats("http");
    let grpc = tokio::spawn(
        cfg.limits
            .grpc_server()
            .add_service(health_service)
            .add_service(
                AgentIngest::new(shared.clone())
                    .with_limits(&cfg.limits)
                    .into_server(),
            )
            .add_service(RouterServiceServer::new(Router::new(shared.clone())))
            .serve_with_incoming_shutdown(
                serve::grpc_incoming(grpc_listener, cfg.limits, grpc_stats.clone()),
                async move {
                    let _ = grpc_stop.wait_for(|s| *s).await;
                },
            ),
    );
    let ready = Arc::new(AtomicBool::new(false));
    let app = http::router(HttpState {
        shared: shared.clone(),
        ready: ready.clone(),
        access: None,
    });
    let http = tokio::spawn(serve::serve_http(
        http_listener,
        app,
        cfg.limits,
        http_stats.clone(),
        serve::plain,
        async move {
            let _ = http_stop.wait_for(|s| *s).await;
        },
        Duration::from_secs(5),
    ));
    // Probes get their own listener and slots: data clients that fill the HTTP listener's
    // cannot fail them (docs/security.md "Streams, handshakes and idle connections").
    let (health_task, health_addr) = match health_listener {
        Some((listener, addr)) => {
            let limits = cfg.limits.health();
            let task = tokio::spawn(serve::serve_http(
                listener,
                http::health_router(ready.clone()),
                limits,
                shared.metrics.listeners.stats("health"),
                serve::plain,
                async move {
                    let _ = health_stop.wait_for(|s| *s).await;
                },
                Duration::from_secs(1),
            ));
            (Some(task), Some(addr))
        }
        None => (None, None),
    };
    let expiry = tokio::spawn(ingest::expire_nodes(shared.clone(), cfg.agent_expiry));
    let tokenizers = tokenize::load_and_watch(
        tokenizers,
        shared.metrics.clone(),
        cfg.tokenizers.reload_interval,
    )
    .await;
    ready.store(true, Ordering::Release);
    info!(grpc = %grpc_addr, http = %http_addr, "standalone controller serving");
    Ok(Running {
        grpc_addr,
        http_addr,
        shared,
        grpc_stats,
        http_stats,
        health_addr,
        grpc,
        http,
        expiry,
        tokenizers,
        health: health_task,
    })
}
