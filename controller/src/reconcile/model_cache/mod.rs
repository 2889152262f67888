//! The model-cache binding controller (spec 004 "Runtime flow", "Cache binding", "Readers",
//! "Failure rules"; issue 8 deliverable 3).
//!
//! Pure decisions live in [`decide`] (gates, selection, drift, binding choice, references,
//! lifecycle, writer election), [`names`] (digests and owned-object names) and [`render`]
//! (writer claim / Job / Lease, derived reader PV and claim, encryption objects); [`plan`] maps
//! bound caches and pods to node-plan reader mounts. The thin kube layer is
//! [`request::reconcile_request`] (one `ModelCache`) and [`binding::reconcile_binding`] (one
//! `ModelCacheBinding`'s lifecycle), plus [`binding::strip_binding_finalizers`] for uninstall.
//!
//! # Runtime flow of a request
//!
//! 1. Gates: `CachingSupport` off → mode `none`; `helmModelCache` with `HelmModelCaching`
//!    off → `none`; `durability: Ephemeral` → `ephemeral`. Recorded, no binding.
//! 2. The cache StorageClass ([`ModelCacheConfig::storage_class`]) must exist with reclaim
//!    policy `Retain`; the catalog ConfigMap is loaded; the provisioner's entry derives the flow.
//!    No derivable flow → mode `ephemeral` with the reason. A durable selection is recorded on
//!    the request (`status.selection`) first; if a later pass (no binding yet) derives anything
//!    else, the request fails `ConfigurationDrifted` before any side effect.
//! 3. Get or create the binding for (workflow, sharing domain, cache handle) in the control
//!    namespace: the `Active` one is joined whatever the catalog says now; `Retiring` ones are
//!    never joined (a new generation is created).
//! 4. The request reference (namespace, name, UID) is added to the binding — with the names of
//!    reader objects for namespaces the binding does not name yet — and then the binding's name
//!    and UID are persisted on the request (`status.binding`, mode `durable`). A request with
//!    no recorded binding whose UID an `Active` binding of its identity already holds (that
//!    write failed) finishes this step with that binding before steps 1–3, whatever the gates
//!    or the catalog say now (step 6). Only then:
//! 5. The flow, from the binding's recorded decision only: the writer Lease elects one request;
//!    its writer claim and Job fill the volume; when the Job succeeded and the claim is bound,
//!    each reader namespace gets a reader PV derived from the writer's PV and a claim pre-bound
//!    to it by name.
//! 6. Catalog, feature-flag and StorageClass changes after step 4 never alter a binding: only the
//!    recorded decision is read. A replaced StorageClass (UID differs) stops provisioning with
//!    `StorageClassChanged` instead.
//!
//! # Binding lifecycle
//!
//! References whose request is gone (or recreated with another UID), or recorded something else
//! as final (mode `none`/`ephemeral`, another binding), are pruned; zero references
//! past [`ModelCacheConfig::idle_period`] → `Retiring` → every object the binding names is
//! deleted if it still carries the binding's label and UID annotation (anything else is foreign:
//! never adopted, never deleted), each delete preconditioned on the UID and resourceVersion that
//! were read, a claim or PV only while its volume still `Retain`s → `Released` written (with
//! `status.releaseSkipped` for whatever was kept) → the finalizer is dropped and the binding
//! deleted. A binding being deleted is `Retiring` at once but released the same way only: zero
//! live references past the idle period. Transient API errors return [`Error`] before any
//! further write (the runtime requeues; nothing is half-decided).
//!
//! # Uninstall
//!
//! [`binding::strip_binding_finalizers`] creates [`UNINSTALL_MARKER`] first; while it exists no
//! binding is created (a create that raced it strips its own finalizer), so none can appear after
//! the strip.
//!
//! # Wiring into `ic-controller run`
//!
//! ```ignore
//! let ctx = Arc::new(model_cache::Context::new(client.clone(), ModelCacheConfig::default(), Arc::new(SystemClock), leader));
//! tokio::spawn(model_cache::run(ctx));   // ModelCache and ModelCacheBinding controllers
//! ```
//!
//! The controller needs RBAC for: modelcaches (get/list/watch, status patch), modelcachebindings
//! (all verbs, status), persistentvolumeclaims, persistentvolumes, jobs, leases, secrets (control
//! namespace), storageclasses (get/create/delete), configmaps (get, catalog namespace; get of
//! the uninstall marker, control namespace).

