//! `ic-controller`: thin binary over the `ic_controller` library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use ic_shared::proto::{router_service_client::RouterServiceClient, LookupRouteRequest};
use ic_shared::telemetry::{self, LogFormat};

/// mimalloc instead of glibc malloc: the Pod webhook decodes, re-encodes and diffs a pod per
/// review, and was allocation-bound (docs/benchmarks.md, "Pod webhook").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// inference-cache controller: KV-prefix index, agent ingest, router (and, in cluster, the
/// CRDs' reconcilers and admission webhooks).
#[derive(Parser)]
#[command(name = "ic-controller", version, about, long_about = None)]
struct Cli {
    /// Log line format.
    #[arg(long, env = "IC_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the index, agent ingest, router and HTTP endpoints on this machine, without a cluster.
    Standalone(StandaloneArgs),
    /// Run in a cluster (kubeconfig or in-cluster service account): everything standalone
    /// serves plus agent authentication, leader election, node plans, CacheNode status, the
    /// admission webhooks and the reconcilers.
    Run(Box<RunArgs>),
    /// Write the CustomResourceDefinitions (one YAML file per CRD).
    Crds {
        /// Output directory.
        #[arg(long, env = "IC_CRDS_OUT", default_value = "chart/crds")]
        out: PathBuf,
        /// Also write the Markdown field reference of every CRD to this file
        /// (docs/crd-reference.md in this repository); not written when unset.
        #[arg(long, env = "IC_CRDS_DOCS", value_name = "PATH")]
        docs: Option<PathBuf>,
    },
    /// Ask a running controller's RouterService where a prompt's prefix is cached.
    Lookup(LookupArgs),
    /// Run a CacheBackend (or a Pod, with --backend) through admission offline, like a server
    /// dry-run: prints the defaulted object or the field-scoped errors (exit 1); for a pod, JSON
    /// with allowed, reason, patch and the mutated pod. Exit 2 on unreadable input.
    Admit(ic_controller::admission::offline::AdmitArgs),
    /// Uninstall step (the chart's pre-delete hook): remove the finalizer of every
    /// ModelCacheBinding in the control namespace so the namespace can be deleted. Exits 1,
    /// naming the binding, when one cannot be stripped — the uninstall must then stop.
    StripFinalizers(StripFinalizersArgs),
    /// Upgrade step (the chart's pre-upgrade hook): server-side apply this release's
    /// CustomResourceDefinitions (Helm never upgrades `crds/`): those in --crds-dir (the chart
    /// mounts its own crds/ there), else the ones built into this binary. Refuses, writing
    /// nothing, when a stored version would no longer be served (exit 1 naming it).
    UpgradeCrds(UpgradeCrdsArgs),
}

#[derive(clap::Args)]
struct UpgradeCrdsArgs {
    /// Kubeconfig file; unset: $KUBECONFIG, ~/.kube/config, then the in-cluster service account.
    #[arg(long, env = "IC_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Directory of CustomResourceDefinitions to apply (`*.yaml`, one CRD each: the chart's
    /// crds/, which its hook mounts here). Unset: the CRDs built into this binary. A file that is
    /// not a CRD stops the upgrade (exit 1 naming it) before anything is written.
    #[arg(long, env = "IC_CRDS_DIR")]
    crds_dir: Option<PathBuf>,
}

#[derive(clap::Args)]
struct StripFinalizersArgs {
    /// Kubeconfig file; unset: $KUBECONFIG, ~/.kube/config, then the in-cluster service account.
    #[arg(long, env = "IC_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The model-cache control namespace.
    #[arg(
        long,
        env = "IC_MODEL_CACHE_CONTROL_NAMESPACE",
        default_value = ic_controller::reconcile::model_cache::DEFAULT_CONTROL_NAMESPACE
    )]
    namespace: String,
}

