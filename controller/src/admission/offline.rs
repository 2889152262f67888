//! `ic-controller admit`: objects through admission offline, like a server dry-run.
//!
//! ```text
//! ic-controller admit FILE.yaml [--old OLD.yaml]                 # a CacheBackend
//! ic-controller admit --backend CB.yaml [--backend …] POD.yaml   # a Pod
//! ```
//!
//! Same code path as the server: each step builds an `admission.k8s.io/v1` AdmissionReview in
//! memory, serializes it, and hands the bytes to [`Admission::handle_bytes`], exactly what the
//! HTTPS routes do. Around it, what the apiserver would do: `apiVersion` and `kind` must name
//! the resource (`inferencecache.io/v1alpha1` CacheBackend, `v1` Pod; a wrong or missing one is
//! an input error, exit 2); unknown fields are handled per `--field-validation` like `kubectl
//! apply`'s server-side field validation — `Strict` (the default, as kubectl's) rejects them
//! (exit 1), `Warn` prunes them with a warning, `Ignore` prunes them silently; the CRD schema's
//! literal defaults are applied before the mutating webhook and again after a non-empty patch.
//!
//! - CacheBackend: prints the defaulted object as YAML (exit 0), or the field-scoped errors
//!   (exit 1). Warnings go to stderr as `Warning: …`. With `--old`, the request is an UPDATE and
//!   validation only rejects violations the update introduces.
//! - Pod: its unknown fields (those the typed Pod model drops, [`prune_unknown_pod_fields`])
//!   follow `--field-validation` too. Each `--backend` (a file may hold several YAML documents)
//!   stands for a **stored**
//!   object: it is pruned and defaulted as storage would, and run through admission only to
//!   report — one that current rules reject is still used, with a warning that the cluster holds
//!   it as stored (objects stored before a rule exist, and the Pod webhook fails open on them);
//!   the pod is then sent to `/mutate-pod` and the result printed as JSON:
//!   `{"allowed", "reason", "patch" (decoded JSON Patch array), "warnings", "pod" (patched)}`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ic_shared::crd::CacheBackend;
use serde_json::{json, Value};

use super::pod::{NativeSidecars, PodWebhookConfig};
use super::review::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, GroupVersionKind, GroupVersionResource,
    Operation,
};
use super::validation::schema;
use super::{Admission, PodMutator, PodWebhook, Route, StaticBackends};
use crate::adapters::Registry;

/// How unknown fields are treated (`kubectl apply --validate=strict|warn|ignore`, the
/// apiserver's `fieldValidation`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FieldValidation {
    /// Reject the object (exit 1), naming each unknown field — kubectl's default.
    #[default]
    #[value(name = "Strict", alias = "strict")]
    Strict,
    /// Prune unknown fields with a warning each.
    #[value(name = "Warn", alias = "warn")]
    Warn,
    /// Prune unknown fields silently.
    #[value(name = "Ignore", alias = "ignore")]
    Ignore,
}

/// `ic-controller admit` arguments.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct AdmitArgs {
    /// Unknown fields of the CacheBackend: Strict (reject, the default, as `kubectl apply`),
    /// Warn (prune with a warning) or Ignore (prune silently). `--backend` objects are stored
    /// ones: their unknown fields are always pruned with a warning.
    #[arg(long, value_enum, default_value_t = FieldValidation::Strict)]
    pub field_validation: FieldValidation,
    /// The object to admit: a CacheBackend, or a Pod when --backend is given. YAML or JSON;
    /// `-` reads standard input.
    pub file: PathBuf,
    /// The stored CacheBackend this one replaces: the request becomes an UPDATE, and only
    /// violations the update introduces are rejected.
    #[arg(long, value_name = "OLD.yaml", conflicts_with = "backends")]
    pub old: Option<PathBuf>,
    /// A CacheBackend the pod is matched against (repeatable; a file may hold several YAML
    /// documents). Turns FILE into a Pod.
    #[arg(long = "backend", value_name = "CB.yaml")]
    pub backends: Vec<PathBuf>,
    /// Namespace of the request when the object does not name one.
    #[arg(long, env = "IC_ADMIT_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// As the controller's --kvevent-subscriber-image: append the kvevent-subscriber sidecar to
    /// wired pods whose backend sets spec.observation.modelID.
    #[arg(long, value_name = "IMAGE")]
    pub kvevent_subscriber_image: Option<String>,
    /// As the controller's --lmcache-worker-image: default image of the SGLang LMCache MP worker.
    #[arg(long, value_name = "IMAGE")]
    pub lmcache_worker_image: Option<String>,
    /// The cluster's Kubernetes version (`1.28`, `v1.30.2`), which the controller discovers from
    /// the apiserver: before 1.29 a wiring that needs a native sidecar fails open. Unset: assumed
    /// to support them.
    #[arg(long, value_name = "VERSION")]
    pub kube_version: Option<String>,
}

