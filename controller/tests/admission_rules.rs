//! One table-driven test per CacheBackend validation rule (spec 000 "Admission" → "Validating"
//! and every admission rule stated elsewhere), named `rule_<rule name>`. Each table has
//! accepted cases (the whole pipeline admits them) and rejected cases (the named rule reports
//! exactly the listed field paths and kinds, and the whole pipeline reports them too).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::adapters::{
    BindingKind, InjectContext, InjectError, InjectReport, Registry, RuntimeAdapter,
};
use ic_controller::admission::review::Operation;
use ic_controller::admission::validation::{
    schema, Outcome, RuleContext, Validator, Violation, ViolationKind,
};
use ic_shared::crd::{CacheType, Runtime};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use ViolationKind::{Forbidden, Invalid, NotSupported, Required};

const NS: &str = "team-a";

fn cb(spec: Value) -> Value {
    json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
           "metadata": {"name": "cb", "namespace": NS}, "spec": spec})
}

fn cb_with_annotations(annotations: Value, spec: Value) -> Value {
    let mut v = cb(spec);
    v["metadata"]["annotations"] = annotations;
    v
}

fn registry() -> Registry {
    Registry::builtin()
}

fn ctx(reg: &Registry) -> RuleContext<'_> {
    RuleContext {
        namespace: NS,
        registry: reg,
        operation: Operation::Create,
    }
}

fn full(obj: &Value) -> Outcome {
    let reg = registry();
    Validator::builtin().validate_value(obj, &ctx(&reg))
}

fn only_rule(name: &str, obj: &Value) -> Vec<Violation> {
    let reg = registry();
    let v = Validator::builtin();
    let rule = v
        .rule(name)
        .unwrap_or_else(|| panic!("no rule named {name}"));
    let decoded = schema::decode(obj).expect("case decodes");
    rule.check(&decoded, &ctx(&reg))
}

type Expect = &'static [(&'static str, ViolationKind)];

/// Asserts the table of one rule.
fn table(rule: &str, accepted: &[Value], rejected: &[(Value, Expect)]) {
    for obj in accepted {
        let out = full(obj);
        assert!(
            out.is_valid(),
            "{rule}: expected accepted, got {:#?}\nfor {obj}",
            out.violations
        );
        assert!(only_rule(rule, obj).is_empty(), "{rule}: {obj}");
    }
    for (obj, expect) in rejected {
        let got: Vec<(String, ViolationKind)> = only_rule(rule, obj)
            .into_iter()
            .map(|v| (v.field, v.kind))
            .collect();
        let want: Vec<(String, ViolationKind)> =
            expect.iter().map(|(f, k)| (f.to_string(), *k)).collect();
        assert_eq!(got, want, "{rule}: for {obj}");
        let out = full(obj);
        for (f, k) in &want {
            assert!(
                out.violations.iter().any(|v| &v.field == f && v.kind == *k),
                "{rule}: full pipeline lacks {f} {k:?}: {:#?}",
                out.violations
            );
        }
    }
}

#[test]
fn every_rule_has_a_test_named_after_it() {
    let src = include_str!("admission_rules.rs");
    for name in Validator::builtin().rule_names() {
        assert!(
            src.contains(&format!("fn rule_{name}()")),
            "rule {name} has no test named rule_{name}"
        );
    }
}

