//! The authenticated, tenant-scoped data plane (docs/security.md "Authenticated data plane"):
//! the real gRPC `RouterService` and the real HTTP router on loopback, with the real
//! TokenReview verifier and SubjectAccessReview reviewer against the in-memory API (its
//! interceptors answer `tokenreviews` and `subjectaccessreviews` create as an API server with
//! RBAC would). No token, a wrong audience, another tenant's namespace, a granted namespace, the
//! API server down, and a flood of distinct tokens.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_controller::access::{CallerAuth, CallerAuthSettings, KubeAccessReviewer, ReviewLimiter};
use ic_controller::http::{router as http_router, HttpState};
use ic_controller::ingest::auth::{
    CachingVerifier, KubeTokenVerifier, TokenIdentity, TokenVerifier, VerifyError,
};
use ic_controller::router::Router;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::kv::content_key::chain;
use ic_shared::proto::{
    self, kv_op::Op, router_service_client::RouterServiceClient,
    router_service_server::RouterServiceServer, KvOp, LookupRouteRequest, StoreOp, StreamDelta,
    StreamDescriptor,
};
use kube_fake_client::{interceptor, ClientBuilder};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Code;

const AUDIENCE: &str = "inference-cache";
const GW_A: &str = "system:serviceaccount:gateways:gateway-a";
const GW_ALL: &str = "system:serviceaccount:gateways:gateway-all";

/// A TokenReview answer for `token`, as an audience-aware API server gives it.
fn token_review(token: &str) -> Value {
    let user = |name: &str| {
        json!({"username": name, "uid": format!("uid-{name}"),
               "groups": ["system:serviceaccounts", "system:serviceaccounts:gateways", "system:authenticated"]})
    };
    match token {
        "tok-gw-a" => json!({"authenticated": true, "audiences": [AUDIENCE], "user": user(GW_A)}),
        "tok-gw-all" => {
            json!({"authenticated": true, "audiences": [AUDIENCE], "user": user(GW_ALL)})
        }
        // A valid token, but for the API server's own audience.
        "tok-api-audience" => json!({"authenticated": true,
            "audiences": ["https://kubernetes.default.svc.cluster.local"], "user": user(GW_A)}),
        _ => {
            json!({"authenticated": false, "error": "[invalid bearer token, token lookup failed]"})
        }
    }
}

/// What RBAC grants: gateway-a `get`/`list` cacheroutes in `team-a` only; gateway-all a
/// ClusterRole with `get`/`list` cacheroutes everywhere, `list`/`get` cachenodes and
/// `get`/`post` on `/probe`.
fn access_review(spec: &Value) -> Value {
    let user = spec["user"].as_str().unwrap_or_default();
    let allowed = if let Some(ra) = spec.get("resourceAttributes") {
        assert_eq!(ra["group"], "inferencecache.io");
        let ns = ra["namespace"].as_str().unwrap_or_default();
        let verb = ra["verb"].as_str().unwrap_or_default();
        match (user, ra["resource"].as_str().unwrap_or_default()) {
            (GW_A, "cacheroutes") => ns == "team-a" && (verb == "get" || verb == "list"),
            (GW_ALL, "cacheroutes" | "cachenodes") => true,
            _ => false,
        }
    } else {
        let nra = &spec["nonResourceAttributes"];
        user == GW_ALL && nra["path"] == "/probe"
    };
    if allowed {
        json!({"allowed": true, "reason": format!("RBAC: allowed by ClusterRoleBinding \"gw\" of ClusterRole \"inference-cache-gateway\" to User \"{user}\"")})
    } else {
        json!({"allowed": false, "reason": ""})
    }
}

/// An in-memory API answering TokenReviews and SubjectAccessReviews; `down` makes both fail as
/// an unreachable API server does. Counts reviews.
async fn api(down: Arc<AtomicBool>, reviews: Arc<AtomicUsize>) -> kube::Client {
    ClientBuilder::new()
        .with_interceptor_funcs(interceptor::Funcs::new().create(move |ctx| {
            let kind = ctx
                .object
                .get("kind")
                .and_then(|k| k.as_str())
                .unwrap_or("");
            if kind != "TokenReview" && kind != "SubjectAccessReview" {
                return Ok(None);
            }
            if down.load(Ordering::SeqCst) {
                return Err(kube_fake_client::Error::Internal(
                    "dial tcp 10.96.0.1:443: connect: connection refused".into(),
                ));
            }
            reviews.fetch_add(1, Ordering::SeqCst);
            let mut out = ctx.object.clone();
            out["status"] = if kind == "TokenReview" {
                assert_eq!(ctx.object["spec"]["audiences"], json!([AUDIENCE]));
                token_review(ctx.object["spec"]["token"].as_str().unwrap_or_default())
            } else {
                access_review(&ctx.object["spec"])
            };
            Ok(Some(out))
        }))
        .build()
        .await
        .unwrap()
}

