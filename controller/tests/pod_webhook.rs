//! Pod webhook decisions (spec 000 "Mutating Pod webhook (engine wiring)": Selection, Injection,
//! Annotations, Idempotency, Fail-open; "Events-only mode"; "Mooncake provider configuration":
//! engineHostNetwork). One test per rule, named after it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod pod_support;

use ic_controller::admission::pod::{
    mutate_pod, PodWebhookConfig, ANNOTATION_INJECTED_BY, ANNOTATION_INJECTED_BY_UID,
    ANNOTATION_INJECT_SKIPPED, ANNOTATION_NOT_INJECTED, ANNOTATION_SKIP_INJECT,
    ANNOTATION_WIRED_SPEC, REASON_INJECTED,
};
use ic_shared::crd::CacheBackend;
use pod_support::*;
use serde_json::{json, Value};

fn vllm_pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine-0", "namespace": "ns", "labels": {"app": "llm", "tier": "a"}},
        "spec": {"containers": [{
            "name": "vllm",
            "image": "vllm/vllm-openai:v0.9.0",
            "command": ["vllm", "serve", "m"],
            "args": ["--port", "8000"]
        }]}
    })
}

fn cb(name: &str, extra: Value) -> CacheBackend {
    let mut v = json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}")},
        "spec": {"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "llm"}}}
    });
    merge(&mut v, extra);
    serde_json::from_value(v).unwrap()
}

/// JSON merge (objects merged recursively, `null` deletes).
fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                if v.is_null() {
                    a.remove(&k);
                } else {
                    merge(a.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (a, b) => *a = b,
    }
}

fn with_annotations(mut pod: Value, ann: Value) -> Value {
    pod["metadata"]["annotations"] = ann;
    pod
}

fn stale() -> Value {
    json!({
        ANNOTATION_INJECTED_BY: "ns/forged",
        ANNOTATION_INJECTED_BY_UID: "forged-uid",
        ANNOTATION_INJECT_SKIPPED: "skip-inject-annotation",
        ANNOTATION_WIRED_SPEC: "{\"runtime\":\"VLLM\",\"forged\":true}",
        "keep": "me"
    })
}

fn cfg() -> PodWebhookConfig {
    PodWebhookConfig::default()
}

/// The reason and the pod's annotations after admission, the `not-injected` record of a
/// fail-open left out (checked here: it carries the reason).
fn annotations_after(
    pod: &Value,
    backends: &[CacheBackend],
    cfg: &PodWebhookConfig,
) -> (String, Value) {
    let o = admit(pod, backends, cfg);
    let mut out = apply(pod, &o);
    if let Some(a) = out
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        if let Some(note) = a.remove(ANNOTATION_NOT_INJECTED) {
            let note = note.as_str().unwrap_or_default().to_string();
            assert!(
                o.reason.starts_with(&note) && o.reason.ends_with("; pod admitted unwired"),
                "{note} vs {}",
                o.reason
            );
        }
    }
    (o.reason, out["metadata"]["annotations"].clone())
}

#[test]
fn selection_first_match_by_name_wins() {
    let b = cb("b-second", json!({}));
    let a = cb(
        "a-first",
        json!({"spec": {"engineSelector": {"matchLabels": {"app": "llm", "tier": "a"}}}}),
    );
    let (_, wired) = admit_converged(&vllm_pod(), &[b, a], &cfg());
    assert_eq!(
        wired["metadata"]["annotations"][ANNOTATION_INJECTED_BY],
        "ns/a-first"
    );
    assert_eq!(
        wired["metadata"]["annotations"][ANNOTATION_INJECTED_BY_UID],
        "uid-a-first"
    );
}

