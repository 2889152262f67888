//! Node plans from real-world engine pods (`testdata/pods/`), wired by CacheBackends:
//! KV endpoints and DP ranks, block sizes, MP-worker ports, required shm, hostNetwork ports,
//! Mooncake master placement, and what cannot be planned.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ic_controller::engine::TENSOR_PARALLEL_SHM_BYTES;
use ic_controller::reconcile::nodes::plans::{self, derive_plans, issue};
use ic_shared::crd::CacheBackend;
use ic_shared::plan::{HashScheme, KvEventSource, NodePlan, PortExpect};
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodStatus};
use serde_json::json;

/// A real engine pod of `testdata/pods`.
fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/pods")
        .join(name)
}

fn fixture(name: &str) -> Pod {
    let text = std::fs::read_to_string(fixture_path(name)).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

fn backend(ns: &str, name: &str, spec: serde_json::Value) -> CacheBackend {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"), "generation": 1},
        "spec": spec,
    }))
    .unwrap()
}

/// Schedules `pod` on `node` with `ip`, marks it wired by `ns/backend` (with the backend's
/// UID) and sets its phase (and Ready when Running).
fn wire(mut pod: Pod, node: &str, ip: &str, backend: &str, phase: &str) -> Pod {
    let ns = pod.metadata.namespace.clone().unwrap();
    pod.metadata.uid = Some(format!("pod-uid-{}", pod.metadata.name.clone().unwrap()));
    let ann = pod
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    ann.insert(
        "inferencecache.io/injected-by".into(),
        format!("{ns}/{backend}"),
    );
    ann.insert(
        "inferencecache.io/injected-by-uid".into(),
        format!("uid-{backend}"),
    );
    pod.spec.as_mut().unwrap().node_name = Some(node.into());
    pod.status = Some(PodStatus {
        phase: Some(phase.into()),
        pod_ip: Some(ip.into()),
        conditions: (phase == "Running").then(|| {
            vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]
        }),
        ..Default::default()
    });
    pod
}

fn src(endpoint: &str, replay: Option<&str>, topic: &str, rank: u32) -> KvEventSource {
    KvEventSource {
        endpoint: endpoint.into(),
        replay_endpoint: replay.map(str::to_string),
        topic: topic.into(),
        dp_rank: rank,
    }
}

/// vLLM + LMCache from the production-stack chart (`command` form), with KV events on and two
/// data-parallel ranks.
fn vllm_pod() -> Pod {
    let mut pod = fixture("03-prodstack-helm-lmcache-cpu-offload.yaml");
    let c = &mut pod.spec.as_mut().unwrap().containers[0];
    let cmd = c.command.as_mut().unwrap();
    cmd.extend([
        "--kv-events-config".to_string(),
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5600","topic":"kv"}"#.to_string(),
        "--data-parallel-size".to_string(),
        "2".to_string(),
    ]);
    wire(pod, "gpu-1", "10.1.2.3", "cb-vllm", "Running")
}

fn vllm_backend() -> CacheBackend {
    backend(
        "default",
        "cb-vllm",
        json!({"runtime": "VLLM", "observation": {"modelID": "mistralai/Mistral-7B-Instruct-v0.2"}}),
    )
}

/// SGLang from llm-d (`sh -c '… exec python3 -m sglang.launch_server "$@"' --` + args), tensor
/// parallel 2, page size 64, on the host network, with the SGLang+LMCache MP worker.
fn sglang_hostnet_pod() -> Pod {
    let mut pod = fixture("13-llmd-sglang-mooncake-sh-c-dashdash-args.yaml");
    let spec = pod.spec.as_mut().unwrap();
    spec.host_network = Some(true);
    spec.containers[0].args.as_mut().unwrap().push(
        r#"--kv-events-config={"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}"#
            .into(),
    );
    wire(pod, "gpu-2", "192.168.1.10", "cb-sglang", "Running")
}

fn sglang_backend() -> CacheBackend {
    backend(
        "llm-d-tiered-prefix-cache",
        "cb-sglang",
        json!({
            "runtime": "SGLang",
            "lmCache": {"hostMemory": {"capacity": "8Gi"}, "workerPort": 6000},
            "observation": {"modelID": "Qwen/Qwen3-32B"},
            "integration": {"engineHostNetwork": true},
        }),
    )
}

