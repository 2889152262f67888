//! Property tests: random mutations of the valid sample CacheBackends (config/samples) never
//! panic anywhere in admission (schema, decode, every rule, UPDATE filtering, defaulting, the
//! three routes, `admit`); random pods through `/mutate-pod` are always allowed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;

use ic_controller::adapters::Registry;
use ic_controller::admission::defaulting::default_cache_backend;
use ic_controller::admission::offline::admit_cache_backend;
use ic_controller::admission::review::Operation;
use ic_controller::admission::validation::{RuleContext, Validator};
use ic_controller::admission::{Admission, PodWebhook, Route, StaticBackends};
use ic_shared::crd::CacheBackend;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

fn samples() -> Vec<Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples");
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("cachebackend-")
        {
            let mut v: Value = serde_yaml::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            v["metadata"]["namespace"] = json!("team-a");
            out.push(v);
        }
    }
    assert!(!out.is_empty());
    out
}

const KEYS: &[&str] = &[
    "runtime",
    "type",
    "lmCache",
    "remoteStorage",
    "provider",
    "ownership",
    "endpoint",
    "redis",
    "lmCacheServer",
    "mooncake",
    "resources",
    "limits",
    "requests",
    "claims",
    "observation",
    "replicas",
    "autoscaling",
    "minReplicas",
    "maxReplicas",
    "integration",
    "mode",
    "role",
    "failOpen",
    "engineOverrides",
    "args",
    "suppressArgs",
    "env",
    "suppressEnv",
    "name",
    "engineHostNetwork",
    "engineSelector",
    "matchLabels",
    "hiCache",
    "ratio",
    "sizeGB",
    "writePolicy",
    "ioBackend",
    "memoryLayout",
    "template",
    "allowCrossNamespace",
    "annotations",
    "inferencecache.io/lmcache-kernel-check",
    "nvidia.com/gpu",
    "hugepages-2Mi",
    "memory",
    "cpu",
    "chunkSizeTokens",
    "hostMemory",
    "capacity",
    "workerPort",
    "firstEventTimeout",
    "status",
    "command",
    "image",
    "deploymentKind",
];

const STRINGS: &[&str] = &[
    "",
    " ",
    "VLLM",
    "SGLang",
    "LMCache",
    "SGLangHiCache",
    "Redis",
    "LMCacheServer",
    "Mooncake",
    "Managed",
    "External",
    "EventsOnly",
    "Offload",
    "ReadOnly",
    "WriteOnly",
    "ReadWrite",
    "lm://x:1",
    "mooncakestore://m:50051",
    "redis:6379",
    "[fd00::1]:0",
    "x.other.svc:1",
    "fd00::1:1",
    "redis:6379/0",
    "-1",
    "0",
    "1.5",
    "3Mi",
    "500m",
    "1e400",
    "99999999999999999999Ei",
    "nan",
    "inf",
    "2.0",
    "--kv-transfer-config",
    "--kv_transfer_config=x",
    "PYTHONHASHSEED",
    "strict",
    "strcit",
    "5m",
    "1h30m",
    "x",
    "hugepages-",
    "kubernetes.io/x",
    "write_thru",
    "\u{1F600}",
    "a\u{0}b",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..70_000).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        proptest::sample::select(STRINGS).prop_map(Value::from),
        "[a-zA-Z0-9:/.\\[\\]_ -]{0,24}".prop_map(Value::from),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((proptest::sample::select(KEYS), inner), 0..4).prop_map(
                |kv| Value::Object(
                    kv.into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect::<Map<_, _>>()
                )
            ),
        ]
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    Replace(usize, Value),
    Remove(usize),
    Insert(usize, &'static str, Value),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), value()).prop_map(|(i, v)| Mutation::Replace(i, v)),
        any::<usize>().prop_map(Mutation::Remove),
        (any::<usize>(), proptest::sample::select(KEYS), value())
            .prop_map(|(i, k, v)| Mutation::Insert(i, k, v)),
    ]
}

