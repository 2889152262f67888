//! `ic-agent run`: wires the check loop, the KV hub, the engine-metrics scraper, the controller
//! link and the HTTP endpoints.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tracing::{info, warn};

use crate::checks::Checks;
use crate::engine_metrics::{self, ScrapeConfig};
use crate::link::{self, LinkConfig};
use crate::state::{now_unix_ms, AgentState, CheckPass};

/// Settings of a running agent.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Controller link; `None` runs checks and endpoints only.
    pub link: Option<LinkConfig>,
    /// HTTP listen address for `/healthz`, `/readyz`, `/metrics`, `/v1/report`.
    pub http_addr: SocketAddr,
    /// Optional second listener serving only `/metrics` (the pod IP in cluster, so Prometheus can
    /// scrape while the troubleshooting endpoints stay on loopback).
    pub metrics_addr: Option<SocketAddr>,
    /// Time between check passes.
    pub check_interval: Duration,
    /// Connection limits of each HTTP listener (docs/security.md "Connection limits").
    pub limits: ic_shared::serve::ConnectionLimits,
    /// With a file, `/metrics` and `/v1/report` require `Authorization: Bearer <its content>`
    /// on both listeners ([`crate::http::auth`]); `None` leaves them open.
    pub http_bearer_token_file: Option<std::path::PathBuf>,
}

/// Why the agent could not start.
#[derive(Debug, Error)]
pub enum RunError {
    /// The HTTP listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// The checks thread could not be started.
    #[error("cannot start the checks thread: {0}")]
    ChecksThread(std::io::Error),
    /// `--http-bearer-token-file` cannot be used.
    #[error("{0}")]
    BearerToken(String),
}

/// Serves `app` on `listener` under `limits` until the task is dropped, counting refused and
/// timed-out connections in `stats`; `what` names the listener in the log line if it stops.
pub(crate) async fn serve_limited(
    listener: TcpListener,
    app: axum::Router,
    limits: ic_shared::serve::ConnectionLimits,
    stats: Arc<ic_shared::serve::ListenerStats>,
    what: &'static str,
) {
    let served = ic_shared::serve::serve_http(
        listener,
        app,
        limits,
        stats,
        ic_shared::serve::plain,
        std::future::pending(),
        Duration::from_secs(1),
    )
    .await;
    if let Err(e) = served {
        warn!(error = %e, server = what, "HTTP server stopped");
    }
}

/// Where the checks run: on a thread of this process ([`CheckRunner::spawn`]; tests, `ic-agent
/// run --checks-in-process`) or in the checks worker process ([`CheckRunner::process`], what
/// `ic-agent run` uses: [`crate::checks_worker`]). Either way, one pass at a time; a pass that
/// could not run is the one `ChecksUnavailable` result.
#[derive(Clone)]
pub struct CheckRunner {
    inner: Runner,
}

#[derive(Clone)]
enum Runner {
    /// The checks thread: passes queue on a channel; the thread ends when the runner is dropped.
    Thread(std::sync::mpsc::Sender<CheckJob>),
    /// The checks supervisor and worker processes.
    Process(Arc<crate::checks_worker::SupervisorClient>),
}

/// One queued pass: the plan and where its results go.
type CheckJob = (
    ic_shared::plan::NodePlan,
    tokio::sync::oneshot::Sender<Vec<ic_shared::check::CheckResult>>,
);

/// Name of the checks thread (`/proc/<pid>/task/<tid>/comm`) of [`CheckRunner::spawn`].
pub const CHECKS_THREAD_NAME: &str = "ic-checks";

impl CheckRunner {
    /// Starts the checks thread, which inherits the calling thread's capabilities (and shares
    /// this process's memory with every parser of it: `ic-agent run` uses [`Self::process`]).
    ///
    /// # Errors
    /// The thread could not be created.
    pub fn spawn(checks: Checks) -> std::io::Result<Self> {
        let (jobs, rx) = std::sync::mpsc::channel::<CheckJob>();
        std::thread::Builder::new()
            .name(CHECKS_THREAD_NAME.into())
            .spawn(move || {
                for (plan, reply) in rx {
                    let _ = reply.send(checks.run_all(&plan));
                }
            })?;
        Ok(CheckRunner {
            inner: Runner::Thread(jobs),
        })
    }

    /// Runs the checks in the worker process behind `client` (started before this process
    /// dropped its capabilities).
    pub fn process(client: crate::checks_worker::SupervisorClient) -> Self {
        CheckRunner {
            inner: Runner::Process(Arc::new(client)),
        }
    }

