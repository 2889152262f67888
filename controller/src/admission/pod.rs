//! The mutating Pod webhook's decision logic (spec 000 "Mutating Pod webhook (engine wiring)",
//! "Events-only mode", "Mooncake provider configuration", "Contract Notes"; DESIGN.md "Where our
//! structure differs": the kvevent-subscriber sidecar mode).
//!
//! [`mutate_pod`] is a pure function: the `/mutate-pod` route and `ic-controller admit` hand it
//! the AdmissionReview's `request.object`, the request namespace and the CacheBackends of that
//! namespace, and send back its [`PodOutcome`]. It **always admits** the pod; every error path
//! admits it unwired with a reason, and a panic inside is caught.
//!
//! Order of decisions:
//!
//! 1. Decode the pod (`k8s_openapi` Pod). Failure → admit, no patch (no pod to patch, so stale
//!    annotations cannot be cleared on this path).
//! 2. `inferencecache.io/skip-inject: <truthy>` (`true`, `t`, `1`, `yes`, `y`, `on`, any case) →
//!    no wiring; strip `injected-by`/`injected-by-uid`/`wired-spec`; stamp `inject-skipped:
//!    skip-inject-annotation` (a pod already carrying exactly that yields no patch).
//! 3. Selection: CacheBackends in the pod's namespace (a backend without a namespace counts as in
//!    every namespace, for offline use) sorted by name, as the API lists them; the first whose
//!    non-empty `engineSelector.matchLabels` is a subset of the pod's labels wins. An empty
//!    selector claims nothing.
//! 4. Events-only: append the kvevent-subscriber sidecar when the controller has
//!    `--kvevent-subscriber-image` and `spec.observation.modelID` is set; otherwise skip
//!    fail-open. No connector, no endpoint needed.
//! 5. Offload: the runtime adapter for (runtime, type) from the [`Registry`]; the binding
//!    ([`resolve_binding`]: Managed → `status.endpoint`, External → trimmed, validated
//!    `spec.remoteStorage.endpoint`, host-only → none); the adapter's `SupportsBinding`; the engine
//!    container; `InjectEngineConfig`; `engineOverrides` (adapter-owned set diffed around the
//!    adapter); `engineHostNetwork` (`hostNetwork: true`, `dnsPolicy: ClusterFirstWithHostNet`,
//!    only with a published endpoint); the kvevent-subscriber sidecar under the same gate as in
//!    step 4.
//! 6. Annotations: on success `injected-by: <namespace>/<name>`, `injected-by-uid: <uid>` and
//!    `wired-spec` (the JSON [`ic_shared::crd::WiredSpec`] the node plan follows),
//!    `inject-skipped` removed; on every fail-open path after decoding, all of them removed.
//!
//! The JSON Patch is the diff between the decoded pod and the mutated one, checked to apply to
//! the request object and to round-trip to the mutated pod. The adapters converge, so
//! re-admitting a wired pod yields no patch.
//!
//! The kvevent-subscriber sidecars it renders are their own concept, in `pod/subscriber.rs`.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ic_shared::crd::{CacheBackend, CacheType, Runtime};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use super::host_ports::{declare_host_ports, declared_ports, Listener};
use super::kv_topology::{engine_kv_listeners, OtherListeners};
use crate::adapters::overrides::{apply_overrides, snapshot};
use crate::adapters::sglang_lmcache_mp::WORKER_CONTAINER;
use crate::adapters::{binding_label, is_rendered, resolve_binding, InjectContext, Registry};
use crate::engine::command::EngineCommand;
use crate::engine::container::select_engine_container;
use crate::engine::flags as engine_flags;

mod subscriber;

pub use subscriber::subscriber_container_name;
use subscriber::{add_subscribers, remove_subscribers, Offload};

