//! Real engine pods from public projects (`testdata/pods/`, each names its source),
//! each paired with plausible CacheBackends: either the exact resulting pod and patch (a golden
//! file under `tests/golden/`, rewritten with `UPDATE_GOLDEN=1`) or a fail-open admit with the
//! precise reason. Every wired pod re-admits with no patch. Spec 000 "Mutating Pod webhook";
//! issue 4 "Real pods".

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod pod_support;

use ic_controller::admission::pod::{PodWebhookConfig, REASON_INJECTED};
use pod_support::*;
use serde_json::{json, Value};

/// What a case must produce.
enum Expect {
    /// Wired: the golden file `<case>.json` holds reason, warnings, patch and resulting pod.
    Golden,
    /// Admitted unwired with exactly this reason and no patch.
    FailOpen(&'static str),
}

struct Case {
    name: &'static str,
    fixture: &'static str,
    backend: &'static str,
    subscriber_image: bool,
    expect: Expect,
}

const SUBSCRIBER_IMAGE: &str = "ghcr.io/inference-cache/ic-agent:0.1.0";

const VLLM_HOST_ONLY: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: mistral-cache
  namespace: default
  uid: 6b1f6a3e-0001-4000-8000-000000000001
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      app: mistral-7b
  lmCache:
    hostMemory:
      capacity: 8Gi
"#;

const VLLM_LMCACHE_SERVER_MANAGED: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: mistral-lmcache
  namespace: default
  uid: 6b1f6a3e-0003-4000-8000-000000000003
spec:
  runtime: VLLM
  type: LMCache
  engineSelector:
    matchLabels:
      model: mistral
      helm-release-name: vllm
  remoteStorage:
    provider: LMCacheServer
    ownership: Managed
status:
  endpoint: mistral-lmcache.default.svc:8100
"#;

const VLLM_LMCACHE_SERVER_READ_ONLY: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: mistral-lmcache
  namespace: default
  uid: 6b1f6a3e-0003-4000-8000-000000000003
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      model: mistral
  integration:
    role: ReadOnly
  remoteStorage:
    provider: LMCacheServer
    ownership: External
    endpoint: lm://lmcache.shared-cache.svc:65432
  allowCrossNamespace: true
"#;

const VLLM_LMCACHE_SERVER_NOT_PUBLISHED: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: mistral-lmcache
  namespace: default
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      model: mistral
  remoteStorage:
    provider: LMCacheServer
    ownership: Managed
"#;

const VLLM_MOONCAKE_EXTERNAL: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: llama-mooncake
  namespace: default
  uid: 6b1f6a3e-0006-4000-8000-000000000006
  annotations:
    inferencecache.io/lmcache-kernel-check: strict
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      app: vllm-llama3-1b-instruct
  remoteStorage:
    provider: Mooncake
    ownership: External
    endpoint: " mooncakestore://mooncake-master.kv-infra.svc.cluster.local:50051 "
  allowCrossNamespace: true
  integration:
    engineHostNetwork: true
    engineOverrides:
      args: ["--max-model-len=8192", "--port=9000"]
      env:
        - name: LMCACHE_CHUNK_SIZE
          value: "512"
      suppressEnv: [LMCACHE_LOCAL_CPU]
"#;

const VLLM_EVENTS_ONLY: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: llama-routing
  namespace: default
  uid: 6b1f6a3e-0016-4000-8000-000000000016
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      app: vllm-llama3-1b-instruct
  integration:
    mode: EventsOnly
  observation:
    modelID: meta-llama/Llama-3.2-1B-Instruct
"#;

const SGLANG_HICACHE_MATCHING: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-hicache
  namespace: llm-d-tiered-prefix-cache
  uid: 6b1f6a3e-0013-4000-8000-000000000013
spec:
  runtime: SGLang
  type: SGLangHiCache
  engineSelector:
    matchLabels:
      llm-d.ai/engine-type: sglang
  hiCache:
    sizeGB: 200
    writePolicy: write_through
    ioBackend: kernel
"#;

const SGLANG_HICACHE_RATIO: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-hicache
  namespace: llm-d-tiered-prefix-cache
spec:
  runtime: SGLang
  type: SGLangHiCache
  engineSelector:
    matchLabels:
      llm-d.ai/engine-type: sglang
  hiCache:
    ratio: "2.0"
"#;

const SGLANG_LMCACHE_HOST_ONLY_LLMD: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-lmcache
  namespace: llm-d-tiered-prefix-cache
spec:
  runtime: SGLang
  engineSelector:
    matchLabels:
      llm-d.ai/model: Qwen3-32B
"#;

const SGLANG_LMCACHE_REDIS: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-lmcache
  namespace: dynamo
  uid: 6b1f6a3e-0022-4000-8000-000000000022
spec:
  runtime: SGLang
  type: LMCache
  engineSelector:
    matchLabels:
      nvidia.com/dynamo-component: SglangSmgSidecarWorker
  lmCache:
    hostMemory:
      capacity: 16Gi
  remoteStorage:
    provider: Redis
    ownership: Managed
  observation:
    modelID: Qwen/Qwen3-0.6B
status:
  endpoint: qwen-lmcache-redis.dynamo.svc:6379
"#;

const SGLANG_HICACHE_DYNAMO: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-hicache
  namespace: dynamo
spec:
  runtime: SGLang
  type: SGLangHiCache
  engineSelector:
    matchLabels:
      nvidia.com/dynamo-component-type: worker
  hiCache:
    ratio: "1.5"
"#;

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "01-vllm-host-only",
            fixture: "01-vllm-docs-nvidia-sh-c.yaml",
            backend: VLLM_HOST_ONLY,
            subscriber_image: false,
            expect: Expect::Golden,
        },
        Case {
            name: "03-vllm-lmcacheserver-managed",
            fixture: "03-prodstack-helm-lmcache-cpu-offload.yaml",
            backend: VLLM_LMCACHE_SERVER_MANAGED,
            subscriber_image: false,
            expect: Expect::Golden,
        },
        Case {
            name: "03-vllm-lmcacheserver-external-read-only",
            fixture: "03-prodstack-helm-lmcache-cpu-offload.yaml",
            backend: VLLM_LMCACHE_SERVER_READ_ONLY,
            subscriber_image: false,
            expect: Expect::Golden,
        },
        Case {
            name: "03-vllm-managed-endpoint-not-published",
            fixture: "03-prodstack-helm-lmcache-cpu-offload.yaml",
            backend: VLLM_LMCACHE_SERVER_NOT_PUBLISHED,
            subscriber_image: false,
            expect: Expect::FailOpen(
                "CacheBackend default/mistral-lmcache: Managed LMCacheServer backend has not published status.endpoint yet (roll the engine workload once the backend is Ready); pod admitted unwired",
            ),
        },
        Case {
            name: "06-vllm-mooncake-external-host-network-strict-overrides",
            fixture: "06-gaie-vllm-lora-syncer-native-sidecar.yaml",
            backend: VLLM_MOONCAKE_EXTERNAL,
            subscriber_image: false,
            expect: Expect::Golden,
        },
        Case {
            name: "06-vllm-events-only-subscriber",
            fixture: "06-gaie-vllm-lora-syncer-native-sidecar.yaml",
            backend: VLLM_EVENTS_ONLY,
            subscriber_image: true,
            expect: Expect::Golden,
        },
        Case {
            name: "06-vllm-events-only-without-subscriber-image",
            fixture: "06-gaie-vllm-lora-syncer-native-sidecar.yaml",
            backend: VLLM_EVENTS_ONLY,
            subscriber_image: false,
            expect: Expect::FailOpen(
                "CacheBackend default/llama-routing: events-only backend, but the controller runs without --kvevent-subscriber-image, so there is no kvevent-subscriber sidecar to append; pod admitted unwired",
            ),
        },
        Case {
            name: "13-sglang-hicache-matching-args",
            fixture: "13-llmd-sglang-mooncake-sh-c-dashdash-args.yaml",
            backend: SGLANG_HICACHE_MATCHING,
            subscriber_image: false,
            expect: Expect::Golden,
        },
        Case {
            name: "13-sglang-hicache-ratio-conflicts-with-size",
            fixture: "13-llmd-sglang-mooncake-sh-c-dashdash-args.yaml",
            backend: SGLANG_HICACHE_RATIO,
            subscriber_image: false,
            expect: Expect::FailOpen(
                "CacheBackend llm-d-tiered-prefix-cache/qwen-hicache: SGLang HiCache: container \"modelserver\" sets --hicache-size 200, the CacheBackend asks for --hicache-ratio 2.0; pod admitted unwired",
            ),
        },
        Case {
            name: "13-sglang-lmcache-conflicts-with-hicache",
            fixture: "13-llmd-sglang-mooncake-sh-c-dashdash-args.yaml",
            backend: SGLANG_LMCACHE_HOST_ONLY_LLMD,
            subscriber_image: false,
            expect: Expect::FailOpen(
                "CacheBackend llm-d-tiered-prefix-cache/qwen-lmcache: container \"modelserver\" already sets --enable-hierarchical-cache: SGLang native HiCache is already configured on this engine; LMCache MP mode replaces the hierarchical cache; pod admitted unwired",
            ),
        },
        Case {
            name: "22-sglang-lmcache-mp-redis-engine-not-first",
            fixture: "22-dynamo-sglang-smg-two-containers-engine-not-main.yaml",
            backend: SGLANG_LMCACHE_REDIS,
            subscriber_image: true,
            expect: Expect::Golden,
        },
        Case {
            name: "22-sglang-hicache-needs-sglang-container-name",
            fixture: "22-dynamo-sglang-smg-two-containers-engine-not-main.yaml",
            backend: SGLANG_HICACHE_DYNAMO,
            subscriber_image: false,
            expect: Expect::FailOpen(
                "CacheBackend dynamo/qwen-hicache: SGLang HiCache: a multi-container pod must name its engine container \"sglang\" (containers: main, sglang-engine); pod admitted unwired",
            ),
        },
    ]
}

