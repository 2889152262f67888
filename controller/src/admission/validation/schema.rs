//! The schema stage: the generated CacheBackend CRD's `openAPIV3Schema`, applied to raw JSON.
//!
//! - [`check`]: types, enums (with their supported values), required properties, integer
//!   bounds, and the `firstEventTimeout` duration pattern — what the apiserver's structural
//!   schema enforces before admission. Unknown fields become warnings (the apiserver prunes
//!   them). CEL rules (`x-kubernetes-validations`) are mirrored by named rules instead
//!   (`autoscaling_min_not_above_max`, `hicache_config_valid`).
//! - [`decode`]: raw JSON → [`CacheBackend`], a failure reported at its field path.
//! - [`apply_defaults`] / [`prune_unknown`]: structural defaulting and pruning as the apiserver
//!   does them, used by `ic-controller admit` so that its output is what a server dry-run would
//!   persist (in cluster the apiserver does this itself).
//!
//! The schema comes from `CacheBackend::crd()`, so this stage cannot drift from the CRD.

use std::sync::OnceLock;

use ic_shared::crd::{CacheBackend, DURATION_PATTERN};
use kube::CustomResourceExt;
use serde_json::{Map, Value};

use super::{Outcome, Violation};

/// The CacheBackend `openAPIV3Schema` as JSON (`None` only if the CRD could not be rendered,
/// which the tests rule out).
pub fn openapi_schema() -> Option<&'static Value> {
    static SCHEMA: OnceLock<Option<Value>> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            let crd = CacheBackend::crd();
            let version = crd.spec.versions.first()?;
            let schema = version.schema.as_ref()?.open_api_v3_schema.as_ref()?;
            serde_json::to_value(schema).ok()
        })
        .as_ref()
}

/// Checks `obj` against the CRD schema. Violations reject; warnings name unknown fields.
pub fn check(obj: &Value) -> Outcome {
    let mut out = Outcome::default();
    if let Some(schema) = openapi_schema() {
        walk(schema, obj, "", &mut out);
    }
    out
}

/// Decodes a CacheBackend, reporting a failure at its field path. A missing field is a
/// `Required value` at that field (`spec.runtime: Required value`), not the decoder's message
/// with the whole enclosing object as the "bad value".
pub fn decode(obj: &Value) -> Result<CacheBackend, Violation> {
    serde_path_to_error::deserialize::<_, CacheBackend>(obj).map_err(|e| {
        let field = render_path(e.path());
        let detail = e.inner().to_string();
        if let Some(name) = detail
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(name, _)| name)
        {
            return Violation::required(child(&field, name), "a CacheBackend must set it");
        }
        let field = if field.is_empty() {
            "<root>".to_string()
        } else {
            field
        };
        let value = lookup(obj, e.path()).map(render_value).unwrap_or_default();
        Violation {
            kind: super::ViolationKind::Invalid,
            field,
            bad_value: if value.is_empty() { None } else { Some(value) },
            detail,
        }
    })
}

/// Applies every schema `default` whose parent object exists (apiserver structural defaulting;
/// `null` counts as absent). Returns whether anything changed.
pub fn apply_defaults(obj: &mut Value) -> bool {
    match openapi_schema() {
        Some(schema) => default_walk(schema, obj),
        None => false,
    }
}

/// Removes fields the schema does not declare (apiserver pruning). Returns the removed paths.
pub fn prune_unknown(obj: &mut Value) -> Vec<String> {
    let mut removed = Vec::new();
    if let Some(schema) = openapi_schema() {
        prune_walk(schema, obj, "", &mut removed);
    }
    removed
}

fn child(base: &str, name: &str) -> String {
    if base.is_empty() {
        name.to_string()
    } else {
        format!("{base}.{name}")
    }
}

fn render_path(path: &serde_path_to_error::Path) -> String {
    let mut s = String::new();
    for seg in path.iter() {
        match seg {
            serde_path_to_error::Segment::Seq { index } => s.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key } => {
                let ident =
                    !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if ident {
                    s = child(&s, key);
                } else {
                    s.push_str(&format!("[{key}]"));
                }
            }
            serde_path_to_error::Segment::Enum { .. } | serde_path_to_error::Segment::Unknown => {}
        }
    }
    s
}