/// Pod annotation stamped on a wired pod: `<namespace>/<name>` of the CacheBackend.
pub const ANNOTATION_INJECTED_BY: &str = "inferencecache.io/injected-by";
/// Pod annotation stamped on a wired pod: the CacheBackend's `metadata.uid`.
pub const ANNOTATION_INJECTED_BY_UID: &str = "inferencecache.io/injected-by-uid";
/// Pod annotation stamped on a wired pod: the JSON [`ic_shared::crd::WiredSpec`] of the
/// CacheBackend spec it was wired under (the node plan reads it instead of the current spec).
pub const ANNOTATION_WIRED_SPEC: &str = crate::annotations::WIRED_SPEC;
/// Pod annotation stamped when the operator opted out with [`ANNOTATION_SKIP_INJECT`].
pub const ANNOTATION_INJECT_SKIPPED: &str = "inferencecache.io/inject-skipped";
/// Pod annotation stamped on a pod a CacheBackend selects but that is admitted unwired:
/// `CacheBackend <ns>/<name>: <reason>` (at most [`MAX_NOT_INJECTED_CHARS`] characters). It is
/// the lasting record of the fail-open (admission warnings of a ReplicaSet's pods reach the
/// kube-controller-manager, not the user); the engine-pod Events controller turns it into a
/// Warning `NotInjected` Event on the pod. Never read as wiring.
pub const ANNOTATION_NOT_INJECTED: &str = crate::annotations::NOT_INJECTED;
/// Longest [`ANNOTATION_NOT_INJECTED`] value, characters.
pub const MAX_NOT_INJECTED_CHARS: usize = 1024;
/// Pod annotation by which an operator opts a pod out of wiring (truthy value).
pub const ANNOTATION_SKIP_INJECT: &str = crate::annotations::SKIP_INJECT;
/// Value of [`ANNOTATION_INJECT_SKIPPED`].
pub const SKIPPED_BY_OPERATOR: &str = "skip-inject-annotation";
/// `PodOutcome::reason` of a wired pod.
pub const REASON_INJECTED: &str = "Injected";
/// Projected service-account token volume of the kvevent-subscriber sidecar (added only when the
/// pod has no volume of that name).
pub const SUBSCRIBER_TOKEN_VOLUME: &str = "inference-cache-token";
/// Where the sidecar mounts [`SUBSCRIBER_TOKEN_VOLUME`]: the directory of
/// `ic-agent subscribe --token-file`'s default (`/var/run/secrets/inference-cache/token`).
pub const SUBSCRIBER_TOKEN_DIR: &str = "/var/run/secrets/inference-cache";
/// Lifetime of the sidecar's projected token in seconds (the kubelet rotates it at 80 %).
pub const SUBSCRIBER_TOKEN_EXPIRATION_SECONDS: i64 = 3600;

/// Controller flags the Pod webhook depends on.
#[derive(Debug, Clone)]
pub struct PodWebhookConfig {
    /// Runtime adapters (`Registry::builtin()` by default).
    pub registry: Arc<Registry>,
    /// `--kvevent-subscriber-image`: when set, the webhook appends the kvevent-subscriber sidecar
    /// (the agent binary in per-pod mode) to wired pods whose backend has
    /// `spec.observation.modelID`; unset (the default) leaves KV events to the node agent.
    pub kvevent_subscriber_image: Option<String>,
    /// Controller address the sidecar streams to (`--controller=`), when set.
    pub kvevent_subscriber_controller: Option<String>,
    /// Default LMCache MP worker image (`spec.lmCache.workerImage` wins; the engine image is the
    /// fallback).
    pub lmcache_worker_image: Option<String>,
    /// Image of the lmcache-kernel-check init container; unset (the default) runs the check in
    /// the engine's own image, which is what it is meant to test.
    pub lmcache_kernel_check_image: Option<String>,
    /// Whether the cluster runs native sidecars, from the apiserver's version (discovered at
    /// start-up in cluster; `admit --kube-version`).
    pub native_sidecars: NativeSidecars,
}

/// Whether the cluster runs native sidecars (init containers with `restartPolicy: Always`;
/// beta and on by default from Kubernetes 1.29, alpha behind a feature gate in 1.28).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum NativeSidecars {
    /// Supported, or not known (offline use): wiring renders them.
    #[default]
    Supported,
    /// The apiserver predates them: a wiring that needs one fails open with the reason.
    Unsupported {
        /// The apiserver's version, e.g. `v1.28.9`.
        version: String,
    },
}