fn cfg(subscriber: bool) -> PodWebhookConfig {
    PodWebhookConfig {
        kvevent_subscriber_image: subscriber.then(|| SUBSCRIBER_IMAGE.to_string()),
        ..Default::default()
    }
}

fn run(case: &Case) {
    let pod = load_pod(case.fixture);
    let backend = backend(case.backend);
    let cfg = cfg(case.subscriber_image);
    match case.expect {
        Expect::Golden => {
            let (outcome, wired) = admit_converged(&pod, std::slice::from_ref(&backend), &cfg);
            assert_eq!(
                outcome.reason, REASON_INJECTED,
                "{}: {}",
                case.name, outcome.reason
            );
            golden(
                case.name,
                &json!({
                    "fixture": case.fixture,
                    "reason": outcome.reason,
                    "warnings": outcome.warnings,
                    "patch": outcome.patch.clone().unwrap_or_default(),
                    "pod": wired,
                }),
            );
        }
        Expect::FailOpen(reason) => {
            let outcome = admit(&pod, std::slice::from_ref(&backend), &cfg);
            assert_eq!(outcome.reason, reason, "{}", case.name);
            // A fail-open on a clean pod changes nothing but the not-injected record.
            assert_fail_open_marked(&pod, &outcome);
        }
    }
}