#[test]
fn selection_skips_empty_selectors() {
    let empty = cb(
        "a-empty",
        json!({"spec": {"engineSelector": {"matchLabels": null}}}),
    );
    let none = cb("a-none", json!({"spec": {"engineSelector": null}}));
    let o = admit(&vllm_pod(), &[empty.clone(), none.clone()], &cfg());
    assert_eq!(
        o.reason,
        "no CacheBackend in namespace \"ns\" selects this pod; pod admitted unwired"
    );
    assert_eq!(o.patch, None);
    let (_, wired) = admit_converged(&vllm_pod(), &[empty, none, cb("z", json!({}))], &cfg());
    assert_eq!(
        wired["metadata"]["annotations"][ANNOTATION_INJECTED_BY],
        "ns/z"
    );
}

#[test]
fn selection_requires_every_label() {
    let b = cb(
        "x",
        json!({"spec": {"engineSelector": {"matchLabels": {"app": "llm", "tier": "b"}}}}),
    );
    assert!(admit(&vllm_pod(), &[b], &cfg())
        .reason
        .starts_with("no CacheBackend"));
}

#[test]
fn selection_only_in_the_pods_namespace() {
    let other = cb("x", json!({"metadata": {"namespace": "other"}}));
    assert!(admit(&vllm_pod(), &[other], &cfg())
        .reason
        .starts_with("no CacheBackend"));
    // The request namespace wins over a pod without metadata.namespace.
    let mut pod = vllm_pod();
    pod["metadata"].as_object_mut().unwrap().remove("namespace");
    let o = mutate_pod(&pod, "ns", &[cb("x", json!({}))], &cfg());
    assert_eq!(o.reason, REASON_INJECTED);
}

#[test]
fn no_match_strips_stale_annotations() {
    let pod = with_annotations(vllm_pod(), stale());
    let (reason, ann) = annotations_after(&pod, &[], &cfg());
    assert!(reason.starts_with("no CacheBackend"));
    assert_eq!(ann, json!({"keep": "me"}));
}

#[test]
fn injection_stamps_its_annotations_and_clears_skipped_marker() {
    let pod = with_annotations(vllm_pod(), stale());
    let backend = cb("x", json!({}));
    let (reason, ann) = annotations_after(&pod, std::slice::from_ref(&backend), &cfg());
    assert_eq!(reason, REASON_INJECTED);
    // The wired-spec record is the node plan's own type, read back as written.
    let wired = ic_shared::crd::WiredSpec::of(&backend);
    assert_eq!(
        ann,
        json!({ANNOTATION_INJECTED_BY: "ns/x", ANNOTATION_INJECTED_BY_UID: "uid-x",
               ANNOTATION_WIRED_SPEC: wired.to_annotation(), "keep": "me"})
    );
    let back =
        ic_shared::crd::WiredSpec::from_annotation(ann[ANNOTATION_WIRED_SPEC].as_str().unwrap())
            .unwrap();
    assert_eq!(back, wired);
}

/// The apiserver sends pods with explicit nulls, an empty status and (from newer clusters)
/// fields the typed model does not know. The typed pod does not re-encode to that object, so
/// the patch check takes its decode-and-compare path; the patch must still apply and keep what
/// the typed model drops.
#[test]
fn injection_patches_apiserver_shaped_requests_and_keeps_unknown_fields() {
    let mut pod = vllm_pod();
    pod["metadata"]["creationTimestamp"] = Value::Null;
    pod["status"] = json!({});
    pod["spec"]["futureField"] = json!({"enabled": true});
    let backends = [cb("x", json!({}))];
    let (outcome, wired) = admit_converged(&pod, &backends, &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED);
    assert!(outcome.patch.is_some(), "the pod must be wired");
    assert_eq!(wired["spec"]["futureField"], json!({"enabled": true}));
    assert_eq!(wired["metadata"]["creationTimestamp"], Value::Null);
    assert_eq!(
        wired["metadata"]["annotations"][ANNOTATION_INJECTED_BY],
        "ns/x"
    );
}

