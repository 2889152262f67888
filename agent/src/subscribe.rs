//! `ic-agent subscribe`: the per-pod kvevent-subscriber (DESIGN.md "Where our structure differs":
//! the `--kvevent-subscriber-image` sidecar mode; spec 000 "Events-only mode", "L2 cache tier
//! semantics").
//!
//! It follows **one** engine publisher (the pod's own, usually `tcp://127.0.0.1:5557`) and
//! streams it to the controller exactly as the node agent streams one entry of its plan: the
//! same [`KvHub`](crate::kv::KvHub) (SUB + replay DEALER, gap healing, restart detection, content
//! keys) and the same [`link`](crate::link) (Hello, full Resync on every (re)connect and on
//! request, batched deltas, acks, one stream per controller replica). The differences:
//!
//! - the plan is built from flags ([`SubscribeConfig::plan`]): tenant = `--tenant`, replica =
//!   `--replica-id` (plus `#rank` for `--data-parallel-rank` > 0), stream id
//!   `<tenant>/<replica-id>#<rank>`; `--ignore-block-removed=true` means the pod's backend keeps
//!   an L2 (Offload): a `BlockRemoved` from GPU re-reports the block at T2 instead of evicting it;
//! - `Hello.pod_subscriber` names the pod (`namespace = --tenant`, `pod = --replica-id`): the
//!   controller lets such a stream report only that pod's streams, sends it no node plan, and in
//!   cluster requires a token bound to that pod (the sidecar's projected token, audience
//!   `inference-cache`);
//! - no node checks run, so no check report is sent;
//! - `--metrics-addr` serves only `/metrics` and `/healthz`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
use ic_shared::proto;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tracing::{info, warn};

use crate::link::{self, LinkConfig};
use crate::state::AgentState;

/// Default `--controller`: the gRPC address `ic-controller standalone` listens on (and
/// `ic-controller lookup` dials). In cluster the webhook passes `--controller` explicitly.
pub const DEFAULT_CONTROLLER: &str = "http://127.0.0.1:50051";
/// Default `--token-file`: where the chart mounts the agent's projected token, and where the Pod
/// webhook mounts the sidecar's (audience `inference-cache`).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/inference-cache/token";
/// Capability a subscriber announces in Hello (besides `kv-events`).
pub const CAPABILITY: &str = "pod-subscriber";