#[test]
fn rule_schema_matches_crd() {
    // The schema stage runs before the rules (types, enums, required, bounds, duration).
    let cases: &[(Value, &str, ViolationKind)] = &[
        (json!({"type": "LMCache"}), "spec.runtime", Required),
        (json!({"runtime": "vllm"}), "spec.runtime", NotSupported),
        (
            json!({"runtime": "VLLM", "type": "Mooncake"}),
            "spec.type",
            NotSupported,
        ),
        (
            json!({"runtime": "VLLM", "replicas": -1}),
            "spec.replicas",
            Invalid,
        ),
        (
            json!({"runtime": "VLLM", "replicas": "2"}),
            "spec.replicas",
            Invalid,
        ),
        (
            json!({"runtime": "VLLM", "lmCache": {"workerPort": 70000}}),
            "spec.lmCache.workerPort",
            Invalid,
        ),
        (
            json!({"runtime": "VLLM", "observation": {"firstEventTimeout": "5 minutes"}}),
            "spec.observation.firstEventTimeout",
            Invalid,
        ),
        (
            json!({"runtime": "VLLM", "remoteStorage": {"provider": "Redis"}}),
            "spec.remoteStorage.ownership",
            Required,
        ),
        (
            json!({"runtime": "VLLM", "integration": {"mode": "Events"}}),
            "spec.integration.mode",
            NotSupported,
        ),
    ];
    for (spec, field, kind) in cases {
        let out = full(&cb(spec.clone()));
        assert!(
            out.violations
                .iter()
                .any(|v| v.field == *field && v.kind == *kind),
            "{spec}: {:#?}",
            out.violations
        );
    }
    let out = full(&cb(json!({"runtime": "VLLM", "type": "External"})));
    assert_eq!(
        out.at("spec.type")[0].to_string(),
        r#"spec.type: Unsupported value: "External": supported values: "LMCache", "SGLangHiCache""#
    );
    let out = full(&cb(json!({"runtime": "VLLM", "replicass": 2})));
    assert!(out.is_valid());
    assert_eq!(
        out.warnings,
        vec![r#"unknown field "spec.replicass""#.to_string()]
    );
}

#[test]
fn rule_cache_hierarchy_consistent() {
    table(
        "cache_hierarchy_consistent",
        &[
            cb(
                json!({"runtime": "SGLang", "type": "LMCache", "lmCache": {"chunkSizeTokens": 256},
                      "remoteStorage": {"provider": "Redis", "ownership": "Managed",
                                        "redis": {"image": "redis:7"}}}),
            ),
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "Mooncake", "ownership": "Managed",
                      "mooncake": {"image": "m"}}, "integration": {"engineHostNetwork": true}}),
            ),
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed"}, "autoscaling": {"maxReplicas": 3, "minReplicas": 1}}),
            ),
        ],
        &[
            (
                cb(
                    json!({"runtime": "SGLang", "remoteStorage": {"provider": "Redis", "ownership": "Managed",
                          "mooncake": {"image": "m"}}}),
                ),
                &[("spec.remoteStorage.mooncake", Forbidden)],
            ),
            (
                cb(
                    json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                          "ownership": "External", "endpoint": "lm://x:1",
                          "lmCacheServer": {"image": "i"}}}),
                ),
                &[("spec.remoteStorage.lmCacheServer", Forbidden)],
            ),
            (
                cb(
                    json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"},
                          "lmCache": {"chunkSizeTokens": 256}}),
                ),
                &[("spec.lmCache", Forbidden)],
            ),
            (
                cb(json!({"runtime": "SGLang", "hiCache": {"ratio": "2"}})),
                &[("spec.hiCache", Forbidden)],
            ),
            (
                cb(json!({"runtime": "VLLM", "autoscaling": {"maxReplicas": 2, "minReplicas": 1}})),
                &[("spec.autoscaling", Forbidden)],
            ),
        ],
    );
    // Events-only autoscaling is reported once, by the events-only rule.
    assert!(only_rule(
        "cache_hierarchy_consistent",
        &cb(
            json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"},
                   "autoscaling": {"maxReplicas": 2, "minReplicas": 1}})
        )
    )
    .is_empty());
    // Inert settings warn.
    let out = full(&cb(
        json!({"runtime": "VLLM", "template": {"priorityClassName": "x"}}),
    ));
    assert!(out.is_valid());
    assert!(out
        .warnings
        .iter()
        .any(|w| w.contains("spec.template has no effect")));
}

#[test]
fn rule_endpoint_ownership_explicit() {
    table(
        "endpoint_ownership_explicit",
        &[
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "External", "endpoint": "lm://lmcache:65432"}}),
            ),
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed"}}),
            ),
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed", "endpoint": "   "}}),
            ),
        ],
        &[
            (
                cb(
                    json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                          "ownership": "External"}}),
                ),
                &[("spec.remoteStorage.endpoint", Required)],
            ),
            (
                cb(
                    json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                          "ownership": "External", "endpoint": " \t "}}),
                ),
                &[("spec.remoteStorage.endpoint", Required)],
            ),
            (
                cb(
                    json!({"runtime": "SGLang", "remoteStorage": {"provider": "Redis",
                          "ownership": "Managed", "endpoint": "redis:6379"}}),
                ),
                &[("spec.remoteStorage.endpoint", Forbidden)],
            ),
        ],
    );
}

fn external(runtime: &str, provider: &str, endpoint: &str) -> Value {
    cb(
        json!({"runtime": runtime, "remoteStorage": {"provider": provider, "ownership": "External",
              "endpoint": endpoint}, "integration": {"engineHostNetwork": provider == "Mooncake"}}),
    )
}

