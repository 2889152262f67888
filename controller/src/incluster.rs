//! `ic-controller run`: the in-cluster controller (DESIGN.md "Modes": in cluster; `docs/in-cluster.md`).
//!
//! Serves what standalone serves — gRPC `AgentService` (agents), `RouterService` (gateways),
//! `grpc.health.v1`, and HTTP `/healthz` `/readyz` `/metrics` `/snapshot` `/v1/nodes` — plus:
//!
//! - agent authentication ([`crate::ingest::auth`]): TokenReview of `Hello.token` (cached), the
//!   agent service account, the token's node bound to `Hello.node`;
//! - caller identity on the data plane ([`crate::access`], on by default): LookupRoute,
//!   `/snapshot`, `/v1/nodes` and `/probe` need a TokenReview-verified bearer token and a
//!   SubjectAccessReview grant, scoped by tenant;
//! - Lease-based leader election ([`crate::leader`]): every replica serves reads and accepts
//!   agent streams (agents keep one stream per replica); only the holder pushes node plans and
//!   writes status;
//! - the node loops ([`crate::reconcile::nodes`], leader only): node plans pushed down agent
//!   streams, CacheNode status and the CacheBackends' `NodeHealthy` advisory;
//! - the CacheBackend reconciler (with the in-process functional probe), the engine-pod Events
//!   controller and the model-cache controllers ([`start_reconcilers`]);
//! - the HTTPS admission webhooks over watch-backed CacheBackend / ModelCache stores, with
//!   file or shared self-signed certificates ([`start_admission`]).
//!
//! [`start`] takes a ready `kube::Client` (the binary builds it from `--kubeconfig`, `KUBECONFIG`
//! or the in-cluster service account via `kube::Client::try_default`), so tests run the whole
//! stack against the bare real apiserver (`controller/tests/incluster_*.rs`; seams: [`Overrides`]).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_shared::proto::agent_service_server::AgentServiceServer;
use ic_shared::proto::router_service_server::RouterServiceServer;
use ic_shared::serve::{self, ConnectionLimits};
use kube::Client;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::access::{
    AccessReviewer, CallerAuth, CallerAuthSettings, KubeAccessReviewer, ReviewLimiter,
    DEFAULT_MAX_CONCURRENT_REVIEWS, DEFAULT_REVIEW_WAIT,
};
use crate::http::{self, HttpState};
use crate::ingest::auth::{
    AgentAuthenticator, CachingVerifier, KubeTokenVerifier, ServiceAccountRef, TokenVerifier,
    DEFAULT_CACHE_ENTRIES, DEFAULT_NEGATIVE_CACHE_TTL,
};
use crate::ingest::{self, AgentIngest};
use crate::leader::{self, ElectionConfig, LeaderHandle, LeaderMetrics, LeaseLock};
use crate::reconcile::clock::{Clock, SystemClock};
use crate::reconcile::model_cache::ModelCacheConfig;
use crate::reconcile::nodes::{self, NodeLoopConfig, NodesMetrics};
use crate::router::Router;
use crate::state::{LookupPolicy, Shared};

/// Admission webhook settings (`--webhook-*`, and the Pod wiring's images), handed to
/// [`start_admission`].
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// Serve the webhooks at all (`--webhooks`; default on).
    pub enabled: bool,
    /// HTTPS listen address (default `0.0.0.0:9443`).
    pub addr: SocketAddr,
    /// Directory with `tls.crt` and `tls.key` (cert-manager or a mounted Secret), reloaded on
    /// change.
    pub cert_dir: Option<PathBuf>,
    /// Generate a self-signed CA and serving certificate at start (and patch the webhook
    /// configurations' `caBundle`).
    pub self_signed: bool,
    /// Name of the Mutating/ValidatingWebhookConfiguration whose `caBundle` is kept set in
    /// self-signed mode.
    pub config_name: Option<String>,
    /// Name of the webhook Service (self-signed mode: the certificate's DNS names
    /// `svc`, `svc.ns`, `svc.ns.svc`, `svc.ns.svc.cluster.local`; ns = the controller's).
    pub service: Option<String>,
    /// Secret (in the controller's namespace) through which replicas share the self-signed
    /// bundle; `None`: each replica generates its own (only sound with one replica).
    pub tls_secret: Option<String>,
    /// How often the `caBundle` is re-asserted in self-signed mode (a `helm upgrade` resets it).
    pub ca_bundle_resync: Duration,
    /// Images and controller address the Pod wiring uses.
    pub pod: crate::admission::pod::PodWebhookConfig,
    /// Connection limits of the HTTPS listener.
    pub limits: ConnectionLimits,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            enabled: true,
            addr: SocketAddr::from(([0, 0, 0, 0], 9443)),
            cert_dir: None,
            self_signed: false,
            config_name: None,
            service: None,
            tls_secret: None,
            ca_bundle_resync: Duration::from_secs(60),
            pod: Default::default(),
            limits: ConnectionLimits::default(),
        }
    }
}