impl NativeSidecars {
    /// From an apiserver's `major`/`minor` (`/version`; a minor such as `29+` is read as 29).
    /// Unparsable values count as supported (the apiserver then decides).
    pub fn from_version(major: &str, minor: &str, git_version: &str) -> Self {
        let num = |s: &str| {
            s.trim()
                .trim_end_matches(|c: char| !c.is_ascii_digit())
                .parse::<u32>()
                .ok()
        };
        match (num(major), num(minor)) {
            (Some(1), Some(m)) if m < 29 => NativeSidecars::Unsupported {
                version: if git_version.is_empty() {
                    format!("v{}.{}", major.trim(), minor.trim())
                } else {
                    git_version.to_string()
                },
            },
            _ => NativeSidecars::Supported,
        }
    }
}

impl Default for PodWebhookConfig {
    fn default() -> Self {
        PodWebhookConfig {
            registry: Arc::new(Registry::builtin()),
            kvevent_subscriber_image: None,
            kvevent_subscriber_controller: None,
            lmcache_worker_image: None,
            lmcache_kernel_check_image: None,
            native_sidecars: NativeSidecars::Supported,
        }
    }
}

/// What the Pod webhook decided.
#[derive(Debug, Clone, PartialEq)]
pub struct PodOutcome {
    /// Always true: the Pod webhook never blocks a pod.
    pub allowed: bool,
    /// RFC 6902 JSON Patch operations against the request object; `None` when nothing changes.
    pub patch: Option<Vec<Value>>,
    /// [`REASON_INJECTED`], or why the pod was skipped or admitted unwired.
    pub reason: String,
    /// Operator-facing warnings (kept template values, ignored overrides, …).
    pub warnings: Vec<String>,
}

impl PodOutcome {
    fn allow(reason: impl Into<String>) -> Self {
        PodOutcome {
            allowed: true,
            patch: None,
            reason: reason.into(),
            warnings: Vec::new(),
        }
    }

    /// The patch as typed operations (empty when there is none). Errors only if an operation is
    /// not a valid RFC 6902 operation, which [`mutate_pod`] never produces.
    pub fn patch_operations(&self) -> Result<Vec<json_patch::PatchOperation>, serde_json::Error> {
        self.patch
            .iter()
            .flatten()
            .map(|op| serde_json::from_value(op.clone()))
            .collect()
    }
}

/// Decides the wiring of one engine pod (spec "Mutating Pod webhook").
///
/// `pod` is the AdmissionReview `request.object`; `namespace` the request namespace (the pod's
/// `metadata.namespace` when empty); `backends` the CacheBackends of that namespace, in any
/// order. Never panics; the outcome is always `allowed`.
pub fn mutate_pod<B: Borrow<CacheBackend>>(
    pod: &Value,
    namespace: &str,
    backends: &[B],
    cfg: &PodWebhookConfig,
) -> PodOutcome {
    catch_unwind(AssertUnwindSafe(|| decide(pod, namespace, backends, cfg))).unwrap_or_else(|_| {
        PodOutcome::allow("internal error in the pod webhook; pod admitted unwired")
    })
}

use crate::annotations::is_truthy as truthy;

fn annotations(pod: &mut Pod) -> &mut BTreeMap<String, String> {
    pod.metadata.annotations.get_or_insert_with(BTreeMap::new)
}

/// Removes `keys` from the pod's annotations (dropping an emptied map that was absent before).
fn strip(pod: &mut Pod, keys: &[&str]) {
    if let Some(a) = pod.metadata.annotations.as_mut() {
        for k in keys {
            a.remove(*k);
        }
    }
}

const ALL_MARKERS: [&str; 5] = [
    ANNOTATION_INJECTED_BY,
    ANNOTATION_INJECTED_BY_UID,
    ANNOTATION_WIRED_SPEC,
    ANNOTATION_INJECT_SKIPPED,
    ANNOTATION_NOT_INJECTED,
];

