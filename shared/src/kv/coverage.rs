//! Coverage: how far one replica's index entries can be trusted (`docs/kv-events.md`
//! "Coverage"). The one definition of the states, their reasons and their wire form, used by the
//! agent (which decides it per engine stream), the controller's index (which stores it per
//! replica and routes by it) and every surface that shows it (`/v1/report`, `/snapshot`,
//! `LookupRoute`, metrics, CacheNode and CacheBackend status).
//!
//! Every state's doc says what its entries **may miss** (blocks the engine holds that are not
//! indexed) and what they **may have extra** (indexed blocks the engine no longer holds), both
//! relative to the engine's cache as of the last batch the agent applied; a test per state
//! (`agent/src/kv/stream.rs`, and the vLLM fault suite against vLLM's own publisher) holds it to
//! that. The rule behind the routed states: a routed replica never has extra entries beyond the
//! batches in flight — [`CoverageState::Partial`] promises a **subset**. A state that may hold
//! blocks the engine evicted is [`CoverageState::Stale`] (or Disconnected), and is not routed
//! (issue 37 item 3: a failed tail check had kept 3 000 evicted blocks under Partial).

use serde::Serialize;

use crate::proto;

/// The coverage states (the proto's `Coverage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum CoverageState {
    /// Every block the engine holds is indexed, and nothing else is.
    ///
    /// Invariant: missing none, extra none. Only a stream whose engine incarnation was proved
    /// (an anchored replay: the engine's batch at the last applied seq is byte-identical to the
    /// one applied, or a bootstrap that saw the incarnation from seq 0) is Exact; sequence
    /// order alone never makes it so (numbers restart at 0 and carry no epoch).
    Exact,
    /// A replay is in flight (a gap, a bootstrap, a rebuild, or an idle tail check that ran
    /// past its bound of 1 s) — routed.
    ///
    /// Invariant: the entries are those of an incarnation already verified, as of the last
    /// batch applied. May miss: the blocks stored by the batches being replayed (and, during a
    /// bootstrap, everything before it). May have extra: only the blocks that the batches being
    /// replayed remove — the same lag an Exact stream has between a batch leaving the engine and
    /// its arrival, here bounded by the replay's deadline (3 s per reply). An attach whose
    /// incarnation is not yet verified is never Healing: it is [`CoverageState::Disconnected`]
    /// with [`ATTACH_UNVERIFIED`].
    Healing,
    /// Some of the engine's blocks are known to be missing; the reason says why — routed.
    ///
    /// Invariant: may miss blocks (what the reason names: stored before the buffer reached,
    /// in a gap or hole, behind an unknown parent, beyond a cap); extra: none — the entries are a
    /// **subset** of the engine's as of the last batch applied (the agent never guesses a key,
    /// and what it may have missed the removal of it forgets or reports as
    /// [`CoverageState::Stale`]).
    Partial,
    /// The entries may include blocks the engine no longer holds: a removal may have been
    /// missed ([`TAIL_UNVERIFIED`]: batches lost after the last one received and the tail check
    /// could not ask for them; [`EVENTS_DROPPED`]: an event that could not be read may have been
    /// a removal; [`SEQUENCE_UNVERIFIED`]: a frame past an implausible sequence jump is held
    /// back, and the jump may hide removals) — **not routed** (no PREFIX_MATCH for this replica).
    ///
    /// Invariant: may miss blocks and may have extra blocks; nothing is promised, so nothing is
    /// routed. TailUnverified is Exact again at the next successful tail check (retried every
    /// second while it lasts) or the next in-order live batch; EventsDropped at a clear or a
    /// restart of the engine; SequenceUnverified at the next frame.
    Stale,
    /// The publisher socket is gone past the grace period ([`PUBLISHER_DISCONNECTED`]), or the
    /// agent (re)attached and has not yet proved that the engine is the incarnation whose entries
    /// it holds ([`ATTACH_UNVERIFIED`]): no PREFIX_MATCH for this replica.
    ///
    /// Invariant: none; the entries may be missing blocks and may hold blocks the engine no
    /// longer has (a restarted engine), so nothing of it is routed.
    Disconnected,
    /// The engine process is known to be gone: no PREFIX_MATCH for this replica.
    ///
    /// Invariant: none (the engine's cache is gone; the entries are what it held); not routed.
    EngineDown,
    /// Not reported (an agent that predates coverage), or the controller's word for a replica
    /// whose reporter it has not heard from (see the controller-side reasons).
    ///
    /// Invariant: none promised (entries as last reported); routed as before coverage existed,
    /// except where the controller's reason says otherwise.
    Unknown,
}

