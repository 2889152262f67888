//! Engine-pod wiring on real fleet topologies (issue 14): host networking, outward publishers,
//! data-parallel ranks, other webhooks' additions, two matching backends, native-sidecar
//! support. Every case starts from a real public manifest under `testdata/pods/topologies/` (each
//! names its source); where a case needs a variant, the test edits the fixture and says how.
//! `docs/pod-wiring.md` describes the rules these tests hold.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod pod_support;

use ic_controller::admission::pod::{NativeSidecars, PodWebhookConfig, REASON_INJECTED};
use ic_controller::reconcile::nodes::plans::derive_plans;
use ic_shared::plan::PortExpect;
use pod_support::*;
use serde_json::{json, Value};

const SUBSCRIBER_IMAGE: &str = "ghcr.io/inference-cache/ic-agent:0.1.0";

const HOST_NET: &str = "30-sglang-docs-host-network-sts.yaml";
const OUTWARD: &str = "31-llmd-precise-prefix-vllm-outward-publisher.yaml";
const DP8: &str = "32-llmd-wide-ep-vllm-dp8-kv-events.yaml";

fn cfg() -> PodWebhookConfig {
    PodWebhookConfig {
        kvevent_subscriber_image: Some(SUBSCRIBER_IMAGE.to_string()),
        ..Default::default()
    }
}

const SGLANG_LMCACHE: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: sglang-lmcache
  namespace: default
  uid: 6b1f6a3e-0030-4000-8000-000000000030
spec:
  runtime: SGLang
  engineSelector:
    matchLabels:
      app: distributed-sglang
  observation:
    modelID: deepseek-ai/DeepSeek-R1
"#;

const QWEN_EVENTS_ONLY: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-routing
  namespace: llm-d-precise
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      llm-d.ai/model: Qwen3-0.6B
  integration:
    mode: EventsOnly
  observation:
    modelID: Qwen/Qwen3-0.6B
"#;

const QWEN_LMCACHE: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: qwen-lmcache
  namespace: llm-d-precise
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      llm-d.ai/model: Qwen3-0.6B
  observation:
    modelID: Qwen/Qwen3-0.6B
"#;

const GLM_LMCACHE: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: glm-lmcache
  namespace: llm-d-wide-ep-precise
  uid: 6b1f6a3e-0032-4000-8000-000000000032
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      llm-d.ai/model: GLM-5.2-FP8
  observation:
    modelID: zai-org/GLM-5.2-FP8
"#;

const GLM_EVENTS_ONLY: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: glm-routing
  namespace: llm-d-wide-ep-precise
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      llm-d.ai/model: GLM-5.2-FP8
  integration:
    mode: EventsOnly
  observation:
    modelID: zai-org/GLM-5.2-FP8
"#;

const GLM_MOONCAKE: &str = r#"
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata:
  name: a-glm-mooncake
  namespace: llm-d-wide-ep-precise
  uid: 6b1f6a3e-0033-4000-8000-000000000033
spec:
  runtime: VLLM
  engineSelector:
    matchLabels:
      llm-d.ai/model: GLM-5.2-FP8
  lmCache:
    chunkSizeTokens: 512
  remoteStorage:
    provider: Mooncake
    ownership: External
    endpoint: mooncakestore://mooncake-master.kv-infra.svc:50051
  allowCrossNamespace: true
"#;

