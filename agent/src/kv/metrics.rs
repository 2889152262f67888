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
//! | `inferencecache_agent_kv_events_dropped_total` | stream, reason | batches or events lost (queue full, `inflight_budget`: the node-wide budget of bytes in flight spent, bad frames, undecodable, token mismatch, evicted orphans, op overflow) |
//! | `inferencecache_agent_kv_events_ignored_total` | stream, reason | events or blocks deliberately not indexed (other group, partial block, unknown hash, parked/resolved orphans) |
//! | `inferencecache_agent_kv_gaps_total` | stream | sequence gaps detected |
//! | `inferencecache_agent_kv_replays_total` | stream, result | replay requests: `healed` (gap filled), `failed` (no answer), `bootstrap` (complete from seq 0), `bootstrap_incomplete` (the buffer no longer held seq 0, or holes), `truncated` (holes in a gap replay), `verified` (idle or reconnect check: same incarnation), `restart_detected` (the replay showed another incarnation), `forged` (a live seq the engine never sent) |
//! | `inferencecache_agent_kv_resyncs_total` | stream, reason | replica clears: `AllBlocksCleared`, `EngineRestarted`, `SequenceGap`, `ReplayTruncated`, `RankMismatch` |
//! | `inferencecache_agent_kv_coverage` | stream, state, reason | 1 for the stream's current coverage (`Exact`, `Healing`, `Partial`, `Disconnected`, `EngineDown`; reason empty when Exact) |
//! | `inferencecache_agent_kv_coverage_transitions_total` | stream, state | transitions into each coverage state |
//! | `inferencecache_agent_kv_blocks` | stream | index entries held |
//! | `inferencecache_agent_kv_connected` | stream | 1 while the SUB socket is connected |
//! | `inferencecache_agent_kv_stream_lag_seconds` | stream | agent time − engine `ts` of the newest live batch applied, plus the engine's clock skew when that is flagged (beyond ±2 s), so skew does not read as lag |
//! | `inferencecache_agent_kv_engine_clock_skew_seconds` | stream | estimated engine clock − agent clock (positive: the engine is ahead): the largest `ts − arrival` of the live batches of the last 10 minutes |
//! | `inferencecache_agent_kv_peers_dropped_total` | stream, socket, reason | engine connections dropped by the ZMTP guard ([`super::zmtp_guard`]): `socket` `events` (publisher) or `replay`; `reason` `frame_too_large`, `message_too_large`, `too_many_frames`, `command_too_large`, `bad_flags`, `bad_greeting` |

use ic_shared::kv::decode::DecodeError;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use ic_shared::kv::coverage::{Coverage, CoverageState, REASONS as COVERAGE_REASONS};

use super::stream::{
    CLEAR_ALL_BLOCKS, CLEAR_ENGINE_RESTARTED, CLEAR_RANK_MISMATCH, CLEAR_REPLAY_TRUNCATED,
    CLEAR_SEQUENCE_GAP, DROP_REASONS, IGNORE_REASONS,
};
use super::zmtp_guard::Violation;

/// Batch-level drop reasons of the subscriber itself (besides the decoder's and the state
/// machine's).
pub const SUBSCRIBER_DROP_REASONS: &[&str] = &[
    "queue_full",
    "inflight_budget",
    "bad_frames",
    "bad_seq",
    "forged_seq",
];

