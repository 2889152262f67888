//! Facts derived from the engine pods and Deployments of a CacheBackend's namespace (spec 000
//! "Status": `matchedEnginePods`, `engineSelectorMessage`; "Conditions": EngineKernelsHealthy,
//! EngineCompatibility; `observedServerInstance`'s cascade targets).
//!
//! The controller does not watch engine pods: it lists them at reconcile cadence and derives
//! everything here, purely.
//!
//! # Kernel-check contract
//!
//! The `lmcache-kernel-check` init container (injected by the vLLM+LMCache adapter) reports
//! through its termination message: JSON `{"loaded": true}` / `{"loaded": false, "cause":
//! "…"}`, or a first line `ok` / `failed: <cause>`. In strict mode (pod annotation
//! `inferencecache.io/lmcache-kernel-check: strict`, or the init container's env
//! `LMCACHE_KERNEL_CHECK_MODE=strict`) a failure exits non-zero, so a non-zero exit without a
//! message is a failure and a zero exit without one is success; in report-only mode the
//! detector always exits 0 and the message is the only result (none → KernelCheckError).

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::crd::{CacheBackend, CacheBackendSpec, CacheBackendStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use super::index_view::selector_matches;
use crate::reconcile::annotations::{INJECTED_BY, INJECTED_BY_UID, LMCACHE_KERNEL_CHECK};
use crate::reconcile::render::LABEL_BACKEND;

/// Name of the kernel-check init container.
pub const KERNEL_CHECK_CONTAINER: &str = "lmcache-kernel-check";
/// Env var on the kernel-check init container naming its mode (`strict`, `report-only`).
pub const KERNEL_CHECK_MODE_ENV: &str = "LMCACHE_KERNEL_CHECK_MODE";

/// `matchedEnginePods` / `engineSelectorMessage` and the requeue hint they imply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SelectorObservation {
    /// `status.matchedEnginePods`.
    pub matched: Option<i32>,
    /// `status.engineSelectorMessage`.
    pub message: Option<String>,
    /// True when the pods were actually counted this reconcile (false: no selector, or the
    /// pod list failed and the prior values were kept).
    pub observed: bool,
    /// Matching pods differ from the desired replica sum of matching Deployments: requeue at
    /// the 5 s churn cadence.
    pub churn: bool,
}

/// `{k=v, k2=v2}` — a selector as the diagnostic message echoes it.
pub fn format_selector(sel: &BTreeMap<String, String>) -> String {
    let parts: Vec<String> = sel.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", parts.join(", "))
}

fn is_owned_cache_server(d: &Deployment) -> bool {
    d.metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(LABEL_BACKEND))
}

/// Computes `matchedEnginePods` and `engineSelectorMessage` (spec "Status").
///
/// - No claim-capable selector (absent or empty `matchLabels`): both cleared.
/// - `pods` unavailable (list failed): the prior values are kept.
/// - Otherwise the count of namespace pods whose labels satisfy the selector; the message is
///   set when the count is 0 and engine pods are expected — i.e. unless the selector matches at
///   least one Deployment (by pod-template labels) and all of them are scaled to zero.
pub fn selector_status(
    spec: &CacheBackendSpec,
    namespace: &str,
    pods: Option<&[Pod]>,
    deployments: Option<&[Deployment]>,
    prior: &CacheBackendStatus,
) -> SelectorObservation {
    let Some(sel) = spec.match_labels() else {
        return SelectorObservation::default();
    };
    let Some(pods) = pods else {
        return SelectorObservation {
            matched: prior.matched_engine_pods,
            message: prior.engine_selector_message.clone(),
            observed: false,
            churn: false,
        };
    };
    let count = pods
        .iter()
        .filter(|p| p.metadata.namespace.as_deref().unwrap_or_default() == namespace)
        .filter(|p| selector_matches(sel, p))
        .count();
    let count = i32::try_from(count).unwrap_or(i32::MAX);
    let matching: Option<Vec<&Deployment>> = deployments.map(|ds| {
        ds.iter()
            .filter(|d| !is_owned_cache_server(d))
            .filter(|d| {
                let labels = d
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.metadata.as_ref())
                    .and_then(|m| m.labels.as_ref());
                sel.iter()
                    .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
            })
            .collect()
    });
    let desired: Option<i32> = matching.as_ref().filter(|m| !m.is_empty()).map(|m| {
        m.iter()
            .map(|d| d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1))
            .sum()
    });
    let expected = desired != Some(0);
    let message = (count == 0 && expected).then(|| {
        format!(
            "spec.engineSelector.matchLabels={} matches no Pods in namespace {namespace}; check \
             the engine pod template's metadata.labels (not the Deployment's labels)",
            format_selector(sel)
        )
    });
    SelectorObservation {
        matched: Some(count),
        message,
        observed: true,
        churn: desired.is_some_and(|d| d != count),
    }
}

