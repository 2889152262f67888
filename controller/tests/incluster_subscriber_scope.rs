//! Per-pod subscribers against the bare real apiserver (issue 38 items 6 and 8): real
//! TokenRequest tokens bound to real pods on a real Node, reviewed by the apiserver's own
//! TokenReview, over a real loopback gRPC connection.
//!
//! - A subscriber stream is accepted only for an engine pod the controller's node plans know, on
//!   that pod's own token: a non-engine pod of the tenant's namespace (another service account)
//!   is refused, so it cannot outrank the tenant's real engine; before plans were derived the
//!   stream is refused `UNAVAILABLE` (retry); a pod replaced under the planned name (UID differs)
//!   is refused.
//! - A planned pod may report only the data-parallel ranks its plan has.
//! - Garbage tokens from one source address cost at most the per-source burst of TokenReviews;
//!   the rest are refused without one and counted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;
mod incluster_support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bare_apiserver_support::{unique, BareCluster};
use ic_controller::ingest::auth::{
    AgentAuthenticator, CachingVerifier, KubeTokenVerifier, TokenIdentity, TokenVerifier,
    VerifyError, DEFAULT_REVIEW_BURST_PER_SOURCE,
};
use ic_controller::ingest::AgentIngest;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::plan::{EnginePlan, KvEventSource, NodePlan};
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, AgentMessage,
};
use incluster_support::{node, pod, service_account, token, AUDIENCE};
use tokio::net::TcpListener;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Code;

/// Counts the TokenReviews that reach the apiserver.
struct Counting {
    inner: KubeTokenVerifier,
    reviews: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl TokenVerifier for Counting {
    async fn verify(&self, token: &str, audience: &str) -> Result<TokenIdentity, VerifyError> {
        self.reviews.fetch_add(1, Ordering::SeqCst);
        self.inner.verify(token, audience).await
    }
}

async fn serve(bare: &BareCluster) -> (String, Arc<Shared>, Arc<AtomicUsize>) {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let reviews = Arc::new(AtomicUsize::new(0));
    let verifier = Arc::new(CachingVerifier::new(Counting {
        inner: KubeTokenVerifier::new(bare.admin.clone()),
        reviews: reviews.clone(),
    }));
    let auth = Arc::new(
        AgentAuthenticator::new(verifier, AUDIENCE, "ic:agent".parse().unwrap())
            .with_metrics(&shared.metrics.registry)
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentIngest::with_auth(shared.clone(), auth).into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), shared, reviews)
}

