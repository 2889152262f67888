//! Connected agents, their latest check results (`/v1/nodes`, the CacheNode writer), each open
//! stream's outbound handle, and the node plans pushed down those streams.
//!
//! Plans: the plan publisher (in-cluster mode, on the leader) hands the registry the desired
//! plan of every node ([`NodeRegistry::publish_plans`]); the registry stamps a new generation on
//! each plan whose content changed and sends it down the node's stream when one is open. A
//! stream that opens later gets the node's current plan first ([`NodeRegistry::attach`]). Once
//! plans were published the registry is *authoritative*: a node without engine pods gets an
//! empty plan, so its agent stops watching what an earlier plan named. Until then (standalone
//! mode, a replica that does not lead) nothing is sent and agents keep the plan they have.
//! Generations start at the `generation_base` given when the book becomes authoritative (the
//! publisher passes the current Unix time in ms), so they keep growing across leader changes
//! and restarts.
//!
//! Sends use `try_send` under the registry lock, so plan updates reach a stream in generation
//! order; a full queue leaves the plan pending and the next publish retries it.
//!
//! Per-pod subscribers (`Hello.pod_subscriber`) are kept apart from the node agents
//! ([`NodeRegistry::connect_subscriber`], [`SubscriberRecord`]): keyed by
//! [`PodScope::reporter_key`] (`<node>/<namespace>/<pod>`), so neither the node's agent nor
//! another pod's subscriber on the same node supersedes them; they get no plan, no CacheNode
//! and no check results, and are not counted in [`NodeRegistry::connected_count`].

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::link::PLAN_ADDITIVE;
use ic_shared::plan::NodePlan;
use ic_shared::proto::{controller_message, ControllerMessage, NodePlanUpdate};
use serde::Serialize;
use tokio::sync::mpsc;
use tonic::Status;

use super::auth::PodScope;

/// The sending half of an agent stream.
pub type Outbound = mpsc::Sender<Result<ControllerMessage, Status>>;

/// What the controller knows about one node's agent.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRecord {
    /// Node name from Hello.
    pub node: String,
    /// True while the agent's stream is open.
    pub connected: bool,
    /// Agent version from Hello.
    pub agent_version: String,
    /// Kernel boot id from Hello.
    pub boot_id: String,
    /// Agent process incarnation from Hello.
    pub agent_instance: String,
    /// Capabilities from Hello.
    pub capabilities: Vec<String>,
    /// Unix ms when the current (or last) stream opened.
    pub connected_at_unix_ms: i64,
    /// Unix ms of the last message from the agent.
    pub last_seen_unix_ms: i64,
    /// Unix ms the latest check pass finished on the node (0 before the first report).
    pub last_report_unix_ms: i64,
    /// Unix ms (controller clock) the latest check report arrived (0 before the first).
    pub report_received_unix_ms: i64,
    /// Seconds between the agent's check passes, as its latest report says (0: not said).
    pub check_interval_seconds: u64,
    /// Plan generation of the latest report.
    pub plan_generation: u64,
    /// Worst status of the latest check results.
    pub status: CheckStatus,
    /// Latest check results.
    pub checks: Vec<CheckResult>,
    /// Stream epoch; a newer stream from the same node supersedes an older one.
    #[serde(skip)]
    pub epoch: u64,
}

/// What the controller knows about one per-pod subscriber (`ic-agent subscribe`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubscriberRecord {
    /// Registry and index key, `<node>/<namespace>/<pod>`.
    pub key: String,
    /// Node from Hello.
    pub node: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// True while the subscriber's stream is open.
    pub connected: bool,
    /// Agent version from Hello.
    pub agent_version: String,
    /// Process incarnation from Hello.
    pub agent_instance: String,
    /// Unix ms when the current (or last) stream opened.
    pub connected_at_unix_ms: i64,
    /// Unix ms of the last message.
    pub last_seen_unix_ms: i64,
    /// Stream epoch; a newer stream for the same pod supersedes an older one.
    #[serde(skip)]
    pub epoch: u64,
}

/// The open stream of a node, for sending.
#[derive(Debug)]
struct Attached {
    epoch: u64,
    tx: Outbound,
    /// Generation of the last plan queued on this stream.
    sent_generation: Option<u64>,
    /// The agent said [`PLAN_ADDITIVE`]: it applies plans with fields it does not know.
    additive: bool,
}

