//! `ic-fleet`: many node agents at once against one real controller (`ic-controller
//! standalone`) over loopback gRPC — memory per (block, replica) entry, convergence after a
//! controller restart with every agent resyncing at once, and LookupRoute latency meanwhile.
//! docs/scaling.md reads its figures; `scripts/bench-fleet.sh` runs it over several sizes.
//!
//! One run: start the controller; connect `--agents` agents (each `--streams-per-agent` engine
//! streams, about `--entries-per-agent` entries in all); wait until the controller's `/metrics`
//! show every agent connected and every entry indexed; measure memory; optionally churn (one
//! prompt replaced per stream every `--churn-every-ms`) and measure the controller's CPU per
//! block op; then SIGTERM the controller, start it again, and time the reconnect storm while
//! lookups run. Prints one Markdown table row (`--header` prints the header first) and, with
//! `--json`, one JSON object per run on stderr.
//!
//! Standalone mode authenticates nobody and keeps no node scope (`ic_controller::ingest::scope`:
//! it derives no plans), so a simulated agent is admitted exactly as a real agent without a
//! token is; in cluster each would need a TokenReview-valid token bound to its node.

// The run's JSON line (`--json`) is one `serde_json::json!` with more keys than the default
// macro recursion limit allows.
#![recursion_limit = "256"]

mod agents;
mod controller;
mod lookups;
mod spec;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use parking_lot::Mutex;

use agents::Fleet;
use controller::{
    cpu_times, listen_overflows, load_average, rss_kib, Controller, ControllerCmd, CpuTimes,
};
use spec::FleetSpec;

/// The controller's default `--max-resync-entries` (`ic_controller::ingest::DEFAULT_MAX_RESYNC_ENTRIES`;
/// not a dependency: the controller crate would pull its whole dependency tree into this
/// build): a larger node resync is refused unless the controller is started with a larger one.
const MAX_RESYNC_ENTRIES: usize = 2 * 1024 * 1024;

#[derive(Parser, Debug)]
#[command(
    name = "ic-fleet",
    about = "Many agents against one controller over loopback gRPC"
)]
struct Args {
    /// Node agents (one HTTP/2 connection each).
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// (block, replica) entries per agent, over all its streams.
    #[arg(long, default_value_t = 20_000)]
    entries_per_agent: usize,
    /// Engine streams (GPUs) per agent.
    #[arg(long, default_value_t = 8)]
    streams_per_agent: usize,
    /// Tenants (namespaces) the nodes are spread over.
    #[arg(long, default_value_t = 16)]
    tenants: usize,
    /// Blocks of each tenant's shared system prompt (held by all its replicas).
    #[arg(long, default_value_t = 32)]
    shared_prefix: usize,
    /// Blocks per prompt after the shared prefix.
    #[arg(long, default_value_t = 32)]
    seq_blocks: usize,
    /// LookupRoute calls per second during the run.
    #[arg(long, default_value_t = 200)]
    lookup_rate: u32,
    /// Churn phase: replace one prompt per stream every this many ms (0 = skip the phase).
    #[arg(long, default_value_t = 0)]
    churn_every_ms: u64,
    /// Seconds the churn phase runs.
    #[arg(long, default_value_t = 10)]
    churn_seconds: u64,
    /// Skip the restart storm.
    #[arg(long)]
    no_restart: bool,
    /// Seconds to wait for convergence before the run fails.
    #[arg(long, default_value_t = 300)]
    converge_timeout: u64,
    /// The controller binary (default: ic-controller next to this binary).
    #[arg(long)]
    controller_bin: Option<PathBuf>,
    /// gRPC port of the controller.
    #[arg(long, default_value_t = 50151)]
    grpc_port: u16,
    /// HTTP port of the controller.
    #[arg(long, default_value_t = 50180)]
    http_port: u16,
    /// Controller log file.
    #[arg(long, default_value = "/tmp/ic-fleet-controller.log")]
    controller_log: PathBuf,
    /// Print the table header first.
    #[arg(long)]
    header: bool,
    /// Also write one JSON object per run to stderr.
    #[arg(long)]
    json: bool,
    /// Nice value of the simulated agents' runtime threads (0..=19). On a fleet the agents run on
    /// their own nodes; on one machine they share the cores with the controller and the gateway
    /// (which stay at the caller's priority), and a positive value lets those two run first.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    agents_nice: i32,
    /// Run the simulated agents' runtime threads at SCHED_IDLE: on a fleet the agents run on
    /// their own nodes; on one machine a normal thread of the controller or the gateway that
    /// wakes preempts them at once (a nice value does not), and the agents take the CPU those
    /// leave. docs/scaling.md "Fourteenth session".
    #[arg(long)]
    agents_idle: bool,
    /// Write every lookup sample (`sent_ms rtt_us verdict`, one per line) to this file at the end.
    #[arg(long)]
    samples_out: Option<PathBuf>,
}

