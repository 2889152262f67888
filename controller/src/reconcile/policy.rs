//! CachePolicy → the router's policy table (spec 000: "Per-namespace lookup tuning lives on
//! CachePolicy"; `docs/in-cluster.md` "Lookup policies").
//!
//! Every replica serves `LookupRoute`, so every replica watches CachePolicies (all namespaces)
//! and keeps its own [`PolicyTable`] equal to them: after each watch event the whole table is
//! replaced from the watched set ([`desired`] + [`PolicyTable::replace_all`]), so a deleted
//! policy's namespace falls back to the controller's defaults. One policy per namespace: when a
//! namespace holds several, the oldest (creation time, then name) applies and the others are
//! reported. Only the leader writes status: `Applied=True` (`PolicyApplied`) with the
//! `observedGeneration`, or `Applied=False` (`DuplicatePolicy`) naming the policy in effect.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ic_shared::crd::{
    new_condition, set_condition, CachePolicy, CachePolicyStatus, ConditionStatus,
    POLICY_CONDITION_APPLIED,
};
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use tokio::sync::watch;

use crate::index::{NamespacePolicy, PolicyTable};

/// Condition reason: the policy is what lookups of its namespace use.
pub const REASON_APPLIED: &str = "PolicyApplied";
/// Condition reason: another, older policy of the namespace applies instead.
pub const REASON_DUPLICATE: &str = "DuplicatePolicy";

/// What the watched policies ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// Per namespace, the values of the policy in effect.
    pub by_namespace: BTreeMap<String, NamespacePolicy>,
    /// `(namespace, name)` of each policy in effect.
    pub applied: Vec<(String, String)>,
    /// `(namespace, name, the name in effect)` of each policy that is not.
    pub duplicates: Vec<(String, String, String)>,
}

fn value(v: Option<i32>) -> Option<u32> {
    v.and_then(|x| u32::try_from(x).ok())
}

/// The table the policies ask for (pure).
pub fn desired(policies: &[CachePolicy]) -> Desired {
    let mut by_ns: BTreeMap<String, Vec<&CachePolicy>> = BTreeMap::new();
    for p in policies {
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        by_ns.entry(ns).or_default().push(p);
    }
    let mut out = Desired::default();
    for (ns, mut ps) in by_ns {
        ps.sort_by(|a, b| {
            let key = |p: &CachePolicy| {
                (
                    p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    p.metadata.name.clone().unwrap_or_default(),
                )
            };
            key(a).cmp(&key(b))
        });
        let Some(first) = ps.first() else { continue };
        let winner = first.metadata.name.clone().unwrap_or_default();
        out.by_namespace.insert(
            ns.clone(),
            NamespacePolicy {
                lookup_timeout_ms: value(first.spec.lookup_timeout_ms),
                minimum_prefix_tokens: value(first.spec.minimum_prefix_tokens),
            },
        );
        out.applied.push((ns.clone(), winner.clone()));
        for p in ps.iter().skip(1) {
            out.duplicates.push((
                ns.clone(),
                p.metadata.name.clone().unwrap_or_default(),
                winner.clone(),
            ));
        }
    }
    out
}

/// The status `p` should carry given `d` (`None` when it carries it already).
pub fn desired_status(
    p: &CachePolicy,
    d: &Desired,
    now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> Option<CachePolicyStatus> {
    let ns = p.metadata.namespace.clone().unwrap_or_default();
    let name = p.metadata.name.clone().unwrap_or_default();
    let generation = p.metadata.generation;
    let cond = match d.duplicates.iter().find(|(n, x, _)| *n == ns && *x == name) {
        Some((_, _, winner)) => new_condition(
            POLICY_CONDITION_APPLIED,
            ConditionStatus::False,
            REASON_DUPLICATE,
            format!(
                "Namespace {ns} has more than one CachePolicy; the oldest, {winner}, applies. \
                 Delete this one or merge it into {winner}."
            ),
            generation,
            now,
        ),
        None => new_condition(
            POLICY_CONDITION_APPLIED,
            ConditionStatus::True,
            REASON_APPLIED,
            format!("Lookups of namespace {ns} use this policy."),
            generation,
            now,
        ),
    };
    let mut st = p.status.clone().unwrap_or_default();
    let changed = set_condition(&mut st.conditions, cond);
    let gen_changed = st.observed_generation != generation;
    st.observed_generation = generation;
    (changed || gen_changed).then_some(st)
}

/// Applies the watched policies to `table`; with `write_status`, patches their status (leader).
pub async fn sync(
    client: &Client,
    table: &PolicyTable,
    policies: &[CachePolicy],
    write_status: bool,
) {
    let d = desired(policies);
    table.replace_all(d.by_namespace.clone());
    if !write_status {
        return;
    }
    for p in policies {
        let Some(st) = desired_status(p, &d, ic_shared::crd::now()) else {
            continue;
        };
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        let name = p.metadata.name.clone().unwrap_or_default();
        let api: Api<CachePolicy> = Api::namespaced(client.clone(), &ns);
        let patch = serde_json::json!({"status": st});
        if let Err(e) = api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::warn!(namespace = %ns, policy = %name, error = %e, "CachePolicy status write failed");
        }
    }
}

/// Watches CachePolicies of every namespace and keeps `table` equal to them until `shutdown`.
pub async fn run(
    client: Client,
    table: Arc<PolicyTable>,
    leader: Arc<AtomicBool>,
    shutdown: watch::Receiver<bool>,
) {
    crate::reconcile::follow::follow_all(
        client.clone(),
        "CachePolicy",
        shutdown,
        |policies: Vec<CachePolicy>| {
            let (client, table, leader) = (client.clone(), table.clone(), leader.clone());
            async move { sync(&client, &table, &policies, leader.load(Ordering::Relaxed)).await }
        },
    )
    .await;
}
