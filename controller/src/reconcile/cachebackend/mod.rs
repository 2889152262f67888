//! The CacheBackend reconciler (DESIGN.md "Reconcile"; spec 000 "Status", "Conditions",
//! "Contract Notes", "Events-only mode").
//!
//! [`reconcile`] is the kube-runtime-style entry point: it **reads** (the live CacheBackend,
//! its owned Deployment / StatefulSet / Service / HPA, the namespace's Pods, Deployments and
//! CacheBackends, the in-process index), calls the **pure** functions ([`crate::reconcile::render`]
//! for the desired children, [`status::evaluate`] for status, conditions, Events and the cascade
//! decision), and **writes** (server-side apply of children, deletion of children an earlier
//! mode left, the cascade-restart patch, a status merge patch, Events). Only the Lease holder
//! writes ([`Context::can_write`]); a follower computes and requeues.
//!
//! # Wiring it into `ic-controller run`
//!
//! ```ignore
//! let ctx = Arc::new(Context::new(client.clone(), shared.clone(), sink, Arc::new(SystemClock), leader_flag)
//!     .with_prober(prober));
//! controller(client.clone())          // watches CacheBackends + owned Deployments, StatefulSets, Services, HPAs
//!     .run(reconcile, error_policy, ctx)
//!     .for_each(|_| async {}).await;
//! ```
//!
//! Engine Pods are *not* watched by this controller: they are listed at reconcile cadence
//! (requeue 30 s, 5 s while the matched pod count differs from the desired replicas). The
//! engine-pod Events controller ([`crate::reconcile::engine_pods`]) is a separate Pod
//! controller.

pub mod cascade;
pub mod endpoint;
pub mod engine;
pub mod events;
pub mod host_tier;
pub mod index_view;
pub mod metrics;
pub mod path;
pub mod probe;
pub mod status;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_shared::crd::{CacheBackend, CacheBackendStatus};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::NamespaceResourceScope;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::{watcher, Controller};
use kube::{Client, Resource, ResourceExt};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use thiserror::Error;

use self::events::EventSink;
use self::index_view::IndexView;
use self::metrics::BackendMetrics;
use self::probe::{ProbeInput, Prober};
use self::status::{evaluate, Memory, Observed, Settings, WorkloadState};
use super::clock::Clock;
use super::render::{self, label_value, RenderError, Rendered, Workload, LABEL_BACKEND};

/// Field manager of every server-side apply and patch the reconciler sends.
pub const FIELD_MANAGER: &str = "inference-cache-controller";

/// A reconcile failure. Each variant names the failing call site; [`Error::metric_label`]
/// gives a stable label.
#[derive(Debug, Error)]
pub enum Error {
    /// The CacheBackend lacks a metadata field (`namespace`, `uid`).
    #[error("CacheBackend has no metadata.{0}")]
    MissingMetadata(&'static str),
    /// Reading objects failed.
    #[error("reading {what} in namespace {namespace}: {source}")]
    Read {
        /// What was read.
        what: &'static str,
        /// Namespace.
        namespace: String,
        /// Client error.
        #[source]
        source: kube::Error,
    },
    /// Server-side apply of an owned object failed.
    #[error("applying {kind} {namespace}/{name}: {source}")]
    Apply {
        /// Object kind.
        kind: &'static str,
        /// Namespace.
        namespace: String,
        /// Object name.
        name: String,
        /// Client error.
        #[source]
        source: kube::Error,
    },
    /// Deleting an owned object left from an earlier mode failed.
    #[error("deleting {kind} {namespace}/{name}: {source}")]
    Delete {
        /// Object kind.
        kind: &'static str,
        /// Namespace.
        namespace: String,
        /// Object name.
        name: String,
        /// Client error.
        #[source]
        source: kube::Error,
    },
    /// Patching the restart trigger onto an engine Deployment failed.
    #[error("cascade-restarting engine Deployment {namespace}/{name}: {source}")]
    Cascade {
        /// Namespace.
        namespace: String,
        /// Deployment name.
        name: String,
        /// Client error.
        #[source]
        source: kube::Error,
    },
    /// Writing the status failed (409 on a concurrent write included).
    #[error("writing status of CacheBackend {namespace}/{name}: {source}")]
    Status {
        /// Namespace.
        namespace: String,
        /// CacheBackend name.
        name: String,
        /// Client error.
        #[source]
        source: kube::Error,
    },
    /// Serializing a patch failed.
    #[error("serializing a patch: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The desired children could not be rendered.
    #[error(transparent)]
    Render(#[from] RenderError),
}

impl Error {
    /// Stable metric label (`read`, `apply`, `delete`, `cascade`, `status`, `serialize`,
    /// `render`, `metadata`).
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::MissingMetadata(_) => "metadata",
            Error::Read { .. } => "read",
            Error::Apply { .. } => "apply",
            Error::Delete { .. } => "delete",
            Error::Cascade { .. } => "cascade",
            Error::Status { .. } => "status",
            Error::Serialize(_) => "serialize",
            Error::Render(_) => "render",
        }
    }
}