/// Leader-election settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderElectionSettings {
    /// Namespace of the Lease (the controller's own namespace).
    pub namespace: String,
    /// Lease name (default `inference-cache-controller`).
    pub lease_name: String,
    /// Identity and timing.
    pub election: ElectionConfig,
}

/// Settings of the in-cluster controller.
#[derive(Debug, Clone)]
pub struct InClusterConfig {
    /// gRPC listen address (AgentService, RouterService, grpc.health.v1).
    pub grpc_addr: SocketAddr,
    /// HTTP listen address (`/healthz`, `/readyz`, `/metrics`, `/snapshot`, `/v1/nodes`).
    pub http_addr: SocketAddr,
    /// How long a disconnected agent's index entries are kept.
    pub agent_expiry: Duration,
    /// Lookup defaults.
    pub policy: LookupPolicy,
    /// Admission webhook settings.
    pub webhook: WebhookSettings,
    /// Leader election.
    pub leader_election: LeaderElectionSettings,
    /// The service account agents must authenticate as.
    pub agent_service_account: ServiceAccountRef,
    /// The audience agents' tokens must carry (default `inference-cache`).
    pub token_audience: String,
    /// How long a successful TokenReview is cached.
    pub token_cache_ttl: Duration,
    /// TokenReviews one source address may cause on agent streams (cache misses only;
    /// `--token-review-burst-per-source`, `--token-reviews-per-second-per-source`).
    pub review_source_limit: crate::ingest::auth::ReviewSourceLimit,
    /// Caller identity on LookupRoute, `/snapshot`, `/v1/nodes` and `/probe`
    /// ([`crate::access`]); `None` serves them to anyone who reaches the ports (logged loudly).
    pub data_plane_auth: Option<DataPlaneAuthSettings>,
    /// Node-plan and node-status timing.
    pub nodes: NodeLoopConfig,
    /// Connection limits, applied to the gRPC, HTTP and webhook listeners each on its own
    /// (docs/security.md "Connection limits").
    pub limits: ConnectionLimits,
    /// The model-cache controllers' settings; `None` leaves them (and `model-data` wiring) off.
    pub model_cache: Option<ModelCacheConfig>,
    /// The functional-probe gate (spec 000 "Functional-probe gate"): the CacheBackend
    /// reconciler probes the in-process index ([`crate::probe::in_process_prober`]). Off is the
    /// spec's `--server-probe-url=""`.
    pub functional_probe: bool,
    /// Per-model tokenizers of LookupRoute `prompt_text` (`--tokenizer`).
    pub tokenizers: crate::tokenize::TokenizerConfig,
}

/// Whether the functional-probe gate is on, from `--functional-probe` and the spec's
/// `--server-probe-url` (spec 000 "Functional-probe gate": `--server-probe-url=""` disables the
/// gate).
///
/// # Errors
/// A non-empty `server_probe_url`: the probe runs in process against the controller's own
/// index, so a URL would be silently ignored; it is refused instead.
pub fn functional_probe_gate(
    functional_probe: bool,
    server_probe_url: Option<&str>,
) -> anyhow::Result<bool> {
    match server_probe_url.map(str::trim) {
        None => Ok(functional_probe),
        Some("") => Ok(false),
        Some(url) => anyhow::bail!(
            "--server-probe-url={url:?}: the functional probe runs in process against this \
             controller's index, so it takes no URL; pass --server-probe-url=\"\" or \
             --functional-probe=false to turn the gate off"
        ),
    }
}