/// All nodes that ever connected since start, plus the plan book.
#[derive(Debug, Default)]
pub struct NodeRegistry {
    nodes: BTreeMap<String, NodeRecord>,
    subscribers: BTreeMap<String, SubscriberRecord>,
    /// The sending half of each subscriber's open stream (epoch, sender), to end it when a
    /// newer stream of its pod takes over.
    subscriber_outbound: BTreeMap<String, (u64, Outbound)>,
    next_epoch: u64,
    outbound: BTreeMap<String, Attached>,
    plans: BTreeMap<String, NodePlan>,
    plans_authoritative: bool,
    generation_base: u64,
    /// Node → the engine pods (`namespace`, `pod`) known to run there, with what the plan says
    /// of each ([`PlannedPod`]); `None` until this replica derived plans once (standalone never
    /// does: no node scope).
    scope: Option<BTreeMap<String, NodeScope>>,
}

/// One node's planned engine pods, keyed by (`namespace`, `pod`).
type NodeScope = BTreeMap<(String, String), PlannedPod>;

/// What the node plans say of one engine pod: the only streams anyone may report for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlannedPod {
    /// The pod's UID when the plan knows it (a subscriber's token must carry the same one).
    pub uid: Option<String>,
    /// The data-parallel ranks the plan's KV-event sources have (`{0}` for an engine planned
    /// without a source: a single-rank engine). A stream of any other rank is refused
    /// (issue 38 item 4: any rank was accepted, so one pod token registered 200 000 streams).
    pub ranks: BTreeSet<u32>,
}

/// What one [`NodeRegistry::publish_plans`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishReport {
    /// Nodes whose plan content changed, with the new generation.
    pub changed: Vec<(String, u64)>,
    /// Plans queued on open streams (node, generation), including retries.
    pub sent: Vec<(String, u64)>,
    /// Nodes whose stream queue was full: their plan stays pending.
    pub pending: Vec<String>,
    /// Nodes with engine pods in their plan but no open agent stream.
    pub unserved: Vec<String>,
}

fn plan_message(plan: &NodePlan, additive: bool) -> Option<ControllerMessage> {
    let plan_json = if additive {
        serde_json::to_string(plan).ok()?
    } else {
        // An older agent's strict parser refuses unknown fields: send what it knows.
        serde_json::to_string(&plan.for_strict_agent()).ok()?
    };
    Some(ControllerMessage {
        msg: Some(controller_message::Msg::Plan(NodePlanUpdate {
            generation: plan.generation,
            plan_json,
        })),
    })
}

/// Queues `plan` on `a` unless it already carries that generation. Returns `Some(true)` when
/// queued, `Some(false)` when the queue is full, `None` when nothing was needed (or the stream
/// is gone).
fn send_plan(a: &mut Attached, plan: &NodePlan) -> Option<bool> {
    if a.sent_generation == Some(plan.generation) {
        return None;
    }
    let msg = plan_message(plan, a.additive)?;
    match a.tx.try_send(Ok(msg)) {
        Ok(()) => {
            a.sent_generation = Some(plan.generation);
            Some(true)
        }
        Err(mpsc::error::TrySendError::Full(_)) => Some(false),
        Err(mpsc::error::TrySendError::Closed(_)) => None,
    }
}

fn same_content(a: &NodePlan, b: &NodePlan) -> bool {
    let mut a = a.clone();
    a.generation = b.generation;
    a == *b
}

/// Identity of a stream, returned by [`NodeRegistry::connect`] and
/// [`NodeRegistry::connect_subscriber`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamTicket {
    /// Key of the stream's state in the registry and the index: the node name for a node
    /// agent, [`PodScope::reporter_key`] for a per-pod subscriber.
    pub node: String,
    /// Epoch of this stream.
    pub epoch: u64,
    /// The pod a subscriber stream may report for; `None` for a node agent.
    pub scope: Option<PodScope>,
}

impl StreamTicket {
    /// The node the stream's engines run on (stamped into stream descriptors).
    pub fn reporting_node(&self) -> &str {
        match &self.scope {
            Some(s) => &s.node,
            None => &self.node,
        }
    }
}

