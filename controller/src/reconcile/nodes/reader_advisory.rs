//! The advisory `ReadersHealthy` condition on `ModelCache` requests (issue 8 deliverable 6;
//! spec 004 "Qualification" point 3: writes from a reader must fail with `EROFS`).
//!
//! Reader pods of bound caches are planned as [`ReaderMount`]s on the nodes they run on
//! (`reconcile::model_cache::plan::reader_mounts`, merged by [`super::plans::add_reader_mounts`]);
//! each node's agent runs its `mounts` check on them and reports one result per mount (subject
//! `<namespace>/<pod>:<path>`), which lands on the `CacheNode`. This module reflects those results
//! on the requests: [`reader_advisories`] is pure (plans + the registry's latest reports → one
//! verdict per binding), [`sync_reader_conditions`] is the thin writer.
//!
//! | status | reason | when |
//! |---|---|---|
//! | False | `ReaderVolumeWritable` | a reader mount is mounted read-write or accepted a write probe |
//! | False | `ReaderVolumeDigestMismatch` | a reader mount's sample file differs from the writer's digest |
//! | False | `ReaderVolumeMissing` | nothing is mounted at a reader pod's planned path |
//! | False | `ReaderCheckFailing` | the check failed a mount with a reason this controller does not know |
//! | Unknown | `ReaderReportStale` | no failure, but a mount's node agent is connected and its last check report is older than 3 check intervals + 60 s (a hung pass) |
//! | Unknown | `AwaitingReports` | no failure, but a mount's node has no connected agent, or its agent has not reported on it yet |
//! | Unknown | `PodNotFound` | no failure, but the agent found no process of a reader pod |
//! | Unknown | `ReaderCheckInconclusive` | no failure, but the agent could not judge a mount |
//! | True | `ReadersReadOnly` | every planned reader mount was reported passing |
//! | (absent) | | no reader mount of the request's binding is planned (modes `none` / `ephemeral`, no reader pods) |
//!
//! Among several failures the reason follows the order of the table (a writable reader first);
//! the message names every failing mount as `node: namespace/pod at path (Reason)` (at most
//! [`MAX_LISTED`], then a count; at most [`MAX_MESSAGE`] bytes).
//!
//! **Per binding.** A [`ReaderMount`] names the binding that planned it, not the request, and
//! requests that share a binding share one copy of the data: a writable reader of that copy
//! threatens every request bound to it, so every request of the binding gets the same verdict.
//!
//! The condition is advisory: the model-cache reconciler's `Ready` logic never reads it, and the
//! Pod webhook still wires pods by `Ready` alone. Ownership of the status and the write protocol
//! are described on [`sync_reader_conditions`].
//!
//! One concept: the `ReadersHealthy` condition, from the agents' mount results to the patch that
//! writes it (its tests are in `reader_advisory/tests.rs`).

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::crd::conditions::{
    find_condition, new_condition, remove_condition, set_condition, ConditionStatus,
};
use ic_shared::crd::{model_cache_condition, model_cache_reason as r, ModelCache};
use ic_shared::plan::{NodePlan, ReaderMount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{json, Value};

use crate::ingest::registry::NodeRecord;

use super::advisory::AdvisoryReport;
use super::cachenode::{vouches_for_nothing, FIELD_MANAGER};

/// The condition type (`ReadersHealthy`).
pub const CONDITION_TYPE: &str = model_cache_condition::READERS_HEALTHY;

/// Name of the agent's reader-volume check (`agent/src/checks/mounts.rs`).
pub const MOUNTS_CHECK: &str = "mounts";

/// The agent's `mounts` reasons this module maps (see `docs/checks.md`).
pub mod agent_reason {
    /// Ok: mounted read-only, every write probe refused.
    pub const READER_VOLUME_READ_ONLY: &str = "ReaderVolumeReadOnly";
    /// Ok: mounted (read-only not required).
    pub const READER_VOLUME_MOUNTED: &str = "ReaderVolumeMounted";
    /// Critical: read-write, or a write probe went through.
    pub const READER_VOLUME_WRITABLE: &str = "ReaderVolumeWritable";
    /// Critical: a sample's digest differs or it cannot be read.
    pub const READER_VOLUME_DIGEST_MISMATCH: &str = "ReaderVolumeDigestMismatch";
    /// Critical: nothing mounted at the path (Unknown for a relative plan path).
    pub const READER_VOLUME_MISSING: &str = "ReaderVolumeMissing";
    /// Unknown: no process of the pod on the node.
    pub const POD_NOT_FOUND: &str = "PodNotFound";
}

/// Most mounts named in a message.
pub const MAX_LISTED: usize = 10;

/// Longest message written (bytes; the API allows 32768).
pub const MAX_MESSAGE: usize = 1024;

/// The verdict for one binding (and so for every request bound to it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaderAdvisory {
    /// Condition status.
    pub status: ConditionStatus,
    /// CamelCase reason (from [`ic_shared::crd::model_cache_reason`]).
    pub reason: &'static str,
    /// A sentence naming the nodes, pods and paths concerned.
    pub message: String,
}

