//! Facts derived from the engine pods and Deployments of a CacheBackend's namespace (spec 000
//! "Status": `matchedEnginePods`, `engineSelectorMessage`; "Conditions": EngineKernelsHealthy,
//! EngineCompatibility; `observedServerInstance`'s cascade targets).
//!
//! The controller does not watch engine pods: it lists them at reconcile cadence and derives
//! everything here, purely.
//!
//! # Kernel-check contract
//!
//! The `lmcache-kernel-check` init container (rendered by the vLLM+LMCache adapter,
//! [`crate::adapters::vllm_lmcache`]) reports through its termination message, the adapter's
//! [`KernelCheckVerdict`] JSON `{"kernelsHealthy": …, "mode": …, "detail": …}`. Its mode is the
//! init container's env [`ENV_KERNEL_CHECK_MODE`] as the adapter rendered it (or the verdict's
//! `mode`). In strict mode a failure exits non-zero, so a non-zero exit without a message is a
//! failure and a zero exit without one is success; in report-only mode the check always exits 0
//! and the message is the only result (none → KernelCheckError).
//!
//! # Engine container and crash loops
//!
//! The engine container is the one the adapters wire ([`select_engine_container`]: the
//! container whose command launches the runtime), never a guess by name. A crash loop is what
//! the kubelet says it is (spec 000 "EngineCompatibility": "only when an injected engine
//! container is in CrashLoopBackOff"): the container's `state.waiting.reason` is
//! `CrashLoopBackOff`, which the kubelet writes while it holds a failed container in restart
//! back-off. A restart count alone is not a crash loop: an engine OOM-killed once a day, or
//! restarted by a node reboot, restarts at once (the kubelet's back-off for it has expired) and
//! is never in `CrashLoopBackOff`.
//!
//! An episode that has been observed (the pod is named by the prior
//! `EngineCompatibility=False/InjectedEngineCrashLooping`) continues between back-offs —
//! waiting in another reason, running for less than [`CRASH_LOOP_WINDOW_SECS`], or terminated
//! again — while its last run ended in failure (`lastState.terminated` non-zero), so one crash
//! loop is one condition and one Event, not one per back-off. The kubelet resets its back-off
//! after 10 minutes of running, and so does this rule.

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::crd::{CacheBackend, CacheBackendSpec, CacheBackendStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use super::index_view::selector_matches;
use crate::adapters::vllm_lmcache::{
    KernelCheckVerdict, ENV_KERNEL_CHECK_MODE, KERNEL_CHECK_CONTAINER, KERNEL_CHECK_STRICT,
};
use crate::engine::container::select_engine_container;
use crate::reconcile::annotations::{
    INJECTED_BY, INJECTED_BY_UID, INJECT_SKIPPED, NOT_INJECTED, WEBHOOK_OPT_OUT,
};
use crate::reconcile::render::LABEL_BACKEND;

/// A container running this long after a failed restart no longer continues a crash-loop
/// episode (the kubelet's back-off reset), seconds.
pub const CRASH_LOOP_WINDOW_SECS: i64 = 600;
/// The kubelet's `state.waiting.reason` for a container held in restart back-off.
pub const CRASH_LOOP_BACK_OFF: &str = "CrashLoopBackOff";

/// `matchedEnginePods` / `engineSelectorMessage` and the requeue hint they imply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SelectorObservation {
    /// `status.matchedEnginePods`: selected pods the Pod webhook decided on.
    pub matched: Option<i32>,
    /// `status.unwiredEnginePods`: selected pods the Pod webhook never saw
    /// ([`admitted_without_webhook`]).
    pub unwired: Option<i32>,
    /// Names of those pods, sorted (for the Event's note).
    pub unwired_pods: Vec<String>,
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

/// True when the Pod webhook never decided about `pod`: it carries none of the webhook's
/// decision annotations (`injected-by`, `not-injected`, `inject-skipped`; the webhook writes one
/// on every pod a CacheBackend selects) and is not labelled `inferencecache.io/webhook=disabled`
/// (the operator's opt-out of the webhook). Such a pod was created while the webhook was
/// unreachable or past its timeout (it fails open), or before the CacheBackend existed, and runs
/// without the cache until it is re-created (pure).
pub fn admitted_without_webhook(pod: &Pod) -> bool {
    let decided = pod.metadata.annotations.as_ref().is_some_and(|a| {
        [INJECTED_BY, NOT_INJECTED, INJECT_SKIPPED]
            .iter()
            .any(|k| a.contains_key(*k))
    });
    let opted_out = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(WEBHOOK_OPT_OUT))
        .map(String::as_str)
        == Some("disabled");
    !decided && !opted_out
}