fn names_of(pod: &Value, list: &str) -> Vec<String> {
    pod["spec"][list]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| c["name"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn subscriber_names(pod: &Value) -> Vec<String> {
    names_of(pod, "containers")
        .into_iter()
        .filter(|n| n.starts_with("kvevent-subscriber"))
        .collect()
}

fn ports_of(c: &Value) -> Vec<(i64, Option<i64>, String)> {
    c["ports"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    (
                        p["containerPort"].as_i64().unwrap(),
                        p["hostPort"].as_i64(),
                        p["name"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Replaces text inside the engine's `sh -c` script (the only args element).
fn edit_script(pod: &mut Value, container: &str, from: &str, to: &str) {
    let c = pod["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == container)
        .unwrap();
    let script = c["args"][0].as_str().unwrap().to_string();
    assert!(script.contains(from), "{from:?} not in the script");
    c["args"][0] = Value::String(script.replace(from, to));
}

/// Replaces the value following `flag` in the engine's exec-form command.
fn set_flag(pod: &mut Value, flag: &str, value: &str) {
    let cmd = pod["spec"]["containers"][0]["command"]
        .as_array_mut()
        .unwrap();
    let i = cmd.iter().position(|a| a == flag).unwrap();
    cmd[i + 1] = Value::String(value.to_string());
}

#[test]
fn every_repo_fixture_has_a_source_and_a_test() {
    let covered = [HOST_NET, OUTWARD, DP8];
    for name in repo_fixture_names() {
        assert!(
            covered.contains(&name.as_str()),
            "fixture {name} has no test"
        );
        let text = std::fs::read_to_string(repo_fixtures_dir().join(&name)).unwrap();
        assert!(
            text.starts_with("# source: github.com/"),
            "{name} must name its public source in its first line"
        );
        load_repo_pod(&name);
    }
}

// ---- 1. host networking -------------------------------------------------------------------

#[test]
fn host_network_pod_declares_its_listeners_and_probes_its_own_worker() {
    let pod = load_repo_pod(HOST_NET);
    let cb = backend(SGLANG_LMCACHE);
    let (outcome, wired) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
    let engine = container(&wired, "sglang-container");
    let ports = ports_of(engine);
    // The MP worker's port and the publisher port the subscriber dials are the node's: both
    // declared as host ports on the engine container (which every scheduler counts).
    assert!(
        ports.contains(&(5555, Some(5555), "ic-lmcache-mp".into())),
        "{ports:?}"
    );
    assert!(
        ports.contains(&(5557, Some(5557), "ic-kv-ev-0".into())),
        "{ports:?}"
    );
    // The worker's probe proves the listener belongs to a process of its own container.
    let worker = init_container(&wired, "lmcache-mp-worker").unwrap();
    let probe = strings(&worker["startupProbe"]["exec"]["command"]);
    assert_eq!(probe[0], "python3");
    assert!(probe[2].contains("\"%04X\" % 5555"), "{}", probe[2]);
    assert!(probe[2].contains("/proc/net/tcp") && probe[2].contains("/fd/"));
    assert!(!probe[2].contains("create_connection"));

    // The node plan expects this pod (by UID) to hold those ports once Ready: the agent's
    // ports check knows the owner.
    let mut scheduled = wired.clone();
    scheduled["metadata"]["name"] = json!("distributed-sglang-0");
    scheduled["metadata"]["uid"] = json!("0f6e3f52-7d2a-4d0c-9b1e-30a000000001");
    scheduled["spec"]["nodeName"] = json!("gpu-node-1");
    scheduled["status"] = json!({"phase": "Running", "podIP": "10.0.0.9",
        "conditions": [{"type": "Ready", "status": "True"}]});
    let plans = derive_plans(&[serde_json::from_value(scheduled).unwrap()], &[cb]);
    let plan = &plans.plans["gpu-node-1"];
    for port in [5555u16, 5557] {
        let e = plan
            .ports
            .iter()
            .find(|p| p.port == port)
            .unwrap_or_else(|| panic!("port {port} not planned: {:?}", plan.ports));
        assert_eq!(e.expect, PortExpect::Held);
        assert_eq!(
            e.owner.as_ref().and_then(|o| o.pod_uid.as_deref()),
            Some("0f6e3f52-7d2a-4d0c-9b1e-30a000000001")
        );
    }
}

/// A CacheBackend edit does not reach a running pod (its worker, env and volumes were rendered
/// at admission), so the node plan follows what the webhook recorded on the pod, not the
/// current spec: the MP-worker port the worker really listens on, its `/dev/shm` need, the
/// model id — and says loudly which fields changed. A pod without the record (wired before it
/// existed) is planned from the current spec; an unreadable record says so.
#[test]
fn the_plan_follows_the_spec_a_pod_was_wired_under_and_says_when_the_spec_moved_on() {
    let pod = load_repo_pod(HOST_NET);
    let cb = backend(SGLANG_LMCACHE);
    let (outcome, wired) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
    let record = wired["metadata"]["annotations"]["inferencecache.io/wired-spec"]
        .as_str()
        .unwrap()
        .to_string();
    let worker = init_container(&wired, "lmcache-mp-worker").unwrap();
    let probe = strings(&worker["startupProbe"]["exec"]["command"]);
    assert!(probe[2].contains("\"%04X\" % 5555"), "{}", probe[2]);
    let mut scheduled = wired.clone();
    scheduled["metadata"]["uid"] = json!("0f6e3f52-7d2a-4d0c-9b1e-30a000000003");
    scheduled["spec"]["nodeName"] = json!("gpu-node-1");
    scheduled["status"] = json!({"phase": "Running", "podIP": "10.0.0.9",
        "conditions": [{"type": "Ready", "status": "True"}]});
    let scheduled_pod: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(scheduled.clone()).unwrap();

    // The operator edits the backend afterwards: another worker port, a bigger L1, a new id.
    let mut edited = cb.clone();
    edited.metadata.generation = Some(2);
    edited.spec.lm_cache = Some(
        serde_json::from_value(json!({
        "workerPort": 6000, "hostMemory": {"capacity": "8Gi"}}))
        .unwrap(),
    );
    edited.spec.observation.as_mut().unwrap().model_id = Some("deepseek-ai/DeepSeek-V3".into());
    let derived = derive_plans(
        std::slice::from_ref(&scheduled_pod),
        std::slice::from_ref(&edited),
    );
    let plan = &derived.plans["gpu-node-1"];
    let e = &plan.engines[0];
    assert_eq!(
        e.mp_worker_port,
        Some(5555),
        "the port the pod's worker listens on"
    );
    assert_eq!(
        e.model, "deepseek-ai/DeepSeek-R1",
        "the id its streams carry"
    );
    assert_eq!(
        e.shm_required_bytes,
        Some(4 << 30),
        "the default 4Gi it was wired with"
    );
    assert!(
        plan.ports.iter().any(|p| p.port == 5555) && !plan.ports.iter().any(|p| p.port == 6000)
    );
    let issue = derived
        .issues
        .iter()
        .find(|i| i.reason == "WiredUnderOlderSpec")
        .unwrap_or_else(|| panic!("{:?}", derived.issues));
    for field in [
        "spec.lmCache.workerPort",
        "spec.lmCache.hostMemory.capacity",
        "spec.observation.modelID",
    ] {
        assert!(issue.message.contains(field), "{}", issue.message);
    }
    assert!(!issue.message.contains("spec.runtime"), "{}", issue.message);

    // Without a kvevent-subscriber sidecar nothing in the pod carries the model id: the node
    // agent's streams take the current one, and only the worker's fields are reported.
    let mut no_sidecar = scheduled.clone();
    no_sidecar["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .retain(|c| {
            !c["name"]
                .as_str()
                .unwrap()
                .starts_with("kvevent-subscriber")
        });
    let derived = derive_plans(
        &[serde_json::from_value(no_sidecar).unwrap()],
        std::slice::from_ref(&edited),
    );
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].model,
        "deepseek-ai/DeepSeek-V3"
    );
    let issue = derived
        .issues
        .iter()
        .find(|i| i.reason == "WiredUnderOlderSpec")
        .unwrap_or_else(|| panic!("{:?}", derived.issues));
    assert!(!issue.message.contains("modelID"), "{}", issue.message);
    // The same capacity written another way is no change.
    let mut same = cb.clone();
    same.spec.lm_cache =
        Some(serde_json::from_value(json!({"hostMemory": {"capacity": "4096Mi"}})).unwrap());
    let derived = derive_plans(
        std::slice::from_ref(&scheduled_pod),
        std::slice::from_ref(&same),
    );
    assert!(
        derived
            .issues
            .iter()
            .all(|i| !i.reason.starts_with("Wired")),
        "{:?}",
        derived.issues
    );

    // The unedited backend: the record agrees, no issue.
    let derived = derive_plans(
        std::slice::from_ref(&scheduled_pod),
        std::slice::from_ref(&cb),
    );
    assert!(
        derived
            .issues
            .iter()
            .all(|i| !i.reason.starts_with("Wired")),
        "{:?}",
        derived.issues
    );
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].mp_worker_port,
        Some(5555)
    );

    // No record (a pod wired before it existed): the current spec.
    let mut unrecorded = scheduled.clone();
    unrecorded["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove("inferencecache.io/wired-spec");
    let derived = derive_plans(
        &[serde_json::from_value(unrecorded).unwrap()],
        std::slice::from_ref(&edited),
    );
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].mp_worker_port,
        Some(6000)
    );
    assert!(
        derived
            .issues
            .iter()
            .all(|i| !i.reason.starts_with("Wired")),
        "{:?}",
        derived.issues
    );

    // A record edited into nonsense: the current spec, and it says so.
    let mut garbled = scheduled;
    garbled["metadata"]["annotations"]["inferencecache.io/wired-spec"] =
        json!(record.replace("workerPort", "wp"));
    let derived = derive_plans(
        &[serde_json::from_value(garbled).unwrap()],
        std::slice::from_ref(&edited),
    );
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].mp_worker_port,
        Some(6000)
    );
    assert!(
        derived
            .issues
            .iter()
            .any(|i| i.reason == "WiredSpecUnreadable"),
        "{:?}",
        derived.issues
    );
}

