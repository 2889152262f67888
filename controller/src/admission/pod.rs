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
//!    no wiring; strip `injected-by`/`injected-by-uid`; stamp `inject-skipped:
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
//! 6. Annotations: on success `injected-by: <namespace>/<name>` and `injected-by-uid: <uid>`,
//!    `inject-skipped` removed; on every fail-open path after decoding, all three removed.
//!
//! The JSON Patch is the diff between the decoded pod and the mutated one, checked to apply to
//! the request object and to round-trip to the mutated pod. The adapters converge, so
//! re-admitting a wired pod yields no patch.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ic_shared::crd::{CacheBackend, Runtime};
use k8s_openapi::api::core::v1::{
    Container, EnvVar, EnvVarSource, ObjectFieldSelector, Pod, ProjectedVolumeSource,
    ResourceRequirements, ServiceAccountTokenProjection, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::Value;

use crate::adapters::overrides::{apply_overrides, snapshot};
use crate::adapters::{
    binding_label, env_var, hardened_security_context, is_rendered, resolve_binding,
    select_engine_by_command, EngineCommand, InjectContext, Registry, ENV_COMPONENT,
};

/// Pod annotation stamped on a wired pod: `<namespace>/<name>` of the CacheBackend.
pub const ANNOTATION_INJECTED_BY: &str = "inferencecache.io/injected-by";
/// Pod annotation stamped on a wired pod: the CacheBackend's `metadata.uid`.
pub const ANNOTATION_INJECTED_BY_UID: &str = "inferencecache.io/injected-by-uid";
/// Pod annotation stamped when the operator opted out with [`ANNOTATION_SKIP_INJECT`].
pub const ANNOTATION_INJECT_SKIPPED: &str = "inferencecache.io/inject-skipped";
/// Pod annotation by which an operator opts a pod out of wiring (truthy value).
pub const ANNOTATION_SKIP_INJECT: &str = crate::reconcile::annotations::SKIP_INJECT;
/// Value of [`ANNOTATION_INJECT_SKIPPED`].
pub const SKIPPED_BY_OPERATOR: &str = "skip-inject-annotation";
/// `PodOutcome::reason` of a wired pod.
pub const REASON_INJECTED: &str = "Injected";
/// Name of the kvevent-subscriber sidecar (a regular container: no Kubernetes version floor).
pub const SUBSCRIBER_CONTAINER: &str = "kvevent-subscriber";
/// Projected service-account token volume of the kvevent-subscriber sidecar (added only when the
/// pod has no volume of that name).
pub const SUBSCRIBER_TOKEN_VOLUME: &str = "inference-cache-token";
/// Where the sidecar mounts [`SUBSCRIBER_TOKEN_VOLUME`]: the directory of
/// `ic-agent subscribe --token-file`'s default (`/var/run/secrets/inference-cache/token`).
pub const SUBSCRIBER_TOKEN_DIR: &str = "/var/run/secrets/inference-cache";
/// Lifetime of the sidecar's projected token in seconds (the kubelet rotates it at 80 %).
pub const SUBSCRIBER_TOKEN_EXPIRATION_SECONDS: i64 = 3600;
/// Engine KV-event endpoint assumed when the engine has no `--kv-events-config`.
pub const DEFAULT_KV_EVENTS_ENDPOINT: &str = "tcp://127.0.0.1:5557";

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
}

