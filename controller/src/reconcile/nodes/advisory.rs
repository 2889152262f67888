//! The advisory `NodeHealthy` condition on CacheBackends (DESIGN.md "Status": agent results
//! "roll up into advisory conditions on the CacheBackends whose engine pods run on those
//! nodes"). It never gates `Ready`.
//!
//! | status | reason | when |
//! |---|---|---|
//! | False | `NodeCheckFailing` | a node running one of the backend's engine pods has a check at Warning or Critical (the message names each node and check, with its status and reason) |
//! | Unknown | `NodeAgentNotConnected` | no failing check, but a node running its engine pods has no connected agent |
//! | Unknown | `NodeReportPending` | agents connected, at least one has not reported yet |
//! | Unknown | `NodeReportStale` | no failing check elsewhere, and a connected agent's last report is older than 3 check intervals + 60 s (a check pass is hung) or says no check could run (`ChecksUnavailable`): that node's verdicts, failing ones included, are not vouched for |
//! | True | `NodesHealthy` | every node running its engine pods reports every check Ok (or Unknown) |
//! | (absent) | | the backend has no scheduled engine pod |
//!
//! A check result about a pod (subject `namespace/pod`) counts only for the backend that owns
//! that pod, and only while its `podUid` is the planned pod's (a result about an earlier pod of
//! that name does not count); host-wide results (`host`, `gpuN`, `tcp/N`) count for every
//! backend on the node.
//!
//! Where: the verdict goes to `status.nodeHealth` on every backend with scheduled engine pods
//! (status, reason, message, transition-only `lastTransitionTime`), and as the `NodeHealthy`
//! condition only where spec 000 "Conditions" leaves room for an advisory condition
//! ([`publishes_condition`]): events-only backends publish exactly Ready, Degraded and
//! Progressing, External ownership Ready and Progressing only, so there the condition is
//! removed (a stale one from an earlier release included) and `status.nodeHealth` alone
//! carries the roll-up.
//!
//! Ownership: the CacheBackend reconciler owns the rest of `status`; it keeps
//! `status.nodeHealth`, removes `NodeHealthy` where the spec fixes the set and mirrors
//! `status.nodeHealth` into it elsewhere ([`mirror_condition`]: a mode flip gets a coherent
//! set at once). This module writes only these two: it reads the backend, merges them into the
//! existing status ([`apply_advisory`], transition-only timestamps) and replaces the status
//! with the read `resourceVersion`, so a concurrent write by the reconciler is never lost (409
//! → read and retry once; otherwise the next pass).

use std::collections::BTreeMap;

use ic_shared::check::CheckStatus;
use ic_shared::crd::conditions::{
    find_condition, new_condition, remove_condition, set_condition, ConditionStatus,
};
use ic_shared::crd::{backend_condition, BackendNodeHealth, CacheBackend, CacheBackendSpec};
use ic_shared::plan::NodePlan;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

use crate::ingest::registry::NodeRecord;

use crate::reconcile::cachebackend::path::{classify, BackendPath};

use super::cachenode::vouches_for_nothing;

/// The condition type (`NodeHealthy`).
pub const CONDITION_TYPE: &str = backend_condition::NODE_HEALTHY;

/// Reasons of the advisory condition.
pub mod reason {
    /// True.
    pub const NODES_HEALTHY: &str = "NodesHealthy";
    /// False.
    pub const NODE_CHECK_FAILING: &str = "NodeCheckFailing";
    /// Unknown: a node has no connected agent.
    pub const NODE_AGENT_NOT_CONNECTED: &str = "NodeAgentNotConnected";
    /// Unknown: an agent has not reported yet.
    pub const NODE_REPORT_PENDING: &str = "NodeReportPending";
    /// Unknown: a connected agent's last report is stale (a check pass is hung).
    pub const NODE_REPORT_STALE: &str = "NodeReportStale";
}

/// The advisory verdict for one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAdvisory {
    /// Condition status.
    pub status: ConditionStatus,
    /// CamelCase reason ([`reason`]).
    pub reason: &'static str,
    /// A sentence naming the nodes and checks.
    pub message: String,
}

/// One failing check on one node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FailingCheck {
    /// Node.
    pub node: String,
    /// Check name.
    pub check: String,
    /// Worst status (Warning or Critical).
    pub status: String,
    /// Reason of the worst result.
    pub reason: String,
}

