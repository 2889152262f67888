//! Admission: the AdmissionReview handlers behind `ic-controller`'s HTTPS webhooks and
//! `ic-controller admit` (spec 000 "Admission", "Mutating Pod webhook"; DESIGN.md "Data flows" 1).
//!
//! | route | handler | failure policy |
//! |---|---|---|
//! | `/mutate-cachebackend` | [`defaulting`]: materialise `spec.integration` / `spec.observation`, first-apply `autoscaling.minReplicas` | Fail |
//! | `/validate-cachebackend` | [`validation`]: schema, decode, the ordered rule list; UPDATE drops pre-existing violations | Fail |
//! | `/mutate-pod` | a [`PodMutator`] (engine wiring); **always allowed** — every error path admits the pod unwired with a reason | Ignore |
//! | `/healthz` | liveness | — |
//!
//! [`Admission`] is the one code path: the HTTPS server ([`server`]) and the offline CLI
//! ([`offline`]) both hand it the raw AdmissionReview bytes ([`Admission::handle_bytes`]) and send
//! back what it returns. Wire types are our own ([`review`]) so that the patch is a base64 string
//! as kube-apiserver requires. Certificates: [`tls`].
//!
//! The CacheBackends a Pod is matched against come from a [`BackendSource`] (a static list for
//! tests and `admit`; the in-cluster controller supplies a watch-backed one).

pub mod ca_bundle;
pub mod defaulting;
pub mod host_ports;
pub mod kv_topology;
pub mod model_cache_pod;
pub mod offline;
pub mod pod;
pub mod review;
pub mod server;
pub mod sources;
pub mod tls;
pub mod validation;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ic_shared::crd::{CacheBackend, ModelCacheStatus};
use serde_json::Value;

use crate::adapters::Registry;
use review::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use validation::{RuleContext, Validator};

/// The webhook routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// `/mutate-cachebackend` (defaulting).
    MutateCacheBackend,
    /// `/validate-cachebackend` (validation).
    ValidateCacheBackend,
    /// `/mutate-pod` (engine wiring; fail-open).
    MutatePod,
}

impl Route {
    /// Every route.
    pub const ALL: [Route; 3] = [
        Route::MutateCacheBackend,
        Route::ValidateCacheBackend,
        Route::MutatePod,
    ];

    /// The HTTP path.
    pub fn path(self) -> &'static str {
        match self {
            Route::MutateCacheBackend => "/mutate-cachebackend",
            Route::ValidateCacheBackend => "/validate-cachebackend",
            Route::MutatePod => "/mutate-pod",
        }
    }

    /// The route for an HTTP path.
    pub fn from_path(path: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.path() == path)
    }
}

/// Where the Pod webhook gets the CacheBackends to match a pod against.
///
/// In cluster this is a watch-backed store (spec: a live list, so a freshly Ready backend is
/// never missed); in tests and `ic-controller admit`, [`StaticBackends`].
pub trait BackendSource: Send + Sync {
    /// The CacheBackends in `namespace`, in any order (the Pod webhook orders them). Shared,
    /// not copied: this runs once per admitted pod.
    fn list(&self, namespace: &str) -> Vec<Arc<CacheBackend>>;
}

/// A fixed list of CacheBackends. A backend without `metadata.namespace` is listed in every
/// namespace (convenient for `ic-controller admit`).
#[derive(Debug, Clone, Default)]
pub struct StaticBackends(pub Vec<Arc<CacheBackend>>);

impl StaticBackends {
    /// A source that always lists `backends` (filtered by namespace).
    pub fn new(backends: impl IntoIterator<Item = CacheBackend>) -> Self {
        StaticBackends(backends.into_iter().map(Arc::new).collect())
    }
}