    /// Registers the runner's metrics (the process runner's
    /// `inferencecache_agent_checks_worker_restarts_total`) in `registry`.
    pub fn register_metrics(&self, registry: &prometheus::Registry) {
        if let Runner::Process(client) = &self.inner {
            client.register_metrics(registry);
        }
    }

    /// Runs every check against `plan` on the checks thread or in the worker. When the pass
    /// cannot run there (the thread is gone, the worker died, hung or is restarting) the pass is
    /// one Unknown result, `checks`/`host`/`ChecksUnavailable`: an empty pass would read "every
    /// check passes" on the CacheNode.
    pub async fn run(&self, plan: ic_shared::plan::NodePlan) -> Vec<ic_shared::check::CheckResult> {
        let jobs = match &self.inner {
            Runner::Thread(jobs) => jobs,
            Runner::Process(client) => {
                return client.run(&plan).await.unwrap_or_else(|why| {
                    warn!(reason = %why, "no check ran this pass");
                    vec![checks_unavailable_with(
                        &why,
                        "a new checks worker is started by itself \
                         (inferencecache_agent_checks_worker_restarts_total); read the agent's \
                         log if this persists.",
                    )]
                })
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        if jobs.send((plan, tx)).is_err() {
            warn!("the checks thread is gone");
            return vec![checks_unavailable("the agent's checks thread is gone")];
        }
        rx.await.unwrap_or_else(|_| {
            warn!("check pass failed on the checks thread");
            vec![checks_unavailable(
                "the check pass died on the agent's checks thread",
            )]
        })
    }
}

/// The one result of a pass that could not run: no check's verdict is known.
fn checks_unavailable(why: &str) -> ic_shared::check::CheckResult {
    checks_unavailable_with(why, "restart the agent pod and read its log.")
}

/// [`checks_unavailable`] with `advice` after the reason.
fn checks_unavailable_with(why: &str, advice: &str) -> ic_shared::check::CheckResult {
    ic_shared::check::CheckResult::new(
        "checks",
        "host",
        ic_shared::check::CheckStatus::Unknown,
        ic_shared::check::CHECKS_UNAVAILABLE,
        format!("{why}, so no node check ran; {advice}"),
    )
}

/// Runs one pass of every check (thread or worker process) and stores it; `interval` is the time
/// to the next pass.
pub async fn check_pass(
    state: &Arc<AgentState>,
    checks: &CheckRunner,
    interval: Duration,
) -> CheckPass {
    let plan = state.plan.read().clone();
    let started = Instant::now();
    let generation = plan.generation;
    let results = checks.run(plan).await;
    let pass = CheckPass {
        observed_at_unix_ms: now_unix_ms(),
        plan_generation: generation,
        duration_seconds: started.elapsed().as_secs_f64(),
        interval_seconds: interval.as_secs(),
        results,
    };
    state.metrics.record_pass(&pass);
    *state.latest.write() = Some(pass.clone());
    pass
}

/// The multi-threaded tokio runtime of `ic-agent run`: two workers, every thread of which
/// (workers and the blocking pool) drops all capabilities and is confined with Landlock to the
/// agent's own mount tree before it runs anything, so the code that parses engine KV-event
/// frames, engine `/metrics`, controller replies and HTTP requests holds no capability and
/// cannot open another pod's files ([`crate::privilege::drop_all_and_confine_or_warn`]).
///
/// # Errors
/// The runtime could not be built.
pub fn build_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(crate::privilege::drop_all_and_confine_or_warn)
        .build()
}

/// A started agent: the bound HTTP address and the tasks.
pub struct Running {
    /// Bound HTTP address.
    pub http_addr: SocketAddr,
    /// Shared state (tests read it).
    pub state: Arc<AgentState>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops every task (HTTP, checks, link, KV subscribers keep their own lifetimes in the hub).
    pub fn abort(&self) {
        for t in &self.tasks {
            t.abort();
        }
        // Stops the KV streams and keeps their state for the next start (`--state-dir`).
        self.state.hub.shutdown();
    }
}

/// Starts the checks thread ([`CheckRunner`], with the calling thread's capabilities), the check
/// loop, the engine-metrics scraper (default [`ScrapeConfig`]), the link and the HTTP server.
pub async fn start(
    cfg: RunConfig,
    state: Arc<AgentState>,
    checks: Checks,
) -> Result<Running, RunError> {
    start_with(cfg, state, checks, ScrapeConfig::default()).await
}

/// Like [`start`], scraping the planned engines' `/metrics` with `scrape` (tier-2 counters;
/// [`engine_metrics`]).
pub async fn start_with(
    cfg: RunConfig,
    state: Arc<AgentState>,
    checks: Checks,
    scrape: ScrapeConfig,
) -> Result<Running, RunError> {
    let checks = CheckRunner::spawn(checks).map_err(RunError::ChecksThread)?;
    start_with_runner(cfg, state, checks, scrape).await
}

/// Like [`start_with`], running the checks with `checks` (`ic-agent run`: the worker process,
/// [`CheckRunner::process`]).
pub async fn start_with_runner(
    cfg: RunConfig,
    state: Arc<AgentState>,
    checks: CheckRunner,
    scrape: ScrapeConfig,
) -> Result<Running, RunError> {
    let token = match &cfg.http_bearer_token_file {
        Some(p) => Some(
            crate::http::auth::BearerToken::from_file(p.clone()).map_err(RunError::BearerToken)?,
        ),
        None => None,
    };
    let listener = TcpListener::bind(cfg.http_addr)
        .await
        .map_err(|source| RunError::Bind {
            addr: cfg.http_addr,
            source,
        })?;
    let http_addr = listener.local_addr().map_err(|source| RunError::Bind {
        addr: cfg.http_addr,
        source,
    })?;
    let metrics_listener = match cfg.metrics_addr {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| RunError::Bind { addr, source })?,
        ),
        None => None,
    };
    crate::privilege::register_metrics(&state.metrics.registry);
    checks.register_metrics(&state.metrics.registry);
    let (pass_tx, pass_rx) = watch::channel(0u64);
    let plan_applied = Arc::new(Notify::new());
    let mut tasks = Vec::new();

    // First pass before anything else, so the link's first report carries results.
    check_pass(&state, &checks, cfg.check_interval).await;
    pass_tx.send_modify(|n| *n += 1);

    {
        let state = state.clone();
        let plan_applied = plan_applied.clone();
        let interval = cfg.check_interval;
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = plan_applied.notified() => {}
                }
                check_pass(&state, &checks, interval).await;
                pass_tx.send_modify(|n| *n += 1);
            }
        }));
    }
    if !scrape.interval.is_zero() {
        let state = state.clone();
        tasks.push(tokio::spawn(async move {
            let plan = || state.plan.read().clone();
            engine_metrics::run(plan, &state.engine_counters, scrape).await;
        }));
    }
    {
        // Keep changed KV stream state on disk (a no-op without `--state-dir`).
        let hub = state.hub.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(crate::kv::persist::SAVE_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let hub = hub.clone();
                let _ = tokio::task::spawn_blocking(move || hub.save_changed()).await;
            }
        }));
    }
    if let Some(link_cfg) = cfg.link {
        let state = state.clone();
        tasks.push(tokio::spawn(link::run(
            link_cfg,
            state,
            pass_rx,
            plan_applied,
        )));
    }
    {
        let app = crate::http::router_guarded(state.clone(), token.clone());
        tasks.push(tokio::spawn(serve_limited(
            listener,
            app,
            cfg.limits,
            state.metrics.listeners.stats("http"),
            "HTTP",
        )));
    }
    if let Some(listener) = metrics_listener {
        let app = crate::http::metrics_router(state.clone(), token.clone());
        tasks.push(tokio::spawn(serve_limited(
            listener,
            app,
            cfg.limits,
            state.metrics.listeners.stats("metrics"),
            "metrics",
        )));
    }
    info!(http = %http_addr, node = %state.node, "agent running");
    Ok(Running {
        http_addr,
        state,
        tasks,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// A checks thread that is gone yields one Unknown result, never an empty pass (which
    /// the controller would read as "every node check passes").
    #[tokio::test]
    async fn a_gone_checks_thread_is_one_unknown_result() {
        let (jobs, rx) = std::sync::mpsc::channel::<CheckJob>();
        drop(rx);
        let runner = CheckRunner {
            inner: Runner::Thread(jobs),
        };
        let r = runner.run(ic_shared::plan::NodePlan::default()).await;
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].status, r[0].reason.as_str(), r[0].subject.as_str()),
            (
                ic_shared::check::CheckStatus::Unknown,
                ic_shared::check::CHECKS_UNAVAILABLE,
                "host"
            )
        );
    }
}
