//! Tier-2 counters and cache memory from the engines' Prometheus endpoints (spec 000
//! `indexParticipation.t2HitRate`, condition `T2Degraded`; `CacheIndex.status.replicas[].
//! cacheMemoryBytes` from LMCache's `lmcache:local_cache_usage`, [`prom::cache_memory_bytes`]).
//!
//! The controller plans an engine's `metricsUrl` (`http://<podIP>:<port>/metrics`) for
//! Offload backends. Every [`ScrapeConfig::interval`] the agent fetches each planned URL once
//! ([`http::get`]: one bounded HTTP/1.1 GET, [`ScrapeConfig::timeout`] for the whole
//! exchange, at most [`ScrapeConfig::max_body_bytes`]) and reads
//! `vllm:external_prefix_cache_{hits,queries}_total` for each of the engine's KV streams
//! ([`prom::t2_counters`]: the series whose `engine` label is the stream's data-parallel rank,
//! else the sum of all series). The latest values live in [`EngineCounters`]; the controller
//! link sends them as a `CounterReport` after every Resync and whenever they change.
//!
//! For SGLang engines it also reads the HiCache host tier's writes and reads
//! ([`prom::host_tier_counters`]: `sglang:hicache_backup_tokens_total{pool="kv"}` of the
//! stream's rank and `sglang:cached_tokens_total{cache_source="host"}` of the pod; the
//! controller's `HiCacheHostTier` condition). SGLang serves `/metrics` only with
//! `--enable-metrics`; without it the controller plans no `metricsUrl`.
//!
//! Absent counters (no KV connector, or an engine that does not export them) are never sent
//! as 0: tier 2 "not exercised" stays distinct from "queried, zero hits" (an entry that
//! carries only the cache memory says `t2_absent`). A failed fetch keeps the stream's last
//! values and their scrape time (`observed_at_unix_ms`: counters are cumulative, nothing new was
//! learnt) except the host-tier pair, which is dropped (a change, so reported): the controller's
//! `HiCacheHostTier` reads only current readings, and an engine that does not answer may be
//! restarting (its counters start again at 0). A stream that left the plan is forgotten.
//!
//! Metric: `inferencecache_agent_engine_metrics_scrapes_total{outcome}` — one per URL and
//! scrape: `ok`, `absent` (fetched, counters not there), or the fetch failure
//! ([`http::FetchError::outcome`]).

pub mod http;
pub mod prom;

use std::collections::BTreeMap;
use std::time::Duration;

use ic_shared::now_unix_ms;
use ic_shared::plan::{EnginePlan, NodePlan};
use ic_shared::proto::{CounterReport, StreamCounters};
use parking_lot::RwLock;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use tokio::sync::watch;
use tracing::debug;

/// Default time between scrapes.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(15);
/// Default deadline of one fetch (connect, request, response).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default largest `/metrics` body accepted (vLLM with many engines and histograms stays well
/// below 1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// Scrape settings (`ic-agent run --t2-scrape-interval-seconds`, `--t2-scrape-timeout-ms`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// Time between scrapes; zero turns scraping off.
    pub interval: Duration,
    /// Deadline of one fetch.
    pub timeout: Duration,
    /// Largest body accepted.
    pub max_body_bytes: usize,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: DEFAULT_INTERVAL,
            timeout: DEFAULT_TIMEOUT,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// Outcomes besides the fetch failures.
const OUTCOME_OK: &str = "ok";
const OUTCOME_ABSENT: &str = "absent";

/// The latest tier-2 counters per stream, and the scrape metrics.
pub struct EngineCounters {
    latest: RwLock<BTreeMap<String, StreamCounters>>,
    changed: watch::Sender<u64>,
    scrapes_total: IntCounterVec,
    t2_hits_total: IntCounterVec,
    t2_queries_total: IntCounterVec,
    t2_last_hit: GaugeVec,
}