#[test]
fn rule_endpoint_scheme_belongs_to_provider() {
    table(
        "endpoint_scheme_belongs_to_provider",
        &[
            external("VLLM", "LMCacheServer", "lm://lmcache:65432"),
            external("VLLM", "LMCacheServer", "lmcache:65432"),
            external("VLLM", "Mooncake", "mooncakestore://mc:50051"),
            external("VLLM", "Mooncake", "mc:50051"),
            external("SGLang", "Redis", "redis:6379"),
        ],
        &[
            (
                external("SGLang", "Redis", "lm://redis:6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis://redis:6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("VLLM", "LMCacheServer", "mooncakestore://x:1"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("VLLM", "Mooncake", "lm://x:1"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("VLLM", "LMCacheServer", "http://x:1"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
        ],
    );
    let out = full(&external("SGLang", "Redis", "lm://redis:6379"));
    assert_eq!(
        out.at("spec.remoteStorage.endpoint")[0].to_string(),
        r#"spec.remoteStorage.endpoint: Invalid value: "lm://redis:6379": scheme "lm://" belongs to provider LMCacheServer; Redis accepts only bare host:port"#
    );
}

#[test]
fn rule_endpoint_shape_valid() {
    table(
        "endpoint_shape_valid",
        &[
            external("SGLang", "Redis", "[fd00::1]:6379"),
            external("SGLang", "Redis", "10.0.0.7:6379"),
            external("SGLang", "Redis", "  redis.example.com:6379  "),
            external("VLLM", "LMCacheServer", "lm://[::1]:65535"),
            external("SGLang", "Redis", "redis:1"),
        ],
        &[
            (
                external("SGLang", "Redis", "redis"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis:0"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis:65536"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis:http"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "red is:6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis:6379/0"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis:6379?db=1"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "redis:6379#x"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "fd00::1:6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "[nope]:6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", ":6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("SGLang", "Redis", "user@redis:6379"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
            (
                external("VLLM", "LMCacheServer", "lm://x:000080"),
                &[("spec.remoteStorage.endpoint", Invalid)],
            ),
        ],
    );
}

#[test]
fn rule_cross_namespace_endpoint_requires_opt_in() {
    let mut allowed = external("SGLang", "Redis", "redis.cache.svc.cluster.local:6379");
    allowed["spec"]["allowCrossNamespace"] = json!(true);
    table(
        "cross_namespace_endpoint_requires_opt_in",
        &[
            external("SGLang", "Redis", "redis.team-a.svc:6379"),
            external("SGLang", "Redis", "redis.team-a.svc.cluster.local:6379"),
            external("SGLang", "Redis", "redis:6379"),
            external("SGLang", "Redis", "redis.cache:6379"),
            external("SGLang", "Redis", "redis.example.com:6379"),
            external("SGLang", "Redis", "10.1.2.3:6379"),
            allowed,
        ],
        &[
            (
                external("SGLang", "Redis", "redis.cache.svc:6379"),
                &[("spec.remoteStorage.endpoint", Forbidden)],
            ),
            (
                external(
                    "VLLM",
                    "LMCacheServer",
                    "lm://lmc.other.svc.cluster.local:65432",
                ),
                &[("spec.remoteStorage.endpoint", Forbidden)],
            ),
        ],
    );
}

#[test]
fn rule_replicas_zero_autoscaling_requires_min_replicas() {
    table(
        "replicas_zero_autoscaling_requires_min_replicas",
        &[
            cb(
                json!({"runtime": "VLLM", "replicas": 0, "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed"}, "autoscaling": {"maxReplicas": 3, "minReplicas": 1}}),
            ),
            cb(
                json!({"runtime": "VLLM", "replicas": 0, "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed"}}),
            ),
        ],
        &[(
            cb(
                json!({"runtime": "VLLM", "replicas": 0, "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed"}, "autoscaling": {"maxReplicas": 3}}),
            ),
            &[("spec.autoscaling.minReplicas", Required)],
        )],
    );
}

#[test]
fn rule_autoscaling_min_not_above_max() {
    table(
        "autoscaling_min_not_above_max",
        &[cb(
            json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                     "ownership": "Managed"}, "autoscaling": {"maxReplicas": 3, "minReplicas": 3}}),
        )],
        &[(
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                      "ownership": "Managed"}, "autoscaling": {"maxReplicas": 2, "minReplicas": 3}}),
            ),
            &[("spec.autoscaling.minReplicas", Invalid)],
        )],
    );
}

fn mooncake(extra: Value) -> Value {
    let mut spec = json!({"runtime": "VLLM", "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"},
                          "integration": {"engineHostNetwork": true}});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    cb(spec)
}

#[test]
fn rule_mooncake_singleton() {
    table(
        "mooncake_singleton",
        &[
            mooncake(json!({"replicas": 1})),
            mooncake(json!({"replicas": 0})),
            mooncake(json!({})),
        ],
        &[
            (
                mooncake(json!({"replicas": 2})),
                &[("spec.replicas", Invalid)],
            ),
            (
                mooncake(json!({"autoscaling": {"maxReplicas": 2, "minReplicas": 1}})),
                &[("spec.autoscaling", Forbidden)],
            ),
            (
                mooncake(
                    json!({"replicas": 3, "autoscaling": {"maxReplicas": 4, "minReplicas": 3}}),
                ),
                &[("spec.replicas", Invalid), ("spec.autoscaling", Forbidden)],
            ),
        ],
    );
}