/// What the reconciler needs: the client, the index, the Event sink, the clock, the optional
/// functional prober, and the leader flag. Shared by every reconcile (`Arc<Context>`); holds
/// the in-process per-backend memory (probe and cascade rate limits, last path).
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// The in-process prefix index (`crate::state::Shared` implements [`IndexView`]).
    pub index: Arc<dyn IndexView>,
    /// Where Events go.
    pub events: Arc<dyn EventSink>,
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// The functional prober; `None` turns the probe gate off (spec `--server-probe-url=""`).
    pub prober: Option<Arc<dyn Prober>>,
    /// True while this replica holds the Lease: only then are children, status and Events
    /// written.
    pub leader: Arc<AtomicBool>,
    /// Cadences and rate limits.
    pub settings: Settings,
    memory: Mutex<HashMap<String, (String, Memory)>>,
    metrics: Option<BackendMetrics>,
}

impl Context {
    /// A context with the default [`Settings`] and no prober. `leader` is read on every
    /// reconcile (set it from the Lease; `true` for a single replica). The reconciler's gauges
    /// ([`BackendMetrics`]) join the registry `index` serves, when it has one (the controller's
    /// shared state: its `/metrics`); otherwise they are kept unregistered.
    pub fn new(
        client: Client,
        index: Arc<dyn IndexView>,
        events: Arc<dyn EventSink>,
        clock: Arc<dyn Clock>,
        leader: Arc<AtomicBool>,
    ) -> Self {
        let metrics = match index.metrics_registry() {
            Some(registry) => BackendMetrics::register(&registry)
                .map_err(|e| {
                    tracing::warn!(error = %e, "CacheBackend gauges not registered (already registered by another context?)")
                })
                .ok(),
            None => None,
        }
        .or_else(|| BackendMetrics::unregistered().ok());
        Context {
            client,
            index,
            events,
            clock,
            prober: None,
            leader,
            settings: Settings::default(),
            memory: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// Registers the reconciler's gauges in `registry` instead.
    ///
    /// # Errors
    /// When they are already registered there.
    pub fn with_metrics(
        mut self,
        registry: &prometheus::Registry,
    ) -> Result<Self, prometheus::Error> {
        self.metrics = Some(BackendMetrics::register(registry)?);
        Ok(self)
    }

    /// The reconciler's gauges.
    pub fn metrics(&self) -> Option<&BackendMetrics> {
        self.metrics.as_ref()
    }

    /// Turns the functional-probe gate on with `prober`.
    pub fn with_prober(mut self, prober: Arc<dyn Prober>) -> Self {
        self.prober = Some(prober);
        self
    }

    /// Replaces the cadences and rate limits.
    pub fn with_settings(mut self, settings: Settings) -> Self {
        self.settings = settings;
        self
    }

    /// Whether this replica may write (holds the Lease).
    pub fn can_write(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    /// The remembered state of backend `key` (`ns/name`), reset when its UID changed (the CR
    /// was recreated).
    fn recall(&self, key: &str, uid: &str) -> Memory {
        match self.memory.lock().get(key) {
            Some((u, m)) if u == uid => *m,
            _ => Memory::default(),
        }
    }

    fn remember(&self, key: &str, uid: &str, m: Memory) {
        self.memory
            .lock()
            .insert(key.to_string(), (uid.to_string(), m));
    }

    /// Forgets a backend (call when it is deleted), its gauges included.
    pub fn forget(&self, key: &str) {
        self.memory.lock().remove(key);
        if let Some(m) = &self.metrics {
            m.forget(key);
        }
    }
}

/// The Controller for CacheBackends: watches CacheBackends and the objects they own
/// (Deployments, StatefulSets, Services, HPAs carrying the `inferencecache.io/cachebackend`
/// label). Run it with [`reconcile`] and [`error_policy`]. Engine pods are listed inside
/// [`reconcile`] at its requeue cadence rather than watched. Watch errors back off with
/// [`super::backoff::watch_backoff`].
pub fn controller(client: Client) -> Controller<CacheBackend> {
    let owned = || watcher::Config::default().labels(LABEL_BACKEND);
    Controller::new(
        Api::<CacheBackend>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(Api::<Deployment>::all(client.clone()), owned())
    .owns(Api::<StatefulSet>::all(client.clone()), owned())
    .owns(Api::<Service>::all(client.clone()), owned())
    .owns(Api::<HorizontalPodAutoscaler>::all(client), owned())
    .trigger_backoff(super::backoff::watch_backoff())
}

/// Requeue policy after a failed reconcile: 15 s (a 409 on the status write retries sooner
/// through the next watch event anyway).
pub fn error_policy(_cb: Arc<CacheBackend>, err: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(error = %err, reason = err.metric_label(), "CacheBackend reconcile failed");
    Action::requeue(Duration::from_secs(15))
}

/// Children owned by one backend, as listed at the start of a reconcile.
#[derive(Debug, Default)]
struct Owned {
    deployments: Vec<Deployment>,
    statefulsets: Vec<StatefulSet>,
    services: Vec<Service>,
    hpas: Vec<HorizontalPodAutoscaler>,
}

fn owned_by<K: Resource>(items: Vec<K>, uid: &str) -> Vec<K> {
    items
        .into_iter()
        .filter(|o| o.owner_references().iter().any(|r| r.uid == uid))
        .collect()
}

async fn list_owned<K>(
    client: &Client,
    ns: &str,
    lp: &ListParams,
    uid: &str,
) -> Result<Vec<K>, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let list = api.list(lp).await.map_err(|source| Error::Read {
        what: "owned objects",
        namespace: ns.to_string(),
        source,
    })?;
    Ok(owned_by(list.items, uid))
}

/// True when every field of `desired` is present with the same value in `live` (arrays
/// element-wise with equal length; nulls in `desired` ignored): applying would change nothing
/// the controller manages.
///
/// "The same" as the apiserver stores it: the quantities of a `limits` / `requests` map compare
/// by value (it stores `0.5` as `500m`, `1024Mi` as `1Gi`), and an empty list or map in
/// `desired` matches an absent field (built-in kinds omit them: `sysctls: []` is not stored).
/// Compared as written, such a child never matched and was re-applied on every reconcile.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    subset(desired, live, false)
}

/// [`is_subset`]; `quantities`: `desired` is a `limits` / `requests` map.
fn subset(desired: &Value, live: &Value, quantities: bool) -> bool {
    match (desired, live) {
        (Value::Object(d), Value::Object(l)) => d.iter().all(|(k, dv)| match (l.get(k), dv) {
            (_, Value::Null) => true,
            (None, Value::Array(a)) => a.is_empty(),
            (None, Value::Object(o)) => o.is_empty(),
            (None, _) => false,
            (Some(Value::String(lq)), Value::String(dq)) if quantities => {
                dq == lq
                    || render::resources::parse_quantity(dq)
                        .is_some_and(|v| Some(v) == render::resources::parse_quantity(lq))
            }
            (Some(lv), _) => subset(dv, lv, k == "limits" || k == "requests"),
        }),
        (Value::Array(d), Value::Array(l)) => {
            d.len() == l.len() && d.iter().zip(l).all(|(a, b)| subset(a, b, false))
        }
        _ => desired == live,
    }
}

/// Annotation on every child the reconciler applies: the SHA-256 (hex) of the object it applied.
/// A field dropped from the desired object (a removed `spec.template` override) leaves the
/// desired object a subset of the live one, so [`ensure`] could not see the change from the
/// fields alone; the digest changes with it and forces the apply that removes the field.
pub const ANNOTATION_APPLIED: &str = "inferencecache.io/applied-digest";

/// Field manager of the one-off apply that hands `spec.replicas` of a cache-server workload to
/// its HorizontalPodAutoscaler (see [`needs_replicas_handover`]).
pub const HPA_HANDOVER_MANAGER: &str = "inference-cache-hpa-handover";

/// `obj` with [`ANNOTATION_APPLIED`] set to the digest of `obj` as serialized (without that
/// annotation).
///
/// # Errors
/// When `obj` does not serialize.
pub fn with_applied_digest<K: Resource + Serialize + Clone>(
    obj: &K,
) -> Result<K, serde_json::Error> {
    let mut out = obj.clone();
    out.meta_mut()
        .annotations
        .get_or_insert_with(Default::default)
        .remove(ANNOTATION_APPLIED);
    let bytes = serde_json::to_vec(&out)?;
    let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
    out.meta_mut()
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANNOTATION_APPLIED.to_string(), hex::encode(digest.as_ref()));
    Ok(out)
}

/// Whether applying `desired` (no `spec.replicas`: autoscaling is on) over `live` would drop a
/// `spec.replicas` that [`FIELD_MANAGER`] owns. Server-side apply removes a field its manager
/// stops applying, and the workload's default (1) would replace it before the HPA acts: a
/// 3-replica cache server would lose two pods (and the engines behind them would be
/// cascade-restarted). Kubernetes' documented remedy ("Transferring ownership" in the
/// server-side apply docs) is to let a second manager apply the current value first.
pub fn needs_replicas_handover(desired: &Value, live: &Value) -> bool {
    if desired.pointer("/spec/replicas").is_some() || live.pointer("/spec/replicas").is_none() {
        return false;
    }
    live.pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .is_some_and(|entries| {
            entries.iter().any(|e| {
                e.get("manager").and_then(Value::as_str) == Some(FIELD_MANAGER)
                    && e.get("operation").and_then(Value::as_str) == Some("Apply")
                    && e.pointer("/fieldsV1/f:spec/f:replicas").is_some()
            })
        })
}

/// Server-side applies `obj` (with its [`ANNOTATION_APPLIED`] digest) unless the live object of
/// the same name (among `live`) already carries every desired field and the same digest;
/// returns the live object either way. When autoscaling takes `spec.replicas` out of a
/// workload this manager owned, the current count is first applied by [`HPA_HANDOVER_MANAGER`]
/// so that it stays until the HPA changes it.
///
/// `initial_replicas` (a workload under autoscaling: the HPA's `minReplicas`) is the count a
/// workload that does not exist yet is created with: the object is created with it, then it is
/// handed over like any other count. Created without one, the workload would run the default 1
/// replica until the HPA first acted (seen on a real cluster: ~15 s at 1 of 3).
async fn ensure<K>(
    client: &Client,
    ns: &str,
    kind: &'static str,
    obj: &K,
    live: &[K],
    initial_replicas: Option<i32>,
) -> Result<K, Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let obj = with_applied_digest(obj)?;
    let desired = serde_json::to_value(&obj)?;
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let apply_error = |source| Error::Apply {
        kind,
        namespace: ns.to_string(),
        name: name.clone(),
        source,
    };
    let existing = live
        .iter()
        .find(|o| o.meta().name.as_deref() == Some(name.as_str()))
        .cloned();
    // Created here with its initial count: the count is handed over at once (below), not
    // left owned by this manager, whose next apply would otherwise drop it.
    let mut created_with_replicas = false;
    let existing = match (existing, initial_replicas) {
        (None, Some(n)) if desired.pointer("/spec/replicas").is_none() => {
            created_with_replicas = true;
            let mut first = desired.clone();
            first["spec"]["replicas"] = json!(n);
            let created = api
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&first),
                )
                .await
                .map_err(apply_error)?;
            Some(created)
        }
        (existing, _) => existing,
    };
    if let Some(current) = existing.as_ref() {
        let current_value = serde_json::to_value(current)?;
        if !created_with_replicas && is_subset(&desired, &current_value) {
            return Ok(current.clone());
        }
        if needs_replicas_handover(&desired, &current_value) {
            let handover = json!({
                "apiVersion": desired["apiVersion"],
                "kind": desired["kind"],
                "metadata": { "name": name, "namespace": ns },
                "spec": { "replicas": current_value.pointer("/spec/replicas") },
            });
            api.patch(
                &name,
                &PatchParams::apply(HPA_HANDOVER_MANAGER).force(),
                &Patch::Apply(&handover),
            )
            .await
            .map_err(apply_error)?;
            tracing::info!(
                kind,
                namespace = ns,
                name,
                "spec.replicas handed over to the HorizontalPodAutoscaler"
            );
        }
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .map_err(apply_error)
}

