//! Starts the two controllers of this module on a real client: the CacheBackend reconciler
//! ([`crate::reconcile::cachebackend::controller`] → [`crate::reconcile::reconcile`]) and the
//! engine-pod Events controller ([`crate::reconcile::engine_pods`]), both publishing Events
//! through kube-runtime's `Recorder` and writing only while the leader flag is set.
//!
//! `ic-controller run` calls [`run_controllers`] from its reconciler integration point:
//!
//! ```ignore
//! let task = tokio::spawn(run_controllers(Controllers {
//!     client: ctx.client.clone(),
//!     index: ctx.shared.clone(),
//!     clock: ctx.clock.clone(),
//!     leader: ctx.leader_flag.clone(),
//!     prober: None,
//!     instance: std::env::var("POD_NAME").ok(),
//! }, ctx.shutdown.clone()));
//! ```

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use futures::StreamExt;
use kube::Client;
use tokio::sync::watch;

use super::cachebackend::events::{EventSink, KubeEventSink};
use super::cachebackend::index_view::IndexView;
use super::cachebackend::probe::Prober;
use super::cachebackend::{self, Context};
use super::clock::Clock;
use super::engine_pods::{self, PodEventsContext};

/// `reportingController` of the Events this module publishes.
pub const REPORTING_CONTROLLER: &str = "inference-cache-controller";

/// What the controllers need.
pub struct Controllers {
    /// Kubernetes client.
    pub client: Client,
    /// The in-process index (`Arc<crate::state::Shared>` coerces to it).
    pub index: Arc<dyn IndexView>,
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// True while this replica holds the Lease.
    pub leader: Arc<AtomicBool>,
    /// The functional prober; `None` turns the probe gate off.
    pub prober: Option<Arc<dyn Prober>>,
    /// `reportingInstance` of published Events (the pod name, when known).
    pub instance: Option<String>,
}

async fn until_true(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Logs what a Controller's output stream says went wrong: a watch failure (the controller is
/// blind until it re-lists) at WARN, a failed reconcile (already logged with its reason by the
/// error policy) at DEBUG.
fn log_stream_error<E: std::error::Error + 'static>(
    what: &'static str,
    err: Option<kube::runtime::controller::Error<E, kube::runtime::watcher::Error>>,
) {
    match err {
        Some(e @ kube::runtime::controller::Error::QueueError(_)) => {
            tracing::warn!(error = %e, "{what}: watch failed; re-listing with back-off")
        }
        Some(e) => tracing::debug!(error = %e, "{what}"),
        None => {}
    }
}

/// Runs both controllers until `shutdown` turns true (or its sender goes away), then lets
/// in-flight reconciles finish.
pub async fn run_controllers(c: Controllers, shutdown: watch::Receiver<bool>) {
    let sink: Arc<dyn EventSink> = Arc::new(KubeEventSink::new(
        c.client.clone(),
        REPORTING_CONTROLLER,
        c.instance.clone(),
    ));
    let mut ctx = Context::new(
        c.client.clone(),
        c.index,
        sink.clone(),
        c.clock,
        c.leader.clone(),
    );
    if let Some(p) = c.prober {
        ctx = ctx.with_prober(p);
    }
    let backends = cachebackend::controller(c.client.clone());
    // The CacheBackend controller's own watch-backed store: the Pod controller finds selected
    // pods the webhook never saw in it.
    let backend_store = backends.store();
    let backends = backends
        .graceful_shutdown_on(until_true(shutdown.clone()))
        .run(
            cachebackend::reconcile,
            cachebackend::error_policy,
            Arc::new(ctx),
        )
        .for_each(|r| async move {
            log_stream_error("CacheBackend controller", r.err());
        });
    let pods_ctx = Arc::new(
        PodEventsContext::new(c.client.clone(), sink, c.leader).with_backends(backend_store),
    );
    let pods = engine_pods::controller(c.client)
        .graceful_shutdown_on(until_true(shutdown))
        .run(
            engine_pods::reconcile_engine_pod,
            engine_pods::error_policy,
            pods_ctx,
        )
        .for_each(|r| async move {
            log_stream_error("engine-pod Events controller", r.err());
        });
    futures::join!(backends, pods);
}