fn decide<B: Borrow<CacheBackend>>(
    raw: &Value,
    namespace: &str,
    backends: &[B],
    cfg: &PodWebhookConfig,
) -> PodOutcome {
    if !raw.is_object() {
        return PodOutcome::allow(
            "decode failure: request.object is not a JSON object; pod admitted unwired",
        );
    }
    // Deserialized from the borrowed tree: no copy of the request object.
    let pod: Pod = match serde::Deserialize::deserialize(raw) {
        Ok(p) => p,
        Err(e) => {
            return PodOutcome::allow(format!(
                "decode failure: the pod does not decode ({e}); pod admitted unwired"
            ))
        }
    };
    let base = match serde_json::to_value(&pod) {
        Ok(v) => v,
        Err(e) => {
            return PodOutcome::allow(format!(
                "internal error: the pod does not re-encode ({e}); pod admitted unwired"
            ))
        }
    };
    let namespace = if namespace.is_empty() {
        pod.metadata.namespace.clone().unwrap_or_default()
    } else {
        namespace.to_string()
    };

    // Explicit operator opt-out.
    let skip = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_SKIP_INJECT))
        .is_some_and(|v| truthy(v));
    if skip {
        let mut out = pod.clone();
        strip(
            &mut out,
            &[
                ANNOTATION_INJECTED_BY,
                ANNOTATION_INJECTED_BY_UID,
                ANNOTATION_WIRED_SPEC,
                ANNOTATION_NOT_INJECTED,
            ],
        );
        annotations(&mut out).insert(
            ANNOTATION_INJECT_SKIPPED.to_string(),
            SKIPPED_BY_OPERATOR.to_string(),
        );
        return finish(
            raw,
            &base,
            &out,
            format!("{ANNOTATION_SKIP_INJECT} is set: wiring skipped by the operator"),
            Vec::new(),
        );
    }

    // Selection: first match by name order; empty selectors claim nothing.
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let matching = ic_shared::crd::selecting_backends(backends, &namespace, &labels);
    let mut selection_warnings = Vec::new();
    if let [first, rest @ ..] = matching.as_slice() {
        if !rest.is_empty() {
            selection_warnings.push(format!(
                "{} CacheBackends in namespace {namespace:?} select this pod ({}); {:?} wins by name order — narrow the others' engineSelector so exactly one selects it",
                matching.len(),
                matching
                    .iter()
                    .map(|cb| cb.metadata.name.as_deref().unwrap_or(""))
                    .collect::<Vec<_>>()
                    .join(", "),
                first.metadata.name.as_deref().unwrap_or("")
            ));
        }
    }
    let Some(cb) = matching.first().copied() else {
        let mut out = pod.clone();
        strip(&mut out, &ALL_MARKERS);
        return finish(
            raw,
            &base,
            &out,
            format!(
                "no CacheBackend in namespace {namespace:?} selects this pod; pod admitted unwired"
            ),
            Vec::new(),
        );
    };
    let id = format!(
        "{}/{}",
        cb.metadata
            .namespace
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or(&namespace),
        cb.metadata.name.as_deref().unwrap_or("")
    );

    let mut wired = pod.clone();
    match wire(&mut wired, cb, cfg) {
        Ok(mut warnings) => {
            warnings.splice(0..0, selection_warnings);
            strip(
                &mut wired,
                &[ANNOTATION_INJECT_SKIPPED, ANNOTATION_NOT_INJECTED],
            );
            let a = annotations(&mut wired);
            a.insert(ANNOTATION_INJECTED_BY.to_string(), id);
            a.insert(
                ANNOTATION_WIRED_SPEC.to_string(),
                ic_shared::crd::WiredSpec::of(cb).to_annotation(),
            );
            match cb.metadata.uid.as_deref().filter(|u| !u.is_empty()) {
                Some(uid) => {
                    a.insert(ANNOTATION_INJECTED_BY_UID.to_string(), uid.to_string());
                }
                None => {
                    a.remove(ANNOTATION_INJECTED_BY_UID);
                }
            }
            finish(raw, &base, &wired, REASON_INJECTED.to_string(), warnings)
        }
        Err(Unwired {
            reason,
            warnings: mut unwired_warnings,
        }) => {
            let mut warnings = selection_warnings;
            warnings.append(&mut unwired_warnings);
            let mut out = pod.clone();
            strip(&mut out, &ALL_MARKERS);
            let record: String = format!("CacheBackend {id}: {reason}")
                .chars()
                .take(MAX_NOT_INJECTED_CHARS)
                .collect();
            annotations(&mut out).insert(ANNOTATION_NOT_INJECTED.to_string(), record);
            finish(
                raw,
                &base,
                &out,
                format!("CacheBackend {id}: {reason}; pod admitted unwired"),
                warnings,
            )
        }
    }
}