fn stream(tenant: &str, pod: &str) -> StreamDescriptor {
    StreamDescriptor {
        stream_id: format!("{tenant}/{pod}#0"),
        replica: pod.into(),
        tenant: tenant.into(),
        model: "m".into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    }
}

/// team-a's replica holds the first 16 tokens of the prompt, team-b's the first 32: a lookup
/// across tenants that saw both would name team-b's.
fn index() -> Arc<Shared> {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let mut ix = shared.index.write();
    let descs = [
        (stream("team-a", "vllm-a"), 16),
        (stream("team-b", "vllm-b"), 32),
    ];
    ix.resync_node(
        "node-1",
        &descs
            .iter()
            .map(|(d, _)| proto::StreamSnapshot {
                stream: Some(d.clone()),
                ..Default::default()
            })
            .collect::<Vec<_>>(),
    );
    for (d, n) in descs {
        ix.apply_delta(
            "node-1",
            &StreamDelta {
                coverage: proto::Coverage::Exact as i32,
                stream: Some(d),
                seq: 1,
                ops: vec![KvOp {
                    op: Some(Op::Store(StoreOp {
                        block_size: 4,
                        tier: proto::Tier::T1 as i32,
                        content_keys: chain(&(0..n).collect::<Vec<_>>(), 4),
                        ..Default::default()
                    })),
                }],
                ..Default::default()
            },
        )
        .unwrap();
    }
    drop(ix);
    shared
}

struct Plane {
    grpc: String,
    http: SocketAddr,
    access: Arc<CallerAuth>,
}

/// Serves gRPC RouterService and the HTTP router with `access` on loopback.
async fn serve(shared: Arc<Shared>, access: Arc<CallerAuth>) -> Plane {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = format!("http://{}", l.local_addr().unwrap());
    let svc = RouterServiceServer::new(Router::new(shared.clone()).with_access(access.clone()));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(TcpListenerStream::new(l)),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = l.local_addr().unwrap();
    let app = http_router(HttpState {
        shared,
        ready: Arc::new(AtomicBool::new(true)),
        access: Some(access.clone()),
    });
    tokio::spawn(async move { axum::serve(l, app).await });
    Plane { grpc, http, access }
}

/// The production wiring: TokenReview and SubjectAccessReview through one limiter, tokens
/// cached by the agent path's cache.
async fn plane(down: Arc<AtomicBool>, reviews: Arc<AtomicUsize>) -> Plane {
    let client = api(down, reviews).await;
    let limiter = ReviewLimiter::new(4, Duration::from_secs(2));
    let verifier: Arc<dyn TokenVerifier> = Arc::new(CachingVerifier::new(
        limiter.verifier(KubeTokenVerifier::new(client.clone())),
    ));
    let access = Arc::new(CallerAuth::new(
        verifier,
        Arc::new(KubeAccessReviewer::new(client)),
        limiter,
        CallerAuthSettings::default(),
    ));
    serve(index(), access).await
}

