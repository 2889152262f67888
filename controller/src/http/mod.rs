//! The controller's HTTP endpoints: `/healthz`, `/readyz`, `/metrics`, `/snapshot`, `/v1/nodes`,
//! `/v1/nodes/{node}`.
//!
//! - `/healthz`: 200 while the process serves HTTP.
//! - `/readyz`: 200 once the gRPC listener is bound, else 503.
//! - `/metrics`: Prometheus text format.
//! - `/snapshot`: the index per replica ([`IndexSnapshot`](crate::index::IndexSnapshot)).
//! - `/probe` (GET or POST): the functional probe ([`ProbeReport`](crate::probe::ProbeReport)):
//!   stages ingest, routing, t2, each `ok` / `failed` / `skipped` with a diagnostic. Optional
//!   coordinates as query parameters or a JSON body: `tenant`, `model`, `hashScheme`,
//!   `blockSize`, `backend`. 200 with the report; a failed stage is an outcome, not a
//!   server error. A parameter over its cap (`blockSize` above
//!   [`MAX_BLOCK_SIZE`](ic_shared::limits::MAX_BLOCK_SIZE), a string above
//!   [`MAX_NAME_BYTES`](ic_shared::limits::MAX_NAME_BYTES), a body above
//!   [`MAX_PROBE_BODY_BYTES`]) is a 400 with `{"error": …}` and nothing is allocated for it.
//! - `/v1/nodes`: `{"nodes":[NodeRecord…]}` — each agent that connected, with its latest checks.
//!
//! [`health_router`] serves `/healthz` and `/readyz` alone on the separate health listener
//! (`--health-addr`, its own connection budget: docs/security.md "Streams, handshakes and idle
//! connections"), so the kubelet's probes answer while data clients hold every slot here.
//!
//! With [`HttpState::access`] set (in cluster), `/snapshot`, `/probe`, `/v1/nodes` and
//! `/v1/nodes/{node}` require `authorization: Bearer TOKEN` and the grant [`crate::access`]
//! names (`list cacheroutes` — narrowed to the granted namespaces without a cluster-wide grant —,
//! the non-resource URL `/probe`, `list` / `get cachenodes`): 401 without a valid token, 403
//! with the review's reason, 503 when no verdict can be had, each with `{"error": …}`.
//! `/healthz`, `/readyz` and `/metrics` stay open (kubelet, Prometheus).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::access::{AccessError, AccessRequest, CallerAuth, TenantGrant};
use crate::probe::{self, ProbeRequest};
use crate::state::Shared;

/// Largest `/probe` POST body accepted (a probe request is a few hundred bytes).
pub const MAX_PROBE_BODY_BYTES: usize = 16 * 1024;

/// State behind the HTTP handlers.
#[derive(Clone)]
pub struct HttpState {
    /// Shared controller state.
    pub shared: Arc<Shared>,
    /// Set once every listener is bound.
    pub ready: Arc<AtomicBool>,
    /// Caller authentication and authorization of the data-plane reads; `None` serves them
    /// to anyone (standalone on loopback).
    pub access: Option<Arc<CallerAuth>>,
}

fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

fn refused(e: AccessError) -> Response {
    let mut r = (e.http_status(), Json(json!({ "error": e.to_string() }))).into_response();
    if e.http_status() == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

/// Checks `request` for the caller of `headers` (nothing without [`HttpState::access`]).
async fn admit(s: &HttpState, headers: &HeaderMap, request: AccessRequest) -> Result<(), Response> {
    match &s.access {
        None => Ok(()),
        Some(a) => a
            .check(authorization(headers), &request)
            .await
            .map(|_| ())
            .map_err(refused),
    }
}

/// The HTTP router.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/snapshot", get(snapshot))
        .route(
            "/probe",
            get(probe_get)
                .post(probe_post)
                .layer(DefaultBodyLimit::max(MAX_PROBE_BODY_BYTES)),
        )
        .route("/v1/nodes", get(nodes))
        .route("/v1/nodes/{node}", get(node))
        .with_state(state)
}

/// The separate health listener's router (`--health-addr`): only `/healthz` and `/readyz`,
/// answering as on the main HTTP listener; anything else is 404.
pub fn health_router(ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(ready): State<Arc<AtomicBool>>| async move { ready_answer(&ready) }),
        )
        .with_state(ready)
}

fn ready_answer(ready: &AtomicBool) -> Response {
    if ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
    }
}

async fn readyz(State(s): State<HttpState>) -> Response {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
    }
}

async fn metrics(State(s): State<HttpState>) -> Response {
    s.shared.update_heap_gauges();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.shared.metrics.render(),
    )
        .into_response()
}

async fn snapshot(State(s): State<HttpState>, headers: HeaderMap) -> Response {
    let grant = match &s.access {
        None => TenantGrant::All,
        Some(a) => {
            let user = match a.authenticate(authorization(&headers)).await {
                Ok(u) => u,
                Err(e) => return refused(e),
            };
            let tenants = s.shared.index.read().tenants();
            match a.visible_tenants(&user, "list", tenants).await {
                Ok(g) => g,
                Err(e) => return refused(e),
            }
        }
    };
    let doc = s.shared.index.read().snapshot_of(&|t| grant.allows(t));
    Json(doc).into_response()
}

fn probe_access(method: &Method) -> AccessRequest {
    AccessRequest::Path {
        verb: if method == Method::POST {
            "post"
        } else {
            "get"
        },
        path: "/probe",
    }
}

async fn probe_get(
    State(s): State<HttpState>,
    headers: HeaderMap,
    Query(req): Query<ProbeRequest>,
) -> Response {
    if let Err(r) = admit(&s, &headers, probe_access(&Method::GET)).await {
        return r;
    }
    run_probe(s, req).await
}

async fn probe_post(
    State(s): State<HttpState>,
    headers: HeaderMap,
    Query(query): Query<ProbeRequest>,
    body: Bytes,
) -> Response {
    if let Err(r) = admit(&s, &headers, probe_access(&Method::POST)).await {
        return r;
    }
    let req = if body.iter().all(u8::is_ascii_whitespace) {
        query
    } else {
        match serde_json::from_slice::<ProbeRequest>(&body) {
            Ok(r) => r,
            Err(e) => return bad_request(format!("probe request body: {e}")),
        }
    };
    run_probe(s, req).await
}

fn bad_request(message: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
}

async fn run_probe(s: HttpState, req: ProbeRequest) -> Response {
    if let Err(e) = req.validate() {
        return bad_request(format!("probe request: {e}"));
    }
    let shared = s.shared.clone();
    // The probe takes the index write lock briefly: keep it off the async workers.
    let report = tokio::task::spawn_blocking(move || {
        let router = crate::router::Router::new(shared.clone());
        probe::run(&shared, &router, &req)
    })
    .await;
    match report {
        Ok(r) => Json(r).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({ "error": format!("probe task: {e}") })),
        )
            .into_response(),
    }
}

async fn nodes(State(s): State<HttpState>, headers: HeaderMap) -> Response {
    if let Err(r) = admit(&s, &headers, AccessRequest::nodes("list", "")).await {
        return r;
    }
    Json(json!({ "nodes": s.shared.nodes.lock().list() })).into_response()
}

async fn node(
    State(s): State<HttpState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if let Err(r) = admit(&s, &headers, AccessRequest::nodes("get", &name)).await {
        return r;
    }
    match s.shared.nodes.lock().get(&name) {
        Some(n) => Json(n).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no agent for node {name:?} has connected") })),
        )
            .into_response(),
    }
}
