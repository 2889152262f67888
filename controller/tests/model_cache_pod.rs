//! Pod wiring of model-cache readers (`admission::model_cache_pod`): the reader claim as a
//! read-only volume `model-data` and a read-only mount in the engine container; fail-open with
//! a reason on every problem; the patch applies and re-admitting a wired pod yields no patch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::admission::model_cache_pod::{
    requested_model_cache, wire_model_cache, ModelCacheWiring,
};
use ic_shared::crd::{ModelCacheStatus, NamespacedName};
use serde_json::{json, Value};

fn status(mode: &str, ready: bool, namespaces: &[&str]) -> ModelCacheStatus {
    serde_json::from_value(json!({
        "mode": mode,
        "binding": {"name": "mcb-x-1", "uid": "u"},
        "readerClaim": "mcb-x-1-reader",
        "readerNamespaces": namespaces,
        "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"},
                        "reason": "R", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    }))
    .unwrap()
}

fn pod(annotations: Value, spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "vllm-0", "namespace": "team-a", "annotations": annotations},
           "spec": spec})
}

fn engine() -> Value {
    json!({"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.9.1"},
                          {"name": "sidecar", "image": "x", "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
           "volumes": [{"name": "tmp", "emptyDir": {}}]})
}

fn apply(pod: &Value, w: &ModelCacheWiring) -> Value {
    let ModelCacheWiring::Wired { patch, .. } = w else {
        panic!("not wired: {w:?}")
    };
    let mut p = pod.clone();
    json_patch::patch(&mut p, patch).unwrap();
    p
}

fn skipped(w: &ModelCacheWiring) -> &str {
    match w {
        ModelCacheWiring::Skipped { reason } => reason,
        other => panic!("expected Skipped, got {other:?}"),
    }
}

#[test]
fn the_annotation_names_the_request() {
    let p = pod(json!({"inferencecache.io/model-cache": "llama"}), engine());
    assert_eq!(
        requested_model_cache(&p, "team-a"),
        Some(Ok(NamespacedName::new("team-a", "llama")))
    );
    let p = pod(
        json!({"inferencecache.io/model-cache": " org/llama "}),
        engine(),
    );
    assert_eq!(
        requested_model_cache(&p, "team-a"),
        Some(Ok(NamespacedName::new("org", "llama")))
    );
    for bad in ["", "/x", "a/", "a/b/c"] {
        let p = pod(json!({"inferencecache.io/model-cache": bad}), engine());
        assert!(
            matches!(requested_model_cache(&p, "team-a"), Some(Err(_))),
            "{bad:?}"
        );
    }
    assert_eq!(
        requested_model_cache(&pod(json!({}), engine()), "team-a"),
        None
    );
    assert_eq!(
        wire_model_cache(&pod(json!({}), engine()), "team-a", None),
        ModelCacheWiring::NotRequested
    );
}

#[test]
fn a_ready_durable_cache_is_mounted_read_only() {
    let p = pod(json!({"inferencecache.io/model-cache": "llama"}), engine());
    let w = wire_model_cache(&p, "team-a", Some(&status("durable", true, &["team-a"])));
    let wired = apply(&p, &w);
    let vol = wired["spec"]["volumes"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        vol,
        json!({"name": "model-data", "persistentVolumeClaim": {"claimName": "mcb-x-1-reader", "readOnly": true}})
    );
    assert_eq!(
        wired["spec"]["containers"][0]["volumeMounts"],
        json!([{"name": "model-data", "mountPath": "/model-data", "readOnly": true}])
    );
    assert!(
        wired["spec"]["containers"][1]["volumeMounts"]
            .as_array()
            .unwrap()
            .len()
            == 1
    );
    if let ModelCacheWiring::Wired { reason, .. } = &w {
        assert!(
            reason.contains("team-a/llama") && reason.contains("mcb-x-1-reader"),
            "{reason}"
        );
    }
    // Idempotent: the wired pod needs no patch.
    let again = wire_model_cache(
        &wired,
        "team-a",
        Some(&status("durable", true, &["team-a"])),
    );
    assert!(
        matches!(again, ModelCacheWiring::Wired { ref patch, .. } if patch.is_empty()),
        "{again:?}"
    );
}

