//! The in-process standalone controller and the small helpers the KV end-to-end tests share
//! (`kv_restart`, `kv_subscribe`, `standalone_stack`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_controller::standalone::{self, StandaloneConfig};
use ic_controller::state::{LookupPolicy, Shared};

/// A golden KV-event recording of the repository's `testdata/kv-events`.
pub fn kv_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/kv-events")
        .join(name)
}

/// A loopback TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A standalone controller running in this process (`ic_controller::standalone`).
pub struct Controller {
    /// Its gRPC address (AgentService, RouterService).
    pub grpc: SocketAddr,
    /// Its HTTP address (/v1/nodes, /snapshot, …).
    pub http: SocketAddr,
    /// Its index and registries.
    pub shared: Arc<Shared>,
    stop: tokio::sync::watch::Sender<bool>,
    done: tokio::task::JoinHandle<()>,
}

impl Controller {
    /// Stops it and waits (at most 10 s) until it has drained its streams and exited.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        tokio::time::timeout(Duration::from_secs(10), self.done)
            .await
            .expect("controller drains and stops")
            .unwrap();
    }
}

/// Starts a standalone controller with its gRPC server on `grpc` (HTTP on an ephemeral port).
/// Retries for up to 5 s: after a stop the port may take a moment to be free again.
pub async fn start_controller(grpc: SocketAddr) -> Controller {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut attempt = 0;
    let running = loop {
        let mut rx = stopped.clone();
        match standalone::start(
            StandaloneConfig {
                grpc_addr: grpc,
                http_addr: "127.0.0.1:0".parse().unwrap(),
                agent_expiry: Duration::from_secs(60),
                policy: LookupPolicy::default(),
                limits: Default::default(),
                allow_unauthenticated_non_loopback: false,
                tokenizers: Default::default(),
            },
            async move {
                let _ = rx.wait_for(|s| *s).await;
            },
        )
        .await
        {
            Ok(r) => break r,
            Err(e) if attempt < 50 => {
                attempt += 1;
                eprintln!("controller start: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("controller start: {e}"),
        }
    };
    let (grpc, http, shared) = (running.grpc_addr, running.http_addr, running.shared.clone());
    let done = tokio::spawn(async move { running.wait().await.unwrap() });
    Controller {
        grpc,
        http,
        shared,
        stop,
        done,
    }
}

/// Polls `f` every 25 ms until it holds; panics naming `what` after `limit`.
pub async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out after {limit:?} waiting for {what}");
}