/// Computes `matchedEnginePods`, `unwiredEnginePods` and `engineSelectorMessage` (spec
/// "Status"; issue 39 item 6).
///
/// - No claim-capable selector (absent or empty `matchLabels`): both cleared.
/// - `pods` unavailable (list failed): the prior values are kept while the spec is the one they
///   were computed for; with `spec_changed` (the generation moved since the last status) the
///   count is unset and the message says no count is known for the current selector.
/// - Otherwise the namespace pods whose labels satisfy the selector, split into those the Pod
///   webhook decided on (`matched`) and those it never saw (`unwired`,
///   [`admitted_without_webhook`]); the message is set when no pod is selected at all and
///   engine pods are expected — i.e. unless the selector matches at least one Deployment (by
///   pod-template labels) and all of them are scaled to zero.
pub fn selector_status(
    spec: &CacheBackendSpec,
    namespace: &str,
    pods: Option<&[Pod]>,
    deployments: Option<&[Deployment]>,
    prior: &CacheBackendStatus,
    spec_changed: bool,
) -> SelectorObservation {
    let Some(sel) = spec.match_labels() else {
        return SelectorObservation::default();
    };
    let Some(pods) = pods else {
        // The pod list failed. The last count stands only for the spec it was taken under; a
        // changed spec (a new selector, perhaps) has none yet, and says so.
        if spec_changed {
            return SelectorObservation {
                matched: None,
                unwired: None,
                unwired_pods: Vec::new(),
                message: Some(
                    "The pods of this namespace could not be listed since the spec changed, so \
                     no engine pod count is known for the current selector yet (see the \
                     controller log; it retries)."
                        .to_string(),
                ),
                observed: false,
                churn: false,
            };
        }
        return SelectorObservation {
            matched: prior.matched_engine_pods,
            unwired: prior.unwired_engine_pods,
            unwired_pods: Vec::new(),
            message: prior.engine_selector_message.clone(),
            observed: false,
            churn: false,
        };
    };
    let selected: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.metadata.namespace.as_deref().unwrap_or_default() == namespace)
        .filter(|p| selector_matches(sel, p))
        .collect();
    let mut unwired_pods: Vec<String> = selected
        .iter()
        .filter(|p| admitted_without_webhook(p))
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    unwired_pods.sort();
    let count = i32::try_from(selected.len()).unwrap_or(i32::MAX);
    let unwired = i32::try_from(unwired_pods.len()).unwrap_or(i32::MAX);
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
        matched: Some(count - unwired),
        unwired: Some(unwired),
        unwired_pods,
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

/// The engine container of a pod for `cb`'s runtime — the runtime the pod was wired under
/// (its `inferencecache.io/wired-spec` record, as the node plan reads it), else the current
/// spec's: the one the adapters wire ([`select_engine_container`]); `None` when none or
/// several qualify.
pub fn engine_container_name<'a>(cb: &CacheBackend, pod: &'a Pod) -> Option<&'a str> {
    let runtime = crate::reconcile::nodes::plans::wired_spec(pod, cb, &mut |_, _| {}).runtime;
    let i = select_engine_container(pod, runtime).ok()?;
    pod.spec
        .as_ref()?
        .containers
        .get(i)
        .map(|c| c.name.as_str())
}

/// True when the kubelet holds the container in restart back-off: `state.waiting.reason` is
/// [`CRASH_LOOP_BACK_OFF`] (see the module docs).
pub fn is_crash_looping(c: &k8s_openapi::api::core::v1::ContainerStatus) -> bool {
    c.state
        .as_ref()
        .and_then(|s| s.waiting.as_ref())
        .and_then(|w| w.reason.as_deref())
        == Some(CRASH_LOOP_BACK_OFF)
}