fn lookup<'a>(obj: &'a Value, path: &serde_path_to_error::Path) -> Option<&'a Value> {
    let mut cur = obj;
    for seg in path.iter() {
        cur = match seg {
            serde_path_to_error::Segment::Seq { index } => cur.get(*index)?,
            serde_path_to_error::Segment::Map { key } => cur.get(key.as_str())?,
            _ => return Some(cur),
        };
    }
    Some(cur)
}

/// Renders a JSON value as Kubernetes prints a bad value: strings quoted, numbers and booleans
/// bare, anything else as compact JSON (cut at 80 characters).
pub fn render_value(v: &Value) -> String {
    let s = match v {
        Value::String(s) => super::quote(s),
        other => other.to_string(),
    };
    if s.chars().count() > 80 {
        let cut: String = s.chars().take(77).collect();
        format!("{cut}...")
    } else {
        s
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn type_matches(expected: &str, v: &Value) -> bool {
    match expected {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        _ => true,
    }
}

fn walk(schema: &Value, value: &Value, path: &str, out: &mut Outcome) {
    if value.is_null() {
        return;
    }
    let field = if path.is_empty() { "<root>" } else { path };
    if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        if !(value.is_string() || value.is_i64() || value.is_u64()) {
            out.violations.push(Violation {
                kind: super::ViolationKind::Invalid,
                field: field.to_string(),
                bad_value: Some(render_value(value)),
                detail: format!("must be an integer or a string, not {}", type_name(value)),
            });
        }
        return;
    }
    if let Some(expected) = schema.get("type").and_then(Value::as_str) {
        if !type_matches(expected, value) {
            out.violations.push(Violation {
                kind: super::ViolationKind::Invalid,
                field: field.to_string(),
                bad_value: Some(render_value(value)),
                detail: format!("must be of type {expected}"),
            });
            return;
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            let supported: Vec<String> = options
                .iter()
                .map(|o| match o {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect();
            let shown = match value {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.violations
                .push(Violation::not_supported(field, &shown, &supported));
            return;
        }
    }
    if let Some(n) = value.as_i64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
            if (n as f64) < min {
                out.violations.push(Violation::invalid_num(
                    field,
                    n,
                    format!("should be greater than or equal to {min}"),
                ));
            }
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64) {
            if (n as f64) > max {
                out.violations.push(Violation::invalid_num(
                    field,
                    n,
                    format!("should be less than or equal to {max}"),
                ));
            }
        }
    }
    if let (Some(pattern), Some(s)) = (
        schema.get("pattern").and_then(Value::as_str),
        value.as_str(),
    ) {
        if pattern == DURATION_PATTERN && ic_shared::crd::parse_duration(s).is_none() {
            out.violations.push(Violation::invalid(
                field,
                s,
                "must be a duration such as 5m, 1h30m or 90s",
            ));
        }
    }
    match value {
        Value::Object(map) => walk_object(schema, map, path, out),
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk(item_schema, item, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// Root fields the apiserver handles itself (the CRD schema need not declare them).
const ROOT_FIELDS: [&str; 3] = ["apiVersion", "kind", "metadata"];

fn walk_object(schema: &Value, map: &Map<String, Value>, path: &str, out: &mut Outcome) {
    let props = schema.get("properties").and_then(Value::as_object);
    let additional = schema.get("additionalProperties");
    if let Some(required) = schema.get("required").and_then(Value::as_array) {
        for r in required.iter().filter_map(Value::as_str) {
            if map.get(r).is_none_or(Value::is_null) {
                out.violations.push(Violation::required(child(path, r), ""));
            }
        }
    }
    for (k, v) in map {
        if path.is_empty()
            && ROOT_FIELDS.contains(&k.as_str())
            && props.is_none_or(|p| !p.contains_key(k))
        {
            continue;
        }
        match (props.and_then(|p| p.get(k)), additional) {
            (Some(prop_schema), _) => walk(prop_schema, v, &child(path, k), out),
            (None, Some(add)) if add.is_object() => walk(add, v, &format!("{path}[{k}]"), out),
            (None, Some(Value::Bool(true))) => {}
            (None, _) if props.is_none() => {}
            (None, _) => {
                if schema.get("x-kubernetes-preserve-unknown-fields") != Some(&Value::Bool(true)) {
                    out.warnings
                        .push(format!("unknown field {:?}", child(path, k)));
                }
            }
        }
    }
}

fn default_walk(schema: &Value, value: &mut Value) -> bool {
    let mut changed = false;
    match value {
        Value::Object(map) => {
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (name, prop_schema) in props {
                    let absent = map.get(name).is_none_or(Value::is_null);
                    if absent {
                        if let Some(d) = prop_schema.get("default") {
                            map.insert(name.clone(), d.clone());
                            changed = true;
                        }
                    }
                    if let Some(child_value) = map.get_mut(name) {
                        changed |= default_walk(prop_schema, child_value);
                    }
                }
            } else if let Some(add) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for v in map.values_mut() {
                    changed |= default_walk(add, v);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    changed |= default_walk(item_schema, item);
                }
            }
        }
        _ => {}
    }
    changed
}

fn prune_walk(schema: &Value, value: &mut Value, path: &str, removed: &mut Vec<String>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            match (props, additional) {
                (Some(props), _) => {
                    let unknown: Vec<String> = map
                        .keys()
                        .filter(|k| !props.contains_key(k.as_str()))
                        .filter(|k| !(path.is_empty() && ROOT_FIELDS.contains(&k.as_str())))
                        .cloned()
                        .collect();
                    for k in unknown {
                        map.remove(&k);
                        removed.push(child(path, &k));
                    }
                    for (k, v) in map.iter_mut() {
                        if let Some(s) = props.get(k) {
                            prune_walk(s, v, &child(path, k), removed);
                        }
                    }
                }
                (None, Some(add)) if add.is_object() => {
                    for (k, v) in map.iter_mut() {
                        prune_walk(add, v, &format!("{path}[{k}]"), removed);
                    }
                }
                _ => {}
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    prune_walk(item_schema, item, &format!("{path}[{i}]"), removed);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_missing_field_is_required_at_its_path_without_a_dump_of_its_parent() {
        let obj = json!({
            "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
            "metadata": {"name": "x", "namespace": "ns"},
            "spec": {}
        });
        let v = decode(&obj).unwrap_err();
        assert_eq!(v.kind, super::super::ViolationKind::Required);
        assert!(
            v.field.starts_with("spec.") && !v.field[5..].contains('.'),
            "{v:?}"
        );
        assert_eq!(v.bad_value, None);
        assert!(
            !v.detail.contains('{') && !v.detail.contains("missing field"),
            "{v:?}"
        );
    }

    #[test]
    fn schema_is_available() {
        assert!(openapi_schema().is_some());
    }

    #[test]
    fn defaults_apply_where_the_parent_exists() {
        let mut v = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
            "metadata": {"name": "a"}, "spec": {"runtime": "VLLM", "integration": {}}});
        assert!(apply_defaults(&mut v));
        assert_eq!(v["spec"]["type"], "LMCache");
        assert_eq!(v["spec"]["replicas"], 1);
        assert_eq!(v["spec"]["deploymentKind"], "Deployment");
        assert_eq!(
            v["spec"]["integration"],
            json!({"mode": "Offload", "role": "ReadWrite", "failOpen": true})
        );
        assert!(v["spec"].get("observation").is_none());
        assert!(v["spec"].get("autoscaling").is_none());
        assert!(!apply_defaults(&mut v));
    }

    #[test]
    fn prune_removes_unknown_fields() {
        let mut v = json!({"metadata": {"name": "a", "labels": {"x": "y"}},
            "spec": {"runtime": "VLLM", "replicass": 2}});
        assert_eq!(prune_unknown(&mut v), vec!["spec.replicass".to_string()]);
        assert_eq!(v["metadata"]["labels"]["x"], "y");
    }

    #[test]
    fn decode_reports_field_path() {
        let v = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
            "metadata": {"name": "a"},
            "spec": {"runtime": "VLLM", "integration": {"engineOverrides": {"args": [1]}}}});
        let e = decode(&v).unwrap_err();
        assert_eq!(e.field, "spec.integration.engineOverrides.args[0]");
    }
}