/// Why a matched pod is left unwired.
struct Unwired {
    reason: String,
    warnings: Vec<String>,
}

impl Unwired {
    /// A fail-open whose reason is also an admission warning (so `kubectl` shows it).
    fn loud(reason: impl Into<String>) -> Self {
        let reason = reason.into();
        Unwired {
            warnings: vec![format!("pod admitted unwired: {reason}")],
            reason,
        }
    }
}

/// Every fail-open of a matched pod is loud: its reason is an admission warning too.
impl<E: std::fmt::Display> From<E> for Unwired {
    fn from(e: E) -> Self {
        Unwired::loud(e.to_string())
    }
}

/// The engine container's explicit env (`name` → literal value; `None` for `valueFrom`).
fn explicit_env(pod: &Pod, engine: usize) -> BTreeMap<String, Option<String>> {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.get(engine))
        .and_then(|c| c.env.as_ref())
        .into_iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect()
}

/// One warning per `envFrom` source of the engine container that could carry a variable the
/// wiring set (added or changed since `before`): an explicit `env` entry wins over `envFrom`,
/// so such a key in that ConfigMap or Secret (e.g. an `LMCACHE_*` setting) is silently
/// overridden. The webhook does not read the source, so the warning names what it would hide.
fn env_from_shadowed(
    pod: &Pod,
    engine: usize,
    before: &BTreeMap<String, Option<String>>,
) -> Vec<String> {
    let Some(c) = pod.spec.as_ref().and_then(|s| s.containers.get(engine)) else {
        return Vec::new();
    };
    let set: Vec<String> = explicit_env(pod, engine)
        .into_iter()
        .filter(|(name, value)| before.get(name) != Some(value))
        .map(|(name, _)| name)
        .collect();
    let mut out = Vec::new();
    for src in c.env_from.iter().flatten() {
        let prefix = src.prefix.as_deref().unwrap_or("");
        let hidden: Vec<&str> = set
            .iter()
            .filter(|n| n.starts_with(prefix))
            .map(String::as_str)
            .collect();
        if hidden.is_empty() {
            continue;
        }
        let what = match (&src.config_map_ref, &src.secret_ref) {
            (Some(cm), _) => format!("ConfigMap {:?}", cm.name),
            (None, Some(sec)) => format!("Secret {:?}", sec.name),
            _ => "an envFrom source".to_string(),
        };
        out.push(format!(
            "container {:?} takes env from {what}{}: if it has a key named {}, the value this CacheBackend injects overrides it (an env entry wins over envFrom) and that setting does not reach the engine",
            c.name,
            if prefix.is_empty() { String::new() } else { format!(" (prefix {prefix:?})") },
            hidden.join(", ")
        ));
    }
    out
}

/// The engine-release warning for a vLLM `--kv-events-config` without a publisher (see
/// [`crate::adapters::engine_release`]); `None` when there is no engine container.
fn publisher_release_warning(pod: &Pod, engine: Option<usize>, runtime: Runtime) -> Option<String> {
    let c = engine.and_then(|i| pod.spec.as_ref()?.containers.get(i))?;
    crate::adapters::engine_release::vllm_kv_events_publisher_warning(pod, c, runtime)
}

