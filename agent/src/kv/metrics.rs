//! Prometheus metrics of the KV-event subscribers (prefix `inferencecache_agent_kv_`).
//!
//! Labels are bounded: `stream` is a planned stream id (`<namespace>/<pod>#<rank>`, one per engine
//! publisher on this node; a stream's series are deleted when the plan drops it), `reason`,
//! `type`, `source`, `result` come from fixed lists.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `inferencecache_agent_kv_batches_received_total` | stream, source | messages received (`live` from the SUB socket, `replay` from the replay socket) |
//! | `inferencecache_agent_kv_batches_decoded_total` | stream | batches whose payload decoded |
//! | `inferencecache_agent_kv_events_decoded_total` | stream, type | events applied, by tag |
//! | `inferencecache_agent_kv_events_dropped_total` | stream, reason | batches or events lost (queue full, bad frames, undecodable, token mismatch, evicted orphans, op overflow) |
//! | `inferencecache_agent_kv_events_ignored_total` | stream, reason | events or blocks deliberately not indexed (other group, partial block, unknown hash, parked/resolved orphans) |
//! | `inferencecache_agent_kv_gaps_total` | stream | sequence gaps detected |
//! | `inferencecache_agent_kv_replays_total` | stream, result | replay requests: `healed` (gap filled), `failed` (no answer), `bootstrap` (complete from seq 0), `bootstrap_incomplete` (the buffer no longer held seq 0, or holes), `truncated` (holes in a gap replay), `verified` (idle or reconnect check: same incarnation), `restart_detected` (the replay showed another incarnation), `forged` (a live seq the engine never sent) |
//! | `inferencecache_agent_kv_resyncs_total` | stream, reason | replica clears: `AllBlocksCleared`, `EngineRestarted`, `SequenceGap`, `ReplayTruncated`, `RankMismatch` |
//! | `inferencecache_agent_kv_coverage` | stream, state, reason | 1 for the stream's current coverage (`Exact`, `Healing`, `Partial`, `Disconnected`, `EngineDown`; reason empty when Exact) |
//! | `inferencecache_agent_kv_coverage_transitions_total` | stream, state | transitions into each coverage state |
//! | `inferencecache_agent_kv_blocks` | stream | index entries held |
//! | `inferencecache_agent_kv_connected` | stream | 1 while the SUB socket is connected |
//! | `inferencecache_agent_kv_stream_lag_seconds` | stream | agent time − engine `ts` of the newest live batch applied |

use ic_shared::kv::decode::DecodeError;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use ic_shared::kv::coverage::{Coverage, CoverageState, REASONS as COVERAGE_REASONS};

use super::stream::{
    CLEAR_ALL_BLOCKS, CLEAR_ENGINE_RESTARTED, CLEAR_RANK_MISMATCH, CLEAR_REPLAY_TRUNCATED,
    CLEAR_SEQUENCE_GAP, DROP_REASONS, IGNORE_REASONS,
};

/// Batch-level drop reasons of the subscriber itself (besides the decoder's and the state
/// machine's).
pub const SUBSCRIBER_DROP_REASONS: &[&str] = &["queue_full", "bad_frames", "bad_seq", "forged_seq"];

const EVENT_TYPES: &[&str] = &["BlockStored", "BlockRemoved", "AllBlocksCleared"];
const SOURCES: &[&str] = &["live", "replay"];
/// `result` label values of `replays_total`.
pub const REPLAY_RESULTS: &[&str] = &[
    "healed",
    "failed",
    "bootstrap",
    "bootstrap_incomplete",
    "truncated",
    "verified",
    "restart_detected",
    "forged",
];
const CLEAR_REASONS: &[&str] = &[
    CLEAR_ALL_BLOCKS,
    CLEAR_ENGINE_RESTARTED,
    CLEAR_SEQUENCE_GAP,
    CLEAR_REPLAY_TRUNCATED,
    CLEAR_RANK_MISMATCH,
];

/// The metric families, registered once per hub.
#[derive(Clone)]
pub struct KvMetrics {
    pub(crate) received: IntCounterVec,
    pub(crate) decoded: IntCounterVec,
    pub(crate) events: IntCounterVec,
    pub(crate) dropped: IntCounterVec,
    pub(crate) ignored: IntCounterVec,
    pub(crate) gaps: IntCounterVec,
    pub(crate) replays: IntCounterVec,
    pub(crate) resyncs: IntCounterVec,
    pub(crate) blocks: IntGaugeVec,
    pub(crate) connected: IntGaugeVec,
    pub(crate) lag: GaugeVec,
    pub(crate) coverage: IntGaugeVec,
    pub(crate) coverage_transitions: IntCounterVec,
}

fn counter(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    reg.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    reg.register(Box::new(g.clone()))?;
    Ok(g)
}

