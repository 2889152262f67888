//! The authenticated, tenant-scoped data plane (docs/security.md "Authenticated data plane"):
//! the real gRPC `RouterService` and the real HTTP router on loopback, with the real
//! TokenReview verifier and SubjectAccessReview reviewer against the bare real apiserver
//! (tests/bare_apiserver_support/): gateways' TokenRequest tokens, reviewed by the apiserver's
//! TokenReview, and RBAC grants (a Role in one tenant's namespace, the chart's
//! `inference-cache-data-plane-reader` ClusterRole) that its SubjectAccessReview answers from.
//! No token, a wrong audience, another tenant's namespace, a granted namespace, the API server
//! down (a fault layer answers the reviews with an error), and a flood of distinct tokens.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;
mod incluster_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bare_apiserver_support::{BareCluster, Faults, Step};
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
use incluster_support::{
    bind_cluster_role, bind_in_namespace, client_with_token, role, sa_user, service_account, token,
    wait_allowed, AUDIENCE, CHART_CONTROLLER_ROLE,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Code;

/// The chart's ClusterRole for data-plane readers: `get`/`list` cacheroutes and cachenodes,
/// `get`/`post` on `/probe`.
const READER_ROLE: &str = "inference-cache-data-plane-reader";

/// One test's tenants, gateways and tokens.
struct World {
    bare: BareCluster,
    /// Tenant namespaces: team A's replica holds 16 tokens of the prompt, team B's 32.
    team_a: String,
    team_b: String,
    /// `system:serviceaccount:<gateways>:gateway-a`: `get`/`list` cacheroutes in team A only
    /// (a Role there).
    gw_a: String,
    /// gateway-a's token for our audience.
    tok_gw_a: String,
    /// gateway-all's token (the chart's reader ClusterRole, bound cluster-wide).
    tok_gw_all: String,
    /// A valid token of gateway-a, but for the API server's own audience.
    tok_api_audience: String,
    /// A client as the controller's ServiceAccount: the chart's controller ClusterRole (it
    /// creates TokenReviews and SubjectAccessReviews).
    controller: kube::Client,
}

/// Namespaces, ServiceAccounts, RBAC and tokens of one test; returns once RBAC allows what it
/// grants (a verdict is cached: a denial seen too early would stay).
async fn world() -> World {
    let bare = BareCluster::get().await;
    let gateways = bare.namespace("gateways").await;
    let team_a = bare.namespace("team-a").await;
    let team_b = bare.namespace("team-b").await;
    for sa in ["gateway-a", "gateway-all", "ic-controller"] {
        service_account(&bare, &gateways, sa).await;
    }
    role(
        &bare,
        &team_a,
        "route-reader",
        json!([{"apiGroups": ["inferencecache.io"], "resources": ["cacheroutes"],
                "verbs": ["get", "list"]}]),
    )
    .await;
    bind_in_namespace(
        &bare,
        &team_a,
        "Role",
        "route-reader",
        &gateways,
        "gateway-a",
    )
    .await;
    bind_cluster_role(&bare, READER_ROLE, &gateways, "gateway-all").await;
    bind_cluster_role(&bare, CHART_CONTROLLER_ROLE, &gateways, "ic-controller").await;
    let gw_a = sa_user(&gateways, "gateway-a");
    wait_allowed(
        &bare,
        &gw_a,
        json!({"resourceAttributes": {"group": "inferencecache.io", "resource": "cacheroutes",
               "verb": "list", "namespace": team_a}}),
    )
    .await;
    wait_allowed(
        &bare,
        &sa_user(&gateways, "gateway-all"),
        json!({"nonResourceAttributes": {"path": "/probe", "verb": "post"}}),
    )
    .await;
    wait_allowed(
        &bare,
        &sa_user(&gateways, "ic-controller"),
        json!({"resourceAttributes": {"group": "authorization.k8s.io",
               "resource": "subjectaccessreviews", "verb": "create"}}),
    )
    .await;
    let tok_gw_a = token(&bare, &gateways, "gateway-a", Some(&[AUDIENCE]), None).await;
    let tok_gw_all = token(&bare, &gateways, "gateway-all", Some(&[AUDIENCE]), None).await;
    let tok_api_audience = token(&bare, &gateways, "gateway-a", None, None).await;
    let controller_token = token(&bare, &gateways, "ic-controller", None, None).await;
    let controller = client_with_token(&bare, &controller_token).await;
    World {
        bare,
        team_a,
        team_b,
        gw_a,
        tok_gw_a,
        tok_gw_all,
        tok_api_audience,
        controller,
    }
}

/// The controller's client with a fault layer (admin credentials): while `down` is set, every
/// TokenReview and SubjectAccessReview is answered as an unreachable API server behind a proxy
/// would. Counts reviews that reached the apiserver.
fn faulty(bare: &BareCluster, down: Arc<AtomicBool>) -> (kube::Client, Arc<Faults>) {
    let faults = Faults::new();
    faults.rule(move |c| {
        let review = c.is("POST", "/tokenreviews") || c.is("POST", "/subjectaccessreviews");
        if review && down.load(Ordering::SeqCst) {
            Step::internal("dial tcp 10.96.0.1:443: connect: connection refused")
        } else {
            Step::Pass
        }
    });
    (bare.client_with(faults.clone()), faults)
}

/// Reviews (TokenReview and SubjectAccessReview) that reached the apiserver.
fn reviews(faults: &Faults) -> usize {
    faults
        .calls()
        .iter()
        .filter(|c| c.is("POST", "/tokenreviews") || c.is("POST", "/subjectaccessreviews"))
        .count()
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

/// Team A's replica holds the first 16 tokens of the prompt, team B's the first 32: a lookup
/// across tenants that saw both would name team B's.
fn index(w: &World) -> Arc<Shared> {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let mut ix = shared.index.write();
    let descs = [
        (stream(&w.team_a, "vllm-a"), 16),
        (stream(&w.team_b, "vllm-b"), 32),
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
/// cached by the agent path's cache, sent with `client`.
async fn plane(w: &World, client: kube::Client) -> Plane {
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
    serve(index(w), access).await
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
    let w = world().await;
    let p = plane(&w, w.controller.clone()).await;
    for token in [None, Some("garbage"), Some(w.tok_api_audience.as_str())] {
        let st = lookup(&p, token, &w.team_a).await.unwrap_err();
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
    let st = lookup(&p, None, &w.team_a).await.unwrap_err();
    assert!(
        st.message().contains("no bearer token") && st.message().contains("\"inference-cache\""),
        "{}",
        st.message()
    );
    let st = lookup(&p, Some(&w.tok_api_audience), &w.team_a)
        .await
        .unwrap_err();
    assert!(st.message().contains("audience"), "{}", st.message());
    // Health and metrics stay open for kubelet and Prometheus.
    assert_eq!(http(p.http, "GET", "/healthz", None).await.0, 200);
    assert_eq!(http(p.http, "GET", "/metrics", None).await.0, 200);
}

#[tokio::test]
async fn a_gateway_reads_only_the_namespaces_it_is_granted() {
    let w = world().await;
    let p = plane(&w, w.controller.clone()).await;
    let (a_id, b_id) = (
        format!("{}/vllm-a#0", w.team_a),
        format!("{}/vllm-b#0", w.team_b),
    );

    // Its own namespace: answered in full.
    let a = lookup(&p, Some(&w.tok_gw_a), &w.team_a).await.unwrap();
    assert_eq!(a.decision, proto::Decision::PrefixMatch as i32);
    assert_eq!(replicas(&a), vec![(a_id.clone(), 16)]);
    assert!(!a.narrowed);

    // Another tenant's namespace: refused, with what was asked.
    let st = lookup(&p, Some(&w.tok_gw_a), &w.team_b).await.unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied);
    assert!(
        st.message().contains(&w.gw_a)
            && st.message().contains(&format!(
                "get cacheroutes.inferencecache.io in namespace \"{}\"",
                w.team_b
            )),
        "{}",
        st.message()
    );

    // No tenant: only team A's replica, although team B's holds a longer prefix; it says so.
    let a = lookup(&p, Some(&w.tok_gw_a), "").await.unwrap();
    assert_eq!(replicas(&a), vec![(a_id.clone(), 16)]);
    assert!(a.narrowed);
    // A cluster-wide grant sees the deepest match, not narrowed.
    let a = lookup(&p, Some(&w.tok_gw_all), "").await.unwrap();
    assert_eq!(replicas(&a), vec![(b_id.clone(), 32)]);
    assert!(!a.narrowed);

    // /snapshot: gateway-a sees team A only, with team A's totals, and the document says so.
    let (status, _, body) = http(p.http, "GET", "/snapshot", Some(&w.tok_gw_a)).await;
    assert_eq!(status, 200, "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = doc["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["streamId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [a_id.as_str()]);
    assert_eq!(doc["narrowed"], true);
    assert_eq!(doc["blocks"], 4, "team A's 4 blocks, not team B's 8");
    assert_eq!(doc["entries"], 4);
    assert!(!body.contains(&w.team_b), "{body}");
    let (status, _, body) = http(p.http, "GET", "/snapshot", Some(&w.tok_gw_all)).await;
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
        let (status, _, body) = http(p.http, method, path, Some(&w.tok_gw_a)).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(
            body.contains(asked) && body.contains("no RBAC rule allows it"),
            "{path}: {body}"
        );
        let (status, _, body) = http(p.http, method, path, Some(&w.tok_gw_all)).await;
        assert!(status == 200 || status == 404, "{path}: {status} {body}");
    }
}

#[tokio::test]
async fn the_api_server_down_fails_closed_with_unavailable() {
    let w = world().await;
    let down = Arc::new(AtomicBool::new(true));
    let (client, faults) = faulty(&w.bare, down.clone());
    let p = plane(&w, client).await;
    let st = lookup(&p, Some(&w.tok_gw_a), &w.team_a).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    assert!(
        st.message().contains("refused") && st.message().contains("connection refused"),
        "{}",
        st.message()
    );
    for path in ["/snapshot", "/v1/nodes", "/probe"] {
        let (status, _, body) = http(p.http, "GET", path, Some(&w.tok_gw_a)).await;
        assert_eq!(status, 503, "{path}: {body}");
        assert!(!body.contains("replicas"), "{body}");
    }
    // Unavailable is never cached: the API server back, the same caller is answered.
    down.store(false, Ordering::SeqCst);
    let a = lookup(&p, Some(&w.tok_gw_a), &w.team_a).await.unwrap();
    assert_eq!(a.replicas.len(), 1);
    assert_eq!(
        reviews(&faults),
        6,
        "4 TokenReviews refused (none cached), then one TokenReview and one SubjectAccessReview"
    );
    // The token is verified but the review cannot run: still refused, not answered.
    down.store(true, Ordering::SeqCst);
    let st = lookup(&p, Some(&w.tok_gw_a), "").await.unwrap_err();
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
    let w = world().await;
    let (client, faults) = faulty(&w.bare, Default::default());
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
    let p = serve(index(&w), access).await;
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
    assert_eq!(reviews(&faults), 0);
    // A repeated token is answered from the cache (no new review).
    let before = slow.calls.load(Ordering::SeqCst);
    http(p.http, "GET", "/snapshot", Some("flood-399")).await;
    http(p.http, "GET", "/snapshot", Some("flood-399")).await;
    assert!(slow.calls.load(Ordering::SeqCst) <= before + 1);
}
