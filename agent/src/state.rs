//! State shared by the agent's loops and endpoints: the plan, the latest check pass, the link.

use std::sync::Arc;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use parking_lot::RwLock;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry};
use serde::Serialize;

use crate::engine_metrics::EngineCounters;
use crate::kv::KvHub;

/// One finished pass of every check.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckPass {
    /// Unix ms when the pass finished.
    pub observed_at_unix_ms: i64,
    /// Plan generation the pass ran against.
    pub plan_generation: u64,
    /// Wall time of the pass in seconds.
    pub duration_seconds: f64,
    /// Seconds between passes (`--check-interval-seconds`): the next one is due this long
    /// after this one.
    pub interval_seconds: u64,
    /// Every result.
    pub results: Vec<CheckResult>,
}

/// The agent's view of one controller replica's stream.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointStatus {
    /// True while the stream is open.
    pub connected: bool,
    /// Streams opened since start.
    pub connects: u64,
    /// Last connection error, if any.
    pub last_error: Option<String>,
}

/// The agent's view of its controller link (one stream per controller replica).
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LinkStatus {
    /// Controller URL as configured, empty when running without one.
    pub controller: String,
    /// True while at least one replica's stream is open.
    pub connected: bool,
    /// Per resolved replica URL.
    pub endpoints: std::collections::BTreeMap<String, EndpointStatus>,
}

impl LinkStatus {
    /// Number of open replica streams.
    pub fn connected_count(&self) -> usize {
        self.endpoints.values().filter(|e| e.connected).count()
    }

    /// Recomputes `connected` from the endpoints.
    pub fn refresh(&mut self) {
        self.connected = self.connected_count() > 0;
    }
}

/// The agent's metrics (`inferencecache_agent_…`).
#[derive(Clone)]
pub struct AgentMetrics {
    /// The registry `/metrics` serves (the KV hub registers into it too).
    pub registry: Registry,
    /// Results of the latest pass, by check and status.
    pub check_results: IntGaugeVec,
    /// Duration of a full check pass.
    pub check_pass_duration_seconds: Histogram,
    /// Open controller streams (one per controller replica).
    pub link_connected: IntGauge,
    /// Controller streams opened.
    pub link_connects_total: IntCounter,
    /// KV delta batches sent.
    pub kv_batches_sent_total: IntCounter,
    /// Per-check detail gauges (bounded labels), see `checks::metrics`.
    pub check_details: crate::checks::metrics::CheckMetrics,
    /// Connections each HTTP listener (`http`, `metrics`) closed on its own, by reason:
    /// `inferencecache_agent_listener_connections_closed_total{listener, reason}`
    /// ([`ic_shared::serve::ListenerMetrics`]).
    pub listeners: ic_shared::serve::ListenerMetrics,
}

impl AgentMetrics {
    /// Creates and registers the agent-level metrics.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let p = "inferencecache_agent_";
        let check_results = IntGaugeVec::new(
            Opts::new(
                format!("{p}check_results"),
                "Results of the latest check pass, by check and status.",
            ),
            &["check", "status"],
        )?;
        let check_pass_duration_seconds = Histogram::with_opts(
            HistogramOpts::new(
                format!("{p}check_pass_duration_seconds"),
                "Wall time of one pass over every node check, in seconds.",
            )
            // Up to 2 min: a pass waits up to 60 s for a first CUDA probe and seconds per hung
            // MP worker; a quantile above the top bucket would read as that bucket.
            .buckets(vec![
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0,
            ]),
        )?;
        let link_connected = IntGauge::new(
            format!("{p}link_connected"),
            "Open AgentService streams to controller replicas.",
        )?;
        let link_connects_total = IntCounter::new(
            format!("{p}link_connects_total"),
            "AgentService streams opened to the controller.",
        )?;
        let kv_batches_sent_total = IntCounter::new(
            format!("{p}kv_batches_sent_total"),
            "KV delta batches sent to the controller.",
        )?;
        registry.register(Box::new(check_results.clone()))?;
        registry.register(Box::new(check_pass_duration_seconds.clone()))?;
        registry.register(Box::new(link_connected.clone()))?;
        registry.register(Box::new(link_connects_total.clone()))?;
        registry.register(Box::new(kv_batches_sent_total.clone()))?;
        let check_details = crate::checks::metrics::CheckMetrics::register(&registry)?;
        let listeners = ic_shared::serve::ListenerMetrics::register(&registry, p)?;
        ic_shared::telemetry::register_process_and_build_info(&registry, crate::BUILD_INFO)?;
        Ok(AgentMetrics {
            registry,
            check_results,
            check_pass_duration_seconds,
            link_connected,
            link_connects_total,
            kv_batches_sent_total,
            check_details,
            listeners,
        })
    }

    /// Records a pass in the gauges.
    pub fn record_pass(&self, pass: &CheckPass) {
        self.check_results.reset();
        for r in &pass.results {
            self.check_results
                .with_label_values(&[r.name.as_str(), r.status.as_label()])
                .inc();
        }
        self.check_details.record(&pass.results);
        self.check_pass_duration_seconds
            .observe(pass.duration_seconds);
    }
}