async fn lookup(
    p: &Plane,
    token: Option<&str>,
    tenant: &str,
) -> Result<proto::LookupRouteResponse, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(p.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RouterServiceClient::new(channel);
    let mut req = tonic::Request::new(LookupRouteRequest {
        tenant: tenant.into(),
        token_ids: (0..32).collect(),
        ..Default::default()
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    client.lookup_route(req).await.map(|r| r.into_inner())
}

/// `method path` with an optional bearer token: (status, headers, body).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("{method} {path} HTTP/1.1\r\nhost: x\r\n{auth}content-length: 0\r\nconnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head[9..12].parse().unwrap();
    (status, head.to_lowercase(), body.to_string())
}

fn replicas(a: &proto::LookupRouteResponse) -> Vec<(String, u32)> {
    a.replicas
        .iter()
        .map(|m| (m.stream_id.clone(), m.matched_tokens))
        .collect()
}

#[tokio::test]
async fn callers_without_a_valid_token_for_our_audience_are_refused() {
    let p = plane(Default::default(), Default::default()).await;
    for token in [None, Some("garbage"), Some("tok-api-audience")] {
        let st = lookup(&p, token, "team-a").await.unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{token:?}: {st:?}");
        for (method, path) in [
            ("GET", "/snapshot"),
            ("GET", "/v1/nodes"),
            ("GET", "/v1/nodes/node-1"),
            ("GET", "/probe"),
            ("POST", "/probe"),
        ] {
            let (status, head, body) = http(p.http, method, path, token).await;
            assert_eq!(status, 401, "{method} {path} {token:?}: {body}");
            assert!(head.contains("www-authenticate: bearer"), "{head}");
            assert!(body.contains("\"error\""), "{body}");
        }
    }
    let st = lookup(&p, None, "team-a").await.unwrap_err();
    assert!(
        st.message().contains("no bearer token") && st.message().contains("\"inference-cache\""),
        "{}",
        st.message()
    );
    let st = lookup(&p, Some("tok-api-audience"), "team-a")
        .await
        .unwrap_err();
    assert!(st.message().contains("audience"), "{}", st.message());
    // Health and metrics stay open for kubelet and Prometheus.
    assert_eq!(http(p.http, "GET", "/healthz", None).await.0, 200);
    assert_eq!(http(p.http, "GET", "/metrics", None).await.0, 200);
}

#[tokio::test]
async fn a_gateway_reads_only_the_namespaces_it_is_granted() {
    let p = plane(Default::default(), Default::default()).await;

    // Its own namespace: answered in full.
    let a = lookup(&p, Some("tok-gw-a"), "team-a").await.unwrap();
    assert_eq!(a.decision, proto::Decision::PrefixMatch as i32);
    assert_eq!(replicas(&a), vec![("team-a/vllm-a#0".to_string(), 16)]);
    assert!(!a.narrowed);

    // Another tenant's namespace: refused, with what was asked.
    let st = lookup(&p, Some("tok-gw-a"), "team-b").await.unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied);
    assert!(
        st.message().contains(GW_A)
            && st
                .message()
                .contains("get cacheroutes.inferencecache.io in namespace \"team-b\""),
        "{}",
        st.message()
    );

    // No tenant: only team-a's replica, although team-b's holds a longer prefix; it says so.
    let a = lookup(&p, Some("tok-gw-a"), "").await.unwrap();
    assert_eq!(replicas(&a), vec![("team-a/vllm-a#0".to_string(), 16)]);
    assert!(a.narrowed);
    // A cluster-wide grant sees the deepest match, not narrowed.
    let a = lookup(&p, Some("tok-gw-all"), "").await.unwrap();
    assert_eq!(replicas(&a), vec![("team-b/vllm-b#0".to_string(), 32)]);
    assert!(!a.narrowed);

    // /snapshot: gateway-a sees team-a only, with team-a's totals, and the document says so.
    let (status, _, body) = http(p.http, "GET", "/snapshot", Some("tok-gw-a")).await;
    assert_eq!(status, 200, "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = doc["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["streamId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["team-a/vllm-a#0"]);
    assert_eq!(doc["narrowed"], true);
    assert_eq!(doc["blocks"], 4, "team-a's 4 blocks, not team-b's 8");
    assert_eq!(doc["entries"], 4);
    assert!(!body.contains("team-b"), "{body}");
    let (status, _, body) = http(p.http, "GET", "/snapshot", Some("tok-gw-all")).await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["replicas"].as_array().unwrap().len(), 2);
    assert_eq!(doc["blocks"], 12);
    assert!(doc.get("narrowed").is_none(), "{doc}");

    // Nodes and the probe: gateway-a has no grant (403 with what was asked), gateway-all has.
    for (method, path, asked) in [
        ("GET", "/v1/nodes", "list cachenodes.inferencecache.io"),
        (
            "GET",
            "/v1/nodes/node-1",
            "get cachenodes.inferencecache.io \\\"node-1\\\"",
        ),
        ("GET", "/probe", "get /probe"),
        ("POST", "/probe", "post /probe"),
    ] {
        let (status, _, body) = http(p.http, method, path, Some("tok-gw-a")).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(
            body.contains(asked) && body.contains("no RBAC rule allows it"),
            "{path}: {body}"
        );
        let (status, _, body) = http(p.http, method, path, Some("tok-gw-all")).await;
        assert!(status == 200 || status == 404, "{path}: {status} {body}");
    }
}

#[tokio::test]
async fn the_api_server_down_fails_closed_with_unavailable() {
    let down = Arc::new(AtomicBool::new(true));
    let p = plane(down.clone(), Default::default()).await;
    let st = lookup(&p, Some("tok-gw-a"), "team-a").await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    assert!(
        st.message().contains("refused") && st.message().contains("connection refused"),
        "{}",
        st.message()
    );
    for path in ["/snapshot", "/v1/nodes", "/probe"] {
        let (status, _, body) = http(p.http, "GET", path, Some("tok-gw-a")).await;
        assert_eq!(status, 503, "{path}: {body}");
        assert!(!body.contains("replicas"), "{body}");
    }
    // Unavailable is never cached: the API server back, the same caller is answered.
    down.store(false, Ordering::SeqCst);
    let a = lookup(&p, Some("tok-gw-a"), "team-a").await.unwrap();
    assert_eq!(a.replicas.len(), 1);
    // The token is verified but the review cannot run: still refused, not answered.
    down.store(true, Ordering::SeqCst);
    let st = lookup(&p, Some("tok-gw-a"), "").await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
}

/// A verifier that takes 20 ms per review and records how many run at once.
#[derive(Default)]
struct SlowVerifier {
    running: AtomicUsize,
    most: AtomicUsize,
    calls: AtomicUsize,
}

#[tonic::async_trait]
impl TokenVerifier for SlowVerifier {
    async fn verify(&self, _token: &str, _audience: &str) -> Result<TokenIdentity, VerifyError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        Err(VerifyError::Rejected("unknown token".into()))
    }
}

