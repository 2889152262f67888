//! The admission chain as the apiserver runs it: the CacheBackend defaulting and validating
//! webhooks (called over HTTPS by `url` + `caBundle`), the CRDs' CEL rules, and the Pod
//! webhook on real pod creates.

use std::time::Duration;

use ic_controller::admission::pod::ANNOTATION_INJECTED_BY;
use ic_shared::crd::CacheBackend;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

use crate::support::{wait_for, Cluster};

fn backend(name: &str, spec: Value) -> CacheBackend {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// The API error of a refused create (panics when it was admitted).
async fn refused(api: &Api<CacheBackend>, cb: &CacheBackend) -> kube::core::Status {
    match api.create(&PostParams::default(), cb).await {
        Err(kube::Error::Api(e)) => *e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The mutating webhook materialises `spec.integration` and `spec.observation`; the apiserver
/// applies the schema's own defaults (`spec.type`, `spec.replicas`).
#[tokio::test]
async fn cachebackend_is_defaulted_through_the_apiserver() {
    let c = Cluster::get().await;
    let ns = c.namespace("defaulting").await;
    let api = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);
    let created = api
        .create(
            &PostParams::default(),
            &backend(
                "plain",
                json!({"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "x"}}}),
            ),
        )
        .await
        .unwrap();
    let spec = serde_json::to_value(&created.spec).unwrap();
    assert_eq!(spec["integration"]["mode"], "Offload", "{spec}");
    assert_eq!(spec["integration"]["role"], "ReadWrite", "{spec}");
    assert_eq!(spec["integration"]["failOpen"], true, "{spec}");
    assert_eq!(spec["observation"]["firstEventTimeout"], "5m", "{spec}");
    assert_eq!(spec["replicas"], 1, "schema default: {spec}");

    // minReplicas is copied from replicas on CREATE only.
    let scaled = api
        .create(
            &PostParams::default(),
            &backend(
                "scaled",
                json!({"runtime": "SGLang", "type": "LMCache", "replicas": 2,
                       "autoscaling": {"maxReplicas": 4},
                       "lmCache": {"chunkSizeTokens": 256, "hostMemory": {"capacity": "1Gi"}},
                       "remoteStorage": {"provider": "Redis", "ownership": "Managed",
                                         "redis": {"image": "redis:7.4-alpine"}},
                       "engineSelector": {"matchLabels": {"app": "y"}}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(scaled.spec.autoscaling.unwrap().min_replicas, Some(2));
    c.drop_namespace(&ns).await;
}

/// The validating webhook refuses with a field-scoped message, and the CRD's CEL rule refuses
/// what it covers, before any webhook sees it.
#[tokio::test]
async fn invalid_cachebackends_are_refused_with_the_field() {
    let c = Cluster::get().await;
    let ns = c.namespace("validation").await;
    let api = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);

    // Webhook rule: replicas 0 with autoscaling needs minReplicas.
    let e = refused(
        &api,
        &backend(
            "zero",
            json!({"runtime": "VLLM", "replicas": 0, "autoscaling": {"maxReplicas": 3},
                   "engineSelector": {"matchLabels": {"app": "x"}}}),
        ),
    )
    .await;
    assert!(
        e.message.contains("vcachebackend.inferencecache.io")
            && e.message.contains("spec.autoscaling.minReplicas"),
        "{e:?}"
    );

    // CEL (x-kubernetes-validations) on spec.autoscaling.
    let e = refused(
        &api,
        &backend(
            "inverted",
            json!({"runtime": "VLLM", "autoscaling": {"minReplicas": 5, "maxReplicas": 2},
                   "engineSelector": {"matchLabels": {"app": "x"}}}),
        ),
    )
    .await;
    assert_eq!(e.code, 422, "{e:?}");
    assert!(
        e.message.contains("spec.autoscaling")
            && e.message
                .contains("minReplicas must not exceed maxReplicas"),
        "{e:?}"
    );

    // Schema: an unknown runtime is refused by the enum (sent as raw JSON: our own type
    // cannot even hold it).
    let raw = json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "unknown"},
        "spec": {"runtime": "TGI", "engineSelector": {"matchLabels": {"app": "x"}}}
    });
    let e = match api
        .patch(
            "unknown",
            &PatchParams::apply("real-apiserver-test"),
            &Patch::Apply(raw),
        )
        .await
    {
        Err(kube::Error::Api(e)) => *e,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(e.code, 422, "{e:?}");
    assert!(e.message.contains("spec.runtime"), "{e:?}");

    // An update is validated too: the stored object stays as it was.
    api.create(
        &PostParams::default(),
        &backend(
            "ok",
            json!({"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "x"}}}),
        ),
    )
    .await
    .unwrap();
    let err = api
        .patch(
            "ok",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"autoscaling": {"minReplicas": 9, "maxReplicas": 1}}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 422),
        "{err:?}"
    );
    assert!(api.get("ok").await.unwrap().spec.autoscaling.is_none());
    c.drop_namespace(&ns).await;
}

/// A vLLM engine pod created through the apiserver comes back wired by the Pod webhook; a pod
/// no CacheBackend selects is admitted untouched.
#[tokio::test]
async fn engine_pod_is_wired_on_a_real_create() {
    let c = Cluster::get().await;
    let ns = c.namespace("podwiring").await;
    let backends = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);
    backends
        .create(
            &PostParams::default(),
            &backend(
                "hostcache",
                json!({"runtime": "VLLM", "type": "LMCache",
                       "lmCache": {"chunkSizeTokens": 256, "hostMemory": {"capacity": "1Gi"}},
                       "engineSelector": {"matchLabels": {"app": "llm"}}}),
            ),
        )
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(c.admin.clone(), &ns);
    let pod = |name: &str, app: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"containers": [{
                "name": "vllm", "image": "vllm/vllm-openai:v0.11.2",
                "command": ["vllm", "serve", "Qwen/Qwen3-8B"], "args": ["--port", "8000"]
            }]}
        }))
        .unwrap()
    };
    // The webhook reads CacheBackends from a watch-backed store: the first pods may be created
    // before the new backend reaches it. Each try is a new pod.
    let mut n = 0;
    let wired = wait_for("a wired engine pod", Duration::from_secs(30), || {
        n += 1;
        let p = pod(&format!("engine-{n}"), "llm");
        let pods = pods.clone();
        async move {
            let created = pods.create(&PostParams::default(), &p).await.unwrap();
            created
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_INJECTED_BY))
                .is_some()
                .then_some(created)
        }
    })
    .await;
    assert_eq!(
        wired.metadata.annotations.as_ref().unwrap()[ANNOTATION_INJECTED_BY],
        format!("{ns}/hostcache")
    );
    let containers = &wired.spec.as_ref().unwrap().containers;
    let engine = containers.iter().find(|c| c.name == "vllm").unwrap();
    let env: Vec<&str> = engine
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    assert!(env.iter().any(|e| e.starts_with("LMCACHE_")), "{env:?}");

    let other = pods
        .create(&PostParams::default(), &pod("unselected", "other"))
        .await
        .unwrap();
    assert!(!other
        .metadata
        .annotations
        .unwrap_or_default()
        .contains_key(ANNOTATION_INJECTED_BY));
    c.drop_namespace(&ns).await;
}

