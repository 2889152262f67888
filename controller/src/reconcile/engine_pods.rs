//! The engine-pod Events controller (spec 000 "Mutating Pod webhook" → Events; "Contract
//! Notes").
//!
//! The Pod webhook cannot record Events (the Pod has no UID at admission), so this Pod-watching
//! controller reads the persisted decision annotations after CREATE and records:
//!
//! | pod annotations | live CacheBackend | Event |
//! |---|---|---|
//! | `injected-by: ns/name` + `injected-by-uid` = live UID | found, UID matches | Normal `InjectedByCacheBackend` |
//! | `injected-by` + `injected-by-uid` ≠ live UID | found | none (forgery or recreated CR) |
//! | `injected-by`, no `injected-by-uid` | — | none (forgery shape) |
//! | `injected-by` | NotFound | none |
//! | `injected-by` | lookup error (not 404) | reconcile error (retried with backoff) |
//! | truthy `skip-inject` + `inject-skipped: skip-inject-annotation` | — | Normal `SkippedByOperator` |
//! | `not-injected: CacheBackend ns/name: reason` (a selected pod the webhook admitted unwired) | — | Warning `NotInjected` with the reason |
//! | only one of the two skip annotations | — | none |
//! | no decision annotation at all, but a CacheBackend of the namespace selects the pod (the webhook never saw it: unreachable, timed out, or the pod predates the backend) | — | Warning `NotInjected` saying so ([`admitted_without_webhook`]) |
//!
//! Each (pod UID, reason) is recorded once, ever: the Event's name is derived from the pod UID
//! and the reason ([`super::cachebackend::events::once_event_name`]), so after a controller
//! restart or a leader change the re-listed pods find their Event (409 AlreadyExists) instead
//! of getting a second one. The in-process set only saves the API call on re-reconciles. A
//! failed create is retried after 30 s. A follower requeues the pods that call for an Event
//! every [`FOLLOWER_RECHECK`] instead of waiting for a change, so a pod admitted while the old
//! leader was failing still gets its Event from the new one.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::crd::CacheBackend;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::{watcher, Controller};
use kube::{Client, Resource};
use parking_lot::Mutex;
use thiserror::Error;

use kube::runtime::reflector::Store;

use super::annotations::{
    INJECTED_BY, INJECTED_BY_UID, INJECT_SKIPPED, INJECT_SKIPPED_BY_ANNOTATION, NOT_INJECTED,
    SKIP_INJECT,
};
use super::cachebackend::events::{reason, EventSink, EventSpec, Recorded};

/// Most (pod UID, reason) pairs remembered before the dedupe set is reset.
const DEDUPE_CAP: usize = 50_000;

/// How often a follower looks again at a pod that would get an Event. The watch delivers each
/// pod once; a follower that merely waited for a change would leave the pods admitted before it
/// gains the Lease without their Event (the old leader may have died first). Only pods whose
/// annotations call for an Event are requeued, and a follower's pass is in memory (no API call).
pub const FOLLOWER_RECHECK: Duration = Duration::from_secs(15);

/// What the controller decided for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodDecision {
    /// Record nothing.
    Skip(&'static str),
    /// Look up CacheBackend `namespace/name` and compare its UID with `uid`.
    VerifyInjection {
        /// Namespace of the named CacheBackend.
        namespace: String,
        /// Its name.
        name: String,
        /// The pod's `injected-by-uid`.
        uid: String,
    },
    /// Record SkippedByOperator.
    SkippedByOperator,
    /// Record a Warning NotInjected with the webhook's reason (the `not-injected` annotation).
    NotInjected(String),
}

/// The skip-inject truthiness, the Pod webhook's own (`annotations::is_truthy`).
pub use crate::reconcile::annotations::is_truthy as truthy;