/// Label of the per-stream tier-2 series: the stream id (`<namespace>/<pod>#<dp rank>`), as on
/// the agent's other per-stream series. (Not `namespace`: a scrape's own target label of that
/// name would push it aside to `exported_namespace`.)
const STREAM_LABELS: [&str; 1] = ["stream"];

impl EngineCounters {
    /// An empty store; registers `inferencecache_agent_engine_metrics_scrapes_total` in
    /// `registry`.
    ///
    /// # Errors
    /// When the metric is already registered there.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let scrapes_total = IntCounterVec::new(
            Opts::new(
                "inferencecache_agent_engine_metrics_scrapes_total",
                "Scrapes of engine /metrics endpoints for tier-2 counters, by outcome (ok, absent, or the fetch failure).",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(scrapes_total.clone()))?;
        // Every outcome exists at 0 from the start: a panel over rate(...) reads 0, not "No data".
        for outcome in [OUTCOME_OK, OUTCOME_ABSENT]
            .iter()
            .chain(http::FetchError::OUTCOMES)
        {
            scrapes_total.with_label_values(&[outcome]);
        }
        let t2_hits_total = IntCounterVec::new(
            Opts::new(
                "inferencecache_agent_engine_t2_hits_total",
                "Tier-2 (KV-connector) reload hits in tokens of each engine stream on this node, from vllm:external_prefix_cache_hits_total; monotonic across engine restarts (a reset adds the new count). For windowed alerts (LMCacheT2NoHits).",
            ),
            &STREAM_LABELS,
        )?;
        let t2_queries_total = IntCounterVec::new(
            Opts::new(
                "inferencecache_agent_engine_t2_queries_total",
                "Tier-2 lookups in tokens of each engine stream on this node, from vllm:external_prefix_cache_queries_total; monotonic across engine restarts.",
            ),
            &STREAM_LABELS,
        )?;
        let t2_last_hit = GaugeVec::new(
            Opts::new(
                "inferencecache_agent_engine_t2_last_hit_timestamp_seconds",
                "Unix time (seconds) of the scrape at which this agent last saw the engine stream's tier-2 hits grow (the first reading with hits counts: the last hit was at or before it); absent while the stream never served a reload. For LMCacheT2NoHits (served reloads before, none in the window).",
            ),
            &STREAM_LABELS,
        )?;
        registry.register(Box::new(t2_hits_total.clone()))?;
        registry.register(Box::new(t2_queries_total.clone()))?;
        registry.register(Box::new(t2_last_hit.clone()))?;
        Ok(EngineCounters {
            latest: RwLock::new(BTreeMap::new()),
            changed: watch::Sender::new(0),
            scrapes_total,
            t2_hits_total,
            t2_queries_total,
            t2_last_hit,
        })
    }

    /// Every stream's latest counters, in stream-id order.
    pub fn latest(&self) -> Vec<StreamCounters> {
        self.latest.read().values().cloned().collect()
    }

    /// The message the link sends: every stream's latest counters; `None` when there are none.
    pub fn report(&self) -> Option<CounterReport> {
        let streams = self.latest();
        (!streams.is_empty()).then_some(CounterReport { streams })
    }

    /// Changes whenever the counters of some stream changed (the link sends a report).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Scrapes counted with `outcome`.
    pub fn scrapes(&self, outcome: &str) -> u64 {
        self.scrapes_total
            .get_metric_with_label_values(&[outcome])
            .map(|c| c.get())
            .unwrap_or(0)
    }

    /// Replaces the store; signals subscribers when any stream's values (not just the scrape
    /// time) changed or a stream came or went.
    fn replace(&self, next: BTreeMap<String, StreamCounters>) {
        // Everything but the scrape time.
        let values = |c: &StreamCounters| StreamCounters {
            observed_at_unix_ms: 0,
            ..c.clone()
        };
        let differs = {
            let cur = self.latest.read();
            cur.len() != next.len()
                || cur
                    .iter()
                    .zip(next.iter())
                    .any(|((ka, a), (kb, b))| ka != kb || values(a) != values(b))
        };
        self.mirror_t2(&self.latest.read(), &next);
        *self.latest.write() = next;
        if differs {
            self.changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

impl EngineCounters {
    /// Advances the per-stream tier-2 counters from `cur` to `next`: by the engine's increase,
    /// or by its whole new value when it went down (the engine restarted and counts from 0);
    /// streams that left the plan lose their series.
    fn mirror_t2(
        &self,
        cur: &BTreeMap<String, StreamCounters>,
        next: &BTreeMap<String, StreamCounters>,
    ) {
        let labels = |c: &StreamCounters| c.stream.as_ref().map(|d| [d.stream_id.clone()]);
        for (id, n) in next.iter().filter(|(_, n)| !n.t2_absent) {
            let Some(l) = labels(n) else { continue };
            let l = [l[0].as_str()];
            let prev = cur.get(id).filter(|c| !c.t2_absent);
            let step = |new: u64, old: Option<u64>| match old {
                Some(o) if new >= o => new - o,
                _ => new,
            };
            let hits = step(n.t2_hits, prev.map(|p| p.t2_hits));
            self.t2_hits_total.with_label_values(&l).inc_by(hits);
            if hits > 0 {
                self.t2_last_hit
                    .with_label_values(&l)
                    .set(n.observed_at_unix_ms as f64 / 1000.0);
            }
            self.t2_queries_total
                .with_label_values(&l)
                .inc_by(step(n.t2_queries, prev.map(|p| p.t2_queries)));
        }
        for (id, c) in cur {
            if next.get(id).is_some_and(|n| !n.t2_absent) {
                continue;
            }
            if let Some(l) = labels(c) {
                let l = [l[0].as_str()];
                let _ = self.t2_hits_total.remove_label_values(&l);
                let _ = self.t2_queries_total.remove_label_values(&l);
                let _ = self.t2_last_hit.remove_label_values(&l);
            }
        }
    }
}

/// Engines with a metrics URL and at least one KV stream, grouped by URL.
fn targets(plan: &NodePlan) -> BTreeMap<String, Vec<&EnginePlan>> {
    let mut out: BTreeMap<String, Vec<&EnginePlan>> = BTreeMap::new();
    for e in &plan.engines {
        if e.kv_events.is_empty() {
            continue;
        }
        if let Some(url) = e.metrics_url.as_deref().filter(|u| !u.trim().is_empty()) {
            out.entry(url.to_string()).or_default().push(e);
        }
    }
    out
}

/// One scrape of every planned URL (concurrently); updates `counters`.
pub async fn scrape_once(plan: &NodePlan, counters: &EngineCounters, cfg: &ScrapeConfig) {
    let targets = targets(plan);
    let fetches = targets.keys().map(|url| async move {
        (
            url.clone(),
            http::get(url, cfg.timeout, cfg.max_body_bytes).await,
        )
    });
    let results = futures::future::join_all(fetches).await;
    let now = now_unix_ms();
    let previous = counters.latest.read().clone();
    let mut next = BTreeMap::new();
    for (url, result) in results {
        let engines = targets.get(&url).map(Vec::as_slice).unwrap_or_default();
        match result {
            Ok(body) => {
                let mut found = false;
                for e in engines {
                    for src in &e.kv_events {
                        let d = e.descriptor(src.dp_rank);
                        let t2 = prom::t2_counters(&body, src.dp_rank);
                        let memory =
                            prom::cache_memory_bytes(&body, src.dp_rank, e.kv_events.len());
                        let prefix = prom::prefix_cache_counters(&body, src.dp_rank);
                        let host = prom::host_tier_counters(&body, src.dp_rank);
                        if t2.is_none() && memory.is_none() && prefix.is_none() && host.is_none() {
                            continue;
                        }
                        found = true;
                        next.insert(
                            d.stream_id.clone(),
                            StreamCounters {
                                stream: Some(d),
                                t2_hits: t2.map_or(0, |c| c.hits),
                                t2_queries: t2.map_or(0, |c| c.queries),
                                observed_at_unix_ms: now,
                                t2_absent: t2.is_none(),
                                cache_memory_bytes: memory,
                                prefix_cache_hits: prefix.map(|c| c.hits),
                                prefix_cache_queries: prefix.map(|c| c.queries),
                                host_tier_written_tokens: host.map(|c| c.written_tokens),
                                host_tier_served_tokens: host.map(|c| c.served_tokens),
                            },
                        );
                    }
                }
                let outcome = if found { OUTCOME_OK } else { OUTCOME_ABSENT };
                counters.scrapes_total.with_label_values(&[outcome]).inc();
            }
            Err(err) => {
                counters
                    .scrapes_total
                    .with_label_values(&[err.outcome()])
                    .inc();
                debug!(url = %url, error = %err, "engine metrics scrape failed; keeping the last counters");
                for e in engines {
                    for src in &e.kv_events {
                        let id = e.stream_id(src.dp_rank);
                        if let Some(prev) = previous.get(&id) {
                            // The host-tier pair is a "now" reading (HiCacheHostTier must not
                            // read True from an engine that may have restarted): dropped.
                            next.insert(
                                id,
                                StreamCounters {
                                    host_tier_written_tokens: None,
                                    host_tier_served_tokens: None,
                                    ..prev.clone()
                                },
                            );
                        }
                    }
                }
            }
        }
    }
    counters.replace(next);
}

/// Scrapes the engines of the current plan (`plan()`, read before each scrape: the agent's
/// `AgentState::plan`) into `counters` every `cfg.interval` (the first at once) until the task
/// is dropped. Does nothing when the interval is zero.
pub async fn run(plan: impl Fn() -> NodePlan, counters: &EngineCounters, cfg: ScrapeConfig) {
    if cfg.interval.is_zero() {
        return;
    }
    loop {
        let plan = plan();
        scrape_once(&plan, counters, &cfg).await;
        tokio::time::sleep(cfg.interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ic_shared::plan::KvEventSource;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Serves `body` to every connection (Content-Length framing) until aborted.
    async fn serve(body: &'static str) -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut b = [0u8; 2048];
                let _ = s.read(&mut b).await;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        (format!("http://{addr}/metrics"), task)
    }

    fn engine(pod: &str, ranks: &[u32], url: Option<String>) -> EnginePlan {
        EnginePlan {
            namespace: "team-a".into(),
            pod: pod.into(),
            model: "m".into(),
            backend: "team-a/cb".into(),
            kv_events: ranks
                .iter()
                .map(|r| KvEventSource {
                    endpoint: "tcp://127.0.0.1:1".into(),
                    dp_rank: *r,
                    ..Default::default()
                })
                .collect(),
            metrics_url: url,
            ..Default::default()
        }
    }

    fn entry(hits: u64, queries: u64, absent: bool) -> BTreeMap<String, StreamCounters> {
        BTreeMap::from([(
            "team-a/vllm-0#0".to_string(),
            StreamCounters {
                stream: Some(ic_shared::proto::StreamDescriptor {
                    stream_id: "team-a/vllm-0#0".into(),
                    replica: "vllm-0".into(),
                    tenant: "team-a".into(),
                    ..Default::default()
                }),
                t2_hits: hits,
                t2_queries: queries,
                t2_absent: absent,
                observed_at_unix_ms: 1,
                ..Default::default()
            },
        )])
    }

    /// `registry` in the text exposition format.
    fn exposition(registry: &Registry) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut buf)
            .unwrap();
        String::from_utf8(buf).unwrap()
    }

    /// Issue 19 item 5: the last-hit time LMCacheT2NoHits reads — absent until the stream
    /// served a reload, moved only by a reading whose hits grew (an engine restart that counts
    /// hits again counts), flat while queries grow without hits, gone with the stream.
    #[test]
    fn t2_last_hit_time_moves_only_with_hits() {
        let registry = Registry::new();
        let counters = EngineCounters::new(&registry).unwrap();
        let at = |hits: u64, queries: u64, ms: i64| {
            let mut e = entry(hits, queries, false);
            for c in e.values_mut() {
                c.observed_at_unix_ms = ms;
            }
            e
        };
        let last_hit = || {
            let text = exposition(&registry);
            text.lines()
                .find(|l| {
                    l.starts_with("inferencecache_agent_engine_t2_last_hit_timestamp_seconds{stream=\"team-a/vllm-0#0\"}")
                })
                .and_then(|l| l.rsplit(' ').next())
                .map(|v| v.parse::<f64>().unwrap())
        };
        counters.replace(at(0, 100, 1_000));
        assert_eq!(last_hit(), None, "queried, never served: no last hit");
        counters.replace(at(10, 150, 2_500));
        assert_eq!(last_hit(), Some(2.5));
        counters.replace(at(10, 200, 3_000));
        assert_eq!(last_hit(), Some(2.5), "queries without hits leave it");
        counters.replace(at(12, 250, 4_000));
        assert_eq!(last_hit(), Some(4.0));
        // The engine restarted: 3 hits since then are new hits.
        counters.replace(at(3, 10, 5_000));
        assert_eq!(last_hit(), Some(5.0));
        // Restarted again, no hit yet.
        counters.replace(at(0, 10, 6_000));
        assert_eq!(last_hit(), Some(5.0));
        counters.replace(BTreeMap::new());
        assert_eq!(last_hit(), None, "the stream left the plan");
    }

    /// Issue 19 item 5: the per-stream tier-2 counters a windowed alert (LMCacheT2NoHits) can
    /// use — monotonic across an engine restart, gone with the stream.
    #[test]
    fn every_scrape_outcome_exists_at_zero_before_the_first_scrape() {
        let registry = Registry::new();
        let _counters = EngineCounters::new(&registry).unwrap();
        let fam = registry
            .gather()
            .into_iter()
            .find(|f| f.name() == "inferencecache_agent_engine_metrics_scrapes_total")
            .unwrap();
        let mut outcomes: Vec<&str> = fam
            .get_metric()
            .iter()
            .map(|m| m.get_label()[0].value())
            .collect();
        outcomes.sort_unstable();
        let mut want: Vec<&str> = [OUTCOME_OK, OUTCOME_ABSENT]
            .into_iter()
            .chain(http::FetchError::OUTCOMES.iter().copied())
            .collect();
        want.sort_unstable();
        assert_eq!(outcomes, want);
        assert!(fam
            .get_metric()
            .iter()
            .all(|m| m.get_counter().get_value() == 0.0));
    }

    #[test]
    fn t2_counters_are_mirrored_monotonically_per_stream() {
        let registry = Registry::new();
        let counters = EngineCounters::new(&registry).unwrap();
        let read = || {
            let text = exposition(&registry);
            let pick = |name: &str| {
                text.lines()
                    .find(|l| l.starts_with(name))
                    .and_then(|l| l.rsplit(' ').next())
                    .map(|v| v.parse::<u64>().unwrap())
            };
            (
                pick("inferencecache_agent_engine_t2_hits_total{stream=\"team-a/vllm-0#0\"}"),
                pick("inferencecache_agent_engine_t2_queries_total{stream=\"team-a/vllm-0#0\"}"),
            )
        };
        counters.replace(entry(0, 0, true));
        assert_eq!(read(), (None, None), "no tier-2 readings, no series");
        counters.replace(entry(10, 100, false));
        assert_eq!(read(), (Some(10), Some(100)));
        counters.replace(entry(30, 150, false));
        assert_eq!(read(), (Some(30), Some(150)));
        // The engine restarted and counts from 0: the counter keeps going up.
        counters.replace(entry(5, 20, false));
        assert_eq!(read(), (Some(35), Some(170)));
        // Queried, no new hits: the window shows hits flat while queries grow.
        counters.replace(entry(5, 90, false));
        assert_eq!(read(), (Some(35), Some(240)));
        counters.replace(BTreeMap::new());
        assert_eq!(read(), (None, None), "the stream left the plan");
    }

    /// Issue 19 item 4: SGLang's host-tier pair per rank from its own page; a failed scrape
    /// drops the pair (and says so with a report) while the cumulative counters stay.
    #[tokio::test]
    async fn a_failed_scrape_drops_the_host_tier_reading() {
        let (url, server) = serve(crate::engine_metrics::prom::tests::SGLANG_DP2).await;
        let counters = EngineCounters::new(&Registry::new()).unwrap();
        let mut changes = counters.subscribe();
        let plan = NodePlan {
            engines: vec![engine("sglang-0", &[0, 1], Some(url))],
            ..Default::default()
        };
        let cfg = ScrapeConfig::default();
        scrape_once(&plan, &counters, &cfg).await;
        let host = |c: &StreamCounters| (c.host_tier_written_tokens, c.host_tier_served_tokens);
        let got: Vec<_> = counters.latest().iter().map(host).collect();
        assert_eq!(got, vec![(Some(2048), Some(1024)), (Some(0), Some(1024))]);
        assert!(counters.latest().iter().all(|c| c.t2_absent));
        changes.mark_unchanged();

        server.abort();
        let _ = server.await;
        scrape_once(&plan, &counters, &cfg).await;
        let got: Vec<_> = counters.latest().iter().map(host).collect();
        assert_eq!(got, vec![(None, None), (None, None)]);
        assert_eq!(counters.latest().len(), 2, "the streams stay");
        assert!(changes.has_changed().unwrap(), "the controller hears of it");
    }

    #[tokio::test]
    async fn each_rank_gets_its_engine_series_and_absent_counters_stay_absent() {
        let (url, server) = serve(crate::engine_metrics::prom::tests::VLLM_DP2).await;
        let (plain, plain_server) = serve("# HELP up x\nup 1\n").await;
        let counters = EngineCounters::new(&Registry::new()).unwrap();
        let mut changes = counters.subscribe();
        let plan = NodePlan {
            engines: vec![
                engine("vllm-0", &[0, 1], Some(url.clone())),
                engine("vllm-1", &[0], Some(plain)),
                engine("vllm-2", &[0], None),
                engine("vllm-3", &[], Some(url)),
            ],
            ..Default::default()
        };
        let cfg = ScrapeConfig::default();
        scrape_once(&plan, &counters, &cfg).await;
        let got: Vec<(String, u64, u64)> = counters
            .latest()
            .into_iter()
            .map(|c| (c.stream.unwrap().stream_id, c.t2_hits, c.t2_queries))
            .collect();
        assert_eq!(
            got,
            vec![
                ("team-a/vllm-0#0".to_string(), 10240, 40960),
                ("team-a/vllm-0#1".to_string(), 0, 12288),
            ]
        );
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        assert_eq!((counters.scrapes("ok"), counters.scrapes("absent")), (1, 1));
        let d = counters.latest()[1].stream.clone().unwrap();
        assert_eq!(
            (
                d.replica.as_str(),
                d.dp_rank,
                d.tenant.as_str(),
                d.backend.as_str()
            ),
            ("vllm-0#1", 1, "team-a", "team-a/cb")
        );

        // Same values again: no change signalled.
        scrape_once(&plan, &counters, &cfg).await;
        assert!(!changes.has_changed().unwrap());

        // The endpoint goes away: the last values stay, the failure is counted.
        server.abort();
        plain_server.abort();
        let _ = server.await;
        scrape_once(&plan, &counters, &cfg).await;
        assert_eq!(counters.latest().len(), 2);
        assert_eq!(counters.scrapes("connect_error"), 2);
        assert!(!changes.has_changed().unwrap());

        // The plan drops the engine: its streams are forgotten.
        scrape_once(&NodePlan::default(), &counters, &cfg).await;
        assert!(counters.report().is_none());
        assert!(changes.has_changed().unwrap());
    }
}
