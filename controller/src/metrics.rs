//! The controller's Prometheus registry (`inferencecache_controller_…`, base units, bounded labels).

pub mod labels;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use labels::{PromptRefusal, StreamRejection, WriteHold};

/// Bucket bounds of the controller's sub-second latency histograms, seconds (10 µs – 100 ms);
/// the lock-wait histogram adds 1 µs below, the write-hold histogram 0.25 s and 1 s above.
const LATENCY_BUCKETS: [f64; 13] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1,
];

/// Every controller metric, registered in [`ControllerMetrics::registry`].
#[derive(Clone)]
pub struct ControllerMetrics {
    /// The registry `/metrics` serves.
    pub registry: Registry,
    /// Agents with an open stream.
    pub agents_connected: IntGauge,
    /// Agent streams opened, by outcome (`accepted`, `rejected`) and, for `rejected`, reason
    /// ([`StreamRejection`]; empty for `accepted`). Count through [`Self::stream_accepted`]
    /// and [`Self::stream_rejected`].
    pub agent_streams_total: IntCounterVec,
    /// KV delta batches received.
    pub kv_batches_total: IntCounter,
    /// Stream deltas applied to the index.
    pub kv_deltas_applied_total: IntCounter,
    /// Stream deltas refused, by reason: `sequence_gap`, `unknown_stream`, `missing_stream`
    /// (each asks the agent for a resync and marks the node's replicas Unknown /
    /// `ResyncRequested`), `awaiting_resync` (dropped while that resync is pending, the rest of
    /// the refused delta's batch included), `outside_node_scope` (a stream the node may not
    /// report).
    pub kv_deltas_refused_total: IntCounterVec,
    /// Full resyncs applied, by trigger (`connect`, `requested`).
    pub kv_resyncs_total: IntCounterVec,
    /// Agent resyncs waiting for a turn or being applied, by `state` (`waiting`, `applying`;
    /// `ingest::turns`).
    pub resyncs_pending: IntGaugeVec,
    /// Streams of a node agent's resyncs and deltas left out, by reason (`outside_node_scope`:
    /// not an engine pod the plans place on the agent's node, one per stream snapshot or
    /// delta dropped; `block_size_cap`: one per snapshot or delta that lost entries or ops to
    /// a block size above the cap or past the registered-sizes cap, its stream then reads
    /// Partial / `BlockSizeCapExceeded`; `stream_cap`: one per stream past
    /// `--max-streams-per-reporter` in one resync; `resync_stream_cap`, `resync_entry_cap`: one
    /// per chunked resync refused as it passed `--max-streams-per-reporter` or
    /// `--max-resync-entries`, its stream ended with `RESOURCE_EXHAUSTED`;
    /// `subscriber_not_planned`: a per-pod subscriber's stream of no planned engine rank).
    pub kv_streams_refused_total: IntCounterVec,
    /// Check reports received.
    pub check_reports_total: IntCounter,
    /// (block, replica) entries in the index.
    pub index_entries: IntGauge,
    /// Distinct blocks in the index.
    pub index_blocks: IntGauge,
    /// Engine streams known to the index.
    pub index_replicas: IntGauge,
    /// Engine streams by coverage (`Exact`, `Healing`, `Partial`, `Disconnected`, `EngineDown`,
    /// `Unknown`).
    pub index_replicas_by_coverage: IntGaugeVec,
    /// KV-event streams the node plans expect that the index has no replica for (their agent
    /// has not connected or resynced since this controller started, or their replica
    /// expired); each makes answers of its scope say `IndexIncomplete`.
    pub index_planned_streams_absent: IntGauge,
    /// The index's heap by part, bytes (`slots`, `slots_used`, `holder_lists`, `key_vectors`,
    /// `key_vectors_used`), estimated from capacities; refreshed on each `/metrics` scrape.
    pub index_heap_bytes: IntGaugeVec,
    /// Blocks evicted by CacheTenant quotas, by tenant.
    pub index_quota_evictions_total: IntCounterVec,
    /// Blocks refused by the per-stream cap.
    pub index_stream_cap_refusals_total: IntCounter,
    /// LookupRoute answers by decision (`prefix_match`, `no_hint`).
    pub lookups_total: IntCounterVec,
    /// LookupRoute server-side latency.
    pub lookup_duration_seconds: Histogram,
    /// The part of a lookup spent waiting for the index's read lock (a writer holding or
    /// queued for it), seconds; a lookup that gives up at its budget counts its whole wait.
    pub lookup_lock_wait_seconds: Histogram,
    /// How long the index's write lock was held at a time, seconds, by `what`
    /// ([`WriteHold`]; taken through [`crate::state::Shared::index_write`], which
    /// observes it). A lookup arriving during a hold waits for the rest of it, and longer when
    /// writers queue or readers drain before a writer.
    pub index_write_hold_seconds: HistogramVec,
    /// LookupRoute prompt texts answered NO_HINT without a lookup, by reason (`too_large`,
    /// `no_model`, `no_tokenizer`, `tokenizer_unavailable`, `tokenization_failed`;
    /// [`PromptRefusal`]).
    pub prompt_text_refusals_total: IntCounterVec,
    /// Tokenizer file loads, by model (one per `--tokenizer`) and outcome (`loaded`, `failed`).
    pub tokenizer_loads_total: IntCounterVec,
    /// 1 while a model's tokenizer file on disk failed to load (the last good one, if any, is
    /// still used), else 0; by model.
    pub tokenizer_load_failing: IntGaugeVec,
    /// Connections each listener (`grpc`, `http`, `health`, `webhook`) closed on its own, by
    /// reason: `inferencecache_controller_listener_connections_closed_total{listener, reason}`
    /// ([`ic_shared::serve::ListenerMetrics`]). Listeners take their stats from it.
    pub listeners: ic_shared::serve::ListenerMetrics,
}