#[test]
fn vllm_engine_gets_one_publisher_per_dp_rank_at_the_pod_ip() {
    let derived = derive_plans(&[vllm_pod()], &[vllm_backend()]);
    let plan = &derived.plans["gpu-1"];
    assert!(plan.gpu_node, "the pod requests nvidia.com/gpu");
    assert!(plan.ports.is_empty(), "not on the host network");
    assert!(plan.shm.is_none());
    let e = &plan.engines[0];
    assert_eq!(e.namespace, "default");
    assert_eq!(e.pod, "vllm-mistral-deployment-vllm-5c9d7f8b6-h7kzp");
    assert_eq!(
        e.pod_uid.as_deref(),
        Some("pod-uid-vllm-mistral-deployment-vllm-5c9d7f8b6-h7kzp")
    );
    assert_eq!(e.model, "mistralai/Mistral-7B-Instruct-v0.2");
    assert_eq!(e.backend, "default/cb-vllm");
    assert_eq!(e.hash_scheme, HashScheme::Vllm);
    assert_eq!(e.block_size, 16);
    assert!(e.keeps_l2, "Offload (the default mode) keeps an L2");
    assert_eq!(
        (e.offload_chunk_tokens, e.descriptor(1).offload_chunk_tokens),
        (Some(256), 256),
        "LMCache loads whole chunks of spec.lmCache.chunkSizeTokens (256 by default)"
    );
    assert_eq!(e.mp_worker_port, None);
    assert_eq!(e.shm_required_bytes, None);
    assert_eq!(
        e.kv_events,
        vec![
            src("tcp://10.1.2.3:5557", Some("tcp://10.1.2.3:5600"), "kv", 0),
            src("tcp://10.1.2.3:5558", Some("tcp://10.1.2.3:5601"), "kv", 1),
        ]
    );
    assert!(derived.issues.is_empty(), "{:?}", derived.issues);
}

#[test]
fn sglang_mp_worker_host_network_pod_plans_shm_worker_port_and_host_ports() {
    let derived = derive_plans(&[sglang_hostnet_pod()], &[sglang_backend()]);
    let plan = &derived.plans["gpu-2"];
    let e = &plan.engines[0];
    assert_eq!(e.hash_scheme, HashScheme::Sglang);
    assert_eq!(e.block_size, 64, "--page-size=64");
    assert_eq!(e.mp_worker_port, Some(6000));
    assert_eq!(
        e.offload_chunk_tokens,
        Some(256),
        "the MP worker's --chunk-size"
    );
    assert_eq!(
        e.shm_required_bytes,
        Some(8 << 30),
        "the MP worker's L1 (8Gi) exceeds the TP minimum"
    );
    assert_eq!(
        e.kv_events,
        vec![src("tcp://192.168.1.10:5557", None, "kv-events", 0)]
    );
    // Ready hostNetwork pod: its KV-event and MP-worker ports must be held by the pod.
    let ports: Vec<(u16, PortExpect, Option<String>)> = plan
        .ports
        .iter()
        .map(|p| {
            (
                p.port,
                p.expect,
                p.owner.as_ref().and_then(|o| o.pod_uid.clone()),
            )
        })
        .collect();
    let uid = Some("pod-uid-tiered-prefix-cache-gpu-sglang-decode-6c7d8f9b5-zx4hw".to_string());
    assert_eq!(
        ports,
        vec![
            (5557, PortExpect::Held, uid.clone()),
            (6000, PortExpect::Held, uid)
        ]
    );
    assert!(plan.ports[1].purpose.contains("MP worker"));
    // The pod does not use the host IPC namespace: no node-level shm requirement.
    assert!(plan.shm.is_none());
}