#[test]
fn rule_engine_host_network_only_where_needed() {
    table(
        "engine_host_network_only_where_needed",
        &[
            mooncake(json!({})),
            external("VLLM", "Mooncake", "mooncakestore://mc:50051"),
            cb(json!({"runtime": "VLLM", "integration": {"engineHostNetwork": false}})),
        ],
        &[
            (
                cb(json!({"runtime": "VLLM", "integration": {"engineHostNetwork": true}})),
                &[("spec.integration.engineHostNetwork", Forbidden)],
            ),
            (
                cb(
                    json!({"runtime": "SGLang", "remoteStorage": {"provider": "Redis", "ownership": "Managed"},
                          "integration": {"engineHostNetwork": true}}),
                ),
                &[("spec.integration.engineHostNetwork", Forbidden)],
            ),
        ],
    );
    // The warning on every Mooncake apply without the flag.
    let out = full(&cb(json!({"runtime": "VLLM",
        "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}})));
    assert!(out.is_valid(), "{:#?}", out.violations);
    assert!(
        out.warnings
            .iter()
            .any(|w| w.starts_with("spec.integration.engineHostNetwork is not set")),
        "{:?}",
        out.warnings
    );
    assert!(!full(&mooncake(json!({})))
        .warnings
        .iter()
        .any(|w| w.contains("engineHostNetwork")));
}

#[test]
fn rule_sglang_role_read_write_only() {
    table(
        "sglang_role_read_write_only",
        &[
            cb(json!({"runtime": "SGLang", "integration": {"role": "ReadWrite"}})),
            cb(json!({"runtime": "SGLang"})),
            cb(json!({"runtime": "VLLM", "integration": {"role": "ReadOnly"}})),
            cb(json!({"runtime": "VLLM", "integration": {"role": "WriteOnly"}})),
        ],
        &[
            (
                cb(json!({"runtime": "SGLang", "integration": {"role": "ReadOnly"}})),
                &[("spec.integration.role", NotSupported)],
            ),
            (
                cb(json!({"runtime": "SGLang", "integration": {"role": "WriteOnly"}})),
                &[("spec.integration.role", NotSupported)],
            ),
            (
                cb(
                    json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"sizeGB": 8},
                          "integration": {"role": "ReadOnly"}}),
                ),
                &[("spec.integration.role", NotSupported)],
            ),
        ],
    );
}

fn hicache(hc: Value) -> Value {
    cb(json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": hc}))
}

#[test]
fn rule_hicache_config_valid() {
    table(
        "hicache_config_valid",
        &[
            hicache(json!({"ratio": "2.0"})),
            hicache(
                json!({"ratio": "0.5", "writePolicy": "write_through_selective",
                           "ioBackend": "kernel_ascend", "memoryLayout": "page_first_kv_split"}),
            ),
            hicache(
                json!({"sizeGB": 64, "writePolicy": "write_back", "ioBackend": "direct",
                           "memoryLayout": "page_head"}),
            ),
        ],
        &[
            (
                cb(json!({"runtime": "SGLang", "type": "SGLangHiCache"})),
                &[("spec.hiCache", Required)],
            ),
            (hicache(json!({})), &[("spec.hiCache", Required)]),
            (
                hicache(json!({"ratio": "2", "sizeGB": 4})),
                &[("spec.hiCache.sizeGB", Forbidden)],
            ),
            (
                hicache(json!({"ratio": "0"})),
                &[("spec.hiCache.ratio", Invalid)],
            ),
            (
                hicache(json!({"ratio": "-1"})),
                &[("spec.hiCache.ratio", Invalid)],
            ),
            (
                hicache(json!({"ratio": "inf"})),
                &[("spec.hiCache.ratio", Invalid)],
            ),
            (
                hicache(json!({"ratio": "NaN"})),
                &[("spec.hiCache.ratio", Invalid)],
            ),
            (
                hicache(json!({"ratio": "two"})),
                &[("spec.hiCache.ratio", Invalid)],
            ),
            (
                hicache(json!({"ratio": " 2"})),
                &[("spec.hiCache.ratio", Invalid)],
            ),
            (
                hicache(json!({"sizeGB": 0})),
                &[("spec.hiCache.sizeGB", Invalid)],
            ),
        ],
    );
    // Enum values: rejected before decoding, naming the supported values.
    for (field, bad) in [
        ("writePolicy", "write_thru"),
        ("ioBackend", "io_uring"),
        ("memoryLayout", "layer-first"),
    ] {
        let out = full(&hicache(json!({"ratio": "2", field: bad})));
        let v = out.at(&format!("spec.hiCache.{field}"));
        assert_eq!(v.len(), 1, "{field}: {:#?}", out.violations);
        assert_eq!(v[0].kind, NotSupported);
        assert!(v[0].detail.starts_with("supported values: "), "{}", v[0]);
    }
}

#[test]
fn rule_lmcache_host_memory_positive() {
    table(
        "lmcache_host_memory_positive",
        &[
            cb(json!({"runtime": "SGLang", "lmCache": {"hostMemory": {"capacity": "32Gi"}}})),
            cb(json!({"runtime": "SGLang", "lmCache": {"hostMemory": {"capacity": 1}}})),
        ],
        &[
            (
                cb(json!({"runtime": "SGLang", "lmCache": {"hostMemory": {"capacity": "0"}}})),
                &[("spec.lmCache.hostMemory.capacity", Invalid)],
            ),
            (
                cb(json!({"runtime": "SGLang", "lmCache": {"hostMemory": {"capacity": "-4Gi"}}})),
                &[("spec.lmCache.hostMemory.capacity", Invalid)],
            ),
            (
                cb(json!({"runtime": "SGLang", "lmCache": {"hostMemory": {"capacity": "lots"}}})),
                &[("spec.lmCache.hostMemory.capacity", Invalid)],
            ),
        ],
    );
}

#[test]
fn rule_lmcache_kernel_check_annotation_valid() {
    let key = "inferencecache.io/lmcache-kernel-check";
    let mut accepted = vec![cb(json!({"runtime": "VLLM"}))];
    for v in ["auto", "report-only", "strict", "off"] {
        accepted.push(cb_with_annotations(
            json!({key: v}),
            json!({"runtime": "VLLM"}),
        ));
    }
    accepted.push(cb_with_annotations(
        json!({key: "strict"}),
        json!({"runtime": "SGLang"}),
    ));
    const FIELD: &str = "metadata.annotations[inferencecache.io/lmcache-kernel-check]";
    table(
        "lmcache_kernel_check_annotation_valid",
        &accepted,
        &[
            (
                cb_with_annotations(json!({key: "strcit"}), json!({"runtime": "VLLM"})),
                &[(FIELD, NotSupported)],
            ),
            (
                cb_with_annotations(json!({key: "Strict"}), json!({"runtime": "VLLM"})),
                &[(FIELD, NotSupported)],
            ),
            (
                cb_with_annotations(json!({key: ""}), json!({"runtime": "SGLang"})),
                &[(FIELD, NotSupported)],
            ),
        ],
    );
    let out = full(&cb_with_annotations(
        json!({key: "strcit"}),
        json!({"runtime": "VLLM"}),
    ));
    assert_eq!(
        out.violations[0].to_string(),
        format!(
            r#"{FIELD}: Unsupported value: "strcit": supported values: "auto", "report-only", "strict", "off""#
        )
    );
}

#[test]
fn rule_events_only_requires_lmcache() {
    table(
        "events_only_requires_lmcache",
        &[
            cb(json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"}})),
            cb(
                json!({"runtime": "SGLang", "type": "LMCache", "integration": {"mode": "EventsOnly"}}),
            ),
        ],
        &[(
            cb(
                json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"},
                      "integration": {"mode": "EventsOnly"}}),
            ),
            &[("spec.type", Invalid)],
        )],
    );
    let out = full(&cb(
        json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"},
                              "lmCache": {"chunkSizeTokens": 256}}),
    ));
    assert!(out.is_valid());
    assert!(out
        .warnings
        .iter()
        .any(|w| w.starts_with("spec.lmCache is ignored")));
}