impl ControllerMetrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let p = "inferencecache_controller_";
        let agents_connected = IntGauge::new(
            format!("{p}agents_connected"),
            "Node agents with an open AgentService.Connect stream.",
        )?;
        let agent_streams_total = IntCounterVec::new(
            Opts::new(
                format!("{p}agent_streams_total"),
                "AgentService.Connect streams, by outcome (accepted, rejected) and the rejection's reason (pending_hellos_full, pending_per_source_full, hello_timeout, first_message_too_large, stream_error, no_hello, invalid_hello, unauthenticated, wrong_identity, review_unavailable, review_rate_limited, not_planned; empty when accepted).",
            ),
            &["outcome", "reason"],
        )?;
        let kv_batches_total = IntCounter::new(
            format!("{p}kv_batches_total"),
            "KV delta batches received from agents.",
        )?;
        let kv_deltas_applied_total = IntCounter::new(
            format!("{p}kv_deltas_applied_total"),
            "Per-stream KV deltas applied to the prefix index.",
        )?;
        let kv_deltas_refused_total = IntCounterVec::new(
            Opts::new(
                format!("{p}kv_deltas_refused_total"),
                "Per-stream KV deltas refused (a resync is requested), by reason.",
            ),
            &["reason"],
        )?;
        let kv_resyncs_total = IntCounterVec::new(
            Opts::new(
                format!("{p}kv_resyncs_total"),
                "Full node resyncs applied to the index, by trigger.",
            ),
            &["trigger"],
        )?;
        let resyncs_pending = IntGaugeVec::new(
            Opts::new(
                format!("{p}resyncs_pending"),
                "Agent resyncs waiting for a turn (waiting) or being applied (applying).",
            ),
            &["state"],
        )?;
        let kv_streams_refused_total = IntCounterVec::new(
            Opts::new(
                format!("{p}kv_streams_refused_total"),
                "Stream snapshots and deltas of agent resyncs left out (outside_node_scope, stream_cap) or cut (block_size_cap), and whole resyncs refused (resync_stream_cap, resync_entry_cap), by reason.",
            ),
            &["reason"],
        )?;
        let check_reports_total = IntCounter::new(
            format!("{p}check_reports_total"),
            "Node check reports received from agents.",
        )?;
        let index_entries = IntGauge::new(
            format!("{p}index_entries"),
            "(block, replica) entries in the KV-prefix index.",
        )?;
        let index_blocks = IntGauge::new(
            format!("{p}index_blocks"),
            "Distinct cached blocks in the KV-prefix index.",
        )?;
        let index_replicas = IntGauge::new(
            format!("{p}index_replicas"),
            "Engine streams (replicas) known to the KV-prefix index.",
        )?;
        let index_heap_bytes = IntGaugeVec::new(
            Opts::new(
                format!("{p}index_heap_bytes"),
                "Heap of the KV-prefix index by part, bytes, from capacities (slots: block-table slot arrays; slots_used: the slots holding a block; holder_lists: spilled holder lists; key_vectors: per-replica key vectors; key_vectors_used: their filled part). Refreshed on each scrape.",
            ),
            &["part"],
        )?;
        let index_replicas_by_coverage = IntGaugeVec::new(
            Opts::new(
                format!("{p}index_replicas_by_coverage"),
                "Engine streams known to the KV-prefix index, by coverage (Exact: every engine block indexed; Disconnected and EngineDown replicas are not routed).",
            ),
            &["coverage"],
        )?;
        let index_planned_streams_absent = IntGauge::new(
            format!("{p}index_planned_streams_absent"),
            "KV-event streams the node plans expect that the KV-prefix index has no replica for (agent not connected or not resynced since this controller started, or the replica expired); LookupRoute answers of their scope carry the IndexIncomplete warning.",
        )?;
        let index_quota_evictions_total = IntCounterVec::new(
            Opts::new(
                format!("{p}index_quota_evictions_total"),
                "Blocks the KV-prefix index evicted (oldest first) to keep a tenant within its CacheTenant spec.quota.maxIndexEntries, by tenant.",
            ),
            &["tenant"],
        )?;
        let index_stream_cap_refusals_total = IntCounter::new(
            format!("{p}index_stream_cap_refusals_total"),
            "Blocks not indexed because their stream reached --max-blocks-per-stream.",
        )?;
        let lookups_total = IntCounterVec::new(
            Opts::new(
                format!("{p}lookups_total"),
                "LookupRoute answers, by decision.",
            ),
            &["decision"],
        )?;
        let lookup_duration_seconds = Histogram::with_opts(
            HistogramOpts::new(
                format!("{p}lookup_duration_seconds"),
                "LookupRoute server-side latency in seconds (prompt_text tokenization included).",
            )
            // Up to 2.5 s: tokenizing a long prompt_text takes tens of ms, and a quantile above
            // the top bucket would read as that bucket.
            .buckets([&LATENCY_BUCKETS[..], &[0.25, 0.5, 1.0, 2.5]].concat()),
        )?;
        let lookup_lock_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                format!("{p}lookup_lock_wait_seconds"),
                "Time a LookupRoute waited for the KV-prefix index's read lock (a writer holding or queued for it), in seconds.",
            )
            .buckets([&[0.000_001][..], &LATENCY_BUCKETS, &[0.25, 1.0]].concat()),
        )?;
        let index_write_hold_seconds = HistogramVec::new(
            HistogramOpts::new(
                format!("{p}index_write_hold_seconds"),
                "How long the KV-prefix index's write lock was held at a time (lookups wait meanwhile), in seconds, by what it applied (deltas, resync_begin, resync_slice, counters, connect, disconnect, expire, tenant_quotas, probe).",
            )
            .buckets([&LATENCY_BUCKETS[..], &[0.25, 1.0]].concat()),
            &["what"],
        )?;
        let prompt_text_refusals_total = IntCounterVec::new(
            Opts::new(
                format!("{p}prompt_text_refusals_total"),
                "LookupRoute prompt texts answered NO_HINT without a lookup (too large, no model, no tokenizer, tokenizer unavailable, tokenization failed), by reason.",
            ),
            &["reason"],
        )?;
        let tokenizer_loads_total = IntCounterVec::new(
            Opts::new(
                format!("{p}tokenizer_loads_total"),
                "Loads of a --tokenizer file (at start and whenever it changed), by model and outcome.",
            ),
            &["model", "outcome"],
        )?;
        let tokenizer_load_failing = IntGaugeVec::new(
            Opts::new(
                format!("{p}tokenizer_load_failing"),
                "1 while the model's tokenizer file failed to load (the last good tokenizer, if any, is still used and answers carry TokenizerStale), else 0.",
            ),
            &["model"],
        )?;
        registry.register(Box::new(agents_connected.clone()))?;
        registry.register(Box::new(agent_streams_total.clone()))?;
        registry.register(Box::new(kv_batches_total.clone()))?;
        registry.register(Box::new(kv_deltas_applied_total.clone()))?;
        registry.register(Box::new(kv_deltas_refused_total.clone()))?;
        registry.register(Box::new(kv_resyncs_total.clone()))?;
        registry.register(Box::new(resyncs_pending.clone()))?;
        registry.register(Box::new(kv_streams_refused_total.clone()))?;
        registry.register(Box::new(check_reports_total.clone()))?;
        registry.register(Box::new(index_entries.clone()))?;
        registry.register(Box::new(index_blocks.clone()))?;
        registry.register(Box::new(index_replicas.clone()))?;
        registry.register(Box::new(index_replicas_by_coverage.clone()))?;
        registry.register(Box::new(index_planned_streams_absent.clone()))?;
        registry.register(Box::new(index_heap_bytes.clone()))?;
        registry.register(Box::new(index_quota_evictions_total.clone()))?;
        registry.register(Box::new(index_stream_cap_refusals_total.clone()))?;
        registry.register(Box::new(lookups_total.clone()))?;
        registry.register(Box::new(lookup_duration_seconds.clone()))?;
        registry.register(Box::new(lookup_lock_wait_seconds.clone()))?;
        registry.register(Box::new(index_write_hold_seconds.clone()))?;
        registry.register(Box::new(prompt_text_refusals_total.clone()))?;
        registry.register(Box::new(tokenizer_loads_total.clone()))?;
        registry.register(Box::new(tokenizer_load_failing.clone()))?;
        let listeners = ic_shared::serve::ListenerMetrics::register(&registry, p)?;
        ic_shared::telemetry::register_process_and_build_info(&registry, crate::BUILD_INFO)?;
        // Every value of these bounded labels exists from the start at 0, so a dashboard or
        // alert reads 0 (not "No data") until the first event of its kind.
        for (vec, values) in [
            (
                &kv_deltas_refused_total,
                &[
                    "sequence_gap",
                    "unknown_stream",
                    "missing_stream",
                    "awaiting_resync",
                    "outside_node_scope",
                ][..],
            ),
            (
                &kv_streams_refused_total,
                &[
                    "outside_node_scope",
                    "block_size_cap",
                    "stream_cap",
                    "resync_stream_cap",
                    "resync_entry_cap",
                    "subscriber_not_planned",
                ][..],
            ),
            (&kv_resyncs_total, &["connect", "requested"][..]),
            (&lookups_total, &["prefix_match", "no_hint"][..]),
            (
                &prompt_text_refusals_total,
                &PromptRefusal::ALL.map(|r| r.label())[..],
            ),
        ] {
            for v in values {
                vec.with_label_values(&[*v]);
            }
        }
        agent_streams_total.with_label_values(&["accepted", ""]);
        for r in StreamRejection::ALL {
            agent_streams_total.with_label_values(&["rejected", r.as_str()]);
        }
        for v in ["waiting", "applying"] {
            resyncs_pending.with_label_values(&[v]);
        }
        for w in WriteHold::ALL {
            index_write_hold_seconds.with_label_values(&[w.as_str()]);
        }
        Ok(ControllerMetrics {
            registry,
            agents_connected,
            agent_streams_total,
            kv_batches_total,
            kv_deltas_applied_total,
            kv_deltas_refused_total,
            kv_resyncs_total,
            resyncs_pending,
            kv_streams_refused_total,
            check_reports_total,
            index_entries,
            index_blocks,
            index_replicas,
            index_replicas_by_coverage,
            index_planned_streams_absent,
            index_heap_bytes,
            index_quota_evictions_total,
            index_stream_cap_refusals_total,
            lookups_total,
            lookup_duration_seconds,
            lookup_lock_wait_seconds,
            index_write_hold_seconds,
            prompt_text_refusals_total,
            tokenizer_loads_total,
            tokenizer_load_failing,
            listeners,
        })
    }

    /// Counts an accepted agent stream.
    pub fn stream_accepted(&self) {
        self.agent_streams_total
            .with_label_values(&["accepted", ""])
            .inc();
    }

    /// Counts a refused agent stream under `reason`.
    pub fn stream_rejected(&self, reason: StreamRejection) {
        self.agent_streams_total
            .with_label_values(&["rejected", reason.as_str()])
            .inc();
    }

    /// Prometheus text exposition of the registry.
    pub fn render(&self) -> String {
        ic_shared::telemetry::encode_metrics(&self.registry)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::ControllerMetrics;

    #[test]
    fn bounded_label_values_read_zero_before_first_use() {
        let m = ControllerMetrics::new().unwrap();
        let text = ic_shared::telemetry::encode_metrics(&m.registry);
        for series in [
            "inferencecache_controller_agent_streams_total{outcome=\"rejected\",reason=\"hello_timeout\"} 0",
            "inferencecache_controller_agent_streams_total{outcome=\"accepted\",reason=\"\"} 0",
            "inferencecache_controller_kv_deltas_refused_total{reason=\"awaiting_resync\"} 0",
            "inferencecache_controller_kv_deltas_refused_total{reason=\"sequence_gap\"} 0",
            "inferencecache_controller_kv_resyncs_total{trigger=\"requested\"} 0",
            "inferencecache_controller_lookups_total{decision=\"prefix_match\"} 0",
            "inferencecache_controller_lookups_total{decision=\"no_hint\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == series),
                "no `{series}` in:\n{text}"
            );
        }
        assert!(text.contains("inferencecache_build_info{commit="));
        assert!(text.contains("process_start_time_seconds "));
    }
}