/// Field case (issue 39 item 1), through the apiserver's own admission chain: an SGLang engine
/// whose KV-event publisher binds `tcp://*:5555`, the port the LMCache MP worker takes by
/// default. The Pod webhook used to drop only the subscriber and still inject the worker on
/// 5555, so the engine or the worker could never bind. The stored pod must come back unwired —
/// no worker, no `injected-by` — with the reason in `not-injected`, and the running controller
/// records a Warning `NotInjected` Event on it. The same engine publishing on 5557 is wired
/// (the webhook is called and wires this backend's pods).
#[tokio::test]
async fn an_engine_listener_on_the_mp_worker_port_leaves_the_pod_unwired_with_an_event() {
    let c = Cluster::get().await;
    let ns = c.namespace("mpport").await;
    Api::<CacheBackend>::namespaced(c.admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &backend(
                "sglang-host",
                json!({"runtime": "SGLang", "type": "LMCache",
                       "engineSelector": {"matchLabels": {"app": "sglang"}}}),
            ),
        )
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(c.admin.clone(), &ns);
    let pod = |name: &str, publisher_port: u16| -> Pod {
        let config = format!(r#"{{"publisher":"zmq","endpoint":"tcp://*:{publisher_port}"}}"#);
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": "sglang"}},
            "spec": {"containers": [{
                "name": "sglang", "image": "lmsysorg/sglang:v0.5.13",
                "command": ["python3", "-m", "sglang.launch_server"],
                "args": ["--model-path", "Qwen/Qwen3-8B", "--port", "30000",
                         "--kv-events-config", config]
            }]}
        }))
        .unwrap()
    };
    let worker = |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .is_some_and(|ics| ics.iter().any(|c| c.name == "lmcache-mp-worker"))
    };
    // The webhook's backend store is watch-fed: retry with new pods until this backend wires.
    let mut n = 0;
    let wired = wait_for("a wired SGLang pod", Duration::from_secs(30), || {
        n += 1;
        let p = pod(&format!("engine-5557-{n}"), 5557);
        let pods = pods.clone();
        async move {
            let created = pods.create(&PostParams::default(), &p).await.unwrap();
            created
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_INJECTED_BY))
                .is_some()
                .then_some(created)
        }
    })
    .await;
    assert!(worker(&wired), "{:?}", wired.spec);

    let created = pods
        .create(&PostParams::default(), &pod("engine-5555", 5555))
        .await
        .unwrap();
    let annotations = created.metadata.annotations.clone().unwrap_or_default();
    assert!(
        !annotations.contains_key(ANNOTATION_INJECTED_BY),
        "{annotations:?}"
    );
    assert!(!worker(&created), "{:?}", created.spec);
    let reason = annotations
        .get("inferencecache.io/not-injected")
        .unwrap_or_else(|| panic!("no not-injected annotation: {annotations:?}"));
    assert!(
        reason.contains(&format!("CacheBackend {ns}/sglang-host: the LMCache MP worker would listen on port 5555, which is the KV-event publisher of data-parallel rank 0 (container \"sglang\"); set spec.lmCache.workerPort to a free port")),
        "{reason}"
    );
    let event = wait_for("a NotInjected Event", Duration::from_secs(60), || async {
        Api::<Event>::namespaced(c.admin.clone(), &ns)
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("NotInjected")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("engine-5555")
            })
    })
    .await;
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert!(
        event.note.as_deref().unwrap_or("").contains("port 5555"),
        "{event:?}"
    );
    c.drop_namespace(&ns).await;
}

