//! The samples in `config/samples/` parse into the Rust types, round-trip without loss, and pass
//! the generated `openAPIV3Schema` (validated with `jsonschema`, which ignores the `x-kubernetes-*`
//! extensions); invalid objects fail the same schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_shared::crd::{
    CacheBackend, CacheIndex, CacheNode, CachePolicy, CacheTenant, CustomResourceDefinition,
    IntegrationMode, RemoteProvider, Runtime,
};
use kube::CustomResourceExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

fn samples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

fn sample_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(samples_dir())
        .expect("config/samples exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

fn load(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("read sample");
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn crd_for(kind: &str) -> CustomResourceDefinition {
    match kind {
        "CacheBackend" => CacheBackend::crd(),
        "CacheIndex" => CacheIndex::crd(),
        "CacheNode" => CacheNode::crd(),
        "CachePolicy" => CachePolicy::crd(),
        "CacheTenant" => CacheTenant::crd(),
        other => panic!("no CRD for kind {other}"),
    }
}

/// A JSON-Schema validator for the kind's served `openAPIV3Schema`.
fn validator(kind: &str) -> jsonschema::Validator {
    let crd = crd_for(kind);
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("openAPIV3Schema");
    let schema = serde_json::to_value(schema).expect("schema to json");
    jsonschema::validator_for(&schema).expect("schema compiles")
}

fn schema_errors(kind: &str, obj: &Value) -> Vec<String> {
    let v = validator(kind);
    v.iter_errors(obj)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Parses `obj` into `K` and checks that serializing it back gives the same JSON (so no field
/// was unknown, misspelt or silently dropped).
fn round_trip<K: DeserializeOwned + Serialize>(name: &str, obj: &Value) -> K {
    let parsed: K = serde_json::from_value(obj.clone())
        .unwrap_or_else(|e| panic!("{name}: does not parse: {e}"));
    let back = serde_json::to_value(&parsed).expect("serialize");
    assert_eq!(&back, obj, "{name}: round trip changed the object");
    parsed
}

#[test]
fn every_sample_parses_round_trips_and_passes_the_schema() {
    let files = sample_files();
    assert!(!files.is_empty(), "no samples found");
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let obj = load(path);
        assert_eq!(
            obj["apiVersion"], "inferencecache.io/v1alpha1",
            "{name}: apiVersion"
        );
        let kind = obj["kind"].as_str().expect("kind").to_string();
        match kind.as_str() {
            "CacheBackend" => {
                round_trip::<CacheBackend>(&name, &obj);
            }
            "CacheIndex" => {
                round_trip::<CacheIndex>(&name, &obj);
            }
            "CacheNode" => {
                round_trip::<CacheNode>(&name, &obj);
            }
            "CachePolicy" => {
                round_trip::<CachePolicy>(&name, &obj);
            }
            "CacheTenant" => {
                round_trip::<CacheTenant>(&name, &obj);
            }
            other => panic!("{name}: unexpected kind {other}"),
        }
        let errors = schema_errors(&kind, &obj);
        assert!(errors.is_empty(), "{name}: schema errors: {errors:#?}");
    }
}

#[test]
fn the_samples_the_spec_names_exist_and_say_what_they_claim() {
    let dir = samples_dir();
    let backend = |file: &str| -> CacheBackend {
        serde_json::from_value(load(&dir.join(file))).unwrap_or_else(|e| panic!("{file}: {e}"))
    };

    let host_only = backend("cachebackend-host-only.yaml");
    assert!(host_only.spec.remote_storage.is_none());

    let redis = backend("cachebackend-redis-managed.yaml");
    let rs = redis.spec.remote_storage.as_ref().unwrap();
    assert_eq!(rs.provider, RemoteProvider::Redis);
    assert!(rs.redis.is_some() && rs.endpoint.is_none());

    let external = backend("cachebackend-external.yaml");
    let rs = external.spec.remote_storage.as_ref().unwrap();
    assert_eq!(rs.provider, RemoteProvider::LMCacheServer);
    assert_eq!(rs.ownership, ic_shared::crd::Ownership::External);
    assert!(rs.endpoint.is_some());

    let mooncake = backend("cachebackend-mooncake.yaml");
    assert_eq!(
        mooncake.spec.remote_storage.as_ref().unwrap().provider,
        RemoteProvider::Mooncake
    );
    assert!(mooncake.spec.engine_host_network());

    let events = backend("cachebackend-events-only.yaml");
    assert_eq!(events.spec.integration_mode(), IntegrationMode::EventsOnly);
    assert!(events.spec.remote_storage.is_none() && events.spec.autoscaling.is_none());

    let hicache = backend("cachebackend-sglang-hicache.yaml");
    assert_eq!(hicache.spec.runtime, Runtime::SgLang);
    assert_eq!(
        hicache.spec.effective_type(),
        ic_shared::crd::CacheType::SGLangHiCache
    );
    assert!(hicache.spec.hi_cache.is_some());

    // Default samples exercise the no-override path (spec "Residual risk").
    for path in sample_files() {
        let obj = load(&path);
        assert!(
            obj.pointer("/spec/integration/engineOverrides").is_none(),
            "{}: samples must not use engineOverrides",
            path.display()
        );
    }
}

fn minimal_backend() -> Value {
    json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": "minimal"},
        "spec": {"runtime": "VLLM"}
    })
}

#[test]
fn minimal_backend_round_trips_without_materialising_absent_specs() {
    let obj = minimal_backend();
    let cb: CacheBackend = round_trip("minimal", &obj);
    assert!(cb.status.is_none());
    let s = &cb.spec;
    assert!(s.type_.is_none());
    assert!(s.lm_cache.is_none());
    assert!(s.remote_storage.is_none());
    assert!(s.observation.is_none());
    assert!(s.autoscaling.is_none());
    assert!(s.integration.is_none());
    assert!(s.engine_selector.is_none());
    assert!(s.hi_cache.is_none());
    assert!(s.template.is_none());
    assert!(s.replicas.is_none());
    assert!(schema_errors("CacheBackend", &obj).is_empty());
    // An explicit empty provider resources block ("{}" suppresses the provider default) is kept.
    let mut with_empty = obj.clone();
    with_empty["spec"]["remoteStorage"] =
        json!({"provider": "Redis", "ownership": "Managed", "redis": {"resources": {}}});
    round_trip::<CacheBackend>("empty resources", &with_empty);
}

/// Applies `edit` to the minimal backend and asserts the schema rejects the result.
fn assert_rejected(what: &str, edit: impl FnOnce(&mut Value)) {
    let mut obj = minimal_backend();
    edit(&mut obj);
    assert!(
        !schema_errors("CacheBackend", &obj).is_empty(),
        "{what}: schema accepted {obj}"
    );
}

#[test]
fn schema_rejects_bad_values() {
    assert_rejected("lower-case runtime", |o| {
        o["spec"]["runtime"] = json!("vllm")
    });
    assert_rejected("missing runtime", |o| o["spec"] = json!({}));
    assert_rejected("old type spelling Mooncake", |o| {
        o["spec"]["type"] = json!("Mooncake")
    });
    assert_rejected("old type spelling External", |o| {
        o["spec"]["type"] = json!("External")
    });
    assert_rejected("replicas -1", |o| o["spec"]["replicas"] = json!(-1));
    assert_rejected("replicas as string", |o| o["spec"]["replicas"] = json!("1"));
    assert_rejected("deploymentKind DaemonSet", |o| {
        o["spec"]["deploymentKind"] = json!("DaemonSet")
    });
    assert_rejected("unknown provider", |o| {
        o["spec"]["remoteStorage"] = json!({"provider": "Memcached", "ownership": "Managed"})
    });
    assert_rejected("missing ownership", |o| {
        o["spec"]["remoteStorage"] = json!({"provider": "Redis"})
    });
    assert_rejected("unknown integration mode", |o| {
        o["spec"]["integration"] = json!({"mode": "RoutingOnly"})
    });
    assert_rejected("unknown role", |o| {
        o["spec"]["integration"] = json!({"role": "ReadMostly"})
    });
    assert_rejected("maxReplicas 0", |o| {
        o["spec"]["autoscaling"] = json!({"maxReplicas": 0})
    });
    assert_rejected("minReplicas 0", |o| {
        o["spec"]["autoscaling"] = json!({"maxReplicas": 2, "minReplicas": 0})
    });
    assert_rejected("autoscaling without maxReplicas", |o| {
        o["spec"]["autoscaling"] = json!({"minReplicas": 1})
    });
    assert_rejected("target CPU 101", |o| {
        o["spec"]["autoscaling"] = json!({"maxReplicas": 2, "targetCPUUtilizationPercent": 101})
    });
    assert_rejected("target CPU 0", |o| {
        o["spec"]["autoscaling"] = json!({"maxReplicas": 2, "targetCPUUtilizationPercent": 0})
    });
    assert_rejected("worker port 70000", |o| {
        o["spec"]["lmCache"] = json!({"workerPort": 70000})
    });
    assert_rejected("worker port 0", |o| {
        o["spec"]["lmCache"] = json!({"workerPort": 0})
    });
    assert_rejected("chunk size 0", |o| {
        o["spec"]["lmCache"] = json!({"chunkSizeTokens": 0})
    });
    assert_rejected("bad duration", |o| {
        o["spec"]["observation"] = json!({"firstEventTimeout": "five minutes"})
    });
    assert_rejected("bad HiCache write policy", |o| {
        o["spec"]["hiCache"] = json!({"sizeGB": 8, "writePolicy": "write-through"})
    });
    assert_rejected("HiCache sizeGB 0", |o| {
        o["spec"]["hiCache"] = json!({"sizeGB": 0})
    });
    assert_rejected("negative grace period", |o| {
        o["spec"]["template"] = json!({"terminationGracePeriodSeconds": -1})
    });
    assert_rejected("failOpen as string", |o| {
        o["spec"]["integration"] = json!({"failOpen": "yes"})
    });
    assert_rejected("negative matchedEnginePods", |o| {
        o["status"] = json!({"matchedEnginePods": -1})
    });
}

#[test]
fn bad_sample_files_fail_the_schema() {
    // The committed samples with one field broken, as an operator might write them.
    let mut bad_enum = load(&samples_dir().join("cachebackend-host-only.yaml"));
    bad_enum["spec"]["runtime"] = json!("sglang");
    assert!(!schema_errors("CacheBackend", &bad_enum).is_empty());

    let mut bad_replicas = load(&samples_dir().join("cachebackend-mooncake.yaml"));
    bad_replicas["spec"]["replicas"] = json!(-1);
    assert!(!schema_errors("CacheBackend", &bad_replicas).is_empty());

    let mut bad_policy = load(&samples_dir().join("cachepolicy.yaml"));
    bad_policy["spec"]["lookupTimeoutMs"] = json!(-5);
    assert!(!schema_errors("CachePolicy", &bad_policy).is_empty());

    let mut bad_tenant = load(&samples_dir().join("cachetenant.yaml"));
    bad_tenant["spec"]["quota"]["maxIndexEntries"] = json!(-1);
    assert!(!schema_errors("CacheTenant", &bad_tenant).is_empty());
}

#[test]
fn schema_accepts_the_full_surface() {
    let obj = json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": "full", "namespace": "ml"},
        "spec": {
            "runtime": "VLLM",
            "type": "LMCache",
            "lmCache": {
                "chunkSizeTokens": 512,
                "hostMemory": {"capacity": "16Gi"},
                "workerImage": "lmcache/vllm-openai:v0.3.9",
                "workerPort": 6000,
                "remoteSerde": "naive"
            },
            "remoteStorage": {
                "provider": "LMCacheServer",
                "ownership": "Managed",
                "lmCacheServer": {
                    "image": "lmcache/standalone:v0.4.7",
                    "command": ["lmcache_server", "0.0.0.0", "65432"],
                    "resources": {"requests": {"cpu": "1", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
                }
            },
            "observation": {"modelID": "meta-llama/Llama-3.1-8B", "firstEventTimeout": "1h30m"},
            "deploymentKind": "StatefulSet",
            "replicas": 0,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetCPUUtilizationPercent": 70},
            "integration": {
                "mode": "Offload",
                "role": "ReadOnly",
                "failOpen": false,
                "engineOverrides": {
                    "args": ["--max-model-len", "8192"],
                    "suppressArgs": ["--enable-prefix-caching"],
                    "env": [
                        {"name": "LMCACHE_CHUNK_SIZE", "value": "512"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
                    ],
                    "suppressEnv": ["LMCACHE_LOCAL_CPU"]
                }
            },
            "engineSelector": {"matchLabels": {"app": "vllm"}},
            "template": {
                "nodeSelector": {"pool": "cache"},
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
                }}},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "topologySpreadConstraints": [{
                    "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app": "cache"}}
                }],
                "imagePullSecrets": [{"name": "regcred"}],
                "serviceAccountName": "cache",
                "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "fsGroup": 2000},
                "priorityClassName": "high",
                "schedulerName": "default-scheduler",
                "runtimeClassName": "nvidia",
                "terminationGracePeriodSeconds": 30
            },
            "allowCrossNamespace": true
        },
        "status": {
            "endpoint": "full-cache.ml.svc:65432",
            "matchedEnginePods": 0,
            "engineSelectorMessage": "spec.engineSelector.matchLabels={app: vllm} matches no Pods",
            "failOpen": false,
            "indexParticipation": {"prefixCount": 0, "lastEventAt": "2026-01-02T03:04:05Z", "t2HitRate": "0"},
            "firstKVEventObservedAt": "2026-01-02T03:04:05Z",
            "firstAvailableAt": "2026-01-02T03:00:00Z",
            "observedServerInstance": "uid-1:0",
            "observedGeneration": 3,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KVEventsObserved", "message": "",
                "lastTransitionTime": "2026-01-02T03:04:05Z", "observedGeneration": 3
            }]
        }
    });
    let cb: CacheBackend = round_trip("full", &obj);
    assert!(!cb.spec.fail_open());
    let errors = schema_errors("CacheBackend", &obj);
    assert!(errors.is_empty(), "{errors:#?}");
}