/// What is known about one planned reader mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MountOutcome {
    /// The agent reported it passing (`ReaderVolumeReadOnly` / `ReaderVolumeMounted`).
    Passed,
    /// The agent failed it (Warning or Critical); the condition reason.
    Failed(&'static str),
    /// The agent reported it Unknown; the condition reason.
    Inconclusive(&'static str),
    /// The node's agent is not connected (never connected, disconnected or expired).
    AgentNotConnected,
    /// The agent is connected but its latest report has no result for this mount (its plan
    /// may not carry the mount yet).
    NotReported,
    /// The agent is connected but its last report is stale or says no check could run ([`vouches_for_nothing`]): what it
    /// said then is not vouched for now.
    ReportStale,
}

/// One planned reader mount with its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountVerdict {
    /// Node the reader pod runs on.
    pub node: String,
    /// Reader pod namespace.
    pub namespace: String,
    /// Reader pod name.
    pub pod: String,
    /// Mount path in the pod.
    pub path: String,
    /// What the agent said.
    pub outcome: MountOutcome,
}

impl MountVerdict {
    fn item(&self) -> String {
        let what = match self.outcome {
            MountOutcome::Passed => "passing",
            MountOutcome::Failed(reason) | MountOutcome::Inconclusive(reason) => reason,
            MountOutcome::AgentNotConnected => "no node agent connected",
            MountOutcome::NotReported => "not reported yet",
            MountOutcome::ReportStale => "no check report for over 3 check intervals",
        };
        format!(
            "{}: {}/{} at {} ({what})",
            self.node, self.namespace, self.pod, self.path
        )
    }
}

/// The check subject the agent reports a reader mount under: `<namespace>/<pod>:<path>`.
pub fn mount_subject(m: &ReaderMount) -> String {
    format!("{}/{}:{}", m.namespace, m.pod, m.path)
}

/// The key of a request's binding in [`reader_advisories`]: `<control namespace>/<binding>`,
/// as the plans' [`ReaderMount::binding`] spells it. `None` while the request has no binding.
pub fn binding_key(control_namespace: &str, mc: &ModelCache) -> Option<String> {
    let b = mc.status.as_ref()?.binding.as_ref()?;
    (!b.name.is_empty()).then(|| format!("{control_namespace}/{}", b.name))
}

/// The condition reason for a failing agent reason (Warning or Critical).
fn failed_reason(agent: &str) -> &'static str {
    match agent {
        agent_reason::READER_VOLUME_WRITABLE => r::READER_VOLUME_WRITABLE,
        agent_reason::READER_VOLUME_DIGEST_MISMATCH => r::READER_VOLUME_DIGEST_MISMATCH,
        agent_reason::READER_VOLUME_MISSING => r::READER_VOLUME_MISSING,
        _ => r::READER_CHECK_FAILING,
    }
}

/// The condition reason for an Unknown agent result.
fn inconclusive_reason(agent: &str) -> &'static str {
    match agent {
        agent_reason::POD_NOT_FOUND => r::READER_POD_NOT_FOUND,
        _ => r::READER_CHECK_INCONCLUSIVE,
    }
}