impl BackendSource for StaticBackends {
    fn list(&self, namespace: &str) -> Vec<Arc<CacheBackend>> {
        self.0
            .iter()
            .filter(|cb| {
                cb.metadata
                    .namespace
                    .as_deref()
                    .is_none_or(|ns| ns.is_empty() || ns == namespace)
            })
            .cloned()
            .collect()
    }
}

/// What the Pod webhook decided for one pod. The pod is always admitted; `patch` (RFC 6902, may
/// be empty) wires it, and `reason` says why it was or was not wired.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodDecision {
    /// Operator-facing reason (`wired to ns/name`, or why the pod was left unwired).
    pub reason: String,
    /// RFC 6902 operations (as JSON) against the request's pod (empty: no change).
    pub patch: Vec<Value>,
    /// Warnings for the client.
    pub warnings: Vec<String>,
}

/// Engine-pod wiring, as the `/mutate-pod` route calls it: [`PodWebhook`] in production
/// ([`pod::mutate_pod`]), fakes in tests, [`UnwiredPods`] to serve without wiring.
pub trait PodMutator: Send + Sync {
    /// Decides for `pod` (the request object) given the CacheBackends of its namespace.
    fn mutate(
        &self,
        request: &AdmissionRequest,
        pod: &Value,
        backends: &[Arc<CacheBackend>],
    ) -> PodDecision;

    /// True when the mutator guarantees that its patch applies to the request object; the
    /// handler then skips its own check (decode the operations, apply them to a copy). Default
    /// false.
    fn patch_is_checked(&self) -> bool {
        false
    }
}

/// Where the Pod webhook reads a `ModelCache`'s status (spec 004 "What runs today": the reader
/// claim a pod asks for with `inferencecache.io/model-cache`).
///
/// In cluster this is a watch-backed store ([`sources::StoreModelCaches`]); tests use a map.
pub trait ModelCacheSource: Send + Sync {
    /// The status of `ModelCache` `namespace/name`; `None` when it does not exist (or has no
    /// status yet).
    fn status(&self, namespace: &str, name: &str) -> Option<ModelCacheStatus>;
}

/// The built-in Pod wiring: [`pod::mutate_pod`] under a [`pod::PodWebhookConfig`], then — when
/// a [`ModelCacheSource`] is set — the model-cache reader volume
/// ([`model_cache_pod::wire_model_cache`]) applied on top of the engine wiring.
#[derive(Clone, Default)]
pub struct PodWebhook {
    /// Registry and controller flags the wiring uses.
    pub config: pod::PodWebhookConfig,
    /// Model-cache statuses; `None` leaves `model-data` wiring off.
    pub model_caches: Option<Arc<dyn ModelCacheSource>>,
}

impl std::fmt::Debug for PodWebhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodWebhook")
            .field("config", &self.config)
            .field("model_caches", &self.model_caches.is_some())
            .finish()
    }
}

impl PodWebhook {
    /// Wiring under `config`.
    pub fn new(config: pod::PodWebhookConfig) -> Self {
        PodWebhook {
            config,
            model_caches: None,
        }
    }

    /// Also mounts model-cache reader claims, reading request statuses from `source`.
    pub fn with_model_caches(mut self, source: Arc<dyn ModelCacheSource>) -> Self {
        self.model_caches = Some(source);
        self
    }
}

impl PodMutator for PodWebhook {
    fn mutate(
        &self,
        request: &AdmissionRequest,
        pod: &Value,
        backends: &[Arc<CacheBackend>],
    ) -> PodDecision {
        let namespace = validation::namespace_of(request.namespace.as_deref(), pod);
        let outcome = pod::mutate_pod(pod, namespace, backends, &self.config);
        let mut decision = PodDecision {
            reason: outcome.reason,
            patch: outcome.patch.unwrap_or_default(),
            warnings: outcome.warnings,
        };
        if let Some(source) = &self.model_caches {
            add_model_cache_wiring(&mut decision, pod, namespace, source.as_ref());
        }
        decision
    }

