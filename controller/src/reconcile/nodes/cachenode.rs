//! The `CacheNode` status writer (DESIGN.md "Status"; `docs/in-cluster.md` "CacheNode").
//!
//! One cluster-scoped `CacheNode` per node (name = node name), written by the leader from what
//! the node's agent reported. [`desired_status`] is pure: from the node's registry record, its
//! plan and the index's streams it computes the whole status, carrying over the previous
//! conditions so that `lastTransitionTime` moves only when a condition's status changes.
//! [`WriteLimiter`] decides whether to write it now: at most one write per node per
//! `min_interval`, except that a condition whose status changed is written at once.
//! [`CacheNodeWriter`] is the thin kube layer (create when missing, then a merge patch of the
//! status subresource that also removes fields that became absent).
//!
//! Conditions (types from [`node_condition`]):
//!
//! | type | status | reason |
//! |---|---|---|
//! | `Ready` | True | `NodeReady` — agent connected, no check Critical |
//! | `Ready` | False | `CheckCritical` (the checks named), `AgentDisconnected`, `AgentNotConnected` |
//! | `Ready` | Unknown | `AwaitingFirstReport` — connected, no check report yet |
//! | `AgentConnected` | True / False | `AgentConnected` / `AgentDisconnected`, `AgentNotConnected` |
//! | one per check (`condition_type_for_check`) | Ok → True, Warning/Critical → False, Unknown → Unknown | the reason of the worst result of that check |

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::crd::conditions::{new_condition, set_condition, ConditionStatus};
use ic_shared::crd::{
    check_condition_status, condition_type_for_check, node_condition, CacheNode, CacheNodeSpec,
    CacheNodeStatus, EngineStreamsStatus, GpuStatus, KvStreamStatus, NodeHealth,
};
use ic_shared::plan::NodePlan;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::Value;

use crate::index::ReplicaSnapshot;
use crate::ingest::registry::NodeRecord;
use crate::reconcile::clock::{elapsed, to_time};

/// Reasons on CacheNode conditions written by the controller itself.
pub mod reason {
    /// Ready=True.
    pub const NODE_READY: &str = "NodeReady";
    /// Ready=False: a check is Critical.
    pub const CHECK_CRITICAL: &str = "CheckCritical";
    /// Ready=Unknown: connected, no report yet.
    pub const AWAITING_FIRST_REPORT: &str = "AwaitingFirstReport";
    /// Ready=Unknown: connected, but the last check report is older than a few of the agent's
    /// check intervals (a check pass is hung; [`super::report_age_if_stale`]).
    pub const CHECKS_STALE: &str = "ChecksStale";
    /// Ready=Unknown: the agent reported that no check could run (its checks thread is gone:
    /// the agent's `ChecksUnavailable` result).
    pub const CHECKS_UNAVAILABLE: &str = ic_shared::check::CHECKS_UNAVAILABLE;
    /// AgentConnected=True.
    pub const AGENT_CONNECTED: &str = "AgentConnected";
    /// AgentConnected=False / Ready=False: the agent's stream ended.
    pub const AGENT_DISCONNECTED: &str = "AgentDisconnected";
    /// AgentConnected=False / Ready=False: engine pods are planned here but no agent ever
    /// connected (since this controller started).
    pub const AGENT_NOT_CONNECTED: &str = "AgentNotConnected";
}

/// A check report is stale once older than this many of the agent's check intervals, plus
/// [`STALE_MARGIN_MS`] (a pass itself takes time: the CUDA probe waits up to its timeout).
pub const STALE_AFTER_INTERVALS: i64 = 3;
/// See [`STALE_AFTER_INTERVALS`].
pub const STALE_MARGIN_MS: i64 = 60_000;

/// The age in seconds of `r`'s last check report when it is stale at `now_ms` (controller
/// clocks both); `None` when fresh, or when the agent did not say its interval (older agents).
pub fn report_age_if_stale(r: &NodeRecord, now_ms: i64) -> Option<i64> {
    let interval_ms = i64::try_from(r.check_interval_seconds)
        .unwrap_or(i64::MAX / 4)
        .saturating_mul(1000);
    if interval_ms == 0 || r.report_received_unix_ms == 0 {
        return None;
    }
    let age = now_ms.saturating_sub(r.report_received_unix_ms);
    (age > interval_ms
        .saturating_mul(STALE_AFTER_INTERVALS)
        .saturating_add(STALE_MARGIN_MS))
    .then_some(age / 1000)
}