#[test]
fn tensor_parallel_needs_shm_and_a_missing_model_id_gates_kv_events() {
    // The vLLM docs pod runs `vllm serve` inside `sh -c`.
    let mut pod = fixture("01-vllm-docs-nvidia-sh-c.yaml");
    let c = &mut pod.spec.as_mut().unwrap().containers[0];
    let script = &mut c.args.as_mut().unwrap()[0];
    script.push_str(r#" --tensor-parallel-size 2 --block-size 32 --kv-events-config '{"enable_kv_cache_events":true}'"#);
    let pod = wire(pod, "gpu-3", "10.9.9.9", "cb-plain", "Running");
    let cb = backend("default", "cb-plain", json!({"runtime": "VLLM"}));
    let derived = derive_plans(&[pod], &[cb]);
    let e = &derived.plans["gpu-3"].engines[0];
    assert_eq!(e.shm_required_bytes, Some(TENSOR_PARALLEL_SHM_BYTES));
    assert_eq!(e.block_size, 32);
    assert!(e.kv_events.is_empty());
    assert_eq!(e.model, "");
    assert_eq!(derived.issues.len(), 1);
    assert_eq!(derived.issues[0].reason, issue::NO_MODEL_ID);
}

#[test]
fn a_block_size_that_is_no_literal_number_is_a_plan_issue_not_a_silent_default() {
    // `sh -c "vllm serve … --block-size $BLOCK_SIZE"`: the shell sets it, nobody before it knows.
    let mut pod = fixture("01-vllm-docs-nvidia-sh-c.yaml");
    let script = &mut pod.spec.as_mut().unwrap().containers[0]
        .args
        .as_mut()
        .unwrap()[0];
    script.push_str(
        r#" --block-size $BLOCK_SIZE --kv-events-config '{"enable_kv_cache_events":true}'"#,
    );
    let pod = wire(pod, "gpu-3", "10.9.9.9", "cb-opaque", "Running");
    let cb = backend(
        "default",
        "cb-opaque",
        json!({"runtime": "VLLM", "observation": {"modelID": "m"}}),
    );
    let derived = derive_plans(&[pod], std::slice::from_ref(&cb));
    let e = &derived.plans["gpu-3"].engines[0];
    assert_eq!(e.block_size, 16, "vLLM's default is assumed");
    let reasons: Vec<&str> = derived.issues.iter().map(|i| i.reason).collect();
    assert_eq!(reasons, [issue::BLOCK_SIZE_UNKNOWN], "{:?}", derived.issues);
    let msg = &derived.issues[0].message;
    assert!(
        msg.contains("--block-size") && msg.contains("$BLOCK_SIZE") && msg.contains("16"),
        "{msg}"
    );

    // SGLang's `--page-size $(PAGE_SIZE)` in container args (Kubernetes expands it at start).
    let mut pod = sglang_hostnet_pod();
    let args = pod.spec.as_mut().unwrap().containers[0]
        .args
        .as_mut()
        .unwrap();
    args.push("--page-size".into());
    args.push("$(PAGE_SIZE)".into());
    let derived = derive_plans(&[pod], &[sglang_backend()]);
    let e = &derived.plans["gpu-2"].engines[0];
    assert_eq!(e.block_size, 1, "SGLang's default page size is assumed");
    assert!(
        derived
            .issues
            .iter()
            .any(|i| i.reason == issue::BLOCK_SIZE_UNKNOWN && i.message.contains("--page-size")),
        "{:?}",
        derived.issues
    );

    // Without KV events the block size plans nothing: no issue for it.
    let mut pod = fixture("01-vllm-docs-nvidia-sh-c.yaml");
    pod.spec.as_mut().unwrap().containers[0]
        .args
        .as_mut()
        .unwrap()[0]
        .push_str(" --block-size $BLOCK_SIZE");
    let pod = wire(pod, "gpu-3", "10.9.9.9", "cb-opaque", "Running");
    let derived = derive_plans(&[pod], std::slice::from_ref(&cb));
    let reasons: Vec<&str> = derived.issues.iter().map(|i| i.reason).collect();
    assert_eq!(reasons, [issue::KV_EVENTS_DISABLED], "{:?}", derived.issues);

    // A literal value plans as given and raises nothing.
    let mut pod = fixture("01-vllm-docs-nvidia-sh-c.yaml");
    let script = &mut pod.spec.as_mut().unwrap().containers[0]
        .args
        .as_mut()
        .unwrap()[0];
    script.push_str(r#" --block-size 32 --kv-events-config '{"enable_kv_cache_events":true}'"#);
    let pod = wire(pod, "gpu-3", "10.9.9.9", "cb-opaque", "Running");
    let derived = derive_plans(&[pod], &[cb]);
    assert_eq!(derived.plans["gpu-3"].engines[0].block_size, 32);
    assert!(
        derived
            .issues
            .iter()
            .all(|i| i.reason != issue::BLOCK_SIZE_UNKNOWN),
        "{:?}",
        derived.issues
    );
}

#[test]
fn engine_container_is_found_beside_a_main_container_and_events_only_keeps_no_l2() {
    let pod = wire(
        fixture("22-dynamo-sglang-smg-two-containers-engine-not-main.yaml"),
        "gpu-4",
        "10.4.4.4",
        "cb-events",
        "Running",
    );
    let cb = backend(
        "dynamo",
        "cb-events",
        json!({"runtime": "SGLang", "integration": {"mode": "EventsOnly"}, "observation": {"modelID": "Qwen/Qwen3-0.6B"}}),
    );
    let container =
        ic_controller::engine::container::EnginePod::read(&pod, ic_shared::crd::Runtime::SgLang)
            .unwrap()
            .container;
    assert_eq!(container.name, "sglang-engine");
    let derived = derive_plans(&[pod], &[cb]);
    let e = &derived.plans["gpu-4"].engines[0];
    assert!(!e.keeps_l2, "events-only has no L2: BlockRemoved evicts");
    assert_eq!(
        e.offload_chunk_tokens, None,
        "events-only has no offload tier"
    );
    assert_eq!(e.mp_worker_port, None, "events-only wires no MP worker");
    assert_eq!(e.block_size, 1, "SGLang's default page size");
    assert!(e.kv_events.is_empty());
    assert_eq!(derived.issues.len(), 1);
    assert_eq!(derived.issues[0].reason, issue::KV_EVENTS_DISABLED);
    assert!(derived.issues[0].message.contains("--kv-events-config"));
}

/// The plan reads the container the webhook wired, by the webhook's rule: the production-stack
/// engine made args-only (the image's entrypoint runs vLLM, as KServe's `kserve-container`
/// does) behind an args-only `istio-proxy` that Istio's `holdApplicationUntilProxyStarts`
/// puts first. Before, the plan read the proxy's args: "no --kv-events-config", block size 16.
#[test]
fn the_plan_reads_the_engine_the_webhook_picks_not_a_sidecar_listed_first() {
    let mut pod = vllm_pod();
    let spec = pod.spec.as_mut().unwrap();
    let engine = &mut spec.containers[0];
    let cmd = engine.command.take().unwrap();
    // `/opt/venv/bin/vllm serve MODEL …` → the image entrypoint is `vllm serve`; args: MODEL …
    let mut args: Vec<String> = cmd[2..].to_vec();
    args.extend(["--block-size".to_string(), "32".to_string()]);
    engine.args = Some(args);
    engine.name = "kserve-container".into();
    let proxy: k8s_openapi::api::core::v1::Container = serde_json::from_value(json!({
        "name": "istio-proxy",
        "image": "docker.io/istio/proxyv2:1.24.0",
        "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local"],
    }))
    .unwrap();
    spec.containers.insert(0, proxy);
    let derived = derive_plans(&[pod], &[vllm_backend()]);
    let e = &derived.plans["gpu-1"].engines[0];
    assert_eq!(e.block_size, 32, "{:?}", derived.issues);
    assert_eq!(e.kv_events.len(), 2, "{:?}", derived.issues);
    assert_eq!(e.shm_containers[0].name, "kserve-container");
    assert!(
        derived.issues.is_empty(),
        "no false KV-events-disabled issue: {:?}",
        derived.issues
    );
}

fn mooncake_master(phase: &str) -> Pod {
    let mut pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "cb-mc-mooncake-master-7d9f-abcde",
            "namespace": "default",
            "uid": "master-uid",
            "labels": {
                "app.kubernetes.io/name": "mooncake-master",
                "app.kubernetes.io/managed-by": "inference-cache",
                "inferencecache.io/cachebackend": "cb-mc",
            },
        },
        "spec": {
            "hostNetwork": true,
            "nodeName": "cpu-1",
            "containers": [{"name": "mooncake-master", "image": "docker.io/kvcacheai/mooncake:0.3.11.post1"}],
        },
    }))
    .unwrap();
    pod.status = Some(PodStatus {
        phase: Some(phase.into()),
        conditions: (phase == "Running").then(|| {
            vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]
        }),
        ..Default::default()
    });
    pod
}