impl NodeRegistry {
    /// Records a new per-pod subscriber stream for `scope`; it supersedes any previous stream
    /// of the same pod, and nothing else.
    pub fn connect_subscriber(
        &mut self,
        hello: &ic_shared::proto::Hello,
        scope: &PodScope,
        tx: Outbound,
        now_ms: i64,
    ) -> StreamTicket {
        self.next_epoch += 1;
        let epoch = self.next_epoch;
        let key = scope.reporter_key();
        if let Some((_, old)) = self.subscriber_outbound.insert(key.clone(), (epoch, tx)) {
            // End the superseded stream now, as for a node agent (see `attach`).
            let _ = old.try_send(Err(super::superseded_status()));
        }
        self.subscribers.insert(
            key.clone(),
            SubscriberRecord {
                key: key.clone(),
                node: scope.node.clone(),
                namespace: scope.namespace.clone(),
                pod: scope.pod.clone(),
                connected: true,
                agent_version: hello.version.clone(),
                agent_instance: hello.agent_instance.clone(),
                connected_at_unix_ms: now_ms,
                last_seen_unix_ms: now_ms,
                epoch,
            },
        );
        StreamTicket {
            node: key,
            epoch,
            scope: Some(scope.clone()),
        }
    }

    /// Records a new node-agent stream from `hello.node`; it supersedes any previous stream of
    /// that node.
    pub fn connect(&mut self, hello: &ic_shared::proto::Hello, now_ms: i64) -> StreamTicket {
        self.next_epoch += 1;
        let epoch = self.next_epoch;
        let rec = self
            .nodes
            .entry(hello.node.clone())
            .or_insert_with(|| NodeRecord {
                node: hello.node.clone(),
                connected: false,
                agent_version: String::new(),
                boot_id: String::new(),
                agent_instance: String::new(),
                capabilities: Vec::new(),
                connected_at_unix_ms: 0,
                last_seen_unix_ms: 0,
                last_report_unix_ms: 0,
                report_received_unix_ms: 0,
                check_interval_seconds: 0,
                plan_generation: 0,
                status: CheckStatus::Unknown,
                checks: Vec::new(),
                epoch: 0,
            });
        rec.connected = true;
        rec.agent_version = hello.version.clone();
        rec.boot_id = hello.boot_id.clone();
        rec.agent_instance = hello.agent_instance.clone();
        rec.capabilities = hello.capabilities.clone();
        rec.connected_at_unix_ms = now_ms;
        rec.last_seen_unix_ms = now_ms;
        rec.epoch = epoch;
        StreamTicket {
            node: hello.node.clone(),
            epoch,
            scope: None,
        }
    }

    /// True when `ticket` is still the node's (or the subscriber's pod's) current stream.
    pub fn is_current(&self, ticket: &StreamTicket) -> bool {
        match ticket.scope {
            Some(_) => self
                .subscribers
                .get(&ticket.node)
                .is_some_and(|r| r.epoch == ticket.epoch),
            None => self
                .nodes
                .get(&ticket.node)
                .is_some_and(|r| r.epoch == ticket.epoch),
        }
    }

    /// Notes traffic on a stream.
    pub fn touch(&mut self, ticket: &StreamTicket, now_ms: i64) {
        if ticket.scope.is_some() {
            if let Some(r) = self.subscribers.get_mut(&ticket.node) {
                if r.epoch == ticket.epoch {
                    r.last_seen_unix_ms = now_ms;
                }
            }
            return;
        }
        if let Some(r) = self.nodes.get_mut(&ticket.node) {
            if r.epoch == ticket.epoch {
                r.last_seen_unix_ms = now_ms;
            }
        }
    }

    /// Stores a check report. Ignored for a superseded stream and for subscribers (which run
    /// no checks).
    pub fn report(
        &mut self,
        ticket: &StreamTicket,
        report: &ic_shared::proto::CheckReport,
        now_ms: i64,
    ) {
        if ticket.scope.is_some() {
            return;
        }
        if let Some(r) = self.nodes.get_mut(&ticket.node) {
            if r.epoch != ticket.epoch {
                return;
            }
            r.checks = report.results.iter().map(CheckResult::from).collect();
            r.status = CheckStatus::worst(r.checks.iter().map(|c| c.status));
            r.last_report_unix_ms = report.observed_at_unix_ms;
            // A re-sent pass (a reconnect sends the latest, however old) is dated by its age.
            r.report_received_unix_ms =
                now_ms.saturating_sub(i64::try_from(report.age_ms).unwrap_or(i64::MAX));
            r.check_interval_seconds = report.interval_seconds;
            r.plan_generation = report.plan_generation;
        }
    }