#[test]
fn skip_inject_annotation_opts_out() {
    for v in ["true", "True", "1", "yes", "on", " t "] {
        let pod = with_annotations(
            vllm_pod(),
            json!({ANNOTATION_SKIP_INJECT: v, ANNOTATION_INJECTED_BY: "ns/x", ANNOTATION_INJECTED_BY_UID: "u", ANNOTATION_WIRED_SPEC: "{}"}),
        );
        let o = admit(&pod, &[cb("x", json!({}))], &cfg());
        assert_eq!(
            o.reason,
            "inferencecache.io/skip-inject is set: wiring skipped by the operator"
        );
        let out = apply(&pod, &o);
        assert_eq!(out["spec"], pod["spec"], "no wiring");
        assert_eq!(
            out["metadata"]["annotations"],
            json!({ANNOTATION_SKIP_INJECT: v, ANNOTATION_INJECT_SKIPPED: "skip-inject-annotation"})
        );
        // Already converged: no patch.
        assert_eq!(admit(&out, &[cb("x", json!({}))], &cfg()).patch, None);
    }
    // Falsy values do not opt out.
    let pod = with_annotations(vllm_pod(), json!({ANNOTATION_SKIP_INJECT: "false"}));
    assert_eq!(
        admit(&pod, &[cb("x", json!({}))], &cfg()).reason,
        REASON_INJECTED
    );
}

#[test]
fn managed_binding_uses_status_endpoint() {
    let b = cb(
        "x",
        json!({"spec": {"remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"}}, "status": {"endpoint": " srv.ns.svc:8100 "}}),
    );
    let (_, wired) = admit_converged(&vllm_pod(), &[b], &cfg());
    assert_eq!(
        env_value(container(&wired, "vllm"), "LMCACHE_REMOTE_URL").as_deref(),
        Some("lm://srv.ns.svc:8100")
    );
}

#[test]
fn managed_binding_without_endpoint_fails_open_and_strips() {
    let b = cb(
        "x",
        json!({"spec": {"remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"}}}),
    );
    let pod = with_annotations(vllm_pod(), stale());
    let (reason, ann) = annotations_after(&pod, &[b], &cfg());
    assert_eq!(reason, "CacheBackend ns/x: Managed LMCacheServer backend has not published status.endpoint yet (roll the engine workload once the backend is Ready); pod admitted unwired");
    assert_eq!(ann, json!({"keep": "me"}));
}

#[test]
fn external_binding_uses_trimmed_spec_endpoint_without_status_fallback() {
    let b = cb(
        "x",
        json!({"spec": {"remoteStorage": {"provider": "Mooncake", "ownership": "External", "endpoint": "  mc.infra:50051\n"}}, "status": {"endpoint": "stale:1"}}),
    );
    let (_, wired) = admit_converged(&vllm_pod(), &[b], &cfg());
    assert_eq!(
        env_value(container(&wired, "vllm"), "LMCACHE_REMOTE_URL").as_deref(),
        Some("mooncakestore://mc.infra:50051")
    );

    let missing = cb(
        "x",
        json!({"spec": {"remoteStorage": {"provider": "Mooncake", "ownership": "External"}}, "status": {"endpoint": "stale:1"}}),
    );
    assert_eq!(
        admit(&vllm_pod(), &[missing], &cfg()).reason,
        "CacheBackend ns/x: External Mooncake backend has no spec.remoteStorage.endpoint; pod admitted unwired"
    );
    let invalid = cb(
        "x",
        json!({"spec": {"remoteStorage": {"provider": "Mooncake", "ownership": "External", "endpoint": "lm://mc:1"}}}),
    );
    assert_eq!(
        admit(&vllm_pod(), &[invalid], &cfg()).reason,
        "CacheBackend ns/x: External Mooncake backend: spec.remoteStorage.endpoint is invalid: endpoint \"lm://mc:1\": scheme \"lm\" is not accepted by provider Mooncake (accepted: host:port or mooncakestore://host:port); pod admitted unwired"
    );
}