#[tokio::test]
async fn a_flood_of_distinct_tokens_is_bounded_in_memory_and_in_reviews() {
    let reviews = Arc::new(AtomicUsize::new(0));
    let client = api(Default::default(), reviews.clone()).await;
    let slow = Arc::new(SlowVerifier::default());
    let limiter = ReviewLimiter::new(4, Duration::from_millis(300));
    let cache = Arc::new(CachingVerifier::with_ttls(
        limiter.verifier(slow.clone()),
        Duration::from_secs(60),
        Duration::from_secs(10),
        64,
    ));
    let access = Arc::new(CallerAuth::new(
        cache.clone(),
        Arc::new(KubeAccessReviewer::new(client)),
        limiter,
        CallerAuthSettings::default(),
    ));
    let p = serve(index(), access).await;
    let mut tasks = Vec::new();
    for i in 0..400 {
        let addr = p.http;
        tasks.push(tokio::spawn(async move {
            http(addr, "GET", "/snapshot", Some(&format!("flood-{i}")))
                .await
                .0
        }));
    }
    let mut by_status = std::collections::BTreeMap::new();
    for t in tasks {
        *by_status.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    // Every request is refused: 401 once reviewed, 503 when no review slot freed in time.
    assert_eq!(
        by_status
            .keys()
            .filter(|s| **s != 401 && **s != 503)
            .count(),
        0,
        "{by_status:?}"
    );
    assert!(
        by_status.get(&401).copied().unwrap_or(0) > 0,
        "{by_status:?}"
    );
    // At most 4 reviews at once reached the API server, and the caches stayed bounded.
    assert!(
        slow.most.load(Ordering::SeqCst) <= 4,
        "{}",
        slow.most.load(Ordering::SeqCst)
    );
    assert!(cache.cached_tokens() <= 64, "{}", cache.cached_tokens());
    assert_eq!(
        p.access.cached_reviews(),
        0,
        "no SubjectAccessReview for an unauthenticated caller"
    );
    assert_eq!(reviews.load(Ordering::SeqCst), 0);
    // A repeated token is answered from the cache (no new review).
    let before = slow.calls.load(Ordering::SeqCst);
    http(p.http, "GET", "/snapshot", Some("flood-399")).await;
    http(p.http, "GET", "/snapshot", Some("flood-399")).await;
    assert!(slow.calls.load(Ordering::SeqCst) <= before + 1);
}
