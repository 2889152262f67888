//! `ic-agent`: thin binary over the `ic_agent` library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use ic_agent::checks::{self, Checks, ChecksConfig};
use ic_shared::check::CheckStatus;
use ic_shared::plan::NodePlan;
use ic_shared::telemetry::{self, LogFormat};

/// inference-cache node agent: checks what only a node can see (/dev/shm, host ports, GPUs),
/// aggregates the node's engine KV-cache events, and reports both to the controller.
#[derive(Parser)]
#[command(name = "ic-agent", version, about, long_about = None)]
struct Cli {
    /// Log line format.
    #[arg(long, env = "IC_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run continuously: checks on a schedule, KV-event subscribers, the controller link, and
    /// the HTTP endpoints /healthz, /readyz, /metrics, /v1/report. Needs --controller or
    /// --plan (or --checks-only): exit 2 otherwise.
    Run(RunArgs),
    /// Run every check once on this host and print a verdict table (or JSON).
    /// Exit status: 0 ok (or unknown), 1 warning, 2 critical, 3 the plan could not be read.
    Check(CheckArgs),
    /// Engine KV-event tools.
    #[command(subcommand)]
    Kv(KvCommand),
    /// Qualify a storage provider for the model cache (docs/model-cache.md "Enabling a
    /// provider"): a writer process fills the writer volume and exits, the reader must see
    /// identical bytes (SHA-256) and refuse every write with EROFS, the reclaim policy must be
    /// Retain. Prints a report to cite. Exit status: 0 qualified, 1 not qualified, 2 the run could not be made.
    Qualify(ic_agent::qualify::QualifyArgs),
    /// Per-pod KV-event subscriber (the kvevent-subscriber sidecar the Pod webhook appends when
    /// the controller runs with --kvevent-subscriber-image): follow ONE engine publisher and
    /// stream its blocks to the controller, like the node agent does for a planned stream.
    /// Runs until SIGTERM / Ctrl-C (exit 0); exit 2 on unusable flags.
    Subscribe(ic_agent::subscribe::SubscribeArgs),
    /// Internal: the process `ic-agent run` starts before it drops its capabilities; it keeps
    /// them, starts the checks worker and restarts it (ic_agent::checks_worker).
    #[command(name = "checks-supervisor", hide = true)]
    ChecksSupervisor(ic_agent::checks_worker::WorkerArgs),
    /// Internal: runs the node checks for the supervisor, one plan frame in, one result frame
    /// out (ic_agent::checks_worker).
    #[command(name = "checks-worker", hide = true)]
    ChecksWorker(ic_agent::checks_worker::WorkerArgs),
}

#[derive(Subcommand)]
enum KvCommand {
    /// Replay golden engine frames (testdata/kv-events/*.json) on a ZMQ PUB socket with
    /// the engine's exact framing, and serve the engine's replay protocol on a ROUTER socket.
    Publish(PublishArgs),
    /// Follow one engine publisher and print every batch decoded, with sequence numbers, gaps,
    /// restarts and (with --replay) what the replay socket brings back.
    Tail(TailArgs),
    /// Decode captured frames from FILE (or stdin) and print each batch as JSON: hex (one message
    /// per line, frames separated by spaces: [topic] [seq] payload), JSON arrays of hex frames, a
    /// fixture file, raw ZMTP multipart dumps (e.g. `kv tail --save`), or one raw msgpack payload.
    Decode(DecodeArgs),
}

#[derive(Args)]
struct TailArgs {
    /// Engine PUB endpoint to connect to, e.g. tcp://10.0.0.7:5557.
    #[arg(long)]
    endpoint: String,
    /// Engine replay (ROUTER) endpoint, e.g. tcp://10.0.0.7:5558: gaps are replayed from it.
    #[arg(long)]
    replay: Option<String>,
    /// Topic prefix to subscribe to (empty = every topic).
    #[arg(long, default_value = "")]
    topic: String,
    /// Print one JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Stop after this many live messages (default: until interrupted).
    #[arg(long)]
    count: Option<u64>,
    /// First replay everything from this engine seq (needs --replay), then follow live.
    #[arg(long)]
    from_seq: Option<u64>,
    /// Also append every live message to FILE as a raw ZMTP multipart dump (`kv decode` reads it).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Seconds to wait for the connect and for each replay reply.
    #[arg(long, default_value_t = 3)]
    timeout_seconds: u64,
}

