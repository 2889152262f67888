//! Engine-release gates of the Pod webhook (issue 39 item 5; `docs/pod-wiring.md` "Engine
//! releases"; the table and its sources in `ic_controller::adapters::engine_release`). Every
//! case starts from a real public manifest under `testdata/pods/` and changes only the engine
//! image (its release), the recorded `--version` annotation, or the engine arguments the gate
//! reads; each edit is named where it is made.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod pod_support;

use ic_controller::admission::pod::{PodWebhookConfig, REASON_INJECTED};
use pod_support::*;
use serde_json::{json, Value};

/// SGLang's own k8s manifest (hostNetwork StatefulSet, `lmsysorg/sglang:latest`).
const SGLANG_STS: &str = "topologies/30-sglang-docs-host-network-sts.yaml";
/// vLLM's docs Deployment (`vllm/vllm-openai:latest`, `sh -c "vllm serve …"`).
const VLLM_DOCS: &str = "01-vllm-docs-nvidia-sh-c.yaml";

const SGLANG_LMCACHE: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: sglang-lmcache
  namespace: default
  uid: 6b1f6a3e-0039-4000-8000-000000000005
spec:
  runtime: SGLang
  engineSelector:
    matchLabels:
      app: distributed-sglang
"#;

const VLLM_LMCACHE: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: mistral-lmcache
  namespace: default
  uid: 6b1f6a3e-0039-4000-8000-000000000006
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      app: mistral-7b
"#;

const VLLM_EVENTS_ONLY: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: mistral-routing
  namespace: default
  uid: 6b1f6a3e-0039-4000-8000-000000000007
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      app: mistral-7b
  integration:
    mode: EventsOnly
  observation:
    modelID: mistralai/Mistral-7B-Instruct-v0.3
"#;

fn cfg() -> PodWebhookConfig {
    PodWebhookConfig {
        kvevent_subscriber_image: Some("ghcr.io/inference-cache/ic-agent:0.1.0".to_string()),
        ..Default::default()
    }
}

fn with_image(mut pod: Value, image: &str) -> Value {
    pod["spec"]["containers"][0]["image"] = json!(image);
    pod
}

fn with_annotation(mut pod: Value, key: &str, value: &str) -> Value {
    pod["metadata"]["annotations"] = json!({ key: value });
    pod
}

/// The docs' `sh -c` script with `extra` appended to the `vllm serve` line and the model
/// replaced by `model`.
fn vllm_script(pod: Value, model: &str, extra: &str) -> Value {
    let mut pod = pod;
    let script = pod["spec"]["containers"][0]["args"][0]
        .as_str()
        .unwrap()
        .replace("mistralai/Mistral-7B-Instruct-v0.3", model);
    pod["spec"]["containers"][0]["args"][0] = json!(format!("{script} {extra}"));
    pod
}

fn release_warnings(w: &[String]) -> Vec<&String> {
    w.iter()
        .filter(|w| w.contains("release") || w.contains("vLLM 0.") || w.contains("sliding"))
        .collect()
}

/// SGLang 0.5.12 has `--enable-lmcache` but no `--lmcache-config-file` (added in 0.5.13; read
/// in the wheels' `server_args.py`): its argparse exits on the unknown flag, so the pod is
/// admitted unwired with the reason, never wired into an engine that cannot start.
#[test]
fn sglang_before_0_5_13_is_left_unwired_with_the_reason() {
    let cb = backend(SGLANG_LMCACHE);
    for image in [
        "docker.io/lmsysorg/sglang:v0.5.12-cu126",
        "lmsysorg/sglang:v0.5.3.post1-cu129-amd64",
        "mirror.corp.example:5000/lmsysorg/sglang:0.5.1",
    ] {
        let pod = with_image(load_pod(SGLANG_STS), image);
        let out = admit(&pod, std::slice::from_ref(&cb), &cfg());
        assert_ne!(out.reason, REASON_INJECTED, "{image}");
        let note = assert_fail_open_marked(&pod, &out);
        assert!(note.contains("--lmcache-config-file"), "{note}");
        assert!(note.contains("0.5.13"), "{note}");
        assert!(note.contains("from image tag"), "{note}");
    }
}

/// From 0.5.13 the flags exist: wired, and no release warning. The recorded `--version`
/// (annotation) wins over the tag: a 0.5.12-tagged image rebuilt on 0.5.13 is wired, and a
/// 0.5.16 tag recorded as 0.5.9 is not.
#[test]
fn sglang_from_0_5_13_or_recorded_so_is_wired() {
    let cb = backend(SGLANG_LMCACHE);
    for image in ["lmsysorg/sglang:v0.5.13-cu126", "lmsysorg/sglang:v0.5.23"] {
        let pod = with_image(load_pod(SGLANG_STS), image);
        let (out, _) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
        assert_eq!(out.reason, REASON_INJECTED, "{image}");
        assert!(
            release_warnings(&out.warnings).is_empty(),
            "{:?}",
            out.warnings
        );
    }
    let pod = with_annotation(
        with_image(load_pod(SGLANG_STS), "lmsysorg/sglang:v0.5.12-cu126"),
        "inferencecache.io/engine-version",
        "0.5.13",
    );
    let (out, _) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    assert_eq!(out.reason, REASON_INJECTED);
    let pod = with_annotation(
        with_image(load_pod(SGLANG_STS), "lmsysorg/sglang:v0.5.16"),
        "inferencecache.io/engine-version",
        "v0.5.9",
    );
    let out = admit(&pod, std::slice::from_ref(&cb), &cfg());
    let note = assert_fail_open_marked(&pod, &out);
    assert!(
        note.contains("annotation inferencecache.io/engine-version"),
        "{note}"
    );
}