#[test]
fn rule_events_only_forbids_remote_storage() {
    table(
        "events_only_forbids_remote_storage",
        &[cb(
            json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"}}),
        )],
        &[
            (
                cb(
                    json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"},
                          "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"}}),
                ),
                &[("spec.remoteStorage", Forbidden)],
            ),
            (
                cb(
                    json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"},
                          "remoteStorage": {"provider": "LMCacheServer", "ownership": "External",
                                            "endpoint": "lm://x:1"}}),
                ),
                &[("spec.remoteStorage", Forbidden)],
            ),
        ],
    );
}

#[test]
fn rule_events_only_forbids_autoscaling() {
    table(
        "events_only_forbids_autoscaling",
        &[cb(
            json!({"runtime": "SGLang", "integration": {"mode": "EventsOnly"}}),
        )],
        &[(
            cb(
                json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"},
                      "autoscaling": {"maxReplicas": 2, "minReplicas": 1}}),
            ),
            &[("spec.autoscaling", Forbidden)],
        )],
    );
}

fn redis_resources(res: Value) -> Value {
    cb(
        json!({"runtime": "SGLang", "remoteStorage": {"provider": "Redis", "ownership": "Managed",
              "redis": {"resources": res}}}),
    )
}

const R: &str = "spec.remoteStorage.redis.resources";

#[test]
fn rule_provider_resource_names_valid() {
    table(
        "provider_resource_names_valid",
        &[redis_resources(json!({
            "requests": {"cpu": "1", "memory": "4Gi", "ephemeral-storage": "1Gi",
                         "hugepages-2Mi": "4Mi", "nvidia.com/gpu": "1"},
            "limits": {"memory": "8Gi", "hugepages-2Mi": "4Mi", "nvidia.com/gpu": "1",
                       "example.com/foo": "2"}}))],
        &[
            (
                redis_resources(json!({"limits": {"foo": "1"}})),
                &[("spec.remoteStorage.redis.resources.limits[foo]", Invalid)],
            ),
            (
                redis_resources(json!({"requests": {"": "1"}})),
                &[("spec.remoteStorage.redis.resources.requests[]", Invalid)],
            ),
            (
                redis_resources(json!({"limits": {"hugepages-": "2Mi", "hugepages-nope": "2Mi"}})),
                &[
                    (
                        "spec.remoteStorage.redis.resources.limits[hugepages-]",
                        Invalid,
                    ),
                    (
                        "spec.remoteStorage.redis.resources.limits[hugepages-nope]",
                        Invalid,
                    ),
                ],
            ),
            (
                redis_resources(json!({"limits": {"kubernetes.io/foo": "1",
                                                  "requests.kubernetes.io/bar": "1"}})),
                &[
                    (
                        "spec.remoteStorage.redis.resources.limits[kubernetes.io/foo]",
                        Invalid,
                    ),
                    (
                        "spec.remoteStorage.redis.resources.limits[requests.kubernetes.io/bar]",
                        Invalid,
                    ),
                ],
            ),
        ],
    );
    // Only the selected provider's block is checked, at its own path.
    let out = full(&cb(
        json!({"runtime": "VLLM", "remoteStorage": {"provider": "Mooncake",
        "ownership": "Managed", "mooncake": {"resources": {"limits": {"foo": "1"}}}},
        "integration": {"engineHostNetwork": true}}),
    ));
    assert_eq!(
        out.violations[0].field,
        "spec.remoteStorage.mooncake.resources.limits[foo]"
    );
}

#[test]
fn rule_provider_resource_quantities_non_negative() {
    table(
        "provider_resource_quantities_non_negative",
        &[redis_resources(
            json!({"requests": {"cpu": "0", "memory": "0"}}),
        )],
        &[
            (
                redis_resources(json!({"requests": {"memory": "-1Gi"}})),
                &[(
                    "spec.remoteStorage.redis.resources.requests[memory]",
                    Invalid,
                )],
            ),
            (
                redis_resources(json!({"limits": {"cpu": "-250m"}, "requests": {"cpu": "bogus"}})),
                &[
                    ("spec.remoteStorage.redis.resources.requests[cpu]", Invalid),
                    ("spec.remoteStorage.redis.resources.limits[cpu]", Invalid),
                ],
            ),
        ],
    );
    let _ = R;
}