/// Everything the loops and endpoints share.
pub struct AgentState {
    /// Node name reported in Hello and reports.
    pub node: String,
    /// Current plan (file plan, replaced by controller plans).
    pub plan: RwLock<NodePlan>,
    /// Latest finished check pass.
    pub latest: RwLock<Option<CheckPass>>,
    /// Controller link status.
    pub link: RwLock<LinkStatus>,
    /// KV-event subscribers.
    pub hub: KvHub,
    /// The engines' latest tier-2 counters per stream (scraped from their `/metrics`).
    pub engine_counters: EngineCounters,
    /// Metrics.
    pub metrics: AgentMetrics,
}

impl AgentState {
    /// Fresh state for `node` with an initial plan.
    pub fn new(node: String, plan: NodePlan) -> Result<Arc<Self>, prometheus::Error> {
        Self::with_state_dir(node, plan, None)
    }

    /// Like [`new`](Self::new), keeping KV stream state in `state_dir` across agent restarts
    /// (`--state-dir`): the first plan's streams already start from their kept state.
    pub fn with_state_dir(
        node: String,
        plan: NodePlan,
        state_dir: Option<crate::kv::persist::StateDir>,
    ) -> Result<Arc<Self>, prometheus::Error> {
        let metrics = AgentMetrics::new()?;
        let hub = KvHub::new(&metrics.registry)?;
        let engine_counters = EngineCounters::new(&metrics.registry)?;
        if let Some(dir) = state_dir {
            hub.set_state_dir(dir);
        }
        hub.apply_plan(&plan);
        Ok(Arc::new(AgentState {
            node,
            plan: RwLock::new(plan),
            latest: RwLock::new(None),
            link: RwLock::new(LinkStatus::default()),
            hub,
            engine_counters,
            metrics,
        }))
    }

    /// The `/v1/report` document: the `ic-agent check --json` shape plus the plan generation,
    /// the KV streams and the link. `None` before the first pass.
    pub fn report_json(&self) -> Option<serde_json::Value> {
        let pass = self.latest.read().clone()?;
        let mut doc = crate::checks::report_json(&self.node, &pass.results);
        if let Some(obj) = doc.as_object_mut() {
            obj.insert("observedAtUnixMs".into(), pass.observed_at_unix_ms.into());
            obj.insert("planGeneration".into(), pass.plan_generation.into());
            obj.insert(
                "kvStreams".into(),
                serde_json::to_value(self.hub.status()).unwrap_or_default(),
            );
            let counters: Vec<serde_json::Value> = self
                .engine_counters
                .latest()
                .iter()
                .map(|c| {
                    // Absent values are null, never 0.
                    let t2 = |v: u64| (!c.t2_absent).then_some(v);
                    serde_json::json!({
                        "streamId": c.stream.as_ref().map(|d| d.stream_id.as_str()).unwrap_or_default(),
                        "t2Hits": t2(c.t2_hits),
                        "t2Queries": t2(c.t2_queries),
                        "cacheMemoryBytes": c.cache_memory_bytes,
                        "prefixCacheHits": c.prefix_cache_hits,
                        "prefixCacheQueries": c.prefix_cache_queries,
                        "hostTierWrittenTokens": c.host_tier_written_tokens,
                        "hostTierServedTokens": c.host_tier_served_tokens,
                        "observedAtUnixMs": c.observed_at_unix_ms,
                    })
                })
                .collect();
            obj.insert("engineCounters".into(), counters.into());
            obj.insert(
                "link".into(),
                serde_json::to_value(self.link.read().clone()).unwrap_or_default(),
            );
        }
        Some(doc)
    }

    /// Worst status of the latest pass (`Unknown` before the first).
    pub fn worst(&self) -> CheckStatus {
        self.latest
            .read()
            .as_ref()
            .map(|p| CheckStatus::worst(p.results.iter().map(|r| r.status)))
            .unwrap_or(CheckStatus::Unknown)
    }
}

pub use ic_shared::now_unix_ms;