#[derive(Args)]
struct DecodeArgs {
    /// Input file; stdin when absent or "-".
    file: Option<PathBuf>,
    /// Print one compact JSON object per line instead of a pretty JSON array.
    #[arg(long)]
    lines: bool,
}

#[derive(Args)]
struct PublishArgs {
    /// Fixture file recorded from a genuine publisher.
    #[arg(long)]
    fixture: PathBuf,
    /// PUB endpoint to bind, e.g. tcp://127.0.0.1:5557; >tcp://HOST:PORT connects instead (as
    /// vLLM does for a non-wildcard endpoint, to a subscriber that binds).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    endpoint: String,
    /// ROUTER endpoint to bind for replay requests, e.g. tcp://127.0.0.1:5558.
    #[arg(long)]
    replay_endpoint: Option<String>,
    /// Which recorded publisher to replay: dp0, dp1 or dp2.
    #[arg(long, default_value = "dp0")]
    source: String,
    /// Passes over the frames; 0 = until interrupted (each pass restarts at the recorded seqs,
    /// which subscribers see as an engine restart).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Milliseconds between frames.
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    /// Milliseconds to wait after binding before the first frame (subscribers connect).
    #[arg(long, default_value_t = 1000)]
    connect_wait_ms: u64,
    /// Seconds to keep serving replay requests after the last frame.
    #[arg(long, default_value_t = 3600)]
    linger_seconds: u64,
    /// Recorded seqs not to send live (still served by replay, so a subscriber that checks its
    /// tail finds them: simulated loss); repeatable.
    #[arg(long = "skip-seq")]
    skip_seqs: Vec<u64>,
    /// End the recording after this seq: later frames are neither sent nor replayable. The
    /// recorded scenarios end with AllBlocksCleared at seq 9: `--until-seq 8` keeps the state.
    #[arg(long)]
    until_seq: Option<u64>,
    /// Send the recorded engine timestamps. By default each live batch carries the current
    /// time, so the agent's `kv_stream_lag_seconds` is the real delay, not the recording's age.
    #[arg(long)]
    recorded_timestamps: bool,
}