    /// [`pod::mutate_pod`] checks that its patch applies to the request object and reproduces
    /// the mutated pod before returning it; the model-cache operations are checked against
    /// that pod before they are appended.
    fn patch_is_checked(&self) -> bool {
        true
    }
}

/// Appends the model-cache reader wiring to `decision`: its operations are computed against
/// the pod as the engine wiring left it (JSON Patch operations apply in order), and dropped
/// with a reason if they do not apply. Fail-open: the engine wiring is kept either way.
fn add_model_cache_wiring(
    decision: &mut PodDecision,
    pod: &Value,
    namespace: &str,
    source: &dyn ModelCacheSource,
) {
    let status = match model_cache_pod::requested_model_cache(pod, namespace) {
        None => return,
        Some(Ok(r)) => source.status(&r.namespace, &r.name),
        Some(Err(_)) => None,
    };
    let mut wired = pod.clone();
    if !decision.patch.is_empty() && check_patch_into(&mut wired, &decision.patch).is_err() {
        return;
    }
    match model_cache_pod::wire_model_cache(&wired, namespace, status.as_ref()) {
        model_cache_pod::ModelCacheWiring::NotRequested => {}
        model_cache_pod::ModelCacheWiring::Skipped { reason } => {
            decision.reason = format!("{}; {reason}", decision.reason);
        }
        model_cache_pod::ModelCacheWiring::Wired { patch, reason } => {
            let ops: Result<Vec<Value>, _> = patch.iter().map(serde_json::to_value).collect();
            match ops {
                Ok(ops) if check_patch_into(&mut wired, &ops).is_ok() => {
                    decision.patch.extend(ops);
                    decision.reason = format!("{}; {reason}", decision.reason);
                }
                Ok(_) | Err(_) => {
                    decision.reason = format!(
                        "{}; internal error: the model-cache patch does not apply; model-data not mounted",
                        decision.reason
                    );
                }
            }
        }
    }
}

/// Pod wiring that admits every pod with no patch (serving the CacheBackend webhooks alone).
#[derive(Debug, Clone, Copy, Default)]
pub struct UnwiredPods;

impl PodMutator for UnwiredPods {
    fn mutate(
        &self,
        _request: &AdmissionRequest,
        _pod: &Value,
        _backends: &[Arc<CacheBackend>],
    ) -> PodDecision {
        PodDecision {
            reason: "engine-pod wiring is not installed in this build; pod admitted unchanged"
                .to_string(),
            ..Default::default()
        }
    }
}

/// An HTTP answer: status code and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandledBody {
    /// HTTP status (always 200: errors are expressed inside the AdmissionReview).
    pub status: u16,
    /// The serialized response AdmissionReview.
    pub body: Vec<u8>,
}

/// The admission handlers: one instance serves every route.
pub struct Admission {
    validator: Validator,
    registry: Arc<Registry>,
    backends: Arc<dyn BackendSource>,
    pods: Arc<dyn PodMutator>,
}

impl Admission {
    /// Handlers over a registry (reserved args/env, supported pairs), a CacheBackend source for
    /// the Pod webhook, and the Pod wiring. Uses [`Validator::builtin`].
    pub fn new(
        registry: Arc<Registry>,
        backends: Arc<dyn BackendSource>,
        pods: Arc<dyn PodMutator>,
    ) -> Self {
        Admission {
            validator: Validator::builtin(),
            registry,
            backends,
            pods,
        }
    }

    /// Replaces the validator (tests, extensions).
    pub fn with_validator(mut self, validator: Validator) -> Self {
        self.validator = validator;
        self
    }

    /// The registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The validator.
    pub fn validator(&self) -> &Validator {
        &self.validator
    }