impl CoverageState {
    /// Every state, in display order (metric label values).
    pub const ALL: [CoverageState; 7] = [
        CoverageState::Exact,
        CoverageState::Healing,
        CoverageState::Partial,
        CoverageState::Stale,
        CoverageState::Disconnected,
        CoverageState::EngineDown,
        CoverageState::Unknown,
    ];

    /// The CamelCase name shown in JSON, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            CoverageState::Exact => "Exact",
            CoverageState::Healing => "Healing",
            CoverageState::Partial => "Partial",
            CoverageState::Stale => "Stale",
            CoverageState::Disconnected => "Disconnected",
            CoverageState::EngineDown => "EngineDown",
            CoverageState::Unknown => "Unknown",
        }
    }

    /// Whether the replica may be returned by a lookup: not when its engine or publisher is
    /// gone, nor when its entries may include blocks the engine no longer holds (Stale).
    pub fn routable(self) -> bool {
        !matches!(
            self,
            CoverageState::Stale | CoverageState::Disconnected | CoverageState::EngineDown
        )
    }

    /// The wire enum.
    pub fn to_proto(self) -> proto::Coverage {
        match self {
            CoverageState::Exact => proto::Coverage::Exact,
            CoverageState::Healing => proto::Coverage::Healing,
            CoverageState::Partial => proto::Coverage::Partial,
            CoverageState::Stale => proto::Coverage::Stale,
            CoverageState::Disconnected => proto::Coverage::Disconnected,
            CoverageState::EngineDown => proto::Coverage::EngineDown,
            CoverageState::Unknown => proto::Coverage::Unspecified,
        }
    }

    /// From the wire value; unknown numbers read as [`CoverageState::Unknown`].
    pub fn from_proto(v: i32) -> CoverageState {
        match proto::Coverage::try_from(v) {
            Ok(proto::Coverage::Exact) => CoverageState::Exact,
            Ok(proto::Coverage::Healing) => CoverageState::Healing,
            Ok(proto::Coverage::Partial) => CoverageState::Partial,
            Ok(proto::Coverage::Stale) => CoverageState::Stale,
            Ok(proto::Coverage::Disconnected) => CoverageState::Disconnected,
            Ok(proto::Coverage::EngineDown) => CoverageState::EngineDown,
            Ok(proto::Coverage::Unspecified) | Err(_) => CoverageState::Unknown,
        }
    }
}

impl std::fmt::Display for CoverageState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Partial: the engine's buffer no longer held the start of its incarnation when the stream
/// attached (or there is no replay endpoint), so blocks stored before are unknown.
pub const BOOTSTRAP_INCOMPLETE: &str = "BootstrapIncomplete";
/// Partial: a replay came back with holes (vLLM < 0.33 under load); the replica was rebuilt from
/// what could be verified.
pub const REPLAY_TRUNCATED: &str = "ReplayTruncated";
/// Partial: a sequence gap could not be replayed; the replica was cleared and rebuilt from live
/// events.
pub const SEQUENCE_GAP: &str = "SequenceGap";
/// Stale: messages were lost after the last one received (or may have been: a tail check
/// failed), and no replay could check the tail; a lost removal would leave a block indexed.
pub const TAIL_UNVERIFIED: &str = "TailUnverified";
/// Partial: blocks are parked because their parent block was never seen.
pub const PARENT_UNKNOWN: &str = "ParentUnknown";
/// Partial: the engine reports another data-parallel rank than the plan's; nothing is indexed.
pub const RANK_MISMATCH: &str = "RankMismatch";
/// Partial: one engine hash named two different contents (a content-hash release): the older
/// entry was dropped.
pub const HASH_COLLISION: &str = "HashCollision";
/// Stale: an event or batch could not be read (undecodable, skipped by the decoder, tokens
/// that do not fit their hashes); the entries may include a block the engine removed — the
/// removal may have been in what was lost.
pub const EVENTS_DROPPED: &str = "EventsDropped";
/// Stale: a frame with an implausible sequence number was held back, unverified (a real jump
/// would hide removals).
pub const SEQUENCE_UNVERIFIED: &str = "SequenceUnverified";
/// Partial: the engine's replay replies carry a topic the plan's subscription does not match,
/// so its live events never pass the SUB filter; nothing is indexed.
pub const TOPIC_MISMATCH: &str = "TopicMismatch";
/// Partial (controller side): the tenant reached its CacheTenant `spec.quota.maxIndexEntries`
/// and the index evicted its oldest entries, some of which this replica's engine still holds.
pub const TENANT_QUOTA_EXCEEDED: &str = "TenantQuotaExceeded";
/// Partial (controller side): the stream reached the controller's per-stream block cap
/// (`--max-blocks-per-stream`); blocks beyond it are not indexed.
pub const STREAM_CAP_EXCEEDED: &str = "StreamCapExceeded";
/// Partial (controller side): the node's resync is being applied in slices (the index write
/// lock is released between them so lookups go on); the replica holds only the entries applied
/// so far until the last slice sets the coverage its agent reported.
pub const RESYNC_APPLYING: &str = "ResyncApplying";
/// Healing: a replay is in flight.
pub const REPLAYING: &str = "Replaying";
/// Disconnected: the publisher socket is down.
pub const PUBLISHER_DISCONNECTED: &str = "PublisherDisconnected";
/// Disconnected: the agent (re)attached to the engine's publisher (a reconnect, its own
/// restart from kept state) and its anchored replay has not yet succeeded — the replay socket is
/// slow or unreachable — so nothing proves the engine is still the
/// incarnation whose entries are held. Not routed; the check is retried with back-off until it
/// succeeds. Live batches are not applied meanwhile (the replay that verifies brings them).
pub const ATTACH_UNVERIFIED: &str = "AttachUnverified";
/// Unknown (controller side): the agent stream that reported the replica ended (the agent
/// disconnected, or a newer stream of its node took over and has not resynced yet).
pub const AGENT_DISCONNECTED: &str = "AgentDisconnected";
/// Unknown (controller side): the controller refused one of the node's deltas (a sequence gap,
/// an unknown stream) and asked its agent for a resync; it applies none of the node's deltas
/// until then.
pub const RESYNC_REQUESTED: &str = "ResyncRequested";
/// Unknown (controller side), not routed: the agent that reports the replica sends a heartbeat
/// every second, and the controller has heard nothing from it for longer than its bound
/// (`--coverage-heartbeat-bound-ms`): the agent is hung, cut off or restarting, so nothing
/// vouches for the entries. Lifted by its next message.
pub const HEARTBEAT_MISSED: &str = "HeartbeatMissed";
/// Partial (controller side): entries or ops of the stream were dropped at ingest because
/// their block size is above the cap or would register one size too many for its hash scheme
/// (docs/security.md "Input bounds").
pub const BLOCK_SIZE_CAP_EXCEEDED: &str = "BlockSizeCapExceeded";

