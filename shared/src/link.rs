//! What an agent sends first on `AgentService.Connect` (docs/grpc.md; the protocol steps 1–2 of
//! `ic_controller::ingest`): `Hello`, then a full resync of every KV stream, split by
//! [`crate::resync::chunk_resync`] when it is larger than one message may be.
//!
//! One definition for `ic-agent` (node agent and per-pod subscriber) and the fleet load
//! generator (`bench/fleet`), so the controller sees the generator's streams exactly as
//! it sees real agents'.

use crate::proto::{self, agent_message::Msg, AgentMessage, StreamSnapshot};

/// Capabilities a node agent announces in `Hello.capabilities`.
pub const NODE_AGENT_CAPABILITIES: [&str; 3] = ["checks", "kv-events", PLAN_ADDITIVE];

/// Capability of an agent that applies a pushed node plan with fields it does not know
/// (`NodePlan::parse_pushed`). An agent without it refuses such a plan whole, so the controller
/// sends it the plan without the fields added since ([`crate::plan::NodePlan::for_strict_agent`]).
pub const PLAN_ADDITIVE: &str = "plan-additive";

/// Capability of an agent that sends a `CoverageHeartbeat` every
/// [`COVERAGE_HEARTBEAT_INTERVAL`] on each stream (issue 37 item 2; docs/kv-events.md "Coverage
/// age"): the controller holds only such an agent to its heartbeat bound. `ic-agent` adds it to
/// its Hello; a generator that sends no heartbeats must not.
pub const COVERAGE_HEARTBEAT: &str = "coverage-heartbeat";

/// How often an agent with [`COVERAGE_HEARTBEAT`] sends a `CoverageHeartbeat` (1 s). The
/// controller's bound (`--coverage-heartbeat-bound-ms`, 5 s by default) must exceed three of
/// these, so that a live agent running late does not flap.
pub const COVERAGE_HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Capabilities a per-pod subscriber (`ic-agent subscribe`) announces.
pub const POD_SUBSCRIBER_CAPABILITIES: [&str; 2] = ["kv-events", "pod-subscriber"];

/// Who opens the stream: the fields of `Hello` (proto `Hello`, one field each).
#[derive(Debug, Clone, Copy)]
pub struct HelloFields<'a> {
    /// Kubernetes node name (`NODE_NAME`); the hostname in standalone mode.
    pub node: &'a str,
    /// `/proc/sys/kernel/random/boot_id` of the node (empty where unreadable).
    pub boot_id: &'a str,
    /// The agent's version (semver).
    pub version: &'a str,
    /// Projected service-account token (audience `inference-cache`); empty in standalone mode.
    pub token: &'a str,
    /// Random per agent process: the controller drops state of an older incarnation.
    pub agent_instance: &'a str,
    /// Set only by a per-pod subscriber: the pod whose engine it follows.
    pub pod_subscriber: Option<&'a proto::PodSubscriber>,
}

/// The `Hello` message, with the capabilities of a node agent or of a pod subscriber.
pub fn hello(f: HelloFields<'_>) -> AgentMessage {
    let capabilities: &[&str] = match f.pod_subscriber {
        Some(_) => &POD_SUBSCRIBER_CAPABILITIES,
        None => &NODE_AGENT_CAPABILITIES,
    };
    AgentMessage {
        msg: Some(Msg::Hello(proto::Hello {
            node: f.node.to_string(),
            boot_id: f.boot_id.to_string(),
            version: f.version.to_string(),
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
            token: f.token.to_string(),
            agent_instance: f.agent_instance.to_string(),
            pod_subscriber: f.pod_subscriber.cloned(),
        })),
    }
}

/// The opening of every stream: `hello`, then the resync of `snapshots` (one `Resync`, or
/// `ResyncChunk`s when it exceeds [`crate::resync::CHUNK_BUDGET_BYTES`]).
pub fn opening(hello: AgentMessage, snapshots: Vec<StreamSnapshot>) -> Vec<AgentMessage> {
    let mut msgs = vec![hello];
    msgs.extend(crate::resync::chunk_resync(snapshots));
    msgs
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn fields(pod: Option<&proto::PodSubscriber>) -> HelloFields<'_> {
        HelloFields {
            node: "n1",
            boot_id: "b",
            version: "0.1.0",
            token: "",
            agent_instance: "i",
            pod_subscriber: pod,
        }
    }

    #[test]
    fn opening_is_hello_then_the_resync_and_capabilities_follow_the_role() {
        let msgs = opening(hello(fields(None)), vec![StreamSnapshot::default()]);
        let [AgentMessage {
            msg: Some(Msg::Hello(h)),
        }, AgentMessage {
            msg: Some(Msg::Resync(r)),
        }] = &msgs[..]
        else {
            panic!("expected Hello then Resync: {msgs:?}")
        };
        assert_eq!(h.node, "n1");
        assert_eq!(h.capabilities, ["checks", "kv-events", "plan-additive"]);
        assert_eq!(r.streams.len(), 1);
        let sub = proto::PodSubscriber {
            namespace: "ns".into(),
            pod: "p".into(),
        };
        let Some(Msg::Hello(h)) = hello(fields(Some(&sub))).msg else {
            panic!("expected Hello")
        };
        assert_eq!(h.capabilities, ["kv-events", "pod-subscriber"]);
        assert_eq!(h.pod_subscriber, Some(sub));
    }
}