#[derive(Args)]
struct CommonArgs {
    /// Node plan (YAML or JSON): required /dev/shm, host ports, engines and their KV publishers.
    #[arg(long, env = "IC_PLAN")]
    plan: Option<PathBuf>,
    /// Node name reported to the controller (default: this host's name).
    #[arg(long, env = "NODE_NAME")]
    node: Option<String>,
    /// Path of libnvidia-ml (default: libnvidia-ml.so.1 from the loader path).
    #[arg(long, env = "IC_NVML_LIBRARY")]
    nvml_library: Option<PathBuf>,
    /// Root of the proc filesystem to inspect (host /proc when the DaemonSet mounts it elsewhere).
    #[arg(long, env = "IC_PROC_ROOT", default_value = "/proc")]
    proc_root: PathBuf,
    /// Path of the host's /dev/shm.
    #[arg(long, env = "IC_SHM_PATH", default_value = "/dev/shm")]
    shm_path: PathBuf,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Controller gRPC URL (`http://HOST:PORT`; a bare `HOST:PORT` means `http://`); without it
    /// the agent runs checks and endpoints only. The host is resolved every 10 s and one stream
    /// is kept per address (point it at a headless Service so every controller replica gets every
    /// node's state); several URLs may be comma-separated.
    #[arg(long, env = "IC_CONTROLLER")]
    controller: Option<String>,
    /// HTTP listen address for /healthz, /readyz, /metrics, /v1/report.
    #[arg(long, env = "IC_HTTP_ADDR", default_value = "127.0.0.1:9090")]
    http_addr: SocketAddr,
    /// Optional separate listen address serving only /metrics (in cluster: the pod IP, port 9091).
    #[arg(long, env = "IC_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Seconds between check passes.
    #[arg(long, env = "IC_CHECK_INTERVAL_SECONDS", default_value_t = 5)]
    check_interval_seconds: u64,
    #[command(flatten)]
    limits: ic_shared::serve::ConnectionLimitArgs,
    /// File holding the projected service-account token presented to the controller.
    #[arg(long, env = "IC_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Require `Authorization: Bearer <token>` on /metrics and /v1/report (both listeners), the
    /// token being this file's content (a mounted Secret; re-read when it changes). /healthz and
    /// /readyz stay open. Unset: no authentication (the troubleshooting listener is loopback-only
    /// by default).
    #[arg(long, env = "IC_HTTP_BEARER_TOKEN_FILE")]
    http_bearer_token_file: Option<PathBuf>,
    /// Seconds between scrapes of the planned engines' /metrics for tier-2 counters
    /// (vllm:external_prefix_cache_{hits,queries}_total); 0 turns scraping off.
    #[arg(long, env = "IC_T2_SCRAPE_INTERVAL_SECONDS", default_value_t = 15)]
    t2_scrape_interval_seconds: u64,
    /// Milliseconds one engine /metrics fetch may take (connect, request, response).
    #[arg(long, env = "IC_T2_SCRAPE_TIMEOUT_MS", default_value_t = 2000)]
    t2_scrape_timeout_ms: u64,
    /// Directory where each KV stream's state is kept across agent restarts (a rolling upgrade
    /// resumes every stream where it was instead of losing what the engines' replay buffers no
    /// longer hold). In cluster the chart mounts a hostPath here. Unset: nothing is kept.
    #[arg(long, env = "IC_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Run with neither a controller (--controller) nor a node plan (--plan): the host checks
    /// and the HTTP endpoints only, reporting nowhere (a troubleshooting run). Without it, `run`
    /// with neither refuses to start (exit 2) rather than run silently with nothing to report
    /// to and no plan.
    #[arg(long, env = "IC_CHECKS_ONLY")]
    checks_only: bool,
    /// Seconds one check pass may take in the checks worker process before it is killed, the
    /// pass reads ChecksUnavailable and a new worker is started (with a growing delay). Above
    /// the longest legitimate pass: a first CUDA probe may wait IC_CUDA_TIMEOUT_SECONDS (60).
    #[arg(long, env = "IC_CHECKS_PASS_TIMEOUT_SECONDS", default_value_t = 180)]
    checks_pass_timeout_seconds: u64,
    /// Debugging only: run the checks on a thread of this process instead of the checks worker
    /// process. That thread keeps the agent's capabilities in the same address space as the
    /// parsers of engine and controller input (docs/security.md).
    #[arg(long, env = "IC_CHECKS_IN_PROCESS")]
    checks_in_process: bool,
    /// Node-wide budget of KV-event bytes in flight, all engine streams together: a live
    /// message is charged its bytes plus what decoding it may allocate from the socket until it
    /// is applied; beyond the budget messages are dropped
    /// (kv_events_dropped_total{reason="inflight_budget"}) and their stream reads Stale
    /// TailUnverified until healed (docs/security.md, hostile engines). Default 48 MiB.
    #[arg(long, env = "IC_KV_INFLIGHT_BYTES", default_value_t = ic_agent::kv::subscriber::budget::DEFAULT_INFLIGHT_BYTES)]
    kv_inflight_bytes: usize,
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Print JSON: {"node":…, "status":…, "checks":[{"name","subject","status","reason","message","observed"}]}.
    #[arg(long)]
    json: bool,
}

impl CommonArgs {
    fn node(&self) -> String {
        self.node.clone().unwrap_or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "localhost".to_string())
        })
    }

    fn plan(&self) -> anyhow::Result<NodePlan> {
        match &self.plan {
            Some(p) => Ok(NodePlan::load(p)?),
            None => Ok(NodePlan::default()),
        }
    }

    /// Check settings: the IC_* tuning variables (XID policy, CUDA, MP-worker timeouts; see
    /// docs/checks.md) overlaid with these flags.
    fn checks_config(&self) -> anyhow::Result<ChecksConfig> {
        Ok(ChecksConfig {
            proc_root: self.proc_root.clone(),
            shm_path: self.shm_path.clone(),
            nvml_library: self.nvml_library.clone(),
            ..ChecksConfig::from_env()?
        })
    }
}

fn main() -> std::process::ExitCode {
    telemetry::exit_code(run_main())
}

