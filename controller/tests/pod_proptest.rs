//! Property tests of the Pod webhook (issue 4 Acceptance: "random pods through `/mutate-pod`
//! are always allowed"): for random pod-shaped objects — random command lines and shell scripts,
//! flags in every spelling, env, mounts, reserved names, annotations — against random
//! CacheBackends, the webhook never panics, always allows, never reports an internal error, emits
//! a patch that applies and yields a valid Pod, and re-admitting the patched pod yields no patch.
//! Arbitrary JSON is always allowed too.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod pod_support;

use ic_controller::admission::pod::{mutate_pod, PodWebhookConfig};
use ic_shared::crd::CacheBackend;
use pod_support::apply;
use proptest::prelude::*;
use serde_json::{json, Value};

const KV: &str = r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_consumer"}"#;
const NIXL: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#;

fn script_fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("vllm serve m".to_string()),
        Just("exec vllm serve".to_string()),
        Just("exec \"$@\"".to_string()),
        Just("python3 -m vllm.entrypoints.openai.api_server".to_string()),
        Just("python3 -m sglang.launch_server".to_string()),
        Just("--port 8000".to_string()),
        Just(" \\\n  ".to_string()),
        Just("\\".to_string()),
        Just("\"$@\"".to_string()),
        Just("$@".to_string()),
        Just("'quoted value'".to_string()),
        Just("\"dq $HOME\"".to_string()),
        Just("$EXTRA".to_string()),
        Just("$(cat /x)".to_string()),
        Just("`date`".to_string()),
        Just("&&".to_string()),
        Just(";".to_string()),
        Just("|".to_string()),
        Just("2>&1".to_string()),
        Just("> /tmp/log".to_string()),
        Just("<<EOF\nvllm serve x\nEOF\n".to_string()),
        Just("# comment".to_string()),
        Just("\n".to_string()),
        Just(format!("--kv-transfer-config '{KV}'")),
        Just(format!("--kv_transfer_config='{NIXL}'")),
        Just("--enable-lmcache".to_string()),
        Just("--enable-hierarchical-cache --hicache-ratio 2".to_string()),
        Just("'".to_string()),
        Just("\"".to_string()),
        "[ -~]{0,12}".prop_map(|s| s),
        "\\PC{0,4}".prop_map(|s| s),
    ]
}

fn script() -> impl Strategy<Value = String> {
    prop::collection::vec(script_fragment(), 0..10).prop_map(|v| v.join(" "))
}

fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("--kv-transfer-config".to_string()),
        Just(KV.to_string()),
        Just(NIXL.to_string()),
        Just(format!("--kv_transfer_config={KV}")),
        Just("--kv-transfer-config.kv_role=kv_both".to_string()),
        Just("--enable-lmcache".to_string()),
        Just("--enable-lmcache=1".to_string()),
        Just("--lmcache-config-file".to_string()),
        Just("/tmp/x.yaml".to_string()),
        Just("--enable-hierarchical-cache".to_string()),
        Just("--hicache-ratio".to_string()),
        Just("--hicache-size".to_string()),
        Just("--hicache-write-policy=write_back".to_string()),
        Just("2".to_string()),
        Just("-1".to_string()),
        Just("--".to_string()),
        Just("m".to_string()),
        Just("\"$@\"".to_string()),
        Just("--kv-events-config".to_string()),
        Just(r#"{"publisher":"zmq","endpoint":"tcp://*:5557"}"#.to_string()),
        Just("--max-model-len".to_string()),
        Just("vllm".to_string()),
        Just("serve".to_string()),
        Just("-m".to_string()),
        Just("sglang.launch_server".to_string()),
        "[ -~]{0,10}".prop_map(|s| s),
    ]
}