/// `ic-agent subscribe` flags (every flag also reads an environment variable).
#[derive(Debug, Clone, clap::Args)]
pub struct SubscribeArgs {
    /// Engine KV-event PUB endpoint to connect a SUB socket to: the `endpoint` of the engine's
    /// `--kv-events-config` with a wildcard host replaced by 127.0.0.1, e.g.
    /// tcp://127.0.0.1:5557.
    #[arg(long, env = "IC_KV_ENDPOINT")]
    pub endpoint: String,
    /// Bind the SUB socket at --endpoint instead of connecting: the engine's publisher connects
    /// to it (vLLM connects to any endpoint that is not a wildcard or ipc, e.g.
    /// tcp://127.0.0.1:5557).
    #[arg(
        long,
        env = "IC_KV_BIND",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub bind: bool,
    /// Engine replay (ROUTER) endpoint, e.g. tcp://127.0.0.1:5558. With it, sequence gaps are
    /// healed and a subscriber that starts after the engine learns the blocks published before;
    /// without it a gap clears the replica until new events arrive.
    #[arg(long, env = "IC_KV_REPLAY_ENDPOINT")]
    pub replay: Option<String>,
    /// Topic prefix to subscribe to; empty (the default) receives every topic.
    #[arg(long, env = "IC_KV_TOPIC", default_value = "")]
    pub topic: String,
    /// Engine family whose events the stream carries: vllm or sglang. Lookups only match
    /// prefixes recorded under the same scheme.
    #[arg(long, env = "IC_HASH_SCHEME", value_parser = parse_hash_scheme)]
    pub hash_scheme: HashScheme,
    /// Model id the engine serves (the CacheBackend's spec.observation.modelID); the index keys
    /// entries by it.
    #[arg(long, env = "IC_MODEL_ID")]
    pub model_id: String,
    /// Tenant of the stream: the engine pod's namespace.
    #[arg(long, env = "POD_NAMESPACE")]
    pub tenant: String,
    /// Replica id in routing answers: the engine pod's name ("#<rank>" is appended for a
    /// data-parallel rank above 0).
    #[arg(long, env = "POD_NAME")]
    pub replica_id: String,
    /// Global data-parallel rank of the publisher followed (the engine publishes one endpoint
    /// per rank; run one subscriber per rank).
    #[arg(long, env = "IC_DATA_PARALLEL_RANK", default_value_t = 0)]
    pub data_parallel_rank: u32,
    /// Engine block size in tokens: used when an event carries none; blocks shorter than it are
    /// not indexed.
    #[arg(long, env = "IC_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// true when the pod's backend keeps an L2 (integration.mode Offload: LMCache still holds a
    /// block the engine evicted): a BlockRemoved from GPU re-reports the block at tier T2.
    /// false (the default, events-only): a BlockRemoved evicts the prefix.
    #[arg(
        long,
        env = "IC_IGNORE_BLOCK_REMOVED",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub ignore_block_removed: bool,
    /// Tokens per chunk of the pod's offload tier (LMCache's `chunk_size`, which loads whole
    /// chunks only), sent on the stream's descriptor so the index credits an offload-only match
    /// in whole chunks (docs/kv-events.md "Chunked offload tiers"); 0 (the default): no chunking.
    /// The webhook renders it for integration mode Offload with `type: LMCache`.
    #[arg(long, env = "IC_OFFLOAD_CHUNK_TOKENS", default_value_t = 0)]
    pub offload_chunk_tokens: u32,
    /// Controller gRPC address: a URL (http://host:port) or host:port; several may be
    /// comma-separated. A name is resolved every 10 s and one stream is kept per address.
    #[arg(long, env = "IC_CONTROLLER", default_value = DEFAULT_CONTROLLER)]
    pub controller: String,
    /// Projected service-account token (audience inference-cache) presented to the controller,
    /// re-read on every connect. When the file does not exist the subscriber connects without a
    /// token, which only a standalone controller accepts.
    #[arg(long, env = "IC_TOKEN_FILE", default_value = DEFAULT_TOKEN_FILE)]
    pub token_file: PathBuf,
    /// Node the pod runs on, sent in Hello (in cluster it must equal the node the token is bound
    /// to). Default: this host's name.
    #[arg(long, env = "NODE_NAME")]
    pub node: Option<String>,
    /// Optional listen address serving /metrics (inferencecache_agent_*) and /healthz, e.g.
    /// 0.0.0.0:9091. Nothing is served without it.
    #[arg(long, env = "IC_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Connection limits of the `--metrics-addr` listener (docs/security.md "Connection
    /// limits"), the same flags as `ic-agent run`.
    #[command(flatten)]
    pub limits: ic_shared::serve::ConnectionLimitArgs,
}

/// Parses `ic-agent subscribe` flags from `args` (the first item is the program or subcommand
/// name, as in `std::env::args`), e.g. the sidecar's exact command line in tests. Unset flags
/// fall back to their environment variables and defaults.
pub fn parse_args<I, T>(args: I) -> Result<SubscribeArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    #[derive(clap::Parser)]
    #[command(name = "subscribe")]
    struct Cli {
        #[command(flatten)]
        args: SubscribeArgs,
    }
    <Cli as clap::Parser>::try_parse_from(args).map(|c| c.args)
}

fn parse_hash_scheme(s: &str) -> Result<HashScheme, String> {
    HashScheme::parse(s.trim()).ok_or_else(|| format!("expected vllm or sglang, got {s:?}"))
}