fn run_main() -> anyhow::Result<()> {
    ic_agent::kv::subscriber::budget::return_large_buffers_to_the_os();
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    match cli.command {
        Command::Qualify(a) => std::process::exit(ic_agent::qualify::run_cli(a)),
        Command::Check(a) => {
            let plan = match a.common.plan() {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("ic-agent check: {}", telemetry::error_report(e.as_ref()));
                    std::process::exit(3);
                }
            };
            let node = a.common.node();
            let cfg = match a.common.checks_config() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("ic-agent check: {}", telemetry::error_report(e.as_ref()));
                    std::process::exit(3);
                }
            };
            let results = Checks::new(&cfg).run_all(&plan);
            let text = if a.json {
                let mut json = serde_json::to_string_pretty(&checks::report_json(&node, &results))?;
                json.push('\n');
                json
            } else {
                checks::render_table(&node, &results)
            };
            ic_agent::write_stdout(&text)?;
            std::process::exit(CheckStatus::worst(results.iter().map(|r| r.status)).exit_code());
        }
        Command::Kv(KvCommand::Publish(a)) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let opts = ic_agent::kv::publish::PublishOptions {
                source: a.source,
                repeat: a.repeat,
                interval: Duration::from_millis(a.interval_ms),
                connect_wait: Duration::from_millis(a.connect_wait_ms),
                linger: Duration::from_secs(a.linger_seconds),
                skip_seqs: a.skip_seqs.into_iter().collect(),
                until_seq: a.until_seq,
                retime: !a.recorded_timestamps,
            };
            // A signal ends publishing or the linger early; the summary is printed either way.
            let r = rt.block_on(ic_agent::kv::publish::publish_fixture_until(
                &a.fixture,
                &a.endpoint,
                a.replay_endpoint.as_deref(),
                &opts,
                telemetry::shutdown_signal(),
            ))?;
            eprintln!(
                "published {} batches ({} withheld), answered {} replay requests with {} batches",
                r.published, r.skipped, r.replay_requests, r.replayed_batches
            );
            Ok(())
        }
        Command::Kv(KvCommand::Tail(a)) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let opts = ic_agent::kv::tail::TailOptions {
                endpoint: a.endpoint,
                replay: a.replay,
                topic: a.topic,
                json: a.json,
                count: a.count,
                from_seq: a.from_seq,
                timeout: Duration::from_secs(a.timeout_seconds.max(1)),
            };
            let mut save = match &a.save {
                Some(p) => Some(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(p)
                        .with_context(|| format!("opening {}", p.display()))?,
                ),
                None => None,
            };
            let stdout = std::io::stdout();
            let summary = rt.block_on(async {
                let mut out = stdout.lock();
                tokio::select! {
                    r = ic_agent::kv::tail::tail(&opts, &mut out, save.as_mut()) => r.map(Some),
                    _ = tokio::signal::ctrl_c() => Ok(None),
                }
            })?;
            if let Some(s) = summary {
                eprintln!(
                    "{} live messages, {} replayed batches, {} gaps ({} healed), {} restarts",
                    s.live, s.replayed, s.gaps, s.healed, s.restarts
                );
            }
            Ok(())
        }
        Command::Kv(KvCommand::Decode(a)) => {
            use std::io::Read;
            let mut input = Vec::new();
            match a.file.as_deref() {
                Some(p) if p != std::path::Path::new("-") => {
                    input = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
                }
                _ => {
                    std::io::stdin().read_to_end(&mut input)?;
                }
            }
            let messages = ic_agent::kv::inspect::parse_input(&input)?;
            let docs: Vec<serde_json::Value> = messages
                .iter()
                .map(ic_agent::kv::inspect::message_json)
                .collect();
            let mut text = String::new();
            if a.lines {
                for d in &docs {
                    text.push_str(&d.to_string());
                    text.push('\n');
                }
            } else {
                text = serde_json::to_string_pretty(&docs)?;
                text.push('\n');
            }
            ic_agent::write_stdout(&text)?;
            let undecodable = docs.iter().filter(|d| d.get("error").is_some()).count();
            if undecodable > 0 {
                eprintln!("{undecodable} of {} messages did not decode", docs.len());
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Subscribe(a) => {
            let cfg = match a.config() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("ic-agent subscribe: {e}");
                    std::process::exit(2);
                }
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(ic_agent::subscribe::run(cfg, telemetry::shutdown_signal()))?;
            Ok(())
        }
        Command::Run(a) => {
            if a.controller.is_none() && a.common.plan.is_none() && !a.checks_only {
                eprintln!(
                    "ic-agent run: neither --controller (IC_CONTROLLER) nor --plan (IC_PLAN) is \
                     set: this agent would report to no controller and check no planned engine. \
                     Set one of them, or pass --checks-only to run the host checks and endpoints \
                     alone."
                );
                std::process::exit(2);
            }
            // The checks' processes first, from this (main) thread while it still holds the
            // capabilities and no Landlock domain: both are inherited across fork/exec, and a
            // process without capabilities cannot give a child any.
            let worker = if a.checks_in_process {
                None
            } else {
                // Fail here on a malformed IC_* variable rather than in the worker.
                a.common.checks_config()?;
                let args = ic_agent::checks_worker::WorkerArgs {
                    proc_root: a.common.proc_root.clone(),
                    shm_path: a.common.shm_path.clone(),
                    nvml_library: a.common.nvml_library.clone(),
                    state_dir: a.state_dir.clone(),
                    pass_timeout_seconds: a.checks_pass_timeout_seconds,
                };
                let format = clap::ValueEnum::to_possible_value(&cli.log_format)
                    .map(|v| v.get_name().to_string())
                    .unwrap_or_default();
                let client = ic_agent::checks_worker::SupervisorClient::spawn(
                    &args,
                    &[("IC_LOG_FORMAT", format)],
                )?;
                // No thread of this process needs a capability from now on: this one drops
                // them (and is confined) before it starts the runtime, whose threads do the
                // same (a failure is logged; the agent keeps running).
                ic_agent::privilege::drop_all_and_confine_or_warn();
                Some(client)
            };
            // Every runtime thread drops its capabilities; with --checks-in-process only the
            // checks thread, which `runtime::start_with` spawns from this (main) thread, keeps
            // them.
            let rt = ic_agent::runtime::build_runtime()?;
            rt.block_on(run(a, worker))
        }
        Command::ChecksSupervisor(a) => Ok(ic_agent::checks_worker::run_supervisor(&a)?),
        Command::ChecksWorker(a) => ic_agent::checks_worker::run_worker(&a),
    }
}