async fn delete_stale<K>(
    client: &Client,
    ns: &str,
    kind: &'static str,
    items: &[K],
    keep: Option<&str>,
) -> Result<(), Error>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    for o in items {
        let name = o.name_any();
        if Some(name.as_str()) == keep {
            continue;
        }
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => tracing::info!(kind, namespace = ns, name, "shed owned object"),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(source) => {
                return Err(Error::Delete {
                    kind,
                    namespace: ns.to_string(),
                    name,
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Recursively sets keys present in `old` but absent from `new` to null, so a JSON merge patch
/// removes them.
fn null_removed(old: &Value, new: &mut Value) {
    if let (Value::Object(o), Value::Object(n)) = (old, new) {
        for (k, ov) in o {
            match n.get_mut(k) {
                None => {
                    n.insert(k.clone(), Value::Null);
                }
                Some(nv) => null_removed(ov, nv),
            }
        }
    }
}

/// The merge patch that turns `old` into `new`, guarded by `resource_version`.
pub fn status_patch(
    old: Option<&CacheBackendStatus>,
    new: &CacheBackendStatus,
    resource_version: Option<&str>,
) -> Result<Value, serde_json::Error> {
    let mut n = serde_json::to_value(new)?;
    if let Some(old) = old {
        null_removed(&serde_json::to_value(old)?, &mut n);
    }
    let mut patch = json!({ "status": n });
    if let Some(rv) = resource_version {
        patch["metadata"] = json!({ "resourceVersion": rv });
    }
    Ok(patch)
}

/// Reconciles one CacheBackend (see the module docs). Returns when to look again: 30 s
/// steady, 5 s during engine-pod churn, earlier when a gate window or rate limit expires.
///
/// Errors: any failed read of the CacheBackend or its owned objects, any failed write
/// (apply, delete, cascade patch, status). Failed reads of engine Pods, Deployments, sibling
/// CacheBackends or the index are soft: the status fields they feed keep their prior values.
pub async fn reconcile(cb: Arc<CacheBackend>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = cb
        .metadata
        .namespace
        .clone()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let name = cb.name_any();
    let key = format!("{ns}/{name}");
    let client = &ctx.client;
    let api: Api<CacheBackend> = Api::namespaced(client.clone(), &ns);
    let Some(live) = api.get_opt(&name).await.map_err(|source| Error::Read {
        what: "CacheBackend",
        namespace: ns.clone(),
        source,
    })?
    else {
        ctx.forget(&key);
        return Ok(Action::await_change());
    };
    if live.metadata.deletion_timestamp.is_some() {
        // Owned children go with the owner (garbage collection); nothing to write.
        ctx.forget(&key);
        return Ok(Action::await_change());
    }
    let uid = live
        .metadata
        .uid
        .clone()
        .ok_or(Error::MissingMetadata("uid"))?;
    let leader = ctx.can_write();
    let rendered: Option<Rendered> = render::render(&live)?;

    // Owned children.
    let lp = ListParams::default().labels(&format!("{LABEL_BACKEND}={}", label_value(&name)));
    let owned = Owned {
        deployments: list_owned(client, &ns, &lp, &uid).await?,
        statefulsets: list_owned(client, &ns, &lp, &uid).await?,
        services: list_owned(client, &ns, &lp, &uid).await?,
        hpas: list_owned(client, &ns, &lp, &uid).await?,
    };
    let owned_workload_present = !owned.deployments.is_empty() || !owned.statefulsets.is_empty();

    let mut workload: Option<WorkloadState> = None;
    let mut service_endpoint: Option<String> = None;
    let desired_deploy = rendered.as_ref().and_then(|r| match &r.workload {
        Workload::Deployment(d) => Some(d.as_ref()),
        Workload::StatefulSet(_) => None,
    });
    let desired_sts = rendered.as_ref().and_then(|r| match &r.workload {
        Workload::StatefulSet(s) => Some(s.as_ref()),
        Workload::Deployment(_) => None,
    });
    if leader {
        if let Some(r) = rendered.as_ref() {
            // Under autoscaling the workload is created at the HPA's floor (see `ensure`).
            let initial_replicas = r.hpa.as_ref().map(|_| render::hpa_min_replicas(&live.spec));
            match &r.workload {
                Workload::Deployment(d) => {
                    let live_d = ensure(
                        client,
                        &ns,
                        "Deployment",
                        d.as_ref(),
                        &owned.deployments,
                        initial_replicas,
                    )
                    .await?;
                    workload = Some(WorkloadState::from_deployment(&live_d));
                }
                Workload::StatefulSet(s) => {
                    let live_s = ensure(
                        client,
                        &ns,
                        "StatefulSet",
                        s.as_ref(),
                        &owned.statefulsets,
                        initial_replicas,
                    )
                    .await?;
                    workload = Some(WorkloadState::from_statefulset(&live_s));
                }
            }
            let live_svc =
                ensure(client, &ns, "Service", &r.service, &owned.services, None).await?;
            service_endpoint = render::service_endpoint(&live_svc);
            if let Some(h) = r.hpa.as_ref() {
                ensure(client, &ns, "HorizontalPodAutoscaler", h, &owned.hpas, None).await?;
            }
        }
        let keep_name = |o: Option<&str>| o.map(str::to_string);
        let deploy_name = keep_name(desired_deploy.and_then(|d| d.metadata.name.as_deref()));
        let sts_name = keep_name(desired_sts.and_then(|s| s.metadata.name.as_deref()));
        let svc_name = rendered
            .as_ref()
            .and_then(|r| r.service.metadata.name.clone());
        let hpa_name = rendered
            .as_ref()
            .and_then(|r| r.hpa.as_ref())
            .and_then(|h| h.metadata.name.clone());
        delete_stale(
            client,
            &ns,
            "HorizontalPodAutoscaler",
            &owned.hpas,
            hpa_name.as_deref(),
        )
        .await?;
        delete_stale(
            client,
            &ns,
            "Deployment",
            &owned.deployments,
            deploy_name.as_deref(),
        )
        .await?;
        delete_stale(
            client,
            &ns,
            "StatefulSet",
            &owned.statefulsets,
            sts_name.as_deref(),
        )
        .await?;
        delete_stale(client, &ns, "Service", &owned.services, svc_name.as_deref()).await?;
    } else if let Some(r) = rendered.as_ref() {
        let want = r.workload.name();
        workload = match &r.workload {
            Workload::Deployment(_) => owned
                .deployments
                .iter()
                .find(|d| d.name_any() == want)
                .map(WorkloadState::from_deployment),
            Workload::StatefulSet(_) => owned
                .statefulsets
                .iter()
                .find(|s| s.name_any() == want)
                .map(WorkloadState::from_statefulset),
        };
        service_endpoint = owned
            .services
            .iter()
            .find(|s| s.metadata.name == r.service.metadata.name)
            .and_then(render::service_endpoint);
    }

    // Soft reads.
    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|e| tracing::warn!(namespace = %ns, error = %e, "listing pods failed"))
        .ok();
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter(|d| !d.owner_references().iter().any(|r| r.uid == uid))
                .collect()
        })
        .map_err(|e| tracing::warn!(namespace = %ns, error = %e, "listing deployments failed"))
        .ok();
    let backends = api
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|e| tracing::warn!(namespace = %ns, error = %e, "listing cachebackends failed"))
        .ok();
    let index = ctx.index.replicas();

    let mut mem = ctx.recall(&key, &uid);
    let obs = Observed {
        backend: live.clone(),
        now: ctx.clock.now(),
        workload,
        owned_workload_present,
        service_endpoint,
        server_selector: rendered.as_ref().map(|r| r.selector.clone()),
        server_containers: rendered
            .as_ref()
            .map(|r| r.container_names.clone())
            .unwrap_or_default(),
        pods,
        deployments,
        backends,
        index,
        probe_enabled: ctx.prober.is_some(),
    };
    let mut eval = evaluate(&obs, &mem, &ProbeInput::NotRun, &ctx.settings);
    if let Some(m) = &ctx.metrics {
        // The probe never changes indexParticipation: every replica exports the same gauge.
        m.record(
            &key,
            eval.status
                .index_participation
                .as_ref()
                .and_then(|p| p.t2_hit_rate.as_deref()),
        );
    }
    if !leader {
        return Ok(Action::requeue(eval.requeue_after));
    }
    if eval.probe_wanted {
        if let Some(prober) = ctx.prober.as_ref() {
            let outcome = prober.probe(&live).await;
            mem.last_probe_at = Some(obs.now);
            ctx.remember(&key, &uid, mem);
            eval = evaluate(&obs, &mem, &ProbeInput::Ran(outcome), &ctx.settings);
        }
    }

    if let cascade::CascadeDecision::Fire(instance) = &eval.cascade {
        // The trigger names the server instance it restarts the engines for, not the time: a
        // cascade repeated for the same replacement (its status write failed with a 409, or the
        // controller restarted before it) patches the same value again, which changes nothing
        // and rolls no engine a second time.
        let patch = cascade::restart_patch(instance);
        let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
        for d in &eval.cascade_targets {
            deploys
                .patch(d, &PatchParams::apply(FIELD_MANAGER), &Patch::Merge(&patch))
                .await
                .map_err(|source| Error::Cascade {
                    namespace: ns.clone(),
                    name: d.clone(),
                    source,
                })?;
            tracing::info!(namespace = %ns, backend = %name, deployment = %d, "cascade-restarted engine Deployment");
        }
        mem.last_cascade_at = Some(obs.now);
        ctx.remember(&key, &uid, mem);
    }

    if live.status.as_ref() != Some(&eval.status) {
        let patch = status_patch(
            live.status.as_ref(),
            &eval.status,
            live.metadata.resource_version.as_deref(),
        )?;
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|source| Error::Status {
                namespace: ns.clone(),
                name: name.clone(),
                source,
            })?;
    }

    let oref = live.object_ref(&());
    for e in &eval.events {
        if let Err(err) = ctx.events.publish(&oref, e).await {
            tracing::warn!(namespace = %ns, backend = %name, error = %err, "publishing event failed");
        }
    }
    mem.last_path = Some(eval.path.kind());
    ctx.remember(&key, &uid, mem);
    Ok(Action::requeue(eval.requeue_after))
}