#[test]
fn rule_provider_resource_limits_cover_requests() {
    table(
        "provider_resource_limits_cover_requests",
        &[
            redis_resources(json!({"requests": {"memory": "4Gi", "cpu": "500m"},
                                   "limits": {"memory": "4096Mi", "cpu": "1"}})),
            redis_resources(
                json!({"requests": {"hugepages-2Mi": "4Mi", "nvidia.com/gpu": "1"},
                                   "limits": {"hugepages-2Mi": "4Mi", "nvidia.com/gpu": "1"}}),
            ),
            redis_resources(json!({"limits": {"memory": "1Gi", "nvidia.com/gpu": "2"}})),
        ],
        &[
            (
                redis_resources(
                    json!({"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}),
                ),
                &[(
                    "spec.remoteStorage.redis.resources.requests[memory]",
                    Invalid,
                )],
            ),
            (
                redis_resources(json!({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}})),
                &[("spec.remoteStorage.redis.resources.requests[cpu]", Invalid)],
            ),
            (
                redis_resources(
                    json!({"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}}),
                ),
                &[(
                    "spec.remoteStorage.redis.resources.requests[nvidia.com/gpu]",
                    Invalid,
                )],
            ),
            (
                redis_resources(
                    json!({"requests": {"hugepages-1Gi": "2Gi"}, "limits": {"hugepages-1Gi": "1Gi"}}),
                ),
                &[(
                    "spec.remoteStorage.redis.resources.requests[hugepages-1Gi]",
                    Invalid,
                )],
            ),
        ],
    );
}

#[test]
fn rule_provider_resource_requests_only_overcommittable() {
    table(
        "provider_resource_requests_only_overcommittable",
        &[redis_resources(
            json!({"requests": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}}),
        )],
        &[
            (
                redis_resources(json!({"requests": {"nvidia.com/gpu": "1"}})),
                &[(
                    "spec.remoteStorage.redis.resources.limits[nvidia.com/gpu]",
                    Required,
                )],
            ),
            (
                redis_resources(
                    json!({"requests": {"hugepages-2Mi": "2Mi"}, "limits": {"memory": "1Gi"}}),
                ),
                &[(
                    "spec.remoteStorage.redis.resources.limits[hugepages-2Mi]",
                    Required,
                )],
            ),
        ],
    );
}

#[test]
fn rule_provider_resource_claims_unsupported() {
    table(
        "provider_resource_claims_unsupported",
        &[
            redis_resources(json!({"claims": []})),
            redis_resources(json!({"limits": {"memory": "1Gi"}})),
        ],
        &[(
            redis_resources(json!({"claims": [{"name": "gpu"}]})),
            &[("spec.remoteStorage.redis.resources.claims", Forbidden)],
        )],
    );
}

#[test]
fn rule_provider_extended_resources_integral() {
    table(
        "provider_extended_resources_integral",
        &[
            redis_resources(json!({"limits": {"nvidia.com/gpu": "2", "cpu": "250m"}})),
            redis_resources(json!({"limits": {"example.com/dev": "1k"}})),
        ],
        &[
            (
                redis_resources(json!({"limits": {"nvidia.com/gpu": "500m"}})),
                &[(
                    "spec.remoteStorage.redis.resources.limits[nvidia.com/gpu]",
                    Invalid,
                )],
            ),
            (
                redis_resources(
                    json!({"requests": {"nvidia.com/gpu": "1.5"}, "limits": {"nvidia.com/gpu": "1.5"}}),
                ),
                &[
                    (
                        "spec.remoteStorage.redis.resources.requests[nvidia.com/gpu]",
                        Invalid,
                    ),
                    (
                        "spec.remoteStorage.redis.resources.limits[nvidia.com/gpu]",
                        Invalid,
                    ),
                ],
            ),
        ],
    );
}

#[test]
fn rule_provider_hugepages_aligned() {
    table(
        "provider_hugepages_aligned",
        &[
            redis_resources(json!({"limits": {"hugepages-2Mi": "4Mi", "hugepages-1Gi": "0"}})),
            redis_resources(json!({"limits": {"hugepages-1Gi": "2Gi"}})),
        ],
        &[
            (
                redis_resources(json!({"limits": {"hugepages-2Mi": "3Mi"}})),
                &[(
                    "spec.remoteStorage.redis.resources.limits[hugepages-2Mi]",
                    Invalid,
                )],
            ),
            (
                redis_resources(json!({"requests": {"hugepages-1Gi": "1536Mi"},
                                       "limits": {"hugepages-1Gi": "1536Mi"}})),
                &[
                    (
                        "spec.remoteStorage.redis.resources.requests[hugepages-1Gi]",
                        Invalid,
                    ),
                    (
                        "spec.remoteStorage.redis.resources.limits[hugepages-1Gi]",
                        Invalid,
                    ),
                ],
            ),
        ],
    );
}

#[test]
fn rule_runtime_pair_supported() {
    table(
        "runtime_pair_supported",
        &[
            cb(json!({"runtime": "VLLM", "type": "LMCache"})),
            cb(json!({"runtime": "SGLang", "type": "LMCache"})),
            cb(json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"}})),
        ],
        &[(
            cb(json!({"runtime": "VLLM", "type": "SGLangHiCache", "hiCache": {"ratio": "2"}})),
            &[("spec.type", NotSupported)],
        )],
    );
    let out = full(&cb(
        json!({"runtime": "VLLM", "type": "SGLangHiCache", "hiCache": {"ratio": "2"}}),
    ));
    let msg = out.at("spec.type")[0].to_string();
    assert!(
        msg.contains("supported pairs: VLLM/LMCache, SGLang/LMCache, SGLang/SGLangHiCache"),
        "{msg}"
    );
}

#[test]
fn rule_engine_wire_accepts_binding() {
    table(
        "engine_wire_accepts_binding",
        &[
            cb(json!({"runtime": "VLLM"})),
            cb(
                json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"}}),
            ),
            mooncake(json!({})),
            cb(
                json!({"runtime": "SGLang", "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
            ),
            cb(json!({"runtime": "SGLang"})),
            hicache(json!({"sizeGB": 8})),
        ],
        &[
            (
                cb(
                    json!({"runtime": "VLLM", "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
                ),
                &[("spec.remoteStorage.provider", NotSupported)],
            ),
            (
                cb(
                    json!({"runtime": "SGLang", "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"}}),
                ),
                &[("spec.remoteStorage.provider", NotSupported)],
            ),
            (
                cb(
                    json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"},
                          "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
                ),
                &[("spec.remoteStorage.provider", NotSupported)],
            ),
        ],
    );
    let out = full(&cb(
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2"},
                              "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
    ));
    let msg = out.at("spec.remoteStorage.provider")[0].to_string();
    assert!(
        msg.contains("does not accept a resp binding; it accepts: host-only"),
        "{msg}"
    );
}

fn overrides(runtime: &str, ov: Value) -> Value {
    cb(json!({"runtime": runtime, "integration": {"engineOverrides": ov}}))
}

#[test]
fn rule_engine_overrides_not_reserved() {
    const B: &str = "spec.integration.engineOverrides";
    table(
        "engine_overrides_not_reserved",
        &[
            overrides(
                "VLLM",
                json!({"args": ["--max-model-len=8192"], "suppressArgs": ["--foo"],
                "env": [{"name": "LMCACHE_CHUNK_SIZE", "value": "512"},
                        {"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": "20"}],
                "suppressEnv": ["LMCACHE_LOCAL_CPU"]}),
            ),
            // VLLM_USE_V1 / PYTHONHASHSEED / LMCACHE_REMOTE_URL are not reserved for SGLang.
            overrides(
                "SGLang",
                json!({"env": [{"name": "VLLM_USE_V1", "value": "0"},
                {"name": "PYTHONHASHSEED", "value": "1"}, {"name": "LMCACHE_REMOTE_URL", "value": "x"}],
                "args": ["--kv-transfer-config={}"]}),
            ),
        ],
        &[
            (
                overrides(
                    "VLLM",
                    json!({"args": ["--kv-transfer-config={\"kv_connector\":\"X\"}"]}),
                ),
                &[("spec.integration.engineOverrides.args[0]", Forbidden)],
            ),
            (
                overrides(
                    "VLLM",
                    json!({"args": ["--max-model-len=1", "--kv_transfer_config", "{}"],
                                         "suppressArgs": ["--kv-transfer-config"]}),
                ),
                &[
                    ("spec.integration.engineOverrides.args[1]", Forbidden),
                    (
                        "spec.integration.engineOverrides.suppressArgs[0]",
                        Forbidden,
                    ),
                ],
            ),
            (
                overrides(
                    "VLLM",
                    json!({"env": [{"name": "PYTHONHASHSEED", "value": "1"},
                    {"name": "LMCACHE_REMOTE_URL", "value": "lm://x:1"}, {"name": "VLLM_USE_V1", "value": "0"},
                    {"name": "INFERENCECACHE_FAIL_OPEN", "value": "false"}],
                    "suppressEnv": ["PYTHONHASHSEED"]}),
                ),
                &[
                    ("spec.integration.engineOverrides.env[0].name", Forbidden),
                    ("spec.integration.engineOverrides.env[1].name", Forbidden),
                    ("spec.integration.engineOverrides.env[2].name", Forbidden),
                    ("spec.integration.engineOverrides.env[3].name", Forbidden),
                    ("spec.integration.engineOverrides.suppressEnv[0]", Forbidden),
                ],
            ),
            (
                overrides(
                    "SGLang",
                    json!({"args": ["--enable-lmcache"],
                    "suppressArgs": ["--lmcache-config-file"],
                    "env": [{"name": "LMCACHE_USE_EXPERIMENTAL", "value": "False"}],
                    "suppressEnv": ["INFERENCECACHE_FAIL_OPEN"]}),
                ),
                &[
                    ("spec.integration.engineOverrides.args[0]", Forbidden),
                    (
                        "spec.integration.engineOverrides.suppressArgs[0]",
                        Forbidden,
                    ),
                    ("spec.integration.engineOverrides.env[0].name", Forbidden),
                    ("spec.integration.engineOverrides.suppressEnv[0]", Forbidden),
                ],
            ),
        ],
    );
    let out = full(&overrides(
        "VLLM",
        json!({"suppressArgs": ["--kv-transfer-config"]}),
    ));
    let msg = out.at(&format!("{B}.suppressArgs[0]"))[0].to_string();
    assert!(
        msg.contains("\"--kv-transfer-config\"") && msg.contains("vllm"),
        "{msg}"
    );
}

#[test]
fn rule_mooncake_command_keeps_fixed_ports() {
    // Warning-only rule: never rejects.
    let obj = mooncake(json!({}));
    let mut moved = obj.clone();
    moved["spec"]["remoteStorage"]["mooncake"] = json!({"command":
        ["mooncake_master", "--rpc_port=50052", "--http_metadata_server_port", "8081"]});
    table(
        "mooncake_command_keeps_fixed_ports",
        &[obj, moved.clone()],
        &[],
    );
    let out = full(&moved);
    assert_eq!(
        out.warnings
            .iter()
            .filter(|w| w.starts_with("spec.remoteStorage.mooncake.command sets"))
            .count(),
        2,
        "{:?}",
        out.warnings
    );
}

/// A small fake adapter, to show the validator consults whatever registry it is given.
struct Fake {
    runtime: Runtime,
    ty: CacheType,
    args: &'static [&'static str],
    env: &'static [&'static str],
    bindings: &'static [Option<BindingKind>],
}

impl RuntimeAdapter for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn runtime(&self) -> Runtime {
        self.runtime
    }
    fn cache_type(&self) -> CacheType {
        self.ty
    }
    fn reserved_args(&self) -> &'static [&'static str] {
        self.args
    }
    fn reserved_env(&self) -> &'static [&'static str] {
        self.env
    }
    fn supports_binding(&self, binding: Option<BindingKind>) -> bool {
        self.bindings.contains(&binding)
    }
    fn inject_engine_config(
        &self,
        _ctx: &InjectContext<'_>,
        _pod: &mut Pod,
        _engine: usize,
    ) -> Result<InjectReport, InjectError> {
        Ok(InjectReport::default())
    }
}

#[test]
fn registry_rules_follow_the_registry_they_are_given() {
    let reg = Registry::new(vec![Box::new(Fake {
        runtime: Runtime::Vllm,
        ty: CacheType::LMCache,
        args: &["--my-flag"],
        env: &["MY_ENV"],
        bindings: &[Some(BindingKind::Resp)],
    })]);
    let ctx = RuleContext {
        namespace: NS,
        registry: &reg,
        operation: Operation::Create,
    };
    let v = Validator::builtin();
    let out = v.validate_value(
        &cb(json!({"runtime": "SGLang", "integration": {"engineOverrides": {"args": ["--my-flag"]}}})),
        &ctx,
    );
    assert!(out.at("spec.type")[0]
        .detail
        .ends_with("supported pairs: VLLM/LMCache"));
    let out = v.validate_value(
        &cb(
            json!({"runtime": "VLLM", "integration": {"engineOverrides": {"args": ["--my_flag=1"],
            "env": [{"name": "MY_ENV", "value": "x"}]}}}),
        ),
        &ctx,
    );
    let fields: Vec<&str> = out.violations.iter().map(|v| v.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "spec.remoteStorage",
            "spec.integration.engineOverrides.args[0]",
            "spec.integration.engineOverrides.env[0].name"
        ]
    );
}