#[derive(clap::Args)]
struct StandaloneArgs {
    /// gRPC listen address: AgentService (agents), RouterService (gateways), grpc.health.v1.
    #[arg(long, env = "IC_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    grpc_addr: SocketAddr,
    /// HTTP listen address: /healthz, /readyz, /metrics, /snapshot, /v1/nodes.
    #[arg(long, env = "IC_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    http_addr: SocketAddr,
    /// Seconds a disconnected agent's index entries are kept before they are dropped.
    #[arg(long, env = "IC_AGENT_EXPIRY_SECONDS", default_value_t = 120)]
    agent_expiry_seconds: u64,
    /// LookupRoute answers NO_HINT for matches shorter than this many tokens
    /// (CachePolicy.spec.minimumPrefixTokens in cluster).
    #[arg(long, env = "IC_MINIMUM_PREFIX_TOKENS", default_value_t = 0)]
    minimum_prefix_tokens: u32,
    /// Most blocks one engine stream may hold in the index (a bound on what one agent or
    /// subscriber token can make the controller store; blocks beyond it are not indexed and the
    /// stream reads Partial/StreamCapExceeded). 0 = no cap.
    #[arg(long, env = "IC_MAX_BLOCKS_PER_STREAM", default_value_t = 16_777_216)]
    max_blocks_per_stream: usize,
    /// Agent resyncs the controller reads and applies at once, in arrival order (a restart
    /// storm queues the rest; docs/grpc.md "Resync turns"). 0 = automatic: half the cores this
    /// process may use, at least 1, at most 4 (the index takes one writer at a time, and the
    /// other cores stay free for lookups and connections).
    #[arg(long, env = "IC_RESYNC_TURNS", default_value_t = 0)]
    resync_turns: usize,
    /// Milliseconds an agent that sends coverage heartbeats (one a second) may stay unheard
    /// before its replicas read Unknown/HeartbeatMissed and are not routed, as a Disconnected
    /// replica is not (docs/kv-events.md "Coverage age"). Must exceed three heartbeat
    /// intervals (3000), so a live agent running late does not flap.
    #[arg(long, env = "IC_COVERAGE_HEARTBEAT_BOUND_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(3001..))]
    coverage_heartbeat_bound_ms: u64,
    /// Most distinct engine streams one reporter (a node agent, a per-pod subscriber) may
    /// register in one resync; the rest are left out and counted in
    /// kv_streams_refused_total{reason="stream_cap"} (in cluster the node plans also limit each
    /// pod to the data-parallel ranks they have). Bounds the index write lock's hold per resync.
    #[arg(long, env = "IC_MAX_STREAMS_PER_REPORTER", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_streams_per_reporter: u64,
    /// Most block entries one reporter's resync (all its chunks together) may carry; a resync
    /// with more ends its stream with RESOURCE_EXHAUSTED as soon as the chunk that passes the
    /// bound arrives, counted in kv_streams_refused_total{reason="resync_entry_cap"}. Default
    /// 2 Mi: twice the largest planned node (1 M blocks), sized to the chart's memory limit.
    #[arg(long, env = "IC_MAX_RESYNC_ENTRIES", default_value_t = 2 * 1024 * 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_resync_entries: u64,
    /// Most AgentService.Connect streams one source address (an IPv4 address, an IPv6 /64)
    /// may have awaiting their Hello or its authentication at once; one more ends at once with
    /// RESOURCE_EXHAUSTED, counted in agent_streams_total{outcome="rejected",reason="pending_per_source_full"}.
    /// Many sources together are still held only by --agent-max-pending-hellos.
    #[arg(long, env = "IC_AGENT_MAX_PENDING_HELLOS_PER_SOURCE", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    agent_max_pending_hellos_per_source: u64,
    /// LookupRoute budget in milliseconds where the tenant's CachePolicy sets no
    /// lookupTimeoutMs (and for lookups without a tenant): past it the answer is NO_HINT with
    /// reason LookupTimeout (fail open).
    #[arg(long, env = "IC_LOOKUP_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    lookup_timeout_ms: u64,
    /// Milliseconds a session holding a resync turn may receive nothing before the turn goes
    /// to the next agent in line (a silent agent then waits for a turn again with its next
    /// message, and is still cut off 10 s after its last one). At most 10000 (the resync chunk
    /// gap).
    #[arg(long, env = "IC_RESYNC_TURN_IDLE_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    resync_turn_idle_ms: u64,
    #[command(flatten)]
    limits: ic_shared::serve::ConnectionLimitArgs,
    #[command(flatten)]
    keepalive: ic_shared::serve::GrpcKeepaliveArgs,
    #[command(flatten)]
    streams: ic_shared::serve::StreamLimitArgs,
    /// Listen on addresses beyond loopback although standalone mode authenticates nobody
    /// (agent streams, LookupRoute, /snapshot, /v1/nodes); without it such an address is refused.
    #[arg(long, env = "IC_ALLOW_UNAUTHENTICATED_NON_LOOPBACK")]
    allow_unauthenticated_non_loopback: bool,
    #[command(flatten)]
    tokenizers: ic_controller::tokenize::TokenizerArgs,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Kubeconfig file; unset: $KUBECONFIG, ~/.kube/config, then the in-cluster service account.
    #[arg(long, env = "IC_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// gRPC listen address: AgentService (agents, authenticated), RouterService (gateways),
    /// grpc.health.v1.
    #[arg(long, env = "IC_GRPC_ADDR", default_value = "0.0.0.0:50051")]
    grpc_addr: SocketAddr,
    /// HTTP listen address: /healthz, /readyz, /metrics, /snapshot, /v1/nodes.
    #[arg(long, env = "IC_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// HTTPS listen address of the admission webhooks.
    #[arg(long, env = "IC_WEBHOOK_ADDR", default_value = "0.0.0.0:9443")]
    webhook_addr: SocketAddr,
    /// Directory holding the webhook serving certificate (tls.crt, tls.key), reloaded when it
    /// changes (cert-manager, a mounted Secret).
    #[arg(
        long,
        env = "IC_WEBHOOK_CERT_DIR",
        conflicts_with = "webhook_self_signed"
    )]
    webhook_cert_dir: Option<PathBuf>,
    /// Generate a self-signed CA and serving certificate at start and patch the webhook
    /// configurations' caBundle.
    #[arg(long, env = "IC_WEBHOOK_SELF_SIGNED")]
    webhook_self_signed: bool,
    /// Name of the Mutating/ValidatingWebhookConfiguration whose caBundle is patched in
    /// self-signed mode.
    #[arg(long, env = "IC_WEBHOOK_CONFIG_NAME")]
    webhook_config_name: Option<String>,
    /// Namespace of the leader-election Lease; default: this pod's namespace (the service
    /// account's), else the kubeconfig context's.
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Name of the leader-election Lease (coordination.k8s.io/v1).
    #[arg(
        long,
        env = "IC_LEADER_ELECTION_LEASE_NAME",
        default_value = "inference-cache-controller"
    )]
    leader_election_lease_name: String,
    /// This replica's identity in the Lease; default: $POD_NAME or the hostname, plus a
    /// per-process suffix.
    #[arg(long, env = "IC_LEADER_ELECTION_IDENTITY")]
    leader_election_identity: Option<String>,
    /// Seconds a Lease stays valid after its last renewal (others may take over after that).
    #[arg(long, env = "IC_LEADER_ELECTION_LEASE_SECONDS", default_value_t = 15)]
    leader_election_lease_seconds: u64,
    /// Seconds the leader keeps writing without a successful renewal (must be below the lease
    /// duration).
    #[arg(
        long,
        env = "IC_LEADER_ELECTION_RENEW_DEADLINE_SECONDS",
        default_value_t = 10
    )]
    leader_election_renew_deadline_seconds: u64,
    /// Seconds between election attempts.
    #[arg(long, env = "IC_LEADER_ELECTION_RETRY_SECONDS", default_value_t = 2)]
    leader_election_retry_seconds: u64,
    /// Service account the node agents authenticate as, NAMESPACE:NAME; default:
    /// <leader-election namespace>:inference-cache-agent.
    #[arg(long, env = "IC_AGENT_SERVICE_ACCOUNT")]
    agent_service_account: Option<ic_controller::ingest::auth::ServiceAccountRef>,
    /// Audience the agents' projected service-account tokens must carry.
    #[arg(long, env = "IC_TOKEN_AUDIENCE", default_value = "inference-cache")]
    token_audience: String,
    /// Seconds a successful TokenReview of an agent token is cached.
    #[arg(long, env = "IC_TOKEN_CACHE_TTL_SECONDS", default_value_t = 60)]
    token_cache_ttl_seconds: u64,
    /// TokenReviews one source address may cause at once on agent streams (tokens not in the
    /// cache); beyond it the stream is refused RESOURCE_EXHAUSTED without a review and counted
    /// in token_reviews_limited_total.
    #[arg(long, env = "IC_TOKEN_REVIEW_BURST_PER_SOURCE", default_value_t = ic_controller::ingest::auth::DEFAULT_REVIEW_BURST_PER_SOURCE, value_parser = clap::value_parser!(u32).range(1..))]
    token_review_burst_per_source: u32,
    /// TokenReviews per second one source address earns back after its burst (a number ≥ 0,
    /// fractions allowed; 0 = none).
    #[arg(long, env = "IC_TOKEN_REVIEWS_PER_SECOND_PER_SOURCE", default_value_t = ic_controller::ingest::auth::DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE, value_parser = ic_controller::ingest::auth::parse_reviews_per_second)]
    token_reviews_per_second_per_source: f64,
    /// Require a caller identity on LookupRoute, /snapshot, /v1/nodes and /probe: a bearer
    /// token verified by TokenReview for --caller-audience, then a SubjectAccessReview (get/list
    /// on cacheroutes.inferencecache.io in the tenant's namespace, list/get on cachenodes, the
    /// non-resource URL /probe). false serves them to anyone who reaches the ports.
    #[arg(long, env = "IC_DATA_PLANE_AUTH", default_value_t = true, action = clap::ArgAction::Set)]
    data_plane_auth: bool,
    /// Audience the callers' (gateways', operators') bearer tokens must carry.
    #[arg(long, env = "IC_CALLER_AUDIENCE", default_value = ic_controller::access::DEFAULT_CALLER_AUDIENCE)]
    caller_audience: String,
    /// Seconds a SubjectAccessReview verdict (allowed or denied) is cached per user and request.
    #[arg(long, env = "IC_ACCESS_REVIEW_TTL_SECONDS", default_value_t = 30)]
    access_review_ttl_seconds: u64,
    /// Most TokenReviews and SubjectAccessReviews in flight at once; a request that waits more
    /// than 2 s for a slot is refused with 503 / UNAVAILABLE.
    #[arg(long, env = "IC_MAX_CONCURRENT_REVIEWS", default_value_t = ic_controller::access::DEFAULT_MAX_CONCURRENT_REVIEWS)]
    max_concurrent_reviews: usize,
    /// Seconds a disconnected agent's index entries are kept before they are dropped.
    #[arg(long, env = "IC_AGENT_EXPIRY_SECONDS", default_value_t = 120)]
    agent_expiry_seconds: u64,
    /// LookupRoute answers NO_HINT for matches shorter than this many tokens.
    #[arg(long, env = "IC_MINIMUM_PREFIX_TOKENS", default_value_t = 0)]
    minimum_prefix_tokens: u32,
    /// Most blocks one engine stream may hold in the index (a bound on what one agent or
    /// subscriber token can make the controller store; blocks beyond it are not indexed and the
    /// stream reads Partial/StreamCapExceeded). 0 = no cap.
    #[arg(long, env = "IC_MAX_BLOCKS_PER_STREAM", default_value_t = 16_777_216)]
    max_blocks_per_stream: usize,
    /// Agent resyncs the controller reads and applies at once, in arrival order (a restart
    /// storm queues the rest; docs/grpc.md "Resync turns"). 0 = automatic: half the cores this
    /// process may use, at least 1, at most 4 (the index takes one writer at a time, and the
    /// other cores stay free for lookups and connections).
    #[arg(long, env = "IC_RESYNC_TURNS", default_value_t = 0)]
    resync_turns: usize,
    /// Milliseconds an agent that sends coverage heartbeats (one a second) may stay unheard
    /// before its replicas read Unknown/HeartbeatMissed and are not routed, as a Disconnected
    /// replica is not (docs/kv-events.md "Coverage age"). Must exceed three heartbeat
    /// intervals (3000), so a live agent running late does not flap.
    #[arg(long, env = "IC_COVERAGE_HEARTBEAT_BOUND_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(3001..))]
    coverage_heartbeat_bound_ms: u64,
    /// Most distinct engine streams one reporter (a node agent, a per-pod subscriber) may
    /// register in one resync; the rest are left out and counted in
    /// kv_streams_refused_total{reason="stream_cap"} (in cluster the node plans also limit each
    /// pod to the data-parallel ranks they have). Bounds the index write lock's hold per resync.
    #[arg(long, env = "IC_MAX_STREAMS_PER_REPORTER", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_streams_per_reporter: u64,
    /// Most block entries one reporter's resync (all its chunks together) may carry; a resync
    /// with more ends its stream with RESOURCE_EXHAUSTED as soon as the chunk that passes the
    /// bound arrives, counted in kv_streams_refused_total{reason="resync_entry_cap"}. Default
    /// 2 Mi: twice the largest planned node (1 M blocks), sized to the chart's memory limit.
    #[arg(long, env = "IC_MAX_RESYNC_ENTRIES", default_value_t = 2 * 1024 * 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_resync_entries: u64,
    /// Most AgentService.Connect streams one source address (an IPv4 address, an IPv6 /64)
    /// may have awaiting their Hello or its authentication at once; one more ends at once with
    /// RESOURCE_EXHAUSTED, counted in agent_streams_total{outcome="rejected",reason="pending_per_source_full"}.
    /// Many sources together are still held only by --agent-max-pending-hellos.
    #[arg(long, env = "IC_AGENT_MAX_PENDING_HELLOS_PER_SOURCE", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    agent_max_pending_hellos_per_source: u64,
    /// LookupRoute budget in milliseconds where the tenant's CachePolicy sets no
    /// lookupTimeoutMs (and for lookups without a tenant): past it the answer is NO_HINT with
    /// reason LookupTimeout (fail open).
    #[arg(long, env = "IC_LOOKUP_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    lookup_timeout_ms: u64,
    /// Milliseconds a session holding a resync turn may receive nothing before the turn goes
    /// to the next agent in line (a silent agent then waits for a turn again with its next
    /// message, and is still cut off 10 s after its last one). At most 10000 (the resync chunk
    /// gap).
    #[arg(long, env = "IC_RESYNC_TURN_IDLE_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    resync_turn_idle_ms: u64,
    /// Seconds between node-plan derivations (pods and CacheBackends are listed each time).
    #[arg(long, env = "IC_NODE_PLAN_INTERVAL_SECONDS", default_value_t = 10)]
    node_plan_interval_seconds: u64,
    /// Minimum seconds between two CacheNode status writes of one node, unless a condition
    /// status changed (those are written at once).
    #[arg(
        long,
        env = "IC_CACHENODE_MIN_WRITE_INTERVAL_SECONDS",
        default_value_t = 30
    )]
    cachenode_min_write_interval_seconds: u64,
    /// At most one write of the cluster-wide CacheIndex status per this many seconds (it is
    /// written only when it changed, by the leader only).
    #[arg(
        long,
        env = "IC_CACHEINDEX_MIN_WRITE_INTERVAL_SECONDS",
        default_value_t = 15
    )]
    cacheindex_min_write_interval_seconds: u64,
    /// Serve the admission webhooks (CacheBackend defaulting/validation, Pod wiring).
    #[arg(long, env = "IC_WEBHOOKS", default_value_t = true, action = clap::ArgAction::Set)]
    webhooks: bool,
    /// Name of the webhook Service; self-signed mode puts its DNS names
    /// (NAME.NAMESPACE.svc, …) into the serving certificate.
    #[arg(
        long,
        env = "IC_WEBHOOK_SERVICE",
        default_value = "inference-cache-webhook"
    )]
    webhook_service: String,
    /// Self-signed mode: Secret in the controller's namespace through which the replicas share
    /// one CA and serving pair (created by the first replica; every replica re-reads it every
    /// 60 s, renews the one-year certificate and rotates the CA before they expire, and reloads
    /// a renewed pair). Unset: each replica generates its own, never rotated, which is only
    /// sound with one replica.
    #[arg(long, env = "IC_WEBHOOK_TLS_SECRET")]
    webhook_tls_secret: Option<String>,
    /// Image of the SGLang LMCache MP worker sidecar when spec.lmCache.workerImage is unset
    /// (default: the engine's own image).
    #[arg(long, env = "IC_LMCACHE_WORKER_IMAGE")]
    lmcache_worker_image: Option<String>,
    /// Image of the lmcache-kernel-check init container (default: the engine's own image,
    /// which is what the check is meant to test).
    #[arg(long, env = "IC_LMCACHE_KERNEL_CHECK_IMAGE")]
    lmcache_kernel_check_image: Option<String>,
    /// Image of the kvevent-subscriber sidecar (ic-agent subscribe); unset: no sidecar, the
    /// node agent subscribes to engines instead.
    #[arg(long, env = "IC_KVEVENT_SUBSCRIBER_IMAGE")]
    kvevent_subscriber_image: Option<String>,
    /// Controller address the kvevent-subscriber sidecar streams to (HOST:PORT or URL).
    #[arg(long, env = "IC_KVEVENT_SUBSCRIBER_CONTROLLER")]
    kvevent_subscriber_controller: Option<String>,
    /// Functional-probe gate: probe each Ready CacheBackend's ingest and routing path through
    /// the in-process index (spec "Functional-probe gate"); false turns the gate off.
    #[arg(long, env = "IC_FUNCTIONAL_PROBE", default_value_t = true, action = clap::ArgAction::Set)]
    functional_probe: bool,
    /// The spec's off switch for the functional-probe gate: `--server-probe-url=""` turns it
    /// off (same as `--functional-probe=false`). The probe runs against the in-process index,
    /// so there is no URL to give: any other value is refused.
    #[arg(long, env = "IC_SERVER_PROBE_URL")]
    server_probe_url: Option<String>,
    /// Run the ModelCache / ModelCacheBinding controllers and model-data pod wiring.
    #[arg(long, env = "IC_MODEL_CACHE_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    model_cache_enabled: bool,
    /// Namespace of ModelCacheBindings, writer Leases, helmModelCache writers and key Secrets.
    #[arg(
        long,
        env = "IC_MODEL_CACHE_CONTROL_NAMESPACE",
        default_value = ic_controller::reconcile::model_cache::DEFAULT_CONTROL_NAMESPACE
    )]
    model_cache_control_namespace: String,
    /// The model-cache StorageClass (its reclaimPolicy must be Retain).
    #[arg(
        long,
        env = "IC_MODEL_CACHE_STORAGE_CLASS",
        default_value = ic_controller::reconcile::model_cache::DEFAULT_STORAGE_CLASS
    )]
    model_cache_storage_class: String,
    /// Namespace of the storage capability catalog ConfigMap; default: the controller's.
    #[arg(long, env = "IC_MODEL_CACHE_CATALOG_NAMESPACE")]
    model_cache_catalog_namespace: Option<String>,
    /// Name of the catalog ConfigMap.
    #[arg(
        long,
        env = "IC_MODEL_CACHE_CATALOG_CONFIG_MAP",
        default_value = ic_controller::catalog::DEFAULT_CONFIG_MAP
    )]
    model_cache_catalog_config_map: String,
    /// Data key of the catalog in the ConfigMap.
    #[arg(
        long,
        env = "IC_MODEL_CACHE_CATALOG_KEY",
        default_value = ic_controller::catalog::DEFAULT_KEY
    )]
    model_cache_catalog_key: String,
    /// Model-cache feature gates: CachingSupport, HelmModelCaching, ModelCacheEncryption as
    /// Name=true|false, comma-separated, over the defaults (true, true, false).
    #[arg(long, env = "IC_MODEL_CACHE_FEATURE_GATES", default_value = "")]
    model_cache_feature_gates: String,
    /// Seconds a ModelCacheBinding may have no references before it retires.
    #[arg(long, env = "IC_MODEL_CACHE_IDLE_SECONDS", default_value_t = 3600)]
    model_cache_idle_seconds: u64,
    /// Service account of model-cache writer Jobs in the control namespace.
    #[arg(
        long,
        env = "IC_MODEL_CACHE_WRITER_SERVICE_ACCOUNT",
        default_value = "default"
    )]
    model_cache_writer_service_account: String,
    #[command(flatten)]
    limits: ic_shared::serve::ConnectionLimitArgs,
    #[command(flatten)]
    keepalive: ic_shared::serve::GrpcKeepaliveArgs,
    #[command(flatten)]
    streams: ic_shared::serve::StreamLimitArgs,
    #[command(flatten)]
    tokenizers: ic_controller::tokenize::TokenizerArgs,
}

