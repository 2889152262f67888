//! The full `RouterService.LookupRoute` round trip on loopback: the controller's own gRPC server
//! as `ic-controller standalone` builds it (`ic_controller::standalone::start`: connection
//! limits, health, AgentService and RouterService on one tonic server, `Router` over the shared
//! index) on its own runtime of `--grpc-server-threads` (2: what `#[tokio::main]` gives the
//! binary on a 2-core machine) worker threads named `ic-ctl-grpc`, holding the workload's final
//! index; tonic clients in this process over 127.0.0.1:
//!
//! - **latency**: one connection, one request at a time (a current-thread runtime on the calling
//!   thread): p50 / p99 / max per round trip, request encoding to decoded answer;
//! - **throughput**: `conns` HTTP/2 connections × `inflight` requests in flight on each, from a
//!   client runtime of one thread (`ic-gw`), for `seconds`: answers per second, and the server's
//!   CPU per answer (its threads' user + system time, `/proc/self/task`).
//!
//! Every answer is checked against what the same `Router` answers in process for the same
//! request (`Router::lookup`: replicas, order, depths, reason): a round trip that loses or
//! changes anything counts as wrong, and so does one that fails or takes longer than
//! [`REQUEST_LIMIT`].
//!
//! Why an earlier in-bench server "never answered" (issue 18): it served a bare
//! `TcpListener` stream, whose accepted sockets keep Nagle's algorithm on. tonic writes an
//! answer's HEADERS, DATA and trailers as separate small writes; with Nagle the later ones wait
//! for the ACK of the first, which the client delays (Linux delayed ACK, ~40 ms): every round
//! trip took 44 ms (measured, p50 44.0 ms; 149.5 µs with `TCP_NODELAY` on the same listener),
//! so its 24 062 sequential requests would have taken ~18 minutes. The controller's own
//! listeners (`ic_shared::serve::grpc_incoming`, what standalone and in-cluster serve) set
//! `TCP_NODELAY` on every accepted socket; this bench uses exactly that server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_controller::index::LookupQuery;
use ic_controller::router::Router;
use ic_controller::standalone::{self, StandaloneConfig};
use ic_shared::proto::{
    router_service_client::RouterServiceClient, LookupRouteRequest, LookupRouteResponse,
    StreamDelta, StreamSnapshot,
};

use crate::e2e::threads_cpu;
use crate::workload::percentile;

/// A request not answered within this long counts as wrong.
const REQUEST_LIMIT: Duration = Duration::from_secs(2);
/// Thread-name prefixes of the server and the concurrent clients.
const SERVER_THREADS: &str = "ic-ctl-grpc";
const CLIENT_THREADS: &str = "ic-gw";

/// What to run.
#[derive(Debug, Clone)]
pub struct GrpcArgs {
    /// Sequential round trips timed.
    pub rounds: usize,
    /// Connections of the throughput run.
    pub conns: usize,
    /// Requests in flight per connection.
    pub inflight: usize,
    /// Length of the throughput run (s).
    pub seconds: f64,
    /// Worker threads of the server's runtime.
    pub server_threads: usize,
}

impl Default for GrpcArgs {
    fn default() -> Self {
        GrpcArgs {
            rounds: 20_000,
            conns: 4,
            inflight: 8,
            seconds: 3.0,
            server_threads: 2,
        }
    }
}

impl GrpcArgs {
    /// Applies one `--grpc-…` flag.
    pub fn set(&mut self, flag: &str, v: &str) -> Result<(), String> {
        let e = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag {
            "--grpc-rounds" => self.rounds = v.parse().map_err(|x| e(&x))?,
            "--grpc-conns" => self.conns = v.parse().map_err(|x| e(&x))?,
            "--grpc-inflight" => self.inflight = v.parse().map_err(|x| e(&x))?,
            "--grpc-seconds" => self.seconds = v.parse().map_err(|x| e(&x))?,
            "--grpc-server-threads" => self.server_threads = v.parse().map_err(|x| e(&x))?,
            other => return Err(format!("unknown flag {other}")),
        }
        Ok(())
    }
}