/// The shm check judges the engine's `/dev/shm`: the plan names the engine container and the
/// MP worker the webhook mounted on the same volume, each with its runtime ID only while pod
/// status says it runs (the engine waits on the worker's startup probe; the sidecar's ID is what
/// its cgroup path carries).
#[test]
fn the_plan_names_the_containers_that_share_the_engines_dev_shm() {
    let pod = load_repo_pod(HOST_NET);
    let cb = backend(SGLANG_LMCACHE);
    let (outcome, wired) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
    let worker_id = "0b5c3e1f9a8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b";
    let engine_id = "9a8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b0b5c3e1f";
    let plan_for = |engine_state: Value| {
        let mut scheduled = wired.clone();
        scheduled["metadata"]["uid"] = json!("0f6e3f52-7d2a-4d0c-9b1e-30a000000002");
        scheduled["spec"]["nodeName"] = json!("gpu-node-1");
        scheduled["status"] = json!({"phase": "Running", "podIP": "10.0.0.9",
            "initContainerStatuses": [{"name": "lmcache-mp-worker", "image": "x", "imageID": "",
                "ready": true, "restartCount": 0, "started": true,
                "containerID": format!("containerd://{}", worker_id.to_uppercase()),
                "state": {"running": {"startedAt": "2026-12-03T10:00:00Z"}}}],
            "containerStatuses": [{"name": "sglang-container", "image": "x", "imageID": "",
                "ready": false, "restartCount": 1, "containerID": format!("containerd://{engine_id}"),
                "state": engine_state}]});
        let plans = derive_plans(
            &[serde_json::from_value(scheduled).unwrap()],
            std::slice::from_ref(&cb),
        );
        plans.plans["gpu-node-1"].engines[0].shm_containers.clone()
    };
    let names_ids = |v: Vec<ic_shared::plan::PlannedContainer>| {
        v.into_iter().map(|c| (c.name, c.id)).collect::<Vec<_>>()
    };
    assert_eq!(
        names_ids(plan_for(json!({"waiting": {"reason": "CrashLoopBackOff"}}))),
        vec![
            ("sglang-container".to_string(), None),
            ("lmcache-mp-worker".to_string(), Some(worker_id.to_string())),
        ]
    );
    assert_eq!(
        names_ids(plan_for(
            json!({"running": {"startedAt": "2026-12-03T10:00:05Z"}})
        )),
        vec![
            ("sglang-container".to_string(), Some(engine_id.to_string())),
            ("lmcache-mp-worker".to_string(), Some(worker_id.to_string())),
        ]
    );
}

