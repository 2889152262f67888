//! The committed `chart/crds/*.yaml` equal what `ic_controller::crdgen` renders, and every CRD
//! schema is structural (as the API server requires) with the enums, bounds, defaults, printer
//! columns and subresources of spec 000.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ic_controller::crdgen;
use ic_shared::crd::CustomResourceDefinition;
use serde_json::{json, Value};

fn chart_crds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../chart/crds")
}

const REGENERATE: &str = "run `cargo run -p ic-controller -- crds` and commit chart/crds";

#[test]
fn committed_crds_match_the_rust_types() {
    let rendered = crdgen::render().expect("render");
    let dir = chart_crds_dir();
    let mut expected_names = BTreeSet::new();
    for (name, yaml) in &rendered {
        expected_names.insert(name.clone());
        let path = dir.join(name);
        let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!("{}: {e}; {REGENERATE}", path.display());
        });
        assert!(
            committed == *yaml,
            "{} is out of date with shared/src/crd; {REGENERATE}",
            path.display()
        );
    }
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("chart/crds")
        .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    let stale: Vec<_> = on_disk.difference(&expected_names).collect();
    assert!(
        stale.is_empty(),
        "chart/crds holds files no type renders: {stale:?}; remove them or {REGENERATE}"
    );
}

#[test]
fn write_produces_the_rendered_files() {
    let dir = std::env::temp_dir().join(format!("ic-crdgen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let written = crdgen::write(&dir).expect("write");
    let rendered = crdgen::render().expect("render");
    assert_eq!(written.len(), rendered.len());
    for (name, yaml) in rendered {
        assert_eq!(std::fs::read_to_string(dir.join(&name)).unwrap(), yaml);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rendered_yaml_parses_back_into_the_same_crds() {
    for ((name, yaml), crd) in crdgen::render().unwrap().iter().zip(crdgen::all_crds()) {
        let back: CustomResourceDefinition =
            serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(back, crd, "{name}");
        assert_eq!(
            name,
            &format!("{}.yaml", crd.metadata.name.as_deref().unwrap())
        );
    }
}

fn crd(kind: &str) -> CustomResourceDefinition {
    crdgen::all_crds()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap_or_else(|| panic!("no CRD for {kind}"))
}

fn schema_json(crd: &CustomResourceDefinition) -> Value {
    let v = &crd.spec.versions[0];
    serde_json::to_value(
        v.schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("openAPIV3Schema"),
    )
    .unwrap()
}

/// The schema node at a dotted path; `[]` steps into array items (`status.conditions[]`).
fn at<'a>(schema: &'a Value, path: &str) -> &'a Value {
    let mut node = schema;
    for seg in path.split('.') {
        let (name, items) = match seg.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (seg, false),
        };
        node = node
            .get("properties")
            .and_then(|p| p.get(name))
            .unwrap_or_else(|| panic!("no property {name} on the way to {path}"));
        if items {
            node = node
                .get("items")
                .unwrap_or_else(|| panic!("{name} has no items ({path})"));
        }
    }
    node
}

/// Structural-schema rules the API server enforces, checked on every node: a `type` everywhere
/// (except int-or-string and preserve-unknown-fields nodes), no `$ref`/`anyOf`/`oneOf`/`allOf`/
/// `not`/`definitions`, no `uniqueItems: true`, list-map keys required or defaulted.
fn check_structural(node: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(obj) = node.as_object() else {
        problems.push(format!("{path}: not an object"));
        return;
    };
    for forbidden in [
        "$ref",
        "$defs",
        "definitions",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "const",
        "patternProperties",
        "additionalItems",
        "dependencies",
    ] {
        if obj.contains_key(forbidden) {
            problems.push(format!("{path}: has {forbidden}"));
        }
    }
    if obj.get("uniqueItems") == Some(&json!(true)) {
        problems.push(format!("{path}: uniqueItems true"));
    }
    let exempt = obj.get("x-kubernetes-int-or-string") == Some(&json!(true))
        || obj.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
    match obj.get("type").and_then(|t| t.as_str()) {
        Some("object" | "array" | "string" | "integer" | "number" | "boolean") => {}
        Some(other) => problems.push(format!("{path}: type {other}")),
        None if exempt => {}
        None => problems.push(format!("{path}: no type")),
    }
    if obj.contains_key("properties") && obj.get("type") != Some(&json!("object")) {
        problems.push(format!("{path}: properties without type object"));
    }
    if obj.contains_key("items") && obj.get("type") != Some(&json!("array")) {
        problems.push(format!("{path}: items without type array"));
    }
    if obj.contains_key("properties") && obj.contains_key("additionalProperties") {
        problems.push(format!("{path}: both properties and additionalProperties"));
    }
    if obj.get("x-kubernetes-list-type") == Some(&json!("map")) {
        let items = &obj["items"];
        let required: BTreeSet<&str> = items["required"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        for key in obj["x-kubernetes-list-map-keys"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let key = key.as_str().unwrap_or_default();
            let defaulted = items["properties"][key].get("default").is_some();
            if !required.contains(key) && !defaulted {
                problems.push(format!(
                    "{path}: list-map key {key} neither required nor defaulted"
                ));
            }
        }
    }
    if let Some(props) = obj.get("properties").and_then(|p| p.as_object()) {
        for (k, v) in props {
            check_structural(v, &format!("{path}.{k}"), problems);
        }
    }
    if let Some(items) = obj.get("items") {
        check_structural(items, &format!("{path}[]"), problems);
    }
    if let Some(ap) = obj.get("additionalProperties").filter(|v| v.is_object()) {
        check_structural(ap, &format!("{path}{{}}"), problems);
    }
}

#[test]
fn every_schema_is_structural() {
    for crd in crdgen::all_crds() {
        let schema = schema_json(&crd);
        let mut problems = Vec::new();
        check_structural(&schema, "", &mut problems);
        assert!(
            problems.is_empty(),
            "{}: {problems:#?}",
            crd.metadata.name.as_deref().unwrap_or_default()
        );
        assert_eq!(schema["type"], "object");
        assert!(schema["properties"]["spec"].is_object());
        assert!(schema["properties"]["status"].is_object());
    }
}

#[test]
fn identity_scope_and_subresources() {
    let expect = [
        ("CacheBackend", "cachebackends", "cb", "Namespaced"),
        ("CacheIndex", "cacheindexes", "ci", "Cluster"),
        ("CacheNode", "cachenodes", "cn", "Cluster"),
        ("CachePolicy", "cachepolicies", "cpol", "Namespaced"),
        ("CacheTenant", "cachetenants", "ct", "Namespaced"),
    ];
    for (kind, plural, short, scope) in expect {
        let c = crd(kind);
        assert_eq!(c.spec.group, "inferencecache.io");
        assert_eq!(c.spec.names.plural, plural);
        assert_eq!(c.spec.names.short_names, Some(vec![short.to_string()]));
        assert_eq!(c.spec.scope, scope);
        assert_eq!(c.spec.versions.len(), 1);
        let v = &c.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(v.served && v.storage);
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{kind}: status subresource"
        );
    }
}

fn enum_values(node: &Value) -> Vec<String> {
    assert_eq!(node["type"], "string", "enum must be type string: {node}");
    node["enum"]
        .as_array()
        .unwrap_or_else(|| panic!("no enum: {node}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn cache_backend_enums_use_the_spec_spellings() {
    let s = schema_json(&crd("CacheBackend"));
    let cases: &[(&str, &[&str])] = &[
        ("spec.runtime", &["VLLM", "SGLang"]),
        ("spec.type", &["LMCache", "SGLangHiCache"]),
        (
            "spec.remoteStorage.provider",
            &["Redis", "LMCacheServer", "Mooncake"],
        ),
        ("spec.remoteStorage.ownership", &["Managed", "External"]),
        ("spec.deploymentKind", &["Deployment", "StatefulSet"]),
        ("spec.integration.mode", &["Offload", "EventsOnly"]),
        (
            "spec.integration.role",
            &["ReadOnly", "WriteOnly", "ReadWrite"],
        ),
        (
            "spec.hiCache.writePolicy",
            &["write_back", "write_through", "write_through_selective"],
        ),
        (
            "spec.hiCache.ioBackend",
            &["direct", "kernel", "kernel_ascend"],
        ),
        (
            "spec.hiCache.memoryLayout",
            &[
                "layer_first",
                "page_first",
                "page_first_direct",
                "page_first_kv_split",
                "page_head",
            ],
        ),
    ];
    for (path, values) in cases {
        assert_eq!(enum_values(at(&s, path)), *values, "{path}");
    }
    let node = schema_json(&crd("CacheNode"));
    assert_eq!(
        enum_values(at(&node, "status.gpus[].status")),
        ["Ok", "Warning", "Critical", "Unknown"]
    );
    // Required vs optional at the top of spec.
    assert_eq!(at(&s, "spec")["required"], json!(["runtime"]));
    assert_eq!(
        at(&s, "spec.remoteStorage")["required"],
        json!(["ownership", "provider"])
    );
    assert_eq!(
        at(&s, "spec.autoscaling")["required"],
        json!(["maxReplicas"])
    );
}

#[test]
fn cache_backend_defaults_and_bounds() {
    let s = schema_json(&crd("CacheBackend"));
    let defaults: &[(&str, Value)] = &[
        ("spec.type", json!("LMCache")),
        ("spec.deploymentKind", json!("Deployment")),
        ("spec.replicas", json!(1)),
        ("spec.integration.mode", json!("Offload")),
        ("spec.integration.role", json!("ReadWrite")),
        ("spec.integration.failOpen", json!(true)),
        ("spec.observation.firstEventTimeout", json!("5m")),
        ("spec.lmCache.chunkSizeTokens", json!(256)),
        ("spec.lmCache.hostMemory.capacity", json!("4Gi")),
        ("spec.lmCache.workerPort", json!(5555)),
        ("spec.autoscaling.targetCPUUtilizationPercent", json!(80)),
    ];
    for (path, want) in defaults {
        assert_eq!(&at(&s, path)["default"], want, "default of {path}");
    }
    // Optional nested objects carry no default: omitted stays absent.
    for path in [
        "spec.lmCache",
        "spec.remoteStorage",
        "spec.observation",
        "spec.autoscaling",
        "spec.integration",
        "spec.engineSelector",
        "spec.hiCache",
        "spec.template",
        "status.indexParticipation",
    ] {
        assert!(
            at(&s, path).get("default").is_none(),
            "{path} has a default"
        );
        assert_eq!(at(&s, path)["type"], "object", "{path}");
    }
    let bounds: &[(&str, Option<f64>, Option<f64>)] = &[
        ("spec.replicas", Some(0.0), None),
        ("spec.autoscaling.minReplicas", Some(1.0), None),
        ("spec.autoscaling.maxReplicas", Some(1.0), None),
        (
            "spec.autoscaling.targetCPUUtilizationPercent",
            Some(1.0),
            Some(100.0),
        ),
        ("spec.lmCache.workerPort", Some(1.0), Some(65535.0)),
        ("spec.lmCache.chunkSizeTokens", Some(1.0), None),
        ("spec.hiCache.sizeGB", Some(1.0), None),
        (
            "spec.template.terminationGracePeriodSeconds",
            Some(0.0),
            None,
        ),
        ("status.matchedEnginePods", Some(0.0), None),
    ];
    for (path, min, max) in bounds {
        let node = at(&s, path);
        assert_eq!(node["type"], "integer", "{path}");
        assert_eq!(node["minimum"].as_f64(), *min, "minimum of {path}");
        assert_eq!(node["maximum"].as_f64(), *max, "maximum of {path}");
    }
    assert!(at(&s, "spec.observation.firstEventTimeout")["pattern"].is_string());
    // CEL rules the API server evaluates (admission repeats them with field-scoped messages).
    let rules = |path: &str| -> Vec<String> {
        at(&s, path)["x-kubernetes-validations"]
            .as_array()
            .unwrap_or_else(|| panic!("{path}: no x-kubernetes-validations"))
            .iter()
            .map(|r| r["rule"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(rules("spec.autoscaling")[0].contains("self.minReplicas <= self.maxReplicas"));
    assert!(rules("spec.hiCache")[0].contains("has(self.ratio) != has(self.sizeGB)"));
    // Conditions are a map list keyed by type.
    let conds = at(&s, "status.conditions");
    assert_eq!(conds["x-kubernetes-list-type"], "map");
    assert_eq!(conds["x-kubernetes-list-map-keys"], json!(["type"]));
    // Template overrides expose the listed fields and no containers.
    let template: BTreeSet<&str> = at(&s, "spec.template")["properties"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let want: BTreeSet<&str> = [
        "nodeSelector",
        "affinity",
        "tolerations",
        "topologySpreadConstraints",
        "imagePullSecrets",
        "serviceAccountName",
        "securityContext",
        "priorityClassName",
        "schedulerName",
        "runtimeClassName",
        "terminationGracePeriodSeconds",
    ]
    .into_iter()
    .collect();
    assert_eq!(template, want);
    // Removed fields (spec "Breaking API cleanup", carve-out) are not served.
    let spec_props = at(&s, "spec")["properties"].as_object().unwrap();
    for removed in ["storage", "backendConfig", "resources", "endpoint"] {
        assert!(
            !spec_props.contains_key(removed),
            "spec.{removed} must not be served"
        );
    }
    let integ = at(&s, "spec.integration")["properties"]
        .as_object()
        .unwrap();
    for removed in ["engine", "firstEventTimeout"] {
        assert!(!integ.contains_key(removed), "spec.integration.{removed}");
    }
    let status_props = at(&s, "status")["properties"].as_object().unwrap();
    for removed in ["health", "capacity"] {
        assert!(!status_props.contains_key(removed), "status.{removed}");
    }
}

#[test]
fn cache_index_policy_and_tenant_fields() {
    let p = schema_json(&crd("CachePolicy"));
    assert_eq!(at(&p, "spec.lookupTimeoutMs")["type"], "integer");
    assert_eq!(at(&p, "spec.minimumPrefixTokens")["type"], "integer");

    let i = schema_json(&crd("CacheIndex"));
    assert_eq!(
        at(&i, "status.replicas[].cacheMemoryBytes")["type"],
        "integer"
    );
    let mem = at(&i, "status.tenants[].memoryUsed");
    assert_eq!(mem["type"], "integer");
    assert!(mem["description"]
        .as_str()
        .unwrap()
        .to_lowercase()
        .contains("always 0"));

    let t = schema_json(&crd("CacheTenant"));
    let quota = at(&t, "spec.quota")["properties"].as_object().unwrap();
    assert!(quota.contains_key("maxIndexEntries"));
    assert!(
        !quota.contains_key("maxMemoryBytes"),
        "removed by the carve-out"
    );
    assert!(!at(&t, "status")["properties"]
        .as_object()
        .unwrap()
        .contains_key("memoryUsed"));
}

fn columns(kind: &str) -> Vec<(String, String, String)> {
    crd(kind).spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.name, c.type_, c.json_path))
        .collect()
}

fn col(name: &str, ty: &str, path: &str) -> (String, String, String) {
    (name.into(), ty.into(), path.into())
}

#[test]
fn printer_columns() {
    assert_eq!(
        columns("CacheBackend"),
        vec![
            col(
                "Ready",
                "string",
                ".status.conditions[?(@.type==\"Ready\")].status"
            ),
            col("Endpoint", "string", ".status.endpoint"),
            col("Matched", "integer", ".status.matchedEnginePods"),
            col(
                "Prefixes",
                "integer",
                ".status.indexParticipation.prefixCount"
            ),
            col(
                "LastEvent",
                "date",
                ".status.indexParticipation.lastEventAt"
            ),
            col("Age", "date", ".metadata.creationTimestamp"),
        ]
    );
    assert_eq!(
        columns("CacheNode"),
        vec![
            col(
                "Ready",
                "string",
                ".status.conditions[?(@.type==\"Ready\")].status"
            ),
            col("GPUs", "integer", ".status.gpuCount"),
            col("Engines", "integer", ".status.engineCount"),
            col("LastReport", "date", ".status.lastReportTime"),
            col("Age", "date", ".metadata.creationTimestamp"),
        ]
    );
    // Every column's path exists in the schema (metadata paths aside).
    for c in crdgen::all_crds() {
        let s = schema_json(&c);
        for (name, _, path) in columns(&c.spec.names.kind) {
            if path.starts_with(".metadata.") {
                continue;
            }
            let dotted: String = path
                .trim_start_matches('.')
                .replace("conditions[?(@.type==\"Ready\")]", "conditions[]");
            at(&s, &dotted);
            let _ = name;
        }
    }
}