    /// Handles raw AdmissionReview bytes for `route` — what the HTTPS server and `admit` call.
    /// Always HTTP 200: a body that does not decode is denied (CacheBackend routes, `code: 400`)
    /// or allowed (`/mutate-pod`), with `uid` recovered from the raw JSON when possible.
    pub fn handle_bytes(&self, route: Route, body: &[u8]) -> HandledBody {
        let response = match serde_json::from_slice::<AdmissionReview>(body) {
            Ok(AdmissionReview {
                request: Some(req), ..
            }) => self.respond(route, &req),
            Ok(_) => undecodable(route, body, "the AdmissionReview has no request"),
            Err(e) => undecodable(
                route,
                body,
                &format!("the AdmissionReview does not decode: {e}"),
            ),
        };
        let review = AdmissionReview::from_response(response);
        let body = serde_json::to_vec(&review).unwrap_or_else(|_| {
            // Unreachable in practice; still answer something the apiserver can read.
            let uid = review.response.map(|r| r.uid).unwrap_or_default();
            format!(
                r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{{"uid":{},"allowed":{}}}}}"#,
                validation::quote(&uid),
                route == Route::MutatePod
            )
            .into_bytes()
        });
        HandledBody { status: 200, body }
    }

    /// Handles a decoded review for `route`.
    pub fn review(&self, route: Route, review: &AdmissionReview) -> AdmissionReview {
        let response = match &review.request {
            Some(req) => self.respond(route, req),
            None => match route {
                Route::MutatePod => AdmissionResponse::allow_with_message(
                    "",
                    "the AdmissionReview has no request; pod admitted unchanged",
                ),
                _ => AdmissionResponse::bad_request("", "the AdmissionReview has no request"),
            },
        };
        AdmissionReview::from_response(response)
    }

    /// The response for one request on `route`.
    pub fn respond(&self, route: Route, req: &AdmissionRequest) -> AdmissionResponse {
        match route {
            Route::MutateCacheBackend => self.mutate_cache_backend(req),
            Route::ValidateCacheBackend => self.validate_cache_backend(req),
            Route::MutatePod => self.mutate_pod(req),
        }
    }

    /// `/mutate-cachebackend`: the defaulting patch (spec "Defaulting").
    pub fn mutate_cache_backend(&self, req: &AdmissionRequest) -> AdmissionResponse {
        if !matches!(req.operation, Operation::Create | Operation::Update) || is_subresource(req) {
            return AdmissionResponse::allow(&req.uid);
        }
        let Some(obj) = &req.object else {
            return AdmissionResponse::bad_request(&req.uid, "request.object is missing");
        };
        match defaulting::default_cache_backend(obj, req.operation) {
            Ok(d) => AdmissionResponse::allow(&req.uid)
                .with_patch(&d.patch)
                .unwrap_or_else(|e| {
                    AdmissionResponse::bad_request(&req.uid, format!("patch encoding failed: {e}"))
                }),
            Err(e) => AdmissionResponse::bad_request(&req.uid, e.to_string()),
        }
    }

    /// `/validate-cachebackend`: every rule; UPDATE only rejects violations the update
    /// introduces (spec "Validating").
    pub fn validate_cache_backend(&self, req: &AdmissionRequest) -> AdmissionResponse {
        if !matches!(req.operation, Operation::Create | Operation::Update) || is_subresource(req) {
            return AdmissionResponse::allow(&req.uid);
        }
        let Some(obj) = &req.object else {
            return AdmissionResponse::bad_request(&req.uid, "request.object is missing");
        };
        let ctx = RuleContext {
            namespace: validation::namespace_of(req.namespace.as_deref(), obj),
            registry: &self.registry,
            operation: req.operation,
        };
        let outcome = match (&req.old_object, req.operation) {
            (Some(old), Operation::Update) => self.validator.validate_update(obj, old, &ctx),
            _ => self.validator.validate_value(obj, &ctx),
        };
        if outcome.is_valid() {
            return AdmissionResponse::allow(&req.uid).with_warnings(outcome.warnings);
        }
        let name = req
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| {
                obj.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_default();
        AdmissionResponse::deny(&req.uid, outcome.to_status(&name)).with_warnings(outcome.warnings)
    }

    /// `/mutate-pod`: engine wiring. Never blocks a pod: every error (including a panic in the
    /// wiring, or a patch that does not apply) admits the pod unchanged with a reason.
    pub fn mutate_pod(&self, req: &AdmissionRequest) -> AdmissionResponse {
        let uid = req.uid.clone();
        catch_unwind(AssertUnwindSafe(|| self.mutate_pod_inner(req))).unwrap_or_else(|_| {
            AdmissionResponse::allow_with_message(
                uid,
                "internal error in the pod webhook; pod admitted unwired",
            )
        })
    }

    fn mutate_pod_inner(&self, req: &AdmissionRequest) -> AdmissionResponse {
        if req.operation != Operation::Create {
            return AdmissionResponse::allow_with_message(
                &req.uid,
                "only pod CREATE is wired; pod admitted unchanged",
            );
        }
        if !req.kind.kind.is_empty() && req.kind.kind != "Pod" {
            return AdmissionResponse::allow_with_message(
                &req.uid,
                format!("not a Pod ({}); admitted unchanged", req.kind.kind),
            );
        }
        let Some(pod) = req.object.as_ref().filter(|o| o.is_object()) else {
            return AdmissionResponse::allow_with_message(
                &req.uid,
                "request.object is not a pod; admitted unwired",
            );
        };
        let namespace = validation::namespace_of(req.namespace.as_deref(), pod);
        let backends = self.backends.list(namespace);
        let decision = self.pods.mutate(req, pod, &backends);
        if !decision.patch.is_empty() && !self.pods.patch_is_checked() {
            if let Err(e) = check_patch(pod, &decision.patch) {
                return AdmissionResponse::allow_with_message(
                    &req.uid,
                    format!("internal error: the wiring patch {e}; pod admitted unwired"),
                );
            }
        }
        match AdmissionResponse::allow_with_message(&req.uid, decision.reason.clone())
            .with_patch(&decision.patch)
        {
            Ok(r) => r.with_warnings(decision.warnings),
            Err(e) => AdmissionResponse::allow_with_message(
                &req.uid,
                format!(
                    "internal error: the wiring patch does not encode ({e}); pod admitted unwired"
                ),
            ),
        }
    }
}

