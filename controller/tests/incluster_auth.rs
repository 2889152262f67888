//! Agent authentication against the bare real apiserver (tests/bare_apiserver_support/):
//! TokenRequest tokens bound to real pods on real Nodes, reviewed by the apiserver's own
//! TokenReview. Over a real loopback gRPC connection, a token for node A cannot open a stream as
//! node B, and missing, unknown, foreign and unbound tokens are refused with a clear status (an
//! unreachable apiserver is a fault layer's error); the TokenReview verifier reads the node from
//! the token, or from the bound pod when the token has none. The TokenReview cache's TTLs are
//! tested with the fake verifier and an injected clock (no apiserver). The in-cluster controller
//! (`incluster::start`) honours `--token-review-burst-per-source` /
//! `--token-reviews-per-second-per-source` (its `review_source_limit`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;
mod incluster_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bare_apiserver_support::{unique, BareCluster, Faults, Step};
use ic_controller::incluster::{
    self, InClusterConfig, LeaderElectionSettings, Overrides, WebhookSettings,
};
use ic_controller::ingest::auth::ReviewSourceLimit;
use ic_controller::ingest::auth::{
    AgentAuthenticator, CachingVerifier, FakeTokenVerifier, KubeTokenVerifier, ServiceAccountRef,
    TokenVerifier, VerifyError, EXTRA_NODE_NAME, EXTRA_POD_NAME,
};
use ic_controller::ingest::AgentIngest;
use ic_controller::leader::ElectionConfig;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient,
    agent_service_server::AgentServiceServer, AgentMessage,
};
use incluster_support::{
    controller_client, node, pod, service_account, token, ControllerGrants, AUDIENCE,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Code;

/// Tokens of one test's namespace: the agent ServiceAccount's, bound to its pods on nodes A and
/// B and unbound, and another ServiceAccount's bound to a pod on node A.
struct Tokens {
    agent_sa: ServiceAccountRef,
    node_a: String,
    node_b: String,
    token_a: String,
    token_b: String,
    token_unbound: String,
    token_app: String,
    app_user: String,
}

async fn tokens(bare: &BareCluster) -> Tokens {
    let ns = bare.namespace("agent-auth").await;
    let agent = "inference-cache-agent";
    service_account(bare, &ns, agent).await;
    service_account(bare, &ns, "some-app").await;
    let node_a = unique("node-a");
    let node_b = unique("node-b");
    node(bare, &node_a).await;
    node(bare, &node_b).await;
    let pod_a = pod(bare, &ns, "agent-a", agent, Some(&node_a)).await;
    let pod_b = pod(bare, &ns, "agent-b", agent, Some(&node_b)).await;
    let app = pod(bare, &ns, "app", "some-app", Some(&node_a)).await;
    Tokens {
        agent_sa: format!("{ns}:{agent}").parse().unwrap(),
        token_a: token(bare, &ns, agent, Some(&[AUDIENCE]), Some(&pod_a)).await,
        token_b: token(bare, &ns, agent, Some(&[AUDIENCE]), Some(&pod_b)).await,
        token_unbound: token(bare, &ns, agent, Some(&[AUDIENCE]), None).await,
        token_app: token(bare, &ns, "some-app", Some(&[AUDIENCE]), Some(&app)).await,
        app_user: format!("system:serviceaccount:{ns}:some-app"),
        node_a,
        node_b,
    }
}

/// The TokenReview verifier with a fault layer: while `down` is set, TokenReviews are answered
/// `503` as by an apiserver that cannot serve them.
fn kube_verifier(bare: &BareCluster, down: Arc<AtomicBool>) -> Arc<KubeTokenVerifier> {
    let faults = Faults::new();
    faults.rule(move |c| {
        if c.is("POST", "/tokenreviews") && down.load(Ordering::SeqCst) {
            Step::Fail {
                code: 503,
                reason: "ServiceUnavailable",
                message: "apiserver down".into(),
            }
        } else {
            Step::Pass
        }
    });
    Arc::new(KubeTokenVerifier::new(bare.client_with(faults)))
}

/// Serves AgentService with authentication on a loopback port.
async fn serve(
    verifier: Arc<dyn TokenVerifier>,
    agent_sa: ServiceAccountRef,
) -> (String, Arc<Shared>) {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let auth = Arc::new(
        AgentAuthenticator::new(verifier, "inference-cache", agent_sa)
            .with_metrics(&shared.metrics.registry)
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = AgentServiceServer::new(AgentIngest::with_auth(shared.clone(), auth));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), shared)
}