/// Unknown (controller side): a node plan expects this engine stream, but the index has no
/// replica of it — its agent has not resynced since this controller started, the node has no
/// working agent, or the replica expired. Shown where replicas are listed by plan
/// (CacheBackend `status.indexParticipation.inexactReplicas`); nothing of it is routed.
pub const NOT_REPORTED: &str = "NotReported";

/// Every reason a coverage can carry (bounded metric label values).
pub const REASONS: &[&str] = &[
    BOOTSTRAP_INCOMPLETE,
    REPLAY_TRUNCATED,
    SEQUENCE_GAP,
    TAIL_UNVERIFIED,
    PARENT_UNKNOWN,
    RANK_MISMATCH,
    HASH_COLLISION,
    EVENTS_DROPPED,
    SEQUENCE_UNVERIFIED,
    TOPIC_MISMATCH,
    TENANT_QUOTA_EXCEEDED,
    STREAM_CAP_EXCEEDED,
    RESYNC_APPLYING,
    REPLAYING,
    PUBLISHER_DISCONNECTED,
    ATTACH_UNVERIFIED,
    AGENT_DISCONNECTED,
    RESYNC_REQUESTED,
    HEARTBEAT_MISSED,
    BLOCK_SIZE_CAP_EXCEEDED,
    NOT_REPORTED,
];