/// What `admit` prints and its exit status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdmitOutput {
    /// Standard output: the defaulted CacheBackend (YAML) or the Pod verdict (JSON).
    pub stdout: String,
    /// Standard error: warnings and errors.
    pub stderr: String,
    /// 0 admitted, 1 rejected.
    pub exit_code: i32,
}

/// Failures before admission could run (usage, unreadable or unparsable input).
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not YAML/JSON of the expected shape.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The arguments do not fit the object.
    #[error("{0}")]
    Usage(String),
}

/// The verdict on a CacheBackend.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheBackendVerdict {
    /// Whether validation admitted it.
    pub allowed: bool,
    /// The object after pruning, schema defaults and the defaulting patch.
    pub object: Value,
    /// The defaulting webhook's JSON Patch (as sent, decoded).
    pub patch: Vec<json_patch::PatchOperation>,
    /// The denial status message (`CacheBackend.inferencecache.io "x" is invalid: …`).
    pub message: String,
    /// One line per field error (`spec.x: Invalid value: …`).
    pub errors: Vec<String>,
    /// Warnings (pruned fields, rule warnings).
    pub warnings: Vec<String>,
}

/// The verdict on a Pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodVerdict {
    /// Always true from the Pod webhook (it fails open); kept for the output contract.
    pub allowed: bool,
    /// Why the pod was or was not wired.
    pub reason: String,
    /// The JSON Patch (decoded; empty when unchanged).
    pub patch: Vec<json_patch::PatchOperation>,
    /// The pod with the patch applied.
    pub pod: Value,
    /// Warnings.
    pub warnings: Vec<String>,
}

impl PodVerdict {
    /// The JSON `admit` prints.
    pub fn to_json(&self) -> Value {
        json!({
            "allowed": self.allowed,
            "reason": self.reason,
            "patch": self.patch,
            "warnings": self.warnings,
            "pod": self.pod,
        })
    }
}

/// Runs `admit` with the built-in runtime adapters and the built-in Pod wiring
/// ([`PodWebhook`]) configured from `args`. The caller prints `stdout`/`stderr` and exits with
/// `exit_code`; an `Err` is a usage or input error (exit 2).
pub fn admit_cli(args: &AdmitArgs) -> Result<AdmitOutput, AdmitError> {
    let registry = Arc::new(Registry::builtin());
    let native_sidecars = match args.kube_version.as_deref() {
        None => NativeSidecars::Supported,
        Some(v) => {
            let bare = v.trim().trim_start_matches('v');
            let mut parts = bare.split('.');
            let (major, minor) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            if minor.is_empty() {
                return Err(AdmitError::Usage(format!(
                    "--kube-version {v:?} is not MAJOR.MINOR[.PATCH]"
                )));
            }
            NativeSidecars::from_version(major, minor, &format!("v{bare}"))
        }
    };
    let config = PodWebhookConfig {
        registry: registry.clone(),
        kvevent_subscriber_image: args.kvevent_subscriber_image.clone(),
        lmcache_worker_image: args.lmcache_worker_image.clone(),
        native_sidecars,
        ..PodWebhookConfig::default()
    };
    run_admit(args, registry, Arc::new(PodWebhook::new(config)))
}