/// Memory, time and lookup figures of one run.
#[derive(Debug, Default)]
struct Report {
    entries: u64,
    empty_rss_kib: u64,
    cold_converge_s: f64,
    cold_cpu: CpuTimes,
    steady_rss_kib: u64,
    cold_hwm_kib: u64,
    quiet: lookups::Window,
    churn_ops_per_s: f64,
    churn_cpu_frac: f64,
    churn_lookups: lookups::Window,
    down_s: f64,
    ready_s: f64,
    storm_converge_s: f64,
    storm_cpu: CpuTimes,
    storm_hwm_kib: u64,
    storm: lookups::Window,
    dropped: u64,
    connect_failures_after_ready: u64,
    resync_requests: u64,
    load_cold: String,
    load_storm: String,
    /// `TcpExt: ListenOverflows` during the cold start and the storm (the machine's).
    cold_listen_overflows: Option<u64>,
    storm_listen_overflows: Option<u64>,
    /// The controller's index heap by part (`…_index_heap_bytes`) once converged.
    steady_heap: Vec<(String, f64)>,
    /// The controller's own `LookupRoute` latency (read-lock wait and walk, no transport) in
    /// the quiet window, and from the restart to convergence.
    quiet_server: Option<ServerLatency>,
    storm_server: Option<ServerLatency>,
    /// The restarted controller's write-lock holds until convergence: resync slices, delta
    /// batches.
    storm_slice_holds: Option<ServerLatency>,
    storm_delta_holds: Option<ServerLatency>,
    /// The restarted controller's lookups' read-lock waits until convergence.
    storm_lock_waits: Option<ServerLatency>,
}

/// What one of the controller's histograms says of the observations between two scrapes: how
/// many, the share within 1 ms, the bucket bound the 99th percentile falls under, and the bound
/// of the highest bucket that gained any.
#[derive(Debug, Clone, Copy, Default)]
struct ServerLatency {
    count: f64,
    within_1ms: f64,
    p99_le_s: f64,
    max_le_s: f64,
}

/// The controller's LookupRoute latency (read-lock wait + walk).
const LOOKUP_SECONDS: &str = "inferencecache_controller_lookup_duration_seconds";
/// The part of the controller's lookups spent waiting for the read lock.
const LOCK_WAIT_SECONDS: &str = "inferencecache_controller_lookup_lock_wait_seconds";
/// The controller's index write-lock holds, by `what`.
const WRITE_HOLD_SECONDS: &str = "inferencecache_controller_index_write_hold_seconds";

