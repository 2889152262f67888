//! An agent "process" for the KV end-to-end tests (`kv_restart`, `kv_faults_vllm`): the real
//! agent runtime on its own tokio runtime, so stopping it stops every task it spawned
//! (subscribers, link streams, the delta pump) and closes its sockets, like a process exit.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ic_agent::checks::{Checks, ChecksConfig};
use ic_agent::kv::persist::StateDir;
use ic_agent::link::LinkConfig;
use ic_agent::runtime::{self, RunConfig};
use ic_agent::state::AgentState;
use ic_shared::plan::NodePlan;

/// A running agent.
pub struct AgentProc {
    rt: Option<tokio::runtime::Runtime>,
    running: runtime::Running,
}

impl AgentProc {
    /// The agent's state (hub, link, metrics).
    pub fn state(&self) -> &Arc<AgentState> {
        &self.running.state
    }

    /// SIGTERM: the agent stops its tasks and keeps its stream state (`--state-dir`).
    pub fn terminate(mut self) {
        self.running.abort();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }

    /// kill -9: everything stops, nothing more is written.
    pub fn kill9(mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Starts an agent for `node` with `plan`, linked to the controller at `grpc` (fast reconnect
/// backoff), keeping stream state in `state_dir` when given, checks every `check_interval`.
pub fn start_agent(
    grpc: SocketAddr,
    node: &str,
    plan: &NodePlan,
    state_dir: Option<&Path>,
    check_interval: Duration,
) -> AgentProc {
    let plan = plan.clone();
    let node = node.to_string();
    let state_dir = state_dir.map(Path::to_path_buf);
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let running = rt.block_on(async {
            let dir = state_dir.as_deref().map(|d| StateDir::open(d).unwrap());
            let state = AgentState::with_state_dir(node, plan, dir).unwrap();
            let mut link = LinkConfig::new(format!("http://{grpc}"));
            link.backoff_initial = Duration::from_millis(100);
            link.backoff_max = Duration::from_millis(300);
            runtime::start(
                RunConfig {
                    link: Some(link),
                    http_addr: "127.0.0.1:0".parse().unwrap(),
                    metrics_addr: None,
                    check_interval,
                    limits: Default::default(),
                    http_bearer_token_file: None,
                },
                state,
                Checks::new(&ChecksConfig::default()),
            )
            .await
            .unwrap()
        });
        AgentProc {
            rt: Some(rt),
            running,
        }
    })
    .join()
    .unwrap()
}