    /// Marks the node (or subscriber) disconnected, unless a newer stream already took over.
    /// Returns whether it did.
    pub fn disconnect(&mut self, ticket: &StreamTicket, now_ms: i64) -> bool {
        if ticket.scope.is_some() {
            if self
                .subscriber_outbound
                .get(&ticket.node)
                .is_some_and(|(epoch, _)| *epoch == ticket.epoch)
            {
                self.subscriber_outbound.remove(&ticket.node);
            }
            return match self.subscribers.get_mut(&ticket.node) {
                Some(r) if r.epoch == ticket.epoch => {
                    r.connected = false;
                    r.last_seen_unix_ms = now_ms;
                    true
                }
                _ => false,
            };
        }
        if self
            .outbound
            .get(&ticket.node)
            .is_some_and(|a| a.epoch == ticket.epoch)
        {
            self.outbound.remove(&ticket.node);
        }
        match self.nodes.get_mut(&ticket.node) {
            Some(r) if r.epoch == ticket.epoch => {
                r.connected = false;
                r.last_seen_unix_ms = now_ms;
                true
            }
            _ => false,
        }
    }

    /// Registers the sending half of the stream `ticket` and queues the node's current plan on
    /// it (once plans are authoritative, an empty plan when the node has none). Returns the
    /// generation queued, if any. Ignored for a superseded stream and for subscribers (a node
    /// plan is for the node's agent).
    pub fn attach(&mut self, ticket: &StreamTicket, tx: Outbound) -> Option<u64> {
        if ticket.scope.is_some() || !self.is_current(ticket) {
            return None;
        }
        let additive = self
            .nodes
            .get(&ticket.node)
            .is_some_and(|r| r.capabilities.iter().any(|c| c == PLAN_ADDITIVE));
        let mut a = Attached {
            epoch: ticket.epoch,
            tx,
            sent_generation: None,
            additive,
        };
        if self.plans_authoritative && !self.plans.contains_key(&ticket.node) {
            self.plans.insert(
                ticket.node.clone(),
                NodePlan {
                    generation: self.generation_base,
                    ..Default::default()
                },
            );
        }
        let queued = match self.plans.get(&ticket.node) {
            Some(plan) => match send_plan(&mut a, plan) {
                Some(true) => Some(plan.generation),
                _ => None,
            },
            None => None,
        };
        if let Some(old) = self.outbound.insert(ticket.node.clone(), a) {
            // End the superseded stream now: its agent, if it still runs, reconnects at once
            // instead of sending deltas nobody applies.
            if old.epoch != ticket.epoch {
                let _ = old.tx.try_send(Err(super::superseded_status()));
            }
        }
        queued
    }

    /// The sending half of the node's open stream.
    pub fn outbound(&self, node: &str) -> Option<Outbound> {
        self.outbound.get(node).map(|a| a.tx.clone())
    }

    /// Replaces the plan book with `desired` (node → plan; the generation field is ignored)
    /// and makes it authoritative. A node whose plan content changed gets the next generation;
    /// a node planned for the first time since the book became authoritative gets the base
    /// generation (`generation_base`, taken from the first call after the book was withdrawn
    /// or created; at least 1); a node that had a plan and is absent from `desired` gets an
    /// empty plan. Every open stream whose last queued generation differs from its node's plan
    /// gets the plan.
    pub fn publish_plans(
        &mut self,
        desired: BTreeMap<String, NodePlan>,
        generation_base: u64,
    ) -> PublishReport {
        if !self.plans_authoritative {
            self.plans_authoritative = true;
            self.generation_base = generation_base.max(1);
        }
        let mut report = PublishReport::default();
        let mut next: BTreeMap<String, NodePlan> = BTreeMap::new();
        let known: Vec<String> = self.plans.keys().cloned().collect();
        for node in known {
            if !desired.contains_key(&node) {
                next.insert(node, NodePlan::default());
            }
        }
        next.extend(desired);
        for (node, mut plan) in next {
            match self.plans.get(&node) {
                Some(old) if same_content(&plan, old) => {}
                Some(old) => {
                    plan.generation = old.generation + 1;
                    report.changed.push((node.clone(), plan.generation));
                    self.plans.insert(node, plan);
                }
                None => {
                    plan.generation = self.generation_base;
                    report.changed.push((node.clone(), plan.generation));
                    self.plans.insert(node, plan);
                }
            }
        }
        for (node, plan) in &self.plans {
            match self.outbound.get_mut(node) {
                Some(a) => match send_plan(a, plan) {
                    Some(true) => report.sent.push((node.clone(), plan.generation)),
                    Some(false) => report.pending.push(node.clone()),
                    None => {}
                },
                None if !plan.engines.is_empty() => report.unserved.push(node.clone()),
                None => {}
            }
        }
        // An empty plan of a node without a stream carries nothing a later stream would not
        // get anyway (attach queues an empty plan): forget it, so the book stays bounded.
        let outbound = &self.outbound;
        self.plans.retain(|node, plan| {
            outbound.contains_key(node) || !same_content(plan, &NodePlan::default())
        });
        report
    }