/// True when an observed crash-loop episode goes on at `now_s` (unix seconds) between two
/// back-offs: the container restarted, its last run ended in failure (`lastState.terminated`
/// with a non-zero exit code), and it is not yet past the kubelet's back-off reset — waiting,
/// terminated again with a failure, or running for less than [`CRASH_LOOP_WINDOW_SECS`].
pub fn continues_crash_loop(c: &k8s_openapi::api::core::v1::ContainerStatus, now_s: i64) -> bool {
    if is_crash_looping(c) {
        return true;
    }
    let last_failed = c
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .is_some_and(|t| t.exit_code != 0);
    if c.restart_count < 1 || !last_failed {
        return false;
    }
    let state = c.state.as_ref();
    if state.and_then(|s| s.waiting.as_ref()).is_some() {
        return true;
    }
    match state.and_then(|s| s.running.as_ref()) {
        Some(r) => r
            .started_at
            .as_ref()
            .is_some_and(|t| now_s - t.0.as_second() < CRASH_LOOP_WINDOW_SECS),
        None => state
            .and_then(|s| s.terminated.as_ref())
            .is_some_and(|t| t.exit_code != 0),
    }
}

/// An injected engine pod whose engine container is crash-looping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashLoop {
    /// Pod name.
    pub pod: String,
    /// The engine container's last termination as the kubelet recorded it
    /// (`lastState.terminated`): `exit code 137 (OOMKilled)`; `None` when absent.
    pub last_termination: Option<String>,
}

/// Start of the `EngineCompatibility=False/InjectedEngineCrashLooping` message, followed by the
/// pod names ([`crash_loop_message`]).
const CRASH_LOOP_MESSAGE_HEAD: &str = "Injected engine pod(s) ";
/// What follows the pod names in that message.
const CRASH_LOOP_MESSAGE_TAIL: &str = " are crash-looping after KV-connector injection";

/// The `EngineCompatibility=False/InjectedEngineCrashLooping` message for `loops` (non-empty):
/// the pod names, each engine's last termination, and what to do.
pub fn crash_loop_message(loops: &[CrashLoop]) -> String {
    let names: Vec<&str> = loops.iter().map(|l| l.pod.as_str()).collect();
    let lasts: Vec<String> = loops
        .iter()
        .filter_map(|l| {
            l.last_termination
                .as_ref()
                .map(|t| format!("{}: {t}", l.pod))
        })
        .collect();
    let last = if lasts.is_empty() {
        String::new()
    } else {
        format!(" Last termination: {}.", lasts.join("; "))
    };
    format!(
        "{CRASH_LOOP_MESSAGE_HEAD}{}{CRASH_LOOP_MESSAGE_TAIL} (the kubelet holds the engine container in {CRASH_LOOP_BACK_OFF}).{last} Check the engine logs; if the model is hybrid-attention, set spec.integration.mode: EventsOnly.",
        names.join(", ")
    )
}

/// The pod names a [`crash_loop_message`] lists (empty for any other text).
pub fn crash_loop_pods(message: &str) -> Vec<String> {
    message
        .strip_prefix(CRASH_LOOP_MESSAGE_HEAD)
        .and_then(|rest| rest.split_once(CRASH_LOOP_MESSAGE_TAIL))
        .map(|(names, _)| names.split(", ").map(str::to_string).collect())
        .unwrap_or_default()
}

/// Pods injected by `cb` whose engine container is crash-looping at `now_s` (unix seconds),
/// sorted by name: in [`CRASH_LOOP_BACK_OFF`] now ([`is_crash_looping`]), or named in `episode`
/// (the pods of the prior condition) and still between back-offs ([`continues_crash_loop`]).
pub fn crash_looping_injected(
    cb: &CacheBackend,
    pods: &[Pod],
    now_s: i64,
    episode: &[String],
) -> Vec<CrashLoop> {
    let mut out: Vec<CrashLoop> = pods
        .iter()
        .filter(|p| injected_by(p, cb))
        .filter_map(|p| {
            let name = p.metadata.name.clone()?;
            let engine = engine_container_name(cb, p)?;
            let c = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())?
                .iter()
                .find(|c| c.name == engine)?;
            let looping = if episode.contains(&name) {
                continues_crash_loop(c, now_s)
            } else {
                is_crash_looping(c)
            };
            looping.then(|| CrashLoop {
                pod: name,
                last_termination: c
                    .last_state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .map(|t| match t.reason.as_deref().filter(|r| !r.is_empty()) {
                        Some(r) => format!("exit code {} ({r})", t.exit_code),
                        None => format!("exit code {}", t.exit_code),
                    }),
            })
        })
        .collect();
    out.sort_by(|a, b| a.pod.cmp(&b.pod));
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