#[cfg(test)]
mod apply_tests {
    use super::*;
    use k8s_openapi::api::apps::v1::Deployment;

    fn deployment(v: Value) -> Deployment {
        serde_json::from_value(v).unwrap_or_default()
    }

    #[test]
    fn the_applied_digest_changes_when_a_field_is_removed() {
        let with = deployment(json!({"metadata": {"name": "d"},
            "spec": {"template": {"spec": {"nodeSelector": {"disk": "ssd"}, "containers": []}}}}));
        let without = deployment(json!({"metadata": {"name": "d"},
            "spec": {"template": {"spec": {"containers": []}}}}));
        let a = with_applied_digest(&with).unwrap_or_default();
        let b = with_applied_digest(&without).unwrap_or_default();
        let digest = |d: &Deployment| {
            d.metadata
                .annotations
                .as_ref()
                .and_then(|m| m.get(ANNOTATION_APPLIED).cloned())
        };
        assert!(digest(&a).is_some_and(|d| d.len() == 64));
        assert_ne!(digest(&a), digest(&b));
        // Without the annotation the removal is invisible to the subset test …
        let live = serde_json::to_value(&with).unwrap_or_default();
        assert!(is_subset(
            &serde_json::to_value(&without).unwrap_or_default(),
            &live
        ));
        // … with it, the desired object is no longer a subset of what was applied before.
        let live = serde_json::to_value(&a).unwrap_or_default();
        assert!(!is_subset(
            &serde_json::to_value(&b).unwrap_or_default(),
            &live
        ));
        // Stable: digesting an already-digested object gives the same digest.
        assert_eq!(
            digest(&with_applied_digest(&a).unwrap_or_default()),
            digest(&a)
        );
    }

