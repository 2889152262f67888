//! A frozen agent's replicas stop routing within the coverage heartbeat bound (issue 37 item 2,
//! acceptance "measured"), with the real binaries: `ic-controller standalone`, `ic-agent run`
//! following `ic-agent kv publish` (genuine vLLM 0.24 frames), all on loopback ports the OS
//! picks. The agent is SIGSTOPped — its TCP connection stays open and the kernel still ACKs, so
//! only the missing heartbeats tell — and `LookupRoute` is polled until the replica is no
//! longer matched; the time is printed and must be within the bound (5 s, the default of
//! `--coverage-heartbeat-bound-ms`) plus slack. SIGCONT: the replica is routed again.
//!
//! Before heartbeats the replica stayed Exact and routed until the HTTP/2 keep-alive gave up
//! (~51 s), then Unknown but still routed until the 120 s expiry: this test failed at its 60 s
//! deadline.
//!
//! Binaries: `ic-controller` is this package's (`CARGO_BIN_EXE_ic-controller`); `ic-agent` is
//! taken from the same directory (`cargo test --workspace` builds both; else
//! `cargo build -p ic-agent --bin ic-agent`). `IC_CONTROLLER_BIN` / `IC_AGENT_BIN` override them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ic_shared::proto::{
    router_service_client::RouterServiceClient, Decision, LookupRouteRequest, LookupRouteResponse,
};

/// The default of `--coverage-heartbeat-bound-ms` (the controller runs with its defaults).
const BOUND: Duration = Duration::from_secs(5);
/// The agent's heartbeat interval: its last heartbeat may precede the SIGSTOP by this much.
const INTERVAL: Duration = Duration::from_secs(1);
/// What is allowed beyond the bound: the watcher's period (250 ms), the lookup poll (50 ms)
/// and scheduling on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(2000);

/// Kills (SIGKILL) its process when dropped; SIGCONT first, so a stopped one dies too.
struct Proc {
    child: Child,
    name: &'static str,
    log: PathBuf,
}

impl Proc {
    fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
    }

    /// Panics with the last lines of its log when it has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "{} exited with {status}; last log lines:\n{}",
                self.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signals to our own child's pid.
        unsafe {
            libc::kill(pid, libc::SIGCONT);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(name: &'static str, bin: &Path, args: &[String], dir: &Path) -> Proc {
    let log = dir.join(format!("{name}.log"));
    let out = std::fs::File::create(&log).unwrap();
    let err = out.try_clone().unwrap();
    let child = Command::new(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    Proc { child, name, log }
}

fn binaries() -> (PathBuf, PathBuf) {
    let controller = std::env::var_os("IC_CONTROLLER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ic-controller")));
    let agent = std::env::var_os("IC_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_BIN_EXE_ic-controller")).with_file_name("ic-agent")
        });
    assert!(
        agent.is_file(),
        "{} is missing: build it with `cargo build -p ic-agent --bin ic-agent` (or set IC_AGENT_BIN)",
        agent.display()
    );
    (controller, agent)
}

/// `n` distinct loopback ports free now (held together while chosen).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events/vllm-0.24.0.json")
}

/// LookupRoute for the fixture's first request (tokens 0..31: blocks A0, A1).
async fn lookup(grpc: &str) -> Option<LookupRouteResponse> {
    let channel = tonic::transport::Endpoint::from_shared(grpc.to_string())
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut c = RouterServiceClient::new(channel);
    c.lookup_route(LookupRouteRequest {
        tenant: "default".into(),
        model: "demo-model".into(),
        hash_scheme: "vllm".into(),
        token_ids: (0..32).collect(),
        ..Default::default()
    })
    .await
    .ok()
    .map(|r| r.into_inner())
}

fn routes_the_replica(r: &LookupRouteResponse) -> bool {
    r.decision == Decision::PrefixMatch as i32 && r.replicas.iter().any(|m| m.replica == "vllm-0")
}