pub mod binding;
pub mod decide;
pub mod names;
pub mod plan;
pub mod render;
pub mod request;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ic_shared::crd::{ModelCache, ModelCacheBinding};
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::{watcher, Controller};
use kube::Client;
use thiserror::Error;

use super::clock::Clock;
pub use binding::{reconcile_binding, strip_binding_finalizers, uninstalling, UNINSTALL_MARKER};
pub use decide::FeatureFlags;
pub use request::reconcile_request;

/// Default control namespace of bindings, writer Leases and `helmModelCache` writers (the
/// spec's `nvca-modelcache-init`).
pub const DEFAULT_CONTROL_NAMESPACE: &str = "inference-cache-model-cache";
/// Default cache StorageClass (the spec's `nvcf-sc`).
pub const DEFAULT_STORAGE_CLASS: &str = "inference-cache-model-cache";
/// Default namespace of the catalog ConfigMap (the chart's release namespace).
pub const DEFAULT_CATALOG_NAMESPACE: &str = "inference-cache";

/// Names and cadences the model cache reads. The spec borrows the StorageClass, ConfigMap,
/// control namespace and flag names from another product; here they are configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCacheConfig {
    /// Namespace of bindings, Leases, `helmModelCache` writers and key Secrets.
    pub control_namespace: String,
    /// The cache StorageClass (must `Retain`).
    pub storage_class: String,
    /// Namespace of the catalog ConfigMap.
    pub catalog_namespace: String,
    /// Name of the catalog ConfigMap.
    pub catalog_config_map: String,
    /// Data key of the catalog in it.
    pub catalog_key: String,
    /// Feature flags.
    pub flags: FeatureFlags,
    /// How long a binding may have zero references before it retires (default 1 h).
    pub idle_period: Duration,
    /// Writer Lease duration: how long an elected writer that never created its Job blocks
    /// others (default 10 min).
    pub writer_lease_duration: Duration,
    /// Service account of writer Jobs in the control namespace (token automount off).
    pub writer_service_account: String,
    /// Requeue while something is in progress (default 15 s).
    pub pending_requeue: Duration,
    /// Requeue when settled (default 5 min).
    pub steady_requeue: Duration,
}

impl Default for ModelCacheConfig {
    fn default() -> Self {
        ModelCacheConfig {
            control_namespace: DEFAULT_CONTROL_NAMESPACE.to_string(),
            storage_class: DEFAULT_STORAGE_CLASS.to_string(),
            catalog_namespace: DEFAULT_CATALOG_NAMESPACE.to_string(),
            catalog_config_map: crate::catalog::DEFAULT_CONFIG_MAP.to_string(),
            catalog_key: crate::catalog::DEFAULT_KEY.to_string(),
            flags: FeatureFlags::default(),
            idle_period: Duration::from_secs(3600),
            writer_lease_duration: Duration::from_secs(600),
            writer_service_account: "default".to_string(),
            pending_requeue: Duration::from_secs(15),
            steady_requeue: Duration::from_secs(300),
        }
    }
}

/// What both reconcilers share.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Names, flags, cadences.
    pub config: ModelCacheConfig,
    /// The clock (idle period, Lease times, condition times).
    pub clock: Arc<dyn Clock>,
    /// True while this replica holds the controller Lease: only then does it write.
    pub leader: Arc<AtomicBool>,
}

impl Context {
    /// A context.
    pub fn new(
        client: Client,
        config: ModelCacheConfig,
        clock: Arc<dyn Clock>,
        leader: Arc<AtomicBool>,
    ) -> Self {
        Context {
            client,
            config,
            clock,
            leader,
        }
    }

    /// True when this replica may write.
    pub fn can_write(&self) -> bool {
        self.leader.load(Ordering::Relaxed)
    }
}

