//! `ic-controller admit` (issue 4 item 7): CacheBackends and Pods through admission offline, on
//! the same code path as the HTTPS server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_controller::admission::offline::{admit_cli, AdmitArgs, AdmitError};
use serde_json::{json, Value};

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

fn write(dir: &Path, name: &str, v: &Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_yaml::to_string(v).unwrap()).unwrap();
    p
}

fn args(file: PathBuf) -> AdmitArgs {
    AdmitArgs {
        file,
        namespace: "default".into(),
        ..AdmitArgs::default()
    }
}

#[test]
fn valid_backend_prints_the_defaulted_object() {
    let out = admit_cli(&args(samples().join("cachebackend-events-only.yaml"))).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let obj: Value = serde_yaml::from_str(&out.stdout).unwrap();
    let spec = &obj["spec"];
    // Webhook defaults.
    assert_eq!(
        spec["integration"],
        json!({"mode": "EventsOnly", "role": "ReadWrite", "failOpen": true})
    );
    assert_eq!(spec["observation"]["firstEventTimeout"], "10m");
    // Schema (apiserver) defaults, as a server dry-run shows them.
    assert_eq!(spec["type"], "LMCache");
    assert_eq!(spec["replicas"], 1);
    assert_eq!(spec["deploymentKind"], "Deployment");
}

#[test]
fn warnings_go_to_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "mc.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "mc"},
                "spec": {"runtime": "VLLM", "replicass": 3,
                         "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}}}),
    );
    let out = admit_cli(&args(file)).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("Warning: unknown field \"spec.replicass\" (pruned)"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("Warning: spec.integration.engineHostNetwork is not set"),
        "{}",
        out.stderr
    );
    let obj: Value = serde_yaml::from_str(&out.stdout).unwrap();
    assert!(obj["spec"].get("replicass").is_none());
}

#[test]
fn invalid_backend_prints_field_errors_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "bad.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "bad", "annotations": {"inferencecache.io/lmcache-kernel-check": "strcit"}},
                "spec": {"runtime": "SGLang", "integration": {"role": "WriteOnly"},
                         "remoteStorage": {"provider": "Redis", "ownership": "External",
                                           "endpoint": "redis.cache.svc:6379/0"}}}),
    );
    let out = admit_cli(&args(file)).unwrap();
    assert_eq!(out.exit_code, 1);
    assert!(out.stdout.is_empty());
    let expected = [
        "Error: CacheBackend.inferencecache.io \"bad\" is invalid:",
        "  spec.remoteStorage.endpoint: Invalid value: \"redis.cache.svc:6379/0\": must not contain a URL path, query or fragment; use host:port",
        "  spec.integration.role: Unsupported value: \"WriteOnly\"",
        "  metadata.annotations[inferencecache.io/lmcache-kernel-check]: Unsupported value: \"strcit\": supported values: \"auto\", \"report-only\", \"strict\", \"off\"",
    ];
    for line in expected {
        assert!(
            out.stderr.contains(line),
            "missing {line:?} in\n{}",
            out.stderr
        );
    }
}

#[test]
fn old_object_makes_an_update() {
    let dir = tempfile::tempdir().unwrap();
    let old = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "x"},
        "spec": {"runtime": "SGLang", "remoteStorage": {"provider": "Redis", "ownership": "External",
                 "endpoint": "redis:0"}}});
    let mut new = old.clone();
    new["metadata"]["labels"] = json!({"team": "a"});
    let old_path = write(dir.path(), "old.yaml", &old);
    let new_path = write(dir.path(), "new.yaml", &new);
    // As a CREATE the pre-existing violation rejects...
    assert_eq!(admit_cli(&args(new_path.clone())).unwrap().exit_code, 1);
    // ...as an UPDATE of the stored object it does not.
    let mut a = args(new_path);
    a.old = Some(old_path);
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
}

/// The real vLLM pod of `testdata/pods`.
fn fixture_pod() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/pods/01-vllm-docs-nvidia-sh-c.yaml")
}

