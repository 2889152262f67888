//! Shared by the agent's integration tests (`engine_metrics`, `sglang_metrics`, `subscribe_cli`,
//! `link_acks`, `link_flush`, `kv_hostile_handshake`, `kv_hostile_zmtp`, `kv_inflight_budget`):
//! a stand-in controller (a real tonic `AgentService` on loopback that records every message an
//! agent sends and lets the test push controller messages down the latest stream), an engine
//! `/metrics` server whose page the test changes, a plain HTTP GET, a one-stream engine plan,
//! a Prometheus sample reader, a free loopback port, a `/proc/<pid>/status` reader and a check
//! that a spawned agent is still alive.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use ic_shared::proto::agent_service_server::{AgentService, AgentServiceServer};
use ic_shared::proto::{controller_message, AgentMessage, ControllerMessage};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// The sending half of the stand-in controller's latest stream.
type DownTx = mpsc::Sender<Result<ControllerMessage, Status>>;
type Down = Pin<Box<dyn Stream<Item = Result<ControllerMessage, Status>> + Send>>;

/// A stand-in controller: records every message, keeps the latest stream's sending half.
#[derive(Clone)]
pub struct FakeController {
    up: mpsc::UnboundedSender<AgentMessage>,
    down: Arc<Mutex<Option<DownTx>>>,
}

#[tonic::async_trait]
impl AgentService for FakeController {
    type ConnectStream = Down;