fn pointers(v: &Value, base: String, out: &mut Vec<String>) {
    out.push(base.clone());
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                pointers(
                    c,
                    format!("{base}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                pointers(c, format!("{base}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn apply(doc: &mut Value, m: &Mutation) {
    let mut ptrs = Vec::new();
    pointers(doc, String::new(), &mut ptrs);
    let pick = |i: usize| ptrs[i % ptrs.len()].clone();
    match m {
        Mutation::Replace(i, v) => {
            let p = pick(*i);
            if p.is_empty() {
                return;
            }
            if let Some(t) = doc.pointer_mut(&p) {
                *t = v.clone();
            }
        }
        Mutation::Remove(i) => {
            let p = pick(*i);
            if let Some((parent, last)) = p.rsplit_once('/') {
                match doc.pointer_mut(parent) {
                    Some(Value::Object(m)) => {
                        m.remove(&last.replace("~1", "/").replace("~0", "~"));
                    }
                    Some(Value::Array(a)) => {
                        if let Ok(i) = last.parse::<usize>() {
                            if i < a.len() {
                                a.remove(i);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        Mutation::Insert(i, k, v) => {
            let p = pick(*i);
            if let Some(Value::Object(m)) = doc.pointer_mut(&p) {
                m.insert((*k).to_string(), v.clone());
            }
        }
    }
}

/// Real wiring, with backends that match the random pods' labels.
fn admission() -> Admission {
    let backends: Vec<CacheBackend> = [
        json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
               "ownership": "External", "endpoint": "lm://lmcache:65432"},
               "observation": {"modelID": "m"}, "engineSelector": {"matchLabels": {"app": "vllm"}}}),
        json!({"runtime": "SGLang", "engineSelector": {"matchLabels": {"app": "sglang"}}}),
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"},
               "engineSelector": {"matchLabels": {"app": "hicache"}}}),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, spec)| {
        serde_json::from_value(json!({"apiVersion": "inferencecache.io/v1alpha1",
            "kind": "CacheBackend", "metadata": {"name": format!("cb{i}"), "namespace": "team-a",
            "uid": format!("uid-{i}")}, "spec": spec}))
        .unwrap()
    })
    .collect();
    Admission::new(
        Arc::new(Registry::builtin()),
        Arc::new(StaticBackends::new(backends)),
        Arc::new(PodWebhook::default()),
    )
}

fn review(op: &str, kind: &str, obj: &Value, old: Option<&Value>) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "p", "kind": {"group": "", "version": "v1", "kind": kind},
                    "resource": {"group": "", "version": "v1", "resource": "x"},
                    "namespace": "team-a", "operation": op, "object": obj, "oldObject": old}}),
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn mutated_cache_backends_never_panic(
        which in any::<usize>(),
        mutations in proptest::collection::vec(mutation(), 1..6),
    ) {
        let all = samples();
        let original = all[which % all.len()].clone();
        let mut doc = original.clone();
        for m in &mutations {
            apply(&mut doc, m);
        }
        let reg = Registry::builtin();
        let ctx = RuleContext { namespace: "team-a", registry: &reg, operation: Operation::Update };
        let v = Validator::builtin();
        let _ = v.validate_value(&doc, &ctx);
        let _ = v.validate_update(&doc, &original, &ctx);
        let _ = v.validate_update(&original, &doc, &ctx);
        if let Ok(cb) = serde_json::from_value::<CacheBackend>(doc.clone()) {
            let _ = v.validate(&cb, &ctx);
        }
        let _ = default_cache_backend(&doc, Operation::Create);
        let _ = default_cache_backend(&doc, Operation::Update);
        let a = admission();
        for (route, op) in [
            (Route::MutateCacheBackend, "CREATE"),
            (Route::ValidateCacheBackend, "CREATE"),
            (Route::ValidateCacheBackend, "UPDATE"),
        ] {
            let out = a.handle_bytes(route, &review(op, "CacheBackend", &doc, Some(&original)));
            let r: Value = serde_json::from_slice(&out.body).unwrap();
            prop_assert_eq!(&r["response"]["uid"], "p");
            // patchType never without patch.
            prop_assert_eq!(r["response"].get("patchType").is_some(), r["response"].get("patch").is_some());
        }
        let verdict = admit_cache_backend(&a, doc.clone(), None, "team-a");
        if verdict.allowed {
            // Whatever admission accepts decodes as a CacheBackend.
            prop_assert!(serde_json::from_value::<CacheBackend>(verdict.object).is_ok());
        }
    }

    #[test]
    fn random_pods_through_mutate_pod_are_always_allowed(
        mutations in proptest::collection::vec(mutation(), 0..6),
        op in proptest::sample::select(&["CREATE", "CREATE", "UPDATE", "DELETE"][..]),
        app in proptest::sample::select(&["vllm", "sglang", "hicache", "other"][..]),
    ) {
        let (name, command) = match app {
            "vllm" => ("vllm", json!(["vllm", "serve", "m"])),
            _ => ("sglang", json!(["python3", "-m", "sglang.launch_server", "--model-path", "m"])),
        };
        let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "team-a", "labels": {"app": app}},
            "spec": {"containers": [{"name": name, "image": "img", "command": command}]}});
        for m in &mutations {
            apply(&mut pod, m);
        }
        let a = admission();
        let out = a.handle_bytes(Route::MutatePod, &review(op, "Pod", &pod, None));
        let r: Value = serde_json::from_slice(&out.body).unwrap();
        prop_assert_eq!(&r["response"]["allowed"], &Value::Bool(true));
        prop_assert_eq!(r["response"].get("patchType").is_some(), r["response"].get("patch").is_some());
    }
}