/// The `LookupRoute` request a gateway sends for `q` (content keys, as the bench's lookups).
pub fn request(q: &LookupQuery) -> LookupRouteRequest {
    LookupRouteRequest {
        tenant: q.tenant.clone(),
        model: q.model.clone(),
        hash_scheme: q.hash_scheme.clone(),
        adapter: q.adapter.clone(),
        content_keys: q.content_keys.clone(),
        block_size: q.block_size.unwrap_or(0),
        ..Default::default()
    }
}

/// Runs and prints the round-trip rows of the second table (`None`: `--no-grpc`).
pub fn row(
    a: Option<&GrpcArgs>,
    snaps: &[StreamSnapshot],
    deltas: &[StreamDelta],
    queries: &[LookupQuery],
) {
    let Some(a) = a else {
        println!("| `LookupRoute` gRPC round trip | not run (--no-grpc) | | | | | — |");
        return;
    };
    let requests: Vec<LookupRouteRequest> = queries.iter().map(request).collect();
    match run(a, snaps, deltas, &requests) {
        Ok(r) => {
            println!(
                "| `LookupRoute` gRPC round trip on loopback, one connection, sequential (µs; standalone server, {} worker threads, {} entries) | {:.1} | {:.1} | {:.0} | {} round trips | measured | {} |",
                a.server_threads,
                r.entries,
                r.us(50.0),
                r.us(99.0),
                r.us(100.0),
                r.rtt_ns.len(),
                if r.wrong == 0 { "yes" } else { "no: answers differ" }
            );
            println!(
                "| `LookupRoute` lookups/s on loopback, {} connections × {} in flight, client on 1 thread | {:.0} /s | — | — | server CPU {:.1} µs per answer, client {:.1} µs; {} of {} answers differ from the in-process router's | measured | {} |",
                a.conns,
                a.inflight,
                r.per_second,
                r.server_cpu_us,
                r.client_cpu_us,
                r.wrong,
                r.checked,
                if r.wrong == 0 { "yes" } else { "no: answers differ" }
            );
        }
        Err(e) => println!("| `LookupRoute` gRPC round trip | error: {e} | | | | | — |"),
    }
}

/// The measurement.
#[derive(Debug, Default)]
pub struct GrpcReport {
    /// Sequential round trips, sorted ns.
    pub rtt_ns: Vec<u64>,
    /// Answers per second of the throughput run.
    pub per_second: f64,
    /// Server CPU (all its threads) per answer in the throughput run, µs.
    pub server_cpu_us: f64,
    /// Client CPU per answer in the throughput run, µs.
    pub client_cpu_us: f64,
    /// Answers that differ from the in-process answer, failed or timed out (must be 0).
    pub wrong: usize,
    /// Answers checked.
    pub checked: usize,
    /// Entries of the index served.
    pub entries: usize,
}

impl GrpcReport {
    /// Round-trip percentile, µs.
    pub fn us(&self, q: f64) -> f64 {
        percentile(&self.rtt_ns, q) as f64 / 1e3
    }
}

async fn connect(
    addr: SocketAddr,
) -> Result<RouterServiceClient<tonic::transport::Channel>, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("{e}"))?
        .connect_timeout(REQUEST_LIMIT)
        .connect()
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    Ok(RouterServiceClient::new(channel))
}

/// One round trip, `None` when it failed or took longer than [`REQUEST_LIMIT`].
async fn ask(
    client: &mut RouterServiceClient<tonic::transport::Channel>,
    req: &LookupRouteRequest,
) -> Option<LookupRouteResponse> {
    match tokio::time::timeout(REQUEST_LIMIT, client.lookup_route(req.clone())).await {
        Ok(Ok(r)) => Some(r.into_inner()),
        _ => None,
    }
}

