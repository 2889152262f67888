//! `CachePolicy` (`inferencecache.io/v1alpha1`, namespaced, short name `cpol`): per-namespace
//! lookup tuning (spec 000 "Spec", the paragraph after the table).
//!
//! The lookup latency budget and the minimum-prefix-token gate live here, not on CacheBackend:
//! `spec.lookupTimeoutMs` and `spec.minimumPrefixTokens` are what the index's resolved policy and
//! the `LookupRoute` path read for requests of the policy's namespace (tenant). One CachePolicy
//! per namespace (enforced by admission, not the schema).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired lookup policy for one namespace.
///
/// Printer columns: MinPrefixTokens, LookupTimeoutMs, Age.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "CachePolicy",
    plural = "cachepolicies",
    singular = "cachepolicy",
    shortname = "cpol",
    namespaced,
    status = "CachePolicyStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "CachePolicy tunes KV-prefix lookups for the requests of one namespace (spec 000).",
    printcolumn = r#"{"name": "MinPrefixTokens", "type": "integer", "jsonPath": ".spec.minimumPrefixTokens"}"#,
    printcolumn = r#"{"name": "LookupTimeoutMs", "type": "integer", "jsonPath": ".spec.lookupTimeoutMs"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct CachePolicySpec {
    /// Lookup latency budget in milliseconds (≥ 0). A lookup that exceeds it answers
    /// `NO_HINT` (fail open). Unset uses the controller's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub lookup_timeout_ms: Option<i32>,

    /// Minimum number of prefix tokens a request must carry before the index is consulted
    /// (≥ 0); shorter requests answer `NO_HINT`. Unset uses the controller's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub minimum_prefix_tokens: Option<i32>,
}

/// Observed state of a CachePolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CachePolicyStatus {
    /// `.metadata.generation` last applied to the index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Conditions keyed by type (e.g. `Applied`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Condition type: the policy is in effect in the index.
pub const POLICY_CONDITION_APPLIED: &str = "Applied";
