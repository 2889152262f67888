//! The `inferencecache.io/v1alpha1` custom resources (spec 000 "Identity", "Spec", "Status") and
//! condition helpers.
//!
//! | kind | scope | short name | module |
//! |---|---|---|---|
//! | `CacheBackend` | namespaced | `cb` | [`cache_backend`] |
//! | `CachePolicy` | namespaced | `cpol` | [`cache_policy`] |
//! | `CacheTenant` | namespaced | `ct` | [`cache_tenant`] |
//! | `CacheIndex` | cluster | `ci` | [`cache_index`] |
//! | `CacheNode` | cluster | `cn` | [`cache_node`] |
//! | `ModelCache` | namespaced | `mc` | [`model_cache`] |
//! | `ModelCacheBinding` | namespaced | `mcb` | [`model_cache_binding`] |
//!
//! Every type derives kube's `CustomResource` (so `T::crd()` renders its
//! `CustomResourceDefinition`) plus `Default`, which the in-memory API used in tests needs.
//! `ic-controller crds` writes the rendered CRDs to `chart/crds/` (see
//! `controller/src/crdgen.rs`); `docs/crds.md` is the human reference.

pub mod cache_backend;
pub mod cache_index;
pub mod cache_node;
pub mod cache_policy;
pub mod cache_tenant;
pub mod conditions;
pub mod model_cache;
pub mod model_cache_binding;

pub use cache_backend::*;
pub use cache_index::*;
pub use cache_node::*;
pub use cache_policy::*;
pub use cache_tenant::*;
pub use conditions::*;
pub use model_cache::*;
pub use model_cache_binding::*;

/// The CRD object type, re-exported so crates without a direct `k8s-openapi` dependency can name
/// it.
pub use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// API group of every resource here.
pub const GROUP: &str = "inferencecache.io";
/// API version of every resource here.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` string (`inferencecache.io/v1alpha1`).
pub const API_VERSION: &str = "inferencecache.io/v1alpha1";

/// Short description used in place of the upstream `Quantity` description (about 2.5 KB, repeated
/// for every quantity in a schema).
pub const QUANTITY_DESCRIPTION: &str =
    "A Kubernetes resource quantity: an integer or a string such as `4Gi`, `500Mi`, `250m`.";

/// schemars transform: replaces the long upstream description on every `Quantity` node
/// (`x-kubernetes-int-or-string: true`) below `schema` with [`QUANTITY_DESCRIPTION`]. Keeps the
/// generated CRDs readable; validation is unchanged.
pub fn shorten_quantity_descriptions(schema: &mut schemars::Schema) {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                let is_quantity = map.get("x-kubernetes-int-or-string")
                    == Some(&serde_json::Value::Bool(true))
                    && map
                        .get("description")
                        .and_then(|d| d.as_str())
                        .is_some_and(|d| d.starts_with("Quantity is a fixed-point"));
                if is_quantity {
                    map.insert(
                        "description".to_string(),
                        serde_json::Value::String(QUANTITY_DESCRIPTION.to_string()),
                    );
                }
                map.values_mut().for_each(walk);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    if let Some(map) = schema.as_object_mut() {
        map.values_mut().for_each(walk);
    }
}

/// Parses a Go `time.Duration` string as `metav1.Duration` accepts it (`5m`, `1h30m`, `1.5s`,
/// `250ms`, `0`); units `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`. A leading sign is not accepted.
/// Returns `None` for anything else (including an empty string).
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    if s == "0" {
        return Some(std::time::Duration::ZERO);
    }
    if s.is_empty() {
        return None;
    }
    let mut total_nanos: f64 = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let (num, tail) = rest.split_at(num_len);
        if num.starts_with('.') || num.ends_with('.') || num.matches('.').count() > 1 {
            return None;
        }
        let value: f64 = num.parse().ok()?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60.0 * 1e9,
            "h" => 3600.0 * 1e9,
            _ => return None,
        };
        total_nanos += value * scale;
        rest = next;
    }
    if !total_nanos.is_finite() || total_nanos > u64::MAX as f64 {
        return None;
    }
    Some(std::time::Duration::from_nanos(total_nanos.round() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("10us"), Some(Duration::from_micros(10)));
        assert_eq!(parse_duration("10µs"), Some(Duration::from_micros(10)));
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
    }

    #[test]
    fn rejects_malformed_durations() {
        for bad in ["", "5", "m", "5x", "-5m", "1..5s", ".5s", "5.m", "5m3"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