#[test]
fn unsupported_pair_fails_open_with_supported_pairs() {
    let b = cb(
        "x",
        json!({"spec": {"type": "SGLangHiCache", "hiCache": {"ratio": "2"}}}),
    );
    assert_eq!(
        admit(&vllm_pod(), &[b], &cfg()).reason,
        "CacheBackend ns/x: no runtime adapter is registered for (VLLM, SGLangHiCache); supported pairs: VLLM/LMCache, SGLang/LMCache, SGLang/SGLangHiCache; pod admitted unwired"
    );
}

#[test]
fn unsupported_binding_fails_open() {
    let b = cb(
        "x",
        json!({"spec": {"remoteStorage": {"provider": "Redis", "ownership": "External", "endpoint": "redis:6379"}}}),
    );
    assert_eq!(
        admit(&vllm_pod(), &[b], &cfg()).reason,
        "CacheBackend ns/x: adapter vllm+lmcache does not accept a resp binding; pod admitted unwired"
    );
}

#[test]
fn adapter_rejection_fails_open_without_partial_changes() {
    let mut pod = vllm_pod();
    pod["spec"]["containers"][0]["args"] = json!([
        "--kv-transfer-config",
        "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}"
    ]);
    let pod = with_annotations(pod, stale());
    let o = admit(&pod, &[cb("x", json!({}))], &cfg());
    assert_eq!(
        o.reason,
        "CacheBackend ns/x: container \"vllm\" already sets --kv-transfer-config with kv_connector \"NixlConnector\"; refusing to replace the operator's connector with LMCacheConnectorV1; pod admitted unwired"
    );
    let out = apply(&pod, &o);
    assert_eq!(out["spec"], pod["spec"]);
    assert_eq!(
        out["metadata"]["annotations"],
        json!({"keep": "me", ANNOTATION_NOT_INJECTED: "CacheBackend ns/x: container \"vllm\" already sets --kv-transfer-config with kv_connector \"NixlConnector\"; refusing to replace the operator's connector with LMCacheConnectorV1"})
    );
}

/// LMCache's production-stack shape names a config file. LMCache releases disagree on whether
/// the file or the injected LMCACHE_* env wins, so the pod is wired with a warning that says
/// so — never silently reported as wired to the backend.
#[test]
fn an_lmcache_config_file_is_wired_with_a_warning_that_the_file_may_win() {
    let mut pod = vllm_pod();
    pod["spec"]["containers"][0]["env"] =
        json!([{"name": "LMCACHE_CONFIG_FILE", "value": "/lmcache/lmcache.yaml"}]);
    let (o, wired) = admit_converged(&pod, &[cb("x", json!({}))], &cfg());
    assert_eq!(o.reason, REASON_INJECTED);
    assert!(
        o.warnings.iter().any(|w| w.starts_with(
            "container \"vllm\" sets LMCACHE_CONFIG_FILE=\"/lmcache/lmcache.yaml\": LMCache releases that read only that file ignore"
        )),
        "{:?}",
        o.warnings
    );
    assert_eq!(
        env_value(container(&wired, "vllm"), "LMCACHE_CONFIG_FILE").as_deref(),
        Some("/lmcache/lmcache.yaml"),
        "the operator's file is kept"
    );
}