/// Decides from the pod's annotations alone (pure).
pub fn decide(pod: &Pod) -> PodDecision {
    let Some(a) = pod.metadata.annotations.as_ref() else {
        return PodDecision::Skip("no annotations");
    };
    if let Some(by) = a.get(INJECTED_BY) {
        let Some((namespace, name)) = by
            .split_once('/')
            .filter(|(n, m)| !n.is_empty() && !m.is_empty())
        else {
            return PodDecision::Skip("malformed injected-by");
        };
        let Some(uid) = a.get(INJECTED_BY_UID).filter(|u| !u.trim().is_empty()) else {
            return PodDecision::Skip("injected-by without injected-by-uid");
        };
        return PodDecision::VerifyInjection {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: uid.trim().to_string(),
        };
    }
    if let Some(why) = a.get(NOT_INJECTED).filter(|w| !w.trim().is_empty()) {
        return PodDecision::NotInjected(why.clone());
    }
    let opted_out = a.get(SKIP_INJECT).is_some_and(|v| truthy(v));
    let marked = a.get(INJECT_SKIPPED).map(String::as_str) == Some(INJECT_SKIPPED_BY_ANNOTATION);
    if opted_out && marked {
        PodDecision::SkippedByOperator
    } else {
        PodDecision::Skip("no injection decision")
    }
}

/// Why `pod` is not wired although a CacheBackend of its namespace selects it, when the Pod
/// webhook never decided about it: no decision annotation at all (the webhook writes one on every
/// pod it selects). That happens when the API server admitted the pod without the webhook — the
/// webhook unreachable or past its timeout (it fails open, spec 000 "Fail-open") — or when the
/// pod was created before the CacheBackend. `None` for a pod with a decision, one no backend
/// selects, or one labelled [`WEBHOOK_OPT_OUT`]`=disabled` (pure).
pub fn admitted_without_webhook(pod: &Pod, backends: &[Arc<CacheBackend>]) -> Option<String> {
    // One predicate for "the Pod webhook never decided on this pod": the one
    // `unwiredEnginePods` counts with.
    if !crate::reconcile::cachebackend::engine::admitted_without_webhook(pod) {
        return None;
    }
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let cb = ic_shared::crd::selecting_backends(backends, namespace, &labels)
        .first()
        .copied()?;
    Some(format!(
        "CacheBackend {namespace}/{}: selects this pod, but the Pod webhook did not see it \
         (unreachable or past its timeout when the pod was created, or the pod predates the \
         CacheBackend)",
        cb.metadata.name.as_deref().unwrap_or_default()
    ))
}

/// A failure of the engine-pod Events controller.
#[derive(Debug, Error)]
pub enum PodEventsError {
    /// Looking up the named CacheBackend failed with something other than NotFound.
    #[error("looking up CacheBackend {namespace}/{name}: {source}")]
    Lookup {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Client error.
        #[source]
        source: kube::Error,
    },
}

/// Context of the engine-pod Events controller.
pub struct PodEventsContext {
    /// Kubernetes client (CacheBackend lookups).
    pub client: Client,
    /// Where Events go.
    pub events: Arc<dyn EventSink>,
    /// True while this replica holds the Lease (only the holder records Events).
    pub leader: Arc<std::sync::atomic::AtomicBool>,
    /// Every CacheBackend (a watch-backed store), to find selected pods the webhook never saw
    /// ([`admitted_without_webhook`]); `None` leaves them without an Event.
    pub backends: Option<Store<CacheBackend>>,
    recorded: Mutex<HashSet<(String, &'static str)>>,
}

impl PodEventsContext {
    /// A context publishing to `events` while `leader` is true.
    pub fn new(
        client: Client,
        events: Arc<dyn EventSink>,
        leader: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        PodEventsContext {
            client,
            events,
            leader,
            backends: None,
            recorded: Mutex::new(HashSet::new()),
        }
    }

    /// Also records `NotInjected` on selected pods the webhook never saw, reading CacheBackends
    /// from `backends`.
    pub fn with_backends(mut self, backends: Store<CacheBackend>) -> Self {
        self.backends = Some(backends);
        self
    }

    /// True (and remembered) the first time `(uid, reason)` is seen.
    fn first_time(&self, uid: &str, reason: &'static str) -> bool {
        let mut r = self.recorded.lock();
        if r.len() >= DEDUPE_CAP {
            r.clear();
        }
        r.insert((uid.to_string(), reason))
    }