/// Wires `pod` for `cb`; returns warnings.
fn wire(pod: &mut Pod, cb: &CacheBackend, cfg: &PodWebhookConfig) -> Result<Vec<String>, Unwired> {
    let spec = &cb.spec;
    let runtime = spec.runtime;
    let mut warnings = Vec::new();

    if spec.is_events_only() {
        let Some(image) = cfg.kvevent_subscriber_image.as_deref() else {
            return Err(Unwired::from(
                "events-only backend, but the controller runs without --kvevent-subscriber-image, so there is no kvevent-subscriber sidecar to append",
            ));
        };
        let Some(model) = spec.model_id() else {
            return Err(Unwired::from(
                "events-only backend without spec.observation.modelID, so the kvevent-subscriber sidecar cannot be configured",
            ));
        };
        let engine = select_engine_container(pod, runtime).ok();
        warnings.extend(publisher_release_warning(pod, engine, runtime));
        let others = other_listeners(pod, engine, runtime, None);
        let listeners = add_subscribers(
            pod,
            engine,
            runtime,
            image,
            model,
            None,
            cfg,
            &others,
            &mut warnings,
        )?;
        if let Some(engine) = engine {
            declare_host_ports(pod, engine, &listeners).map_err(Unwired::loud)?;
        }
        return Ok(warnings);
    }

    let cache_type = spec.effective_type();
    let Some(adapter) = cfg.registry.lookup(runtime, cache_type) else {
        return Err(Unwired::from(format!(
            "no runtime adapter is registered for ({}, {}); supported pairs: {}",
            runtime.as_str(),
            cache_type.as_str(),
            cfg.registry.supported_pairs_text()
        )));
    };
    let binding = resolve_binding(cb)?;
    let kind = binding.as_ref().map(|b| b.kind);
    if !adapter.supports_binding(kind) {
        return Err(Unwired::from(format!(
            "adapter {} does not accept a {} binding",
            adapter.name(),
            binding_label(kind)
        )));
    }
    let engine = adapter.select_engine(pod)?;
    warnings.extend(publisher_release_warning(pod, Some(engine), runtime));
    if let Some(previous) =
        previous_wiring_by_another(pod, cb).filter(|_| !adapter.backend_env().is_empty())
    {
        forget_backend_env(pod, engine, adapter.backend_env());
        warnings.push(format!(
            "the pod was wired by CacheBackend {previous}; the settings it derived from that backend ({}) are replaced by this one's",
            adapter.backend_env().join(", ")
        ));
    }
    let before = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.get(engine))
        .map(|c| snapshot(c, runtime))
        .unwrap_or_default();
    let ctx = InjectContext {
        backend: cb,
        binding: binding.as_ref(),
        lmcache_worker_image: cfg.lmcache_worker_image.as_deref(),
        kernel_check_image: cfg.lmcache_kernel_check_image.as_deref(),
    };
    let env_before = explicit_env(pod, engine);
    let report = adapter.inject_engine_config(&ctx, pod, engine)?;
    warnings.extend(report.warnings);

    if let Some(ov) = spec
        .integration
        .as_ref()
        .and_then(|i| i.engine_overrides.as_ref())
    {
        let Some(c) = pod.spec.as_mut().and_then(|s| s.containers.get_mut(engine)) else {
            return Err(Unwired::from(
                "internal error: the engine container disappeared",
            ));
        };
        let w = apply_overrides(
            c,
            runtime,
            &before,
            ov,
            adapter.reserved_args(),
            adapter.reserved_env(),
        )?;
        warnings.extend(w);
    }

    warnings.extend(env_from_shadowed(pod, engine, &env_before));

    if spec.engine_host_network() {
        if binding.is_some() {
            if let Some(ps) = pod.spec.as_mut() {
                ps.host_network = Some(true);
                match ps.dns_policy.as_deref() {
                    None | Some("ClusterFirst") | Some("ClusterFirstWithHostNet") => {}
                    Some(other) => warnings.push(format!(
                        "dnsPolicy {other} replaced by ClusterFirstWithHostNet so the host-network engine still resolves the backend's Service name"
                    )),
                }
                ps.dns_policy = Some("ClusterFirstWithHostNet".to_string());
            }
        } else {
            warnings.push(
                "spec.integration.engineHostNetwork is ignored: the backend publishes no endpoint (host-only)".to_string(),
            );
        }
    }

    if let Some(reason) = native_sidecar_refusal(pod, cfg) {
        return Err(Unwired::loud(reason));
    }
    let mp_worker = mp_worker_port(pod, cb);
    if let Some(p) = mp_worker {
        // Every declared port counts here, the engine's own too: none of them is the worker.
        // So do the KV-event ports the engine binds, declared or not, subscriber or not: a
        // worker on one of them keeps the engine (or the worker) from starting, so the pod is
        // left unwired with the reason rather than wired into a pod that cannot run.
        let mut taken = other_listeners(pod, Some(engine), runtime, None);
        let engine_name = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.get(engine))
            .map(|c| c.name.clone())
            .unwrap_or_default();
        for l in engine_kv_listeners(pod, engine, runtime) {
            taken
                .entry(l.port)
                .or_insert_with(|| format!("{} (container {engine_name:?})", l.what));
        }
        let declared = declared_ports(pod);
        if let Some(what) = taken.get(&p).or_else(|| declared.get(&p)) {
            return Err(Unwired::loud(format!(
                "the LMCache MP worker would listen on port {p}, which is {what}; set spec.lmCache.workerPort to a free port"
            )));
        }
    }
    let others = other_listeners(pod, Some(engine), runtime, mp_worker);
    let mut listeners: Vec<Listener> = mp_worker
        .map(|port| Listener {
            port,
            name: super::host_ports::MP_WORKER_PORT_NAME.to_string(),
            what: "the LMCache MP worker".to_string(),
            engine_owned: false,
        })
        .into_iter()
        .collect();
    match (cfg.kvevent_subscriber_image.as_deref(), spec.model_id()) {
        (Some(image), Some(model)) => {
            // LMCache loads whole chunks: the sidecar's streams say of which size.
            let chunk_tokens = (cache_type == CacheType::LMCache)
                .then(|| {
                    let container = pod.spec.as_ref().and_then(|s| s.containers.get(engine));
                    crate::adapters::lmcache_chunk_tokens(pod, runtime, container, cb)
                })
                .flatten();
            listeners.extend(add_subscribers(
                pod,
                Some(engine),
                runtime,
                image,
                model,
                Some(Offload { chunk_tokens }),
                cfg,
                &others,
                &mut warnings,
            )?);
        }
        _ => remove_subscribers(pod, &[]),
    }
    declare_host_ports(pod, engine, &listeners).map_err(Unwired::loud)?;
    Ok(warnings)
}