/// LMCache is often configured by `LMCACHE_*` keys of a ConfigMap the engine takes with
/// `envFrom`. The env the webhook injects wins over `envFrom`, so such a key is overridden:
/// the pod is wired, with a warning naming the source and the variables it would hide. A
/// source whose prefix cannot produce them is not mentioned.
#[test]
fn an_env_from_source_the_injected_env_overrides_is_named_in_a_warning() {
    let mut pod = vllm_pod();
    pod["spec"]["containers"][0]["envFrom"] = json!([
        {"configMapRef": {"name": "lmcache-settings"}},
        {"prefix": "HF_", "secretRef": {"name": "hf-token"}},
    ]);
    let (o, wired) = admit_converged(&pod, &[cb("x", json!({}))], &cfg());
    assert_eq!(o.reason, REASON_INJECTED);
    let shadow: Vec<&String> = o
        .warnings
        .iter()
        .filter(|w| w.contains("takes env from"))
        .collect();
    assert_eq!(shadow.len(), 1, "{:?}", o.warnings);
    assert!(
        shadow[0].starts_with(
            "container \"vllm\" takes env from ConfigMap \"lmcache-settings\": if it has a key named "
        ),
        "{}",
        shadow[0]
    );
    // Every variable it names is one the wired container sets explicitly.
    let env = env_of(container(&wired, "vllm"));
    for name in ["LMCACHE_CHUNK_SIZE", "LMCACHE_LOCAL_CPU", "PYTHONHASHSEED"] {
        assert!(shadow[0].contains(name), "{}", shadow[0]);
        assert!(
            env.iter().any(|(n, _)| n == name),
            "{name} not injected: {env:?}"
        );
    }
    // The same pod without envFrom: no such warning.
    let mut plain = pod.clone();
    plain["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("envFrom");
    let o = admit(&plain, &[cb("x", json!({}))], &cfg());
    assert!(
        o.warnings.iter().all(|w| !w.contains("takes env from")),
        "{:?}",
        o.warnings
    );
}

#[test]
fn decode_failures_fail_open_without_patch() {
    let mut pod = vllm_pod();
    pod["spec"]["containers"] = json!("not a list");
    let o = admit(&pod, &[cb("x", json!({}))], &cfg());
    assert!(
        o.reason
            .starts_with("decode failure: the pod does not decode"),
        "{}",
        o.reason
    );
    assert_eq!(o.patch, None);
    for v in [json!(null), json!([1, 2]), json!("pod")] {
        let o = mutate_pod::<CacheBackend>(&v, "ns", &[], &cfg());
        assert!(o.allowed);
        assert_eq!(o.patch, None);
        assert_eq!(
            o.reason,
            "decode failure: request.object is not a JSON object; pod admitted unwired"
        );
    }
}

#[test]
fn no_engine_container_fails_open() {
    let mut pod = vllm_pod();
    pod["spec"]["containers"][0]["command"] = json!(["/app/server"]);
    pod["spec"]["containers"][0]["args"] = json!(["--port", "1"]);
    assert_eq!(
        admit(&pod, &[cb("x", json!({}))], &cfg()).reason,
        "CacheBackend ns/x: no engine container found for VLLM: container \"vllm\" does not launch VLLM (looked for `vllm serve`, `python -m vllm.entrypoints.openai.api_server`); pod admitted unwired"
    );
}

#[test]
fn events_only_appends_only_the_subscriber() {
    let b = cb(
        "x",
        json!({"spec": {"integration": {"mode": "EventsOnly"}, "observation": {"modelID": "m"}, "lmCache": {"chunkSizeTokens": 64}}}),
    );
    let mut pod = vllm_pod();
    pod["spec"]["containers"][0]["args"] = json!([
        "--kv-events-config",
        "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5600\",\"topic\":\"kv-events\"}"
    ]);
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        kvevent_subscriber_controller: Some("ic-controller.ic-system.svc:50051".into()),
        ..Default::default()
    };
    let (o, wired) = admit_converged(&pod, &[b], &cfg);
    assert_eq!(o.reason, REASON_INJECTED);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    assert_eq!(
        container(&wired, "vllm"),
        container(&pod, "vllm"),
        "no connector, no env"
    );
    let sub = container(&wired, "kvevent-subscriber");
    assert_eq!(
        strings(&sub["args"]),
        vec![
            "subscribe",
            "--endpoint=tcp://127.0.0.1:5600",
            "--hash-scheme=vllm",
            "--block-size=16",
            "--model-id=m",
            "--tenant=$(POD_NAMESPACE)",
            "--replica-id=$(POD_NAME)",
            "--controller=ic-controller.ic-system.svc:50051",
        ]
    );
    assert_eq!(sub["securityContext"]["runAsNonRoot"], true);
    // The pod's own projected token (audience inference-cache), read-only where
    // `ic-agent subscribe --token-file` looks by default: the controller verifies the stream as
    // this pod's.
    assert_eq!(
        sub["volumeMounts"],
        json!([{"name": "inference-cache-token", "mountPath": "/var/run/secrets/inference-cache", "readOnly": true}])
    );
    let volumes = wired["spec"]["volumes"].as_array().unwrap();
    assert_eq!(
        volumes.last().unwrap(),
        &json!({"name": "inference-cache-token", "projected": {"sources": [{"serviceAccountToken": {
            "audience": "inference-cache", "expirationSeconds": 3600, "path": "token"}}]}})
    );
}