/// Whether `r`'s latest report vouches for nothing on its node at `now_ms`: it is stale
/// ([`report_age_if_stale`]), or it says no check could run ([`reason::CHECKS_UNAVAILABLE`]).
/// The roll-ups (NodeHealthy, ReadersHealthy) then read the node as Unknown.
pub fn vouches_for_nothing(r: &NodeRecord, now_ms: i64) -> bool {
    report_age_if_stale(r, now_ms).is_some()
        || r.checks
            .iter()
            .any(|c| c.reason == reason::CHECKS_UNAVAILABLE)
}

/// Longest condition message written (the API allows 32768 bytes).
const MAX_MESSAGE: usize = 2048;

fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// Everything the controller knows about one node.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    /// Node name.
    pub node: &'a str,
    /// Its agent's registry record (`None`: no agent connected since start).
    pub record: Option<&'a NodeRecord>,
    /// Its current plan.
    pub plan: Option<&'a NodePlan>,
    /// The index's streams reported by this node.
    pub replicas: &'a [ReplicaSnapshot],
    /// Whether `plan` comes from this leadership's plan pass (false before its first one: the
    /// plans are empty then, and `engines` / `engineCount` keep their previous values).
    pub plans_authoritative: bool,
}

fn time_of_ms(ms: i64) -> Option<Time> {
    (ms > 0)
        .then(|| Timestamp::from_millisecond(ms).ok())
        .flatten()
        .map(to_time)
}

/// The condition of one check: worst result decides the status; the reason is the first worst
/// result's; the message lists the results at that severity (`subject: message`).
pub fn check_condition(name: &str, results: &[&CheckResult], at: Time) -> Condition {
    let worst = CheckStatus::worst(results.iter().map(|r| r.status));
    let top: Vec<&&CheckResult> = results.iter().filter(|r| r.status == worst).collect();
    let reason = top
        .first()
        .map(|r| r.reason.clone())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| worst.to_string());
    let message = top
        .iter()
        .map(|r| {
            if r.subject.is_empty() || r.subject == "host" {
                r.message.clone()
            } else {
                format!("{}: {}", r.subject, r.message)
            }
        })
        .collect::<Vec<_>>()
        .join("; ");
    new_condition(
        condition_type_for_check(name),
        check_condition_status(worst),
        reason,
        truncate(message),
        None,
        at,
    )
}

fn gpu_status(r: &CheckResult) -> Option<GpuStatus> {
    let index: i32 = r
        .observed
        .get("index")
        .and_then(|v| v.parse().ok())
        .or_else(|| r.subject.strip_prefix("gpu").and_then(|i| i.parse().ok()))?;
    Some(GpuStatus {
        index,
        uuid: r.observed.get("uuid").cloned(),
        name: r.observed.get("name").cloned(),
        status: NodeHealth::from(r.status),
        reason: Some(r.reason.clone()).filter(|s| !s.is_empty()),
        message: Some(r.message.clone()).filter(|s| !s.is_empty()),
    })
}

/// A sentence for a stream that is not Exact (`None` when it is).
fn coverage_message(state: &str, reason: Option<&str>) -> Option<String> {
    if state == "Exact" || state.is_empty() {
        return None;
    }
    Some(match reason.and_then(ic_shared::kv::coverage::describe) {
        Some(why) => format!("{state}: {why}"),
        None => format!("coverage {state}"),
    })
}

