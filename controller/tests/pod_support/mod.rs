//! Helpers shared by the Pod webhook tests: fixture loading (multi-document YAML, workload pod
//! templates), CacheBackends from YAML, patch application, golden files.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_controller::admission::pod::{mutate_pod, PodOutcome, PodWebhookConfig};
use ic_shared::crd::CacheBackend;
use serde_json::Value;

/// The repository root (the directory holding `controller/`).
pub fn repo_root() -> PathBuf {
    let f = Path::new(file!());
    if f.is_absolute() {
        // …/controller/tests/pod_support/mod.rs
        f.ancestors()
            .nth(4)
            .map(Path::to_path_buf)
            .unwrap_or_default()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }
}

/// The repository's real engine pods (`testdata/pods`).
pub fn fixtures_dir() -> PathBuf {
    repo_root().join("testdata/pods")
}

/// `testdata/pods/topologies`: real public engine pods of the deployment topologies of issue 14
/// (host network, outward publisher, data parallel), each naming its source in a header.
pub fn repo_fixtures_dir() -> PathBuf {
    fixtures_dir().join("topologies")
}

/// The YAML file names directly in `dir`, sorted.
fn yaml_names(dir: PathBuf) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    names.sort();
    names
}

/// Every file name under [`repo_fixtures_dir`], sorted.
pub fn repo_fixture_names() -> Vec<String> {
    yaml_names(repo_fixtures_dir())
}

/// The single pod of a repository fixture (a workload's template as a Pod).
pub fn load_repo_pod(name: &str) -> Value {
    let text = std::fs::read_to_string(repo_fixtures_dir().join(name)).expect("repo fixture");
    let mut pods = pods_in_yaml(&text);
    assert_eq!(pods.len(), 1, "{name}: expected exactly one pod");
    pods.remove(0)
}

/// `controller/tests/golden`.
pub fn golden_dir() -> PathBuf {
    repo_root().join("controller/tests/golden")
}

/// Every fixture file name, sorted.
pub fn fixture_names() -> Vec<String> {
    yaml_names(fixtures_dir())
}

/// The pod of a workload document: a Pod as is; the pod template of a Deployment, StatefulSet,
/// DaemonSet, ReplicaSet, Job (`spec.template`), CronJob (`spec.jobTemplate.spec.template`) or
/// LeaderWorkerSet (`spec.leaderWorkerTemplate.workerTemplate`) as a Pod in the workload's
/// namespace.
pub fn pod_of(doc: &Value) -> Option<Value> {
    let kind = doc.get("kind")?.as_str()?;
    let template = match kind {
        "Pod" => return Some(doc.clone()),
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            doc.pointer("/spec/template")?
        }
        "CronJob" => doc.pointer("/spec/jobTemplate/spec/template")?,
        "LeaderWorkerSet" => doc.pointer("/spec/leaderWorkerTemplate/workerTemplate")?,
        _ => return None,
    };
    let mut metadata = template
        .get("metadata")
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    if let (Some(ns), Some(m)) = (doc.pointer("/metadata/namespace"), metadata.as_object_mut()) {
        m.entry("namespace").or_insert(ns.clone());
    }
    Some(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": template.get("spec").cloned().unwrap_or(Value::Null),
    }))
}

/// Loads every pod in a (possibly multi-document) YAML fixture file.
pub fn load_pods(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures_dir().join(name)).expect("fixture");
    pods_in_yaml(&text)
}

/// Every pod (or workload pod template, as a Pod) in a multi-document YAML text.
pub fn pods_in_yaml(text: &str) -> Vec<Value> {
    let mut pods = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v: serde_yaml::Value = serde::Deserialize::deserialize(doc).expect("yaml document");
        if v.is_null() {
            continue;
        }
        let json: Value = serde_json::to_value(v).expect("yaml as json");
        if let Some(p) = pod_of(&json) {
            pods.push(p);
        }
    }
    pods
}

/// The single pod of a fixture.
pub fn load_pod(name: &str) -> Value {
    let mut pods = load_pods(name);
    assert_eq!(pods.len(), 1, "{name}: expected exactly one pod");
    pods.remove(0)
}

/// A CacheBackend from YAML.
pub fn backend(yaml: &str) -> CacheBackend {
    serde_yaml::from_str(yaml).expect("CacheBackend YAML")
}

/// The namespace of a pod value.
pub fn namespace_of(pod: &Value) -> String {
    pod.pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_string()
}