/// The kvevent-subscriber chains at the engine's own block size (the node plan's rule): vLLM
/// `--block-size`, SGLang `--page-size` (default 1 — the subscriber's own default of 16 would
/// call every SGLang page partial and index nothing); a value only the shell knows is loud.
#[test]
fn the_subscriber_chains_at_the_engines_block_size() {
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        ..Default::default()
    };
    let events = "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5600\",\"topic\":\"kv-events\"}";
    let events_only = |runtime: &str| {
        cb(
            "x",
            json!({"spec": {"runtime": runtime, "integration": {"mode": "EventsOnly"}, "observation": {"modelID": "m"}}}),
        )
    };
    let block_arg = |wired: &Value| -> Vec<String> {
        strings(&container(wired, "kvevent-subscriber")["args"])
            .into_iter()
            .filter(|a| a.starts_with("--block-size"))
            .collect()
    };

    let mut pod = vllm_pod();
    pod["spec"]["containers"][0]["args"] =
        json!(["--block-size", "32", "--kv-events-config", events]);
    let (o, wired) = admit_converged(&pod, &[events_only("VLLM")], &cfg);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    assert_eq!(block_arg(&wired), vec!["--block-size=32"]);

    let mut sgl = vllm_pod();
    sgl["spec"]["containers"][0] = json!({
        "name": "sglang",
        "image": "lmsysorg/sglang:v0.5.16",
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "Q", "--kv-events-config", events]
    });
    let (o, wired) = admit_converged(&sgl, &[events_only("SGLang")], &cfg);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    assert_eq!(
        block_arg(&wired),
        vec!["--block-size=1"],
        "SGLang's default page size"
    );
    sgl["spec"]["containers"][0]["args"] = json!([
        "--model-path",
        "Q",
        "--page-size=64",
        "--kv-events-config",
        events
    ]);
    let (_, wired) = admit_converged(&sgl, &[events_only("SGLang")], &cfg);
    assert_eq!(block_arg(&wired), vec!["--block-size=64"]);

    let mut shell = vllm_pod();
    shell["spec"]["containers"][0]["command"] = json!(["/bin/sh", "-c"]);
    shell["spec"]["containers"][0]["args"] = json!([format!(
        "vllm serve m --block-size $BLOCK --kv-events-config '{events}'"
    )]);
    let (o, wired) = admit_converged(&shell, &[events_only("VLLM")], &cfg);
    assert_eq!(block_arg(&wired), vec!["--block-size=16"]);
    assert!(
        o.warnings
            .iter()
            .any(|w| w.contains("--block-size") && w.contains("not a literal number")),
        "{:?}",
        o.warnings
    );
}

#[test]
fn the_subscribers_token_volume_is_added_only_when_absent() {
    let b = cb(
        "x",
        json!({"spec": {"integration": {"mode": "EventsOnly"}, "observation": {"modelID": "m"}}}),
    );
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        ..Default::default()
    };
    let mut pod = vllm_pod();
    let mine = json!({"name": "inference-cache-token", "projected": {"sources": [{"serviceAccountToken": {"audience": "inference-cache", "expirationSeconds": 7200, "path": "token"}}]}});
    pod["spec"]["volumes"] = json!([mine.clone()]);
    let (_, wired) = admit_converged(&pod, std::slice::from_ref(&b), &cfg);
    assert_eq!(wired["spec"]["volumes"], json!([mine]), "kept as it was");
    assert_eq!(
        container(&wired, "kvevent-subscriber")["volumeMounts"][0]["name"],
        "inference-cache-token"
    );
    // A pod without volumes gets exactly one.
    let (_, wired) = admit_converged(&vllm_pod(), &[b], &cfg);
    let names: Vec<&str> = wired["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "inference-cache-token")
            .count(),
        1
    );
}