#[test]
fn host_network_collisions_fail_open_with_reason_and_warning() {
    // The worker port is the engine's HTTP port (--port 8000): nothing can make both bind.
    let pod = load_repo_pod(HOST_NET);
    let mut cb = backend(SGLANG_LMCACHE);
    cb.spec.lm_cache = Some(ic_shared::crd::LmCacheSpec {
        worker_port: Some(8000),
        ..Default::default()
    });
    let outcome = admit(&pod, &[cb], &cfg());
    assert_eq!(
        outcome.reason,
        "CacheBackend default/sglang-lmcache: the LMCache MP worker would listen on port 8000, which is the engine's HTTP port (container \"sglang-container\"); set spec.lmCache.workerPort to a free port; pod admitted unwired"
    );
    assert_fail_open_marked(&pod, &outcome);
    assert!(outcome
        .warnings
        .iter()
        .any(|w| w.starts_with("pod admitted unwired: the LMCache MP worker")));

    // The engine declares the worker's port for one of its own listeners (llm-d's wide-EP pods
    // use 5555 for --data-parallel-rpc-port): refused whatever the network.
    let mut pod = load_repo_pod(HOST_NET);
    pod["spec"]["hostNetwork"] = json!(false);
    pod["spec"]["containers"][0]["ports"] = json!([{"containerPort": 5555, "name": "dp-rpc"}]);
    let outcome = admit(&pod, &[backend(SGLANG_LMCACHE)], &cfg());
    assert_eq!(
        outcome.reason,
        "CacheBackend default/sglang-lmcache: the LMCache MP worker would listen on port 5555, which is container \"sglang-container\" port dp-rpc; set spec.lmCache.workerPort to a free port; pod admitted unwired"
    );

    // Another container of the pod already declares the node port the subscriber would dial.
    let mut pod = load_repo_pod(HOST_NET);
    pod["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({
        "name": "zmq-exporter", "image": "example/exporter:1",
        "ports": [{"containerPort": 5557, "name": "zmq"}]}));
    let outcome = admit(&pod, &[backend(SGLANG_LMCACHE)], &cfg());
    // Offload still wires; only the subscriber fails open (its reason is a warning), and no
    // subscriber or host port for it is rendered.
    assert_eq!(outcome.reason, REASON_INJECTED);
    assert!(
        outcome.warnings.iter().any(|w| w.starts_with("the kvevent-subscriber is not added: port 5557 would be both container \"zmq-exporter\" port zmq and the KV-event publisher of data-parallel rank 0")),
        "{:?}",
        outcome.warnings
    );
    let wired = apply(&pod, &outcome);
    assert!(subscriber_names(&wired).is_empty());
    let ports = ports_of(container(&wired, "sglang-container"));
    assert_eq!(ports, vec![(5555, Some(5555), "ic-lmcache-mp".to_string())]);
}

// ---- 2. outward publishers, 3. PYTHONHASHSEED ---------------------------------------------