async fn open(
    url: &str,
    node: &str,
    ns: &str,
    pod: &str,
    token: &str,
) -> (
    Result<tonic::Streaming<proto::ControllerMessage>, tonic::Status>,
    tokio::sync::mpsc::Sender<AgentMessage>,
) {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = AgentServiceClient::new(channel);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(AgentMessage {
        msg: Some(Msg::Hello(proto::Hello {
            node: node.into(),
            version: "0.1.0".into(),
            token: token.into(),
            pod_subscriber: Some(proto::PodSubscriber {
                namespace: ns.into(),
                pod: pod.into(),
            }),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let resp = client
        .connect(ReceiverStream::new(rx))
        .await
        .map(|r| r.into_inner());
    (resp, tx)
}

fn resync(ns: &str, pod: &str, rank: u32) -> AgentMessage {
    let replica = if rank == 0 {
        pod.to_string()
    } else {
        format!("{pod}#{rank}")
    };
    AgentMessage {
        msg: Some(Msg::Resync(proto::Resync {
            streams: vec![proto::StreamSnapshot {
                stream: Some(proto::StreamDescriptor {
                    stream_id: format!("{ns}/{pod}#{rank}"),
                    replica,
                    dp_rank: rank,
                    tenant: ns.into(),
                    model: "m".into(),
                    hash_scheme: "vllm".into(),
                    ..Default::default()
                }),
                entries: vec![proto::BlockEntry {
                    adapter: String::new(),
                    block_size: 16,
                    content_key: 0xa1,
                    tier: proto::Tier::T1 as i32,
                }],
                ..Default::default()
            }],
        })),
    }
}

fn plan(ns: &str, pod: &str, uid: Option<String>) -> NodePlan {
    NodePlan {
        engines: vec![EnginePlan {
            namespace: ns.into(),
            pod: pod.into(),
            pod_uid: uid,
            kv_events: vec![KvEventSource {
                endpoint: "tcp://127.0.0.1:5557".into(),
                dp_rank: 0,
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

async fn final_status(inbound: &mut tonic::Streaming<proto::ControllerMessage>) -> tonic::Status {
    loop {
        match inbound.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream must end with a status"),
            Err(st) => return st,
        }
    }
}

#[tokio::test]
async fn only_a_planned_engine_pod_on_its_own_token_may_subscribe() {
    let bare = &BareCluster::get().await;
    let ns = bare.namespace("sub-scope").await;
    service_account(bare, &ns, "engine").await;
    service_account(bare, &ns, "other").await;
    let n = unique("node");
    node(bare, &n).await;
    let engine = pod(bare, &ns, "vllm-a", "engine", Some(&n)).await;
    let intruder = pod(bare, &ns, "intruder", "other", Some(&n)).await;
    let engine_token = token(bare, &ns, "engine", Some(&[AUDIENCE]), Some(&engine)).await;
    let intruder_token = token(bare, &ns, "other", Some(&[AUDIENCE]), Some(&intruder)).await;
    let (url, shared, _) = serve(bare).await;

    // Before this replica derived its plans it cannot tell an engine pod: retry later.
    let (refused, _tx) = open(&url, &n, &ns, "vllm-a", &engine_token).await;
    let Err(st) = refused else {
        panic!("refused before plans")
    };
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.message().contains("node plans"), "{st:?}");

    shared.nodes.lock().set_node_scope(&BTreeMap::from([(
        n.clone(),
        plan(&ns, "vllm-a", engine.metadata.uid.clone()),
    )]));

    // A non-engine pod of the same namespace, on its own valid pod-bound token: refused.
    let (refused, _tx) = open(&url, &n, &ns, "intruder", &intruder_token).await;
    let Err(st) = refused else {
        panic!("the intruder is refused")
    };
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    assert!(
        st.message().contains("not an engine pod"),
        "{}",
        st.message()
    );
    // The intruder's token claiming the engine pod: the token's pod claim decides.
    let (refused, _tx) = open(&url, &n, &ns, "vllm-a", &intruder_token).await;
    assert_eq!(refused.err().unwrap().code(), Code::PermissionDenied);

    // The engine's own token is accepted; its planned rank is indexed, another rank is not.
    let (accepted, tx) = open(&url, &n, &ns, "vllm-a", &engine_token).await;
    let mut inbound = accepted.unwrap();
    tx.send(resync(&ns, "vllm-a", 0)).await.unwrap();
    incluster_support::wait_for(
        "the engine's stream",
        std::time::Duration::from_secs(30),
        || {
            let found = shared
                .index
                .read()
                .stream_entries(&format!("{ns}/vllm-a#0"))
                .is_some();
            async move { found.then_some(()) }
        },
    )
    .await;
    tx.send(resync(&ns, "vllm-a", 7)).await.unwrap();
    let st = final_status(&mut inbound).await;
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    assert!(st.message().contains("rank"), "{st:?}");
    assert!(shared
        .index
        .read()
        .stream_entries(&format!("{ns}/vllm-a#7"))
        .is_none());

    // The planned pod replaced under the same name (the plan still has the old UID): refused.
    shared.nodes.lock().set_node_scope(&BTreeMap::from([(
        n.clone(),
        plan(&ns, "vllm-a", Some("0000-not-this-pod".into())),
    )]));
    let (refused, _tx) = open(&url, &n, &ns, "vllm-a", &engine_token).await;
    let Err(st) = refused else {
        panic!("a UID mismatch is refused")
    };
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    assert!(st.message().contains("UID"), "{st:?}");

    let text = shared.metrics.render();
    assert!(
        text.contains("inferencecache_controller_kv_streams_refused_total{reason=\"subscriber_not_planned\"} 3"),
        "{text}"
    );
}

#[tokio::test]
async fn garbage_tokens_from_one_source_cost_at_most_its_burst_of_token_reviews() {
    let bare = &BareCluster::get().await;
    let n = unique("node");
    let (url, shared, reviews) = serve(bare).await;
    let attempts = 3 * DEFAULT_REVIEW_BURST_PER_SOURCE as usize;
    let mut limited = 0;
    for i in 0..attempts {
        let (refused, _tx) = open(&url, &n, "ns", "p", &format!("garbage-{i}")).await;
        match refused.map(|_| ()).expect_err("garbage is refused").code() {
            Code::Unauthenticated => {}
            Code::ResourceExhausted => limited += 1,
            other => panic!("{other:?}"),
        }
    }
    // Refill (2 per second) may add a few while the loop runs; never one per token.
    let reviewed = reviews.load(Ordering::SeqCst);
    assert!(
        reviewed < 2 * DEFAULT_REVIEW_BURST_PER_SOURCE as usize,
        "{reviewed} reviews"
    );
    assert_eq!(reviewed + limited, attempts);
    // The same garbage token again costs nothing: its rejection is cached (by hash).
    let before = reviews.load(Ordering::SeqCst);
    let (refused, _tx) = open(&url, &n, "ns", "p", "garbage-0").await;
    assert_eq!(refused.err().unwrap().code(), Code::Unauthenticated);
    assert_eq!(reviews.load(Ordering::SeqCst), before);
    let text = shared.metrics.render();
    assert!(
        text.contains(&format!(
            "inferencecache_controller_token_reviews_limited_total {limited}"
        )),
        "{text}"
    );
}