/// The chart's ValidatingAdmissionPolicies on the controller's own writes: as the chart's
/// ServiceAccount, a Deployment the controller does not own cannot be changed (its RBAC alone
/// would allow it), while the admin's identical write goes through; nor can an unlabelled
/// Secret be created in the model cache's control namespace.
#[tokio::test]
async fn the_admission_policy_keeps_the_controller_to_its_own_objects() {
    use k8s_openapi::api::apps::v1::Deployment;
    let c = Cluster::get().await;
    let ns = c.namespace("policy").await;
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "someone-elses", "labels": {"app": "web"}},
        "spec": {"selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}
    }))
    .unwrap();
    Api::<Deployment>::namespaced(c.admin.clone(), &ns)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let scale = json!({"spec": {"replicas": 0}});
    let controller = c.client("IC_CLUSTER_CONTROLLER_KUBECONFIG").await;
    let err = Api::<Deployment>::namespaced(controller, &ns)
        .patch(
            "someone-elses",
            &PatchParams::default(),
            &Patch::Merge(&scale),
        )
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err:?}")
    };
    assert!(
        status.message.contains("ValidatingAdmissionPolicy")
            && status
                .message
                .contains("inference-cache-controller-owned-workloads"),
        "{status:?}"
    );
    Api::<Deployment>::namespaced(c.admin.clone(), &ns)
        .patch(
            "someone-elses",
            &PatchParams::default(),
            &Patch::Merge(&scale),
        )
        .await
        .unwrap();

    // The model cache's policy: in its control namespace the controller may create only the
    // key Secrets it labels (RBAC alone would let it create any Secret there).
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("unlabelled-{}", std::process::id())},
        "stringData": {"k": "v"}
    }))
    .unwrap();
    let controller = c.client("IC_CLUSTER_CONTROLLER_KUBECONFIG").await;
    let err = Api::<Secret>::namespaced(controller, "inference-cache-model-cache")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err:?}")
    };
    assert!(
        status
            .message
            .contains("inference-cache-controller-model-cache-writes"),
        "{status:?}"
    );
    c.drop_namespace(&ns).await;
}