/// Errors of a reconcile pass. Every one leaves state as it was (no half-applied decision):
/// the runtime requeues after [`error_policy`]'s delay.
#[derive(Debug, Error)]
pub enum Error {
    /// A Kubernetes API call failed (transient or conflict).
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The object has no namespace or name.
    #[error("object has no {0}")]
    MissingMeta(&'static str),
    /// JSON (de)serialization.
    #[error("serialization: {0}")]
    Serde(#[from] serde_json::Error),
    /// Randomness for an encryption key was unavailable.
    #[error("no randomness for the cache key")]
    Random,
    /// Uninstall must stop: a binding's finalizer could not be removed.
    #[error(
        "uninstall stopped: cannot remove the finalizer of ModelCacheBinding {name}: {source}"
    )]
    StripFinalizer {
        /// Binding name.
        name: String,
        /// The API error.
        source: kube::Error,
    },
    /// Uninstall must stop: bindings with finalizers kept appearing after the uninstall marker
    /// was created (a controller that does not honour it).
    #[error("uninstall stopped: ModelCacheBindings with finalizers still appear after {rounds} strip rounds; is an older controller still running?")]
    StillCreating {
        /// Rounds made.
        rounds: usize,
    },
}

impl Error {
    /// Stable metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::MissingMeta(_) => "missing_meta",
            Error::Serde(_) => "serde",
            Error::Random => "random",
            Error::StripFinalizer { .. } => "strip_finalizer",
            Error::StillCreating { .. } => "still_creating",
        }
    }
}

/// True for a 404 API error.
pub(crate) fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// True for a 409 API error (already exists, or a stale resourceVersion).
pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Requeue after a write lost an optimistic-concurrency race (409): the other writer's change
/// is already stored, so a fresh read can go at once. On the real apiserver the request and
/// binding reconcilers race on a binding's status about once per binding; a flat 15 s made every
/// new cache wait for it.
pub const CONFLICT_REQUEUE: Duration = Duration::from_secs(1);

/// Requeue policy for both reconcilers, state unchanged: [`CONFLICT_REQUEUE`] after a 409
/// (logged at DEBUG: it is expected), 15 s after any other error.
pub fn error_policy<K>(_obj: Arc<K>, err: &Error, _ctx: Arc<Context>) -> Action {
    if matches!(err, Error::Kube(e) if is_conflict(e)) {
        tracing::debug!(error = %err, "model-cache write lost a race; re-reading");
        return Action::requeue(CONFLICT_REQUEUE);
    }
    tracing::warn!(error = %err, kind = err.label(), "model-cache reconcile failed; requeue");
    Action::requeue(Duration::from_secs(15))
}

/// The binding a request's `status.binding` names (in `control_namespace`), for the binding
/// controller's watch of requests.
pub fn binding_of_request(
    request: &ModelCache,
    control_namespace: &str,
) -> Option<kube::runtime::reflector::ObjectRef<ModelCacheBinding>> {
    let name = &request.status.as_ref()?.binding.as_ref()?.name;
    Some(kube::runtime::reflector::ObjectRef::new(name).within(control_namespace))
}

/// Runs the `ModelCache` controller (all namespaces) and the `ModelCacheBinding` controller
/// (control namespace) until both streams end.
pub async fn run(ctx: Arc<Context>) {
    let requests: Api<ModelCache> = Api::all(ctx.client.clone());
    let bindings: Api<ModelCacheBinding> =
        Api::namespaced(ctx.client.clone(), &ctx.config.control_namespace);
    let a = Controller::new(requests, watcher::Config::default())
        .trigger_backoff(crate::reconcile::backoff::watch_backoff())
        .run(reconcile_request, error_policy, ctx.clone())
        .for_each(|_| async {});
    // A request's change (its deletion above all) reaches its binding at once: the binding
    // otherwise noticed a deleted request only at its next steady pass, up to 5 min later,
    // and its idle period started that much late (seen on the real apiserver).
    let control_namespace = ctx.config.control_namespace.clone();
    let b = Controller::new(bindings, watcher::Config::default())
        .watches(
            Api::<ModelCache>::all(ctx.client.clone()),
            watcher::Config::default(),
            move |request: ModelCache| binding_of_request(&request, &control_namespace),
        )
        .trigger_backoff(crate::reconcile::backoff::watch_backoff())
        .run(reconcile_binding, error_policy, ctx)
        .for_each(|_| async {});
    futures::join!(a, b);
}