const MAX_LISTED: usize = 10;

fn list<T: std::fmt::Display>(items: &[T]) -> String {
    let shown: Vec<String> = items
        .iter()
        .take(MAX_LISTED)
        .map(|i| i.to_string())
        .collect();
    if items.len() > MAX_LISTED {
        format!("{} and {} more", shown.join(", "), items.len() - MAX_LISTED)
    } else {
        shown.join(", ")
    }
}

/// True when a check subject names a pod (`namespace/pod`) rather than a host surface.
fn pod_subject(subject: &str) -> Option<&str> {
    let (prefix, _) = subject.split_once('/')?;
    (!matches!(prefix, "tcp" | "udp" | "host")).then_some(subject)
}

/// Computes every backend's advisory from the node plans (which backends' engine pods run
/// where) and the agents' records, at `now_ms` (controller clock, Unix ms; judges a record's
/// staleness with [`vouches_for_nothing`]). Backends without planned engine pods get no entry.
pub fn advisories(
    plans: &BTreeMap<String, NodePlan>,
    records: &BTreeMap<String, NodeRecord>,
    now_ms: i64,
) -> BTreeMap<String, NodeAdvisory> {
    // backend → node → its pods there (`namespace/pod` → planned pod UID)
    let mut placement: BTreeMap<String, BTreeMap<String, PodsOnNode>> = BTreeMap::new();
    for (node, plan) in plans {
        for e in &plan.engines {
            if e.backend.is_empty() {
                continue;
            }
            placement
                .entry(e.backend.clone())
                .or_default()
                .entry(node.clone())
                .or_default()
                .insert(format!("{}/{}", e.namespace, e.pod), e.pod_uid.clone());
        }
    }
    placement
        .into_iter()
        .map(|(backend, nodes)| {
            let adv = advisory_for(&nodes, records, now_ms);
            (backend, adv)
        })
        .collect()
}

/// A backend's engine pods on one node: `namespace/pod` → planned pod UID.
type PodsOnNode = BTreeMap<String, Option<String>>;

fn advisory_for(
    nodes: &BTreeMap<String, PodsOnNode>,
    records: &BTreeMap<String, NodeRecord>,
    now_ms: i64,
) -> NodeAdvisory {
    let mut failing: Vec<FailingCheck> = Vec::new();
    let mut missing: Vec<String> = Vec::new();
    let mut pending: Vec<String> = Vec::new();
    let mut stale: Vec<String> = Vec::new();
    for (node, pods) in nodes {
        let Some(rec) = records.get(node).filter(|r| r.connected) else {
            missing.push(node.clone());
            continue;
        };
        if rec.last_report_unix_ms <= 0 && rec.checks.is_empty() {
            pending.push(node.clone());
            continue;
        }
        // A stale report, or a pass that could not run at all (the agent's checks thread is
        // gone), vouches for nothing on the node.
        if vouches_for_nothing(rec, now_ms) {
            stale.push(node.clone());
            continue;
        }
        let mut worst: BTreeMap<&str, (CheckStatus, &str)> = BTreeMap::new();
        for c in &rec.checks {
            if let Some(p) = pod_subject(&c.subject) {
                let planned = pods.get(p);
                let same_pod = match (c.observed.get("podUid"), planned) {
                    (Some(got), Some(Some(want))) => got == want,
                    (_, planned) => planned.is_some(),
                };
                if !same_pod {
                    continue;
                }
            }
            let e = worst
                .entry(c.name.as_str())
                .or_insert((CheckStatus::Ok, ""));
            if c.status.severity() > e.0.severity() {
                *e = (c.status, c.reason.as_str());
            }
        }
        for (check, (status, reason)) in worst {
            if matches!(status, CheckStatus::Warning | CheckStatus::Critical) {
                failing.push(FailingCheck {
                    node: node.clone(),
                    check: check.to_string(),
                    status: status.to_string(),
                    reason: reason.to_string(),
                });
            }
        }
    }
    let missing_sentence = (!missing.is_empty()).then(|| {
        format!(
            "No node agent is connected on {}, so their checks are unknown.",
            list(&missing)
        )
    });
    if !failing.is_empty() {
        let items: Vec<String> = failing
            .iter()
            .map(|f| format!("{}: {} {} ({})", f.node, f.check, f.status, f.reason))
            .collect();
        let mut message = format!(
            "Engine pods of this backend run on nodes with failing checks: {}. See `kubectl describe cachenode <node>`.",
            list(&items)
        );
        if let Some(s) = missing_sentence {
            message.push(' ');
            message.push_str(&s);
        }
        return NodeAdvisory {
            status: ConditionStatus::False,
            reason: reason::NODE_CHECK_FAILING,
            message,
        };
    }
    if let Some(s) = missing_sentence {
        return NodeAdvisory {
            status: ConditionStatus::Unknown,
            reason: reason::NODE_AGENT_NOT_CONNECTED,
            message: format!("Engine pods of this backend run on nodes without a node agent. {s}"),
        };
    }
    if !stale.is_empty() {
        return NodeAdvisory {
            status: ConditionStatus::Unknown,
            reason: reason::NODE_REPORT_STALE,
            message: format!(
                "The node agent on {} is connected but sends no current check verdict: no \
                 report for more than 3 check intervals + 60 s (a check pass is hung, e.g. on an \
                 unreachable network volume), or no check could run (its checks thread is \
                 gone), so its earlier verdicts are not vouched for. See `kubectl describe \
                 cachenode <node>` (Ready=Unknown/ChecksStale or ChecksUnavailable).",
                list(&stale)
            ),
        };
    }
    if !pending.is_empty() {
        return NodeAdvisory {
            status: ConditionStatus::Unknown,
            reason: reason::NODE_REPORT_PENDING,
            message: format!(
                "Waiting for the first check report from {}.",
                list(&pending)
            ),
        };
    }
    let all: Vec<&String> = nodes.keys().collect();
    NodeAdvisory {
        status: ConditionStatus::True,
        reason: reason::NODES_HEALTHY,
        message: format!(
            "Node checks pass on every node running this backend's engine pods: {}.",
            list(&all)
        ),
    }
}