    #[test]
    fn the_subset_test_reads_values_as_the_apiserver_stores_them() {
        let desired = json!({"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}},
            "securityContext": {"sysctls": [], "seLinuxOptions": {}}, "args": ["0.5"]});
        let stored = json!({"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            "securityContext": {}, "args": ["0.5"]});
        assert!(is_subset(&desired, &stored));
        // Another value, a quantity outside a resource map, a non-empty list: not the same.
        let other = json!({"resources": {"requests": {"cpu": "750m", "memory": "1Gi"}}});
        assert!(!is_subset(&desired, &other));
        assert!(!is_subset(
            &json!({"args": ["0.5"]}),
            &json!({"args": ["500m"]})
        ));
        assert!(!is_subset(&json!({"sysctls": [{"name": "a"}]}), &json!({})));
        assert!(!is_subset(
            &json!({"tolerations": []}),
            &json!({"tolerations": [{"key": "k"}]})
        ));
    }

    #[test]
    fn replicas_are_handed_over_only_when_our_manager_owns_them() {
        let desired = json!({"spec": {"template": {}}});
        let live = |manager: &str| {
            json!({"metadata": {"managedFields": [{"manager": manager, "operation": "Apply",
                "fieldsV1": {"f:spec": {"f:replicas": {}}}}]}, "spec": {"replicas": 3}})
        };
        assert!(needs_replicas_handover(&desired, &live(FIELD_MANAGER)));
        assert!(!needs_replicas_handover(
            &desired,
            &live(HPA_HANDOVER_MANAGER)
        ));
        assert!(!needs_replicas_handover(
            &json!({"spec": {"replicas": 3}}),
            &live(FIELD_MANAGER)
        ));
        assert!(!needs_replicas_handover(&desired, &json!({"spec": {}})));
    }
}