#[test]
fn mooncake_master_placement_reserves_its_host_ports() {
    let derived = derive_plans(&[mooncake_master("Pending")], &[]);
    let plan = &derived.plans["cpu-1"];
    assert!(plan.engines.is_empty());
    let ports: Vec<(u16, PortExpect)> = plan.ports.iter().map(|p| (p.port, p.expect)).collect();
    assert_eq!(
        ports,
        vec![
            (8080, PortExpect::Free),
            (9003, PortExpect::Free),
            (50051, PortExpect::Free)
        ],
        "a scheduled master that has not started needs its ports free"
    );
    assert!(
        plan.ports
            .iter()
            .all(|p| p.owner.as_ref().and_then(|o| o.pod_uid.as_deref()) == Some("master-uid")),
        "free for that pod: its own early listeners (a native sidecar) are no conflict"
    );
    let derived = derive_plans(&[mooncake_master("Running")], &[]);
    let plan = &derived.plans["cpu-1"];
    assert!(plan.ports.iter().all(|p| p.expect == PortExpect::Held
        && p.owner.as_ref().and_then(|o| o.pod_uid.as_deref()) == Some("master-uid")));
    assert!(plan
        .ports
        .iter()
        .any(|p| p.port == 50051 && p.purpose.contains("RPC")));
    // A started but not yet Ready master is not judged.
    let mut starting = mooncake_master("Running");
    starting.status.as_mut().unwrap().conditions = None;
    assert!(derive_plans(&[starting], &[]).plans["cpu-1"]
        .ports
        .is_empty());
}