/// Runs `admit` over an explicit registry and Pod wiring (tests use fakes).
pub fn run_admit(
    args: &AdmitArgs,
    registry: Arc<Registry>,
    pods: Arc<dyn PodMutator>,
) -> Result<AdmitOutput, AdmitError> {
    let docs = read_documents(&args.file)?;
    let [obj] = <[Value; 1]>::try_from(docs).map_err(|d| AdmitError::Parse {
        path: args.file.clone(),
        message: format!("expected one object, found {}", d.len()),
    })?;
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
    if args.backends.is_empty() {
        if kind == "Pod" {
            return Err(AdmitError::Usage(
                "FILE is a Pod: name the CacheBackends it is matched against with --backend"
                    .to_string(),
            ));
        }
        expect_kind(&args.file, &obj, "CacheBackend")?;
        let old = match &args.old {
            Some(p) => {
                let docs = read_documents(p)?;
                let [o] = <[Value; 1]>::try_from(docs).map_err(|d| AdmitError::Parse {
                    path: p.clone(),
                    message: format!("expected one object, found {}", d.len()),
                })?;
                expect_kind(p, &o, "CacheBackend")?;
                Some(o)
            }
            None => None,
        };
        let admission = Admission::new(registry, Arc::new(StaticBackends::default()), pods);
        let v =
            admit_cache_backend_with(&admission, obj, old, &args.namespace, args.field_validation);
        return Ok(render_cache_backend(&v));
    }

    expect_kind(&args.file, &obj, "Pod")?;
    let namespace = obj
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or(&args.namespace)
        .to_string();
    // Backends are admitted as the cluster would have stored them.
    let bare = Admission::new(
        registry.clone(),
        Arc::new(StaticBackends::default()),
        pods.clone(),
    );
    let mut stderr = String::new();
    let mut backends = Vec::new();
    for path in &args.backends {
        for mut doc in read_documents(path)? {
            expect_kind(path, &doc, "CacheBackend")?;
            if doc.pointer("/metadata/namespace").is_none() {
                if let Some(meta) = doc.get_mut("metadata").and_then(Value::as_object_mut) {
                    meta.insert("namespace".to_string(), Value::String(namespace.clone()));
                }
            }
            let status = doc.get("status").cloned();
            let v = admit_cache_backend(&bare, doc, None, &namespace);
            let name = v
                .object
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            for w in &v.warnings {
                stderr.push_str(&format!("Warning: backend {name}: {w}\n"));
            }
            if !v.allowed {
                // A stored object: it may predate a rule that rejects it today.
                stderr.push_str(&format!(
                    "Warning: backend {name} ({}) would not be admitted today ({}); the cluster holds it as stored, so the pod is matched against it as is\n",
                    path.display(),
                    if v.errors.is_empty() {
                        v.message.clone()
                    } else {
                        v.errors.join("; ")
                    }
                ));
            }
            let mut object = v.object;
            if let (Some(s), Some(map)) = (status, object.as_object_mut()) {
                map.insert("status".to_string(), s);
            }
            let cb: CacheBackend =
                serde_json::from_value(object).map_err(|e| AdmitError::Parse {
                    path: path.clone(),
                    message: format!("backend {name}: {e}"),
                })?;
            backends.push(cb);
        }
    }
    let mut obj = obj;
    let unknown = prune_unknown_pod_fields(&mut obj);
    if !unknown.is_empty() {
        match args.field_validation {
            FieldValidation::Strict => {
                let name = obj
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                stderr.push_str(&format!("Error: Pod {name:?} is invalid:\n"));
                for f in &unknown {
                    stderr.push_str(&format!("  strict decoding error: unknown field {f:?}\n"));
                }
                return Ok(AdmitOutput {
                    stdout: String::new(),
                    stderr,
                    exit_code: 1,
                });
            }
            FieldValidation::Warn => {
                for f in &unknown {
                    stderr.push_str(&format!("Warning: unknown field {f:?} (pruned)\n"));
                }
            }
            FieldValidation::Ignore => {}
        }
    }
    let admission = Admission::new(registry, Arc::new(StaticBackends::new(backends)), pods);
    let verdict = admit_pod(&admission, obj, &namespace);
    for w in &verdict.warnings {
        stderr.push_str(&format!("Warning: {w}\n"));
    }
    let stdout = serde_json::to_string_pretty(&verdict.to_json()).unwrap_or_default() + "\n";
    Ok(AdmitOutput {
        stdout,
        stderr,
        exit_code: 0,
    })
}