#[test]
fn every_fixture_pod_has_a_case() {
    let covered: Vec<&str> = cases().iter().map(|c| c.fixture).collect();
    for name in fixture_names() {
        assert!(
            covered.contains(&name.as_str()),
            "fixture {name} has no case in tests/pod_fixtures.rs"
        );
        assert!(!load_pods(&name).is_empty(), "fixture {name} holds no pod");
    }
}

#[test]
fn fixture_cases() {
    for case in cases() {
        run(&case);
    }
}

#[test]
fn no_stray_golden_files() {
    let names: Vec<String> = cases()
        .iter()
        .filter(|c| matches!(c.expect, Expect::Golden))
        .map(|c| format!("{}.json", c.name))
        .collect();
    for entry in std::fs::read_dir(golden_dir())
        .expect("golden dir")
        .flatten()
    {
        let n = entry.file_name().to_string_lossy().into_owned();
        assert!(names.contains(&n), "golden file {n} belongs to no case");
    }
}

/// The details the golden files hold, asserted by meaning so a regeneration cannot silently
/// change them.
#[test]
fn fixture_wiring_details() {
    // 01: flag inserted into the sh -c script, shell-quoted; kernel check (GPU, auto).
    let pod = load_pod("01-vllm-docs-nvidia-sh-c.yaml");
    let (_, wired) = admit_converged(&pod, &[backend(VLLM_HOST_ONLY)], &cfg(false));
    let c = container(&wired, "mistral-7b");
    assert_eq!(strings(&c["command"]), vec!["/bin/sh", "-c"]);
    assert_eq!(
        strings(&c["args"]),
        vec![
            r#"vllm serve mistralai/Mistral-7B-Instruct-v0.3 --trust-remote-code --enable-chunked-prefill --max_num_batched_tokens 1024 --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'"#
        ]
    );
    assert_eq!(
        env_value(c, "LMCACHE_MAX_LOCAL_CPU_SIZE").as_deref(),
        Some("8")
    );
    assert_eq!(env_value(c, "LMCACHE_REMOTE_URL"), None);
    let check = init_container(&wired, "lmcache-kernel-check").expect("kernel check");
    assert_eq!(
        env_value(check, "INFERENCECACHE_KERNEL_CHECK_MODE").as_deref(),
        Some("report-only")
    );
    assert_eq!(
        wired["metadata"]["annotations"]["inferencecache.io/injected-by"],
        "default/mistral-cache"
    );

    // 03: existing connector adopted, not duplicated; reserved env converged; tunables kept.
    let pod = load_pod("03-prodstack-helm-lmcache-cpu-offload.yaml");
    let (outcome, wired) =
        admit_converged(&pod, &[backend(VLLM_LMCACHE_SERVER_MANAGED)], &cfg(false));
    let c = container(&wired, "vllm");
    let argv: Vec<String> = strings(&c["command"])
        .into_iter()
        .chain(strings(&c["args"]))
        .collect();
    assert_eq!(
        argv.iter()
            .filter(|a| a.starts_with("--kv-transfer-config"))
            .count(),
        1
    );
    // production-stack's chart fixes the seed at 123: any fixed seed keeps LMCache's keys
    // stable, so it is kept (issue 14 item 3), with a warning.
    assert_eq!(env_value(c, "PYTHONHASHSEED").as_deref(), Some("123"));
    assert!(outcome
        .warnings
        .iter()
        .any(|w| w.contains("PYTHONHASHSEED=123 from the pod template is kept")));
    assert_eq!(
        env_value(c, "LMCACHE_MAX_LOCAL_CPU_SIZE").as_deref(),
        Some("20")
    );
    assert_eq!(
        env_value(c, "LMCACHE_REMOTE_URL").as_deref(),
        Some("lm://mistral-lmcache.default.svc:8100")
    );
    assert!(outcome
        .warnings
        .iter()
        .any(|w| w.contains("LMCACHE_MAX_LOCAL_CPU_SIZE=20")));
    assert_eq!(
        strings(&init_container(&wired, "lmcache-kernel-check").unwrap()["command"])[0],
        "/opt/venv/bin/python3"
    );

    // 06: Mooncake + host network + strict + overrides; the LoRA native sidecar stays first.
    let pod = load_pod("06-gaie-vllm-lora-syncer-native-sidecar.yaml");
    let (_, wired) = admit_converged(&pod, &[backend(VLLM_MOONCAKE_EXTERNAL)], &cfg(false));
    assert_eq!(wired["spec"]["hostNetwork"], true);
    assert_eq!(wired["spec"]["dnsPolicy"], "ClusterFirstWithHostNet");
    let inits: Vec<&str> = wired["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(inits, vec!["lora-adapter-syncer", "lmcache-kernel-check"]);
    let c = container(&wired, "vllm");
    assert_eq!(
        env_value(c, "LMCACHE_REMOTE_URL").as_deref(),
        Some("mooncakestore://mooncake-master.kv-infra.svc.cluster.local:50051")
    );
    assert_eq!(env_value(c, "LMCACHE_CHUNK_SIZE").as_deref(), Some("512"));
    assert_eq!(env_value(c, "LMCACHE_LOCAL_CPU"), None);
    let args = strings(&c["args"]);
    assert!(args.contains(&"--max-model-len=8192".to_string()));
    assert!(
        !args.contains(&"--port=9000".to_string()),
        "user-template flag: silent no-op"
    );
    assert_eq!(
        env_value(
            init_container(&wired, "lmcache-kernel-check").unwrap(),
            "INFERENCECACHE_KERNEL_CHECK_MODE"
        )
        .as_deref(),
        Some("strict")
    );

    // 13: everything already matches: only the annotations change.
    let pod = load_pod("13-llmd-sglang-mooncake-sh-c-dashdash-args.yaml");
    let (outcome, wired) = admit_converged(&pod, &[backend(SGLANG_HICACHE_MATCHING)], &cfg(false));
    assert_eq!(wired["spec"], pod["spec"]);
    assert!(outcome.patch.unwrap().iter().all(|op| op["path"]
        .as_str()
        .unwrap()
        .starts_with("/metadata/annotations")));

    // 22: the engine is the second container; the MP worker reuses nothing (the engine has no
    // /dev/shm of its own) and gets the RESP L2 adapter.
    let pod = load_pod("22-dynamo-sglang-smg-two-containers-engine-not-main.yaml");
    let (_, wired) = admit_converged(&pod, &[backend(SGLANG_LMCACHE_REDIS)], &cfg(true));
    assert_eq!(container(&wired, "main"), container(&pod, "main"));
    let e = container(&wired, "sglang-engine");
    let args = strings(&e["args"]);
    assert!(args.ends_with(&[
        "--enable-lmcache".into(),
        "--lmcache-config-file".into(),
        "/etc/lmcache/lmcache.yaml".into()
    ]));
    let w = init_container(&wired, "lmcache-mp-worker").unwrap();
    assert_eq!(w["restartPolicy"], "Always");
    let wargs = strings(&w["args"]);
    assert!(wargs.windows(2).any(|p| p[0] == "--l2-adapter"
        && p[1] == r#"{"host":"qwen-lmcache-redis.dynamo.svc","port":6379,"type":"resp"}"#));
    assert!(wargs.windows(2).any(|p| p == ["--l1-size-gb", "16"]));
    let sub = container(&wired, "kvevent-subscriber");
    assert!(strings(&sub["args"]).contains(&"--hash-scheme=sglang".to_string()));
    // The sidecar presents the pod's own projected token (audience inference-cache).
    assert_eq!(
        sub["volumeMounts"][0]["mountPath"],
        "/var/run/secrets/inference-cache"
    );
    let token = wired["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "inference-cache-token")
        .expect("token volume");
    assert_eq!(
        token["projected"]["sources"][0]["serviceAccountToken"]["audience"],
        "inference-cache"
    );
}

#[test]
fn golden_files_are_valid_pods() {
    for case in cases()
        .iter()
        .filter(|c| matches!(c.expect, Expect::Golden))
    {
        let path = golden_dir().join(format!("{}.json", case.name));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let v: Value = serde_json::from_str(&text).unwrap();
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(v["pod"].clone())
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert!(pod.spec.is_some());
    }
}

#[test]
fn loader_finds_pods_in_workloads_and_multi_document_files() {
    let text = r#"
apiVersion: v1
kind: Service
metadata: {name: s}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: d, namespace: team}
spec:
  template:
    metadata: {labels: {app: a}}
    spec: {containers: [{name: c, image: i}]}
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: j}
spec:
  jobTemplate:
    spec:
      template:
        spec: {containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: p}
spec: {containers: [{name: c, image: i}]}
"#;
    let pods = pods_in_yaml(text);
    assert_eq!(pods.len(), 3);
    assert_eq!(pods[0]["kind"], "Pod");
    assert_eq!(pods[0]["metadata"]["namespace"], "team");
    assert_eq!(pods[0]["metadata"]["labels"]["app"], "a");
    assert_eq!(pods[2]["metadata"]["name"], "p");
}