#[test]
fn events_only_without_model_id_fails_open() {
    let b = cb(
        "x",
        json!({"spec": {"integration": {"mode": "EventsOnly"}}}),
    );
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        ..Default::default()
    };
    let pod = with_annotations(vllm_pod(), stale());
    let (reason, ann) = annotations_after(&pod, &[b], &cfg);
    assert_eq!(reason, "CacheBackend ns/x: events-only backend without spec.observation.modelID, so the kvevent-subscriber sidecar cannot be configured; pod admitted unwired");
    assert_eq!(ann, json!({"keep": "me"}));
}

#[test]
fn offload_subscriber_only_with_image_and_model_id() {
    let b = cb("x", json!({"spec": {"observation": {"modelID": "m"}}}));
    let (_, wired) = admit_converged(&vllm_pod(), std::slice::from_ref(&b), &cfg());
    assert!(wired["spec"]["containers"].as_array().unwrap().len() == 1);
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        ..Default::default()
    };
    let (_, wired) = admit_converged(&vllm_pod(), &[b], &cfg);
    let sub = container(&wired, "kvevent-subscriber");
    assert!(strings(&sub["args"]).contains(&"--ignore-block-removed=true".to_string()));
}

#[test]
fn foreign_subscriber_name_fails_open() {
    let b = cb("x", json!({"spec": {"observation": {"modelID": "m"}}}));
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        ..Default::default()
    };
    let mut pod = vllm_pod();
    pod["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "kvevent-subscriber", "image": "mine"}));
    assert_eq!(
        admit(&pod, &[b], &cfg).reason,
        "CacheBackend ns/x: the pod already has a container named \"kvevent-subscriber\" that inference-cache did not render; rename it to get the pod wired; pod admitted unwired"
    );
}

