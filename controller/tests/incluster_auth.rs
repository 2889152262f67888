//! Agent authentication: over a real loopback gRPC connection with the fake verifier (a token
//! for node A cannot open a stream as node B; missing, unknown and foreign tokens are refused
//! with a clear status), the TokenReview cache, and the TokenReview verifier against the
//! in-memory API (an interceptor answers `tokenreviews` create as an API server would).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_controller::ingest::auth::{
    AgentAuthenticator, CachingVerifier, FakeTokenVerifier, KubeTokenVerifier, ServiceAccountRef,
    TokenVerifier, VerifyError,
};
use ic_controller::ingest::AgentIngest;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient,
    agent_service_server::AgentServiceServer, AgentMessage,
};
use k8s_openapi::api::core::v1::Pod;
use kube_fake_client::{interceptor, ClientBuilder};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Code;

fn agent_sa() -> ServiceAccountRef {
    "inference-cache:inference-cache-agent".parse().unwrap()
}

/// Serves AgentService with authentication on a loopback port.
async fn serve(verifier: Arc<dyn TokenVerifier>) -> (String, Arc<Shared>) {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let auth = Arc::new(
        AgentAuthenticator::new(verifier, "inference-cache", agent_sa())
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

fn fake() -> Arc<FakeTokenVerifier> {
    let other: ServiceAccountRef = "default:some-app".parse().unwrap();
    Arc::new(
        FakeTokenVerifier::new()
            .with_token("token-a", &agent_sa(), Some("node-a"))
            .with_token("token-b", &agent_sa(), Some("node-b"))
            .with_token("token-unbound", &agent_sa(), None)
            .with_token("token-app", &other, Some("node-a")),
    )
}

#[tokio::test]
async fn a_token_for_node_a_cannot_open_a_stream_as_node_b() {
    let (url, shared) = serve(fake()).await;

    let (refused, _tx) = open(&url, "node-b", "token-a").await;
    let Err(status) = refused else {
        panic!("node B with node A's token must be refused");
    };
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("\"node-a\"") && status.message().contains("\"node-b\""),
        "{}",
        status.message()
    );
    assert!(
        shared.nodes.lock().get("node-b").is_none(),
        "a refused stream leaves no trace"
    );

    let (accepted, _tx) = open(&url, "node-a", "token-a").await;
    accepted.expect("node A with its own token is accepted");
    assert!(shared.nodes.lock().get("node-a").unwrap().connected);

    // And node B's own token opens node B.
    let (accepted, _tx2) = open(&url, "node-b", "token-b").await;
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
    let verifier = fake();
    let (url, shared) = serve(verifier.clone()).await;
    let cases = [
        ("", Code::Unauthenticated, "Hello.token is empty"),
        ("forged", Code::Unauthenticated, "rejected"),
        (
            "token-app",
            Code::PermissionDenied,
            "system:serviceaccount:default:some-app",
        ),
        (
            "token-unbound",
            Code::PermissionDenied,
            "not bound to a node",
        ),
    ];
    for (token, code, text) in cases {
        let (res, _tx) = open(&url, "node-a", token).await;
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
    verifier.set_unavailable(Some("apiserver down"));
    let (res, _tx) = open(&url, "node-a", "token-a").await;
    assert_eq!(
        res.err().unwrap().code(),
        Code::Unavailable,
        "the agent retries later"
    );
    assert_eq!(shared.nodes.lock().connected_count(), 0);
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

/// An API server's TokenReview answers, keyed by token.
fn review_answer(token: &str) -> serde_json::Value {
    let sa_user = |extra: serde_json::Value| {
        json!({
            "username": "system:serviceaccount:inference-cache:inference-cache-agent",
            "uid": "sa-uid",
            "groups": ["system:serviceaccounts", "system:serviceaccounts:inference-cache"],
            "extra": extra,
        })
    };
    match token {
        "bound-a" => json!({
            "authenticated": true,
            "audiences": ["inference-cache"],
            "user": sa_user(json!({
                "authentication.kubernetes.io/node-name": ["node-a"],
                "authentication.kubernetes.io/pod-name": ["agent-xyz"],
            })),
        }),
        "no-node-extra" => json!({
            "authenticated": true,
            "audiences": ["inference-cache"],
            "user": sa_user(json!({
                "authentication.kubernetes.io/pod-name": ["agent-old"],
                "authentication.kubernetes.io/pod-uid": ["pod-uid-old"],
            })),
        }),
        "api-audience" => json!({"authenticated": true, "user": sa_user(json!({}))}),
        _ => {
            json!({"authenticated": false, "error": "[invalid bearer token, square/go-jose: error in cryptographic primitive]"})
        }
    }
}

#[tokio::test]
async fn token_review_verifier_against_the_in_memory_api() {
    let reviews = Arc::new(AtomicUsize::new(0));
    let seen = reviews.clone();
    let agent_pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "agent-old", "namespace": "inference-cache", "uid": "pod-uid-old"},
        "spec": {"nodeName": "node-c", "containers": [{"name": "agent", "image": "ic-agent"}]},
    }))
    .unwrap();
    let client = ClientBuilder::new()
        .with_object(agent_pod)
        .with_interceptor_funcs(interceptor::Funcs::new().create(move |ctx| {
            if ctx.object.get("kind").and_then(|k| k.as_str()) != Some("TokenReview") {
                return Ok(None);
            }
            seen.fetch_add(1, Ordering::SeqCst);
            // The controller asks for our audience.
            assert_eq!(ctx.object["spec"]["audiences"], json!(["inference-cache"]));
            let token = ctx.object["spec"]["token"].as_str().unwrap_or_default();
            let mut out = ctx.object.clone();
            out["status"] = review_answer(token);
            Ok(Some(out))
        }))
        .build()
        .await
        .unwrap();
    let v = KubeTokenVerifier::new(client);

    let id = v.verify("bound-a", "inference-cache").await.unwrap();
    assert_eq!(
        id.username,
        "system:serviceaccount:inference-cache:inference-cache-agent"
    );
    assert_eq!(id.node.as_deref(), Some("node-a"));

    // Without the node-name extra (Kubernetes < 1.30) the bound pod's node is used.
    let id = v.verify("no-node-extra", "inference-cache").await.unwrap();
    assert_eq!(id.node.as_deref(), Some("node-c"));

    // A token only valid for the API server's own audience is not ours.
    match v.verify("api-audience", "inference-cache").await {
        Err(VerifyError::Rejected(m)) => assert!(m.contains("audience"), "{m}"),
        other => panic!("{other:?}"),
    }
    match v.verify("garbage", "inference-cache").await {
        Err(VerifyError::Rejected(m)) => assert!(m.contains("invalid bearer token"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(reviews.load(Ordering::SeqCst), 4);

    // End to end through the authenticator: node binding from the review.
    let auth = AgentAuthenticator::new(Arc::new(v), "inference-cache", agent_sa());
    let hello = |node: &str, token: &str| proto::Hello {
        node: node.into(),
        token: token.into(),
        ..Default::default()
    };
    assert_eq!(
        auth.authenticate(&hello("node-a", "bound-a"))
            .await
            .unwrap()
            .node,
        "node-a"
    );
    let err = auth
        .authenticate(&hello("node-b", "bound-a"))
        .await
        .unwrap_err();
    assert_eq!(err.to_status().code(), Code::PermissionDenied);
}