/// The condition for an advisory, stamped `at` (kept when the status does not change, see
/// [`apply_advisory`]).
pub fn advisory_condition(
    adv: &NodeAdvisory,
    observed_generation: Option<i64>,
    at: Time,
) -> Condition {
    new_condition(
        CONDITION_TYPE,
        adv.status,
        adv.reason,
        adv.message.clone(),
        observed_generation,
        at,
    )
}

/// Whether a backend of `spec` publishes the `NodeHealthy` condition (spec 000 "Conditions"):
/// false for an events-only backend (exactly Ready, Degraded, Progressing) and for External
/// ownership (Ready and Progressing only); true for Offload-managed, host-only and the other
/// paths. Where false, `status.nodeHealth` alone carries the roll-up.
pub fn publishes_condition(spec: &CacheBackendSpec) -> bool {
    !matches!(
        classify(spec),
        BackendPath::EventsOnly | BackendPath::External(_)
    )
}

/// `status.nodeHealth` for an advisory, stamped `at` unless `prior` has the same status (then
/// its `lastTransitionTime` is kept).
pub fn node_health(
    adv: &NodeAdvisory,
    prior: Option<&BackendNodeHealth>,
    at: Time,
) -> BackendNodeHealth {
    let status = adv.status.as_str().to_string();
    let last_transition_time = match prior {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => at,
    };
    BackendNodeHealth {
        status,
        reason: adv.reason.to_string(),
        message: adv.message.clone(),
        last_transition_time,
    }
}

/// The `NodeHealthy` condition that mirrors `health` (its transition time included), for a
/// backend at `observed_generation`.
pub fn mirror_condition(health: &BackendNodeHealth, observed_generation: Option<i64>) -> Condition {
    Condition {
        type_: CONDITION_TYPE.to_string(),
        status: health.status.clone(),
        reason: health.reason.clone(),
        message: health.message.clone(),
        observed_generation,
        last_transition_time: health.last_transition_time.clone(),
    }
}

/// Sets (`Some`) or removes (`None`) the advisory condition in `conditions`, leaving every
/// other condition alone. Returns true when the list changed.
pub fn apply_advisory(conditions: &mut Vec<Condition>, desired: Option<Condition>) -> bool {
    match desired {
        Some(c) => set_condition(conditions, c),
        None => remove_condition(conditions, CONDITION_TYPE),
    }
}