#[test]
fn unwired_stale_orphaned_and_finished_pods_are_not_planned() {
    let unwired = {
        let mut p = fixture("06-gaie-vllm-lora-syncer-native-sidecar.yaml");
        p.spec.as_mut().unwrap().node_name = Some("gpu-5".into());
        p
    };
    let stale = {
        let mut p = vllm_pod();
        p.metadata.name = Some("stale".into());
        p.metadata.annotations.as_mut().unwrap().insert(
            "inferencecache.io/injected-by-uid".into(),
            "uid-of-an-older-cb".into(),
        );
        p
    };
    let orphan = {
        let mut p = vllm_pod();
        p.metadata.name = Some("orphan".into());
        p.metadata.annotations.as_mut().unwrap().insert(
            "inferencecache.io/injected-by".into(),
            "default/gone".into(),
        );
        p
    };
    let finished = {
        let mut p = vllm_pod();
        p.metadata.name = Some("done".into());
        p.status.as_mut().unwrap().phase = Some("Succeeded".into());
        p
    };
    let unscheduled = {
        let mut p = vllm_pod();
        p.metadata.name = Some("pending".into());
        p.spec.as_mut().unwrap().node_name = None;
        p
    };
    let derived = derive_plans(
        &[unwired, stale, orphan, finished, unscheduled],
        &[vllm_backend()],
    );
    assert!(derived.plans.is_empty(), "{:?}", derived.plans);
    let mut reasons: Vec<&str> = derived.issues.iter().map(|i| i.reason).collect();
    reasons.sort();
    assert_eq!(
        reasons,
        vec![issue::BACKEND_NOT_FOUND, issue::STALE_INJECTION]
    );
}

#[test]
fn host_ipc_pods_set_the_node_shm_and_host_port_conflicts_are_reported() {
    let mut a = sglang_hostnet_pod();
    a.spec.as_mut().unwrap().host_ipc = Some(true);
    let mut b = sglang_hostnet_pod();
    b.metadata.name = Some("second-replica".into());
    b.metadata.uid = Some("uid-b".into());
    let derived = derive_plans(&[a, b], &[sglang_backend()]);
    let plan = &derived.plans["gpu-2"];
    assert_eq!(plan.shm.as_ref().unwrap().required_bytes, 8 << 30);
    assert_eq!(plan.engines.len(), 2);
    // Both replicas want 5557 and 6000 on one host: the second is reported, not planned twice.
    assert_eq!(plan.ports.len(), 2);
    let conflicts: Vec<_> = derived
        .issues
        .iter()
        .filter(|i| i.reason == issue::HOST_PORT_CONFLICT)
        .collect();
    assert_eq!(conflicts.len(), 2);
    assert!(conflicts[0].message.contains("also claimed by"));
}