fn command() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!(["vllm", "serve", "m"])),
        Just(json!(["/opt/venv/bin/vllm", "serve"])),
        Just(json!([
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server"
        ])),
        Just(json!(["python3", "-m", "sglang.launch_server"])),
        Just(json!(["/app/server"])),
        Just(json!(["bash", "/start.sh"])),
        Just(json!(["/bin/sh", "-c"])),
        script().prop_map(|s| json!(["/bin/sh", "-c", s])),
        script().prop_map(|s| json!(["bash", "-ec", s, "--"])),
        prop::collection::vec(token(), 0..4).prop_map(|t| {
            let mut v = vec!["vllm".to_string(), "serve".to_string()];
            v.extend(t);
            json!(v)
        }),
    ]
}

fn args() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        prop::collection::vec(token(), 0..6).prop_map(|t| json!(t)),
        script().prop_map(|s| json!([s])),
    ]
}

fn env() -> impl Strategy<Value = Value> {
    let entry = prop_oneof![
        Just(json!({"name": "PYTHONHASHSEED", "value": "123"})),
        Just(json!({"name": "VLLM_USE_V1", "value": "0"})),
        Just(json!({"name": "LMCACHE_CHUNK_SIZE", "value": "64"})),
        Just(json!({"name": "LMCACHE_REMOTE_URL", "value": "lm://x:1"})),
        Just(
            json!({"name": "INFERENCECACHE_FAIL_OPEN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        ),
        Just(json!({"name": "INFERENCECACHE_COMPONENT", "value": "lmcache-mp-worker"})),
        Just(json!({"name": "PATH", "value": "/opt/venv/bin:/usr/bin"})),
        Just(json!({"name": "EXTRA", "value": format!("--kv-transfer-config {KV}")})),
        Just(json!({"name": "EXTRA", "value": "--enable-hierarchical-cache --max-model-len 8"})),
    ];
    prop_oneof![
        Just(Value::Null),
        prop::collection::vec(entry, 0..4).prop_map(|v| json!(v))
    ]
}

fn mounts() -> impl Strategy<Value = Value> {
    let m = prop_oneof![
        Just(json!({"name": "shm", "mountPath": "/dev/shm"})),
        Just(json!({"name": "shm", "mountPath": "/dev/shm", "readOnly": true})),
        Just(json!({"name": "cm", "mountPath": "/dev/shm"})),
        Just(json!({"name": "lmcache-config", "mountPath": "/etc/lmcache"})),
        Just(json!({"name": "lmcache-dshm", "mountPath": "/dev/shm"})),
        Just(json!({"name": "data", "mountPath": "/data"})),
    ];
    prop_oneof![
        Just(Value::Null),
        prop::collection::vec(m, 0..3).prop_map(|v| json!(v))
    ]
}

fn container() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("vllm"),
            Just("sglang"),
            Just("engine"),
            Just("main"),
            Just("kvevent-subscriber"),
            Just("lmcache-mp-worker"),
            Just("lmcache-kernel-check"),
        ],
        prop_oneof![Just("vllm/vllm-openai:v0.9.0"), Just("lmsysorg/sglang:v0.5"), Just("busybox")],
        command(),
        args(),
        env(),
        mounts(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(name, image, command, args, env, mounts, gpu, restricted)| {
            let mut c = json!({"name": name, "image": image});
            for (k, v) in [("command", command), ("args", args), ("env", env), ("volumeMounts", mounts)] {
                if !v.is_null() {
                    c[k] = v;
                }
            }
            if gpu {
                c["resources"] = json!({"limits": {"nvidia.com/gpu": 1}});
            }
            if restricted {
                c["securityContext"] = json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}});
            }
            c
        })
}

