//! A node agent's stream into the controller's real gRPC ingest (`AgentService.Connect` over
//! loopback), for the integration tests that feed the in-process index the way an agent does:
//! Hello, a Resync of its engines' streams, then reports.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use ic_controller::ingest::AgentIngest;
use ic_controller::state::Shared;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient,
    agent_service_server::AgentServiceServer, AgentMessage, BlockEntry, Resync, StreamDescriptor,
    StreamSnapshot,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};

/// The controller's agent ingest on a loopback port; returns its gRPC URL.
pub async fn serve_ingest(shared: Arc<Shared>) -> String {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServiceServer::new(AgentIngest::new(shared)))
            .serve_with_incoming(TcpListenerStream::new(grpc)),
    );
    format!("http://{addr}")
}

/// What the engines of one test run: their streams' descriptor fields and block entries.
pub struct Engines {
    pub namespace: &'static str,
    pub model: &'static str,
    pub hash_scheme: &'static str,
    /// `namespace/name` of the CacheBackend that wired them.
    pub backend: &'static str,
    pub block_size: u32,
    /// Content key of the first pod's one block; the i-th pod holds `key_base + i`.
    pub key_base: u64,
}

impl Engines {
    /// The descriptor of `pod`'s rank-0 stream (`namespace/pod#0`).
    pub fn descriptor(&self, pod: &str) -> StreamDescriptor {
        StreamDescriptor {
            stream_id: format!("{}/{pod}#0", self.namespace),
            replica: pod.to_string(),
            tenant: self.namespace.to_string(),
            model: self.model.into(),
            hash_scheme: self.hash_scheme.into(),
            backend: self.backend.into(),
            ..Default::default()
        }
    }

    /// A Resync of `pods`' streams, one T1 block each, last event at `last_event_ms`.
    pub fn resync(&self, pods: &[&str], last_event_ms: i64) -> AgentMessage {
        AgentMessage {
            msg: Some(Msg::Resync(Resync {
                streams: pods
                    .iter()
                    .enumerate()
                    .map(|(i, p)| StreamSnapshot {
                        stream: Some(self.descriptor(p)),
                        entries: vec![BlockEntry {
                            block_size: self.block_size,
                            content_key: self.key_base + i as u64,
                            tier: proto::Tier::T1 as i32,
                            ..Default::default()
                        }],
                        last_event_unix_ms: last_event_ms,
                        ..Default::default()
                    })
                    .collect(),
            })),
        }
    }
}

/// An open agent stream: what the test sends goes to the controller in order.
pub struct AgentStream {
    pub tx: mpsc::Sender<AgentMessage>,
    /// What the controller sends down the stream (acks, plans, resync requests).
    pub inbound: tonic::Streaming<proto::ControllerMessage>,
}

/// Connects to `grpc` as node `node`'s agent: Hello, then `first` (a Resync).
pub async fn connect(grpc: &str, node: &str, first: AgentMessage) -> AgentStream {
    let hello = proto::Hello {
        node: node.into(),
        ..Default::default()
    };
    connect_with(grpc, hello, first).await
}

/// Connects to `grpc` with `hello` (its node, capabilities, token), then sends `first`.
pub async fn connect_with(grpc: &str, hello: proto::Hello, first: AgentMessage) -> AgentStream {
    let channel = tonic::transport::Endpoint::from_shared(grpc.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = AgentServiceClient::new(channel);
    let (tx, rx) = mpsc::channel(16);
    tx.send(AgentMessage {
        msg: Some(Msg::Hello(hello)),
    })
    .await
    .unwrap();
    tx.send(first).await.unwrap();
    let inbound = client
        .connect(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    AgentStream { tx, inbound }
}

/// Polls `f` every 10 ms until it holds; panics naming `what` after 30 s.
pub async fn until(what: &str, mut f: impl FnMut() -> bool) {
    // Generous: these tests share a loaded 2-core machine (and, since the harness moved to the
    // real apiserver, its round trips).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out after 30 s waiting for {what}");
}