    /// Forgets `(uid, reason)` so the next reconcile tries again (the publish failed).
    fn forget(&self, uid: &str, reason: &'static str) {
        self.recorded.lock().remove(&(uid.to_string(), reason));
    }
}

/// The Pod controller feeding [`reconcile_engine_pod`] (every Pod; the decision is made from
/// annotations in process).
pub fn controller(client: Client) -> Controller<Pod> {
    Controller::new(Api::<Pod>::all(client), watcher::Config::default())
        .trigger_backoff(super::backoff::watch_backoff())
}

/// Requeue policy after a failed lookup: 30 s.
pub fn error_policy(_pod: Arc<Pod>, err: &PodEventsError, _ctx: Arc<PodEventsContext>) -> Action {
    tracing::warn!(error = %err, "engine-pod events reconcile failed");
    Action::requeue(Duration::from_secs(30))
}

/// Records InjectedByCacheBackend or SkippedByOperator on `pod` per the module table.
///
/// Errors only when the CacheBackend lookup fails with something other than NotFound.
pub async fn reconcile_engine_pod(
    pod: Arc<Pod>,
    ctx: Arc<PodEventsContext>,
) -> Result<Action, PodEventsError> {
    let Some(pod_uid) = pod.metadata.uid.clone() else {
        return Ok(Action::await_change());
    };
    let mut decision = decide(&pod);
    if let (PodDecision::Skip(_), Some(store)) = (&decision, &ctx.backends) {
        if let Some(why) = admitted_without_webhook(&pod, &store.state()) {
            decision = PodDecision::NotInjected(why);
        }
    }
    if let PodDecision::Skip(why) = decision {
        tracing::trace!(why, "no engine-pod event");
        return Ok(Action::await_change());
    }
    if !ctx.leader.load(std::sync::atomic::Ordering::SeqCst) {
        // Not ours to record yet; look again, so that gaining the Lease records what the old
        // leader did not (the Event's derived name makes a duplicate a 409, never a second one).
        return Ok(Action::requeue(FOLLOWER_RECHECK));
    }
    let event = match decision {
        PodDecision::Skip(_) => return Ok(Action::await_change()),
        PodDecision::SkippedByOperator => EventSpec::normal(
            reason::SKIPPED_BY_OPERATOR,
            "Cache wiring skipped: the pod opts out with inferencecache.io/skip-inject.",
        ),
        PodDecision::NotInjected(why) => EventSpec::warning(
            reason::NOT_INJECTED,
            format!(
                "Not wired to the cache: {why}. The pod runs without it; fix the cause and \
                 recreate the pod (kubectl rollout restart its workload)."
            ),
        ),
        PodDecision::VerifyInjection {
            namespace,
            name,
            uid,
        } => {
            // Recorded already by this process: no lookup (every change of every injected pod
            // comes through here).
            if ctx
                .recorded
                .lock()
                .contains(&(pod_uid.clone(), reason::INJECTED_BY_CACHE_BACKEND))
            {
                return Ok(Action::await_change());
            }
            let api: Api<CacheBackend> = Api::namespaced(ctx.client.clone(), &namespace);
            let live = api
                .get_opt(&name)
                .await
                .map_err(|source| PodEventsError::Lookup {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    source,
                })?;
            match live {
                Some(cb) if cb.metadata.uid.as_deref() == Some(uid.as_str()) => EventSpec::normal(
                    reason::INJECTED_BY_CACHE_BACKEND,
                    format!("Engine wired to the cache by CacheBackend {namespace}/{name}."),
                ),
                _ => return Ok(Action::await_change()),
            }
        }
    };
    let reason: &'static str = match event.reason.as_str() {
        reason::SKIPPED_BY_OPERATOR => reason::SKIPPED_BY_OPERATOR,
        reason::NOT_INJECTED => reason::NOT_INJECTED,
        _ => reason::INJECTED_BY_CACHE_BACKEND,
    };
    if ctx.first_time(&pod_uid, reason) {
        let oref = pod.object_ref(&());
        // One Event per pod and reason, ever: its name is derived from the pod UID, so a
        // restarted controller or a new leader re-listing every pod finds it (409) instead of
        // re-creating it.
        match ctx.events.publish_once(&oref, &event).await {
            Ok(Recorded::New) => {}
            Ok(Recorded::AlreadyRecorded) => {
                tracing::debug!(
                    reason,
                    "engine-pod event already recorded by an earlier run"
                )
            }
            Err(err) => {
                ctx.forget(&pod_uid, reason);
                tracing::warn!(error = %err, "publishing engine-pod event failed; retrying later");
                return Ok(Action::requeue(Duration::from_secs(30)));
            }
        }
    }
    Ok(Action::await_change())
}