    /// Stops distributing plans (this replica no longer leads): forgets the book, so streams
    /// opened from now on get no plan, until the next [`NodeRegistry::publish_plans`].
    pub fn withdraw_plans(&mut self) {
        self.plans.clear();
        self.plans_authoritative = false;
        for a in self.outbound.values_mut() {
            a.sent_generation = None;
        }
    }

    /// Records which engine pods run on which node, from derived plans (every replica derives
    /// them, leader or not): from now on a node agent may report only those pods' streams
    /// ([`NodeRegistry::node_may_report`]).
    pub fn set_node_scope(&mut self, plans: &BTreeMap<String, NodePlan>) {
        self.scope = Some(
            plans
                .iter()
                .map(|(node, plan)| {
                    let pods = plan
                        .engines
                        .iter()
                        .map(|e| {
                            let mut ranks: BTreeSet<u32> =
                                e.kv_events.iter().map(|k| k.dp_rank).collect();
                            if ranks.is_empty() {
                                ranks.insert(0);
                            }
                            (
                                (e.namespace.clone(), e.pod.clone()),
                                PlannedPod {
                                    uid: e.pod_uid.clone(),
                                    ranks,
                                },
                            )
                        })
                        .collect();
                    (node.clone(), pods)
                })
                .collect(),
        );
    }

    /// Whether node `node`'s agent may report `desc`: always without a node scope (standalone,
    /// or before this replica's first plan derivation); otherwise only a stream of an engine
    /// pod the plans place on `node` — tenant = the pod's namespace, replica = the pod
    /// (`pod` or `pod#rank`), stream id `namespace/pod#rank`, rank one the plan has
    /// ([`PlannedPod::ranks`]).
    ///
    /// # Errors
    /// A sentence naming the stream and why it is outside the node's scope.
    pub fn node_may_report(
        &self,
        node: &str,
        desc: &ic_shared::proto::StreamDescriptor,
    ) -> Result<(), String> {
        let Some(scope) = &self.scope else {
            return Ok(());
        };
        let pod = desc
            .replica
            .split_once('#')
            .map_or(desc.replica.as_str(), |(p, _)| p);
        let Some(planned) = scope
            .get(node)
            .and_then(|pods| pods.get(&(desc.tenant.clone(), pod.to_string())))
        else {
            return Err(format!(
                "stream {:?} (pod {}/{}) is not an engine pod the controller knows on node {node:?}",
                desc.stream_id, desc.tenant, pod
            ));
        };
        let want = format!("{}/{}#{}", desc.tenant, pod, desc.dp_rank);
        if desc.stream_id != want {
            return Err(format!(
                "stream id {:?} does not match its pod and rank (expected {want:?})",
                desc.stream_id
            ));
        }
        if !planned.ranks.contains(&desc.dp_rank) {
            return Err(format!(
                "stream {:?} has data-parallel rank {} but the plan of pod {}/{} has ranks {:?}",
                desc.stream_id, desc.dp_rank, desc.tenant, pod, planned.ranks
            ));
        }
        Ok(())
    }

