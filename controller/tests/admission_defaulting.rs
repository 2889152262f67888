//! CacheBackend defaulting, one table per default (spec 000 "Admission" → "Defaulting"): the
//! defaulted value, the operator-set values it never clobbers, and the JSON Patch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::admission::defaulting::default_cache_backend;
use ic_controller::admission::review::Operation;
use serde_json::{json, Value};

fn cb(spec: Value) -> Value {
    json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
           "metadata": {"name": "cb", "namespace": "ns"}, "spec": spec})
}

fn defaulted(spec: Value, op: Operation) -> Value {
    let original = cb(spec);
    let d = default_cache_backend(&original, op).unwrap();
    // The patch reproduces the defaulted object from the original.
    let mut patched = original.clone();
    json_patch::patch(&mut patched, &d.patch).unwrap();
    assert_eq!(patched, d.object);
    // Defaulting converges: a second pass changes nothing.
    assert!(default_cache_backend(&d.object, op)
        .unwrap()
        .patch
        .is_empty());
    d.object["spec"].clone()
}

#[test]
fn default_integration() {
    let cases = [
        (
            json!({"runtime": "VLLM"}),
            json!({"mode": "Offload", "role": "ReadWrite", "failOpen": true}),
        ),
        (
            json!({"runtime": "VLLM", "integration": null}),
            json!({"mode": "Offload", "role": "ReadWrite", "failOpen": true}),
        ),
        (
            json!({"runtime": "VLLM", "integration": {}}),
            json!({"mode": "Offload", "role": "ReadWrite", "failOpen": true}),
        ),
        (
            json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"}}),
            json!({"mode": "EventsOnly", "role": "ReadWrite", "failOpen": true}),
        ),
        (
            json!({"runtime": "VLLM", "integration": {"role": "ReadOnly", "failOpen": false}}),
            json!({"mode": "Offload", "role": "ReadOnly", "failOpen": false}),
        ),
        (
            json!({"runtime": "VLLM", "integration": {"engineHostNetwork": true,
                 "engineOverrides": {"args": ["--x"]}}}),
            json!({"mode": "Offload", "role": "ReadWrite", "failOpen": true, "engineHostNetwork": true,
                "engineOverrides": {"args": ["--x"]}}),
        ),
    ];
    for (spec, want) in cases {
        for op in [Operation::Create, Operation::Update] {
            assert_eq!(defaulted(spec.clone(), op)["integration"], want, "{spec}");
        }
    }
}

#[test]
fn default_observation() {
    let cases = [
        (
            json!({"runtime": "VLLM"}),
            json!({"firstEventTimeout": "5m"}),
        ),
        (
            json!({"runtime": "VLLM", "observation": {"modelID": "m"}}),
            json!({"modelID": "m", "firstEventTimeout": "5m"}),
        ),
        (
            json!({"runtime": "VLLM", "observation": {"firstEventTimeout": "10m"}}),
            json!({"firstEventTimeout": "10m"}),
        ),
        (
            json!({"runtime": "VLLM", "observation": {"firstEventTimeout": "0"}}),
            json!({"firstEventTimeout": "0"}),
        ),
    ];
    for (spec, want) in cases {
        assert_eq!(
            defaulted(spec.clone(), Operation::Create)["observation"],
            want,
            "{spec}"
        );
    }
}

#[test]
fn default_autoscaling_min_replicas_first_apply_only() {
    let rs = json!({"provider": "LMCacheServer", "ownership": "Managed"});
    // (spec, operation, expected autoscaling)
    let cases = [
        // CREATE: copied from replicas; the schema default 1 when replicas is unset.
        (
            json!({"runtime": "VLLM", "remoteStorage": rs, "replicas": 3, "autoscaling": {"maxReplicas": 5}}),
            Operation::Create,
            json!({"maxReplicas": 5, "minReplicas": 3}),
        ),
        (
            json!({"runtime": "VLLM", "remoteStorage": rs, "autoscaling": {"maxReplicas": 5}}),
            Operation::Create,
            json!({"maxReplicas": 5, "minReplicas": 1}),
        ),
        (
            json!({"runtime": "VLLM", "remoteStorage": rs, "replicas": 2,
                "autoscaling": {"maxReplicas": 5, "minReplicas": null}}),
            Operation::Create,
            json!({"maxReplicas": 5, "minReplicas": 2}),
        ),
        // Never clobbered.
        (
            json!({"runtime": "VLLM", "remoteStorage": rs, "replicas": 3,
                "autoscaling": {"maxReplicas": 5, "minReplicas": 2}}),
            Operation::Create,
            json!({"maxReplicas": 5, "minReplicas": 2}),
        ),
        // Never from replicas 0 (validation rejects that case instead).
        (
            json!({"runtime": "VLLM", "remoteStorage": rs, "replicas": 0, "autoscaling": {"maxReplicas": 5}}),
            Operation::Create,
            json!({"maxReplicas": 5}),
        ),
        // Not on UPDATE: a later replicas edit does not move the floor, and an unset floor stays
        // unset.
        (
            json!({"runtime": "VLLM", "remoteStorage": rs, "replicas": 4, "autoscaling": {"maxReplicas": 5}}),
            Operation::Update,
            json!({"maxReplicas": 5}),
        ),
    ];
    for (spec, op, want) in cases {
        assert_eq!(
            defaulted(spec.clone(), op)["autoscaling"],
            want,
            "{spec} {op:?}"
        );
    }
    // Without spec.autoscaling nothing is materialised.
    assert!(
        defaulted(json!({"runtime": "VLLM", "replicas": 2}), Operation::Create)
            .get("autoscaling")
            .is_none()
    );
}

#[test]
fn other_fields_are_left_to_the_apiserver_and_untouched() {
    let spec = json!({"runtime": "SGLang", "replicas": 2, "unknownField": {"kept": true},
        "integration": {"mode": "Offload", "role": "ReadWrite", "failOpen": true},
        "observation": {"firstEventTimeout": "5m"}});
    let d = default_cache_backend(&cb(spec.clone()), Operation::Create).unwrap();
    assert!(d.patch.is_empty(), "{:?}", d.patch);
    assert_eq!(d.object["spec"], spec);
}

#[test]
fn patch_is_add_operations_at_exact_paths() {
    let d = default_cache_backend(
        &cb(json!({"runtime": "VLLM", "observation": {"modelID": "m"},
                   "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"},
                   "autoscaling": {"maxReplicas": 4}})),
        Operation::Create,
    )
    .unwrap();
    let mut ops: Vec<Value> = d
        .patch
        .iter()
        .map(|p| serde_json::to_value(p).unwrap())
        .collect();
    ops.sort_by_key(|o| o["path"].as_str().unwrap().to_string());
    assert_eq!(
        ops,
        vec![
            json!({"op": "add", "path": "/spec/autoscaling/minReplicas", "value": 1}),
            json!({"op": "add", "path": "/spec/integration",
                   "value": {"mode": "Offload", "role": "ReadWrite", "failOpen": true}}),
            json!({"op": "add", "path": "/spec/observation/firstEventTimeout", "value": "5m"}),
        ]
    );
}

#[test]
fn missing_or_odd_spec_is_left_for_validation() {
    let obj = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
                     "metadata": {"name": "x"}});
    assert!(default_cache_backend(&obj, Operation::Create)
        .unwrap()
        .patch
        .is_empty());
    let obj = cb(json!({"runtime": "VLLM", "integration": "nope", "observation": 3}));
    assert!(default_cache_backend(&obj, Operation::Create)
        .unwrap()
        .patch
        .is_empty());
}