impl KvMetrics {
    /// Creates and registers every family in `reg`. Fails if a name is already registered there.
    pub fn new(reg: &Registry) -> prometheus::Result<Self> {
        const P: &str = "inferencecache_agent_kv_";
        Ok(Self {
            received: counter(
                reg,
                &format!("{P}batches_received_total"),
                "Engine KV-event messages received, by source (live or replay).",
                &["stream", "source"],
            )?,
            decoded: counter(
                reg,
                &format!("{P}batches_decoded_total"),
                "Engine KV-event batches whose payload decoded.",
                &["stream"],
            )?,
            events: counter(
                reg,
                &format!("{P}events_decoded_total"),
                "Engine KV events applied, by event type.",
                &["stream", "type"],
            )?,
            dropped: counter(
                reg,
                &format!("{P}events_dropped_total"),
                "Engine KV-event batches or events lost, by reason.",
                &["stream", "reason"],
            )?,
            ignored: counter(
                reg,
                &format!("{P}events_ignored_total"),
                "Engine KV events or blocks deliberately not indexed, by reason.",
                &["stream", "reason"],
            )?,
            gaps: counter(
                reg,
                &format!("{P}gaps_total"),
                "Sequence gaps detected on engine KV-event streams.",
                &["stream"],
            )?,
            replays: counter(
                reg,
                &format!("{P}replays_total"),
                "Replay requests to engine replay sockets, by result.",
                &["stream", "result"],
            )?,
            resyncs: counter(
                reg,
                &format!("{P}resyncs_total"),
                "Replica clears sent to the index, by reason.",
                &["stream", "reason"],
            )?,
            blocks: gauge(
                reg,
                &format!("{P}blocks"),
                "Index entries (content keys) held per stream.",
                &["stream"],
            )?,
            connected: gauge(
                reg,
                &format!("{P}connected"),
                "1 while the stream's SUB socket is connected to the engine publisher.",
                &["stream"],
            )?,
            lag: {
                let g = GaugeVec::new(
                    Opts::new(
                        format!("{P}stream_lag_seconds"),
                        "Agent time minus the engine timestamp of the newest live batch applied, in seconds.",
                    ),
                    &["stream"],
                )?;
                reg.register(Box::new(g.clone()))?;
                g
            },
            coverage: gauge(
                reg,
                &format!("{P}coverage"),
                "1 for the stream's current coverage state and reason (Exact: every engine block indexed).",
                &["stream", "state", "reason"],
            )?,
            coverage_transitions: counter(
                reg,
                &format!("{P}coverage_transitions_total"),
                "Transitions of a stream's coverage into each state.",
                &["stream", "state"],
            )?,
        })
    }

    /// Moves the stream's coverage series from `old` to `new` (the gauge keeps exactly one
    /// series per stream at 1).
    pub(crate) fn set_coverage(&self, stream: &str, old: Option<Coverage>, new: Coverage) {
        if let Some(o) = old {
            if o == new {
                return;
            }
            let _ = self
                .coverage
                .remove_label_values(&[stream, o.state.as_str(), o.reason_str()]);
        }
        self.coverage
            .with_label_values(&[stream, new.state.as_str(), new.reason_str()])
            .set(1);
        self.coverage_transitions
            .with_label_values(&[stream, new.state.as_str()])
            .inc();
    }

    /// Deletes every series of `stream` (after the plan dropped it).
    pub(crate) fn remove_stream(&self, stream: &str) {
        for c in [&self.decoded, &self.gaps] {
            let _ = c.remove_label_values(&[stream]);
        }
        for g in [&self.blocks, &self.connected] {
            let _ = g.remove_label_values(&[stream]);
        }
        let _ = self.lag.remove_label_values(&[stream]);
        for s in SOURCES {
            let _ = self.received.remove_label_values(&[stream, s]);
        }
        for t in EVENT_TYPES {
            let _ = self.events.remove_label_values(&[stream, t]);
        }
        let drops = SUBSCRIBER_DROP_REASONS
            .iter()
            .chain(DecodeError::REASONS)
            .chain(DROP_REASONS);
        for r in drops {
            let _ = self.dropped.remove_label_values(&[stream, r]);
        }
        for r in IGNORE_REASONS {
            let _ = self.ignored.remove_label_values(&[stream, r]);
        }
        for r in REPLAY_RESULTS {
            let _ = self.replays.remove_label_values(&[stream, r]);
        }
        for r in CLEAR_REASONS {
            let _ = self.resyncs.remove_label_values(&[stream, r]);
        }
        for st in CoverageState::ALL {
            let _ = self
                .coverage_transitions
                .remove_label_values(&[stream, st.as_str()]);
            for r in COVERAGE_REASONS.iter().chain(std::iter::once(&"")) {
                let _ = self.coverage.remove_label_values(&[stream, st.as_str(), r]);
            }
        }
    }
}