    /// The plan's record of engine pod `namespace/pod` on `node`, when a node scope is in
    /// force: `Ok(None)` without one (standalone, or before this replica first derived plans),
    /// `Ok(Some(_))` for a planned engine pod.
    ///
    /// # Errors
    /// A sentence saying the pod is not an engine pod the plans place on `node` (issue 38 item
    /// 6: a per-pod subscriber stream is accepted only for such a pod).
    pub fn planned_pod(
        &self,
        node: &str,
        namespace: &str,
        pod: &str,
    ) -> Result<Option<&PlannedPod>, String> {
        let Some(scope) = &self.scope else {
            return Ok(None);
        };
        scope
            .get(node)
            .and_then(|pods| pods.get(&(namespace.to_string(), pod.to_string())))
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "pod {namespace}/{pod} is not an engine pod the controller's node plans place on node {node:?}: only a planned engine pod's own subscriber may report KV events"
                )
            })
    }

    /// Whether a node scope is in force on this replica.
    pub fn has_node_scope(&self) -> bool {
        self.scope.is_some()
    }

    /// The node's current plan (generation stamped), if any.
    pub fn plan(&self, node: &str) -> Option<NodePlan> {
        self.plans.get(node).cloned()
    }

    /// Every node's current plan.
    pub fn plans(&self) -> BTreeMap<String, NodePlan> {
        self.plans.clone()
    }

    /// Whether plans were published (in-cluster mode).
    pub fn plans_authoritative(&self) -> bool {
        self.plans_authoritative
    }

    /// Nodes and subscribers disconnected for longer than `expiry_ms`; they are forgotten and
    /// their keys (what the index files their streams under) returned.
    pub fn expire(&mut self, now_ms: i64, expiry_ms: i64) -> Vec<String> {
        let mut gone: Vec<String> = self
            .nodes
            .values()
            .filter(|r| !r.connected && now_ms - r.last_seen_unix_ms > expiry_ms)
            .map(|r| r.node.clone())
            .collect();
        for n in &gone {
            self.nodes.remove(n);
        }
        let subscribers: Vec<String> = self
            .subscribers
            .values()
            .filter(|r| !r.connected && now_ms - r.last_seen_unix_ms > expiry_ms)
            .map(|r| r.key.clone())
            .collect();
        for k in &subscribers {
            self.subscribers.remove(k);
        }
        gone.extend(subscribers);
        gone
    }

    /// Every per-pod subscriber, sorted by key.
    pub fn subscribers(&self) -> Vec<SubscriberRecord> {
        self.subscribers.values().cloned().collect()
    }

    /// Number of open subscriber streams.
    pub fn connected_subscribers(&self) -> usize {
        self.subscribers.values().filter(|r| r.connected).count()
    }

    /// Number of open node-agent streams.
    pub fn connected_count(&self) -> usize {
        self.nodes.values().filter(|r| r.connected).count()
    }

    /// Every node, sorted by name.
    pub fn list(&self) -> Vec<NodeRecord> {
        self.nodes.values().cloned().collect()
    }

    /// One node.
    pub fn get(&self, node: &str) -> Option<NodeRecord> {
        self.nodes.get(node).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ic_shared::proto;

    fn hello(node: &str) -> proto::Hello {
        proto::Hello {
            node: node.into(),
            version: "1.0".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_newer_stream_supersedes_and_the_old_ones_end_does_not_disconnect() {
        let mut reg = NodeRegistry::default();
        let old = reg.connect(&hello("n1"), 1);
        let new = reg.connect(&hello("n1"), 2);
        assert!(!reg.is_current(&old));
        assert!(!reg.disconnect(&old, 3));
        assert!(reg.get("n1").unwrap().connected);
        assert!(reg.disconnect(&new, 4));
        assert!(!reg.get("n1").unwrap().connected);
        assert_eq!(reg.connected_count(), 0);
    }

    #[test]
    fn subscribers_are_keyed_by_pod_apart_from_the_nodes_agent() {
        let mut reg = NodeRegistry::default();
        let scope = |pod: &str| PodScope {
            node: "n1".into(),
            namespace: "ns".into(),
            pod: pod.into(),
        };
        let agent = reg.connect(&hello("n1"), 1);
        let (a_tx, mut a_rx) = mpsc::channel(4);
        let a = reg.connect_subscriber(&hello("n1"), &scope("a"), a_tx, 1);
        let b = reg.connect_subscriber(&hello("n1"), &scope("b"), mpsc::channel(4).0, 1);
        assert_eq!(a.node, "n1/ns/a");
        assert_eq!(a.reporting_node(), "n1");
        // Neither the agent nor another pod's subscriber supersedes a subscriber, and back.
        assert!(reg.is_current(&agent) && reg.is_current(&a) && reg.is_current(&b));
        assert_eq!((reg.connected_count(), reg.connected_subscribers()), (1, 2));
        assert_eq!(reg.list().len(), 1, "no CacheNode record for a subscriber");
        // No plan goes down a subscriber's stream.
        reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("a"))]), 1);
        let (tx, mut rx) = mpsc::channel(4);
        assert_eq!(reg.attach(&a, tx), None);
        assert!(rx.try_recv().is_err());
        // The same pod's restarted subscriber supersedes the old stream, which is ended at
        // once (Aborted), as a node agent's is.
        let a2 = reg.connect_subscriber(&hello("n1"), &scope("a"), mpsc::channel(4).0, 2);
        assert!(!reg.is_current(&a) && reg.is_current(&a2));
        assert_eq!(
            a_rx.try_recv().unwrap().unwrap_err().code(),
            tonic::Code::Aborted
        );
        assert!(!reg.disconnect(&a, 3));
        assert!(reg.disconnect(&a2, 3));
        assert!(reg.expire(50, 100).is_empty());
        assert_eq!(reg.expire(200, 100), vec!["n1/ns/a".to_string()]);
        assert_eq!(reg.subscribers().len(), 1);
    }

    #[test]
    fn reports_set_the_worst_status_and_expiry_forgets_only_old_disconnected_nodes() {
        let mut reg = NodeRegistry::default();
        let t = reg.connect(&hello("n1"), 0);
        let t2 = reg.connect(&hello("n2"), 0);
        let report = proto::CheckReport {
            observed_at_unix_ms: 10,
            plan_generation: 3,
            interval_seconds: 5,
            age_ms: 0,
            results: vec![
                proto::CheckResult {
                    name: "shm".into(),
                    status: proto::CheckStatus::Ok as i32,
                    ..Default::default()
                },
                proto::CheckResult {
                    name: "gpu".into(),
                    status: proto::CheckStatus::Warning as i32,
                    ..Default::default()
                },
            ],
        };
        reg.report(&t, &report, 5);
        let r = reg.get("n1").unwrap();
        assert_eq!(r.status, CheckStatus::Warning);
        assert_eq!(r.checks.len(), 2);
        assert_eq!(r.plan_generation, 3);
        // When it arrived by the controller's clock, and the agent's interval.
        assert_eq!(
            (r.report_received_unix_ms, r.check_interval_seconds),
            (5, 5)
        );
        // A pass re-sent on a reconnect is dated by its age, not by its arrival: a hung pass
        // does not look fresh again.
        let resent = proto::CheckReport {
            age_ms: 120_000,
            ..report.clone()
        };
        reg.report(&t, &resent, 200_000);
        assert_eq!(reg.get("n1").unwrap().report_received_unix_ms, 80_000);
        reg.disconnect(&t, 100);
        assert!(reg.expire(150, 100).is_empty());
        assert_eq!(reg.expire(201, 100), vec!["n1".to_string()]);
        assert!(reg.get("n2").is_some());
        assert!(reg.is_current(&t2));
    }

    fn engine_plan(pod: &str) -> NodePlan {
        NodePlan {
            engines: vec![ic_shared::plan::EnginePlan {
                namespace: "ns".into(),
                pod: pod.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn received_plan(
        rx: &mut mpsc::Receiver<Result<ControllerMessage, Status>>,
    ) -> Option<(u64, NodePlan)> {
        match rx.try_recv().ok()?.ok()?.msg? {
            controller_message::Msg::Plan(p) => {
                Some((p.generation, NodePlan::parse(&p.plan_json, "test").unwrap()))
            }
            _ => None,
        }
    }

    /// An agent released before `shmContainers` / `readerMounts[].containers` parses pushed
    /// plans strictly and would drop the whole plan: it is sent the plan without them. One
    /// that says `plan-additive` gets all of it.
    #[test]
    fn agents_without_plan_additive_get_the_plan_without_newer_fields() {
        let mut plan = engine_plan("a");
        plan.engines[0].shm_containers = vec![ic_shared::plan::PlannedContainer {
            name: "vllm".into(),
            id: Some("0123456789abcdef".into()),
        }];
        plan.reader_mounts = vec![ic_shared::plan::ReaderMount {
            pod: "r".into(),
            path: "/models".into(),
            containers: plan.engines[0].shm_containers.clone(),
            ..Default::default()
        }];
        let json_for = |caps: Vec<String>| {
            let mut reg = NodeRegistry::default();
            reg.publish_plans(BTreeMap::from([("n1".to_string(), plan.clone())]), 1);
            let t = reg.connect(
                &proto::Hello {
                    capabilities: caps,
                    ..hello("n1")
                },
                0,
            );
            let (tx, mut rx) = mpsc::channel(4);
            reg.attach(&t, tx);
            match rx.try_recv().ok().and_then(|m| m.ok()).and_then(|m| m.msg) {
                Some(controller_message::Msg::Plan(p)) => p.plan_json,
                other => panic!("{other:?}"),
            }
        };
        let old = json_for(vec!["checks".into(), "kv-events".into()]);
        assert!(
            !old.contains("shmContainers") && !old.contains("\"containers\""),
            "{old}"
        );
        assert_eq!(NodePlan::parse(&old, "old").unwrap().engines[0].pod, "a");
        let new = json_for(
            ic_shared::link::NODE_AGENT_CAPABILITIES
                .iter()
                .map(|c| c.to_string())
                .collect(),
        );
        let back = NodePlan::parse(&new, "new").unwrap();
        assert_eq!(
            back.engines[0].shm_containers,
            plan.engines[0].shm_containers
        );
        assert_eq!(back.reader_mounts[0].containers.len(), 1);
    }

    #[test]
    fn standalone_registries_send_no_plan_on_connect() {
        let mut reg = NodeRegistry::default();
        let t = reg.connect(&hello("n1"), 0);
        let (tx, mut rx) = mpsc::channel(4);
        assert_eq!(reg.attach(&t, tx), None);
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn plans_get_generations_on_change_and_reach_open_streams_once() {
        let mut reg = NodeRegistry::default();
        let r = reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("a"))]), 1);
        assert_eq!(r.changed, vec![("n1".to_string(), 1)]);
        assert_eq!(r.unserved, vec!["n1".to_string()]);

        // A stream that opens later gets the current plan first.
        let t = reg.connect(&hello("n1"), 0);
        let (tx, mut rx) = mpsc::channel(4);
        assert_eq!(reg.attach(&t, tx), Some(1));
        let (g, p) = received_plan(&mut rx).unwrap();
        assert_eq!(g, 1);
        assert_eq!(p.engines[0].pod, "a");

        // Same content: no new generation, nothing sent.
        let r = reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("a"))]), 1);
        assert!(r.changed.is_empty() && r.sent.is_empty() && r.unserved.is_empty());
        assert!(rx.try_recv().is_err());

        // Changed content: generation 2 is pushed.
        let r = reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("b"))]), 1);
        assert_eq!(r.sent, vec![("n1".to_string(), 2)]);
        assert_eq!(received_plan(&mut rx).unwrap().1.engines[0].pod, "b");

        // The node's engines are gone: it gets an empty plan (generation 3).
        let r = reg.publish_plans(BTreeMap::new(), 1);
        assert_eq!(r.sent, vec![("n1".to_string(), 3)]);
        let (g, p) = received_plan(&mut rx).unwrap();
        assert_eq!((g, p.engines.len()), (3, 0));

        // Authoritative now: a new node's agent gets an empty plan on connect.
        let t2 = reg.connect(&hello("n2"), 0);
        let (tx2, mut rx2) = mpsc::channel(4);
        assert_eq!(reg.attach(&t2, tx2), Some(1));
        assert!(received_plan(&mut rx2).unwrap().1.engines.is_empty());

        // Withdrawn (leadership lost): nothing for new streams; a later publish restarts the
        // generations at the new base, above the old ones.
        reg.withdraw_plans();
        let t3 = reg.connect(&hello("n3"), 0);
        let (tx3, _rx3) = mpsc::channel(4);
        assert_eq!(reg.attach(&t3, tx3), None);
        let r = reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("b"))]), 1000);
        assert!(r.sent.contains(&("n1".to_string(), 1000)));
        assert_eq!(received_plan(&mut rx).unwrap().0, 1000);
    }

    #[test]
    fn a_full_queue_keeps_the_plan_pending_until_the_next_publish() {
        let mut reg = NodeRegistry::default();
        let t = reg.connect(&hello("n1"), 0);
        let (tx, mut rx) = mpsc::channel(1);
        reg.attach(&t, tx.clone());
        tx.try_send(Err(Status::internal("filler"))).unwrap();
        let r = reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("a"))]), 1);
        assert_eq!(r.pending, vec!["n1".to_string()]);
        let _ = rx.try_recv();
        let r = reg.publish_plans(BTreeMap::from([("n1".to_string(), engine_plan("a"))]), 1);
        assert_eq!(r.sent, vec![("n1".to_string(), 1)]);
        // A disconnected stream's handle is dropped.
        assert!(reg.disconnect(&t, 1));
        assert!(reg.outbound("n1").is_none());
    }
}