/// What the latest report of `record` says about `mount`. A result whose `podUid` differs from
/// the planned pod's UID is about an earlier pod of that name and does not count. A mount
/// without its own result, on a node whose `mounts` check reported Unknown as a whole (subject
/// `host`: the check panicked or returned nothing), is inconclusive. A connected agent whose
/// last report is stale at `now_ms` (controller clock, Unix ms) is [`MountOutcome::ReportStale`].
pub fn mount_outcome(
    mount: &ReaderMount,
    record: Option<&NodeRecord>,
    now_ms: i64,
) -> MountOutcome {
    let Some(rec) = record.filter(|r| r.connected) else {
        return MountOutcome::AgentNotConnected;
    };
    if vouches_for_nothing(rec, now_ms) {
        return MountOutcome::ReportStale;
    }
    let subject = mount_subject(mount);
    let same_pod = |c: &CheckResult| match (c.observed.get("podUid"), mount.pod_uid.as_ref()) {
        (Some(got), Some(want)) => got == want,
        _ => true,
    };
    let worst = rec
        .checks
        .iter()
        .filter(|c| c.name == MOUNTS_CHECK && c.subject == subject && same_pod(c))
        .max_by_key(|c| c.status.severity());
    match worst {
        Some(c) => match c.status {
            CheckStatus::Ok => MountOutcome::Passed,
            CheckStatus::Warning | CheckStatus::Critical => {
                MountOutcome::Failed(failed_reason(&c.reason))
            }
            CheckStatus::Unknown => MountOutcome::Inconclusive(inconclusive_reason(&c.reason)),
        },
        None if rec.checks.iter().any(|c| {
            c.name == MOUNTS_CHECK && c.subject == "host" && c.status == CheckStatus::Unknown
        }) =>
        {
            MountOutcome::Inconclusive(r::READER_CHECK_INCONCLUSIVE)
        }
        None => MountOutcome::NotReported,
    }
}

/// Every planned reader mount, grouped by binding key ([`ReaderMount::binding`]), with its
/// outcome. Mounts without a binding (a plan file in standalone mode) are left out.
pub fn mount_verdicts(
    plans: &BTreeMap<String, NodePlan>,
    records: &BTreeMap<String, NodeRecord>,
    now_ms: i64,
) -> BTreeMap<String, Vec<MountVerdict>> {
    let mut out: BTreeMap<String, Vec<MountVerdict>> = BTreeMap::new();
    for (node, plan) in plans {
        for m in &plan.reader_mounts {
            if m.binding.is_empty() {
                continue;
            }
            out.entry(m.binding.clone())
                .or_default()
                .push(MountVerdict {
                    node: node.clone(),
                    namespace: m.namespace.clone(),
                    pod: m.pod.clone(),
                    path: m.path.clone(),
                    outcome: mount_outcome(m, records.get(node), now_ms),
                });
        }
    }
    out
}

/// Computes every binding's verdict from the node plans (which reader mounts run where) and the
/// agents' records (their latest reports). Bindings without planned reader mounts get no entry.
pub fn reader_advisories(
    plans: &BTreeMap<String, NodePlan>,
    records: &BTreeMap<String, NodeRecord>,
    now_ms: i64,
) -> BTreeMap<String, ReaderAdvisory> {
    mount_verdicts(plans, records, now_ms)
        .into_iter()
        .map(|(binding, verdicts)| {
            let adv = advisory_for(&binding, &verdicts);
            (binding, adv)
        })
        .collect()
}

/// Precedence of the False reasons (first wins).
const FAILED_ORDER: [&str; 4] = [
    r::READER_VOLUME_WRITABLE,
    r::READER_VOLUME_DIGEST_MISMATCH,
    r::READER_VOLUME_MISSING,
    r::READER_CHECK_FAILING,
];

