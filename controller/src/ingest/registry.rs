//! Connected agents and their latest check results (`/v1/nodes`; later the CacheNode writer).

use std::collections::BTreeMap;

use ic_shared::check::{CheckResult, CheckStatus};
use serde::Serialize;

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

/// All nodes that ever connected since start.
#[derive(Debug, Default)]
pub struct NodeRegistry {
    nodes: BTreeMap<String, NodeRecord>,
    next_epoch: u64,
}

/// Identity of a stream, returned by [`NodeRegistry::connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamTicket {
    /// Node name.
    pub node: String,
    /// Epoch of this stream.
    pub epoch: u64,
}

impl NodeRegistry {
    /// Records a new stream from `hello.node`; it supersedes any previous stream of that node.
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
        }
    }

    /// True when `ticket` is still the node's current stream.
    pub fn is_current(&self, ticket: &StreamTicket) -> bool {
        self.nodes
            .get(&ticket.node)
            .is_some_and(|r| r.epoch == ticket.epoch)
    }

    /// Notes traffic on a stream.
    pub fn touch(&mut self, ticket: &StreamTicket, now_ms: i64) {
        if let Some(r) = self.nodes.get_mut(&ticket.node) {
            if r.epoch == ticket.epoch {
                r.last_seen_unix_ms = now_ms;
            }
        }
    }

    /// Stores a check report. Ignored for a superseded stream.
    pub fn report(&mut self, ticket: &StreamTicket, report: &ic_shared::proto::CheckReport) {
        if let Some(r) = self.nodes.get_mut(&ticket.node) {
            if r.epoch != ticket.epoch {
                return;
            }
            r.checks = report.results.iter().map(CheckResult::from).collect();
            r.status = CheckStatus::worst(r.checks.iter().map(|c| c.status));
            r.last_report_unix_ms = report.observed_at_unix_ms;
            r.plan_generation = report.plan_generation;
        }
    }

    /// Marks the node disconnected, unless a newer stream already took over. Returns whether it did.
    pub fn disconnect(&mut self, ticket: &StreamTicket, now_ms: i64) -> bool {
        match self.nodes.get_mut(&ticket.node) {
            Some(r) if r.epoch == ticket.epoch => {
                r.connected = false;
                r.last_seen_unix_ms = now_ms;
                true
            }
            _ => false,
        }
    }

    /// Nodes disconnected for longer than `expiry_ms`; they are forgotten and returned.
    pub fn expire(&mut self, now_ms: i64, expiry_ms: i64) -> Vec<String> {
        let gone: Vec<String> = self
            .nodes
            .values()
            .filter(|r| !r.connected && now_ms - r.last_seen_unix_ms > expiry_ms)
            .map(|r| r.node.clone())
            .collect();
        for n in &gone {
            self.nodes.remove(n);
        }
        gone
    }

    /// Number of open streams.
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
    fn reports_set_the_worst_status_and_expiry_forgets_only_old_disconnected_nodes() {
        let mut reg = NodeRegistry::default();
        let t = reg.connect(&hello("n1"), 0);
        let t2 = reg.connect(&hello("n2"), 0);
        let report = proto::CheckReport {
            observed_at_unix_ms: 10,
            plan_generation: 3,
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
        reg.report(&t, &report);
        let r = reg.get("n1").unwrap();
        assert_eq!(r.status, CheckStatus::Warning);
        assert_eq!(r.checks.len(), 2);
        assert_eq!(r.plan_generation, 3);
        reg.disconnect(&t, 100);
        assert!(reg.expire(150, 100).is_empty());
        assert_eq!(reg.expire(201, 100), vec!["n1".to_string()]);
        assert!(reg.get("n2").is_some());
        assert!(reg.is_current(&t2));
    }
}