/// Sets the roll-up of `cb` at `now` (`desired` `None`: the backend has no scheduled engine
/// pod): `status.nodeHealth`, and the `NodeHealthy` condition where [`publishes_condition`]
/// (removed elsewhere). Returns the new status when it differs from the current one.
pub fn desired_status(
    cb: &CacheBackend,
    desired: Option<&NodeAdvisory>,
    now: Time,
) -> Option<ic_shared::crd::CacheBackendStatus> {
    let current = cb.status.clone().unwrap_or_default();
    let mut next = current.clone();
    // A status from before `nodeHealth` existed: its condition's transition time stands.
    let prior = current.node_health.clone().or_else(|| {
        find_condition(&current.conditions, CONDITION_TYPE).map(|c| BackendNodeHealth {
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
            last_transition_time: c.last_transition_time.clone(),
        })
    });
    next.node_health = desired.map(|a| node_health(a, prior.as_ref(), now));
    let condition = match (&next.node_health, publishes_condition(&cb.spec)) {
        (Some(h), true) => Some(mirror_condition(h, cb.metadata.generation)),
        _ => None,
    };
    match (
        &condition,
        find_condition(&current.conditions, CONDITION_TYPE),
    ) {
        (None, None) => {}
        (Some(w), Some(c))
            if w.status == c.status
                && w.reason == c.reason
                && w.message == c.message
                && w.observed_generation == c.observed_generation => {}
        _ => {
            apply_advisory(&mut next.conditions, condition);
        }
    }
    (next != current).then_some(next)
}

/// What one pass of an advisory-condition writer did ([`sync_advisories`] on CacheBackends,
/// `reader_advisory::sync_reader_conditions` on ModelCaches).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdvisoryReport {
    /// Objects (`namespace/name`) whose condition was written.
    pub written: Vec<String>,
    /// Objects whose write failed (retried next pass), with the error.
    pub failed: Vec<(String, String)>,
}

impl AdvisoryReport {
    /// Records the outcome of one status write of `key` (object `name` in `api`'s namespace)
    /// and returns the object to try again with, if any: on the first attempt a conflict (409)
    /// re-reads the object and returns it; a vanished object (404) ends quietly; anything else
    /// ends as written or failed.
    pub(crate) async fn settle<K, T>(
        &mut self,
        api: &Api<K>,
        key: &str,
        name: &str,
        result: Result<T, kube::Error>,
        first_attempt: bool,
    ) -> Option<K>
    where
        K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        match result {
            Ok(_) => {
                self.written.push(key.to_string());
                None
            }
            Err(kube::Error::Api(e)) if e.code == 409 && first_attempt => {
                match api.get_opt(name).await {
                    Ok(fresh) => fresh,
                    Err(e) => {
                        self.failed.push((key.to_string(), e.to_string()));
                        None
                    }
                }
            }
            Err(kube::Error::Api(e)) if e.code == 404 => None,
            Err(e) => {
                self.failed.push((key.to_string(), e.to_string()));
                None
            }
        }
    }
}

/// Writes the roll-up ([`desired_status`]: `status.nodeHealth`, and the condition where the
/// spec leaves room for it) on every backend in `backends` where it differs from `desired`
/// (absent from `desired` → both are removed). Only the status subresource is
/// replaced, with the backend's `resourceVersion`; a conflict re-reads and retries once.
pub async fn sync_advisories(
    client: &Client,
    backends: &[CacheBackend],
    desired: &BTreeMap<String, NodeAdvisory>,
    now: Time,
) -> AdvisoryReport {
    let mut report = AdvisoryReport::default();
    for cb in backends {
        let ns = cb.namespace().unwrap_or_default();
        // `namespace/name`, as the node plans key backends (not through `plans`: that would tie
        // this file into the engine-pod import circle, scripts/check-imports.py).
        let key = format!("{ns}/{}", cb.name_any());
        let api: Api<CacheBackend> = Api::namespaced(client.clone(), &ns);
        let mut obj = cb.clone();
        for attempt in 0..2 {
            let Some(status) = desired_status(&obj, desired.get(&key), now.clone()) else {
                break;
            };
            obj.status = Some(status);
            let name = obj.name_any();
            let result = api
                .replace_status(&name, &PostParams::default(), &obj)
                .await;
            match report.settle(&api, &key, &name, result, attempt == 0).await {
                Some(fresh) => obj = fresh,
                None => break,
            }
        }
    }
    report
}