/// Resolves on SIGTERM (the kubelet stopping the pod) or SIGINT.
async fn termination() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The namespace this pod runs in, from its service-account mount.
fn pod_namespace() -> Option<String> {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The `User-Agent` of every request to the Kubernetes API: `ic-controller/<version>`, as the
/// apiserver's audit log and `kubectl get --raw /metrics` (apiserver_request_total by client)
/// show it (kube-rs sends none by default).
const KUBE_USER_AGENT: &str = concat!("ic-controller/", env!("CARGO_PKG_VERSION"));

async fn kube_client(kubeconfig: Option<&PathBuf>) -> anyhow::Result<kube::Client> {
    let mut cfg = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "no Kubernetes configuration: set --kubeconfig or KUBECONFIG, or run in a pod",
        )?,
    };
    cfg.headers.push((
        hyper::header::USER_AGENT,
        hyper::header::HeaderValue::from_static(KUBE_USER_AGENT),
    ));
    kube::Client::try_from(cfg).context("building the Kubernetes client")
}

async fn run_in_cluster(a: RunArgs) -> anyhow::Result<()> {
    use ic_controller::incluster::{
        self, InClusterConfig, LeaderElectionSettings, WebhookSettings,
    };
    let client = kube_client(a.kubeconfig.as_ref()).await?;
    let namespace = a
        .leader_election_namespace
        .filter(|n| !n.is_empty())
        .or_else(pod_namespace)
        .unwrap_or_else(|| client.default_namespace().to_string());
    let base = a
        .leader_election_identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "ic-controller".to_string());
    let identity = match a.leader_election_identity {
        Some(id) => id,
        None => ic_controller::leader::unique_identity(&base),
    };
    if a.leader_election_renew_deadline_seconds >= a.leader_election_lease_seconds {
        bail!("--leader-election-renew-deadline-seconds must be below --leader-election-lease-seconds");
    }
    let agent_sa = match a.agent_service_account {
        Some(sa) => sa,
        None => format!("{namespace}:inference-cache-agent")
            .parse()
            .map_err(|e: String| anyhow::anyhow!(e))?,
    };
    let control_namespace = a.model_cache_control_namespace.clone();
    let limits = a
        .limits
        .with_keepalive(&a.keepalive)
        .with_streams(&a.streams);
    let model_cache = if a.model_cache_enabled {
        use ic_controller::reconcile::model_cache::{FeatureFlags, ModelCacheConfig};
        Some(ModelCacheConfig {
            control_namespace: a.model_cache_control_namespace,
            storage_class: a.model_cache_storage_class,
            catalog_namespace: a
                .model_cache_catalog_namespace
                .unwrap_or_else(|| namespace.clone()),
            catalog_config_map: a.model_cache_catalog_config_map,
            catalog_key: a.model_cache_catalog_key,
            flags: FeatureFlags::parse(&a.model_cache_feature_gates)
                .map_err(|e| anyhow::anyhow!("--model-cache-feature-gates: {e}"))?,
            idle_period: Duration::from_secs(a.model_cache_idle_seconds),
            writer_service_account: a.model_cache_writer_service_account,
            ..Default::default()
        })
    } else {
        None
    };
    let cfg = InClusterConfig {
        grpc_addr: a.grpc_addr,
        http_addr: a.http_addr,
        agent_expiry: Duration::from_secs(a.agent_expiry_seconds),
        policy: ic_controller::state::LookupPolicy {
            minimum_prefix_tokens: a.minimum_prefix_tokens,
            max_blocks_per_stream: (a.max_blocks_per_stream > 0).then_some(a.max_blocks_per_stream),
            resync_turns: (a.resync_turns > 0).then_some(a.resync_turns),
            max_streams_per_reporter: usize::try_from(a.max_streams_per_reporter).ok(),
            max_resync_entries: usize::try_from(a.max_resync_entries).ok(),
            max_pending_hellos_per_source: usize::try_from(a.agent_max_pending_hellos_per_source)
                .ok(),
            lookup_timeout: Some(Duration::from_millis(a.lookup_timeout_ms)),
            resync_turn_idle: Some(Duration::from_millis(a.resync_turn_idle_ms)),
            coverage_heartbeat_bound: Some(Duration::from_millis(a.coverage_heartbeat_bound_ms)),
        },
        webhook: WebhookSettings {
            enabled: a.webhooks,
            addr: a.webhook_addr,
            cert_dir: a.webhook_cert_dir,
            self_signed: a.webhook_self_signed,
            config_name: a.webhook_config_name,
            service: Some(a.webhook_service),
            tls_secret: a.webhook_tls_secret,
            ca_bundle_resync: Duration::from_secs(60),
            pod: ic_controller::admission::pod::PodWebhookConfig {
                kvevent_subscriber_image: a.kvevent_subscriber_image,
                kvevent_subscriber_controller: a.kvevent_subscriber_controller,
                lmcache_worker_image: a.lmcache_worker_image,
                lmcache_kernel_check_image: a.lmcache_kernel_check_image,
                ..Default::default()
            },
            limits,
        },
        leader_election: LeaderElectionSettings {
            namespace,
            lease_name: a.leader_election_lease_name,
            election: ic_controller::leader::ElectionConfig {
                identity,
                lease_duration: Duration::from_secs(a.leader_election_lease_seconds),
                renew_deadline: Duration::from_secs(a.leader_election_renew_deadline_seconds),
                retry_period: Duration::from_secs(a.leader_election_retry_seconds.max(1)),
            },
        },
        agent_service_account: agent_sa,
        token_audience: a.token_audience,
        token_cache_ttl: Duration::from_secs(a.token_cache_ttl_seconds),
        review_source_limit: ic_controller::ingest::auth::ReviewSourceLimit {
            burst: a.token_review_burst_per_source,
            per_second: a.token_reviews_per_second_per_source,
        },
        data_plane_auth: a.data_plane_auth.then(|| incluster::DataPlaneAuthSettings {
            caller: ic_controller::access::CallerAuthSettings {
                audience: a.caller_audience,
                review_ttl: Duration::from_secs(a.access_review_ttl_seconds),
                ..Default::default()
            },
            max_concurrent_reviews: a.max_concurrent_reviews,
        }),
        nodes: ic_controller::reconcile::nodes::NodeLoopConfig {
            plan_interval: Duration::from_secs(a.node_plan_interval_seconds.max(1)),
            cachenode_min_write_interval: Duration::from_secs(
                a.cachenode_min_write_interval_seconds,
            ),
            cacheindex_min_write_interval: Duration::from_secs(
                a.cacheindex_min_write_interval_seconds,
            ),
            model_cache_control_namespace: control_namespace,
            ..Default::default()
        },
        limits,
        model_cache,
        functional_probe: incluster::functional_probe_gate(
            a.functional_probe,
            a.server_probe_url.as_deref(),
        )?,
        tokenizers: a.tokenizers.config(),
    };
    let running = incluster::start(client, cfg, Default::default(), termination()).await?;
    running.wait().await?;
    Ok(())
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("prompt").required(true).args(["tokens", "text"])))]
struct LookupArgs {
    /// Controller gRPC URL (`http://HOST:PORT`; a bare `HOST:PORT` means `http://`).
    #[arg(long, env = "IC_CONTROLLER", default_value = "http://127.0.0.1:50051")]
    controller: String,
    /// Prompt token ids: a comma list ("1,2,3") and/or ranges ("0..32" = 0 to 31). One of
    /// --tokens and --text is needed.
    #[arg(long, conflicts_with = "text")]
    tokens: Option<String>,
    /// Prompt text instead of token ids: the controller tokenizes it with --model's tokenizer.
    #[arg(long)]
    text: Option<String>,
    /// With --text: do not add the tokenizer's special tokens (a chat prompt already rendered
    /// with the chat template).
    #[arg(long, requires = "text")]
    no_special_tokens: bool,
    /// Tenant (namespace); empty matches any.
    #[arg(long, default_value = "")]
    tenant: String,
    /// Model id; empty matches any.
    #[arg(long, default_value = "")]
    model: String,
    /// Hash scheme (vllm|sglang); empty matches any.
    #[arg(long, default_value = "")]
    hash_scheme: String,
    /// LoRA adapter name; empty = base model.
    #[arg(long, default_value = "")]
    adapter: String,
    /// Block size in tokens; 0 = every size registered for the scheme.
    #[arg(long, default_value_t = 0)]
    block_size: u32,
    /// File holding a bearer token (a service-account token for the controller's
    /// --caller-audience) sent as `authorization: Bearer …`; an in-cluster controller refuses
    /// lookups without one.
    #[arg(long, env = "IC_TOKEN_FILE")]
    token_file: Option<PathBuf>,
}