impl Default for PodWebhookConfig {
    fn default() -> Self {
        PodWebhookConfig {
            registry: Arc::new(Registry::builtin()),
            kvevent_subscriber_image: None,
            kvevent_subscriber_controller: None,
            lmcache_worker_image: None,
            lmcache_kernel_check_image: None,
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

use crate::reconcile::annotations::is_truthy as truthy;

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

const ALL_MARKERS: [&str; 3] = [
    ANNOTATION_INJECTED_BY,
    ANNOTATION_INJECTED_BY_UID,
    ANNOTATION_INJECT_SKIPPED,
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
            &[ANNOTATION_INJECTED_BY, ANNOTATION_INJECTED_BY_UID],
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
    let mut candidates: Vec<&CacheBackend> = backends
        .iter()
        .map(Borrow::borrow)
        .filter(|cb| {
            cb.metadata
                .namespace
                .as_deref()
                .is_none_or(|ns| ns.is_empty() || ns == namespace)
        })
        .collect();
    candidates.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let matched = candidates.into_iter().find(|cb| {
        cb.spec
            .match_labels()
            .is_some_and(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
    });
    let Some(cb) = matched else {
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
        Ok(warnings) => {
            strip(&mut wired, &[ANNOTATION_INJECT_SKIPPED]);
            let a = annotations(&mut wired);
            a.insert(ANNOTATION_INJECTED_BY.to_string(), id);
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
        Err(Unwired { reason, warnings }) => {
            let mut out = pod.clone();
            strip(&mut out, &ALL_MARKERS);
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

impl<E: std::fmt::Display> From<E> for Unwired {
    fn from(e: E) -> Self {
        Unwired {
            reason: e.to_string(),
            warnings: Vec::new(),
        }
    }
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
        let engine = select_engine_by_command(pod, runtime).ok();
        add_subscriber(
            pod,
            engine,
            runtime,
            image,
            model,
            false,
            cfg,
            &mut warnings,
        )?;
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

    if let (Some(image), Some(model)) = (cfg.kvevent_subscriber_image.as_deref(), spec.model_id()) {
        add_subscriber(
            pod,
            Some(engine),
            runtime,
            image,
            model,
            true,
            cfg,
            &mut warnings,
        )?;
    }
    Ok(warnings)
}

/// The engine's KV-event endpoint as seen from a sidecar: `--kv-events-config`'s `endpoint`
/// with a wildcard host replaced by loopback.
fn kv_events_endpoint(
    pod: &Pod,
    engine: Option<usize>,
    runtime: Runtime,
    warnings: &mut Vec<String>,
) -> String {
    let Some(c) = engine.and_then(|i| pod.spec.as_ref().and_then(|s| s.containers.get(i))) else {
        warnings.push(format!(
            "no engine container found; the kvevent-subscriber listens on {DEFAULT_KV_EVENTS_ENDPOINT}"
        ));
        return DEFAULT_KV_EVENTS_ENDPOINT.to_string();
    };
    let found = EngineCommand::parse(c, runtime).ok().and_then(|cmd| {
        let occ = cmd.find("--kv-events-config").into_iter().next()?;
        let (value, _) = cmd.value_of(&occ)?;
        let v: Value = serde_json::from_str(&value).ok()?;
        let ep = v.get("endpoint")?.as_str()?.to_string();
        let rest = ep.strip_prefix("tcp://")?;
        let (host, port) = rest.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let host = if matches!(host, "*" | "0.0.0.0" | "" | "[::]" | "::") {
            "127.0.0.1"
        } else {
            host
        };
        Some(format!("tcp://{host}:{port}"))
    });
    match found {
        Some(ep) => ep,
        None => {
            warnings.push(format!(
                "container {:?} has no readable --kv-events-config endpoint; the kvevent-subscriber listens on {DEFAULT_KV_EVENTS_ENDPOINT} (the engine must publish KV events for routing to work)",
                c.name
            ));
            DEFAULT_KV_EVENTS_ENDPOINT.to_string()
        }
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: path.to_string(),
            }),
            ..Default::default()
        }),
    }
}

/// Appends (or converges) the kvevent-subscriber sidecar: the agent binary in per-pod mode,
/// `--hash-scheme` from the runtime, `--ignore-block-removed=true` in Offload mode, tenant = pod
/// namespace, replica id = pod name (downward API). The sidecar mounts a projected
/// service-account token (audience `inference-cache`, 1 h) read-only at
/// [`SUBSCRIBER_TOKEN_DIR`], which the controller verifies as the pod's own
/// ([`crate::ingest::auth`], per-pod subscribers); the volume is added unless the pod already
/// has one named [`SUBSCRIBER_TOKEN_VOLUME`].
#[allow(clippy::too_many_arguments)]
fn add_subscriber(
    pod: &mut Pod,
    engine: Option<usize>,
    runtime: Runtime,
    image: &str,
    model: &str,
    offload: bool,
    cfg: &PodWebhookConfig,
    warnings: &mut Vec<String>,
) -> Result<(), Unwired> {
    let endpoint = kv_events_endpoint(pod, engine, runtime, warnings);
    let scheme = match runtime {
        Runtime::Vllm => "vllm",
        Runtime::SgLang => "sglang",
    };
    let mut args = vec![
        "subscribe".to_string(),
        format!("--endpoint={endpoint}"),
        format!("--hash-scheme={scheme}"),
        format!("--model-id={model}"),
        "--tenant=$(POD_NAMESPACE)".to_string(),
        "--replica-id=$(POD_NAME)".to_string(),
    ];
    if offload {
        args.push("--ignore-block-removed=true".to_string());
    }
    if let Some(ctl) = cfg.kvevent_subscriber_controller.as_deref() {
        args.push(format!("--controller={ctl}"));
    }
    let sidecar = Container {
        name: SUBSCRIBER_CONTAINER.to_string(),
        image: Some(image.to_string()),
        args: Some(args),
        env: Some(vec![
            env_var(ENV_COMPONENT, SUBSCRIBER_CONTAINER),
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("NODE_NAME", "spec.nodeName"),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("10m".to_string())),
                ("memory".to_string(), Quantity("32Mi".to_string())),
            ])),
            ..Default::default()
        }),
        security_context: Some(hardened_security_context()),
        volume_mounts: Some(vec![VolumeMount {
            name: SUBSCRIBER_TOKEN_VOLUME.to_string(),
            mount_path: SUBSCRIBER_TOKEN_DIR.to_string(),
            read_only: Some(true),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let Some(spec) = pod.spec.as_mut() else {
        return Err(Unwired::from("the pod has no spec"));
    };
    if spec
        .init_containers
        .iter()
        .flatten()
        .any(|c| c.name == SUBSCRIBER_CONTAINER)
    {
        return Err(Unwired::from(format!(
            "the pod already has a init container named {SUBSCRIBER_CONTAINER:?} that inference-cache did not render; rename it to get the pod wired"
        )));
    }
    match spec.containers.iter_mut().find(|c| c.name == SUBSCRIBER_CONTAINER) {
        Some(existing) if is_rendered(existing, SUBSCRIBER_CONTAINER) => *existing = sidecar,
        Some(_) => {
            return Err(Unwired::from(format!(
                "the pod already has a container named {SUBSCRIBER_CONTAINER:?} that inference-cache did not render; rename it to get the pod wired"
            )))
        }
        None => spec.containers.push(sidecar),
    }
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    if !volumes.iter().any(|v| v.name == SUBSCRIBER_TOKEN_VOLUME) {
        volumes.push(subscriber_token_volume());
    }
    Ok(())
}

/// The sidecar's projected token: audience `inference-cache`, file `token`.
fn subscriber_token_volume() -> Volume {
    Volume {
        name: SUBSCRIBER_TOKEN_VOLUME.to_string(),
        projected: Some(ProjectedVolumeSource {
            default_mode: None,
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(crate::ingest::auth::DEFAULT_AUDIENCE.to_string()),
                    expiration_seconds: Some(SUBSCRIBER_TOKEN_EXPIRATION_SECONDS),
                    path: "token".to_string(),
                }),
                ..Default::default()
            }]),
        }),
        ..Default::default()
    }
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