/// How data-plane callers are checked (docs/security.md "Authenticated data plane").
#[derive(Debug, Clone)]
pub struct DataPlaneAuthSettings {
    /// Audience, review cache lifetime and bound.
    pub caller: CallerAuthSettings,
    /// Most TokenReviews and SubjectAccessReviews in flight at once (agents' and callers').
    pub max_concurrent_reviews: usize,
}

impl Default for DataPlaneAuthSettings {
    fn default() -> Self {
        DataPlaneAuthSettings {
            caller: CallerAuthSettings::default(),
            max_concurrent_reviews: DEFAULT_MAX_CONCURRENT_REVIEWS,
        }
    }
}

/// Test seams: replace the token verifier (default: [`KubeTokenVerifier`] behind a
/// [`CachingVerifier`]) or the clock.
#[derive(Default, Clone)]
pub struct Overrides {
    /// Token verifier to use instead of TokenReview.
    pub token_verifier: Option<Arc<dyn TokenVerifier>>,
    /// Access reviewer to use instead of SubjectAccessReview.
    pub access_reviewer: Option<Arc<dyn AccessReviewer>>,
    /// Clock for leader election and status timestamps.
    pub clock: Option<Arc<dyn Clock>>,
}

/// Why the controller could not start or stopped with an error.
#[derive(Debug, Error)]
pub enum RunError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// Metrics registration failed.
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Two `--tokenizer` flags name one model.
    #[error(transparent)]
    Tokenizers(#[from] crate::tokenize::DuplicateModel),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(std::io::Error),
    /// A server task panicked or was cancelled.
    #[error("server task: {0}")]
    Join(#[from] tokio::task::JoinError),
    /// A part contributed by another module failed to start.
    #[error("{part}: {message}")]
    Part {
        /// Which part (`admission`, `reconciler`).
        part: &'static str,
        /// Its error.
        message: String,
    },
}

/// What [`start_admission`] and [`start_reconcilers`] get.
#[derive(Clone)]
pub struct RunContext {
    /// Kubernetes client.
    pub client: Client,
    /// Shared controller state (index, registry, metrics).
    pub shared: Arc<Shared>,
    /// Leadership.
    pub leader: LeaderHandle,
    /// The same leadership as a flag (for components that poll an `AtomicBool`).
    pub leader_flag: Arc<AtomicBool>,
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// Turns true at shutdown.
    pub shutdown: watch::Receiver<bool>,
    /// The controller's namespace (Lease, webhook Service, self-signed Secret).
    pub namespace: String,
}

/// A started part that runs until shutdown.
pub struct PartTask {
    /// Name for logs.
    pub name: &'static str,
    /// The task; `Err` carries a message.
    pub task: JoinHandle<Result<(), String>>,
}

/// Starts the HTTPS AdmissionReview server ([`crate::admission::server`]) on `settings.addr`:
///
/// - the Pod webhook matches pods against a watch-backed store of every CacheBackend (and, with
///   the model cache on, reads `ModelCache` statuses for `model-data` wiring); the server waits
///   up to 30 s for the stores' first list so early pods are not admitted unwired for want of
///   a cache;
/// - certificates: `--webhook-cert-dir` (hot reload), or self-signed — shared through
///   `settings.tls_secret` when set — with the CA kept in `settings.config_name`'s `caBundle`.
///
/// `Ok(None)` when webhooks are disabled. Errors: certificate or bind failures (the process
/// exits: a controller that cannot serve its fail-closed webhooks must not look healthy).
pub async fn start_admission(
    ctx: &RunContext,
    settings: &WebhookSettings,
    model_cache: bool,
) -> Result<Option<(PartTask, SocketAddr)>, RunError> {
    use crate::admission::{ca_bundle, server, sources, tls, Admission, PodWebhook};
    if !settings.enabled {
        info!("admission webhooks disabled (--webhooks=false)");
        return Ok(None);
    }
    let part = |message: String| RunError::Part {
        part: "admission",
        message,
    };
    let (backends, backends_task) = sources::spawn_store::<ic_shared::crd::CacheBackend>(
        ctx.client.clone(),
        "cachebackends",
        ctx.shutdown.clone(),
    );
    let mut tasks = vec![backends_task];
    let mut model_caches = None;
    if model_cache {
        let (store, task) = sources::spawn_store::<ic_shared::crd::ModelCache>(
            ctx.client.clone(),
            "modelcaches",
            ctx.shutdown.clone(),
        );
        tasks.push(task);
        model_caches = Some(store);
    }
    let ready_limit = Duration::from_secs(30);
    let mut ready = sources::wait_ready(&backends, ready_limit).await;
    if let Some(s) = &model_caches {
        ready &= sources::wait_ready(s, ready_limit).await;
    }
    if !ready {
        warn!("the CacheBackend/ModelCache watch has not listed yet; serving webhooks anyway (pods admitted before it lists stay unwired)");
    }
    let (backend_source, model_cache_source) = sources::pod_sources(backends, model_caches);
    // Native sidecars (the LMCache MP worker) only where the apiserver runs them.
    let mut pod_config = settings.pod.clone();
    match ctx.client.apiserver_version().await {
        Ok(v) => {
            pod_config.native_sidecars = crate::admission::pod::NativeSidecars::from_version(
                &v.major,
                &v.minor,
                &v.git_version,
            );
            info!(version = %v.git_version, native_sidecars = ?pod_config.native_sidecars, "apiserver version discovered");
        }
        Err(e) => {
            warn!("cannot read the apiserver version ({e}); native sidecars are assumed supported")
        }
    }
    let mut pods = PodWebhook::new(pod_config);
    if let Some(source) = model_cache_source {
        pods = pods.with_model_caches(source);
    }
    let admission = Arc::new(Admission::new(
        settings.pod.registry.clone(),
        backend_source,
        Arc::new(pods),
    ));

    let mut shared_keeper: Option<ca_bundle::CertKeeper> = None;
    let tls_source = if let Some(dir) = &settings.cert_dir {
        tls::TlsSource::Files {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            reload_interval: Duration::from_secs(10),
        }
    } else if settings.self_signed {
        let service = settings
            .service
            .clone()
            .unwrap_or_else(|| "inference-cache-webhook".to_string());
        let sans = tls::service_dns_names(&service, &ctx.namespace);
        match &settings.tls_secret {
            Some(secret) => {
                // Read (or create) the shared Secret, repair or rotate what is due, and serve
                // its pair; the keeper re-reads it every resync (admission/ca_bundle/keeper.rs).
                let metrics = ca_bundle::CertMetrics::register(&ctx.shared.metrics.registry)
                    .map_err(|e| part(e.to_string()))?;
                let mut keeper = ca_bundle::CertKeeper::new(
                    ctx.client.clone(),
                    ca_bundle::SelfSignedSecret {
                        namespace: ctx.namespace.clone(),
                        name: secret.clone(),
                        subject_alt_names: sans,
                        webhook_config: settings.config_name.clone(),
                        policy: ca_bundle::RotationPolicy {
                            overlap: (settings.ca_bundle_resync * 5)
                                .max(ca_bundle::RotationPolicy::default().overlap),
                            ..Default::default()
                        },
                    },
                )
                .with_metrics(metrics);
                keeper
                    .tick(ca_bundle::unix_now())
                    .await
                    .map_err(|e| part(e.to_string()))?;
                let bundle = keeper.served().cloned().ok_or_else(|| {
                    part("the self-signed webhook Secret holds no servable certificate".to_string())
                })?;
                shared_keeper = Some(keeper);
                tls::TlsSource::Pem {
                    cert_pem: bundle.cert_pem,
                    key_pem: bundle.key_pem,
                    ca_pem: Some(bundle.ca_pem),
                }
            }
            None => tls::TlsSource::SelfSigned(tls::SelfSignedOptions {
                subject_alt_names: sans,
                write_dir: None,
            }),
        }
    } else {
        return Err(part(
            "no webhook certificate: set --webhook-cert-dir or --webhook-self-signed (or --webhooks=false)"
                .to_string(),
        ));
    };
    let mut server_config = server::ServerConfig::new(settings.addr, tls_source);
    server_config.limits = settings.limits;
    // Registered only where webhooks serve: a series that read 0 elsewhere would say "expired".
    let cert_expiry = prometheus::IntGauge::new(
        "inferencecache_controller_webhook_cert_expiry_timestamp_seconds",
        "notAfter of the certificate the admission webhooks serve now, in Unix seconds (follows reloads).",
    )
    .map_err(|e| part(e.to_string()))?;
    ctx.shared
        .metrics
        .registry
        .register(Box::new(cert_expiry.clone()))
        .map_err(|e| part(e.to_string()))?;
    let server_config_expiry = Some(cert_expiry.clone());
    server_config.cert_expiry = Some(cert_expiry);
    let running = server::start(admission, server_config)
        .await
        .map_err(|e| part(e.to_string()))?;
    ctx.shared
        .metrics
        .listeners
        .add("webhook", running.stats.clone());
    if let Some(mut keeper) = shared_keeper {
        // Every replica, leader or not: renews when due (writes are serialized by the Secret's
        // resourceVersion), keeps the caBundle, and reloads the Secret's pair when it changes.
        keeper.serve_into(running.rustls.clone(), server_config_expiry);
        tasks.push(ca_bundle::spawn_cert_keeper(
            keeper,
            settings.ca_bundle_resync,
            ctx.shutdown.clone(),
        ));
        if settings.config_name.is_none() {
            warn!("self-signed webhook certificate without --webhook-config-name: set the caBundle yourself");
        }
    } else if settings.self_signed {
        match (&settings.config_name, &running.ca_pem) {
            (Some(name), Some(ca)) => tasks.push(ca_bundle::spawn_ca_bundle_keeper(
                ctx.client.clone(),
                name.clone(),
                ca.clone(),
                settings.ca_bundle_resync,
                ctx.shutdown.clone(),
            )),
            _ => warn!("self-signed webhook certificate without --webhook-config-name: set the caBundle yourself"),
        }
    }
    let local_addr = running.local_addr;
    let mut stop = ctx.shutdown.clone();
    let task = tokio::spawn(async move {
        let _ = stop.wait_for(|s| *s).await;
        running.shutdown();
        let res = running.wait().await.map_err(|e| e.to_string());
        for t in tasks {
            t.abort();
        }
        res
    });
    Ok(Some((
        PartTask {
            name: "admission",
            task,
        },
        local_addr,
    )))
}

/// Starts the CacheBackend reconciler and the engine-pod Events controller
/// ([`crate::reconcile::run_controllers`]), writing only while `ctx.leader_flag` is set, with
/// the in-process functional probe when `functional_probe`; and, when `model_cache` is set, the
/// ModelCache / ModelCacheBinding controllers ([`crate::reconcile::model_cache::run`]).
pub async fn start_reconcilers(
    ctx: &RunContext,
    functional_probe: bool,
    model_cache: Option<ModelCacheConfig>,
) -> Result<Vec<PartTask>, RunError> {
    let controllers = crate::reconcile::Controllers {
        client: ctx.client.clone(),
        index: ctx.shared.clone(),
        clock: ctx.clock.clone(),
        leader: ctx.leader_flag.clone(),
        prober: functional_probe.then(|| {
            crate::probe::in_process_prober(
                ctx.shared.clone(),
                Some(Arc::new(crate::t2probe::ProviderT2Prober::default())),
            )
        }),
        instance: std::env::var("POD_NAME").ok(),
    };
    let shutdown = ctx.shutdown.clone();
    let task = tokio::spawn(async move {
        crate::reconcile::run_controllers(controllers, shutdown).await;
        Ok(())
    });
    let mut parts = vec![PartTask {
        name: "reconcilers",
        task,
    }];
    if let Some(config) = model_cache {
        let mc = Arc::new(crate::reconcile::model_cache::Context::new(
            ctx.client.clone(),
            config,
            ctx.clock.clone(),
            ctx.leader_flag.clone(),
        ));
        let mut stop = ctx.shutdown.clone();
        let task = tokio::spawn(async move {
            tokio::select! {
                _ = crate::reconcile::model_cache::run(mc) => {}
                _ = stop.wait_for(|s| *s) => {}
            }
            Ok(())
        });
        parts.push(PartTask {
            name: "model-cache",
            task,
        });
    }
    Ok(parts)
}

/// How long [`Running::wait`] lets the parts (reconcilers, model-cache controllers, admission)
/// finish in-flight work after the stop signal before it aborts them.
pub const PART_DRAIN: Duration = Duration::from_secs(10);

/// A started in-cluster controller.
pub struct Running {
    /// Bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// Bound HTTP address.
    pub http_addr: SocketAddr,
    /// Bound HTTPS address of the admission webhooks (`None` when disabled).
    pub webhook_addr: Option<SocketAddr>,
    /// Bound address of the separate health listener (`limits.health_addr`), if any.
    pub health_addr: Option<SocketAddr>,
    /// Shared state (tests read the index and registry directly).
    pub shared: Arc<Shared>,
    /// Leadership of this replica.
    pub leader: LeaderHandle,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    http: JoinHandle<Result<(), std::io::Error>>,
    election: JoinHandle<()>,
    loops: Vec<JoinHandle<()>>,
    parts: Vec<PartTask>,
}

impl Running {
    /// Waits until the servers stop (after the shutdown future resolves), the Lease is
    /// released and the loops end.
    pub async fn wait(self) -> Result<(), RunError> {
        let grpc = self.grpc.await;
        let http = self.http.await;
        if let Err(e) = self.election.await {
            warn!(error = %e, "leader election task failed");
        }
        for l in self.loops {
            l.abort();
        }
        let mut first_err = None;
        // The parts saw the stop signal with the servers; each gets until one drain deadline to
        // finish what is in flight (a reconcile, a webhook review). One that is still running then
        // is aborted, not waited for: a stuck call must not keep the process from exiting.
        let deadline = tokio::time::Instant::now() + PART_DRAIN;
        for mut p in self.parts {
            let joined = match tokio::time::timeout_at(deadline, &mut p.task).await {
                Ok(joined) => joined,
                Err(_) => {
                    warn!(
                        part = p.name,
                        drain_seconds = PART_DRAIN.as_secs(),
                        "still running after the shutdown drain; aborted"
                    );
                    p.task.abort();
                    continue;
                }
            };
            match joined {
                Ok(Ok(())) => {}
                Ok(Err(message)) => {
                    first_err.get_or_insert(RunError::Part {
                        part: p.name,
                        message,
                    });
                }
                Err(e) => {
                    first_err.get_or_insert(RunError::Join(e));
                }
            }
        }
        grpc??;
        http?.map_err(RunError::Http)?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A listener on `addr` with an accept queue sized for `limits` ([`serve::listen`]).
fn bind(
    addr: SocketAddr,
    limits: &ConnectionLimits,
) -> Result<(TcpListener, SocketAddr), RunError> {
    let l = serve::listen(addr, limits).map_err(|source| RunError::Bind { addr, source })?;
    let local = l
        .local_addr()
        .map_err(|source| RunError::Bind { addr, source })?;
    Ok((l, local))
}

/// Binds the listeners, starts leader election, the node loops, the servers and the
/// integration points, and serves until `shutdown` resolves.
pub async fn start<F>(
    client: Client,
    cfg: InClusterConfig,
    overrides: Overrides,
    shutdown: F,
) -> Result<Running, RunError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let tokenizers = Arc::new(crate::tokenize::Tokenizers::new(&cfg.tokenizers.specs)?);
    let shared = Arc::new(
        Shared::new(cfg.policy)?
            .with_tokenizers(tokenizers.clone())
            .await_plans(),
    );
    let registry = shared.metrics.registry.clone();
    let clock: Arc<dyn Clock> = overrides.clock.unwrap_or_else(|| Arc::new(SystemClock));
    let (grpc_listener, grpc_addr) = bind(cfg.grpc_addr, &cfg.limits)?;
    let (http_listener, http_addr) = bind(cfg.http_addr, &cfg.limits)?;
    let health_listener = match cfg.limits.health_addr {
        Some(addr) => Some(bind(addr, &cfg.limits.health())?),
        None => None,
    };

    // One shutdown signal fans out to everything.
    let (stop_tx, stop_rx) = watch::channel(false);
    {
        let stopping = shared.stopping.clone();
        tokio::spawn(async move {
            shutdown.await;
            // End agent streams first, so the servers can drain.
            stopping.send_replace(true);
            let _ = stop_tx.send(true);
        });
    }

    // Leader election.
    let lock = LeaseLock::new(
        client.clone(),
        &cfg.leader_election.namespace,
        &cfg.leader_election.lease_name,
    );
    let election = leader::spawn(
        lock,
        cfg.leader_election.election.clone(),
        clock.clone(),
        Some(LeaderMetrics::register(&registry)?),
        stop_rx.clone(),
    );
    let leader_handle = election.handle.clone();
    let leader_flag = Arc::new(AtomicBool::new(false));
    let mirror = {
        let flag = leader_flag.clone();
        let mut rx = leader_handle.subscribe();
        tokio::spawn(async move {
            loop {
                flag.store(*rx.borrow_and_update(), Ordering::SeqCst);
                if rx.changed().await.is_err() {
                    flag.store(false, Ordering::SeqCst);
                    break;
                }
            }
        })
    };

    // Agent authentication. TokenReviews (agents' and callers') and SubjectAccessReviews share
    // one bound on reviews in flight; cache hits take no slot.
    let limiter = ReviewLimiter::new(
        cfg.data_plane_auth
            .as_ref()
            .map_or(DEFAULT_MAX_CONCURRENT_REVIEWS, |d| d.max_concurrent_reviews),
        DEFAULT_REVIEW_WAIT,
    );
    let verifier: Arc<dyn TokenVerifier> = match overrides.token_verifier {
        Some(v) => v,
        None => Arc::new(CachingVerifier::with_ttls(
            limiter.verifier(KubeTokenVerifier::new(client.clone())),
            cfg.token_cache_ttl,
            DEFAULT_NEGATIVE_CACHE_TTL,
            DEFAULT_CACHE_ENTRIES,
        )),
    };
    let access = match &cfg.data_plane_auth {
        Some(d) => {
            let reviewer: Arc<dyn AccessReviewer> = match overrides.access_reviewer {
                Some(r) => r,
                None => Arc::new(KubeAccessReviewer::new(client.clone())),
            };
            info!(audience = %d.caller.audience, "LookupRoute, /snapshot, /v1/nodes and /probe require a TokenReview-verified bearer token and a SubjectAccessReview grant");
            Some(Arc::new(
                CallerAuth::new(verifier.clone(), reviewer, limiter, d.caller.clone())
                    .with_metrics(&registry)?,
            ))
        }
        None => {
            warn!("--data-plane-auth=false: LookupRoute, /snapshot, /v1/nodes and /probe answer anyone who reaches the ports, every tenant's routes included; restrict them with networkPolicy");
            None
        }
    };
    let auth = Arc::new(
        AgentAuthenticator::new(
            verifier,
            cfg.token_audience.clone(),
            cfg.agent_service_account.clone(),
        )
        .with_source_limit(
            cfg.review_source_limit.burst,
            cfg.review_source_limit.per_second,
        )
        .with_metrics(&registry)?,
    );
    info!(service_account = %cfg.agent_service_account, audience = %cfg.token_audience, "agent streams require a TokenReview-verified service-account token bound to the agent's node");

    // Node loops.
    let node_metrics = NodesMetrics::register(&registry)?;
    let plan_loop = nodes::spawn_plan_publisher(
        client.clone(),
        shared.clone(),
        leader_handle.clone(),
        Some(node_metrics.clone()),
        cfg.nodes.clone(),
        stop_rx.clone(),
    );
    let status_loop = nodes::spawn_status_writer(
        client.clone(),
        shared.clone(),
        leader_handle.clone(),
        clock.clone(),
        cfg.nodes.clone(),
        Some(node_metrics),
        stop_rx.clone(),
    );
    let cache_index = crate::reconcile::cache_index::spawn_writer(
        client.clone(),
        shared.clone(),
        leader_handle.clone(),
        clock.clone(),
        cfg.nodes.status_interval,
        cfg.nodes.cacheindex_min_write_interval,
        stop_rx.clone(),
    );
    // Every replica has its own index, so every replica follows the CacheTenant quotas.
    let quotas = tokio::spawn(crate::reconcile::tenants::run_quotas(
        client.clone(),
        shared.clone(),
        stop_rx.clone(),
    ));
    let expiry = tokio::spawn(ingest::expire_nodes(shared.clone(), cfg.agent_expiry));
    // Every replica routes, so every replica loads the tokenizers.
    let tokenizer_watch = crate::tokenize::load_and_watch(
        tokenizers,
        shared.metrics.clone(),
        cfg.tokenizers.reload_interval,
    )
    .await;
    // Every replica routes, so every replica follows the CachePolicies (the leader writes
    // their status).
    let policies = tokio::spawn(crate::reconcile::policy::run(
        client.clone(),
        shared.index.read().policies(),
        leader_flag.clone(),
        stop_rx.clone(),
    ));

    // gRPC and HTTP.
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<AgentServiceServer<AgentIngest>>()
        .await;
    health.set_serving::<RouterServiceServer<Router>>().await;
    let mut grpc_stop = stop_rx.clone();
    let grpc = tokio::spawn(
        cfg.limits
            .grpc_server()
            .add_service(health_service)
            .add_service(
                AgentIngest::with_auth(shared.clone(), auth)
                    .with_limits(&cfg.limits)
                    .into_server(),
            )
            .add_service(crate::ingest::handshake::TokenFirst::new(
                RouterServiceServer::new(match &access {
                    Some(a) => Router::new(shared.clone()).with_access(a.clone()),
                    None => Router::new(shared.clone()),
                }),
                access.clone(),
            ))
            .serve_with_incoming_shutdown(
                serve::grpc_incoming(
                    grpc_listener,
                    cfg.limits,
                    shared.metrics.listeners.stats("grpc"),
                ),
                async move {
                    let _ = grpc_stop.wait_for(|s| *s).await;
                },
            ),
    );
    let ready = Arc::new(AtomicBool::new(false));
    let app = http::router(HttpState {
        shared: shared.clone(),
        ready: ready.clone(),
        access,
    });
    let mut http_stop = stop_rx.clone();
    let http = tokio::spawn(serve::serve_http(
        http_listener,
        app,
        cfg.limits,
        shared.metrics.listeners.stats("http"),
        serve::plain,
        async move {
            let _ = http_stop.wait_for(|s| *s).await;
        },
        Duration::from_secs(5),
    ));

    // Probes get their own listener and slots: data clients that fill the HTTP listener's
    // cannot fail the kubelet's probes (docs/security.md "Streams, handshakes and idle
    // connections").
    let mut health_addr = None;
    let mut health_task = None;
    if let Some((listener, addr)) = health_listener {
        let mut health_stop = stop_rx.clone();
        let app = http::health_router(ready.clone());
        let limits = cfg.limits.health();
        let health_stats = shared.metrics.listeners.stats("health");
        health_addr = Some(addr);
        health_task = Some(tokio::spawn(async move {
            if let Err(e) = serve::serve_http(
                listener,
                app,
                limits,
                health_stats,
                serve::plain,
                async move {
                    let _ = health_stop.wait_for(|s| *s).await;
                },
                Duration::from_secs(1),
            )
            .await
            {
                warn!(error = %e, "health listener failed");
            }
        }));
    }

    // Parts owned by other modules.
    let ctx = RunContext {
        client,
        shared: shared.clone(),
        leader: leader_handle.clone(),
        leader_flag,
        clock,
        shutdown: stop_rx,
        namespace: cfg.leader_election.namespace.clone(),
    };
    let mut parts = Vec::new();
    let mut webhook_addr = None;
    if let Some((p, addr)) = start_admission(&ctx, &cfg.webhook, cfg.model_cache.is_some()).await? {
        parts.push(p);
        webhook_addr = Some(addr);
    }
    parts.extend(start_reconcilers(&ctx, cfg.functional_probe, cfg.model_cache.clone()).await?);

    ready.store(true, Ordering::Release);
    info!(grpc = %grpc_addr, http = %http_addr, identity = %cfg.leader_election.election.identity, lease = %format!("{}/{}", cfg.leader_election.namespace, cfg.leader_election.lease_name), "in-cluster controller serving");
    Ok(Running {
        grpc_addr,
        http_addr,
        webhook_addr,
        health_addr,
        shared,
        leader: leader_handle,
        grpc,
        http,
        election: election.task,
        loops: vec![
            plan_loop,
            status_loop,
            cache_index,
            quotas,
            expiry,
            tokenizer_watch,
            mirror,
            policies,
        ]
        .into_iter()
        .chain(health_task)
        .collect(),
        parts,
    })
}

#[cfg(test)]
mod tests {
    use super::functional_probe_gate;

    #[test]
    fn the_specs_empty_probe_url_turns_the_gate_off_and_a_url_is_refused() {
        assert!(functional_probe_gate(true, None).unwrap());
        assert!(!functional_probe_gate(false, None).unwrap());
        assert!(!functional_probe_gate(true, Some("")).unwrap());
        assert!(!functional_probe_gate(true, Some("  ")).unwrap());
        let err = functional_probe_gate(true, Some("http://inference-cache-server:8081"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("in process") && err.contains("--functional-probe=false"),
            "{err}"
        );
    }
}