/// Opens a stream with `hello` first; returns the response (or the refusal) and the sender.
async fn open(
    url: &str,
    node: &str,
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

#[tokio::test]
async fn a_token_for_node_a_cannot_open_a_stream_as_node_b() {
    let bare = BareCluster::get().await;
    let t = tokens(&bare).await;
    let (url, shared) = serve(kube_verifier(&bare, Default::default()), t.agent_sa.clone()).await;

    let (refused, _tx) = open(&url, &t.node_b, &t.token_a).await;
    let Err(status) = refused else {
        panic!("node B with node A's token must be refused");
    };
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains(&format!("\"{}\"", t.node_a))
            && status.message().contains(&format!("\"{}\"", t.node_b)),
        "{}",
        status.message()
    );
    assert!(
        shared.nodes.lock().get(&t.node_b).is_none(),
        "a refused stream leaves no trace"
    );

    let (accepted, _tx) = open(&url, &t.node_a, &t.token_a).await;
    accepted.expect("node A with its own token is accepted");
    assert!(shared.nodes.lock().get(&t.node_a).unwrap().connected);

    // And node B's own token opens node B.
    let (accepted, _tx2) = open(&url, &t.node_b, &t.token_b).await;
    accepted.unwrap();
    let metrics = shared.metrics.render();
    assert!(
        metrics.contains(r#"inferencecache_controller_agent_auth_total{result="node_mismatch"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"inferencecache_controller_agent_auth_total{result="ok"} 2"#));
}

#[tokio::test]
async fn missing_unknown_foreign_and_unbound_tokens_are_refused_clearly() {
    let bare = BareCluster::get().await;
    let t = tokens(&bare).await;
    let down = Arc::new(AtomicBool::new(false));
    let (url, shared) = serve(kube_verifier(&bare, down.clone()), t.agent_sa.clone()).await;
    let cases = [
        ("", Code::Unauthenticated, "Hello.token is empty"),
        ("forged", Code::Unauthenticated, "rejected"),
        (
            t.token_app.as_str(),
            Code::PermissionDenied,
            t.app_user.as_str(),
        ),
        (
            t.token_unbound.as_str(),
            Code::PermissionDenied,
            "not bound to a node",
        ),
    ];
    for (token, code, text) in cases {
        let (res, _tx) = open(&url, &t.node_a, token).await;
        let st = res
            .err()
            .unwrap_or_else(|| panic!("token {token:?} must be refused"));
        assert_eq!(st.code(), code, "token {token:?}: {}", st.message());
        assert!(
            st.message().contains(text),
            "token {token:?}: {}",
            st.message()
        );
    }
    down.store(true, Ordering::SeqCst);
    let (res, _tx) = open(&url, &t.node_a, &t.token_a).await;
    assert_eq!(
        res.err().unwrap().code(),
        Code::Unavailable,
        "the agent retries later"
    );
    assert_eq!(shared.nodes.lock().connected_count(), 0);
}

/// A fake verifier of two node-bound agent tokens (counts its reviews).
fn fake() -> Arc<FakeTokenVerifier> {
    let agent: ServiceAccountRef = "inference-cache:inference-cache-agent".parse().unwrap();
    Arc::new(
        FakeTokenVerifier::new()
            .with_token("token-a", &agent, Some("node-a"))
            .with_token("token-b", &agent, Some("node-b")),
    )
}

#[tokio::test]
async fn token_reviews_are_cached_for_their_ttl() {
    let inner = fake();
    let base = std::time::Instant::now();
    let offset = Arc::new(parking_lot::Mutex::new(Duration::ZERO));
    let advance = |d: Duration| *offset.lock() += d;
    let clock_offset = offset.clone();
    let cache = CachingVerifier::with_ttls(
        inner.clone(),
        Duration::from_secs(60),
        Duration::from_secs(10),
        16,
    )
    .with_clock(Arc::new(move || base + *clock_offset.lock()));
    for _ in 0..3 {
        assert_eq!(
            cache
                .verify("token-a", "inference-cache")
                .await
                .unwrap()
                .node
                .as_deref(),
            Some("node-a")
        );
    }
    assert_eq!(inner.calls(), 1);
    // Another audience is another review.
    let _ = cache.verify("token-a", "other").await;
    assert_eq!(inner.calls(), 2);
    advance(Duration::from_secs(61));
    cache.verify("token-a", "inference-cache").await.unwrap();
    assert_eq!(inner.calls(), 3, "expired entries are reviewed again");

    // Rejections are cached briefly; unavailability is not cached at all.
    assert!(matches!(
        cache.verify("nope", "inference-cache").await,
        Err(VerifyError::Rejected(_))
    ));
    assert!(cache.verify("nope", "inference-cache").await.is_err());
    assert_eq!(inner.calls(), 4);
    advance(Duration::from_secs(11));
    let _ = cache.verify("nope", "inference-cache").await;
    assert_eq!(inner.calls(), 5);
    inner.set_unavailable(Some("down"));
    let _ = cache.verify("token-b", "inference-cache").await;
    let _ = cache.verify("token-b", "inference-cache").await;
    assert_eq!(inner.calls(), 7);
    inner.set_unavailable(None);
    assert!(cache.verify("token-b", "inference-cache").await.is_ok());
}

#[tokio::test]
async fn token_review_verifier_against_the_real_apiserver() {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("agent-auth").await;
    let agent = "inference-cache-agent";
    service_account(&bare, &ns, agent).await;
    let node_a = unique("node-a");
    let node_b = unique("node-b");
    let node_c = unique("node-c");
    node(&bare, &node_a).await;

    // A token bound to an agent pod on node A: the apiserver puts the node into the token.
    let agent_pod = pod(&bare, &ns, "agent-xyz", agent, Some(&node_a)).await;
    let bound_a = token(&bare, &ns, agent, Some(&[AUDIENCE]), Some(&agent_pod)).await;
    // A token bound to a pod before it had a node (no node-name extra, as from apiservers before
    // 1.30), then scheduled onto node C (the binding subresource, as the scheduler does).
    let old_pod = pod(&bare, &ns, "agent-old", agent, None).await;
    let no_node_extra = token(&bare, &ns, agent, Some(&[AUDIENCE]), Some(&old_pod)).await;
    let pods = Api::<Pod>::namespaced(bare.admin.clone(), &ns);
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "agent-old"},
                         "target": {"apiVersion": "v1", "kind": "Node", "name": node_c}});
    let _: serde_json::Value = pods
        .create_subresource("binding", "agent-old", &PostParams::default(), &binding)
        .await
        .unwrap();
    // A valid token for the API server's own audience only.
    let api_audience = token(&bare, &ns, agent, None, Some(&agent_pod)).await;

    let faults = Faults::new();
    let v = KubeTokenVerifier::new(bare.client_with(faults.clone()));
    let reviews = || {
        faults
            .calls()
            .iter()
            .filter(|c| c.is("POST", "/tokenreviews"))
            .count()
    };
    let pod_reads = |name: &str| {
        faults
            .calls()
            .iter()
            .filter(|c| c.is("GET", &format!("/pods/{name}")))
            .count()
    };

    let id = v.verify(&bound_a, AUDIENCE).await.unwrap();
    assert_eq!(
        id.username,
        format!("system:serviceaccount:{ns}:inference-cache-agent")
    );
    assert_eq!(id.node.as_deref(), Some(node_a.as_str()));
    assert_eq!(id.extra_value(EXTRA_NODE_NAME), Some(node_a.as_str()));
    assert_eq!(pod_reads("agent-xyz"), 0, "the node came from the token");

    // Without the node-name extra the bound pod's node is used.
    let id = v.verify(&no_node_extra, AUDIENCE).await.unwrap();
    assert_eq!(id.extra_value(EXTRA_NODE_NAME), None, "{:?}", id.extra);
    assert_eq!(id.extra_value(EXTRA_POD_NAME), Some("agent-old"));
    assert_eq!(id.node.as_deref(), Some(node_c.as_str()));
    assert_eq!(pod_reads("agent-old"), 1);

    // A token only valid for the API server's own audience is not ours.
    match v.verify(&api_audience, AUDIENCE).await {
        Err(VerifyError::Rejected(m)) => assert!(m.contains("audience"), "{m}"),
        other => panic!("{other:?}"),
    }
    match v.verify("garbage", AUDIENCE).await {
        Err(VerifyError::Rejected(m)) => assert!(m.contains("invalid bearer token"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(reviews(), 4);

    // End to end through the authenticator: node binding from the review.
    let auth = AgentAuthenticator::new(
        Arc::new(v.clone()),
        AUDIENCE,
        format!("{ns}:{agent}").parse().unwrap(),
    );
    let hello = |node: &str, token: &str| proto::Hello {
        node: node.into(),
        token: token.into(),
        ..Default::default()
    };
    assert_eq!(
        auth.authenticate(&hello(&node_a, &bound_a))
            .await
            .unwrap()
            .node,
        node_a
    );
    let err = auth
        .authenticate(&hello(&node_b, &bound_a))
        .await
        .unwrap_err();
    assert_eq!(err.to_status().code(), Code::PermissionDenied);
    assert_eq!(
        auth.authenticate(&hello(&node_c, &no_node_extra))
            .await
            .unwrap()
            .node,
        node_c
    );

    // Once its pod is gone, a token is refused: the verifier finds the pod missing, or the
    // apiserver refuses the token itself (once its cache of the last review runs out).
    pods.delete("agent-old", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    match v.verify(&no_node_extra, AUDIENCE).await {
        Err(VerifyError::Rejected(m)) => {
            assert!(m.contains("agent-old") || m.contains("not found"), "{m}")
        }
        other => panic!("a deleted pod's token: {other:?}"),
    }
}

/// Counts the TokenReviews asked of it and rejects every token.
struct Rejecting(std::sync::atomic::AtomicUsize);

#[tonic::async_trait]
impl TokenVerifier for Rejecting {
    async fn verify(
        &self,
        _token: &str,
        _audience: &str,
    ) -> Result<ic_controller::ingest::auth::TokenIdentity, VerifyError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(VerifyError::Rejected("unknown token".into()))
    }
}

/// `--token-review-burst-per-source=2 --token-reviews-per-second-per-source=0`
/// (`InClusterConfig::review_source_limit`, as `ic-controller run` builds it): the in-cluster
/// controller reviews the first two garbage tokens from one source address and refuses the
/// third RESOURCE_EXHAUSTED without a review (the default burst, 16, would review it).
#[tokio::test]
async fn in_cluster_the_review_burst_flag_refuses_the_third_review_from_one_source() {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("review-burst").await;
    let client = controller_client(&bare, &ns, ControllerGrants::default()).await;
    let mut election = ElectionConfig::new("replica-1");
    election.retry_period = Duration::from_millis(100);
    let cfg = InClusterConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        agent_expiry: Duration::from_secs(60),
        policy: LookupPolicy::default(),
        webhook: WebhookSettings {
            enabled: false,
            addr: "127.0.0.1:0".parse().unwrap(),
            ..Default::default()
        },
        leader_election: LeaderElectionSettings {
            namespace: ns.clone(),
            lease_name: "inference-cache-controller".into(),
            election,
        },
        agent_service_account: format!("{ns}:inference-cache-agent").parse().unwrap(),
        token_audience: AUDIENCE.into(),
        token_cache_ttl: Duration::from_secs(60),
        review_source_limit: ReviewSourceLimit {
            burst: 2,
            per_second: 0.0,
        },
        data_plane_auth: None,
        nodes: Default::default(),
        limits: Default::default(),
        model_cache: None,
        functional_probe: false,
        tokenizers: Default::default(),
    };
    let reviews = Arc::new(Rejecting(std::sync::atomic::AtomicUsize::new(0)));
    let overrides = Overrides {
        token_verifier: Some(reviews.clone()),
        ..Default::default()
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = incluster::start(client, cfg, overrides, async {
        let _ = stop_rx.await;
    })
    .await
    .unwrap();
    let url = format!("http://{}", running.grpc_addr);
    let mut codes = Vec::new();
    for i in 0..3 {
        let (refused, _tx) = open(&url, "node-x", &format!("garbage-{i}")).await;
        codes.push(refused.map(|_| ()).expect_err("garbage is refused").code());
    }
    assert_eq!(
        codes,
        [
            Code::Unauthenticated,
            Code::Unauthenticated,
            Code::ResourceExhausted
        ]
    );
    assert_eq!(reviews.0.load(Ordering::SeqCst), 2);
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running.wait())
        .await
        .unwrap()
        .unwrap();
}
