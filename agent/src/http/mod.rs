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

/// The HTTP router.
pub fn router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/report", get(report))
        .with_state(state)
}

/// A router serving only `/metrics` (for a separate, scrapeable listener).
pub fn metrics_router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
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