/// Applies an outcome's patch to `pod`.
pub fn apply(pod: &Value, outcome: &PodOutcome) -> Value {
    let mut out = pod.clone();
    if let Some(ops) = &outcome.patch {
        let patch: json_patch::Patch =
            serde_json::from_value(Value::Array(ops.clone())).expect("patch decodes");
        json_patch::patch(&mut out, &patch).expect("patch applies");
    }
    out
}

/// Checks a fail-open of a selected pod: the only change is the `not-injected` annotation
/// (`CacheBackend ns/name: <reason>`, what the Events controller turns into a Warning Event),
/// and the reason is an admission warning too. Returns the annotation's value.
pub fn assert_fail_open_marked(pod: &Value, outcome: &PodOutcome) -> String {
    let mut out = apply(pod, outcome);
    let note = out
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
        .and_then(|a| a.remove(ic_controller::admission::pod::ANNOTATION_NOT_INJECTED))
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no not-injected annotation: {}", outcome.reason));
    if out
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .is_some_and(|a| a.is_empty())
        && pod.pointer("/metadata/annotations").is_none()
    {
        if let Some(m) = out.pointer_mut("/metadata").and_then(Value::as_object_mut) {
            m.remove("annotations");
        }
    }
    let mut base = pod.clone();
    if let Some(a) = base
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        a.remove(ic_controller::admission::pod::ANNOTATION_NOT_INJECTED);
    }
    assert_eq!(out, base, "a fail-open changes nothing but the annotation");
    assert!(note.starts_with("CacheBackend "), "{note}");
    assert!(
        outcome
            .reason
            .contains(note.split_once(": ").map_or("", |x| x.1)),
        "{note} vs {}",
        outcome.reason
    );
    assert!(
        outcome
            .warnings
            .iter()
            .any(|w| w.starts_with("pod admitted unwired: ")),
        "the fail-open is loud: {:?}",
        outcome.warnings
    );
    note
}

/// Runs the webhook on `pod` against `backends`.
pub fn admit(pod: &Value, backends: &[CacheBackend], cfg: &PodWebhookConfig) -> PodOutcome {
    let outcome = mutate_pod(pod, &namespace_of(pod), backends, cfg);
    assert!(outcome.allowed, "the pod webhook must always allow");
    outcome
}

/// Runs the webhook, applies the patch, and checks re-admission yields no patch.
pub fn admit_converged(
    pod: &Value,
    backends: &[CacheBackend],
    cfg: &PodWebhookConfig,
) -> (PodOutcome, Value) {
    let outcome = admit(pod, backends, cfg);
    let wired = apply(pod, &outcome);
    let again = admit(&wired, backends, cfg);
    assert_eq!(
        again.patch, None,
        "re-admission must yield no patch; reason {:?}",
        again.reason
    );
    assert_eq!(
        again.reason, outcome.reason,
        "re-admission must reach the same decision"
    );
    (outcome, wired)
}

/// The container named `name` in `pod`.
pub fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod.pointer("/spec/containers")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The init container named `name` in `pod`, if any.
pub fn init_container<'a>(pod: &'a Value, name: &str) -> Option<&'a Value> {
    pod.pointer("/spec/initContainers")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
}

/// `name=value` of every env entry with a literal value.
pub fn env_of(c: &Value) -> Vec<(String, String)> {
    c.get("env")
        .and_then(Value::as_array)
        .map(|v| {
            v.iter()
                .map(|e| {
                    (
                        e["name"].as_str().unwrap_or("").to_string(),
                        e["value"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The value of env var `name` on container `c`.
pub fn env_value(c: &Value, name: &str) -> Option<String> {
    env_of(c)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

/// The strings of a JSON string array.
pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Compares `actual` with the golden file `name`, or rewrites it under `UPDATE_GOLDEN=1`.
pub fn golden(name: &str, actual: &Value) {
    let path = golden_dir().join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(actual).expect("json") + "\n";
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(golden_dir()).expect("golden dir");
        std::fs::write(&path, &text).expect("write golden");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing golden file {}; run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    if want != text {
        let want_v: Value = serde_json::from_str(&want).unwrap_or(Value::Null);
        panic!(
            "golden mismatch for {name} ({}); rerun with UPDATE_GOLDEN=1 after reviewing.\n--- want\n{}\n--- got\n{}",
            path.display(),
            serde_json::to_string_pretty(&want_v).unwrap_or_default(),
            text
        );
    }
}