#[test]
fn plans_are_deterministic_and_readable_by_the_agent() {
    let pods = vec![sglang_hostnet_pod(), vllm_pod(), mooncake_master("Pending")];
    let backends = vec![vllm_backend(), sglang_backend()];
    let a = derive_plans(&pods, &backends);
    let mut reversed = pods.clone();
    reversed.reverse();
    let b = derive_plans(&reversed, &backends);
    assert_eq!(a, b);
    assert_eq!(
        a.plans.keys().collect::<Vec<_>>(),
        vec!["cpu-1", "gpu-1", "gpu-2"]
    );
    // What the controller sends is what `ic-agent` parses (unknown fields are rejected there).
    for plan in a.plans.values() {
        let json = serde_json::to_string(plan).unwrap();
        assert_eq!(&NodePlan::parse(&json, "test").unwrap(), plan);
    }
    let by_node: BTreeMap<_, _> = a.backends_by_node();
    assert_eq!(
        by_node["gpu-2"].iter().cloned().collect::<Vec<_>>(),
        vec!["llm-d-tiered-prefix-cache/cb-sglang".to_string()]
    );
    assert!(!by_node.contains_key("cpu-1"));
}

// ---------------------------------------------------------------------------------------------
// Engine metrics URL (tier-2 counters; spec 000 `indexParticipation.t2HitRate`)
// ---------------------------------------------------------------------------------------------