/// Why the subscriber could not start.
#[derive(Debug, Error)]
pub enum SubscribeError {
    /// A flag value is unusable.
    #[error("invalid --{flag}: {reason}")]
    Invalid {
        /// Flag name.
        flag: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The metrics listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
}

/// Settings of one subscriber.
#[derive(Debug, Clone)]
pub struct SubscribeConfig {
    /// Engine PUB endpoint (`@tcp://…` when the SUB binds it, `--bind`).
    pub endpoint: String,
    /// Engine replay endpoint.
    pub replay: Option<String>,
    /// Topic prefix.
    pub topic: String,
    /// Engine family.
    pub hash_scheme: HashScheme,
    /// Model id.
    pub model: String,
    /// Tenant (pod namespace).
    pub tenant: String,
    /// Replica id (pod name).
    pub replica: String,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Engine block size in tokens.
    pub block_size: u32,
    /// The backend keeps an L2: BlockRemoved demotes to T2.
    pub keeps_l2: bool,
    /// Tokens per offload-tier chunk (0: none); the plan's `offload_chunk_tokens`.
    pub offload_chunk_tokens: u32,
    /// Controller URL(s), normalised to `scheme://host:port`.
    pub controller: String,
    /// Token file, `None` to connect without a token.
    pub token_file: Option<PathBuf>,
    /// Node name sent in Hello.
    pub node: String,
    /// `/metrics` + `/healthz` listener.
    pub metrics_addr: Option<SocketAddr>,
    /// Connection limits of that listener.
    pub limits: ic_shared::serve::ConnectionLimits,
    /// First reconnect delay of the controller link.
    pub backoff_initial: Duration,
    /// Reconnect delay cap of the controller link.
    pub backoff_max: Duration,
}

impl SubscribeArgs {
    /// Validates the flags into a config. A `--token-file` that does not exist means "no token"
    /// (logged), so the same command works against a standalone controller.
    pub fn config(&self) -> Result<SubscribeConfig, SubscribeError> {
        let required = |flag: &'static str, v: &str| -> Result<String, SubscribeError> {
            let v = v.trim();
            if v.is_empty() {
                return Err(SubscribeError::Invalid {
                    flag,
                    reason: "must not be empty".into(),
                });
            }
            Ok(v.to_string())
        };
        let mut endpoint = required("endpoint", &self.endpoint)?;
        if self.bind {
            if !endpoint.starts_with("tcp://") {
                return Err(SubscribeError::Invalid {
                    flag: "endpoint",
                    reason: "--bind takes a tcp://HOST:PORT endpoint".into(),
                });
            }
            // The hub's spelling of a SUB that binds (kv::subscriber::bound_endpoint).
            endpoint = format!("@{endpoint}");
        }
        let tenant = required("tenant", &self.tenant)?;
        let replica = required("replica-id", &self.replica_id)?;
        if replica.contains(['#', '/']) || tenant.contains(['#', '/']) {
            return Err(SubscribeError::Invalid {
                flag: if tenant.contains(['#', '/']) {
                    "tenant"
                } else {
                    "replica-id"
                },
                reason: "a namespace or pod name cannot contain '#' or '/'".into(),
            });
        }
        if self.block_size == 0 {
            return Err(SubscribeError::Invalid {
                flag: "block-size",
                reason: "must be at least 1".into(),
            });
        }
        let controller = controller_urls(&self.controller).ok_or(SubscribeError::Invalid {
            flag: "controller",
            reason: format!("no address in {:?}", self.controller),
        })?;
        let token_file = if self.token_file.exists() {
            Some(self.token_file.clone())
        } else {
            warn!(path = %self.token_file.display(), "no token file: connecting without a token (only a standalone controller accepts that)");
            None
        };
        let defaults = LinkConfig::new("");
        Ok(SubscribeConfig {
            endpoint,
            replay: self
                .replay
                .as_deref()
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string),
            topic: self.topic.clone(),
            hash_scheme: self.hash_scheme,
            model: required("model-id", &self.model_id)?,
            tenant,
            replica,
            dp_rank: self.data_parallel_rank,
            block_size: self.block_size,
            keeps_l2: self.ignore_block_removed,
            offload_chunk_tokens: self.offload_chunk_tokens,
            controller,
            token_file,
            node: self
                .node
                .clone()
                .filter(|n| !n.trim().is_empty())
                .unwrap_or_else(hostname),
            metrics_addr: self.metrics_addr,
            limits: self.limits.limits(),
            backoff_initial: defaults.backoff_initial,
            backoff_max: defaults.backoff_max,
        })
    }
}