impl ServerLatency {
    /// Histogram `name` (series with `labels`, e.g. `what="deltas"`, or "" for none) between
    /// two scrapes of one controller (`m0` the earlier; an empty map for a controller that
    /// started with empty counters).
    fn between(
        m0: &std::collections::HashMap<String, f64>,
        m1: &std::collections::HashMap<String, f64>,
        name: &str,
        labels: &str,
    ) -> Option<Self> {
        let at = |k: &str| m1.get(k).copied().unwrap_or(0.0) - m0.get(k).copied().unwrap_or(0.0);
        let (count_key, bucket_prefix) = if labels.is_empty() {
            (format!("{name}_count"), format!("{name}_bucket{{le=\""))
        } else {
            (
                format!("{name}_count{{{labels}}}"),
                format!("{name}_bucket{{{labels},le=\""),
            )
        };
        let count = at(&count_key);
        let mut buckets: Vec<(f64, f64)> = m1
            .keys()
            .filter_map(|k| {
                let le = k.strip_prefix(&bucket_prefix)?.strip_suffix("\"}")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, at(k)))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let within_1ms = buckets
            .iter()
            .find(|(le, _)| (*le - 0.001).abs() < 1e-12)
            .map_or(0.0, |(_, c)| *c);
        let p99_le_s = buckets
            .iter()
            .find(|(_, c)| *c >= 0.99 * count)
            .map_or(f64::INFINITY, |(le, _)| *le);
        let max_le_s = buckets
            .iter()
            .find(|(_, c)| *c >= count)
            .map_or(f64::INFINITY, |(le, _)| *le);
        (count > 0.0).then_some(ServerLatency {
            count,
            within_1ms: within_1ms / count,
            p99_le_s,
            max_le_s,
        })
    }

    /// One line for stderr beside the table row: `what` of `agents` agents.
    fn line(&self, agents: usize, what: &str) -> String {
        format!(
            "ic-fleet: {agents} agents, {what}: {:.0}, {:.2} % within 1 ms, p99 ≤ {} ms, max ≤ {} ms",
            self.count,
            self.within_1ms * 100.0,
            self.p99_le_s * 1e3,
            self.max_le_s * 1e3
        )
    }
}

fn gib(kib: u64) -> f64 {
    kib as f64 / (1024.0 * 1024.0)
}

/// Switches the calling thread to `SCHED_IDLE` (`--agents-idle`). Linux schedules policies per
/// thread, so only the thread that calls it changes; threads it creates later inherit it (the
/// controller and the gateway are started from the main thread, which stays normal).
///
/// Errors: the kernel's (`EPERM` where a seccomp or LSM policy forbids it).
fn lower_this_thread_to_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(2) on the calling thread (pid 0) reads `param`, a valid local.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn main() {
    let args = Args::parse();
    let nice = args.agents_nice;
    let idle = args.agents_idle;
    // The simulated agents run on a runtime of their own (at `--agents-nice` / `--agents-idle`);
    // the orchestration — controller start and restart, convergence polls, scrapes, clocks —
    // on a normal-class current-thread runtime, so a lowered agent runtime never delays it.
    let agents_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(move || {
            if idle {
                if let Err(e) = lower_this_thread_to_idle() {
                    eprintln!("ic-fleet: an agent thread could not switch to SCHED_IDLE: {e}");
                }
            }
            if nice > 0 {
                // SAFETY: setpriority(2) on the calling thread (who = 0); no memory is touched.
                // Linux applies a nice value per thread, so only this runtime's threads change.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
            }
        })
        .build();
    let main_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    match (agents_rt, main_rt) {
        (Ok(agents_rt), Ok(main_rt)) => {
            main_rt.block_on(run_main(args, agents_rt.handle().clone()));
        }
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("ic-fleet: the runtime did not start: {e}");
            std::process::exit(1);
        }
    }
}