/// GET `path` from the controller's HTTP port, as text.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_agents_replicas_stop_routing_within_the_heartbeat_bound() {
    let (controller_bin, agent_bin) = binaries();
    let dir = tempfile::tempdir().unwrap();
    let p = free_ports(5);
    let (grpc_port, http_port, agent_port, pub_port, replay_port) = (p[0], p[1], p[2], p[3], p[4]);
    let grpc = format!("http://127.0.0.1:{grpc_port}");

    let mut controller = spawn(
        "controller",
        &controller_bin,
        &[
            "standalone".into(),
            format!("--grpc-addr=127.0.0.1:{grpc_port}"),
            format!("--http-addr=127.0.0.1:{http_port}"),
        ],
        dir.path(),
    );
    let mut publisher = spawn(
        "publisher",
        &agent_bin,
        &[
            "kv".into(),
            "publish".into(),
            format!("--fixture={}", fixture().display()),
            format!("--endpoint=tcp://127.0.0.1:{pub_port}"),
            format!("--replay-endpoint=tcp://127.0.0.1:{replay_port}"),
            // The state before the recording's final AllBlocksCleared stays.
            "--until-seq=8".into(),
            "--connect-wait-ms=1500".into(),
            "--linger-seconds=600".into(),
        ],
        dir.path(),
    );
    let plan = dir.path().join("plan.json");
    std::fs::write(
        &plan,
        serde_json::json!({
            "engines": [{
                "namespace": "default",
                "pod": "vllm-0",
                "model": "demo-model",
                "hashScheme": "vllm",
                "blockSize": 16,
                "keepsL2": true,
                "kvEvents": [{
                    "endpoint": format!("tcp://127.0.0.1:{pub_port}"),
                    "replayEndpoint": format!("tcp://127.0.0.1:{replay_port}"),
                    "dpRank": 0
                }]
            }]
        })
        .to_string(),
    )
    .unwrap();
    let mut agent = spawn(
        "agent",
        &agent_bin,
        &[
            "run".into(),
            format!("--plan={}", plan.display()),
            format!("--controller={grpc}"),
            format!("--http-addr=127.0.0.1:{agent_port}"),
            "--node=frozen-node".into(),
            "--t2-scrape-interval-seconds=0".into(),
        ],
        dir.path(),
    );

    // The replica is routed, Exact.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        controller.assert_running();
        publisher.assert_running();
        agent.assert_running();
        if let Some(r) = lookup(&grpc).await {
            if let Some(m) = r.replicas.iter().find(|m| m.replica == "vllm-0") {
                if m.coverage == ic_shared::proto::Coverage::Exact as i32 {
                    break;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the replica never became routed and Exact; snapshot: {}",
            http_get(http_port, "/snapshot")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Freeze the agent.
    agent.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let deadline = stopped + Duration::from_secs(60);
    let unrouted = loop {
        let r = lookup(&grpc).await.expect("LookupRoute answers");
        if !routes_the_replica(&r) {
            break stopped.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "the frozen agent's replica is still routed {:?} after SIGSTOP (bound {BOUND:?}): {r:?}",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let snapshot = http_get(http_port, "/snapshot");
    eprintln!(
        "frozen agent: LookupRoute stopped routing its replica {} ms after SIGSTOP (bound {} ms, heartbeat every {} ms)",
        unrouted.as_millis(),
        BOUND.as_millis(),
        INTERVAL.as_millis()
    );
    assert!(
        unrouted <= BOUND + SLACK,
        "stopped routing only {unrouted:?} after SIGSTOP (bound {BOUND:?} + slack {SLACK:?})"
    );
    assert!(
        unrouted + INTERVAL + Duration::from_millis(100) >= BOUND,
        "stopped routing {unrouted:?} after SIGSTOP: before the bound {BOUND:?} (less one heartbeat interval)"
    );
    assert!(
        snapshot.contains(r#""coverageReason":"HeartbeatMissed""#)
            && snapshot.contains(r#""routable":false"#),
        "/snapshot: {snapshot}"
    );

    // Thawed: heard again, routed again with what it reported.
    agent.signal(libc::SIGCONT);
    let thawed = Instant::now();
    let deadline = thawed + Duration::from_secs(60);
    loop {
        let r = lookup(&grpc).await.expect("LookupRoute answers");
        if let Some(m) = r.replicas.iter().find(|m| m.replica == "vllm-0") {
            assert!(
                m.coverage_age_ms
                    .is_some_and(|a| a < BOUND.as_millis() as u64),
                "{m:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the thawed agent's replica is still not routed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "thawed agent: routed again {} ms after SIGCONT",
        thawed.elapsed().as_millis()
    );
    agent.assert_running();
    controller.assert_running();
}
