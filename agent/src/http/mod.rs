//! The agent's troubleshooting endpoints: `/healthz`, `/readyz`, `/metrics`, `/v1/report`.
//!
//! - `/healthz`: 200 while the process serves HTTP.
//! - `/readyz`: 200 once the first check pass has finished, else 503.
//! - `/metrics`: Prometheus text format (`inferencecache_agent_…`); also served alone on
//!   `--metrics-addr` (the pod IP in cluster) by [`metrics_router`].
//! - `/v1/report`: the latest pass in the `ic-agent check --json` shape, plus `planGeneration`,
//!   `kvStreams`, `engineCounters` (the engines' latest tier-2 counters per stream) and `link`;
//!   503 before the first pass.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::state::AgentState;

pub mod auth;

/// The HTTP router, every endpoint open.
pub fn router(state: Arc<AgentState>) -> Router {
    router_guarded(state, None)
}

/// The HTTP router; with `token`, `/metrics` and `/v1/report` require it ([`auth`]), while
/// `/healthz` and `/readyz` stay open for the kubelet.
pub fn router_guarded(state: Arc<AgentState>, token: Option<Arc<auth::BearerToken>>) -> Router {
    let protected = guard(
        Router::new()
            .route("/metrics", get(metrics))
            .route("/v1/report", get(report)),
        token,
    );
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(protected)
        .with_state(state)
}

/// A router serving only `/metrics` (for a separate, scrapeable listener), guarded by `token`
/// when given.
pub fn metrics_router(state: Arc<AgentState>, token: Option<Arc<auth::BearerToken>>) -> Router {
    guard(Router::new().route("/metrics", get(metrics)), token).with_state(state)
}

fn guard(
    routes: Router<Arc<AgentState>>,
    token: Option<Arc<auth::BearerToken>>,
) -> Router<Arc<AgentState>> {
    match token {
        Some(t) => routes.route_layer(axum::middleware::from_fn_with_state(t, auth::require)),
        None => routes,
    }
}

async fn readyz(State(s): State<Arc<AgentState>>) -> Response {
    if s.latest.read().is_some() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "first check pass not finished\n",
        )
            .into_response()
    }
}

async fn metrics(State(s): State<Arc<AgentState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        ic_shared::telemetry::encode_metrics(&s.metrics.registry),
    )
        .into_response()
}

async fn report(State(s): State<Arc<AgentState>>) -> Response {
    match s.report_json() {
        Some(doc) => Json(doc).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": "first check pass not finished"})),
        )
            .into_response(),
    }
}