fn engines_status(
    plan: Option<&NodePlan>,
    replicas: &[ReplicaSnapshot],
) -> Vec<EngineStreamsStatus> {
    let Some(plan) = plan else {
        return Vec::new();
    };
    let by_stream: HashMap<&str, &ReplicaSnapshot> =
        replicas.iter().map(|r| (r.stream_id.as_str(), r)).collect();
    plan.engines
        .iter()
        .map(|e| EngineStreamsStatus {
            namespace: e.namespace.clone(),
            pod: e.pod.clone(),
            model: Some(e.model.clone()).filter(|m| !m.is_empty()),
            streams: e
                .kv_events
                .iter()
                .map(|s| {
                    let r = by_stream.get(e.stream_id(s.dp_rank).as_str());
                    KvStreamStatus {
                        endpoint: s.endpoint.clone(),
                        dp_rank: i32::try_from(s.dp_rank).ok(),
                        connected: r.is_some_and(|r| {
                            !r.stale
                                && !matches!(r.coverage, "Disconnected" | "EngineDown")
                                && r.coverage_reason
                                    != Some(ic_shared::kv::coverage::AGENT_DISCONNECTED)
                        }),
                        last_event_at: r.and_then(|r| time_of_ms(r.last_event_unix_ms)),
                        prefix_count: r.map_or(0, |r| r.prefix_count as i64),
                        coverage: r.map(|r| r.coverage.to_string()).filter(|c| !c.is_empty()),
                        coverage_reason: r.and_then(|r| r.coverage_reason.map(str::to_string)),
                        message: match r {
                            None => Some("the agent has reported no state for this stream yet".into()),
                            Some(r) if r.stale => Some(
                                "stream state is uncertain (a sequence gap without replay); it contributes no prefixes until it recovers".into(),
                            ),
                            Some(r) => coverage_message(r.coverage, r.coverage_reason),
                        },
                    }
                })
                .collect(),
        })
        .collect()
}