#[test]
fn violations_are_aggregated_and_field_scoped() {
    let out = full(&cb(json!({"runtime": "SGLang",
        "remoteStorage": {"provider": "Redis", "ownership": "External", "endpoint": "lm://r:0"},
        "integration": {"role": "ReadOnly", "engineHostNetwork": true},
        "replicas": 0, "autoscaling": {"maxReplicas": 2}})));
    let fields: Vec<String> = out.violations.iter().map(|v| v.field.clone()).collect();
    for f in [
        "spec.remoteStorage.endpoint",
        "spec.integration.role",
        "spec.integration.engineHostNetwork",
        "spec.autoscaling.minReplicas",
    ] {
        assert!(fields.iter().any(|x| x == f), "{f} missing from {fields:?}");
    }
    let status = out.to_status("cb");
    assert_eq!(status.code, 422);
    assert!(status
        .message
        .starts_with(r#"CacheBackend.inferencecache.io "cb" is invalid: ["#));
    assert_eq!(status.details.unwrap().causes.len(), out.violations.len());
}

#[test]
fn update_drops_only_preexisting_violations() {
    let reg = registry();
    let ctx = RuleContext {
        namespace: NS,
        registry: &reg,
        operation: Operation::Update,
    };
    let v = Validator::builtin();
    let old = external("SGLang", "Redis", "redis:0");
    // An unrelated edit (a label) on an object with a pre-existing violation is admitted.
    let mut relabeled = old.clone();
    relabeled["metadata"]["labels"] = json!({"team": "a"});
    assert!(v.validate_update(&relabeled, &old, &ctx).is_valid());
    // Changing the bad endpoint to a different bad endpoint is a new violation.
    let other_bad = external("SGLang", "Redis", "redis:99999");
    let out = v.validate_update(&other_bad, &old, &ctx);
    assert_eq!(out.violations.len(), 1);
    assert_eq!(out.violations[0].field, "spec.remoteStorage.endpoint");
    // Flipping a valid field to an invalid one is rejected.
    let mut flipped = old.clone();
    flipped["spec"]["integration"]["role"] = json!("WriteOnly");
    let out = v.validate_update(&flipped, &old, &ctx);
    assert_eq!(
        out.violations
            .iter()
            .map(|v| v.field.as_str())
            .collect::<Vec<_>>(),
        ["spec.integration.role"]
    );
}

#[test]
fn samples_are_admitted() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/samples");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.starts_with("cachebackend-") {
            continue;
        }
        let mut obj: Value =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        obj["metadata"]["namespace"] = json!(NS);
        let out = full(&obj);
        assert!(out.is_valid(), "{name}: {:#?}", out.violations);
        n += 1;
    }
    assert!(n >= 6);
}
