//! `ic-controller admit` (issue 4 item 7): CacheBackends and Pods through admission offline, on
//! the same code path as the HTTPS server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_controller::admission::offline::{admit_cli, AdmitArgs, AdmitError, FieldValidation};
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
    let mut a = args(file);
    a.field_validation = FieldValidation::Warn;
    let out = admit_cli(&a).unwrap();
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
fn stored_backends_that_current_rules_reject_are_used_with_a_warning() {
    // engineHostNetwork without a published endpoint is rejected today; a backend stored before
    // that rule exists, and the Pod webhook fails open on (here: ignores) the field.
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
                "spec": {"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "a"}},
                         "integration": {"engineHostNetwork": true}}}),
    );
    let mut a = args(pod);
    a.backends = vec![cb.clone()];
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "Warning: backend cb ({}) would not be admitted today (spec.integration.engineHostNetwork: Forbidden",
            cb.display()
        )),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("the cluster holds it as stored"),
        "{}",
        out.stderr
    );
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["reason"], "Injected", "{v:#}");
    assert!(v["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w.as_str().unwrap().contains("engineHostNetwork is ignored")));
}

#[test]
fn api_version_and_kind_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    for (name, doc, want) in [
        (
            "wrong.yaml",
            json!({"apiVersion": "inferencecache.io/v1", "kind": "CacheBackend",
                   "metadata": {"name": "x"}, "spec": {"runtime": "VLLM"}}),
            "CacheBackend has apiVersion \"inferencecache.io/v1\"; this server serves CacheBackend only as \"inferencecache.io/v1alpha1\"",
        ),
        (
            "missing.yaml",
            json!({"kind": "CacheBackend", "metadata": {"name": "x"}, "spec": {"runtime": "VLLM"}}),
            "apiVersion not set (a CacheBackend is \"inferencecache.io/v1alpha1\")",
        ),
    ] {
        let file = write(dir.path(), name, &doc);
        match admit_cli(&args(file)) {
            Err(AdmitError::Parse { message, .. }) => assert_eq!(message, want),
            other => panic!("{name}: {other:?}"),
        }
    }
    // A Pod is core v1.
    let pod = write(
        dir.path(),
        "pod.yaml",
        &json!({"apiVersion": "apps/v1", "kind": "Pod", "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "c", "image": "i"}]}}),
    );
    let cb = write(
        dir.path(),
        "cb.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "cb"}, "spec": {"runtime": "VLLM"}}),
    );
    let mut a = args(pod);
    a.backends = vec![cb];
    assert!(matches!(
        admit_cli(&a),
        Err(AdmitError::Parse { message, .. }) if message.contains("serves Pod only as \"v1\"")
    ));
}

#[test]
fn unknown_fields_follow_field_validation() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "typo.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "typo"},
                "spec": {"runtime": "VLLM", "engineSelectr": {"matchLabels": {"app": "a"}}}}),
    );
    // Strict, the default (as kubectl apply): rejected, naming the field.
    let out = admit_cli(&args(file.clone())).unwrap();
    assert_eq!(out.exit_code, 1, "{}", out.stderr);
    assert!(out.stdout.is_empty());
    assert!(
        out.stderr.contains(
            "Error: CacheBackend.inferencecache.io \"typo\" is invalid:\n  strict decoding error: unknown field \"spec.engineSelectr\""
        ),
        "{}",
        out.stderr
    );
    // Warn: pruned with a warning.
    let mut a = args(file.clone());
    a.field_validation = FieldValidation::Warn;
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    assert!(out
        .stderr
        .contains("Warning: unknown field \"spec.engineSelectr\" (pruned)"));
    // Ignore: pruned silently.
    a.field_validation = FieldValidation::Ignore;
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("engineSelectr"), "{}", out.stderr);
    // The binary takes the flag as kubectl spells the values.
    let bin = env!("CARGO_BIN_EXE_ic-controller");
    for (flag, code) in [("Strict", 1), ("Warn", 0), ("Ignore", 0)] {
        let o = std::process::Command::new(bin)
            .arg("admit")
            .arg(format!("--field-validation={flag}"))
            .arg(&file)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(code), "{flag}: {o:?}");
    }
}