/// `HOST:PORT` entries become `http://HOST:PORT` (the webhook's `--controller=` form); URLs are
/// kept. `None` when no entry is left.
pub fn controller_urls(list: &str) -> Option<String> {
    let urls: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            if u.contains("://") {
                u.to_string()
            } else {
                format!("http://{u}")
            }
        })
        .collect();
    (!urls.is_empty()).then(|| urls.join(","))
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".to_string())
}

impl SubscribeConfig {
    /// The one-engine plan the hub runs: the same entry the controller would plan for this pod.
    pub fn plan(&self) -> NodePlan {
        NodePlan {
            engines: vec![EnginePlan {
                namespace: self.tenant.clone(),
                pod: self.replica.clone(),
                model: self.model.clone(),
                hash_scheme: self.hash_scheme,
                block_size: self.block_size,
                keeps_l2: self.keeps_l2,
                offload_chunk_tokens: (self.offload_chunk_tokens > 0)
                    .then_some(self.offload_chunk_tokens),
                kv_events: vec![KvEventSource {
                    endpoint: self.endpoint.clone(),
                    replay_endpoint: self.replay.clone(),
                    topic: self.topic.clone(),
                    dp_rank: self.dp_rank,
                }],
                ..EnginePlan::default()
            }],
            ..NodePlan::default()
        }
    }

    /// The identity sent in `Hello.pod_subscriber`.
    pub fn pod_identity(&self) -> proto::PodSubscriber {
        proto::PodSubscriber {
            namespace: self.tenant.clone(),
            pod: self.replica.clone(),
        }
    }

    /// The stream id the subscriber reports (`<tenant>/<replica>#<rank>`).
    pub fn stream_id(&self) -> String {
        format!("{}/{}#{}", self.tenant, self.replica, self.dp_rank)
    }
}

/// A running subscriber: the hub, the controller link and the optional metrics listener.
pub struct Subscriber {
    /// Shared state (the hub's status, the link's status, the metrics).
    pub state: Arc<AgentState>,
    /// Bound `/metrics` address, when one was asked for.
    pub metrics_addr: Option<SocketAddr>,
    /// Refused and timed-out connections of that listener.
    pub metrics_stats: Arc<ic_shared::serve::ListenerStats>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Held so the link never sees the (unused) check-pass channel close.
    _passes: watch::Sender<u64>,
}