#[test]
fn cache_node_and_index_status_validate() {
    let node = json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheNode",
        "metadata": {"name": "gpu-node-1"},
        "spec": {"nodeName": "gpu-node-1"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "AllChecksPassed", "message": "", "lastTransitionTime": "2026-01-02T03:04:05Z"},
                {"type": "GPUHealthy", "status": "False", "reason": "XidFatal", "message": "GPU 1 reported XID 79", "lastTransitionTime": "2026-01-02T03:04:05Z"}
            ],
            "lastReportTime": "2026-01-02T03:04:05Z",
            "agentVersion": "0.1.0",
            "bootID": "c0ffee",
            "observedPlanGeneration": 4,
            "gpuCount": 2,
            "engineCount": 1,
            "gpus": [
                {"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "status": "Ok"},
                {"index": 1, "uuid": "GPU-1", "name": "NVIDIA H200", "status": "Critical", "reason": "XidFatal", "message": "XID 79"}
            ],
            "engines": [{
                "namespace": "ml", "pod": "vllm-0", "model": "m",
                "streams": [{"endpoint": "tcp://10.0.0.5:5557", "dpRank": 0, "connected": true,
                             "lastEventAt": "2026-01-02T03:04:05Z", "prefixCount": 12}]
            }]
        }
    });
    round_trip::<CacheNode>("node", &node);
    let errors = schema_errors("CacheNode", &node);
    assert!(errors.is_empty(), "{errors:#?}");
    let mut bad = node.clone();
    bad["status"]["gpus"][0]["status"] = json!("Broken");
    assert!(!schema_errors("CacheNode", &bad).is_empty());

    let index = json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheIndex",
        "metadata": {"name": "default"},
        "spec": {},
        "status": {
            "replicas": [{"id": "vllm-0", "tenant": "ml", "backend": "ml/cache", "model": "m",
                          "prefixCount": 10, "cacheMemoryBytes": 1073741824, "hitRate": "0.5"}],
            "replicaCount": 1,
            "tenants": [{"id": "ml", "indexEntries": 10, "memoryUsed": 0}],
            "prefixes": {"total": 10, "t1": 8, "t2": 2},
            "observedServer": "in-process",
            "lastUpdated": "2026-01-02T03:04:05Z"
        }
    });
    let ci: CacheIndex = round_trip("index", &index);
    // Deprecated in place: memoryUsed is always serialized, even at 0.
    let back = serde_json::to_value(&ci).unwrap();
    assert_eq!(back["status"]["tenants"][0]["memoryUsed"], json!(0));
    let errors = schema_errors("CacheIndex", &index);
    assert!(errors.is_empty(), "{errors:#?}");
}