async fn run_main(args: Args, agents_rt: tokio::runtime::Handle) {
    if args.header {
        println!("| agents | streams | entries | empty RSS | cold converge s | cold ctrl CPU s | steady RSS GiB | B/entry | cold peak GiB | quiet lookup p50/p99 µs | churn block-ops/s | churn ctrl CPU | restart: ready s | converged s | storm ctrl CPU s | storm peak GiB | storm lookup p50/p99/max µs | storm exact/no-hint/wrong/errors | dropped | listen overflows (cold/storm) | load (cold/storm) |");
        println!(
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
    }
    match run(&args, &agents_rt).await {
        Ok(r) => print_row(&args, &r),
        Err(e) => {
            eprintln!("ic-fleet: {e}");
            std::process::exit(1);
        }
    }
}

/// The gauge series of replicas reading Exact.
const EXACT_SERIES: &str =
    "inferencecache_controller_index_replicas_by_coverage{coverage=\"Exact\"}";

/// Polls the controller until every agent is connected, every entry indexed and every stream
/// Exact; returns the elapsed time since `since`.
async fn converge(
    cmd: &ControllerCmd,
    ctl: &mut Controller,
    fleet: &Fleet,
    since: Instant,
    limit: Duration,
) -> Result<Duration, String> {
    let want = fleet.spec.total_entries() as f64;
    let agents = fleet.spec.agents as f64;
    let streams = (fleet.spec.agents * fleet.spec.streams_per_agent) as f64;
    loop {
        if since.elapsed() > limit {
            let m = cmd.metrics().await.unwrap_or_default();
            return Err(format!(
                "not converged within {limit:?}: entries {:?} of {want}, agents {:?} of {agents}, Exact streams {:?} of {streams}; agent errors {:?}",
                m.get("inferencecache_controller_index_entries"),
                m.get("inferencecache_controller_agents_connected"),
                m.get(EXACT_SERIES),
                fleet.stats.errors.lock()
            ));
        }
        if !ctl.alive() {
            return Err(format!("the controller exited (see {})", cmd.log.display()));
        }
        if let Ok(m) = cmd.metrics().await {
            let entries = m.get("inferencecache_controller_index_entries").copied();
            let connected = m.get("inferencecache_controller_agents_connected").copied();
            // Every stream Exact: no resync is still being applied (Partial / ResyncApplying).
            let exact = m.get(EXACT_SERIES).copied();
            if entries == Some(want) && connected == Some(agents) && exact == Some(streams) {
                return Ok(since.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run(args: &Args, agents_rt: &tokio::runtime::Handle) -> Result<Report, String> {
    let spec = FleetSpec::new(
        args.agents,
        args.entries_per_agent,
        args.streams_per_agent,
        args.tenants,
        args.shared_prefix,
        args.seq_blocks,
    );
    if spec.streams_per_agent * spec.entries_per_stream() > MAX_RESYNC_ENTRIES {
        return Err(format!(
            "{} entries per agent is above the controller's default --max-resync-entries of {}",
            spec.streams_per_agent * spec.entries_per_stream(),
            MAX_RESYNC_ENTRIES
        ));
    }
    let fleet = Fleet::new(spec);
    let grpc = SocketAddr::from(([127, 0, 0, 1], args.grpc_port));
    let http = SocketAddr::from(([127, 0, 0, 1], args.http_port));
    let cmd = ControllerCmd {
        bin: args
            .controller_bin
            .clone()
            .unwrap_or_else(controller::default_bin),
        grpc,
        http,
        // One connection per agent, plus the lookup client and headroom (docs/scaling.md).
        max_connections: args.agents + 64,
        log: args.controller_log.clone(),
    };
    let limit = Duration::from_secs(args.converge_timeout);
    let mut r = Report {
        entries: fleet.spec.total_entries(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut ctl = cmd.spawn()?;
    cmd.wait_ready(Duration::from_secs(30)).await?;
    r.empty_rss_kib = rss_kib(ctl.pid).0;

    // Cold start: every agent connects to an empty controller.
    let url = format!("http://{grpc}");
    let cpu0 = cpu_times(ctl.pid);
    let lo0 = listen_overflows();
    let cold = Instant::now();
    for a in 0..fleet.spec.agents {
        agents_rt.spawn(agents::run_agent(fleet.clone(), a, url.clone()));
    }
    r.cold_converge_s = converge(&cmd, &mut ctl, &fleet, cold, limit)
        .await?
        .as_secs_f64();
    r.cold_cpu = cpu_times(ctl.pid).since(cpu0);
    r.cold_listen_overflows = listen_overflows()
        .zip(lo0)
        .map(|(a, b)| a.saturating_sub(b));
    r.load_cold = load_average();
    tokio::time::sleep(Duration::from_secs(2)).await;
    (r.steady_rss_kib, r.cold_hwm_kib) = rss_kib(ctl.pid);
    r.steady_heap = cmd
        .metrics()
        .await
        .map(|m| {
            let mut v: Vec<(String, f64)> = m
                .into_iter()
                .filter(|(k, _)| k.starts_with("inferencecache_controller_index_heap_bytes{"))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        })
        .unwrap_or_default();

    let samples = Arc::new(Mutex::new(Vec::new()));
    // The gateway is its own process: its lookups run on a runtime and OS thread of their own,
    // so the round trips measure the controller, not this generator's thousands of agent tasks.
    {
        let (fleet, url, rate, samples) = (
            fleet.clone(),
            url.clone(),
            args.lookup_rate,
            samples.clone(),
        );
        std::thread::Builder::new()
            .name("gateway".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(lookups::run(fleet, url, rate, t0, samples)),
                    Err(e) => eprintln!("ic-fleet: the gateway runtime did not start: {e}"),
                }
            })
            .map_err(|e| format!("gateway thread: {e}"))?;
    }
    let q0 = t0.elapsed();
    let mq0 = cmd.metrics().await.unwrap_or_default();
    tokio::time::sleep(Duration::from_secs(3)).await;
    r.quiet = lookups::window(&samples.lock(), q0, t0.elapsed());
    r.quiet_server = cmd
        .metrics()
        .await
        .ok()
        .and_then(|m| ServerLatency::between(&mq0, &m, LOOKUP_SECONDS, ""));

    if args.churn_every_ms > 0 {
        let m0 = cmd.metrics().await?;
        let c0 = cpu_times(ctl.pid);
        let w0 = t0.elapsed();
        let started = Instant::now();
        fleet
            .churn_every_ms
            .store(args.churn_every_ms, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(args.churn_seconds)).await;
        fleet.churn_every_ms.store(0, Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64();
        let m1 = cmd.metrics().await?;
        let applied = |m: &std::collections::HashMap<String, f64>| {
            m.get("inferencecache_controller_kv_deltas_applied_total")
                .copied()
                .unwrap_or(0.0)
        };
        // Each delta removes one prompt and stores one: 2 × seq_blocks block ops.
        r.churn_ops_per_s =
            (applied(&m1) - applied(&m0)) * 2.0 * fleet.spec.seq_blocks as f64 / secs;
        r.churn_cpu_frac = cpu_times(ctl.pid).since(c0).total() / secs;
        r.churn_lookups = lookups::window(&samples.lock(), w0, t0.elapsed());
        // Let the last batches land before the restart counts entries.
        converge(&cmd, &mut ctl, &fleet, Instant::now(), limit).await?;
    }

    if !args.no_restart {
        let ended0 = fleet.stats.ended.load(Ordering::Relaxed);
        let down = Instant::now();
        ctl.stop().await?;
        r.down_s = down.elapsed().as_secs_f64();
        // Every stream of the old process has ended before the new one starts (an agent may
        // also have reconnected to the stopping process and ended again: at least one end each).
        while fleet.stats.connected.load(Ordering::Relaxed) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ended1 = fleet.stats.ended.load(Ordering::Relaxed);
        if ended1 - ended0 < fleet.spec.agents as u64 {
            return Err(format!(
                "{} streams ended at the restart, expected {}",
                ended1 - ended0,
                fleet.spec.agents
            ));
        }
        let lo0 = listen_overflows();
        let mut ctl2 = cmd.spawn()?;
        let spawned = ctl2.started;
        let cpu0 = cpu_times(ctl2.pid);
        r.ready_s = cmd.wait_ready(Duration::from_secs(30)).await?.as_secs_f64();
        let ready_at = t0.elapsed();
        let fails0 = fleet.stats.connect_failures.load(Ordering::Relaxed);
        r.storm_converge_s = converge(&cmd, &mut ctl2, &fleet, spawned, limit)
            .await?
            .as_secs_f64();
        let conv_at = t0.elapsed();
        r.storm_cpu = cpu_times(ctl2.pid).since(cpu0);
        r.storm_listen_overflows = listen_overflows()
            .zip(lo0)
            .map(|(a, b)| a.saturating_sub(b));
        r.load_storm = load_average();
        r.storm_hwm_kib = rss_kib(ctl2.pid).1;
        r.connect_failures_after_ready =
            fleet.stats.connect_failures.load(Ordering::Relaxed) - fails0;
        r.dropped = fleet.stats.ended.load(Ordering::Relaxed) - ended1;
        r.storm = lookups::window(&samples.lock(), ready_at, conv_at);
        if let Ok(m) = cmd.metrics().await {
            let none = Default::default();
            r.storm_server = ServerLatency::between(&none, &m, LOOKUP_SECONDS, "");
            r.storm_slice_holds =
                ServerLatency::between(&none, &m, WRITE_HOLD_SECONDS, "what=\"resync_slice\"");
            r.storm_delta_holds =
                ServerLatency::between(&none, &m, WRITE_HOLD_SECONDS, "what=\"deltas\"");
            r.storm_lock_waits = ServerLatency::between(&none, &m, LOCK_WAIT_SECONDS, "");
        }
        ctl = ctl2;
    }
    if let Some(path) = &args.samples_out {
        let text: String = samples
            .lock()
            .iter()
            .map(|s| format!("{} {} {:?}\n", s.at.as_millis(), s.rtt_us, s.verdict))
            .collect();
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    r.resync_requests = fleet.stats.resync_requests.load(Ordering::Relaxed);
    fleet.stop.store(true, Ordering::Relaxed);
    let _ = ctl.stop().await;
    if args.json {
        eprintln!("{}", json(args, &r, &fleet));
    }
    Ok(r)
}

fn json(args: &Args, r: &Report, fleet: &Fleet) -> String {
    let w = |w: &lookups::Window| {
        serde_json::json!({"answered": w.answered, "errors": w.errors, "exact": w.exact,
            "no_hint": w.no_hint, "wrong": w.wrong, "p50_us": w.p50_us, "p99_us": w.p99_us,
            "max_us": w.max_us})
    };
    serde_json::json!({
        "agents": args.agents, "streams_per_agent": args.streams_per_agent,
        "entries": r.entries, "empty_rss_kib": r.empty_rss_kib,
        "cold_converge_s": r.cold_converge_s, "cold_cpu_s": r.cold_cpu.total(),
        "cold_cpu_user_s": r.cold_cpu.user, "cold_cpu_system_s": r.cold_cpu.system,
        "steady_rss_kib": r.steady_rss_kib, "cold_hwm_kib": r.cold_hwm_kib,
        "quiet": w(&r.quiet), "churn_ops_per_s": r.churn_ops_per_s,
        "churn_cpu_frac": r.churn_cpu_frac, "churn_lookups": w(&r.churn_lookups),
        "down_s": r.down_s, "ready_s": r.ready_s, "storm_converge_s": r.storm_converge_s,
        "storm_cpu_s": r.storm_cpu.total(), "storm_cpu_user_s": r.storm_cpu.user,
        "storm_cpu_system_s": r.storm_cpu.system, "storm_hwm_kib": r.storm_hwm_kib, "storm": w(&r.storm),
        "dropped": r.dropped, "connect_failures_after_ready": r.connect_failures_after_ready,
        "resync_requests": r.resync_requests,
        "batches_sent": fleet.stats.batches_sent.load(Ordering::Relaxed),
        "batches_acked": fleet.stats.batches_acked.load(Ordering::Relaxed),
        "agent_errors": fleet.stats.errors.lock().clone(),
        "load_cold": r.load_cold, "load_storm": r.load_storm,
        "cold_listen_overflows": r.cold_listen_overflows,
        "storm_listen_overflows": r.storm_listen_overflows,
        "steady_heap_bytes": r.steady_heap.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
        "connects": fleet.stats.connects.load(Ordering::Relaxed),
        "quiet_server_within_1ms": r.quiet_server.map(|s| s.within_1ms),
        "quiet_server_p99_le_s": r.quiet_server.map(|s| s.p99_le_s),
        "storm_server_lookups": r.storm_server.map(|s| s.count),
        "storm_server_within_1ms": r.storm_server.map(|s| s.within_1ms),
        "storm_server_p99_le_s": r.storm_server.map(|s| s.p99_le_s),
        "storm_slice_holds_p99_le_s": r.storm_slice_holds.map(|s| s.p99_le_s),
        "storm_slice_holds_max_le_s": r.storm_slice_holds.map(|s| s.max_le_s),
        "storm_delta_holds_p99_le_s": r.storm_delta_holds.map(|s| s.p99_le_s),
        "storm_lock_waits_within_1ms": r.storm_lock_waits.map(|s| s.within_1ms),
        "connect_failures": fleet.stats.connect_failures.load(Ordering::Relaxed),
    })
    .to_string()
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "?".into(), |v| v.to_string())
}

fn print_row(args: &Args, r: &Report) {
    let churn = if args.churn_every_ms > 0 {
        (
            format!("{:.2} M", r.churn_ops_per_s / 1e6),
            format!("{:.0} %", r.churn_cpu_frac * 100.0),
        )
    } else {
        ("–".into(), "–".into())
    };
    let storm = |s: String| if args.no_restart { "–".into() } else { s };
    let overflows = format!(
        "{}/{}",
        opt(r.cold_listen_overflows),
        opt(r.storm_listen_overflows)
    );
    println!(
        "| {} | {} | {:.1} M | {:.0} MiB | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{} |",
        args.agents,
        args.agents * args.streams_per_agent,
        r.entries as f64 / 1e6,
        r.empty_rss_kib as f64 / 1024.0,
        r.cold_converge_s,
        r.cold_cpu.total(),
        gib(r.steady_rss_kib),
        (r.steady_rss_kib.saturating_sub(r.empty_rss_kib) * 1024) as f64 / r.entries.max(1) as f64,
        gib(r.cold_hwm_kib),
        r.quiet.p50_us,
        r.quiet.p99_us,
        churn.0,
        churn.1,
        storm(format!("{:.2}", r.ready_s)),
        storm(format!("{:.1}", r.storm_converge_s)),
        storm(format!("{:.1}", r.storm_cpu.total())),
        storm(format!("{:.2}", gib(r.storm_hwm_kib))),
        storm(format!("{}/{}/{}", r.storm.p50_us, r.storm.p99_us, r.storm.max_us)),
        storm(format!(
            "{}/{}/{}/{}",
            r.storm.exact, r.storm.no_hint, r.storm.wrong, r.storm.errors
        )),
        storm(r.dropped.to_string()),
        overflows,
        r.load_cold,
        if r.load_storm.is_empty() { "–" } else { r.load_storm.as_str() },
    );
    // Beside the row (stderr): the controller's CPU split. System time is system calls and
    // page faults; on a VM that backs guest memory on first touch it dominates the cold start
    // (docs/scaling.md "Why the cold start is slower than the storm").
    eprintln!(
        "ic-fleet: {} agents, controller CPU user / system: cold {:.1} / {:.1} s{}",
        args.agents,
        r.cold_cpu.user,
        r.cold_cpu.system,
        if args.no_restart {
            String::new()
        } else {
            format!(
                ", storm {:.1} / {:.1} s",
                r.storm_cpu.user, r.storm_cpu.system
            )
        }
    );
    // Beside the row (stderr): the controller's own share of the round trips.
    for (what, s) in [
        (
            "quiet, controller-side lookups (read-lock wait + walk)",
            r.quiet_server,
        ),
        (
            "storm, controller-side lookups (read-lock wait + walk)",
            r.storm_server,
        ),
        (
            "storm, controller-side lookups' read-lock waits",
            r.storm_lock_waits,
        ),
        (
            "storm, write-lock holds of resync slices",
            r.storm_slice_holds,
        ),
        (
            "storm, write-lock holds of delta batches",
            r.storm_delta_holds,
        ),
    ] {
        if let Some(s) = s {
            eprintln!("{}", s.line(args.agents, what));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// `--agents-idle` lowers only the thread that asks: a thread it creates afterwards
    /// inherits the class, the caller's other threads keep theirs.
    #[test]
    fn agents_idle_lowers_only_the_calling_thread() {
        // SAFETY (both calls): sched_getscheduler(2) with pid 0 reads no memory of ours.
        let policy = || unsafe { libc::sched_getscheduler(0) };
        let (lowered, inherited) = std::thread::spawn(move || {
            lower_this_thread_to_idle().unwrap();
            let child = std::thread::spawn(policy).join().unwrap();
            (policy(), child)
        })
        .join()
        .unwrap();
        assert_eq!(lowered, libc::SCHED_IDLE);
        assert_eq!(inherited, libc::SCHED_IDLE);
        assert_ne!(policy(), libc::SCHED_IDLE, "the caller keeps its class");
    }

    /// The controller's own `/metrics` text (its `ControllerMetrics`), scraped twice: the
    /// lookups between the scrapes are counted, their share within 1 ms and the p99's bucket.
    #[test]
    fn server_latency_reads_the_controllers_histogram_between_two_scrapes() {
        let m = ic_controller::metrics::ControllerMetrics::new().unwrap();
        // Before the first scrape: 50 slow lookups that must not count.
        for _ in 0..50 {
            m.lookup_duration_seconds.observe(0.04);
        }
        let m0 = controller::parse_metrics(&m.render());
        // Between the scrapes: 97 within 1 ms, 2 in (1 ms, 2.5 ms], 1 in (2.5 ms, 5 ms].
        for _ in 0..97 {
            m.lookup_duration_seconds.observe(0.000_3);
        }
        for _ in 0..2 {
            m.lookup_duration_seconds.observe(0.002);
        }
        m.lookup_duration_seconds.observe(0.004);
        let m1 = controller::parse_metrics(&m.render());
        let s = ServerLatency::between(&m0, &m1, LOOKUP_SECONDS, "").unwrap();
        assert_eq!(s.count, 100.0);
        assert!((s.within_1ms - 0.97).abs() < 1e-9, "{}", s.within_1ms);
        assert!((s.p99_le_s - 0.0025).abs() < 1e-12, "{}", s.p99_le_s);
        // From an empty map (a controller that started with empty counters): everything.
        let all = ServerLatency::between(&HashMap::new(), &m1, LOOKUP_SECONDS, "").unwrap();
        assert_eq!(all.count, 150.0);
        assert!((all.p99_le_s - 0.05).abs() < 1e-12, "{}", all.p99_le_s);
        // No lookup between the scrapes: nothing to say.
        assert!(ServerLatency::between(&m1, &m1, LOOKUP_SECONDS, "").is_none());
        assert!((s.max_le_s - 0.005).abs() < 1e-12, "{}", s.max_le_s);
        // A labelled histogram: the write-lock holds of one `what`.
        let holds = &m.index_write_hold_seconds;
        holds.with_label_values(&["deltas"]).observe(0.000_02);
        holds.with_label_values(&["resync_slice"]).observe(0.000_2);
        holds.with_label_values(&["resync_slice"]).observe(0.03);
        let m2 = controller::parse_metrics(&m.render());
        let slices =
            ServerLatency::between(&m1, &m2, WRITE_HOLD_SECONDS, "what=\"resync_slice\"").unwrap();
        assert_eq!(slices.count, 2.0);
        assert!((slices.within_1ms - 0.5).abs() < 1e-9);
        assert!(
            (slices.max_le_s - 0.05).abs() < 1e-12,
            "{}",
            slices.max_le_s
        );
    }
}