/// The vLLM docs pod (`sh -c "vllm serve …"`, no `--port`) with KV events on and `extra`
/// appended to its script, wired by an Offload (or `mode`) backend with a model id.
fn vllm_sh_c(extra: &str, mode: &str) -> Option<String> {
    let mut pod = fixture("01-vllm-docs-nvidia-sh-c.yaml");
    let c = &mut pod.spec.as_mut().unwrap().containers[0];
    let script = &mut c.args.as_mut().unwrap()[0];
    script.push_str(r#" --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq"}'"#);
    script.push_str(extra);
    let pod = wire(pod, "gpu-3", "10.9.9.9", "cb-sh", "Running");
    let cb = backend(
        "default",
        "cb-sh",
        json!({"runtime": "VLLM", "integration": {"mode": mode}, "observation": {"modelID": "m"}}),
    );
    let derived = derive_plans(&[pod], &[cb]);
    let e = &derived.plans["gpu-3"].engines[0];
    assert_eq!(e.kv_events.len(), 1, "{:?}", derived.issues);
    e.metrics_url.clone()
}

#[test]
fn vllm_metrics_url_follows_port_in_every_spelling_with_default_8000() {
    // production-stack `command: [vllm, serve, …, --host, 0.0.0.0, --port, "8000"]`
    let derived = derive_plans(&[vllm_pod()], &[vllm_backend()]);
    assert_eq!(
        derived.plans["gpu-1"].engines[0].metrics_url.as_deref(),
        Some("http://10.1.2.3:8000/metrics"),
        "one URL for both DP ranks: one API server serves every engine of the pod"
    );
    assert_eq!(
        vllm_sh_c("", "Offload").as_deref(),
        Some("http://10.9.9.9:8000/metrics"),
        "vLLM's default --port"
    );
    assert_eq!(
        vllm_sh_c(" --port 8001", "Offload").as_deref(),
        Some("http://10.9.9.9:8001/metrics")
    );
    assert_eq!(
        vllm_sh_c(" --port=8002 --host 0.0.0.0", "Offload").as_deref(),
        Some("http://10.9.9.9:8002/metrics")
    );
    assert_eq!(
        vllm_sh_c(" --port \"$PORT\"", "Offload"),
        None,
        "an unknown port plans nothing rather than a wrong one"
    );
    assert_eq!(
        vllm_sh_c(" --host 127.0.0.1", "Offload"),
        None,
        "the agent cannot reach a pod's loopback"
    );
    assert_eq!(
        vllm_sh_c(" --port 8001", "EventsOnly"),
        None,
        "events-only has no tier 2"
    );
}

#[test]
fn sglang_metrics_url_needs_enable_metrics_and_defaults_to_port_30000() {
    // llm-d SGLang (`--host=0.0.0.0 --port=8000 --enable-metrics`) on the host network.
    let derived = derive_plans(&[sglang_hostnet_pod()], &[sglang_backend()]);
    assert_eq!(
        derived.plans["gpu-2"].engines[0].metrics_url.as_deref(),
        Some("http://192.168.1.10:8000/metrics")
    );
    let variant = |drop: &[&str], host_network: bool| {
        let mut pod = sglang_hostnet_pod();
        let spec = pod.spec.as_mut().unwrap();
        spec.host_network = Some(host_network);
        spec.containers[0]
            .args
            .as_mut()
            .unwrap()
            .retain(|a| !drop.contains(&a.as_str()));
        let derived = derive_plans(&[pod], &[sglang_backend()]);
        derived.plans["gpu-2"].engines[0].metrics_url.clone()
    };
    assert_eq!(
        variant(&["--port=8000"], false).as_deref(),
        Some("http://192.168.1.10:30000/metrics"),
        "SGLang's default --port"
    );
    assert_eq!(
        variant(&["--enable-metrics"], false),
        None,
        "SGLang serves /metrics only with --enable-metrics"
    );
    assert_eq!(
        variant(&["--host=0.0.0.0", "--port=8000"], false),
        None,
        "SGLang binds 127.0.0.1 by default: unreachable from the agent"
    );
    assert_eq!(
        variant(&["--host=0.0.0.0", "--port=8000"], true).as_deref(),
        Some("http://127.0.0.1:30000/metrics"),
        "on the host network the node's loopback is the engine's"
    );
}

/// Issue 19 item 4: the engines of an `(SGLang, SGLangHiCache)` backend are scraped too — the
/// host-tier counters of `HiCacheHostTier` come from the same `/metrics`, which needs
/// `--enable-metrics` there as well.
#[test]
fn a_hicache_backend_plans_the_metrics_url() {
    let hicache = backend(
        "llm-d-tiered-prefix-cache",
        "cb-sglang",
        json!({
            "runtime": "SGLang",
            "type": "SGLangHiCache",
            "hiCache": {"ratio": "2.0"},
            "observation": {"modelID": "Qwen/Qwen3-32B"},
            "integration": {"engineHostNetwork": true},
        }),
    );
    let derived = derive_plans(&[sglang_hostnet_pod()], std::slice::from_ref(&hicache));
    let e = &derived.plans["gpu-2"].engines[0];
    assert_eq!(
        e.metrics_url.as_deref(),
        Some("http://192.168.1.10:8000/metrics")
    );
    assert!(!e.kv_events.is_empty());
    assert_eq!(e.mp_worker_port, None, "HiCache runs no LMCache MP worker");
    assert_eq!(
        e.offload_chunk_tokens, None,
        "HiCache's host pool is page-granular"
    );
    let mut pod = sglang_hostnet_pod();
    pod.spec.as_mut().unwrap().containers[0]
        .args
        .as_mut()
        .unwrap()
        .retain(|a| a != "--enable-metrics");
    let derived = derive_plans(&[pod], &[hicache]);
    assert_eq!(derived.plans["gpu-2"].engines[0].metrics_url, None);
}

#[test]
fn the_metrics_url_reaches_the_agent() {
    let derived = derive_plans(&[vllm_pod()], &[vllm_backend()]);
    let json = serde_json::to_value(&derived.plans["gpu-1"]).unwrap();
    assert_eq!(
        json["engines"][0]["metricsUrl"],
        "http://10.1.2.3:8000/metrics"
    );
    let back = NodePlan::parse(&json.to_string(), "test").unwrap();
    assert_eq!(&back, &derived.plans["gpu-1"]);
}

/// One data-parallel rank per pod, its rank taken from the pod (a LeaderWorkerSet worker
/// index, a StatefulSet pod index) through an env `fieldRef`: the plan resolves it the way the
/// kubelet does and subscribes that rank only — not every rank of `--data-parallel-size`,
/// whose other publishers this pod does not run. A rank it cannot resolve is a plan issue
/// naming the flag, not a silent guess.
#[test]
fn a_data_parallel_rank_from_the_pods_own_labels_is_resolved_and_an_unknown_one_is_an_issue() {
    let with_rank = |rank_arg: &str, env: serde_json::Value, label: Option<&str>| {
        let mut pod = vllm_pod();
        let c = &mut pod.spec.as_mut().unwrap().containers[0];
        let cmd = c.command.as_mut().unwrap();
        let at = cmd
            .iter()
            .position(|a| a == "--data-parallel-size")
            .unwrap();
        cmd[at + 1] = "4".into();
        cmd.extend(["--data-parallel-rank".to_string(), rank_arg.to_string()]);
        c.env
            .get_or_insert_with(Vec::new)
            .push(serde_json::from_value(env).unwrap());
        if let Some(l) = label {
            pod.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert("leaderworkerset.sigs.k8s.io/worker-index".into(), l.into());
        }
        derive_plans(&[pod], &[vllm_backend()])
    };
    let lws_index = json!({"name": "DP_RANK", "valueFrom": {"fieldRef":
        {"fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}}});
    let ranks = |d: &plans::DerivedPlans| {
        d.plans["gpu-1"].engines[0]
            .kv_events
            .iter()
            .map(|s| (s.dp_rank, s.endpoint.clone()))
            .collect::<Vec<_>>()
    };

    // Resolved from the pod's label: rank 3 only, at port 5557 + 3.
    let d = with_rank("$(DP_RANK)", lws_index.clone(), Some("3"));
    assert_eq!(ranks(&d), vec![(3, "tcp://10.1.2.3:5560".to_string())]);
    assert!(d.issues.is_empty(), "{:?}", d.issues);
    // A literal env value resolves the same way.
    let d = with_rank("$(DP_RANK)", json!({"name": "DP_RANK", "value": "1"}), None);
    assert_eq!(ranks(&d), vec![(1, "tcp://10.1.2.3:5558".to_string())]);
    // The label is not there (the pod is not an LWS worker yet): an issue, and the plan says
    // which ranks it subscribes instead.
    let d = with_rank("$(DP_RANK)", lws_index, None);
    assert_eq!(ranks(&d).len(), 4);
    let issue = d
        .issues
        .iter()
        .find(|i| i.reason == issue::DATA_PARALLEL_RANK_UNKNOWN)
        .unwrap_or_else(|| panic!("{:?}", d.issues));
    assert!(
        issue
            .message
            .starts_with("--data-parallel-rank $(DP_RANK) cannot be resolved"),
        "{}",
        issue.message
    );
    assert!(issue.message.contains("[0, 1, 2, 3]"), "{}", issue.message);
    // `$DP_RANK` in an exec-form command reaches vLLM literally (no shell expands it): unknown.
    let d = with_rank("$DP_RANK", json!({"name": "DP_RANK", "value": "1"}), None);
    assert!(
        d.issues
            .iter()
            .any(|i| i.reason == issue::DATA_PARALLEL_RANK_UNKNOWN),
        "{:?}",
        d.issues
    );
}

/// The engine takes the last `--kv-events-config`; when that one is an expansion the plan
/// cannot read, it plans nothing and says why — never the earlier literal the engine ignores.
#[test]
fn a_last_kv_events_config_that_is_an_expansion_is_an_issue_not_the_earlier_literal() {
    let mut pod = vllm_pod();
    let cmd = pod.spec.as_mut().unwrap().containers[0]
        .command
        .as_mut()
        .unwrap();
    cmd.extend([
        "--kv-events-config".to_string(),
        "$(KV_EVENTS_JSON)".to_string(),
    ]);
    let d = derive_plans(&[pod], &[vllm_backend()]);
    assert!(d.plans["gpu-1"].engines[0].kv_events.is_empty());
    let i = d
        .issues
        .iter()
        .find(|i| i.reason == issue::KV_EVENTS_CONFIG_INVALID)
        .unwrap_or_else(|| panic!("{:?}", d.issues));
    assert!(
        i.message.contains("is an expansion ($(KV_EVENTS_JSON))"),
        "{}",
        i.message
    );
}