/// The `injected-by` of a pod wired by a different CacheBackend (another name, or the same
/// name with another UID), if any.
fn previous_wiring_by_another(pod: &Pod, cb: &CacheBackend) -> Option<String> {
    let a = pod.metadata.annotations.as_ref()?;
    let by = a.get(ANNOTATION_INJECTED_BY)?;
    let name = cb.metadata.name.as_deref().unwrap_or("");
    let same_name = by.rsplit_once('/').map_or(by.as_str(), |(_, n)| n) == name;
    let same_uid = match (
        a.get(ANNOTATION_INJECTED_BY_UID),
        cb.metadata.uid.as_deref(),
    ) {
        (Some(old), Some(new)) => old == new,
        _ => true,
    };
    (!(same_name && same_uid)).then(|| by.clone())
}

/// Removes the engine env an adapter derives from its backend, so a re-admission under a new
/// backend renders that backend's values instead of keeping the old one's.
fn forget_backend_env(pod: &mut Pod, engine: usize, names: &[&str]) {
    if let Some(c) = pod.spec.as_mut().and_then(|s| s.containers.get_mut(engine)) {
        if let Some(env) = c.env.as_mut() {
            env.retain(|e| !names.contains(&e.name.as_str()));
            if env.is_empty() {
                c.env = None;
            }
        }
    }
}

/// Why a rendered native sidecar (an init container with `restartPolicy: Always`) cannot run
/// on this cluster, when the apiserver's version is known to predate them.
fn native_sidecar_refusal(pod: &Pod, cfg: &PodWebhookConfig) -> Option<String> {
    let NativeSidecars::Unsupported { version } = &cfg.native_sidecars else {
        return None;
    };
    let sidecar = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.restart_policy.as_deref() == Some("Always") && is_rendered(c, &c.name))?;
    Some(format!(
        "the wiring needs the native sidecar {:?} (an init container with restartPolicy: Always), which the apiserver ({version}) does not run: native sidecars are on by default from Kubernetes 1.29",
        sidecar.name
    ))
}

