//! Model-cache reader wiring for the Pod webhook (spec 004 "What runs today": "The mutating
//! webhook injects the reader PVC into workload pods as a volume named `model-data`"; issue 8
//! deliverable 4).
//!
//! Pure and fail-open like the rest of the Pod webhook: the caller resolves the request the pod
//! names ([`requested_model_cache`]), looks up its status, and calls [`wire_model_cache`], which
//! returns either JSON Patch operations or the reason the pod is left as it is. It never fails
//! the pod.
//!
//! ```text
//! metadata.annotations:
//!   inferencecache.io/model-cache: llama-8b              # or team-a/llama-8b (helmModelCache)
//!   inferencecache.io/model-cache-mount-path: /models    # optional, default /model-data
//!   inferencecache.io/model-cache-container: vllm        # optional, default the first container
//! ```
//!
//! Wired: volume `model-data` = the request's reader claim with `readOnly: true`, and a
//! `readOnly: true` volumeMount of it in the engine container. Left alone (with a reason): no
//! annotation, a malformed one, the request unknown, its mode not `durable`, its `Ready`
//! condition not `True`, the pod's namespace not among its reader namespaces, a foreign
//! `model-data` volume, no such container, a relative mount path or one the container already
//! uses. A pod already wired to the same claim yields no operations.

use ic_shared::crd::{
    annotations, is_condition_true, model_cache_condition, CacheMode, ModelCacheStatus,
    NamespacedName, MODEL_DATA_VOLUME,
};
use json_patch::{AddOperation, PatchOperation};
use serde_json::{json, Value};

/// Default mount path of `model-data` in the engine container.
pub const DEFAULT_MOUNT_PATH: &str = "/model-data";

/// What [`wire_model_cache`] decided.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelCacheWiring {
    /// The pod does not ask for a model cache: nothing to say.
    NotRequested,
    /// Patch the pod with these operations (empty when it is already wired).
    Wired {
        /// RFC 6902 operations against the request's pod.
        patch: Vec<PatchOperation>,
        /// `model cache <ns>/<name>: reader claim <claim> mounted read-only at <path> in <container>`.
        reason: String,
    },
    /// Leave the pod unchanged, for this reason (fail-open).
    Skipped {
        /// Why, as a sentence.
        reason: String,
    },
}

/// The request a pod names in [`annotations::MODEL_CACHE`], relative to `pod_namespace`:
/// `None` without the annotation; `Some(Err(reason))` when the value is malformed.
pub fn requested_model_cache(
    pod: &Value,
    pod_namespace: &str,
) -> Option<Result<NamespacedName, String>> {
    let raw = pod
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(annotations::MODEL_CACHE))?;
    let Some(value) = raw.as_str().map(str::trim) else {
        return Some(Err(format!(
            "annotation {} is not a string",
            annotations::MODEL_CACHE
        )));
    };
    let parsed = match value.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok(NamespacedName::new(ns, name))
        }
        None if !value.is_empty() => Ok(NamespacedName::new(pod_namespace, value)),
        _ => Err(format!(
            "annotation {} is {value:?}; expected <name> or <namespace>/<name>",
            annotations::MODEL_CACHE
        )),
    };
    Some(parsed)
}

fn skip(reason: impl Into<String>) -> ModelCacheWiring {
    ModelCacheWiring::Skipped {
        reason: reason.into(),
    }
}

fn add(path: &str, value: Value) -> Result<PatchOperation, String> {
    let path = json_patch::jsonptr::PointerBuf::parse(path).map_err(|e| e.to_string())?;
    Ok(PatchOperation::Add(AddOperation { path, value }))
}