fn pod() -> impl Strategy<Value = Value> {
    let volume = prop_oneof![
        Just(json!({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})),
        Just(json!({"name": "cm", "configMap": {"name": "x"}})),
        Just(json!({"name": "lmcache-config", "emptyDir": {}})),
        Just(json!({"name": "lmcache-dshm", "emptyDir": {"medium": "Memory"}})),
        Just(json!({"name": "data", "emptyDir": {}})),
    ];
    let init = prop_oneof![
        Just(json!({"name": "sidecar", "image": "x", "restartPolicy": "Always"})),
        Just(json!({"name": "lmcache-mp-worker", "image": "x"})),
        Just(
            json!({"name": "lmcache-mp-worker", "image": "x", "env": [{"name": "INFERENCECACHE_COMPONENT", "value": "lmcache-mp-worker"}]})
        ),
        Just(json!({"name": "lmcache-kernel-check", "image": "x"})),
        Just(json!({"name": "kvevent-subscriber", "image": "x"})),
    ];
    let annotations = prop_oneof![
        Just(Value::Null),
        Just(
            json!({"inferencecache.io/injected-by": "ns/forged", "inferencecache.io/injected-by-uid": "u"})
        ),
        Just(json!({"inferencecache.io/inject-skipped": "skip-inject-annotation"})),
        Just(json!({"inferencecache.io/skip-inject": "true"})),
        Just(json!({"inferencecache.io/skip-inject": "no"})),
    ];
    (
        prop::collection::vec(container(), 0..4),
        prop::option::of(prop::collection::vec(init, 0..3)),
        prop::option::of(prop::collection::vec(volume, 0..3)),
        annotations,
        prop_oneof![
            Just(json!({"app": "llm"})),
            Just(json!({"app": "llm", "tier": "a"})),
            Just(Value::Null)
        ],
        any::<bool>(),
    )
        .prop_map(
            |(containers, inits, volumes, annotations, labels, host_net)| {
                let mut p = json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "p", "namespace": "ns"},
                    "spec": {"containers": containers}
                });
                if !labels.is_null() {
                    p["metadata"]["labels"] = labels;
                }
                if !annotations.is_null() {
                    p["metadata"]["annotations"] = annotations;
                }
                if let Some(i) = inits {
                    p["spec"]["initContainers"] = json!(i);
                }
                if let Some(v) = volumes {
                    p["spec"]["volumes"] = json!(v);
                }
                if host_net {
                    p["spec"]["dnsPolicy"] = json!("Default");
                }
                p
            },
        )
}

fn backend(i: usize) -> CacheBackend {
    let specs = [
        json!({"runtime": "VLLM"}),
        json!({"runtime": "VLLM", "integration": {"role": "ReadOnly", "engineOverrides": {"args": ["--max-model-len", "4096", "--port=1"], "suppressArgs": ["--kv-transfer-config"], "env": [{"name": "LMCACHE_CHUNK_SIZE", "value": "512"}], "suppressEnv": ["LMCACHE_LOCAL_CPU", "PYTHONHASHSEED"]}}, "remoteStorage": {"provider": "LMCacheServer", "ownership": "External", "endpoint": "lm://s:1"}}),
        json!({"runtime": "VLLM", "integration": {"engineHostNetwork": true}, "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}, "observation": {"modelID": "m"}}),
        json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"}, "observation": {"modelID": "m"}}),
        json!({"runtime": "SGLang"}),
        json!({"runtime": "SGLang", "remoteStorage": {"provider": "Redis", "ownership": "Managed"}, "lmCache": {"hostMemory": {"capacity": "1536Mi"}}, "integration": {"engineOverrides": {"args": ["--page-size 64"]}}}),
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"}}),
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"sizeGB": 10, "writePolicy": "write_back"}, "integration": {"engineOverrides": {"args": ["--hicache-size=20"], "suppressArgs": ["--hicache-write-policy"]}}}),
        json!({"runtime": "VLLM", "lmCache": {"hostMemory": {"capacity": "bogus"}}}),
    ];
    let mut spec = specs[i % specs.len()].clone();
    spec["engineSelector"] = if i.is_multiple_of(2) {
        json!({"matchLabels": {"app": "llm"}})
    } else {
        json!({"matchLabels": {"tier": "a"}})
    };
    let status = match i % specs.len() {
        2 => json!({"endpoint": "mc.ns.svc:50051"}),
        5 => json!({"endpoint": "redis.ns.svc:6379"}),
        _ => json!({}),
    };
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": format!("cb-{i:02}"), "namespace": "ns", "uid": format!("uid-{i}")},
        "spec": spec,
        "status": status
    }))
    .unwrap()
}