/// The node's whole desired status. `previous` supplies transition times: a condition whose
/// status is unchanged keeps its `lastTransitionTime`; `now` stamps the others.
pub fn desired_status(
    view: &NodeView<'_>,
    previous: Option<&CacheNodeStatus>,
    now: Time,
) -> CacheNodeStatus {
    let mut wanted: Vec<Condition> = Vec::new();
    let rec = view.record;
    let connected = rec.is_some_and(|r| r.connected);
    let reported = rec.is_some_and(|r| r.last_report_unix_ms > 0 || !r.checks.is_empty());

    // Per-check conditions, grouped by check name.
    let mut by_check: BTreeMap<&str, Vec<&CheckResult>> = BTreeMap::new();
    if let Some(r) = rec {
        for c in &r.checks {
            by_check.entry(c.name.as_str()).or_default().push(c);
        }
    }
    let check_conds: Vec<Condition> = by_check
        .iter()
        .map(|(name, results)| check_condition(name, results, now.clone()))
        .collect();

    let critical: Vec<String> = by_check
        .iter()
        .filter(|(_, rs)| rs.iter().any(|r| r.status == CheckStatus::Critical))
        .map(|(name, rs)| {
            let reasons: Vec<&str> = rs
                .iter()
                .filter(|r| r.status == CheckStatus::Critical)
                .map(|r| r.reason.as_str())
                .collect();
            format!("{name} ({})", reasons.join(", "))
        })
        .collect();
    let warnings: Vec<&str> = by_check
        .iter()
        .filter(|(_, rs)| CheckStatus::worst(rs.iter().map(|r| r.status)) == CheckStatus::Warning)
        .map(|(name, _)| *name)
        .collect();
    let unknown: Vec<&str> = by_check
        .iter()
        .filter(|(_, rs)| rs.iter().any(|r| r.status == CheckStatus::Unknown))
        .map(|(name, _)| *name)
        .collect();
    let unavailable = by_check
        .values()
        .flatten()
        .find(|r| r.reason == reason::CHECKS_UNAVAILABLE);
    // Said after the verdict: checks (or subjects) whose state is not known.
    let not_known = if unknown.is_empty() {
        String::new()
    } else {
        format!(
            " Not known (Unknown results, see their conditions): {}.",
            unknown.join(", ")
        )
    };

    let (agent_status, agent_reason, agent_message) = match rec {
        Some(r) if r.connected => (
            ConditionStatus::True,
            reason::AGENT_CONNECTED,
            format!("ic-agent {} is connected.", r.agent_version),
        ),
        Some(_) => (
            ConditionStatus::False,
            reason::AGENT_DISCONNECTED,
            "The node agent's stream to the controller ended; the conditions below are its last report.".to_string(),
        ),
        None => (
            ConditionStatus::False,
            reason::AGENT_NOT_CONNECTED,
            "Engine pods run on this node but no node agent has connected: check the ic-agent DaemonSet (tolerations, node selector, image pull).".to_string(),
        ),
    };
    let (ready_status, ready_reason, ready_message) = if !connected {
        (ConditionStatus::False, agent_reason, agent_message.clone())
    } else if !critical.is_empty() {
        (
            ConditionStatus::False,
            reason::CHECK_CRITICAL,
            format!(
                "Critical node checks: {}. Engines on this node will fail until they pass.",
                critical.join(", ")
            ),
        )
    } else if !reported {
        (
            ConditionStatus::Unknown,
            reason::AWAITING_FIRST_REPORT,
            "The agent is connected but has not reported checks yet.".to_string(),
        )
    } else if let Some((age, interval)) = rec.and_then(|r| {
        report_age_if_stale(r, now.0.as_millisecond()).map(|a| (a, r.check_interval_seconds))
    }) {
        (
            ConditionStatus::Unknown,
            reason::CHECKS_STALE,
            format!(
                "The agent is connected but its last check report is {age} s old (it checks every {interval} s): a check pass is hung (e.g. on an unreachable network filesystem; see the agent's log). The conditions below are that report."
            ),
        )
    } else if let Some(r) = unavailable {
        (
            ConditionStatus::Unknown,
            reason::CHECKS_UNAVAILABLE,
            r.message.clone(),
        )
    } else if warnings.is_empty() && unknown.is_empty() {
        (
            ConditionStatus::True,
            reason::NODE_READY,
            "Every node check passes.".to_string(),
        )
    } else if warnings.is_empty() {
        (
            ConditionStatus::True,
            reason::NODE_READY,
            format!("No check fails.{not_known}"),
        )
    } else {
        (
            ConditionStatus::True,
            reason::NODE_READY,
            format!(
                "No check is critical; warnings: {}.{not_known}",
                warnings.join(", ")
            ),
        )
    };
    wanted.push(new_condition(
        node_condition::READY,
        ready_status,
        ready_reason,
        truncate(ready_message),
        None,
        now.clone(),
    ));
    wanted.push(new_condition(
        node_condition::AGENT_CONNECTED,
        agent_status,
        agent_reason,
        agent_message,
        None,
        now.clone(),
    ));
    wanted.extend(check_conds);

    // Carry transition times over from the previous status.
    let mut merged: Vec<Condition> = previous.map(|p| p.conditions.clone()).unwrap_or_default();
    for c in &wanted {
        set_condition(&mut merged, c.clone());
    }
    let conditions: Vec<Condition> = wanted
        .iter()
        .filter_map(|w| merged.iter().find(|c| c.type_ == w.type_).cloned())
        .collect();

    let mut gpus: Vec<GpuStatus> = rec
        .map(|r| {
            r.checks
                .iter()
                .filter(|c| c.name == "gpu" && c.subject.starts_with("gpu"))
                .filter_map(gpu_status)
                .collect()
        })
        .unwrap_or_default();
    gpus.sort_by_key(|g| g.index);
    gpus.dedup_by_key(|g| g.index);
    let (engines, engine_count) = match previous.filter(|_| !view.plans_authoritative) {
        Some(p) => (p.engines.clone(), p.engine_count),
        None => (
            engines_status(view.plan, view.replicas),
            i32::try_from(view.plan.map_or(0, |p| p.engines.len())).unwrap_or(i32::MAX),
        ),
    };

    CacheNodeStatus {
        conditions,
        last_report_time: rec.and_then(|r| time_of_ms(r.last_report_unix_ms)),
        agent_version: rec
            .map(|r| r.agent_version.clone())
            .filter(|v| !v.is_empty()),
        boot_id: rec.map(|r| r.boot_id.clone()).filter(|v| !v.is_empty()),
        observed_plan_generation: rec
            .filter(|r| r.plan_generation > 0)
            .and_then(|r| i64::try_from(r.plan_generation).ok()),
        gpu_count: i32::try_from(gpus.len()).unwrap_or(i32::MAX),
        engine_count,
        gpus,
        engines,
    }
}

/// Condition type → status, the part of a status whose change bypasses the rate limit.
pub fn condition_statuses(status: &CacheNodeStatus) -> BTreeMap<String, String> {
    status
        .conditions
        .iter()
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect()
}

/// Whether (and why) to write a node's status now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteDecision {
    /// Write: the object has no status yet, or a condition status changed, or the interval
    /// passed.
    Write(&'static str),
    /// Nothing differs from what was last written.
    Unchanged,
    /// Something differs, but the node was written less than `min_interval` ago and no
    /// condition status changed.
    RateLimited,
}

/// Per-node write rate limit (an injected time makes it testable).
#[derive(Debug, Clone)]
pub struct WriteLimiter {
    min_interval: Duration,
    last_write: HashMap<String, Timestamp>,
}