fn list(items: &[String]) -> String {
    let shown: Vec<&str> = items.iter().take(MAX_LISTED).map(String::as_str).collect();
    if items.len() > MAX_LISTED {
        format!("{} and {} more", shown.join("; "), items.len() - MAX_LISTED)
    } else {
        shown.join("; ")
    }
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE - '…'.len_utf8();
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// The verdict for one binding's planned mounts (not empty).
pub fn advisory_for(binding: &str, verdicts: &[MountVerdict]) -> ReaderAdvisory {
    let failed: Vec<&MountVerdict> = verdicts
        .iter()
        .filter(|v| matches!(v.outcome, MountOutcome::Failed(_)))
        .collect();
    let undecided: Vec<&MountVerdict> = verdicts
        .iter()
        .filter(|v| !matches!(v.outcome, MountOutcome::Passed | MountOutcome::Failed(_)))
        .collect();
    let nodes = |vs: &[&MountVerdict], sep: &str| -> String {
        let n: BTreeSet<&str> = vs.iter().map(|v| v.node.as_str()).collect();
        n.into_iter().collect::<Vec<_>>().join(sep)
    };
    if !failed.is_empty() {
        let reason = FAILED_ORDER
            .iter()
            .copied()
            .find(|want| {
                failed
                    .iter()
                    .any(|v| v.outcome == MountOutcome::Failed(want))
            })
            .unwrap_or(r::READER_CHECK_FAILING);
        // The mounts of the leading reason first, then the others.
        let mut ordered = failed.clone();
        ordered.sort_by_key(|v| v.outcome != MountOutcome::Failed(reason));
        let items: Vec<String> = ordered.iter().map(|v| v.item()).collect();
        let action = match reason {
            r::READER_VOLUME_WRITABLE => {
                "A writable reader can corrupt the shared copy for every pod: mount the reader \
                 claim with readOnly: true and check the reader PV (csi.readOnly: true, the \
                 catalog's readerMountOptions)."
            }
            r::READER_VOLUME_DIGEST_MISMATCH => {
                "The readers do not see what the writer wrote: the reader PV may point at \
                 another or a stale volume."
            }
            r::READER_VOLUME_MISSING => {
                "The pod does not mount the reader claim at the planned path: check its \
                 volumeMounts."
            }
            _ => "See the agent's message on the CacheNode.",
        };
        let mut message = format!(
            "Reader volumes of model cache binding {binding} fail the node agent's mounts \
             check: {}. {action} Details: `kubectl describe cachenode {}` (MountsHealthy).",
            list(&items),
            nodes(&failed, " ")
        );
        if !undecided.is_empty() {
            message.push_str(&format!(
                " {} other reader mount{} not judged yet.",
                undecided.len(),
                if undecided.len() == 1 { " is" } else { "s are" }
            ));
        }
        return ReaderAdvisory {
            status: ConditionStatus::False,
            reason,
            message: truncate(message),
        };
    }
    if !undecided.is_empty() {
        let awaiting = undecided.iter().any(|v| {
            matches!(
                v.outcome,
                MountOutcome::AgentNotConnected | MountOutcome::NotReported
            )
        });
        let pod_not_found = undecided
            .iter()
            .any(|v| v.outcome == MountOutcome::Inconclusive(r::READER_POD_NOT_FOUND));
        let stale = undecided
            .iter()
            .any(|v| v.outcome == MountOutcome::ReportStale);
        let (reason, lead) = if stale {
            (
                r::READER_REPORT_STALE,
                "A node agent has sent no check report for over 3 check intervals + 60 s (a \
                 check pass is hung, e.g. on an unreachable network volume; its CacheNode reads \
                 Ready=Unknown/ChecksStale), so its earlier verdict is not vouched for, on \
                 reader volumes of model cache binding",
            )
        } else if awaiting {
            (
                r::AWAITING_REPORTS,
                "Waiting for the node agents to report on reader volumes of model cache binding",
            )
        } else if pod_not_found {
            (
                r::READER_POD_NOT_FOUND,
                "The node agent found no process of reader pods (not started yet, or the agent \
                 cannot see the host's /proc) of model cache binding",
            )
        } else {
            (
                r::READER_CHECK_INCONCLUSIVE,
                "The node agent could not judge reader volumes of model cache binding",
            )
        };
        let items: Vec<String> = undecided.iter().map(|v| v.item()).collect();
        return ReaderAdvisory {
            status: ConditionStatus::Unknown,
            reason,
            message: truncate(format!("{lead} {binding}: {}.", list(&items))),
        };
    }
    let all: Vec<&MountVerdict> = verdicts.iter().collect();
    ReaderAdvisory {
        status: ConditionStatus::True,
        reason: r::READERS_READ_ONLY,
        message: truncate(format!(
            "The node agents report {} reader mount{} of model cache binding {binding} \
             read-only (every write probe refused with EROFS), on {}.",
            verdicts.len(),
            plural(verdicts.len()),
            nodes(&all, ", ")
        )),
    }
}

/// The condition for a verdict, stamped `at` (kept when the status does not change, see
/// [`apply_reader_condition`]).
pub fn reader_condition(
    adv: &ReaderAdvisory,
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

/// The condition a request should carry: its binding's verdict, or `None` (the condition is
/// absent) when no reader mount of its binding is planned.
pub fn desired_condition(
    mc: &ModelCache,
    control_namespace: &str,
    advisories: &BTreeMap<String, ReaderAdvisory>,
    at: Time,
) -> Option<Condition> {
    let key = binding_key(control_namespace, mc)?;
    advisories
        .get(&key)
        .map(|a| reader_condition(a, mc.metadata.generation, at))
}

/// Sets (`Some`) or removes (`None`) the condition in `conditions`, leaving every other
/// condition alone; `lastTransitionTime` moves only when the status changes. Returns true when
/// the list changed.
pub fn apply_reader_condition(conditions: &mut Vec<Condition>, desired: Option<Condition>) -> bool {
    match desired {
        Some(c) => set_condition(conditions, c),
        None => remove_condition(conditions, CONDITION_TYPE),
    }
}

/// True when the stored condition already says what `desired` says (the transition time aside).
pub fn is_current(conditions: &[Condition], desired: Option<&Condition>) -> bool {
    match (desired, find_condition(conditions, CONDITION_TYPE)) {
        (None, None) => true,
        (Some(w), Some(c)) => {
            w.status == c.status
                && w.reason == c.reason
                && w.message == c.message
                && w.observed_generation == c.observed_generation
        }
        _ => false,
    }
}

/// The merge patch of `modelcaches/status` that stores `conditions` (the whole list: a merge
/// patch replaces a list) under the precondition that the object is still at
/// `resource_version`.
pub fn conditions_patch(conditions: &[Condition], resource_version: &str) -> Value {
    let list = if conditions.is_empty() {
        Value::Null
    } else {
        serde_json::to_value(conditions).unwrap_or(Value::Null)
    };
    json!({
        "metadata": {"resourceVersion": resource_version},
        "status": {"conditions": list},
    })
}

/// Writes the condition on every request in `caches` whose stored condition differs from its
/// binding's verdict in `desired` (no verdict → the condition is removed).
///
/// **Write protocol.** The model-cache reconciler owns the rest of `status`, including the
/// other conditions, and writes it with merge patches of the whole status. Chart RBAC grants
/// only `patch` on `modelcaches/status`, so this writer cannot `replace` the status; it reads the
/// request, merges this one condition into the list it read ([`apply_reader_condition`]) and
/// sends a JSON merge patch of `status.conditions` that also carries the read
/// `metadata.resourceVersion` ([`conditions_patch`]). A merge patch replaces a list as a
/// whole, so without that precondition a write could drop a condition the reconciler set in
/// the meantime; with it the API server refuses a stale write (409), and the writer re-reads
/// and retries once (otherwise the next pass). A JSON patch (RFC 6902) would need the same read
/// (its list operations address conditions by index, so it needs a `test` of the
/// resourceVersion just the same) and is harder to read; a merge patch without the list would
/// need a strategic merge by `type`, which custom resources do not support. The reconciler, in
/// turn, keeps condition types it does not manage when it writes (it merges into the status it
/// read); should a racing reconciler write still drop this condition, the loop's periodic
/// resync writes it again.
pub async fn sync_reader_conditions(
    client: &Client,
    caches: &[ModelCache],
    control_namespace: &str,
    desired: &BTreeMap<String, ReaderAdvisory>,
    now: Time,
) -> AdvisoryReport {
    let mut report = AdvisoryReport::default();
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..Default::default()
    };
    for mc in caches {
        let ns = mc.namespace().unwrap_or_default();
        let key = format!("{ns}/{}", mc.name_any());
        let api: Api<ModelCache> = Api::namespaced(client.clone(), &ns);
        let mut obj = mc.clone();
        for attempt in 0..2 {
            let want = desired_condition(&obj, control_namespace, desired, now.clone());
            let mut conditions = obj
                .status
                .as_ref()
                .map(|s| s.conditions.clone())
                .unwrap_or_default();
            if is_current(&conditions, want.as_ref())
                || !apply_reader_condition(&mut conditions, want)
            {
                break;
            }
            let rv = obj.resource_version().unwrap_or_default();
            let name = obj.name_any();
            let result = api
                .patch_status(
                    &name,
                    &params,
                    &Patch::Merge(conditions_patch(&conditions, &rv)),
                )
                .await;
            match report.settle(&api, &key, &name, result, attempt == 0).await {
                Some(fresh) => obj = fresh,
                None => break,
            }
        }
    }
    report
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