/// The verdict of a termination message (the adapter's [`KernelCheckVerdict`]), with the mode
/// it names.
fn parse_message(msg: &str) -> Option<(KernelResult, Option<String>)> {
    let v = KernelCheckVerdict::parse(msg)?;
    let detail = v
        .detail
        .clone()
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "lmcache c_ops failed to load".to_string());
    let r = if v.kernels_healthy {
        KernelResult::Healthy
    } else {
        KernelResult::Failed(detail)
    };
    Some((r, v.mode))
}

fn from_terminated(t: &ContainerStateTerminated, strict: bool) -> KernelResult {
    if let Some((r, _)) = t.message.as_deref().and_then(parse_message) {
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

/// Whether the pod's kernel check runs strict: the mode the adapter rendered into the init
/// container's env, or the mode its verdict reports.
fn is_strict(pod: &Pod) -> bool {
    let by_env = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .and_then(|ics| ics.iter().find(|c| c.name == KERNEL_CHECK_CONTAINER))
        .and_then(|c| c.env.as_ref())
        .is_some_and(|env| {
            env.iter().any(|e| {
                e.name == ENV_KERNEL_CHECK_MODE
                    && e.value
                        .as_deref()
                        .is_some_and(|v| v.trim().eq_ignore_ascii_case(KERNEL_CHECK_STRICT))
            })
        });
    let by_verdict = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .and_then(|ss| ss.iter().find(|c| c.name == KERNEL_CHECK_CONTAINER))
        .and_then(|cs| {
            let st = cs.state.as_ref().and_then(|s| s.terminated.as_ref());
            let last = cs.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            st.or(last)?.message.as_deref().and_then(parse_message)
        })
        .and_then(|(_, mode)| mode)
        .is_some_and(|m| m == KERNEL_CHECK_STRICT);
    by_env || by_verdict
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

    /// The episode's pods are read back from the message the condition carries.
    #[test]
    fn crash_loop_message_round_trips_its_pods() {
        let loops = [
            CrashLoop {
                pod: "vllm-a".into(),
                last_termination: Some("exit code 137 (OOMKilled)".into()),
            },
            CrashLoop {
                pod: "vllm-b".into(),
                last_termination: None,
            },
        ];
        let m = crash_loop_message(&loops);
        assert!(
            m.contains("Last termination: vllm-a: exit code 137 (OOMKilled)."),
            "{m}"
        );
        assert_eq!(crash_loop_pods(&m), vec!["vllm-a", "vllm-b"]);
        assert!(crash_loop_pods("something else").is_empty());
    }

    #[test]
    fn kernel_messages_are_the_adapters_verdicts() {
        assert_eq!(
            parse_message(
                r#"{"kernelsHealthy": true, "mode": "report-only", "detail": "lmcache.c_ops loaded from /x"}"#
            ),
            Some((KernelResult::Healthy, Some("report-only".into())))
        );
        assert_eq!(
            parse_message(
                r#"{"kernelsHealthy": false, "mode": "strict", "detail": "ImportError: libcudart.so.13"}"#
            ),
            Some((
                KernelResult::Failed("ImportError: libcudart.so.13".to_string()),
                Some("strict".into())
            ))
        );
        // Formats nothing renders are not verdicts.
        assert_eq!(parse_message(r#"{"loaded": true}"#), None);
        assert_eq!(parse_message("ok"), None);
        assert_eq!(parse_message(""), None);
    }

    /// A pod wired as vLLM keeps its vLLM engine after the backend's runtime is edited: its
    /// crash-loop and kernel-check conditions still read that container.
    #[test]
    fn the_engine_container_is_found_by_the_runtime_the_pod_was_wired_under() {
        let cb: CacheBackend = serde_json::from_value(serde_json::json!({
            "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
            "metadata": {"name": "b", "namespace": "ns"},
            "spec": {"runtime": "VLLM"}}))
        .unwrap();
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai",
                "command": ["vllm", "serve", "m"]}]}}))
        .unwrap();
        assert_eq!(engine_container_name(&cb, &pod), Some("engine"));
        let wired = ic_shared::crd::WiredSpec::of(&cb).to_annotation();
        let mut edited = cb.clone();
        edited.spec.runtime = ic_shared::crd::Runtime::SgLang;
        assert_eq!(
            engine_container_name(&edited, &pod),
            None,
            "no record: the current spec"
        );
        pod.metadata.annotations = Some(BTreeMap::from([(
            crate::reconcile::annotations::WIRED_SPEC.to_string(),
            wired,
        )]));
        assert_eq!(engine_container_name(&edited, &pod), Some("engine"));
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
