//! Kubernetes Events (spec 000 "Contract Notes").
//!
//! Events are emitted only on meaningful transitions, never on steady-state reconciles; the
//! decision of *which* events a reconcile emits is pure (see `status::transitions`); publishing goes
//! through the small [`EventSink`] trait: [`KubeEventSink`] (kube-runtime's `Recorder`,
//! `events.k8s.io/v1`) in the cluster, [`RecordingEventSink`] in tests.

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
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
    /// Warning on a CacheBackend: more selected engine pods than before run without the cache,
    /// admitted without the Pod webhook (`status.unwiredEnginePods` rose).
    pub const ENGINE_PODS_UNWIRED: &str = "EnginePodsUnwired";
    /// Warning on a CacheBackend: an injected engine container entered CrashLoopBackOff.
    pub const INJECTED_ENGINE_CRASH_LOOPING: &str = "InjectedEngineCrashLooping";
    /// Normal on an engine Pod: the webhook's injection claim matches the live CacheBackend.
    pub const INJECTED_BY_CACHE_BACKEND: &str = "InjectedByCacheBackend";
    /// Normal on an engine Pod: explicit `skip-inject` opt-out with the webhook's marker.
    pub const SKIPPED_BY_OPERATOR: &str = "SkippedByOperator";
    /// Warning on an engine Pod: a CacheBackend selects it but the webhook admitted it unwired
    /// (the pod's `not-injected` annotation carries the reason).
    pub const NOT_INJECTED: &str = "NotInjected";
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

/// What [`EventSink::publish_once`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The Event was created.
    New,
    /// An Event with the same name already exists (this controller, an earlier process of it, or
    /// another replica recorded it): nothing was written.
    AlreadyRecorded,
}

/// Where events go.
pub trait EventSink: Send + Sync {
    /// Publishes `event` regarding `object`.
    fn publish<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<(), EventError>>;

    /// Records `event` regarding `object` at most once per (object UID, reason), whatever the
    /// process: the Event's name is [`once_event_name`], so a second create (after a controller
    /// restart or a leader change) is refused by the API server with 409 and reads
    /// [`Recorded::AlreadyRecorded`]. For one-shot facts about an object (spec 000
    /// InjectedByCacheBackend, SkippedByOperator) that must not be re-created on every restart.
    fn publish_once<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<Recorded, EventError>>;
}

/// The deterministic name of the one Event [`EventSink::publish_once`] records for `object`
/// and `reason`: `<object name, at most 200 chars>.<16 hex digits of xxh3(uid "/" reason)>`
/// (a valid DNS subdomain for any valid object name; different objects of the same name, e.g. a
/// recreated pod, get different names because their UIDs differ).
pub fn once_event_name(object: &ObjectReference, reason: &str) -> String {
    let name: String = object
        .name
        .as_deref()
        .unwrap_or("object")
        .chars()
        .take(200)
        .collect();
    let key = format!("{}/{reason}", object.uid.as_deref().unwrap_or_default());
    format!(
        "{}.{:016x}",
        name.trim_end_matches(['.', '-']),
        xxhash_rust::xxh3::xxh3_64(key.as_bytes())
    )
}

/// The most bytes an `events.k8s.io/v1` Event's `note` may hold (the API server's validation
/// counts UTF-8 bytes, not characters: a longer note is refused with 422).
pub const NOTE_LIMIT_BYTES: usize = 1024;

/// `note` cut to at most [`NOTE_LIMIT_BYTES`] bytes on a character boundary.
pub fn note_within_limit(note: &str) -> String {
    if note.len() <= NOTE_LIMIT_BYTES {
        return note.to_string();
    }
    let mut end = NOTE_LIMIT_BYTES;
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note[..end].to_string()
}

/// An [`EventSink`] backed by kube-runtime's `Recorder` (`events.k8s.io/v1`, with its
/// client-side series aggregation).
pub struct KubeEventSink {
    recorder: Recorder,
    client: Client,
    reporter: Reporter,
}

impl KubeEventSink {
    /// A sink reporting as `controller` (e.g. `inference-cache-controller`) from `instance`
    /// (the pod name, when known).
    pub fn new(client: Client, controller: &str, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: controller.to_string(),
            instance,
        };
        KubeEventSink {
            recorder: Recorder::new(client.clone(), reporter.clone()),
            client,
            reporter,
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
                note: Some(note_within_limit(&event.note)),
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

    fn publish_once<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<Recorded, EventError>> {
        Box::pin(async move {
            let namespace = object.namespace.clone().unwrap_or_else(|| "default".into());
            let ev = K8sEvent {
                metadata: ObjectMeta {
                    name: Some(once_event_name(object, &event.reason)),
                    namespace: Some(namespace.clone()),
                    ..Default::default()
                },
                action: Some(event.action.clone()),
                reason: Some(event.reason.clone()),
                note: Some(note_within_limit(&event.note)),
                event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
                regarding: Some(object.clone()),
                reporting_controller: Some(self.reporter.controller.clone()),
                reporting_instance: Some(
                    self.reporter
                        .instance
                        .clone()
                        .unwrap_or_else(|| self.reporter.controller.clone()),
                ),
                type_: Some(
                    match event.kind {
                        EventKind::Normal => "Normal",
                        EventKind::Warning => "Warning",
                    }
                    .to_string(),
                ),
                ..Default::default()
            };
            let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
            match api.create(&PostParams::default(), &ev).await {
                Ok(_) => Ok(Recorded::New),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    Ok(Recorded::AlreadyRecorded)
                }
                Err(source) => Err(EventError::Publish {
                    reason: event.reason.clone(),
                    source,
                }),
            }
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
    once_names: Mutex<std::collections::HashSet<String>>,
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

impl RecordingEventSink {
    fn record(&self, object: &ObjectReference, event: &EventSpec) {
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
    }
}

impl EventSink for RecordingEventSink {
    fn publish<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<(), EventError>> {
        self.record(object, event);
        Box::pin(async { Ok(()) })
    }

    /// Like the API server: a second Event of the same [`once_event_name`] is refused.
    fn publish_once<'a>(
        &'a self,
        object: &'a ObjectReference,
        event: &'a EventSpec,
    ) -> BoxFuture<'a, Result<Recorded, EventError>> {
        let fresh = self
            .once_names
            .lock()
            .insert(once_event_name(object, &event.reason));
        if fresh {
            self.record(object, event);
        }
        Box::pin(async move {
            Ok(if fresh {
                Recorded::New
            } else {
                Recorded::AlreadyRecorded
            })
        })
    }
}
