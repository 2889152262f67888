//! Kubernetes Events (spec 000 "Contract Notes").
//!
//! Events are emitted only on meaningful transitions, never on steady-state reconciles; the
//! decision of *which* events a reconcile emits is pure (see `status::evaluate`); publishing goes
//! through the small [`EventSink`] trait: [`KubeEventSink`] (kube-runtime's `Recorder`,
//! `events.k8s.io/v1`) in the cluster, [`RecordingEventSink`] in tests.

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Client;
use parking_lot::Mutex;
use thiserror::Error;

/// Event reasons (CamelCase, as `kubectl describe` shows them).
pub mod reason {
    /// Warning on a CacheBackend: entered Degraded=True/ReplicasUnavailable.
    pub const BACKEND_DEGRADED: &str = "BackendDegraded";
    /// Normal on a CacheBackend: back to Ready=True (not from the KV-event gate's reasons).
    pub const BACKEND_RECOVERED: &str = "BackendRecovered";
    /// Warning on a CacheBackend: `integration.failOpen` set to false.
    pub const FAIL_CLOSED_ENABLED: &str = "FailClosedEnabled";
    /// Normal on a CacheBackend: `integration.failOpen` back to true.
    pub const FAIL_OPEN_RESTORED: &str = "FailOpenRestored";
    /// Normal on a CacheBackend: entered Ready=False/AwaitingFirstKVEvent.
    pub const AWAITING_FIRST_KV_EVENT: &str = "AwaitingFirstKVEvent";
    /// Normal on a CacheBackend: the first KV event was observed (latch set).
    pub const KV_EVENTS_OBSERVED: &str = "KVEventsObserved";
    /// Warning on a CacheBackend: no KV event within firstEventTimeout.
    pub const NO_KV_EVENTS_OBSERVED: &str = "NoKVEventsObserved";
    /// Normal on a CacheBackend: the engine selector matches no pods while some are expected.
    pub const ENGINE_SELECTOR_UNMATCHED: &str = "EngineSelectorUnmatched";
    /// Warning on a CacheBackend: an injected engine container entered CrashLoopBackOff.
    pub const INJECTED_ENGINE_CRASH_LOOPING: &str = "InjectedEngineCrashLooping";
    /// Normal on an engine Pod: the webhook's injection claim matches the live CacheBackend.
    pub const INJECTED_BY_CACHE_BACKEND: &str = "InjectedByCacheBackend";
    /// Normal on an engine Pod: explicit `skip-inject` opt-out with the webhook's marker.
    pub const SKIPPED_BY_OPERATOR: &str = "SkippedByOperator";
}

/// Event severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// Informational.
    Normal,
    /// Needs attention.
    Warning,
}

/// One event to publish on an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSpec {
    /// Severity.
    pub kind: EventKind,
    /// CamelCase reason, one of [`reason`].
    pub reason: String,
    /// Human-readable message (at most 1 kB).
    pub note: String,
    /// CamelCase action the controller took or observed (`Reconcile`, `Observe`, …).
    pub action: String,
}

impl EventSpec {
    /// A Normal event.
    pub fn normal(reason: &str, note: impl Into<String>) -> Self {
        EventSpec {
            kind: EventKind::Normal,
            reason: reason.to_string(),
            note: note.into(),
            action: "Reconcile".to_string(),
        }
    }

    /// A Warning event.
    pub fn warning(reason: &str, note: impl Into<String>) -> Self {
        EventSpec {
            kind: EventKind::Warning,
            reason: reason.to_string(),
            note: note.into(),
            action: "Reconcile".to_string(),
        }
    }
}

/// Publishing failed.
#[derive(Debug, Error)]
pub enum EventError {
    /// The API server rejected the Event.
    #[error("publishing event {reason}: {source}")]
    Publish {
        /// The event's reason.
        reason: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// Where events go.
pub trait EventSink: Send + Sync {
    /// Publishes `event` regarding `object`.
    fn publish<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<(), EventError>>;
}

/// An [`EventSink`] backed by kube-runtime's `Recorder` (`events.k8s.io/v1`, with its
/// client-side series aggregation).
pub struct KubeEventSink {
    recorder: Recorder,
}

impl KubeEventSink {
    /// A sink reporting as `controller` (e.g. `inference-cache-controller`) from `instance`
    /// (the pod name, when known).
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> Self {
        KubeEventSink {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: controller.to_string(),
                    instance,
                },
            ),
        }
    }
}

impl EventSink for KubeEventSink {
    fn publish<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<(), EventError>> {
        Box::pin(async move {
            let ev = Event {
                type_: match event.kind {
                    EventKind::Normal => EventType::Normal,
                    EventKind::Warning => EventType::Warning,
                },
                reason: event.reason.clone(),
                note: Some(event.note.chars().take(1024).collect()),
                action: event.action.clone(),
                secondary: None,
            };
            self.recorder
                .publish(&ev, object)
                .await
                .map_err(|source| EventError::Publish {
                    reason: event.reason.clone(),
                    source,
                })
        })
    }
}

/// One event a [`RecordingEventSink`] received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedEvent {
    /// `kind` of the regarding object.
    pub object_kind: String,
    /// `namespace/name` of the regarding object.
    pub object: String,
    /// UID of the regarding object (empty when unknown).
    pub object_uid: String,
    /// The event.
    pub event: EventSpec,
}

/// An in-memory [`EventSink`] for tests.
#[derive(Debug, Default)]
pub struct RecordingEventSink {
    events: Mutex<Vec<RecordedEvent>>,
}

impl RecordingEventSink {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<RecordedEvent> {
        self.events.lock().clone()
    }

    /// Every event so far, then forgets them.
    pub fn take(&self) -> Vec<RecordedEvent> {
        std::mem::take(&mut *self.events.lock())
    }

    /// The reasons of every event so far, in order.
    pub fn reasons(&self) -> Vec<String> {
        self.events
            .lock()
            .iter()
            .map(|e| e.event.reason.clone())
            .collect()
    }

    /// How many events with `reason` were recorded.
    pub fn count(&self, reason: &str) -> usize {
        self.events
            .lock()
            .iter()
            .filter(|e| e.event.reason == reason)
            .count()
    }
}

impl EventSink for RecordingEventSink {
    fn publish<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<(), EventError>> {
        self.events.lock().push(RecordedEvent {
            object_kind: object.kind.clone().unwrap_or_default(),
            object: format!(
                "{}/{}",
                object.namespace.as_deref().unwrap_or_default(),
                object.name.as_deref().unwrap_or_default()
            ),
            object_uid: object.uid.clone().unwrap_or_default(),
            event: event.clone(),
        });
        Box::pin(async { Ok(()) })
    }
}