/// `socket` label values of `peers_dropped_total`.
const PEER_SOCKETS: &[&str] = &["events", "replay"];
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
    pub(crate) clock_skew: GaugeVec,
    pub(crate) coverage: IntGaugeVec,
    pub(crate) coverage_transitions: IntCounterVec,
    pub(crate) peers_dropped: IntCounterVec,
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
            clock_skew: {
                let g = GaugeVec::new(
                    Opts::new(
                        format!("{P}engine_clock_skew_seconds"),
                        "Estimated engine clock minus agent clock in seconds (positive: the engine's clock is ahead), from the live batches of the last 10 minutes.",
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
            peers_dropped: counter(
                reg,
                &format!("{P}peers_dropped_total"),
                "Engine connections dropped for breaking the ZMTP frame and message limits, by socket (events or replay) and reason.",
                &["stream", "socket", "reason"],
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

    /// Calls `f` with every fixed-label counter series of `stream` (label values from the fixed
    /// lists above): the one enumeration [`init_stream`](Self::init_stream) and
    /// [`remove_stream`](Self::remove_stream) share.
    fn each_counter_series(&self, stream: &str, mut f: impl FnMut(&IntCounterVec, &[&str])) {
        for c in [&self.decoded, &self.gaps] {
            f(c, &[stream]);
        }
        for s in SOURCES {
            f(&self.received, &[stream, s]);
        }
        for t in EVENT_TYPES {
            f(&self.events, &[stream, t]);
        }
        let drops = SUBSCRIBER_DROP_REASONS
            .iter()
            .chain(DecodeError::REASONS)
            .chain(DROP_REASONS);
        for r in drops {
            f(&self.dropped, &[stream, r]);
        }
        for r in IGNORE_REASONS {
            f(&self.ignored, &[stream, r]);
        }
        for r in REPLAY_RESULTS {
            f(&self.replays, &[stream, r]);
        }
        for r in CLEAR_REASONS {
            f(&self.resyncs, &[stream, r]);
        }
        for st in CoverageState::ALL {
            f(&self.coverage_transitions, &[stream, st.as_str()]);
        }
        for socket in PEER_SOCKETS {
            for r in Violation::REASONS {
                f(&self.peers_dropped, &[stream, socket, r]);
            }
        }
    }

    /// Creates every fixed-label series of a newly planned `stream` at 0 (counters, `blocks`,
    /// `connected`), so a panel or alert over `rate(...)` reads 0 rather than "No data" until the
    /// first event of each kind. `stream_lag_seconds` and `coverage` appear with the first batch
    /// and the first coverage state: absent there means "not known yet", not 0.
    pub(crate) fn init_stream(&self, stream: &str) {
        self.each_counter_series(stream, |c, labels| {
            c.with_label_values(labels);
        });
        for g in [&self.blocks, &self.connected] {
            g.with_label_values(&[stream]);
        }
    }

    /// Deletes every series of `stream` (after the plan dropped it).
    pub(crate) fn remove_stream(&self, stream: &str) {
        self.each_counter_series(stream, |c, labels| {
            let _ = c.remove_label_values(labels);
        });
        for g in [&self.blocks, &self.connected] {
            let _ = g.remove_label_values(&[stream]);
        }
        let _ = self.lag.remove_label_values(&[stream]);
        let _ = self.clock_skew.remove_label_values(&[stream]);
        for st in CoverageState::ALL {
            for r in COVERAGE_REASONS.iter().chain(std::iter::once(&"")) {
                let _ = self.coverage.remove_label_values(&[stream, st.as_str(), r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Series of `stream` in the registry: (family name, value).
    fn series_of(reg: &Registry, stream: &str) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for fam in reg.gather() {
            for m in fam.get_metric() {
                if m.get_label()
                    .iter()
                    .any(|l| l.name() == "stream" && l.value() == stream)
                {
                    let v = match fam.get_field_type() {
                        prometheus::proto::MetricType::COUNTER => m.get_counter().get_value(),
                        _ => m.get_gauge().get_value(),
                    };
                    out.push((fam.name().to_string(), v));
                }
            }
        }
        out
    }

    #[test]
    fn a_planned_stream_has_every_fixed_series_at_zero_and_loses_them_all_when_dropped() {
        let reg = Registry::new();
        let m = KvMetrics::new(&reg).unwrap();
        m.init_stream("ns/pod#0");
        let series = series_of(&reg, "ns/pod#0");
        let families: std::collections::BTreeSet<&str> =
            series.iter().map(|(f, _)| f.as_str()).collect();
        for want in [
            "inferencecache_agent_kv_batches_received_total",
            "inferencecache_agent_kv_batches_decoded_total",
            "inferencecache_agent_kv_events_decoded_total",
            "inferencecache_agent_kv_events_dropped_total",
            "inferencecache_agent_kv_events_ignored_total",
            "inferencecache_agent_kv_gaps_total",
            "inferencecache_agent_kv_replays_total",
            "inferencecache_agent_kv_resyncs_total",
            "inferencecache_agent_kv_coverage_transitions_total",
            "inferencecache_agent_kv_blocks",
            "inferencecache_agent_kv_connected",
            "inferencecache_agent_kv_peers_dropped_total",
        ] {
            assert!(
                families.contains(want),
                "{want} has no series after init_stream"
            );
        }
        assert!(series.iter().all(|(_, v)| *v == 0.0), "{series:?}");
        // Every drop reason of each source is there, not only one.
        let drops = series
            .iter()
            .filter(|(f, _)| f == "inferencecache_agent_kv_events_dropped_total")
            .count();
        assert_eq!(
            drops,
            SUBSCRIBER_DROP_REASONS.len() + DecodeError::REASONS.len() + DROP_REASONS.len()
        );
        m.set_coverage(
            "ns/pod#0",
            None,
            Coverage {
                state: CoverageState::Exact,
                reason: None,
            },
        );
        m.lag.with_label_values(&["ns/pod#0"]).set(0.5);
        m.clock_skew.with_label_values(&["ns/pod#0"]).set(-0.001);
        m.init_stream("other/pod#0");
        m.remove_stream("ns/pod#0");
        assert_eq!(series_of(&reg, "ns/pod#0"), vec![]);
        assert!(!series_of(&reg, "other/pod#0").is_empty());
    }
}