#[test]
fn container_and_path_come_from_annotations() {
    let p = pod(
        json!({"inferencecache.io/model-cache": "org/llama",
               "inferencecache.io/model-cache-mount-path": "/models",
               "inferencecache.io/model-cache-container": "sidecar"}),
        json!({"containers": [{"name": "vllm", "image": "x"},
                              {"name": "sidecar", "image": "x", "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}]}),
    );
    let w = wire_model_cache(
        &p,
        "team-a",
        Some(&status("durable", true, &["team-a", "team-b"])),
    );
    let wired = apply(&p, &w);
    assert_eq!(
        wired["spec"]["volumes"].as_array().unwrap().len(),
        1,
        "volumes created"
    );
    let mounts = wired["spec"]["containers"][1]["volumeMounts"]
        .as_array()
        .unwrap();
    assert_eq!(
        mounts[1],
        json!({"name": "model-data", "mountPath": "/models", "readOnly": true})
    );
    assert!(wired["spec"]["containers"][0].get("volumeMounts").is_none());
}

#[test]
fn every_problem_leaves_the_pod_unwired_with_a_reason() {
    let ann = json!({"inferencecache.io/model-cache": "llama"});
    let ok = status("durable", true, &["team-a"]);
    let cases: Vec<(&str, Value, Option<ModelCacheStatus>, &str)> = vec![
        (
            "unknown request",
            pod(ann.clone(), engine()),
            None,
            "not found",
        ),
        (
            "mode none",
            pod(ann.clone(), engine()),
            Some(status("none", true, &["team-a"])),
            "mode none",
        ),
        (
            "mode ephemeral",
            pod(ann.clone(), engine()),
            Some(status("ephemeral", true, &["team-a"])),
            "mode ephemeral",
        ),
        (
            "not ready",
            pod(ann.clone(), engine()),
            Some(status("durable", false, &["team-a"])),
            "not Ready",
        ),
        (
            "other namespace",
            pod(ann.clone(), engine()),
            Some(status("durable", true, &["team-b"])),
            "no reader claim in namespace team-a",
        ),
        (
            "bad annotation",
            pod(json!({"inferencecache.io/model-cache": "a/b/c"}), engine()),
            Some(ok.clone()),
            "expected <name>",
        ),
        (
            "relative path",
            pod(
                json!({"inferencecache.io/model-cache": "llama", "inferencecache.io/model-cache-mount-path": "models"}),
                engine(),
            ),
            Some(ok.clone()),
            "absolute",
        ),
        (
            "no such container",
            pod(
                json!({"inferencecache.io/model-cache": "llama", "inferencecache.io/model-cache-container": "nope"}),
                engine(),
            ),
            Some(ok.clone()),
            "not found",
        ),
        (
            "no containers",
            pod(ann.clone(), json!({})),
            Some(ok.clone()),
            "no containers",
        ),
        (
            "foreign model-data volume",
            pod(
                ann.clone(),
                json!({"containers": [{"name": "c", "image": "x"}], "volumes": [{"name": "model-data", "emptyDir": {}}]}),
            ),
            Some(ok.clone()),
            "already has a volume",
        ),
        (
            "path taken",
            pod(
                ann.clone(),
                json!({"containers": [{"name": "c", "image": "x", "volumeMounts": [{"name": "cache", "mountPath": "/model-data"}]}], "volumes": [{"name": "cache", "emptyDir": {}}]}),
            ),
            Some(ok.clone()),
            "already mounts something at /model-data",
        ),
        (
            "writable claim already there",
            pod(
                ann.clone(),
                json!({"containers": [{"name": "c", "image": "x"}], "volumes": [{"name": "model-data", "persistentVolumeClaim": {"claimName": "mcb-x-1-reader"}}]}),
            ),
            Some(ok.clone()),
            "not the read-only reader claim",
        ),
    ];
    for (case, p, s, want) in cases {
        let w = wire_model_cache(&p, "team-a", s.as_ref());
        let reason = skipped(&w);
        assert!(reason.contains(want), "{case}: {reason}");
    }
}

#[test]
fn garbage_never_panics() {
    let s = status("durable", true, &["team-a"]);
    for p in [
        json!(null),
        json!([]),
        json!({"metadata": {"annotations": {"inferencecache.io/model-cache": 7}}}),
        json!({"metadata": {"annotations": {"inferencecache.io/model-cache": "x"}}, "spec": {"containers": "no"}}),
        json!({"metadata": {"annotations": {"inferencecache.io/model-cache": "x"}}, "spec": {"containers": [{}], "volumes": {}}}),
    ] {
        let _ = wire_model_cache(&p, "team-a", Some(&s));
    }
}