#[test]
fn unknown_pod_fields_follow_field_validation_and_real_pods_have_none() {
    let dir = tempfile::tempdir().unwrap();
    let pod = write(
        dir.path(),
        "pod.yaml",
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "a"}},
                "spec": {"containers": [{"name": "vllm", "image": "i", "command": ["vllm", "serve", "m"],
                         "volumeMount": [{"name": "x", "mountPath": "/x"}]}]}}),
    );
    let cb = write(
        dir.path(),
        "cb.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "cb"},
                "spec": {"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "a"}}}}),
    );
    let mut a = args(pod);
    a.backends = vec![cb.clone()];
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains(
            "Error: Pod \"p\" is invalid:\n  strict decoding error: unknown field \"spec.containers[0].volumeMount\""
        ),
        "{}",
        out.stderr
    );
    a.field_validation = FieldValidation::Warn;
    let out = admit_cli(&a).unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.stderr);
    assert!(out
        .stderr
        .contains("Warning: unknown field \"spec.containers[0].volumeMount\" (pruned)"));
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(v["pod"]["spec"]["containers"][0]
        .get("volumeMount")
        .is_none());
    assert_eq!(v["reason"], "Injected");

    // Every real engine pod of the fixtures passes Strict, and so does every pod the webhook
    // wired (the golden files).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [
        root.join("../testdata/pods"),
        root.join("../testdata/pods/topologies"),
    ]
    .into_iter();
    for entry in dirs
        .flat_map(|d| std::fs::read_dir(d).unwrap().flatten())
        .filter(|e| e.path().is_file())
    {
        let text = std::fs::read_to_string(entry.path()).unwrap();
        for doc in ic_controller::admission::offline::parse_documents(&text).unwrap() {
            let mut pod = match doc["kind"].as_str() {
                Some("Pod") => doc.clone(),
                _ => json!({"apiVersion": "v1", "kind": "Pod",
                            "metadata": doc["spec"]["template"]["metadata"].clone(),
                            "spec": doc["spec"]["template"]["spec"].clone()}),
            };
            let unknown = ic_controller::admission::offline::prune_unknown_pod_fields(&mut pod);
            assert!(
                unknown.is_empty(),
                "{}: {unknown:?}",
                entry.path().display()
            );
        }
    }
    for entry in std::fs::read_dir(root.join("tests/golden"))
        .unwrap()
        .flatten()
    {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(entry.path()).unwrap()).unwrap();
        let mut pod = v["pod"].clone();
        let unknown = ic_controller::admission::offline::prune_unknown_pod_fields(&mut pod);
        assert!(
            unknown.is_empty(),
            "{}: {unknown:?}",
            entry.path().display()
        );
    }
}

#[test]
fn kube_version_gates_native_sidecars() {
    let dir = tempfile::tempdir().unwrap();
    let pod = write(
        dir.path(),
        "pod.yaml",
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "s"}},
                "spec": {"containers": [{"name": "sglang", "image": "lmsysorg/sglang:v0.5.16",
                         "command": ["python3", "-m", "sglang.launch_server", "--model-path", "Q"]}]}}),
    );
    let cb = write(
        dir.path(),
        "cb.yaml",
        &json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                "metadata": {"name": "cb"},
                "spec": {"runtime": "SGLang", "engineSelector": {"matchLabels": {"app": "s"}}}}),
    );
    let mut a = args(pod);
    a.backends = vec![cb];
    a.kube_version = Some("v1.28.9".into());
    let out = admit_cli(&a).unwrap();
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert!(
        v["reason"]
            .as_str()
            .unwrap()
            .contains("the wiring needs the native sidecar \"lmcache-mp-worker\""),
        "{v:#}"
    );
    // Unwired: the only change is the not-injected record of why.
    let patch = v["patch"].as_array().unwrap();
    assert_eq!(patch.len(), 1, "{v:#}");
    assert_eq!(patch[0]["path"], "/metadata/annotations");
    assert!(patch[0]["value"]["inferencecache.io/not-injected"]
        .as_str()
        .unwrap()
        .starts_with("CacheBackend default/cb: the wiring needs the native sidecar"));
    a.kube_version = Some("1.30".into());
    let v: Value = serde_json::from_str(&admit_cli(&a).unwrap().stdout).unwrap();
    assert_eq!(v["reason"], "Injected", "{v:#}");
    a.kube_version = Some("latest".into());
    assert!(matches!(admit_cli(&a), Err(AdmitError::Usage(_))));
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

#[test]
fn unbounded_and_deeply_nested_input_is_refused_with_a_clear_error() {
    // The attack: `admit /dev/zero` read until memory ran out.
    if std::path::Path::new("/dev/zero").exists() {
        match admit_cli(&args(PathBuf::from("/dev/zero"))) {
            Err(e @ AdmitError::Read { .. }) => {
                let text = format!("{e}");
                assert!(text.contains("cap of 8388608 bytes"), "{text}");
            }
            other => panic!("{:?}", other.map(|o| o.exit_code)),
        }
    }
    // A 100 000-deep document is refused before the YAML parser sees it.
    let dir = tempfile::tempdir().unwrap();
    let deep = dir.path().join("deep.yaml");
    std::fs::write(
        &deep,
        format!("spec: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)),
    )
    .unwrap();
    match admit_cli(&args(deep)) {
        Err(e @ AdmitError::Parse { .. }) => {
            let text = format!("{e}");
            assert!(
                text.contains("nesting deeper than the limit of 64"),
                "{text}"
            );
        }
        other => panic!("{:?}", other.map(|o| o.exit_code)),
    }
}
