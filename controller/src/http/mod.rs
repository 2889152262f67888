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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

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

async fn readyz(State(s): State<HttpState>) -> Response {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
    }
}

async fn metrics(State(s): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.shared.metrics.render(),
    )
        .into_response()
}

async fn snapshot(State(s): State<HttpState>) -> Response {
    Json(s.shared.index.read().snapshot()).into_response()
}

async fn probe_get(State(s): State<HttpState>, Query(req): Query<ProbeRequest>) -> Response {
    run_probe(s, req).await
}

async fn probe_post(
    State(s): State<HttpState>,
    Query(query): Query<ProbeRequest>,
    body: Bytes,
) -> Response {
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

async fn nodes(State(s): State<HttpState>) -> Response {
    Json(json!({ "nodes": s.shared.nodes.lock().list() })).into_response()
}

async fn node(State(s): State<HttpState>, Path(name): Path<String>) -> Response {
    match s.shared.nodes.lock().get(&name) {
        Some(n) => Json(n).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no agent for node {name:?} has connected") })),
        )
            .into_response(),
    }
}