impl WriteLimiter {
    /// At most one write per node per `min_interval`, unless a condition status changed.
    pub fn new(min_interval: Duration) -> Self {
        WriteLimiter {
            min_interval,
            last_write: HashMap::new(),
        }
    }

    /// Decides for `node`, comparing `desired` with the status currently stored (`current`).
    pub fn decide(
        &self,
        node: &str,
        current: Option<&CacheNodeStatus>,
        desired: &CacheNodeStatus,
        now: Timestamp,
    ) -> WriteDecision {
        let Some(current) = current else {
            return WriteDecision::Write("first");
        };
        if current == desired {
            return WriteDecision::Unchanged;
        }
        if condition_statuses(current) != condition_statuses(desired) {
            return WriteDecision::Write("condition");
        }
        match self.last_write.get(node) {
            Some(t) if elapsed(&to_time(*t), now) < self.min_interval => WriteDecision::RateLimited,
            _ => WriteDecision::Write("interval"),
        }
    }

    /// Records a write of `node` at `now`.
    pub fn wrote(&mut self, node: &str, now: Timestamp) {
        self.last_write.insert(node.to_string(), now);
    }

    /// Forgets every node (after a leadership change).
    pub fn reset(&mut self) {
        self.last_write.clear();
    }
}

/// Status fields that a merge patch must null out when they became absent.
const OPTIONAL_STATUS_FIELDS: [&str; 7] = [
    "conditions",
    "lastReportTime",
    "agentVersion",
    "bootID",
    "observedPlanGeneration",
    "gpus",
    "engines",
];

/// The merge patch that makes the stored status equal to `status` (absent fields → null).
pub fn status_patch(status: &CacheNodeStatus) -> Value {
    let mut v = serde_json::to_value(status).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        for k in OPTIONAL_STATUS_FIELDS {
            m.entry(k.to_string()).or_insert(Value::Null);
        }
    }
    serde_json::json!({ "status": v })
}

/// Field manager of the controller's writes.
pub const FIELD_MANAGER: &str = "inference-cache-controller";

/// Writes CacheNode objects (the leader's job).
pub struct CacheNodeWriter {
    api: Api<CacheNode>,
    limiter: WriteLimiter,
    /// What the API holds, as far as we know (read once per node, then our own writes).
    stored: HashMap<String, Option<CacheNodeStatus>>,
}

impl CacheNodeWriter {
    /// A writer with the given rate limit.
    pub fn new(client: Client, min_interval: Duration) -> Self {
        CacheNodeWriter {
            api: Api::all(client),
            limiter: WriteLimiter::new(min_interval),
            stored: HashMap::new(),
        }
    }

    /// Forgets what was read and written (call when leadership is (re)gained, so the next
    /// pass reads the objects again).
    pub fn reset(&mut self) {
        self.limiter.reset();
        self.stored.clear();
    }

    /// Brings one node's CacheNode up to date (subject to the rate limit). Creates the object
    /// when missing. Errors are the API's.
    pub async fn sync_node(
        &mut self,
        view: &NodeView<'_>,
        now: Timestamp,
    ) -> Result<WriteDecision, kube::Error> {
        let node = view.node.to_string();
        let current = match self.stored.get(&node) {
            Some(s) => s.clone(),
            None => {
                let obj = self.api.get_opt(&node).await?;
                let status = match obj {
                    Some(o) => o.status,
                    None => {
                        let obj = CacheNode::new(
                            &node,
                            CacheNodeSpec {
                                node_name: Some(node.clone()),
                            },
                        );
                        match self.api.create(&PostParams::default(), &obj).await {
                            Ok(_) => {}
                            Err(kube::Error::Api(e)) if e.code == 409 => {}
                            Err(e) => return Err(e),
                        }
                        None
                    }
                };
                self.stored.insert(node.clone(), status.clone());
                status
            }
        };
        let desired = desired_status(view, current.as_ref(), to_time(now));
        let decision = self.limiter.decide(&node, current.as_ref(), &desired, now);
        if let WriteDecision::Write(_) = decision {
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..Default::default()
            };
            let res = self
                .api
                .patch_status(&node, &params, &Patch::Merge(status_patch(&desired)))
                .await;
            match res {
                Ok(_) => {
                    self.limiter.wrote(&node, now);
                    self.stored.insert(node, Some(desired));
                }
                Err(e) => {
                    // Read again next time (the object may have been deleted or changed).
                    self.stored.remove(&node);
                    return Err(e);
                }
            }
        }
        Ok(decision)
    }
}