/// What a reason means, in a sentence an operator can act on (CacheNode messages, docs).
pub fn describe(reason: &str) -> Option<&'static str> {
    Some(match reason {
        BOOTSTRAP_INCOMPLETE => "the engine's replay buffer no longer reached back to its start when the agent attached: blocks stored before are missing until the engine's cache is reset or it restarts",
        REPLAY_TRUNCATED => "a replay came back with holes (vLLM < 0.33 under load); the replica was rebuilt from what could be verified",
        SEQUENCE_GAP => "messages were lost and could not be replayed; the replica was rebuilt from live events",
        TAIL_UNVERIFIED => "messages may have been lost after the last one received and no replay could check them; a lost removal would leave a block indexed, so the replica is not routed until a tail check succeeds (retried every second)",
        PARENT_UNKNOWN => "blocks are parked because their parent block was never seen",
        RANK_MISMATCH => "the engine reports another data-parallel rank than planned; nothing is indexed",
        HASH_COLLISION => "one engine hash named two different contents; the older entry was dropped",
        EVENTS_DROPPED => "events could not be read (undecodable, unknown to this agent, or tokens that do not fit their hashes); entries may be missing or stale, so the replica is not routed until the engine's cache is reset or it restarts",
        SEQUENCE_UNVERIFIED => "a frame with an implausible sequence number is held back; the replica is not routed until the next frame settles it",
        TOPIC_MISMATCH => "the engine publishes its KV events under another topic than the plan subscribes to, so none arrives; nothing is indexed. Check the topic in the engine's --kv-events-config",
        TENANT_QUOTA_EXCEEDED => "the tenant reached its CacheTenant quota (spec.quota.maxIndexEntries): the index evicted its oldest entries, so some blocks the engine holds are not routed to it",
        STREAM_CAP_EXCEEDED => "the stream reached the controller's per-stream block cap (--max-blocks-per-stream): blocks beyond it are not indexed",
        RESYNC_APPLYING => "the controller is applying the node's resync in slices: entries are incomplete until the last slice (milliseconds to seconds)",
        PUBLISHER_DISCONNECTED => "the engine's publisher is unreachable; its replica is not routed",
        ATTACH_UNVERIFIED => "the agent re-attached to the engine but its replay socket has not yet confirmed that the engine is the one whose blocks it holds (slow or unreachable); its replica is not routed until the check, retried with back-off, succeeds",
        AGENT_DISCONNECTED => "the agent stream that reported this replica ended (the agent disconnected, or a newer stream of its node has not resynced yet); entries are as last reported",
        RESYNC_REQUESTED => "the controller refused one of the node's deltas (a sequence gap or an unknown stream) and asked its agent for a resync; entries are as last applied until it arrives",
        HEARTBEAT_MISSED => "the agent that reports this replica has sent nothing (not even its once-a-second heartbeat) for longer than the controller's --coverage-heartbeat-bound-ms: it is hung, cut off or restarting; the replica is not routed until the agent is heard again",
        BLOCK_SIZE_CAP_EXCEEDED => "blocks of a size above the cap (4096), or one size too many for the hash scheme (64 sizes), were dropped at ingest: they are not routed to this replica",
        REPLAYING => "a replay is in flight",
        NOT_REPORTED => "a node plan expects this engine stream but the index holds nothing of it: its agent has not resynced since the controller started, the node has no working agent, or the replica expired; it is not routed until its agent reports it",
        _ => return None,
    })
}

/// A state with its reason (`None` for Exact and Unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coverage {
    /// The state.
    pub state: CoverageState,
    /// CamelCase reason (one of [`REASONS`]) when not Exact.
    pub reason: Option<&'static str>,
}

impl Coverage {
    /// Exact, no reason.
    pub const EXACT: Coverage = Coverage {
        state: CoverageState::Exact,
        reason: None,
    };

    /// A state with a reason.
    pub fn new(state: CoverageState, reason: &'static str) -> Self {
        Coverage {
            state,
            reason: Some(reason),
        }
    }

    /// The reason as sent on the wire (empty when none).
    pub fn reason_str(&self) -> &'static str {
        self.reason.unwrap_or("")
    }

    /// From the wire pair; a reason not in [`REASONS`] is dropped (the state is kept), so a
    /// caller cannot grow metric label sets.
    pub fn from_proto(state: i32, reason: &str) -> Self {
        Coverage {
            state: CoverageState::from_proto(state),
            reason: if reason.is_empty() {
                None
            } else {
                // `NotReported` is the controller's word for a stream nobody reported: no
                // report can carry it.
                REASONS
                    .iter()
                    .copied()
                    .find(|r| *r == reason && *r != NOT_REPORTED)
            },
        }
    }
}

impl std::fmt::Display for Coverage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.reason {
            Some(r) => write!(f, "{}/{r}", self.state),
            None => write!(f, "{}", self.state),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_and_routability() {
        for s in CoverageState::ALL {
            assert_eq!(CoverageState::from_proto(s.to_proto() as i32), s);
        }
        assert_eq!(CoverageState::from_proto(99), CoverageState::Unknown);
        assert!(!CoverageState::Disconnected.routable());
        assert!(!CoverageState::EngineDown.routable());
        assert!(
            !CoverageState::Stale.routable(),
            "Stale may hold evicted blocks"
        );
        assert!(CoverageState::Partial.routable() && CoverageState::Unknown.routable());
        let c = Coverage::from_proto(proto::Coverage::Partial as i32, BOOTSTRAP_INCOMPLETE);
        assert_eq!(
            c,
            Coverage::new(CoverageState::Partial, BOOTSTRAP_INCOMPLETE)
        );
        assert_eq!(c.to_string(), "Partial/BootstrapIncomplete");
        assert_eq!(Coverage::from_proto(1, "Forged").reason, None);
        assert_eq!(
            Coverage::from_proto(CoverageState::Unknown.to_proto() as i32, NOT_REPORTED).reason,
            None,
            "a report cannot claim the controller's NotReported"
        );
        for r in REASONS {
            assert!(describe(r).is_some(), "{r} has a description");
        }
    }
}