#[test]
fn pod_is_wired_through_the_pod_webhook_and_readmission_is_a_no_op() {
    let pod = fixture_pod();
    let dir = tempfile::tempdir().unwrap();
    // Two documents in one --backend file: one that does not match, one that does.
    let backends = dir.path().join("backends.yaml");
    std::fs::write(
        &backends,
        "apiVersion: inferencecache.io/v1alpha1\nkind: CacheBackend\nmetadata: {name: other}\n\
         spec: {runtime: VLLM, engineSelector: {matchLabels: {app: nope}}}\n---\n\
         apiVersion: inferencecache.io/v1alpha1\nkind: CacheBackend\nmetadata: {name: mistral, uid: u-1}\n\
         spec:\n  runtime: VLLM\n  remoteStorage: {provider: LMCacheServer, ownership: External, endpoint: 'lm://lmcache:65432'}\n  engineSelector: {matchLabels: {app: mistral-7b}}\n",
    )
    .unwrap();
    let mut a = args(pod);
    a.backends = vec![backends.clone()];
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["allowed"], true);
    assert!(
        v["patch"].as_array().is_some_and(|p| !p.is_empty()),
        "{v:#}"
    );
    assert_eq!(
        v["pod"]["metadata"]["annotations"]["inferencecache.io/injected-by"], "default/mistral",
        "{v:#}"
    );
    // Re-admitting the wired pod yields no patch.
    let wired = write(dir.path(), "wired.yaml", &v["pod"]);
    let mut again = args(wired);
    again.backends = vec![backends];
    let out = admit_cli(&again).unwrap();
    let v2: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v2["patch"], json!([]), "{v2:#}");
    assert_eq!(v2["pod"], v["pod"]);
}

#[test]
fn invalid_backend_is_refused_in_pod_mode() {
    let dir = tempfile::tempdir().unwrap();
    let pod = write(
        dir.path(),
        "pod.yaml",
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "a"}},
                "spec": {"containers": [{"name": "vllm", "image": "i", "command": ["vllm", "serve", "m"]}]}}),
    );
    let cb = write(
        dir.path(),
        "cb.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "cb"},
                "spec": {"runtime": "VLLM", "integration": {"engineHostNetwork": true}}}),
    );
    let mut a = args(pod);
    a.backends = vec![cb];
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 1);
    assert!(
        out.stderr
            .contains("spec.integration.engineHostNetwork: Forbidden"),
        "{}",
        out.stderr
    );
}

#[test]
fn usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let pod = write(
        dir.path(),
        "pod.yaml",
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
    );
    assert!(matches!(admit_cli(&args(pod)), Err(AdmitError::Usage(_))));
    let two = dir.path().join("two.yaml");
    std::fs::write(&two, "kind: CacheBackend\n---\nkind: CacheBackend\n").unwrap();
    assert!(matches!(
        admit_cli(&args(two)),
        Err(AdmitError::Parse { .. })
    ));
    assert!(matches!(
        admit_cli(&args(dir.path().join("missing.yaml"))),
        Err(AdmitError::Read { .. })
    ));
}

#[test]
fn the_binary_prints_the_verdict_and_exits_with_its_code() {
    let bin = env!("CARGO_BIN_EXE_ic-controller");
    let ok = std::process::Command::new(bin)
        .arg("admit")
        .arg(samples().join("cachebackend-events-only.yaml"))
        .output()
        .unwrap();
    assert_eq!(ok.status.code(), Some(0), "{ok:?}");
    let text = String::from_utf8(ok.stdout).unwrap();
    assert!(text.contains("mode: EventsOnly"), "{text}");

    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "bad.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "bad"},
                "spec": {"runtime": "SGLang", "integration": {"role": "WriteOnly"}}}),
    );
    let denied = std::process::Command::new(bin)
        .arg("admit")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(denied.status.code(), Some(1));
    let err = String::from_utf8(denied.stderr).unwrap();
    assert!(
        err.contains("spec.integration.role: Unsupported value: \"WriteOnly\""),
        "{err}"
    );

    let missing = std::process::Command::new(bin)
        .args(["admit", "/nonexistent/cb.yaml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8(missing.stderr)
        .unwrap()
        .contains("/nonexistent/cb.yaml"));
}