#[test]
fn engine_host_network_only_with_a_published_endpoint() {
    let b = cb(
        "x",
        json!({"spec": {"integration": {"engineHostNetwork": true}, "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}}, "status": {"endpoint": "mc.ns.svc:50051"}}),
    );
    let (_, wired) = admit_converged(&vllm_pod(), &[b], &cfg());
    assert_eq!(wired["spec"]["hostNetwork"], true);
    assert_eq!(wired["spec"]["dnsPolicy"], "ClusterFirstWithHostNet");

    // Not yet published: no connector and no host network.
    let b = cb(
        "x",
        json!({"spec": {"integration": {"engineHostNetwork": true}, "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}}}),
    );
    let o = admit(&vllm_pod(), &[b], &cfg());
    assert!(o.reason.contains("has not published status.endpoint"));
    assert_fail_open_marked(&vllm_pod(), &o);

    // Host-only: never granted.
    let b = cb(
        "x",
        json!({"spec": {"integration": {"engineHostNetwork": true}}}),
    );
    let (o, wired) = admit_converged(&vllm_pod(), &[b], &cfg());
    assert!(wired["spec"].get("hostNetwork").is_none());
    assert!(o
        .warnings
        .iter()
        .any(|w| w.contains("engineHostNetwork is ignored")));
}

#[test]
fn fail_closed_is_mirrored_but_webhook_still_fails_open() {
    let b = cb("x", json!({"spec": {"integration": {"failOpen": false}}}));
    let (_, wired) = admit_converged(&vllm_pod(), &[b], &cfg());
    assert_eq!(
        env_value(container(&wired, "vllm"), "INFERENCECACHE_FAIL_OPEN").as_deref(),
        Some("false")
    );
}

#[test]
fn re_admission_of_a_wired_pod_yields_no_patch() {
    let backends = [cb(
        "vllm",
        json!({"spec": {"remoteStorage": {"provider": "LMCacheServer", "ownership": "External", "endpoint": "lm://s:1"}, "integration": {"engineOverrides": {"args": ["--max-model-len", "4096"], "env": [{"name": "LMCACHE_CHUNK_SIZE", "value": "128"}], "suppressEnv": ["LMCACHE_LOCAL_CPU"]}}}}),
    )];
    let (o, wired) = admit_converged(&vllm_pod(), &backends, &cfg());
    assert!(o.patch.is_some());
    let c = container(&wired, "vllm");
    assert_eq!(
        strings(&c["args"]),
        vec![
            "--port",
            "8000",
            "--kv-transfer-config",
            "{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}",
            "--max-model-len",
            "4096"
        ]
    );
    assert_eq!(env_value(c, "LMCACHE_CHUNK_SIZE").as_deref(), Some("128"));
    assert_eq!(env_value(c, "LMCACHE_LOCAL_CPU"), None);
}

#[test]
fn overrides_cannot_touch_reserved_entries() {
    let b = cb(
        "x",
        json!({"spec": {"integration": {"engineOverrides": {"suppressArgs": ["--kv-transfer-config"], "suppressEnv": ["PYTHONHASHSEED"], "env": [{"name": "VLLM_USE_V1", "value": "0"}]}}}}),
    );
    let (o, wired) = admit_converged(&vllm_pod(), &[b], &cfg());
    let c = container(&wired, "vllm");
    assert!(strings(&c["args"]).contains(&"--kv-transfer-config".to_string()));
    assert_eq!(env_value(c, "PYTHONHASHSEED").as_deref(), Some("0"));
    assert_eq!(env_value(c, "VLLM_USE_V1").as_deref(), Some("1"));
    assert_eq!(o.warnings.len(), 3, "{:?}", o.warnings);
}

#[test]
fn no_overrides_block_renders_the_canonical_patch() {
    let plain = admit(&vllm_pod(), &[cb("x", json!({}))], &cfg());
    let empty = admit(
        &vllm_pod(),
        &[cb(
            "x",
            json!({"spec": {"integration": {"engineOverrides": {}}}}),
        )],
        &cfg(),
    );
    assert_eq!(plain.patch, empty.patch);
}

#[test]
fn patch_operations_are_typed_rfc6902() {
    let o = admit(&vllm_pod(), &[cb("x", json!({}))], &cfg());
    let ops = o.patch_operations().unwrap();
    assert_eq!(ops.len(), o.patch.as_ref().unwrap().len());
    for op in o.patch.unwrap() {
        assert!(matches!(
            op["op"].as_str(),
            Some("add" | "remove" | "replace")
        ));
        assert!(op["path"].as_str().unwrap().starts_with('/'));
    }
}

#[test]
fn hicache_overrides_replace_and_suppress_and_converge() {
    let mut pod = vllm_pod();
    pod["spec"]["containers"][0] = json!({
        "name": "sglang",
        "image": "lmsysorg/sglang:v0.5.16",
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "Q"]
    });
    let b = cb(
        "x",
        json!({"spec": {"runtime": "SGLang", "type": "SGLangHiCache",
            "hiCache": {"sizeGB": 10, "writePolicy": "write_back", "ioBackend": "direct"},
            "integration": {"engineOverrides": {
                "args": ["--hicache-size=20", "--hicache-storage-backend", "file"],
                "suppressArgs": ["--hicache-io-backend", "--enable-hierarchical-cache"]}}}}),
    );
    let (o, wired) = admit_converged(&pod, &[b], &cfg());
    assert_eq!(
        strings(&container(&wired, "sglang")["args"]),
        vec![
            "--model-path",
            "Q",
            "--enable-hierarchical-cache",
            "--hicache-size=20",
            "--hicache-write-policy",
            "write_back",
            "--hicache-storage-backend",
            "file"
        ]
    );
    assert_eq!(
        o.warnings.len(),
        1,
        "the reserved suppress entry is ignored: {:?}",
        o.warnings
    );
}