/// `<namespace>/<name>` of a backend, as the injected-by annotation carries it.
pub fn backend_ref(cb: &CacheBackend) -> String {
    format!(
        "{}/{}",
        cb.metadata.namespace.as_deref().unwrap_or_default(),
        cb.metadata.name.as_deref().unwrap_or_default()
    )
}

/// True when `pod` was injected by `cb`: `injected-by` names it and `injected-by-uid` matches
/// its live UID.
pub fn injected_by(pod: &Pod, cb: &CacheBackend) -> bool {
    let Some(a) = pod.metadata.annotations.as_ref() else {
        return false;
    };
    let Some(uid) = cb.metadata.uid.as_deref() else {
        return false;
    };
    a.get(INJECTED_BY).map(String::as_str) == Some(backend_ref(cb).as_str())
        && a.get(INJECTED_BY_UID).map(String::as_str) == Some(uid)
}

/// The engine pods of `cb`: selector-matched or injected by it, in the backend's namespace.
pub fn engine_pods<'a>(cb: &CacheBackend, pods: &'a [Pod]) -> Vec<&'a Pod> {
    let ns = cb.metadata.namespace.as_deref().unwrap_or_default();
    let sel = cb.spec.match_labels();
    pods.iter()
        .filter(|p| p.metadata.namespace.as_deref().unwrap_or_default() == ns)
        .filter(|p| sel.is_some_and(|s| selector_matches(s, p)) || injected_by(p, cb))
        .collect()
}

/// The engine container of a pod: the one named `vllm` or `sglang`, else the first.
pub fn engine_container_name(pod: &Pod) -> Option<&str> {
    let containers = &pod.spec.as_ref()?.containers;
    containers
        .iter()
        .find(|c| c.name == "vllm" || c.name == "sglang")
        .or_else(|| containers.first())
        .map(|c| c.name.as_str())
}

/// Names (sorted) of pods injected by `cb` whose engine container is in CrashLoopBackOff.
pub fn crash_looping_injected(cb: &CacheBackend, pods: &[Pod]) -> Vec<String> {
    let mut out: Vec<String> = pods
        .iter()
        .filter(|p| injected_by(p, cb))
        .filter(|p| {
            let Some(engine) = engine_container_name(p) else {
                return false;
            };
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.name == engine
                            && c.state
                                .as_ref()
                                .and_then(|s| s.waiting.as_ref())
                                .and_then(|w| w.reason.as_deref())
                                == Some("CrashLoopBackOff")
                    })
                })
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    out.sort();
    out
}

/// One pod's kernel-check verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelResult {
    /// The native kernels loaded.
    Healthy,
    /// They failed to load; the cause.
    Failed(String),
    /// The check ended without a recognised result; what was seen.
    Error(String),
    /// The check has not finished.
    Pending,
}

/// The kernel check of one engine pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCheck {
    /// Pod name.
    pub pod: String,
    /// Verdict.
    pub result: KernelResult,
    /// Whether the pod was admitted in strict mode (read from the pod).
    pub strict: bool,
}

fn parse_message(msg: &str) -> Option<KernelResult> {
    let msg = msg.trim();
    if msg.is_empty() {
        return None;
    }
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(msg) {
        let cause = ["cause", "error", "reason", "message"]
            .iter()
            .find_map(|k| v.get(*k).and_then(|c| c.as_str()))
            .unwrap_or("lmcache c_ops failed to load")
            .to_string();
        return match v.get("loaded").and_then(|l| l.as_bool()) {
            Some(true) => Some(KernelResult::Healthy),
            Some(false) => Some(KernelResult::Failed(cause)),
            None => match v.get("status").and_then(|s| s.as_str()) {
                Some("ok") => Some(KernelResult::Healthy),
                Some("failed") => Some(KernelResult::Failed(cause)),
                _ => None,
            },
        };
    }
    let first = msg.lines().next().unwrap_or_default().trim();
    let lower = first.to_ascii_lowercase();
    if lower == "ok" || lower == "loaded" || lower == "healthy" {
        return Some(KernelResult::Healthy);
    }
    for prefix in ["failed:", "fail:", "failed"] {
        if lower.starts_with(prefix) {
            let cause = first[prefix.len()..].trim();
            return Some(KernelResult::Failed(if cause.is_empty() {
                "lmcache c_ops failed to load".to_string()
            } else {
                cause.to_string()
            }));
        }
    }
    None
}