/// Starts the standalone server over the workload's final index (`snaps` then `deltas` on node
/// `bench`) and measures (see the module docs).
pub fn run(
    a: &GrpcArgs,
    snaps: &[StreamSnapshot],
    deltas: &[StreamDelta],
    requests: &[LookupRouteRequest],
) -> Result<GrpcReport, String> {
    if requests.is_empty() {
        return Err("no requests".into());
    }
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.server_threads.max(1))
        .thread_name(SERVER_THREADS)
        .enable_all()
        .build()
        .map_err(|e| format!("server runtime: {e}"))?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = server_rt
        .block_on(standalone::start(
            StandaloneConfig::ephemeral(),
            async move {
                let mut rx = stopped;
                let _ = rx.wait_for(|s| *s).await;
            },
        ))
        .map_err(|e| format!("controller: {e}"))?;
    let shared = running.shared.clone();
    {
        let mut ix = shared.index.write();
        ix.resync_node("bench", snaps);
        for d in deltas {
            let _ = ix.apply_delta("bench", d);
        }
        shared.update_index_gauges(&ix);
    }
    let entries = shared.index.read().entry_count();
    // The in-process answer every round trip must reproduce.
    let router = Router::new(shared.clone());
    let expected: Vec<LookupRouteResponse> = requests.iter().map(|r| router.lookup(r)).collect();
    let addr = running.grpc_addr;
    let mut report = GrpcReport {
        entries,
        ..Default::default()
    };

    // Latency: one connection, sequential, driven from this thread.
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("client runtime: {e}"))?;
    client_rt.block_on(async {
        let mut client = connect(addr).await?;
        // Warm-up: the connection's windows, the server's first allocations.
        for req in requests.iter().take(200) {
            let _ = ask(&mut client, req).await;
        }
        let mut rtt = Vec::with_capacity(a.rounds);
        for (req, want) in requests.iter().zip(&expected).cycle().take(a.rounds) {
            let t = Instant::now();
            let got = ask(&mut client, req).await;
            rtt.push(t.elapsed().as_nanos() as u64);
            report.checked += 1;
            if got.as_ref() != Some(want) {
                report.wrong += 1;
            }
        }
        rtt.sort_unstable();
        report.rtt_ns = rtt;
        Ok::<_, String>(())
    })?;

    // Throughput: conns × inflight loops on a one-thread client runtime.
    let gw_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(CLIENT_THREADS)
        .enable_all()
        .build()
        .map_err(|e| format!("client runtime: {e}"))?;
    let requests: Arc<Vec<(LookupRouteRequest, LookupRouteResponse)>> = Arc::new(
        requests
            .iter()
            .cloned()
            .zip(expected.iter().cloned())
            .collect(),
    );
    let seconds = a.seconds;
    let (conns, inflight) = (a.conns.max(1), a.inflight.max(1));
    let (done, wrong, checked, wall, server_cpu, client_cpu) = gw_rt.block_on(async move {
        let mut clients = Vec::with_capacity(conns);
        for _ in 0..conns {
            clients.push(connect(addr).await?);
        }
        let (s0, c0) = (threads_cpu(SERVER_THREADS), threads_cpu(CLIENT_THREADS));
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs_f64(seconds);
        let mut tasks = Vec::new();
        for (c, client) in clients.iter().enumerate() {
            for i in 0..inflight {
                let mut client = client.clone();
                let requests = requests.clone();
                let start = (c * inflight + i) * 7919 % requests.len();
                tasks.push(tokio::spawn(async move {
                    let (mut n, mut wrong) = (0u64, 0u64);
                    for (req, want) in requests.iter().cycle().skip(start) {
                        if Instant::now() >= until {
                            break;
                        }
                        let got = ask(&mut client, req).await;
                        n += 1;
                        if got.as_ref() != Some(want) {
                            wrong += 1;
                        }
                    }
                    (n, wrong)
                }));
            }
        }
        let (mut done, mut wrong) = (0u64, 0u64);
        for t in tasks {
            let (n, w) = t.await.map_err(|e| format!("client task: {e}"))?;
            done += n;
            wrong += w;
        }
        let wall = t0.elapsed().as_secs_f64();
        let (s1, c1) = (threads_cpu(SERVER_THREADS), threads_cpu(CLIENT_THREADS));
        Ok::<_, String>((done, wrong, done, wall, s1 - s0, c1 - c0))
    })?;
    report.per_second = done as f64 / wall.max(1e-9);
    report.server_cpu_us = server_cpu * 1e6 / (done.max(1) as f64);
    report.client_cpu_us = client_cpu * 1e6 / (done.max(1) as f64);
    report.wrong += wrong as usize;
    report.checked += checked as usize;
    gw_rt.shutdown_background();
    let _ = stop.send(true);
    server_rt.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(5), running.wait()).await;
    });
    Ok(report)
}