    async fn connect(
        &self,
        request: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Down>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        *self.down.lock() = Some(tx);
        let up = self.up.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                let _ = up.send(m);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl FakeController {
    /// Serves a stand-in controller on 127.0.0.1 (ephemeral port). Returns it, its gRPC
    /// address, and the receiver of every message agents send it, in order.
    pub async fn start() -> (
        FakeController,
        SocketAddr,
        mpsc::UnboundedReceiver<AgentMessage>,
    ) {
        let (up, received) = mpsc::unbounded_channel();
        let fake = FakeController {
            up,
            down: Arc::new(Mutex::new(None)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(AgentServiceServer::new(fake.clone()))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        (fake, grpc, received)
    }

    /// Sends `msg` down the latest agent stream; panics when no agent has connected.
    pub async fn send(&self, msg: controller_message::Msg) {
        let tx = self.down.lock().clone().expect("an agent is connected");
        tx.send(Ok(ControllerMessage { msg: Some(msg) }))
            .await
            .unwrap();
    }
}

/// `GET path` on `addr` (HTTP/1.1, `Connection: close`): the whole response, head and body.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The engine's `/metrics` body, which a test changes while the agent scrapes it.
pub type Page = Arc<Mutex<String>>;

/// Serves `page` at `/metrics` on loopback (prometheus_client's content type); returns its URL.
pub async fn engine_metrics_server(page: Page) -> String {
    use axum::extract::State;
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(|State(p): State<Page>| async move {
                (
                    [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
                    p.lock().clone(),
                )
            }),
        )
        .with_state(page);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/metrics")
}

/// A running agent that scrapes an engine `/metrics` page every 100 ms and links to a stand-in
/// controller.
pub struct ScrapingAgent {
    /// The agent's state.
    pub state: Arc<ic_agent::state::AgentState>,
    /// The running agent (its HTTP address; abort it at the end).
    pub agent: ic_agent::runtime::Running,
    /// The stand-in controller.
    pub fake: FakeController,
    /// Every message the agent sent.
    pub received: mpsc::UnboundedReceiver<AgentMessage>,
}

/// Serves `page` ([`engine_metrics_server`]) and starts an agent on node `gpu-1` whose plan is
/// `plan_for(<the page's URL>)`.
pub async fn start_scraping_agent(
    page: &Page,
    plan_for: impl FnOnce(String) -> ic_shared::plan::NodePlan,
) -> ScrapingAgent {
    use std::time::Duration;
    let (fake, grpc, received) = FakeController::start().await;
    let url = engine_metrics_server(page.clone()).await;
    let state = ic_agent::state::AgentState::new("gpu-1".into(), plan_for(url)).unwrap();
    let mut link = ic_agent::link::LinkConfig::new(format!("http://{grpc}"));
    link.backoff_max = Duration::from_millis(200);
    let agent = ic_agent::runtime::start_with(
        ic_agent::runtime::RunConfig {
            link: Some(link),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            metrics_addr: None,
            check_interval: Duration::from_secs(3600),
            limits: Default::default(),
            http_bearer_token_file: None,
        },
        state.clone(),
        ic_agent::checks::Checks::with(vec![]),
        ic_agent::engine_metrics::ScrapeConfig {
            interval: Duration::from_millis(100),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    ScrapingAgent {
        state,
        agent,
        fake,
        received,
    }
}

/// The real agent runtime on node `node` following a replayed vLLM 0.26.0 publisher
/// (`testdata/kv-events/vllm-0.26.0.json`, with a replay endpoint, paced by `publish`), linked to
/// the controller at `grpc` with the link settings `link` adjusts. Returns the running agent and
/// the publisher task.
pub async fn agent_following_replay(
    node: &str,
    grpc: SocketAddr,
    publish: ic_agent::kv::publish::PublishOptions,
    link: impl FnOnce(&mut ic_agent::link::LinkConfig),
) -> (
    ic_agent::runtime::Running,
    tokio::task::JoinHandle<
        Result<ic_agent::kv::publish::PublishReport, ic_agent::kv::publish::PublishError>,
    >,
) {
    use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
    use std::time::Duration;
    let free_port = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (pub_port, replay_port) = (free_port(), free_port());
    let recording = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/kv-events/vllm-0.26.0.json");
    let publisher = tokio::spawn(async move {
        ic_agent::kv::publish::publish_fixture(
            &recording,
            &format!("tcp://127.0.0.1:{pub_port}"),
            Some(&format!("tcp://127.0.0.1:{replay_port}")),
            &publish,
        )
        .await
    });
    let plan = NodePlan {
        engines: vec![EnginePlan {
            namespace: "team-a".into(),
            pod: "engine-0".into(),
            model: "model-x".into(),
            hash_scheme: HashScheme::Vllm,
            block_size: 16,
            kv_events: vec![KvEventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
                topic: String::new(),
                dp_rank: 0,
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let state = ic_agent::state::AgentState::new(node.into(), plan).unwrap();
    let mut cfg = ic_agent::link::LinkConfig::new(format!("http://{grpc}"));
    link(&mut cfg);
    let running = ic_agent::runtime::start(
        ic_agent::runtime::RunConfig {
            link: Some(cfg),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            metrics_addr: None,
            check_interval: Duration::from_secs(30),
            limits: Default::default(),
            http_bearer_token_file: None,
        },
        state,
        ic_agent::checks::Checks::new(&ic_agent::checks::ChecksConfig::default()),
    )
    .await
    .unwrap();
    (running, publisher)
}

/// A one-stream engine plan: pod `pod` in namespace `team-a`, model `m`, 16-token blocks,
/// KV events of `hash_scheme` published on `endpoint` (and replayed on `replay_endpoint`).
pub fn kv_engine(
    pod: &str,
    hash_scheme: ic_shared::plan::HashScheme,
    endpoint: String,
    replay_endpoint: Option<String>,
) -> ic_shared::plan::EnginePlan {
    ic_shared::plan::EnginePlan {
        namespace: "team-a".into(),
        pod: pod.into(),
        model: "m".into(),
        hash_scheme,
        block_size: 16,
        kv_events: vec![ic_shared::plan::KvEventSource {
            endpoint,
            replay_endpoint,
            topic: String::new(),
            dp_rank: 0,
        }],
        ..ic_shared::plan::EnginePlan::default()
    }
}

/// Sum of the samples of `name` in a Prometheus text page whose line contains every `needle`.
pub fn sample(text: &str, name: &str, needles: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && needles.iter().all(|n| l.contains(n)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A loopback TCP port that was free a moment ago (bound and released: the caller binds it next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `kB` line of `/proc/<pid>/status` (`"VmHWM:"`, `"VmRSS:"`) in bytes; `pid` may be `"self"`.
pub fn proc_status_bytes(pid: &str, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// Fails with the child's exit status (134 = the abort) and stderr when it is gone.
pub fn assert_alive(child: &mut std::process::Child, stderr: &std::path::Path) {
    if let Some(status) = child.try_wait().unwrap() {
        panic!(
            "the agent died ({status}):\n{}",
            std::fs::read_to_string(stderr).unwrap_or_default()
        );
    }
}