fn parse_tokens(spec: &str) -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((a, b)) = part.split_once("..") {
            let a: u32 = a
                .trim()
                .parse()
                .with_context(|| format!("bad range start in {part:?}"))?;
            let b: u32 = b
                .trim()
                .parse()
                .with_context(|| format!("bad range end in {part:?}"))?;
            out.extend(a..b);
        } else {
            out.push(part.parse().with_context(|| {
                let hint = match part.split_once('-') {
                    Some((a, b)) if !a.is_empty() => format!(" (a range is {a}..{b})"),
                    _ => String::new(),
                };
                format!(
                    "bad token id {part:?}{hint}: --tokens takes comma-separated ids and \
                     START..END ranges, e.g. 0..32 or 1,2,3"
                )
            })?);
        }
    }
    if out.is_empty() {
        bail!("--tokens names no token ids");
    }
    Ok(out)
}

fn main() -> std::process::ExitCode {
    // One TLS provider for the whole process (the webhook server, the kube client): rustls picks
    // one by itself only when exactly one is compiled in, and a build that unifies features with
    // another crate's (the test build does) has two — it then panics at the first handshake.
    // Err means one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    telemetry::exit_code(run_main())
}

#[tokio::main]
async fn run_main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    match cli.command {
        Command::Standalone(a) => {
            let cfg = ic_controller::standalone::StandaloneConfig {
                grpc_addr: a.grpc_addr,
                http_addr: a.http_addr,
                agent_expiry: Duration::from_secs(a.agent_expiry_seconds),
                policy: ic_controller::state::LookupPolicy {
                    minimum_prefix_tokens: a.minimum_prefix_tokens,
                    max_blocks_per_stream: (a.max_blocks_per_stream > 0)
                        .then_some(a.max_blocks_per_stream),
                    resync_turns: (a.resync_turns > 0).then_some(a.resync_turns),
                    max_streams_per_reporter: usize::try_from(a.max_streams_per_reporter).ok(),
                    max_resync_entries: usize::try_from(a.max_resync_entries).ok(),
                    max_pending_hellos_per_source: usize::try_from(
                        a.agent_max_pending_hellos_per_source,
                    )
                    .ok(),
                    lookup_timeout: Some(Duration::from_millis(a.lookup_timeout_ms)),
                    resync_turn_idle: Some(Duration::from_millis(a.resync_turn_idle_ms)),
                    coverage_heartbeat_bound: Some(Duration::from_millis(
                        a.coverage_heartbeat_bound_ms,
                    )),
                },
                limits: a
                    .limits
                    .with_keepalive(&a.keepalive)
                    .with_streams(&a.streams),
                allow_unauthenticated_non_loopback: a.allow_unauthenticated_non_loopback,
                tokenizers: a.tokenizers.config(),
            };
            // SIGINT or SIGTERM: drain and exit 0 (as `run` does).
            let running =
                ic_controller::standalone::start(cfg, telemetry::shutdown_signal()).await?;
            running.wait().await?;
        }
        Command::Run(a) => run_in_cluster(*a).await?,
        Command::Crds { out, docs } => {
            for path in ic_controller::crdgen::write(&out)
                .with_context(|| format!("writing CRDs into {}", out.display()))?
            {
                println!("{}", path.display());
            }
            if let Some(docs) = docs {
                ic_controller::crddoc::write(&docs)
                    .with_context(|| format!("writing the CRD reference {}", docs.display()))?;
                println!("{}", docs.display());
            }
        }
        Command::Admit(a) => {
            let out = match ic_controller::admission::offline::admit_cli(&a) {
                Ok(out) => out,
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(2);
                }
            };
            print!("{}", out.stdout);
            eprint!("{}", out.stderr);
            std::process::exit(out.exit_code);
        }
        Command::StripFinalizers(a) => {
            let client = kube_client(a.kubeconfig.as_ref()).await?;
            match ic_controller::reconcile::model_cache::strip_binding_finalizers(
                &client,
                &a.namespace,
            )
            .await
            {
                Ok(n) => println!(
                    "removed the finalizer of {n} ModelCacheBinding(s) in namespace {}",
                    a.namespace
                ),
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        }
        Command::UpgradeCrds(a) => {
            let crds = match &a.crds_dir {
                Some(dir) => match ic_controller::crdupgrade::load_dir(dir) {
                    Ok(crds) => crds,
                    Err(e) => {
                        eprintln!("error: {e}");
                        std::process::exit(1);
                    }
                },
                None => ic_controller::crdgen::all_crds(),
            };
            let client = kube_client(a.kubeconfig.as_ref()).await?;
            match ic_controller::crdupgrade::upgrade(&client, &crds).await {
                Ok(done) => {
                    for (name, action) in done {
                        let what = match action {
                            ic_controller::crdupgrade::CrdAction::Create => "created",
                            ic_controller::crdupgrade::CrdAction::Update => "applied",
                        };
                        println!("{what} CustomResourceDefinition {name}");
                    }
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        }
        Command::Lookup(a) => {
            // `host:port` means plain-text gRPC, as `ic-agent subscribe --controller` reads it.
            let url = if a.controller.contains("://") {
                a.controller.clone()
            } else {
                format!("http://{}", a.controller)
            };
            let channel = tonic::transport::Endpoint::from_shared(url)
                .with_context(|| format!("invalid controller URL {:?}", a.controller))?
                .connect()
                .await
                .with_context(|| format!("connecting to {}", a.controller))?;
            let mut client = RouterServiceClient::new(channel);
            let mut request = tonic::Request::new(LookupRouteRequest {
                tenant: a.tenant,
                model: a.model,
                hash_scheme: a.hash_scheme,
                adapter: a.adapter,
                token_ids: match &a.tokens {
                    Some(t) => parse_tokens(t)?,
                    None => Vec::new(),
                },
                content_keys: vec![],
                block_size: a.block_size,
                add_special_tokens: a.text.as_ref().map(|_| !a.no_special_tokens),
                prompt_text: a.text,
            });
            if let Some(path) = &a.token_file {
                let token = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --token-file {}", path.display()))?;
                let value = format!("Bearer {}", token.trim())
                    .parse()
                    .with_context(|| {
                        format!("--token-file {}: not a header value", path.display())
                    })?;
                request.metadata_mut().insert("authorization", value);
            }
            let resp = client
                .lookup_route(request)
                .await
                .map_err(|s| lookup_status_error(&a.controller, s))?
                .into_inner();
            println!("{}", serde_json::to_string_pretty(&lookup_json(&resp))?);
        }
    }
    Ok(())
}

/// A failed LookupRoute in words. A server that answers plain HTTP (tonic maps its status to
/// "grpc-status header missing, mapped from HTTP status code 404") is not the controller's gRPC
/// port: most often its HTTP port (8080 in the standalone stack).
fn lookup_status_error(controller: &str, s: tonic::Status) -> anyhow::Error {
    if s.message().contains("mapped from HTTP status code") {
        anyhow::anyhow!(
            "{controller} answered plain HTTP, not gRPC ({}): is it the controller's HTTP port? \
             RouterService is on its gRPC port (--grpc-addr, 50051 by default)",
            s.message()
        )
    } else {
        anyhow::anyhow!("LookupRoute failed: {:?}: {}", s.code(), s.message())
    }
}

fn lookup_json(r: &ic_shared::proto::LookupRouteResponse) -> serde_json::Value {
    use ic_shared::proto::{Decision, Tier};
    let decision = Decision::try_from(r.decision)
        .map(|d| d.as_str_name())
        .unwrap_or("DECISION_UNSPECIFIED");
    serde_json::json!({
        "decision": decision,
        "reason": r.reason,
        "blockSize": r.block_size,
        "requestBlocks": r.request_blocks,
        "narrowed": r.narrowed,
        "warnings": r.warnings,
        "promptTokens": r.prompt_tokens,
        "replicas": r.replicas.iter().map(|m| serde_json::json!({
            "replica": m.replica,
            "streamId": m.stream_id,
            "node": m.node,
            "dpRank": m.dp_rank,
            "matchedBlocks": m.matched_blocks,
            "matchedTokens": m.matched_tokens,
            "tier": Tier::try_from(m.tier).map(|t| t.as_str_name()).unwrap_or("TIER_UNSPECIFIED"),
            "backend": m.backend,
        })).collect::<Vec<_>>(),
    })
}