/// A release that cannot be read — `latest` (the manifest as SGLang ships it), a digest, a
/// pre-release, a private image whose tag is its own numbering — is wired as for a current
/// SGLang, with an admission warning that says so and how to record the release.
#[test]
fn unknown_sglang_releases_are_wired_with_a_warning() {
    let cb = backend(SGLANG_LMCACHE);
    for (image, why) in [
        ("docker.io/lmsysorg/sglang:latest", "\"latest\""),
        (
            "lmsysorg/sglang@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "by digest",
        ),
        ("lmsysorg/sglang:v0.5.14rc0-cu126", "\"v0.5.14rc0-cu126\""),
        ("ghcr.io/acme/sglang-runtime:v0.1.0", "not the engine's own image"),
    ] {
        let pod = with_image(load_pod(SGLANG_STS), image);
        let (out, _) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
        assert_eq!(out.reason, REASON_INJECTED, "{image}: {}", out.reason);
        let w = release_warnings(&out.warnings);
        assert_eq!(w.len(), 1, "{image}: {:?}", out.warnings);
        assert!(w[0].contains(why), "{image}: {}", w[0]);
        assert!(w[0].contains("inferencecache.io/engine-version"), "{}", w[0]);
    }
}

/// vLLM before 0.11.1 defaults `publisher` to "null" (`vllm/config/kv_events.py` 0.11.0), so
/// `--kv-events-config '{"enable_kv_cache_events":true,…}'` without a publisher sends nothing;
/// 0.11.1 makes it "zmq". The pod is wired (the flag is the operator's), with a warning below
/// 0.11.1 and for an unknown release, none from 0.11.1 or with an explicit publisher.
#[test]
fn vllm_events_without_a_publisher_warn_before_0_11_1() {
    let no_publisher =
        r#"--kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557"}'"#;
    let zmq = r#"--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}'"#;
    for yaml in [VLLM_LMCACHE, VLLM_EVENTS_ONLY] {
        let cb = backend(yaml);
        let case = |image: &str, extra: &str| {
            let pod = with_image(
                vllm_script(
                    load_pod(VLLM_DOCS),
                    "mistralai/Mistral-7B-Instruct-v0.3",
                    extra,
                ),
                image,
            );
            let (out, _) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
            assert_eq!(out.reason, REASON_INJECTED, "{image}: {}", out.reason);
            out.warnings
                .into_iter()
                .filter(|w| w.contains("publisher"))
                .collect::<Vec<_>>()
        };
        let w = case("vllm/vllm-openai:v0.11.0", no_publisher);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("vLLM 0.11.0"), "{}", w[0]);
        assert!(w[0].contains("\"null\""), "{}", w[0]);
        let w = case("vllm/vllm-openai:latest", no_publisher);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("could not be read"), "{}", w[0]);
        assert!(case("vllm/vllm-openai:v0.11.1", no_publisher).is_empty());
        assert!(case("vllm/vllm-openai:v0.11.0", zmq).is_empty());
    }
}

/// A sliding-window model (Gemma 3, gpt-oss) wired with the LMCache connector: vLLM turns its
/// hybrid KV-cache manager off with any KV connector, so the sliding-window layers keep
/// full-length KV. Wired, with a warning naming the model and EventsOnly; a full-attention
/// model gets none.
#[test]
fn a_sliding_window_model_with_the_lmcache_connector_warns() {
    let cb = backend(VLLM_LMCACHE);
    for model in ["google/gemma-3-27b-it", "openai/gpt-oss-120b"] {
        let pod = with_image(
            vllm_script(load_pod(VLLM_DOCS), model, ""),
            "vllm/vllm-openai:v0.11.1",
        );
        let (out, _) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
        assert_eq!(out.reason, REASON_INJECTED);
        let w: Vec<_> = out
            .warnings
            .iter()
            .filter(|w| w.contains("sliding"))
            .collect();
        assert_eq!(w.len(), 1, "{model}: {:?}", out.warnings);
        assert!(
            w[0].contains(model) && w[0].contains("EventsOnly"),
            "{}",
            w[0]
        );
    }
    let pod = with_image(load_pod(VLLM_DOCS), "vllm/vllm-openai:v0.11.1");
    let (out, _) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    assert!(
        !out.warnings.iter().any(|w| w.contains("sliding")),
        "{:?}",
        out.warnings
    );
}