/// The LMCache MP worker's port when the adapter rendered the worker.
fn mp_worker_port(pod: &Pod, cb: &CacheBackend) -> Option<u16> {
    let rendered = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .any(|c| is_rendered(c, WORKER_CONTAINER));
    if !rendered {
        return None;
    }
    u16::try_from(
        cb.spec
            .lm_cache
            .clone()
            .unwrap_or_default()
            .effective_worker_port(),
    )
    .ok()
}

/// The pod's TCP listeners other than the engine's KV-event sockets: ports other containers
/// declare, the engine's HTTP port (`--port`, else the runtime's default), the MP worker.
fn other_listeners(
    pod: &Pod,
    engine: Option<usize>,
    runtime: Runtime,
    mp_worker: Option<u16>,
) -> OtherListeners {
    let engine_c = engine.and_then(|i| pod.spec.as_ref().and_then(|s| s.containers.get(i)));
    let engine_name = engine_c.map(|c| c.name.as_str());
    let mut out: OtherListeners = declared_ports(pod)
        .into_iter()
        .filter(|(_, what)| {
            // The engine's own declarations may be its publishers; they are not "others".
            engine_name.is_none_or(|n| !what.starts_with(&format!("container {n:?} ")))
        })
        .collect();
    if let Some(c) = engine_c {
        if let Ok(cmd) = EngineCommand::parse(c, runtime) {
            let args = cmd.texts();
            let http = engine_flags::http_port(runtime, &args);
            out.entry(http)
                .or_insert_with(|| format!("the engine's HTTP port (container {:?})", c.name));
        }
    }
    if let Some(p) = mp_worker {
        out.insert(p, "the LMCache MP worker".to_string());
    }
    out
}

/// Builds the outcome: the patch from `base` to `out`, checked against the request object.
fn finish(
    raw: &Value,
    base: &Value,
    out: &Pod,
    reason: String,
    warnings: Vec<String>,
) -> PodOutcome {
    let after = match serde_json::to_value(out) {
        Ok(v) => v,
        Err(e) => {
            return PodOutcome::allow(format!(
                "internal error: the mutated pod does not encode ({e}); pod admitted unwired"
            ))
        }
    };
    let patch = json_patch::diff(base, &after);
    if patch.0.is_empty() {
        return PodOutcome {
            allowed: true,
            patch: None,
            reason,
            warnings,
        };
    }
    // The patch must apply to the object the apiserver holds and yield the pod we built.
    let ops = match serde_json::to_value(&patch) {
        Ok(Value::Array(ops)) => ops,
        _ => {
            return PodOutcome::allow(
                "internal error: the wiring patch does not encode; pod admitted unwired",
            )
        }
    };
    let mut probe = raw.clone();
    if let Err(e) = json_patch::patch(&mut probe, &patch) {
        return PodOutcome::allow(format!(
            "internal error: the wiring patch does not apply ({e}); pod admitted unwired"
        ));
    }
    // The patched request must be the wired pod. When the request object is exactly what the
    // typed pod encodes to, comparing the JSON trees proves it; otherwise (fields the typed
    // model drops, explicit nulls, …) the patched request is decoded and compared as a pod.
    let reproduces =
        probe == after || serde_json::from_value::<Pod>(probe).is_ok_and(|p| &p == out);
    if reproduces {
        PodOutcome {
            allowed: true,
            patch: Some(ops),
            reason,
            warnings,
        }
    } else {
        PodOutcome::allow(
            "internal error: the wiring patch does not reproduce the wired pod; pod admitted unwired",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn truthy_values() {
        for v in ["true", "TRUE", "t", "1", "yes", "Y", "on", " true "] {
            assert!(truthy(v), "{v}");
        }
        for v in ["false", "0", "", "no", "off", "nope"] {
            assert!(!truthy(v), "{v}");
        }
    }

    #[test]
    fn never_panics_on_garbage_and_always_allows() {
        let cfg = PodWebhookConfig::default();
        for v in [
            json!(null),
            json!({}),
            json!({"spec": null}),
            json!({"metadata": 5}),
        ] {
            let o = mutate_pod::<CacheBackend>(&v, "", &[], &cfg);
            assert!(o.allowed);
            assert_eq!(o.patch, None);
        }
    }
}