/// `PROPTEST_CASES` when set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn check(
    pod: &Value,
    backends: &[CacheBackend],
    cfg: &PodWebhookConfig,
) -> Result<(), TestCaseError> {
    let o = mutate_pod(pod, "ns", backends, cfg);
    prop_assert!(o.allowed);
    prop_assert!(
        !o.reason.contains("internal error"),
        "internal error: {}",
        o.reason
    );
    if o.patch.is_some() {
        let wired = apply(pod, &o);
        prop_assert!(
            serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(wired.clone()).is_ok()
        );
        let again = mutate_pod(&wired, "ns", backends, cfg);
        prop_assert!(again.allowed);
        prop_assert_eq!(
            again.patch,
            None,
            "re-admission must converge: {} / {}",
            o.reason,
            again.reason
        );
        prop_assert_eq!(again.reason, o.reason);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(2000), ..ProptestConfig::default() })]

    #[test]
    fn random_pods_are_always_allowed_and_converge(
        p in pod(),
        picks in prop::collection::vec(0usize..18, 0..3),
        subscriber in any::<bool>(),
    ) {
        let backends: Vec<CacheBackend> = picks.into_iter().map(backend).collect();
        let cfg = PodWebhookConfig {
            kvevent_subscriber_image: subscriber.then(|| "ic-agent:1".to_string()),
            ..Default::default()
        };
        check(&p, &backends, &cfg)?;
    }
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[ -~]{0,8}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("metadata".to_string()),
                    Just("spec".to_string()),
                    Just("containers".to_string()),
                    Just("labels".to_string()),
                    Just("name".to_string()),
                    Just("command".to_string()),
                    Just("args".to_string()),
                    "[a-z]{1,6}".prop_map(|s| s),
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(1000), ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_json_is_always_allowed(v in arbitrary_json(), picks in prop::collection::vec(0usize..18, 0..3)) {
        let backends: Vec<CacheBackend> = picks.into_iter().map(backend).collect();
        check(&v, &backends, &PodWebhookConfig::default())?;
    }
}

/// The generator reaches the interesting decisions (so the properties above are not vacuous):
/// wired pods of every adapter, and several kinds of fail-open.
#[test]
fn generator_reaches_wiring_and_fail_open_paths() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    use std::collections::BTreeMap;

    let mut runner = TestRunner::deterministic();
    let strategy = (pod(), prop::collection::vec(0usize..18, 1..3));
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut injected_by_backend: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..3000 {
        let (p, picks) = strategy.new_tree(&mut runner).unwrap().current();
        let backends: Vec<CacheBackend> = picks.into_iter().map(backend).collect();
        let cfg = PodWebhookConfig {
            kvevent_subscriber_image: Some("ic-agent:1".into()),
            ..Default::default()
        };
        let o = mutate_pod(&p, "ns", &backends, &cfg);
        if o.reason == "Injected" {
            let wired = apply(&p, &o);
            let by = wired["metadata"]["annotations"]["inferencecache.io/injected-by"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let i: usize = by.trim_start_matches("ns/cb-").parse().unwrap_or(99);
            *injected_by_backend
                .entry(format!("spec {}", i % 9))
                .or_default() += 1;
        }
        let key: String = o.reason.split(':').take(2).collect::<Vec<_>>().join(":");
        *reasons.entry(key).or_default() += 1;
    }
    // Every backend spec that can wire did wire some pods (spec 8 has an invalid capacity).
    for spec in 0..8 {
        assert!(
            injected_by_backend
                .get(&format!("spec {spec}"))
                .copied()
                .unwrap_or(0)
                > 0,
            "backend spec {spec} never wired a pod: {injected_by_backend:?}"
        );
    }
    assert!(
        reasons.len() >= 10,
        "too few distinct decisions: {reasons:#?}"
    );
}