fn from_terminated(t: &ContainerStateTerminated, strict: bool) -> KernelResult {
    if let Some(r) = t.message.as_deref().and_then(parse_message) {
        return r;
    }
    match (strict, t.exit_code) {
        (true, 0) => KernelResult::Healthy,
        (true, code) => KernelResult::Failed(format!("kernel check exited with code {code}")),
        (false, code) => KernelResult::Error(format!(
            "kernel check exited with code {code} without a recognised result"
        )),
    }
}

fn is_strict(pod: &Pod) -> bool {
    let by_annotation = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LMCACHE_KERNEL_CHECK))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("strict"));
    let by_env = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .and_then(|ics| ics.iter().find(|c| c.name == KERNEL_CHECK_CONTAINER))
        .and_then(|c| c.env.as_ref())
        .is_some_and(|env| {
            env.iter().any(|e| {
                e.name == KERNEL_CHECK_MODE_ENV
                    && e.value
                        .as_deref()
                        .is_some_and(|v| v.trim().eq_ignore_ascii_case("strict"))
            })
        });
    by_annotation || by_env
}

/// The kernel check of each pod that runs one (pods without the init container are skipped).
pub fn kernel_checks(pods: &[&Pod]) -> Vec<KernelCheck> {
    let mut out = Vec::new();
    for pod in pods {
        let runs_check = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .is_some_and(|ics| ics.iter().any(|c| c.name == KERNEL_CHECK_CONTAINER));
        if !runs_check {
            continue;
        }
        let strict = is_strict(pod);
        let status = pod
            .status
            .as_ref()
            .and_then(|s| s.init_container_statuses.as_ref())
            .and_then(|ss| ss.iter().find(|c| c.name == KERNEL_CHECK_CONTAINER));
        let result = match status {
            None => KernelResult::Pending,
            Some(cs) => match cs.state.as_ref().and_then(|s| s.terminated.as_ref()) {
                Some(t) => from_terminated(t, strict),
                None => match cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()) {
                    // A strict check restarting after a failure: report the last failure.
                    Some(t) => match from_terminated(t, strict) {
                        f @ KernelResult::Failed(_) => f,
                        _ => KernelResult::Pending,
                    },
                    None => KernelResult::Pending,
                },
            },
        };
        out.push(KernelCheck {
            pod: pod.metadata.name.clone().unwrap_or_default(),
            result,
            strict,
        });
    }
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
    out
}

/// Engine Deployments (sorted, unique) that own pods injected by `cb` — the cascade-restart
/// targets. A pod's Deployment is found through its ReplicaSet owner (`<deployment>-<hash>`,
/// `hash` = the pod's `pod-template-hash` label); when `deployments` is known, only names
/// present there are returned.
pub fn injected_engine_deployments(
    cb: &CacheBackend,
    pods: &[Pod],
    deployments: Option<&[Deployment]>,
) -> Vec<String> {
    let existing: Option<BTreeSet<&str>> = deployments.map(|ds| {
        ds.iter()
            .filter(|d| !is_owned_cache_server(d))
            .filter_map(|d| d.metadata.name.as_deref())
            .collect()
    });
    let mut out = BTreeSet::new();
    for pod in pods.iter().filter(|p| injected_by(p, cb)) {
        let Some(hash) = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("pod-template-hash"))
        else {
            continue;
        };
        let rs = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.kind == "ReplicaSet");
        let Some(deploy) = rs.and_then(|o| o.name.strip_suffix(&format!("-{hash}"))) else {
            continue;
        };
        if existing.as_ref().is_none_or(|e| e.contains(deploy)) {
            out.insert(deploy.to_string());
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_messages() {
        assert_eq!(
            parse_message("{\"loaded\": true}"),
            Some(KernelResult::Healthy)
        );
        assert_eq!(
            parse_message("{\"loaded\": false, \"cause\": \"libcudart.so.13\"}"),
            Some(KernelResult::Failed("libcudart.so.13".to_string()))
        );
        assert_eq!(parse_message("ok\n"), Some(KernelResult::Healthy));
        assert_eq!(
            parse_message("failed: no module named lmcache"),
            Some(KernelResult::Failed("no module named lmcache".to_string()))
        );
        assert_eq!(parse_message("garbage"), None);
        assert_eq!(parse_message(""), None);
    }

    #[test]
    fn selector_format() {
        let sel = BTreeMap::from([
            ("app".to_string(), "vllm".to_string()),
            ("tier".to_string(), "gpu".to_string()),
        ]);
        assert_eq!(format_selector(&sel), "{app=vllm, tier=gpu}");
    }
}