impl Subscriber {
    /// Stops the link and the listener and closes the engine sockets.
    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
        self.state.hub.apply_plan(&NodePlan::default());
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts the subscriber (within a tokio runtime).
pub async fn start(cfg: SubscribeConfig) -> Result<Subscriber, SubscribeError> {
    let (metrics_listener, metrics_addr) = match cfg.metrics_addr {
        Some(addr) => {
            let bind_err = |source| SubscribeError::Bind { addr, source };
            let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
            let bound = listener.local_addr().map_err(bind_err)?;
            (Some(listener), Some(bound))
        }
        None => (None, None),
    };
    let state = AgentState::new(cfg.node.clone(), cfg.plan())?;
    let mut link_cfg = LinkConfig::new(cfg.controller.clone());
    link_cfg.token_file = cfg.token_file.clone();
    link_cfg.pod_subscriber = Some(cfg.pod_identity());
    link_cfg.backoff_initial = cfg.backoff_initial;
    link_cfg.backoff_max = cfg.backoff_max;
    let (passes, pass_rx) = watch::channel(0u64);
    let mut tasks = vec![tokio::spawn(link::run(
        link_cfg,
        state.clone(),
        pass_rx,
        Arc::new(Notify::new()),
    ))];
    let metrics_stats = state.metrics.listeners.stats("metrics");
    if let Some(listener) = metrics_listener {
        tasks.push(tokio::spawn(crate::runtime::serve_limited(
            listener,
            metrics_router(state.clone()),
            cfg.limits,
            metrics_stats.clone(),
            "metrics",
        )));
    }
    info!(
        stream = %cfg.stream_id(),
        endpoint = %cfg.endpoint,
        replay = cfg.replay.as_deref().unwrap_or(""),
        model = %cfg.model,
        hash_scheme = cfg.hash_scheme.as_str(),
        keeps_l2 = cfg.keeps_l2,
        controller = %cfg.controller,
        node = %cfg.node,
        token = cfg.token_file.is_some(),
        metrics = ?metrics_addr,
        "kvevent subscriber running"
    );
    Ok(Subscriber {
        state,
        metrics_addr,
        metrics_stats,
        tasks,
        _passes: passes,
    })
}

/// Runs the subscriber until `shutdown` resolves (the binary passes SIGTERM / Ctrl-C), then
/// stops it.
pub async fn run(
    cfg: SubscribeConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), SubscribeError> {
    let running = start(cfg).await?;
    shutdown.await;
    info!("kvevent subscriber stopping");
    running.stop();
    Ok(())
}

/// `/metrics` and `/healthz` (200 while the process serves).
fn metrics_router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/metrics",
            get(move || {
                let state = state.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        ic_shared::telemetry::encode_metrics(&state.metrics.registry),
                    )
                        .into_response()
                }
            }),
        )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// Parses the base command line with `extra` flags added or replacing base ones.
    fn parse(extra: &[&str]) -> Result<SubscribeConfig, String> {
        let base = [
            "--endpoint=tcp://127.0.0.1:5557",
            "--hash-scheme=sglang",
            "--model-id=m",
            "--tenant=team-a",
            "--replica-id=pod-a",
            "--token-file=/nonexistent/token",
            "--node=n1",
        ];
        let key = |f: &str| f.split('=').next().unwrap_or_default().to_string();
        let mut argv = vec!["subscribe"];
        argv.extend(
            base.iter()
                .filter(|b| !extra.iter().any(|e| key(e) == key(b))),
        );
        argv.extend_from_slice(extra);
        let args = parse_args(argv).map_err(|e| e.to_string())?;
        args.config().map_err(|e| e.to_string())
    }

    /// Reads until the peer closes (or 10 s pass: a failure); returns what arrived.
    async fn until_closed(s: &mut tokio::net::TcpStream) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut out = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return out,
                Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
                Err(_) => panic!("the metrics listener kept a connection open past 10 s"),
            }
        }
    }

    /// The sidecar's `--metrics-addr` listener runs under the same limits as the agent's: a
    /// connection over `--max-connections` is closed at accept, a silent one after
    /// `--header-read-timeout-seconds`, and the listener answers again once a slot frees.
    #[tokio::test]
    async fn the_metrics_listener_is_under_the_connection_limits() {
        use tokio::io::AsyncWriteExt;
        use tokio::net::TcpStream;
        let cfg = parse(&[
            "--metrics-addr=127.0.0.1:0",
            "--max-connections=2",
            "--header-read-timeout-seconds=1",
            "--controller=127.0.0.1:1",
        ])
        .unwrap();
        let sub = start(cfg).await.unwrap();
        let addr = sub.metrics_addr.unwrap();
        let mut silent = vec![
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        // Both slots taken: a third connection is closed without an answer.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = TcpStream::connect(addr).await.unwrap();
        let _ = third
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await;
        assert!(
            until_closed(&mut third).await.is_empty(),
            "served over the cap"
        );
        assert_eq!(sub.metrics_stats.refused(), 1);
        // The silent ones are closed by the header-read deadline.
        for s in &mut silent {
            assert!(until_closed(s).await.is_empty());
        }
        assert!(sub.metrics_stats.timed_out() >= 1);
        let mut ok = TcpStream::connect(addr).await.unwrap();
        ok.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let got = String::from_utf8_lossy(&until_closed(&mut ok).await).to_string();
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        sub.stop();
    }

    #[test]
    fn bind_plans_a_sub_that_binds() {
        let cfg = parse(&["--bind", "--data-parallel-rank=2"]).unwrap();
        assert_eq!(cfg.endpoint, "@tcp://127.0.0.1:5557");
        assert_eq!(
            crate::kv::subscriber::bound_endpoint(&cfg.plan().engines[0].kv_events[0].endpoint),
            Some("tcp://127.0.0.1:5557")
        );
        assert_eq!(parse(&[]).unwrap().endpoint, "tcp://127.0.0.1:5557");
        let err = parse(&["--bind", "--endpoint=ipc:///tmp/x"]).unwrap_err();
        assert!(err.contains("--bind takes a tcp://"), "{err}");
    }

    #[test]
    fn the_webhooks_command_line_parses_into_the_planned_stream() {
        let cfg = parse(&[
            "--ignore-block-removed=true",
            "--controller=ic-controller.ic-system.svc:50051",
        ])
        .unwrap();
        assert!(cfg.keeps_l2);
        assert_eq!(cfg.controller, "http://ic-controller.ic-system.svc:50051");
        assert_eq!(cfg.token_file, None, "a missing token file means no token");
        assert_eq!(cfg.stream_id(), "team-a/pod-a#0");
        let plan = cfg.plan();
        let e = &plan.engines[0];
        assert_eq!(
            (e.namespace.as_str(), e.pod.as_str(), e.model.as_str()),
            ("team-a", "pod-a", "m")
        );
        assert_eq!(e.hash_scheme, HashScheme::Sglang);
        assert_eq!(e.stream_id(0), cfg.stream_id());
        assert_eq!(e.kv_events[0].endpoint, "tcp://127.0.0.1:5557");
        assert_eq!(
            cfg.pod_identity(),
            proto::PodSubscriber {
                namespace: "team-a".into(),
                pod: "pod-a".into()
            }
        );
    }

    #[test]
    fn defaults_and_bare_flags() {
        let cfg = parse(&[]).unwrap();
        assert!(!cfg.keeps_l2, "BlockRemoved evicts by default");
        assert_eq!(cfg.controller, DEFAULT_CONTROLLER);
        assert_eq!((cfg.dp_rank, cfg.block_size), (0, 16));
        assert_eq!(cfg.topic, "");
        assert!(parse(&["--ignore-block-removed"]).unwrap().keeps_l2);
        assert!(!parse(&["--ignore-block-removed=false"]).unwrap().keeps_l2);
        let ranked = parse(&["--data-parallel-rank=2", "--replay=tcp://127.0.0.1:5558"]).unwrap();
        assert_eq!(ranked.plan().engines[0].replica_id(2), "pod-a#2");
        assert_eq!(ranked.stream_id(), "team-a/pod-a#2");
        assert_eq!(ranked.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        // No chunked offload tier unless the webhook says so; with it, the descriptor says so.
        assert_eq!(cfg.plan().engines[0].descriptor(0).offload_chunk_tokens, 0);
        let chunked = parse(&["--offload-chunk-tokens=256"]).unwrap();
        assert_eq!(chunked.plan().engines[0].offload_chunk_tokens, Some(256));
        assert_eq!(
            chunked.plan().engines[0].descriptor(0).offload_chunk_tokens,
            256
        );
    }

    #[test]
    fn bad_flags_are_refused_with_the_flag_named() {
        assert!(parse(&["--hash-scheme=trtllm"])
            .unwrap_err()
            .contains("vllm or sglang"));
        assert!(parse(&["--tenant="]).unwrap_err().contains("--tenant"));
        assert!(parse(&["--replica-id=a#1"])
            .unwrap_err()
            .contains("--replica-id"));
        assert!(parse(&["--block-size=0"])
            .unwrap_err()
            .contains("--block-size"));
        assert!(parse(&["--controller= , "])
            .unwrap_err()
            .contains("--controller"));
    }

    #[test]
    fn controller_addresses_are_normalised() {
        assert_eq!(
            controller_urls("a:1, http://b:2").as_deref(),
            Some("http://a:1,http://b:2")
        );
        assert_eq!(controller_urls(""), None);
    }
}