fn render_cache_backend(v: &CacheBackendVerdict) -> AdmitOutput {
    let mut stderr = String::new();
    for w in &v.warnings {
        stderr.push_str(&format!("Warning: {w}\n"));
    }
    if v.allowed {
        AdmitOutput {
            stdout: serde_yaml::to_string(&v.object).unwrap_or_default(),
            stderr,
            exit_code: 0,
        }
    } else {
        let head = v.message.split(" is invalid:").next().unwrap_or("");
        stderr.push_str(&format!("Error: {head} is invalid:\n"));
        for e in &v.errors {
            stderr.push_str(&format!("  {e}\n"));
        }
        AdmitOutput {
            stdout: String::new(),
            stderr,
            exit_code: 1,
        }
    }
}

/// Checks `kind` and `apiVersion` as the apiserver routes an object: a CacheBackend must be
/// `inferencecache.io/v1alpha1`, a Pod `v1`.
fn expect_kind(path: &Path, obj: &Value, kind: &str) -> Result<(), AdmitError> {
    let parse = |message: String| AdmitError::Parse {
        path: path.to_path_buf(),
        message,
    };
    match obj.get("kind").and_then(Value::as_str) {
        Some(k) if k == kind => {}
        Some(k) => return Err(parse(format!("expected kind {kind}, found {k}"))),
        None => return Err(parse(format!("expected kind {kind}, found no kind"))),
    }
    let want = match kind {
        "Pod" => "v1".to_string(),
        _ => format!("{}/{}", ic_shared::crd::GROUP, ic_shared::crd::VERSION),
    };
    match obj.get("apiVersion").and_then(Value::as_str) {
        Some(v) if v == want => Ok(()),
        Some(v) => Err(parse(format!(
            "{kind} has apiVersion {v:?}; this server serves {kind} only as {want:?}"
        ))),
        None => Err(parse(format!("apiVersion not set (a {kind} is {want:?})"))),
    }
}

/// Removes from a Pod the fields the Kubernetes API (the typed model, API 1.33) does not know,
/// as the apiserver drops them, and returns their paths (`spec.containers[0].volumeMount`).
/// Found by decoding into the typed Pod and re-encoding: what the input has (non-null) and the
/// re-encoding lacks is unknown. A pod that does not decode is left to the Pod webhook (which
/// admits it unwired with the decode error).
pub fn prune_unknown_pod_fields(pod: &mut Value) -> Vec<String> {
    let Ok(typed) = serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(pod.clone()) else {
        return Vec::new();
    };
    let Ok(known) = serde_json::to_value(&typed) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    prune_against(pod, &known, "", &mut out);
    out
}

