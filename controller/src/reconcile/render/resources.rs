//! Provider container resources (spec 000 "Resources"): the typed block deep-copied, the
//! bounded 4Gi/8Gi default only when the block is absent, and the autoscaling CPU-request
//! fallback. Plus the Kubernetes quantity parser the renderers need.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Memory request used when the provider's `resources` block is absent.
pub const DEFAULT_MEMORY_REQUEST: &str = "4Gi";
/// Memory limit used when the provider's `resources` block is absent.
pub const DEFAULT_MEMORY_LIMIT: &str = "8Gi";
/// CPU request filled in when autoscaling is set and no positive CPU request is present.
pub const AUTOSCALING_CPU_REQUEST: &str = "250m";

/// The resources rendered onto a provider container.
///
/// - `block` present (even `{}`): deep-copied as is — an explicit empty block suppresses the
///   default.
/// - `block` absent: requests.memory 4Gi, limits.memory 8Gi (never persisted into the CR).
/// - `autoscaling`: `requests.cpu` becomes 250m when it is absent or not positive; nothing else
///   changes (no memory request is synthesised).
pub fn provider_resources(
    block: Option<&ResourceRequirements>,
    autoscaling: bool,
) -> ResourceRequirements {
    let mut out = match block {
        Some(b) => b.clone(),
        None => ResourceRequirements {
            requests: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity(DEFAULT_MEMORY_REQUEST.to_string()),
            )])),
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity(DEFAULT_MEMORY_LIMIT.to_string()),
            )])),
            ..Default::default()
        },
    };
    if autoscaling {
        let positive = out
            .requests
            .as_ref()
            .and_then(|r| r.get("cpu"))
            .and_then(|q| parse_quantity(&q.0))
            .is_some_and(|v| v > 0.0);
        if !positive {
            out.requests.get_or_insert_with(BTreeMap::new).insert(
                "cpu".to_string(),
                Quantity(AUTOSCALING_CPU_REQUEST.to_string()),
            );
        }
    }
    out
}

pub use crate::quantity::parse_quantity;

/// `limits.memory` of `resources` in bytes, when present and parsable.
pub fn memory_limit_bytes(resources: &ResourceRequirements) -> Option<f64> {
    resources
        .limits
        .as_ref()
        .and_then(|l| l.get("memory"))
        .and_then(|q| parse_quantity(&q.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity(s.to_string())
    }

    #[test]
    fn parses_quantities() {
        assert_eq!(parse_quantity("8Gi"), Some(8.0 * 1024.0 * 1024.0 * 1024.0));
        assert_eq!(parse_quantity("250m"), Some(0.25));
        assert_eq!(parse_quantity("1.5G"), Some(1.5e9));
        assert_eq!(parse_quantity("1e3"), Some(1000.0));
        assert_eq!(parse_quantity("0"), Some(0.0));
        assert_eq!(parse_quantity("-1"), Some(-1.0));
        assert_eq!(parse_quantity("12"), Some(12.0));
        assert_eq!(parse_quantity("abc"), None);
        assert_eq!(parse_quantity("5Xi"), None);
        assert_eq!(parse_quantity(""), None);
    }

    #[test]
    fn default_only_when_block_absent() {
        let r = provider_resources(None, false);
        assert_eq!(r.requests.as_ref().unwrap()["memory"], q("4Gi"));
        assert_eq!(r.limits.as_ref().unwrap()["memory"], q("8Gi"));
        let empty = ResourceRequirements::default();
        assert_eq!(provider_resources(Some(&empty), false), empty);
    }

    #[test]
    fn autoscaling_fills_cpu_only_when_not_positive() {
        let r = provider_resources(None, true);
        assert_eq!(r.requests.as_ref().unwrap()["cpu"], q("250m"));
        assert_eq!(r.requests.as_ref().unwrap()["memory"], q("4Gi"));

        let zero = ResourceRequirements {
            requests: Some(BTreeMap::from([("cpu".to_string(), q("0"))])),
            ..Default::default()
        };
        let r = provider_resources(Some(&zero), true);
        assert_eq!(r.requests.as_ref().unwrap()["cpu"], q("250m"));
        assert!(!r.requests.as_ref().unwrap().contains_key("memory"));

        let one = ResourceRequirements {
            requests: Some(BTreeMap::from([("cpu".to_string(), q("1"))])),
            ..Default::default()
        };
        assert_eq!(provider_resources(Some(&one), true), one);

        let empty = ResourceRequirements::default();
        let r = provider_resources(Some(&empty), true);
        assert_eq!(r.requests.unwrap().len(), 1);
        assert!(r.limits.is_none());
    }
}
