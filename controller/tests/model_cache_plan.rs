//! Reader mounts of bound caches become `readerMounts` entries of their node's plan (issue 8
//! deliverable 6): only running pods on a node, reading a durable cache through its reader
//! claim, in one of its reader namespaces.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::reconcile::model_cache::plan::{reader_mounts, requested_cache};
use ic_shared::crd::ModelCache;
use ic_shared::plan::{NodePlan, PlannedContainer, ReaderMount};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

const CTL: &str = "inference-cache-model-cache";

fn cache(ns: &str, name: &str, mode: &str, readers: &[&str]) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"source": {"uri": "hf://x/y", "revision": "r"}, "size": "1Gi",
                 "workflow": "helmModelCache", "readerNamespaces": readers, "writer": {"template": {}}},
        "status": {"mode": mode, "binding": {"name": format!("mcb-{name}-1"), "uid": "u"},
                   "readerClaim": format!("mcb-{name}-1-reader"), "readerNamespaces": readers}
    }))
    .unwrap()
}

fn pod(
    ns: &str,
    name: &str,
    node: Option<&str>,
    annotation: &str,
    claim: &str,
    extra: Value,
) -> Pod {
    let mut spec = json!({
        "containers": [
            {"name": "vllm", "image": "x", "volumeMounts": [{"name": "model-data", "mountPath": "/models", "readOnly": true}]},
            {"name": "side", "image": "x", "volumeMounts": [{"name": "model-data", "mountPath": "/models", "readOnly": true}]}
        ],
        "initContainers": [
            {"name": "warm", "image": "x", "volumeMounts": [{"name": "model-data", "mountPath": "/warm", "readOnly": true}]},
            {"name": "prefetch", "image": "x", "restartPolicy": "Always", "volumeMounts": [{"name": "model-data", "mountPath": "/prefetch", "readOnly": true}]}
        ],
        "volumes": [{"name": "model-data", "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}]
    });
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    let mut p = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"),
                     "annotations": {"inferencecache.io/model-cache": annotation}},
        "spec": spec});
    for (k, v) in extra.as_object().unwrap() {
        p[k] = v.clone();
    }
    serde_json::from_value(p).unwrap()
}

#[test]
fn bound_readers_become_plan_entries_per_node() {
    let caches = vec![
        cache("org", "llama", "durable", &["ns-b", "ns-c"]),
        cache("org", "eph", "ephemeral", &["ns-b"]),
    ];
    let pods = vec![
        pod(
            "ns-b",
            "r1",
            Some("node-1"),
            "org/llama",
            "mcb-llama-1-reader",
            json!({}),
        ),
        pod(
            "ns-c",
            "r2",
            Some("node-2"),
            "org/llama",
            "mcb-llama-1-reader",
            json!({}),
        ),
        // Not counted: unscheduled, finished, another claim, namespace not a reader, ephemeral,
        // unknown cache, no annotation.
        pod(
            "ns-b",
            "pending",
            None,
            "org/llama",
            "mcb-llama-1-reader",
            json!({}),
        ),
        pod(
            "ns-b",
            "done",
            Some("node-1"),
            "org/llama",
            "mcb-llama-1-reader",
            json!({"status": {"phase": "Succeeded"}}),
        ),
        pod(
            "ns-b",
            "other-claim",
            Some("node-1"),
            "org/llama",
            "something-else",
            json!({}),
        ),
        pod(
            "ns-x",
            "stranger",
            Some("node-1"),
            "org/llama",
            "mcb-llama-1-reader",
            json!({}),
        ),
        pod(
            "ns-b",
            "eph",
            Some("node-1"),
            "org/eph",
            "mcb-eph-1-reader",
            json!({}),
        ),
        pod(
            "ns-b",
            "unknown",
            Some("node-1"),
            "org/nope",
            "mcb-llama-1-reader",
            json!({}),
        ),
    ];
    let plan = reader_mounts(&caches, &pods, CTL);
    assert_eq!(plan.keys().collect::<Vec<_>>(), vec!["node-1", "node-2"]);
    let n1 = &plan["node-1"];
    assert_eq!(
        n1.iter()
            .map(|m| (m.pod.as_str(), m.path.as_str()))
            .collect::<Vec<_>>(),
        vec![("r1", "/models"), ("r1", "/prefetch")],
        "one entry per distinct mount path: main containers and native sidecars; a plain init \
         container has exited once the pod runs, so its /warm is never mounted"
    );
    assert_eq!(
        n1[0],
        ReaderMount {
            namespace: "ns-b".into(),
            pod: "r1".into(),
            pod_uid: Some("uid-r1".into()),
            path: "/models".into(),
            expect_read_only: true,
            samples: vec![],
            binding: format!("{CTL}/mcb-llama-1"),
            containers: vec![
                PlannedContainer {
                    name: "vllm".into(),
                    id: None
                },
                PlannedContainer {
                    name: "side".into(),
                    id: None
                },
            ],
        }
    );
    assert_eq!(plan["node-2"].len(), 2);
    // The entries drop into a node plan as they are.
    let np = NodePlan {
        reader_mounts: plan["node-1"].clone(),
        ..NodePlan::default()
    };
    let back = NodePlan::parse(&serde_json::to_string(&np).unwrap(), "test").unwrap();
    assert_eq!(back.reader_mounts.len(), 2);
}

#[test]
fn a_plain_name_is_in_the_pod_namespace() {
    let p = pod("ns-b", "r", Some("n"), "llama", "c", json!({}));
    assert_eq!(requested_cache(&p), Some(("ns-b".into(), "llama".into())));
    let p = pod("ns-b", "r", Some("n"), "a/b/c", "c", json!({}));
    assert_eq!(requested_cache(&p), None);
}

/// Each planned reader path names the containers that mount it, with their runtime IDs only
/// while pod status says they run: the agent looks through those, never through one that does
/// not mount the volume.
#[test]
fn reader_paths_name_their_containers_with_running_ids() {
    let caches = vec![cache("org", "llama", "durable", &["ns-b"])];
    let id = "0b5c3e1f9a8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b";
    let pods = vec![pod(
        "ns-b",
        "r1",
        Some("node-1"),
        "org/llama",
        "mcb-llama-1-reader",
        json!({"status": {"phase": "Running",
            "containerStatuses": [
                {"name": "vllm", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                 "containerID": format!("cri-o://{id}"), "state": {"running": {}}},
                {"name": "side", "image": "x", "imageID": "", "ready": false, "restartCount": 3,
                 "containerID": "cri-o://1111111111111111",
                 "state": {"waiting": {"reason": "CrashLoopBackOff"}}}],
            "initContainerStatuses": [
                {"name": "prefetch", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                 "containerID": "containerd://2222222222222222", "state": {"running": {}}}]}}),
    )];
    let plan = reader_mounts(&caches, &pods, CTL);
    type Named = Vec<(String, Option<String>)>;
    let by_path: Vec<(String, Named)> = plan["node-1"]
        .iter()
        .map(|m| {
            (
                m.path.clone(),
                m.containers
                    .iter()
                    .map(|c| (c.name.clone(), c.id.clone()))
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        by_path,
        vec![
            (
                "/models".to_string(),
                vec![
                    ("vllm".to_string(), Some(id.to_string())),
                    ("side".to_string(), None)
                ]
            ),
            (
                "/prefetch".to_string(),
                vec![("prefetch".to_string(), Some("2222222222222222".to_string()))]
            ),
        ]
    );
}