/// Decides the model-cache wiring of `pod` (the AdmissionReview's `request.object`) in
/// `pod_namespace`, given the `status` of the request it names (`None`: not found).
///
/// Returns [`ModelCacheWiring::Wired`] with operations that add volume `model-data`
/// (`persistentVolumeClaim: {claimName, readOnly: true}`) and a `readOnly` mount of it at the
/// `inferencecache.io/model-cache-mount-path` annotation's path (default `/model-data`) in the
/// container named by `inferencecache.io/model-cache-container` (default the first one);
/// otherwise [`ModelCacheWiring::Skipped`] with the reason, or
/// [`ModelCacheWiring::NotRequested`]. Never panics on any input.
pub fn wire_model_cache(
    pod: &Value,
    pod_namespace: &str,
    status: Option<&ModelCacheStatus>,
) -> ModelCacheWiring {
    let request = match requested_model_cache(pod, pod_namespace) {
        None => return ModelCacheWiring::NotRequested,
        Some(Err(reason)) => return skip(reason),
        Some(Ok(r)) => r,
    };
    let Some(status) = status else {
        return skip(format!("ModelCache {request} not found; pod left unwired"));
    };
    if status.mode != Some(CacheMode::Durable) {
        let mode = status
            .mode
            .map(|m| m.as_str())
            .unwrap_or("not selected yet");
        return skip(format!(
            "ModelCache {request} has mode {mode}: no reader claim to mount"
        ));
    }
    let Some(claim) = status.reader_claim.as_deref().filter(|c| !c.is_empty()) else {
        return skip(format!("ModelCache {request} has no reader claim yet"));
    };
    if !is_condition_true(&status.conditions, model_cache_condition::READY) {
        return skip(format!(
            "ModelCache {request} is not Ready: its reader claim may not exist yet"
        ));
    }
    if !status.reader_namespaces.iter().any(|n| n == pod_namespace) {
        return skip(format!(
            "ModelCache {request} has no reader claim in namespace {pod_namespace} (reader namespaces: {})",
            status.reader_namespaces.join(", ")
        ));
    }
    let annotation = |key: &str| {
        pod.pointer("/metadata/annotations")
            .and_then(|a| a.get(key))
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|s| !s.is_empty())
    };
    let path = annotation(annotations::MODEL_CACHE_MOUNT_PATH).unwrap_or(DEFAULT_MOUNT_PATH);
    if !path.starts_with('/') {
        return skip(format!(
            "annotation {} is {path:?}; a mount path must be absolute",
            annotations::MODEL_CACHE_MOUNT_PATH
        ));
    }
    let Some(containers) = pod.pointer("/spec/containers").and_then(Value::as_array) else {
        return skip("the pod has no containers");
    };
    let wanted = annotation(annotations::MODEL_CACHE_CONTAINER);
    let found = match wanted {
        Some(name) => containers
            .iter()
            .position(|c| c.get("name").and_then(Value::as_str) == Some(name)),
        None => (!containers.is_empty()).then_some(0),
    };
    let Some(index) = found else {
        return skip(format!(
            "container {:?} not found in the pod",
            wanted.unwrap_or_default()
        ));
    };
    let container = &containers[index];
    let cname = container
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let volumes = pod.pointer("/spec/volumes").and_then(Value::as_array);
    let existing = volumes.and_then(|vs| {
        vs.iter()
            .find(|v| v.get("name").and_then(Value::as_str) == Some(MODEL_DATA_VOLUME))
    });
    let mounts = container.get("volumeMounts").and_then(Value::as_array);
    let mounted_here = mounts.and_then(|ms| {
        ms.iter()
            .find(|m| m.get("name").and_then(Value::as_str) == Some(MODEL_DATA_VOLUME))
    });
    let reason = format!(
        "model cache {request}: reader claim {claim} mounted read-only at {path} in container {cname}"
    );
    if let Some(v) = existing {
        let same_claim = v
            .pointer("/persistentVolumeClaim/claimName")
            .and_then(Value::as_str)
            == Some(claim)
            && v.pointer("/persistentVolumeClaim/readOnly") == Some(&json!(true));
        let mount_ok = mounted_here.is_some_and(|m| {
            m.get("readOnly") == Some(&json!(true))
                && m.get("mountPath").and_then(Value::as_str) == Some(path)
        });
        if same_claim && mount_ok {
            return ModelCacheWiring::Wired {
                patch: Vec::new(),
                reason,
            };
        }
        return skip(format!(
            "the pod already has a volume named {MODEL_DATA_VOLUME} that is not the read-only reader claim {claim}"
        ));
    }
    if mounted_here.is_some() {
        return skip(format!(
            "container {cname} already mounts a volume named {MODEL_DATA_VOLUME}"
        ));
    }
    if mounts.is_some_and(|ms| {
        ms.iter()
            .any(|m| m.get("mountPath").and_then(Value::as_str) == Some(path))
    }) {
        return skip(format!(
            "container {cname} already mounts something at {path}"
        ));
    }
    let volume = json!({
        "name": MODEL_DATA_VOLUME,
        "persistentVolumeClaim": {"claimName": claim, "readOnly": true}
    });
    let mount = json!({"name": MODEL_DATA_VOLUME, "mountPath": path, "readOnly": true});
    let ops = (|| -> Result<Vec<PatchOperation>, String> {
        Ok(vec![
            match volumes {
                Some(_) => add("/spec/volumes/-", volume)?,
                None => add("/spec/volumes", json!([volume]))?,
            },
            match mounts {
                Some(_) => add(&format!("/spec/containers/{index}/volumeMounts/-"), mount)?,
                None => add(
                    &format!("/spec/containers/{index}/volumeMounts"),
                    json!([mount]),
                )?,
            },
        ])
    })();
    match ops {
        Ok(patch) => ModelCacheWiring::Wired { patch, reason },
        Err(e) => skip(format!("internal error building the patch: {e}")),
    }
}
