//! CacheBackend defaulting (spec 000 "Admission" → "Defaulting (mutating)"; "Contract Notes":
//! `spec.integration` is materialised by the webhook).
//!
//! | field | default | when |
//! |---|---|---|
//! | `spec.integration` | `{}` then `mode: Offload`, `role: ReadWrite`, `failOpen: true` for each absent key | always |
//! | `spec.observation` | `{}` then `firstEventTimeout: 5m` when absent | always |
//! | `spec.autoscaling.minReplicas` | `spec.replicas` (1 when unset, the schema default) | CREATE only, when `spec.autoscaling` is set and `minReplicas` is not, and never when replicas is 0 |
//!
//! An operator-set value is never changed; `null` counts as absent. The defaulter works on the
//! raw JSON it was given — never a decode/re-encode round trip, which could drop or reshape
//! fields — and the JSON Patch is the diff of the original and the defaulted object, so a
//! fully-defaulted object yields an empty patch.
//!
//! The schema-level literal defaults (`spec.type`, `spec.replicas`, …) are the apiserver's; see
//! [`crate::admission::validation::schema::apply_defaults`] for the offline equivalent.

use ic_shared::crd::{
    DEFAULT_FAIL_OPEN, DEFAULT_FIRST_EVENT_TIMEOUT, DEFAULT_INTEGRATION_MODE,
    DEFAULT_INTEGRATION_ROLE, DEFAULT_REPLICAS,
};
use serde_json::{Map, Value};

use crate::admission::review::Operation;

/// The defaulted object and the JSON Patch that turns the original into it.
#[derive(Debug, Clone, PartialEq)]
pub struct Defaulted {
    /// The object with defaults applied.
    pub object: Value,
    /// RFC 6902 operations (empty when nothing changed).
    pub patch: Vec<json_patch::PatchOperation>,
}

/// Why an object could not be defaulted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefaultingError {
    /// The object is not a JSON object.
    #[error("the object is not a JSON object")]
    NotAnObject,
}

/// Applies the webhook defaults to a copy of `obj` and returns it with the patch.
///
/// Errors: [`DefaultingError::NotAnObject`] when `obj` is not a JSON object. A missing or
/// non-object `spec` is left for validation to report (nothing is defaulted).
pub fn default_cache_backend(
    obj: &Value,
    operation: Operation,
) -> Result<Defaulted, DefaultingError> {
    if !obj.is_object() {
        return Err(DefaultingError::NotAnObject);
    }
    let mut object = obj.clone();
    apply(&mut object, operation);
    let patch = json_patch::diff(obj, &object).0;
    Ok(Defaulted { object, patch })
}

/// Applies the webhook defaults in place (see the module table). Returns whether anything
/// changed.
pub fn apply(obj: &mut Value, operation: Operation) -> bool {
    let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
        return false;
    };
    let mut changed = false;
    changed |= materialise(
        spec,
        "integration",
        &[
            ("mode", enum_value(DEFAULT_INTEGRATION_MODE)),
            ("role", enum_value(DEFAULT_INTEGRATION_ROLE)),
            ("failOpen", Value::Bool(DEFAULT_FAIL_OPEN)),
        ],
    );
    changed |= materialise(
        spec,
        "observation",
        &[(
            "firstEventTimeout",
            Value::String(DEFAULT_FIRST_EVENT_TIMEOUT.to_string()),
        )],
    );
    if operation == Operation::Create {
        changed |= default_min_replicas(spec);
    }
    changed
}

fn is_absent(map: &Map<String, Value>, key: &str) -> bool {
    map.get(key).is_none_or(Value::is_null)
}

fn enum_value<T: serde::Serialize>(v: T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// Ensures `spec[key]` is an object and fills each absent default. A present non-object value
/// is left for validation to reject.
fn materialise(spec: &mut Map<String, Value>, key: &str, defaults: &[(&str, Value)]) -> bool {
    let mut changed = false;
    if is_absent(spec, key) {
        spec.insert(key.to_string(), Value::Object(Map::new()));
        changed = true;
    }
    let Some(obj) = spec.get_mut(key).and_then(Value::as_object_mut) else {
        return changed;
    };
    for (field, value) in defaults {
        if is_absent(obj, field) && !value.is_null() {
            obj.insert((*field).to_string(), value.clone());
            changed = true;
        }
    }
    changed
}

/// `autoscaling.minReplicas = replicas` (first apply only; the caller checks CREATE). Skipped
/// when replicas is 0 (schema minimum 1; validation rejects that case instead) or not an
/// integer.
fn default_min_replicas(spec: &mut Map<String, Value>) -> bool {
    let replicas = if is_absent(spec, "replicas") {
        Some(i64::from(DEFAULT_REPLICAS))
    } else {
        spec.get("replicas").and_then(Value::as_i64)
    };
    let Some(replicas) = replicas.filter(|r| *r >= 1) else {
        return false;
    };
    let Some(autoscaling) = spec.get_mut("autoscaling").and_then(Value::as_object_mut) else {
        return false;
    };
    if !is_absent(autoscaling, "minReplicas") {
        return false;
    }
    autoscaling.insert("minReplicas".to_string(), Value::from(replicas));
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cb(spec: Value) -> Value {
        json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
               "metadata": {"name": "x", "namespace": "ns"}, "spec": spec})
    }

    fn patched(original: &Value, d: &Defaulted) -> Value {
        let mut v = original.clone();
        json_patch::patch(&mut v, &d.patch).unwrap();
        v
    }

    #[test]
    fn patch_reproduces_the_defaulted_object() {
        let o = cb(json!({"runtime": "VLLM", "autoscaling": {"maxReplicas": 3}, "replicas": 2}));
        let d = default_cache_backend(&o, Operation::Create).unwrap();
        assert_eq!(patched(&o, &d), d.object);
        assert_eq!(d.object["spec"]["autoscaling"]["minReplicas"], 2);
        let again = default_cache_backend(&d.object, Operation::Create).unwrap();
        assert!(again.patch.is_empty(), "{:?}", again.patch);
    }

    #[test]
    fn not_an_object_is_an_error() {
        assert_eq!(
            default_cache_backend(&json!([1]), Operation::Create),
            Err(DefaultingError::NotAnObject)
        );
    }
}