/// Field case (issue 39 item 1): the engine's own KV-event publisher binds the port the MP
/// worker would take (SGLang `--kv-events-config` on `tcp://*:5555`, nothing declared). The
/// subscriber's port check saw the collision and dropped only the subscriber; the worker was
/// still injected on 5555, so one of the two could never bind. The webhook must leave such a
/// pod unwired with the reason, with a subscriber image or without one, and for the replay port
/// too; a config that does not publish binds nothing and is wired.
#[test]
fn an_engine_kv_listener_on_the_worker_port_leaves_the_pod_unwired() {
    let with_events = |config: &str| {
        let mut pod = load_repo_pod(HOST_NET);
        pod["spec"]["hostNetwork"] = json!(false);
        edit_script(
            &mut pod,
            "sglang-container",
            "--enable-metrics",
            &format!("--enable-metrics --kv-events-config '{config}'"),
        );
        pod
    };
    let publisher = with_events(r#"{"publisher":"zmq","endpoint":"tcp://*:5555"}"#);
    for config in [cfg(), PodWebhookConfig::default()] {
        let outcome = admit(&publisher, &[backend(SGLANG_LMCACHE)], &config);
        assert_eq!(
            outcome.reason,
            "CacheBackend default/sglang-lmcache: the LMCache MP worker would listen on port 5555, which is the KV-event publisher of data-parallel rank 0 (container \"sglang-container\"); set spec.lmCache.workerPort to a free port; pod admitted unwired"
        );
        assert_fail_open_marked(&publisher, &outcome);
        assert!(outcome.warnings.iter().any(|w| w
            .starts_with("pod admitted unwired: the LMCache MP worker would listen on port 5555")));
        let out = apply(&publisher, &outcome);
        assert!(init_container(&out, "lmcache-mp-worker").is_none());
    }

    // The replay ROUTER always binds, whatever its host.
    let replay = with_events(
        r#"{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5555"}"#,
    );
    let outcome = admit(&replay, &[backend(SGLANG_LMCACHE)], &cfg());
    assert!(
        outcome.reason.contains("port 5555, which is the KV-event replay endpoint of data-parallel rank 0 (container \"sglang-container\")"),
        "{}",
        outcome.reason
    );
    assert_fail_open_marked(&replay, &outcome);

    // Moved to a free port, the same pod is wired: worker on 5600, publisher followed on 5555.
    let mut cb = backend(SGLANG_LMCACHE);
    cb.spec.lm_cache = Some(ic_shared::crd::LmCacheSpec {
        worker_port: Some(5600),
        ..Default::default()
    });
    let (outcome, wired) = admit_converged(&publisher, &[cb], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
    assert!(init_container(&wired, "lmcache-mp-worker").is_some());
    assert_eq!(
        subscriber_names(&wired),
        vec!["kvevent-subscriber".to_string()]
    );

    // A config that does not publish binds nothing: the worker keeps 5555.
    let silent = with_events(r#"{"publisher":"null","endpoint":"tcp://*:5555"}"#);
    let outcome = admit(
        &silent,
        &[backend(SGLANG_LMCACHE)],
        &PodWebhookConfig::default(),
    );
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
}

#[test]
fn outward_publisher_is_not_followed_and_never_rendered_literally() {
    // As published: the endpoint comes from the engine's shell (${NAMESPACE}).
    let pod = load_repo_pod(OUTWARD);
    let outcome = admit(&pod, &[backend(QWEN_EVENTS_ONLY)], &cfg());
    assert_eq!(
        outcome.reason,
        "CacheBackend llm-d-precise/qwen-routing: container \"vllm\": the KV-event endpoint \"tcp://gaie-kv-events-epp.${NAMESPACE}.svc.cluster.local:5557\" is expanded by the engine's shell at start-up; its value is unknown at admission (write it literally); pod admitted unwired"
    );
    assert_fail_open_marked(&pod, &outcome);
    assert_eq!(
        outcome.warnings.len(),
        1,
        "the fail-open's own: {:?}",
        outcome.warnings
    );

    // Written literally, the endpoint names the EPP Service: vLLM connects out to it.
    let mut literal = pod.clone();
    edit_script(&mut literal, "vllm", "${NAMESPACE}", "llm-d-precise");
    let outcome = admit(&literal, &[backend(QWEN_EVENTS_ONLY)], &cfg());
    assert!(
        outcome.reason.contains("the engine connects its KV-event publisher to \"tcp://gaie-kv-events-epp.llm-d-precise.svc.cluster.local:5557\""),
        "{}",
        outcome.reason
    );
    assert_fail_open_marked(&literal, &outcome);
}

#[test]
fn fixed_hash_seed_is_kept_and_offload_wires_without_a_subscriber() {
    // The NixlConnector is another KV connector (the adapter refuses to replace it); this case
    // is the same pod with that flag removed.
    let mut pod = load_repo_pod(OUTWARD);
    edit_script(
        &mut pod,
        "vllm",
        "--kv-transfer-config '{\"kv_connector\":\"NixlConnector\", \"kv_role\":\"kv_both\"}' \\\n",
        "",
    );
    let (outcome, wired) = admit_converged(&pod, &[backend(QWEN_LMCACHE)], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED);
    let c = container(&wired, "vllm");
    assert_eq!(env_value(c, "PYTHONHASHSEED").as_deref(), Some("42"));
    assert!(
        outcome.warnings.iter().any(|w| w.contains("PYTHONHASHSEED=42")
            && w.contains("llm-d's precise-prefix scorer")),
        "{:?}",
        outcome.warnings
    );
    assert!(subscriber_names(&wired).is_empty());
    assert!(outcome.warnings.iter().any(|w| w.starts_with(
        "the kvevent-subscriber is not added: container \"vllm\": the KV-event endpoint"
    )));
    // No rendered container carries a literal shell variable.
    for c in wired["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .chain(
            wired["spec"]["initContainers"]
                .as_array()
                .into_iter()
                .flatten(),
        )
        .filter(|c| c["name"] != "vllm")
    {
        assert!(!c.to_string().contains("${"), "{c}");
    }
}

// ---- 4. data parallelism -------------------------------------------------------------------

#[test]
fn one_subscriber_per_data_parallel_rank_with_its_replay_endpoint() {
    let pod = load_repo_pod(DP8);
    let (outcome, wired) = admit_converged(&pod, &[backend(GLM_LMCACHE)], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{:?}", outcome.warnings);
    let names = subscriber_names(&wired);
    assert_eq!(
        names,
        std::iter::once("kvevent-subscriber".to_string())
            .chain((1..8).map(|r| format!("kvevent-subscriber-{r}")))
            .collect::<Vec<_>>()
    );
    for (rank, name) in names.iter().enumerate() {
        let args = strings(&container(&wired, name)["args"]);
        assert!(
            args.contains(&format!("--endpoint=tcp://127.0.0.1:{}", 5557 + rank)),
            "{args:?}"
        );
        assert!(
            args.contains(&format!("--replay=tcp://127.0.0.1:{}", 5600 + rank)),
            "{args:?}"
        );
        assert_eq!(
            args.contains(&format!("--data-parallel-rank={rank}")),
            rank > 0,
            "{args:?}"
        );
    }
    // Not on the host network: no host ports declared.
    assert!(ports_of(container(&wired, "vllm"))
        .iter()
        .all(|(_, _, n)| !n.starts_with("ic-")));

    // Fewer ranks on re-admission: the extra subscribers go.
    let mut fewer = wired.clone();
    set_flag(&mut fewer, "--data-parallel-size", "2");
    set_flag(&mut fewer, "--data-parallel-size-local", "2");
    let (_, rewired) = admit_converged(&fewer, &[backend(GLM_LMCACHE)], &cfg());
    assert_eq!(
        subscriber_names(&rewired),
        vec!["kvevent-subscriber", "kvevent-subscriber-1"]
    );
}

#[test]
fn data_parallel_port_plans_are_checked() {
    // A replay port at publisher + 1 is rank 1's publisher port.
    let mut pod = load_repo_pod(DP8);
    set_flag(
        &mut pod,
        "--kv-events-config",
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#,
    );
    let (outcome, wired) = admit_converged(&pod, &[backend(GLM_LMCACHE)], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED);
    assert!(subscriber_names(&wired).is_empty());
    assert!(
        outcome.warnings.iter().any(|w| w.contains(
            "port 5558 would be both the KV-event replay endpoint of data-parallel rank 0 and the KV-event publisher of data-parallel rank 1"
        )),
        "{:?}",
        outcome.warnings
    );

    // tcp://*:0: vLLM binds an ephemeral port and advertises it only at run time.
    let mut pod = load_repo_pod(DP8);
    set_flag(
        &mut pod,
        "--kv-events-config",
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0"}"#,
    );
    let outcome = admit(&pod, &[backend(GLM_EVENTS_ONLY)], &cfg());
    assert_eq!(
        outcome.reason,
        "CacheBackend llm-d-wide-ep-precise/glm-routing: container \"vllm\": KV-event endpoint \"tcp://*:0\" asks for an ephemeral port, which vLLM picks and advertises only at run time (vllm-project/vllm#55844); give a fixed port; pod admitted unwired"
    );
    assert_fail_open_marked(&pod, &outcome);

    // On the host network every rank's publisher and replay port is declared; the routing
    // proxy's own 8000-8007 do not collide.
    let mut pod = load_repo_pod(DP8);
    pod["spec"]["hostNetwork"] = json!(true);
    let (outcome, wired) = admit_converged(&pod, &[backend(GLM_EVENTS_ONLY)], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{:?}", outcome.warnings);
    let declared: Vec<(i64, Option<i64>, String)> = ports_of(container(&wired, "vllm"))
        .into_iter()
        .filter(|(_, _, n)| n.starts_with("ic-"))
        .collect();
    assert_eq!(declared.len(), 16, "{declared:?}");
    for r in 0..8i64 {
        assert!(declared.contains(&(5557 + r, Some(5557 + r), format!("ic-kv-ev-{r}"))));
        assert!(declared.contains(&(5600 + r, Some(5600 + r), format!("ic-kv-rp-{r}"))));
    }
}

#[test]
fn a_publisher_that_connects_to_loopback_is_served_by_subscribers_that_bind() {
    // The same DP8 engine told to connect (vLLM connects any non-wildcard endpoint) to its
    // own loopback: each rank's subscriber binds port + rank.
    let mut pod = load_repo_pod(DP8);
    set_flag(
        &mut pod,
        "--kv-events-config",
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","replay_endpoint":"tcp://*:5600"}"#,
    );
    let (outcome, wired) = admit_converged(&pod, &[backend(GLM_EVENTS_ONLY)], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{:?}", outcome.warnings);
    let names = subscriber_names(&wired);
    assert_eq!(names.len(), 8);
    for (rank, name) in names.iter().enumerate() {
        let args = strings(&container(&wired, name)["args"]);
        assert_eq!(
            args[1],
            format!("--endpoint=tcp://127.0.0.1:{}", 5557 + rank)
        );
        assert_eq!(args[2], "--bind");
        assert_eq!(args[3], format!("--replay=tcp://127.0.0.1:{}", 5600 + rank));
    }
    // On the host network the subscribers' bound ports are the node's: declared.
    pod["spec"]["hostNetwork"] = json!(true);
    let (_, wired) = admit_converged(&pod, &[backend(GLM_EVENTS_ONLY)], &cfg());
    let declared: Vec<String> = ports_of(container(&wired, "vllm"))
        .into_iter()
        .map(|(_, _, n)| n)
        .filter(|n| n.starts_with("ic-kv-sub-"))
        .collect();
    assert_eq!(declared.len(), 8, "{declared:?}");
}

// ---- 5. other webhooks' additions ---------------------------------------------------------

/// What a secrets-injecting webhook (Vault Agent Injector's shape) adds to every container.
fn inject_vault(pod: &mut Value, list: &str, name: &str) {
    let c = pod["spec"][list]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {list} {name}"));
    let push = |c: &mut Value, key: &str, item: Value| match c[key].as_array_mut() {
        Some(a) => a.push(item),
        None => c[key] = json!([item]),
    };
    push(
        c,
        "env",
        json!({"name": "VAULT_ADDR", "value": "https://vault.vault.svc:8200"}),
    );
    push(
        c,
        "volumeMounts",
        json!({"name": "vault-secrets", "mountPath": "/vault/secrets"}),
    );
    c["resources"]["limits"] = json!({"memory": "128Mi"});
}

#[test]
fn readmission_keeps_other_webhooks_additions_to_our_sidecars() {
    let pod = load_repo_pod(HOST_NET);
    let cb = backend(SGLANG_LMCACHE);
    let (_, mut wired) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    inject_vault(&mut wired, "containers", "kvevent-subscriber");
    inject_vault(&mut wired, "initContainers", "lmcache-mp-worker");
    wired["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "vault-secrets", "emptyDir": {"medium": "Memory"}}));
    let again = admit(&wired, std::slice::from_ref(&cb), &cfg());
    assert_eq!(again.reason, REASON_INJECTED);
    assert_eq!(
        again.patch, None,
        "re-admission strips nothing: {:?}",
        again.patch
    );

    // A backend change converges the owned fields and still keeps the additions.
    let mut changed = cb.clone();
    changed.spec.lm_cache = Some(ic_shared::crd::LmCacheSpec {
        chunk_size_tokens: Some(512),
        ..Default::default()
    });
    let out = admit(&wired, &[changed], &cfg());
    let rewired = apply(&wired, &out);
    let w = init_container(&rewired, "lmcache-mp-worker").unwrap();
    assert!(strings(&w["args"])
        .windows(2)
        .any(|p| p == ["--chunk-size", "512"]));
    assert_eq!(
        env_value(w, "VAULT_ADDR").as_deref(),
        Some("https://vault.vault.svc:8200")
    );
    assert_eq!(w["resources"]["limits"]["memory"], "128Mi");
    let s = container(&rewired, "kvevent-subscriber");
    assert!(s["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["mountPath"] == "/vault/secrets"));
    assert_eq!(s["resources"]["requests"]["cpu"], "10m");

    // The kernel check (vLLM) too.
    let pod = load_repo_pod(DP8);
    let (_, mut wired) = admit_converged(&pod, &[backend(GLM_LMCACHE)], &cfg());
    inject_vault(&mut wired, "initContainers", "lmcache-kernel-check");
    let again = admit(&wired, &[backend(GLM_LMCACHE)], &cfg());
    assert_eq!(again.patch, None, "{:?}", again.patch);
}

// ---- 6. two matching backends -------------------------------------------------------------

#[test]
fn two_matching_backends_warn_and_a_new_backend_replaces_the_old_settings() {
    let pod = load_repo_pod(DP8);
    let a = backend(GLM_MOONCAKE);
    let b = backend(GLM_LMCACHE);
    let outcome = admit(&pod, &[b.clone(), a.clone()], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED);
    assert_eq!(
        outcome.warnings[0],
        "2 CacheBackends in namespace \"llm-d-wide-ep-precise\" select this pod (a-glm-mooncake, glm-lmcache); \"a-glm-mooncake\" wins by name order — narrow the others' engineSelector so exactly one selects it"
    );
    let by_a = apply(&pod, &outcome);
    let e = container(&by_a, "vllm");
    assert_eq!(
        env_value(e, "LMCACHE_REMOTE_URL").as_deref(),
        Some("mooncakestore://mooncake-master.kv-infra.svc:50051")
    );
    assert_eq!(env_value(e, "LMCACHE_CHUNK_SIZE").as_deref(), Some("512"));

    // Re-admitted when only the host-only backend selects it: A's settings do not survive.
    let (outcome, by_b) = admit_converged(&by_a, std::slice::from_ref(&b), &cfg());
    let e = container(&by_b, "vllm");
    assert_eq!(env_value(e, "LMCACHE_REMOTE_URL"), None);
    assert_eq!(env_value(e, "LMCACHE_REMOTE_SERDE"), None);
    assert_eq!(env_value(e, "LMCACHE_CHUNK_SIZE").as_deref(), Some("256"));
    assert_eq!(
        by_b["metadata"]["annotations"]["inferencecache.io/injected-by"],
        "llm-d-wide-ep-precise/glm-lmcache"
    );
    assert!(outcome.warnings.iter().any(
        |w| w.starts_with("the pod was wired by CacheBackend llm-d-wide-ep-precise/a-glm-mooncake")
    ));
}

// ---- 7. /dev/shm on a real shape ------------------------------------------------------------

#[test]
fn tensor_parallel_vllm_without_shm_is_warned() {
    let mut pod = load_repo_pod(DP8);
    set_flag(&mut pod, "--tensor-parallel-size", "2");
    pod["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("volumeMounts");
    let outcome = admit(&pod, &[backend(GLM_LMCACHE)], &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED);
    assert!(
        outcome.warnings.iter().any(|w| w
            .contains("runs tensor-parallel size 2 without a /dev/shm mount")
            && w.contains("production-stack#276")),
        "{:?}",
        outcome.warnings
    );
    // With its /dev/shm (as published): no such warning.
    let outcome = admit(&load_repo_pod(DP8), &[backend(GLM_LMCACHE)], &cfg());
    assert!(outcome.warnings.iter().all(|w| !w.contains("/dev/shm")));
}

// ---- 8. native sidecars --------------------------------------------------------------------

#[test]
fn native_sidecars_only_where_the_apiserver_runs_them() {
    let old = PodWebhookConfig {
        native_sidecars: NativeSidecars::from_version("1", "28", "v1.28.9"),
        ..cfg()
    };
    let outcome = admit(&load_repo_pod(HOST_NET), &[backend(SGLANG_LMCACHE)], &old);
    assert_eq!(
        outcome.reason,
        "CacheBackend default/sglang-lmcache: the wiring needs the native sidecar \"lmcache-mp-worker\" (an init container with restartPolicy: Always), which the apiserver (v1.28.9) does not run: native sidecars are on by default from Kubernetes 1.29; pod admitted unwired"
    );
    assert_fail_open_marked(&load_repo_pod(HOST_NET), &outcome);
    // vLLM renders no native sidecar (the routing proxy is the pod's own): wired.
    let outcome = admit(&load_repo_pod(DP8), &[backend(GLM_LMCACHE)], &old);
    assert_eq!(outcome.reason, REASON_INJECTED);
    // Versions: 1.29 and later (also "29+" minors) run them.
    assert_eq!(
        NativeSidecars::from_version("1", "29+", "v1.29.3-eks"),
        NativeSidecars::Supported
    );
    assert_eq!(
        NativeSidecars::from_version("1", "27", ""),
        NativeSidecars::Unsupported {
            version: "v1.27".into()
        }
    );
}

/// LMCache loads whole chunks, and the index credits an offload-only match in the chunk size
/// the running engine (vLLM) or MP worker (SGLang) was started with. That is the pod's own
/// wiring: a user's `LMCACHE_CHUNK_SIZE` on the vLLM container stands (the adapter only defaults
/// it), and a later `spec.lmCache.chunkSizeTokens` edit does not reach a running worker.
#[test]
fn offload_chunks_follow_the_chunk_size_the_pod_runs_with() {
    let schedule = |wired: &Value, uid: &str| -> k8s_openapi::api::core::v1::Pod {
        let mut scheduled = wired.clone();
        scheduled["metadata"]["uid"] = json!(uid);
        scheduled["spec"]["nodeName"] = json!("gpu-node-1");
        scheduled["status"] = json!({"phase": "Running", "podIP": "10.0.0.9",
            "conditions": [{"type": "Ready", "status": "True"}]});
        serde_json::from_value(scheduled).unwrap()
    };
    let chunk = |cb: ic_shared::crd::CacheBackend| {
        let mut cb = cb;
        cb.spec.lm_cache = Some(serde_json::from_value(json!({"chunkSizeTokens": 128})).unwrap());
        cb
    };

    // SGLang: the worker was rendered with the default 256; the backend now says 128.
    let cb = backend(SGLANG_LMCACHE);
    let (outcome, wired) =
        admit_converged(&load_repo_pod(HOST_NET), std::slice::from_ref(&cb), &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
    let worker_args = strings(&init_container(&wired, "lmcache-mp-worker").unwrap()["args"]);
    assert!(
        worker_args.windows(2).any(|w| w == ["--chunk-size", "256"]),
        "{worker_args:?}"
    );
    let pod = schedule(&wired, "0f6e3f52-7d2a-4d0c-9b1e-30a000000011");
    let derived = derive_plans(std::slice::from_ref(&pod), &[chunk(cb.clone())]);
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].offload_chunk_tokens,
        Some(256),
        "the running worker's --chunk-size, not the edited spec's 128"
    );
    // A pod without a rendered worker is planned from the current spec.
    let mut bare = wired.clone();
    bare["spec"]["initContainers"] = json!([]);
    let pod = schedule(&bare, "0f6e3f52-7d2a-4d0c-9b1e-30a000000012");
    let derived = derive_plans(std::slice::from_ref(&pod), &[chunk(cb)]);
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].offload_chunk_tokens,
        Some(128)
    );

    // vLLM: the user's own LMCACHE_CHUNK_SIZE=512 is kept by the webhook and planned.
    let mut pod = load_repo_pod(OUTWARD);
    edit_script(
        &mut pod,
        "vllm",
        "--kv-transfer-config '{\"kv_connector\":\"NixlConnector\", \"kv_role\":\"kv_both\"}' \\\n",
        "",
    );
    let vllm = pod["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "vllm")
        .unwrap();
    let own = json!({"name": "LMCACHE_CHUNK_SIZE", "value": "512"});
    match vllm["env"].as_array_mut() {
        Some(env) => env.push(own),
        None => vllm["env"] = json!([own]),
    }
    let cb = backend(QWEN_LMCACHE);
    let (outcome, wired) = admit_converged(&pod, std::slice::from_ref(&cb), &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{outcome:?}");
    assert_eq!(
        env_value(container(&wired, "vllm"), "LMCACHE_CHUNK_SIZE").as_deref(),
        Some("512")
    );
    let scheduled = schedule(&wired, "0f6e3f52-7d2a-4d0c-9b1e-30a000000013");
    let derived = derive_plans(std::slice::from_ref(&scheduled), std::slice::from_ref(&cb));
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].offload_chunk_tokens,
        Some(512)
    );
    // The same value from a Secret cannot be read: the spec's (default 256) is planned.
    let mut from_secret = wired.clone();
    let vllm = from_secret["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "vllm")
        .unwrap();
    for e in vllm["env"].as_array_mut().unwrap() {
        if e["name"] == "LMCACHE_CHUNK_SIZE" {
            *e = json!({"name": "LMCACHE_CHUNK_SIZE",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}});
        }
    }
    let scheduled = schedule(&from_secret, "0f6e3f52-7d2a-4d0c-9b1e-30a000000014");
    let derived = derive_plans(std::slice::from_ref(&scheduled), &[cb]);
    assert_eq!(
        derived.plans["gpu-node-1"].engines[0].offload_chunk_tokens,
        Some(256)
    );
    // The kvevent-subscriber sidecars of an offload pod carry the same chunk size on their
    // streams (`--offload-chunk-tokens`), here the spec's 512 the adapter rendered.
    let mut glm = backend(GLM_LMCACHE);
    glm.spec.lm_cache = Some(serde_json::from_value(json!({"chunkSizeTokens": 512})).unwrap());
    let (outcome, wired) = admit_converged(&load_repo_pod(DP8), std::slice::from_ref(&glm), &cfg());
    assert_eq!(outcome.reason, REASON_INJECTED, "{:?}", outcome.warnings);
    let names = subscriber_names(&wired);
    assert_eq!(names.len(), 8);
    for name in &names {
        let args = strings(&container(&wired, name)["args"]);
        assert!(
            args.contains(&"--offload-chunk-tokens=512".to_string()),
            "{name}: {args:?}"
        );
    }
    // An events-only pod has no offload tier: no chunk flag.
    let (_, wired) = admit_converged(&load_repo_pod(DP8), &[backend(GLM_EVENTS_ONLY)], &cfg());
    let names = subscriber_names(&wired);
    assert!(!names.is_empty());
    for name in &names {
        let args = strings(&container(&wired, name)["args"]);
        assert!(
            !args.iter().any(|a| a.starts_with("--offload-chunk-tokens")),
            "{args:?}"
        );
    }
}