fn prune_against(v: &mut Value, known: &Value, path: &str, out: &mut Vec<String>) {
    match (v, known) {
        (Value::Object(m), Value::Object(k)) => {
            let mut gone = Vec::new();
            for (key, child) in m.iter_mut() {
                let here = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match k.get(key) {
                    None if !child.is_null() => gone.push((key.clone(), here)),
                    None => {}
                    Some(kc) => prune_against(child, kc, &here, out),
                }
            }
            for (key, here) in gone {
                m.remove(&key);
                out.push(here);
            }
        }
        (Value::Array(a), Value::Array(k)) => {
            for (i, (child, kc)) in a.iter_mut().zip(k).enumerate() {
                prune_against(child, kc, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Reads every YAML (or JSON) document of a file (`-` = stdin), skipping empty documents; at
/// most [`MAX_ADMIT_BYTES`](ic_shared::limits::MAX_ADMIT_BYTES) are read (a longer input is a
/// `Read` error naming the cap).
pub fn read_documents(path: &Path) -> Result<Vec<Value>, AdmitError> {
    use ic_shared::limits::{read_bounded, MAX_ADMIT_BYTES};
    let text = if path == Path::new("-") {
        read_bounded(std::io::stdin().lock(), MAX_ADMIT_BYTES)
    } else {
        std::fs::File::open(path).and_then(|f| read_bounded(f, MAX_ADMIT_BYTES))
    }
    .map_err(|source| AdmitError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_documents(&text).map_err(|message| AdmitError::Parse {
        path: path.to_path_buf(),
        message,
    })
}

/// Parses YAML/JSON text into its non-empty documents; text nested deeper than
/// [`MAX_DOCUMENT_DEPTH`](ic_shared::limits::MAX_DOCUMENT_DEPTH) is refused before parsing.
pub fn parse_documents(text: &str) -> Result<Vec<Value>, String> {
    use serde::Deserialize as _;
    ic_shared::limits::check_depth(text, ic_shared::limits::MAX_DOCUMENT_DEPTH)?;
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).map_err(|e| e.to_string())?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

fn request(
    route: Route,
    operation: Operation,
    namespace: &str,
    object: Value,
    old: Option<Value>,
) -> AdmissionRequest {
    let (kind, resource) = match route {
        Route::MutatePod => (
            GroupVersionKind {
                group: String::new(),
                version: "v1".into(),
                kind: "Pod".into(),
            },
            GroupVersionResource {
                group: String::new(),
                version: "v1".into(),
                resource: "pods".into(),
            },
        ),
        _ => (
            GroupVersionKind {
                group: ic_shared::crd::GROUP.into(),
                version: ic_shared::crd::VERSION.into(),
                kind: "CacheBackend".into(),
            },
            GroupVersionResource {
                group: ic_shared::crd::GROUP.into(),
                version: ic_shared::crd::VERSION.into(),
                resource: "cachebackends".into(),
            },
        ),
    };
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .map(str::to_string);
    AdmissionRequest {
        uid: format!(
            "ic-controller-admit-{}",
            route.path().trim_start_matches('/')
        ),
        request_kind: Some(kind.clone()),
        request_resource: Some(resource.clone()),
        kind,
        resource,
        name,
        namespace: Some(namespace.to_string()),
        operation,
        dry_run: Some(true),
        object: Some(object),
        old_object: old,
        ..Default::default()
    }
}

/// Sends one request through [`Admission::handle_bytes`] (the server's code path) and decodes
/// the response.
fn round_trip(admission: &Admission, route: Route, req: AdmissionRequest) -> AdmissionResponse {
    let uid = req.uid.clone();
    let bytes = serde_json::to_vec(&AdmissionReview::from_request(req)).unwrap_or_default();
    let handled = admission.handle_bytes(route, &bytes);
    serde_json::from_slice::<AdmissionReview>(&handled.body)
        .ok()
        .and_then(|r| r.response)
        .unwrap_or_else(|| AdmissionResponse::bad_request(uid, "the response does not decode"))
}

fn status_message(r: &AdmissionResponse) -> String {
    r.status
        .as_ref()
        .map(|s| s.message.clone())
        .unwrap_or_default()
}

/// Admits a CacheBackend as CREATE (or UPDATE with `old`) with unknown fields pruned and
/// warned about ([`FieldValidation::Warn`]); see [`admit_cache_backend_with`].
pub fn admit_cache_backend(
    admission: &Admission,
    obj: Value,
    old: Option<Value>,
    namespace: &str,
) -> CacheBackendVerdict {
    admit_cache_backend_with(admission, obj, old, namespace, FieldValidation::Warn)
}

/// Admits a CacheBackend as CREATE (or UPDATE with `old`): unknown fields per
/// `field_validation` (Strict: rejected before admission runs), schema defaults, the
/// `/mutate-cachebackend` patch, schema defaults again, then `/validate-cachebackend`.
pub fn admit_cache_backend_with(
    admission: &Admission,
    mut obj: Value,
    old: Option<Value>,
    namespace: &str,
    field_validation: FieldValidation,
) -> CacheBackendVerdict {
    let unknown = schema::prune_unknown(&mut obj);
    if field_validation == FieldValidation::Strict && !unknown.is_empty() {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let errors: Vec<String> = unknown
            .iter()
            .map(|f| format!("strict decoding error: unknown field {f:?}"))
            .collect();
        return CacheBackendVerdict {
            allowed: false,
            object: obj.clone(),
            patch: Vec::new(),
            message: format!(
                "CacheBackend.{} {name:?} is invalid: {}",
                ic_shared::crd::GROUP,
                errors.join(", ")
            ),
            errors,
            warnings: Vec::new(),
        };
    }
    let mut warnings: Vec<String> = match field_validation {
        FieldValidation::Ignore => Vec::new(),
        _ => unknown
            .into_iter()
            .map(|f| format!("unknown field {f:?} (pruned)"))
            .collect(),
    };
    schema::apply_defaults(&mut obj);
    let old = old.map(|mut o| {
        schema::prune_unknown(&mut o);
        schema::apply_defaults(&mut o);
        o
    });
    let op = if old.is_some() {
        Operation::Update
    } else {
        Operation::Create
    };
    let mutated = round_trip(
        admission,
        Route::MutateCacheBackend,
        request(
            Route::MutateCacheBackend,
            op,
            namespace,
            obj.clone(),
            old.clone(),
        ),
    );
    if !mutated.allowed {
        let message = status_message(&mutated);
        return CacheBackendVerdict {
            allowed: false,
            object: obj,
            patch: Vec::new(),
            errors: vec![message.clone()],
            message,
            warnings,
        };
    }
    let patch = mutated.patch_operations().unwrap_or_default();
    if !patch.is_empty() {
        if let Err(e) = json_patch::patch(&mut obj, &patch) {
            let message = format!("the defaulting patch does not apply: {e}");
            return CacheBackendVerdict {
                allowed: false,
                object: obj,
                patch,
                errors: vec![message.clone()],
                message,
                warnings,
            };
        }
        schema::apply_defaults(&mut obj);
    }
    warnings.extend(mutated.warnings);
    let validated = round_trip(
        admission,
        Route::ValidateCacheBackend,
        request(Route::ValidateCacheBackend, op, namespace, obj.clone(), old),
    );
    warnings.extend(validated.warnings.iter().cloned());
    let errors = validated
        .status
        .as_ref()
        .and_then(|s| s.details.as_ref())
        .map(|d| {
            d.causes
                .iter()
                .map(|c| format!("{}: {}", c.field, c.message))
                .collect()
        })
        .unwrap_or_default();
    CacheBackendVerdict {
        allowed: validated.allowed,
        object: obj,
        patch,
        message: status_message(&validated),
        errors,
        warnings,
    }
}

/// Admits a Pod through `/mutate-pod` and applies the returned patch.
pub fn admit_pod(admission: &Admission, pod: Value, namespace: &str) -> PodVerdict {
    let r = round_trip(
        admission,
        Route::MutatePod,
        request(
            Route::MutatePod,
            Operation::Create,
            namespace,
            pod.clone(),
            None,
        ),
    );
    let patch = r.patch_operations().unwrap_or_default();
    let mut patched = pod;
    let mut reason = status_message(&r);
    if !patch.is_empty() {
        if let Err(e) = json_patch::patch(&mut patched, &patch) {
            reason = format!("{reason} (the patch does not apply: {e})");
        }
    }
    PodVerdict {
        allowed: r.allowed,
        reason,
        patch,
        pod: patched,
        warnings: r.warnings,
    }
}