async fn run(
    a: RunArgs,
    worker: Option<ic_agent::checks_worker::SupervisorClient>,
) -> anyhow::Result<()> {
    let plan = a.common.plan()?;
    let node = a.common.node();
    let state_dir = match &a.state_dir {
        Some(dir) => Some(
            ic_agent::kv::persist::StateDir::open(dir)
                .with_context(|| format!("--state-dir {}", dir.display()))?,
        ),
        None => None,
    };
    let state = ic_agent::state::AgentState::with_state_dir(node, plan, state_dir)?;
    state.hub.set_inflight_bytes(a.kv_inflight_bytes);
    let link = match &a.controller {
        Some(url) => {
            // A bare HOST:PORT means http://HOST:PORT, as for `subscribe` and `lookup`.
            let url = ic_agent::subscribe::controller_urls(url)
                .with_context(|| format!("--controller {url:?} names no controller"))?;
            let mut cfg = ic_agent::link::LinkConfig::new(url);
            if let Some(f) = &a.token_file {
                // Fail fast on a missing file; the link re-reads it on every connect, since the
                // kubelet rotates projected tokens.
                std::fs::metadata(f)
                    .with_context(|| format!("reading token file {}", f.display()))?;
                cfg.token_file = Some(f.clone());
            }
            Some(cfg)
        }
        None => None,
    };
    let checks = match worker {
        Some(client) => ic_agent::runtime::CheckRunner::process(client),
        None => ic_agent::runtime::CheckRunner::spawn(Checks::new(&ChecksConfig {
            state_dir: a.state_dir.clone(),
            ..a.common.checks_config()?
        }))
        .context("starting the checks thread")?,
    };
    let running = ic_agent::runtime::start_with_runner(
        ic_agent::runtime::RunConfig {
            link,
            http_addr: a.http_addr,
            metrics_addr: a.metrics_addr,
            check_interval: Duration::from_secs(a.check_interval_seconds.max(1)),
            limits: a.limits.limits(),
            http_bearer_token_file: a.http_bearer_token_file.clone(),
        },
        state,
        checks,
        ic_agent::engine_metrics::ScrapeConfig {
            interval: Duration::from_secs(a.t2_scrape_interval_seconds),
            timeout: Duration::from_millis(a.t2_scrape_timeout_ms.max(1)),
            ..Default::default()
        },
    )
    .await?;
    // With --checks-in-process the checks thread has inherited this thread's capabilities (and
    // no Landlock domain); this one needs neither from now on (a failure is logged, as for the
    // runtime's threads: the agent keeps running). Without it, this thread dropped them before
    // the runtime started; again is a no-op.
    ic_agent::privilege::drop_all_and_confine_or_warn();
    telemetry::shutdown_signal().await;
    running.abort();
    Ok(())
}