/// Whether `ops` is a JSON Patch that applies to `pod`.
fn check_patch(pod: &Value, ops: &[Value]) -> Result<(), String> {
    let mut probe = pod.clone();
    check_patch_into(&mut probe, ops)
}

/// Applies the JSON Patch `ops` to `doc` (left unchanged on error).
fn check_patch_into(doc: &mut Value, ops: &[Value]) -> Result<(), String> {
    let ops: Vec<json_patch::PatchOperation> = ops
        .iter()
        .map(|op| serde_json::from_value(op.clone()))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("is not a JSON Patch ({e})"))?;
    json_patch::patch(doc, &ops).map_err(|e| format!("does not apply ({e})"))
}

fn is_subresource(req: &AdmissionRequest) -> bool {
    req.sub_resource.as_deref().is_some_and(|s| !s.is_empty())
}

/// The answer to a body that is no AdmissionReview: with the uid when
/// [`review::uid_of_raw`] finds one, else saying that it could not be read. The Pod webhook
/// still admits the pod (unwired); the CacheBackend webhooks refuse.
fn undecodable(route: Route, body: &[u8], why: &str) -> AdmissionResponse {
    let uid = review::uid_of_raw(body);
    let unread;
    let why = if uid.is_empty() {
        unread = format!("{why} (and its request.uid could not be read)");
        unread.as_str()
    } else {
        why
    };
    match route {
        Route::MutatePod => {
            AdmissionResponse::allow_with_message(uid, format!("{why}; pod admitted unwired"))
        }
        _ => AdmissionResponse::bad_request(uid, why),
    }
}
