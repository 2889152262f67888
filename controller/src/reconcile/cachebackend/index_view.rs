//! `status.indexParticipation` from the in-process prefix index (spec 000 "Index
//! Participation"; DESIGN.md "Index": the reconciler reads the snapshot in process).
//!
//! The index is reached through the small [`IndexView`] trait so tests can fake it (and fake
//! its failure). Attribution follows the spec: each replica's engine pod is looked up by
//! (tenant = namespace, replica id = pod name); a pod carrying
//! `inferencecache.io/injected-by: <ns>/<name>` belongs to that backend; otherwise the first
//! CacheBackend of the namespace, sorted by name, whose non-empty `matchLabels` is a subset of
//! the pod's labels. A replica whose pod is gone is skipped.

use std::collections::{BTreeMap, HashMap};

use ic_shared::crd::{CacheBackend, IndexParticipation, ReplicaCoverage};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use parking_lot::{Mutex, RwLock};
use thiserror::Error;

use crate::index::PrefixIndex;
use crate::ingest::host_tier::{HostTierReading, HostTierReadings};
use crate::reconcile::annotations::INJECTED_BY;
use crate::reconcile::clock::to_time;

/// One engine stream (pod × data-parallel rank) as the status reconciler needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaObservation {
    /// Tenant: the engine pod's namespace.
    pub tenant: String,
    /// Replica id: the pod name, plus `#<rank>` when the data-parallel rank is above 0.
    pub replica: String,
    /// Distinct prefix entries (blocks) the replica holds, any tier.
    pub prefix_count: u64,
    /// Unix milliseconds of the newest engine event; 0 when none yet.
    pub last_event_unix_ms: i64,
    /// Cumulative tier-2 lookups (`vllm:external_prefix_cache_queries_total`), when reported.
    pub t2_queries: Option<u64>,
    /// Cumulative tier-2 hits (`vllm:external_prefix_cache_hits_total`), when reported.
    pub t2_hits: Option<u64>,
    /// Cumulative prefix-cache lookups (`vllm:prefix_cache_queries_total`), when reported.
    pub prefix_cache_queries: Option<u64>,
    /// Cumulative prefix-cache hits (`vllm:prefix_cache_hits_total`), when reported.
    pub prefix_cache_hits: Option<u64>,
    /// Coverage state of the replica's entries (`Exact`, `Partial`, …; empty = Exact).
    pub coverage: &'static str,
    /// Why it is not Exact.
    pub coverage_reason: Option<&'static str>,
    /// The engine's current SGLang HiCache host-tier reading (issue 19 item 4), when its agent
    /// reports one ([`crate::ingest::host_tier`]).
    pub host_tier: Option<HostTierReading>,
}

impl ReplicaObservation {
    /// The engine pod's name (the replica id without its `#rank` suffix).
    pub fn pod_name(&self) -> &str {
        self.replica.split('#').next().unwrap_or_default()
    }
}

/// The index could not be read; the reconciler keeps the previous `indexParticipation`
/// (soft state).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("prefix index unavailable: {0}")]
pub struct IndexUnavailable(pub String);

/// Read access to the per-replica projection of the prefix index.
pub trait IndexView: Send + Sync {
    /// Every replica the index knows, or why it could not be read.
    fn replicas(&self) -> Result<Vec<ReplicaObservation>, IndexUnavailable>;

    /// The registry the controller's `/metrics` serves, when this view is the controller's
    /// shared state: [`super::Context::new`] registers the reconciler's gauges
    /// ([`super::metrics::BackendMetrics`]) there. `None` (the default) for fakes.
    fn metrics_registry(&self) -> Option<prometheus::Registry> {
        None
    }
}

/// Every replica the index holds, then every stream the node plans expect that it holds
/// nothing of (after a controller restart until its agent resyncs, on a node without a working
/// agent, after expiry): `Unknown` / `NotReported` with no entries, so a backend's status does
/// not read exact while its engines are missing from the index.
fn from_index(index: &PrefixIndex, host: Option<&HostTierReadings>) -> Vec<ReplicaObservation> {
    let absent: Vec<ReplicaObservation> = index
        .planned_streams_without_replica()
        .filter_map(|(id, scope)| {
            let (_, replica) = ic_shared::plan::EnginePlan::replica_of_stream_id(id)?;
            Some(ReplicaObservation {
                tenant: scope.0.clone(),
                replica,
                coverage: ic_shared::kv::coverage::CoverageState::Unknown.as_str(),
                coverage_reason: Some(ic_shared::kv::coverage::NOT_REPORTED),
                ..ReplicaObservation::default()
            })
        })
        .collect();
    index
        .snapshot()
        .replicas
        .into_iter()
        .map(|r| ReplicaObservation {
            host_tier: host.and_then(|h| h.get(&r.stream_id)),
            tenant: r.tenant,
            replica: r.replica,
            prefix_count: r.prefix_count as u64,
            last_event_unix_ms: r.last_event_unix_ms,
            // The engines' tier-2 counters, as the node agents scrape and report them
            // (`CounterReport`); absent until a replica's engine exposed them.
            t2_queries: r.t2_queries,
            t2_hits: r.t2_hits,
            prefix_cache_queries: r.prefix_cache_queries,
            prefix_cache_hits: r.prefix_cache_hits,
            coverage: r.coverage,
            coverage_reason: r.coverage_reason,
        })
        .chain(absent)
        .collect()
}

impl IndexView for RwLock<PrefixIndex> {
    fn replicas(&self) -> Result<Vec<ReplicaObservation>, IndexUnavailable> {
        Ok(from_index(&self.read(), None))
    }
}

impl IndexView for crate::state::Shared {
    /// `IndexUnavailable` until this replica first derived the node plans
    /// ([`crate::state::Shared::plans_pending`]): before that the index does not know which
    /// streams to expect, and a backend whose agents have not resynced would read empty and
    /// exact — the status keeps its previous `indexParticipation` instead.
    fn replicas(&self) -> Result<Vec<ReplicaObservation>, IndexUnavailable> {
        if self
            .plans_pending
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(IndexUnavailable(
                "node plans not derived yet since the controller started".into(),
            ));
        }
        let index = self.index.read();
        Ok(from_index(&index, Some(&self.host_tier.read())))
    }

    fn metrics_registry(&self) -> Option<prometheus::Registry> {
        Some(self.metrics.registry.clone())
    }
}

/// A settable index for tests: a list of replicas, or a failure.
#[derive(Debug)]
pub struct FakeIndex {
    state: Mutex<Result<Vec<ReplicaObservation>, IndexUnavailable>>,
}

impl Default for FakeIndex {
    fn default() -> Self {
        FakeIndex {
            state: Mutex::new(Ok(Vec::new())),
        }
    }
}

impl FakeIndex {
    /// An index with no replicas.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the replicas.
    pub fn set(&self, replicas: Vec<ReplicaObservation>) {
        *self.state.lock() = Ok(replicas);
    }

    /// Makes every read fail with `reason`.
    pub fn fail(&self, reason: &str) {
        *self.state.lock() = Err(IndexUnavailable(reason.to_string()));
    }
}

impl IndexView for FakeIndex {
    fn replicas(&self) -> Result<Vec<ReplicaObservation>, IndexUnavailable> {
        self.state.lock().clone()
    }
}

/// The labels of `pod` satisfy the non-empty equality selector `sel`.
pub fn selector_matches(sel: &BTreeMap<String, String>, pod: &Pod) -> bool {
    let labels = pod.metadata.labels.as_ref();
    !sel.is_empty()
        && sel
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The name of the CacheBackend (in the pod's namespace) that owns `pod`: the injected-by
/// annotation first, else the first of `backends` (any order; sorted here by name) whose
/// non-empty selector matches.
pub fn owning_backend(pod: &Pod, backends: &[CacheBackend]) -> Option<String> {
    let pod_ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    if let Some((ns, name)) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(INJECTED_BY))
        .and_then(|v| v.split_once('/'))
    {
        if ns == pod_ns && !name.is_empty() {
            return Some(name.to_string());
        }
    }
    let mut sorted: Vec<&CacheBackend> = backends
        .iter()
        .filter(|b| b.metadata.namespace.as_deref().unwrap_or_default() == pod_ns)
        .collect();
    sorted.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    sorted
        .into_iter()
        .find(|b| {
            b.spec
                .match_labels()
                .is_some_and(|m| selector_matches(m, pod))
        })
        .and_then(|b| b.metadata.name.clone())
}

/// Formats `hits / queries` as a short decimal that never lies at the ends: `"0"` only for
/// exactly zero hits, `"1"` only for hits = queries; otherwise four decimals, or as many more
/// as it takes to keep three significant digits of a small rate (1 in 30 000 → `"0.0000333"`)
/// or of the distance to 1 (29 999 in 30 000 → `"0.9999667"`), at most 15 (a rate below
/// 1e-15 reads `"0.000000000000001"`). `queries` = 0 gives `"0"`.
pub fn format_rate(hits: u64, queries: u64) -> String {
    if hits == 0 || queries == 0 {
        return "0".to_string();
    }
    if hits >= queries {
        return "1".to_string();
    }
    let r = hits as f64 / queries as f64;
    let digits = |x: f64| -> usize { ((-x.log10()).floor().clamp(0.0, 20.0) as usize) + 3 };
    let decimals = digits(r).max(digits(1.0 - r)).clamp(4, 15);
    let s = format!("{r:.decimals$}");
    match s.trim_end_matches('0').trim_end_matches('.') {
        // Below what 15 decimals show: the smallest non-zero value, never "0".
        "0" => "0.000000000000001".to_string(),
        "1" => "0.999999999999999".to_string(),
        t => t.to_string(),
    }
}

/// Computes the backend's `indexParticipation`.
///
/// - `replicas` failed, or `pods` / `backends` unavailable → `prior` unchanged (soft state).
/// - No replica attributed → `prior` absent stays absent; a present `prior` resets to
///   `prefixCount: 0` without `lastEventAt` (drain), keeping `t2HitRate` and `hitRate`. A
///   planned stream the index holds nothing of (`Unknown` / `NotReported`) is attributed like
///   a replica: the backend then reads `prefixCount: 0` with it in `inexactReplicas`.
/// - `inexactReplicas` lists replicas the index holds first, then `NotReported` ones, each
///   group by replica id, at most 32.
/// - Otherwise the sum of prefix counts, the newest event time, the query-weighted tier-2 hit
///   rate when any replica reported tier-2 lookups (else the prior `t2HitRate`), and the
///   query-weighted prefix-cache `hitRate` (issue 19: Σ hits / Σ queries of
///   `vllm:prefix_cache_{hits,queries}_total` over the replicas that report them — each token
///   looked up counts once, so a busy replica weighs more than an idle one, as the traffic
///   does) when any reported lookups, else the prior `hitRate` (like `t2HitRate`: the
///   counters are cumulative, a drain or a restarted engine does not erase what was measured);
///   unset until then, never 0 for "not reported".
pub fn participation(
    prior: Option<&IndexParticipation>,
    namespace: &str,
    name: &str,
    replicas: &Result<Vec<ReplicaObservation>, IndexUnavailable>,
    pods: Option<&[Pod]>,
    backends: Option<&[CacheBackend]>,
) -> Option<IndexParticipation> {
    let (Ok(replicas), Some(pods), Some(backends)) = (replicas, pods, backends) else {
        return prior.cloned();
    };
    let by_name: HashMap<&str, &Pod> = pods
        .iter()
        .filter(|p| p.metadata.namespace.as_deref().unwrap_or_default() == namespace)
        .filter_map(|p| p.metadata.name.as_deref().map(|n| (n, p)))
        .collect();
    let mut found = false;
    let mut prefix_count: u64 = 0;
    let mut last_ms: i64 = 0;
    let (mut queries, mut hits) = (0u64, 0u64);
    let (mut pc_queries, mut pc_hits) = (0u64, 0u64);
    let mut inexact: Vec<ReplicaCoverage> = Vec::new();
    for r in replicas.iter().filter(|r| r.tenant == namespace) {
        let Some(pod) = by_name.get(r.pod_name()) else {
            continue;
        };
        if owning_backend(pod, backends).as_deref() != Some(name) {
            continue;
        }
        found = true;
        if !r.coverage.is_empty() && r.coverage != "Exact" {
            inexact.push(ReplicaCoverage {
                replica: r.replica.clone(),
                coverage: r.coverage.to_string(),
                reason: r.coverage_reason.map(str::to_string),
            });
        }
        prefix_count = prefix_count.saturating_add(r.prefix_count);
        last_ms = last_ms.max(r.last_event_unix_ms);
        if let Some(q) = r.t2_queries {
            queries = queries.saturating_add(q);
            hits = hits.saturating_add(r.t2_hits.unwrap_or(0).min(q));
        }
        if let (Some(q), Some(h)) = (r.prefix_cache_queries, r.prefix_cache_hits) {
            pc_queries = pc_queries.saturating_add(q);
            pc_hits = pc_hits.saturating_add(h.min(q));
        }
    }
    if !found {
        return prior.map(|p| IndexParticipation {
            prefix_count: 0,
            last_event_at: None,
            hit_rate: p.hit_rate.clone(),
            t2_hit_rate: p.t2_hit_rate.clone(),
            inexact_replicas: Vec::new(),
        });
    }
    let t2_hit_rate = if queries > 0 {
        Some(format_rate(hits, queries))
    } else {
        prior.and_then(|p| p.t2_hit_rate.clone())
    };
    Some(IndexParticipation {
        prefix_count: i64::try_from(prefix_count).unwrap_or(i64::MAX),
        last_event_at: (last_ms > 0)
            .then(|| Timestamp::from_millisecond(last_ms).ok())
            .flatten()
            .map(to_time),
        hit_rate: if pc_queries > 0 {
            Some(format_rate(pc_hits, pc_queries))
        } else {
            prior.and_then(|p| p.hit_rate.clone())
        },
        t2_hit_rate,
        inexact_replicas: {
            let unreported = |c: &ReplicaCoverage| {
                c.reason.as_deref() == Some(ic_shared::kv::coverage::NOT_REPORTED)
            };
            inexact.sort_by(|a, b| (unreported(a), &a.replica).cmp(&(unreported(b), &b.replica)));
            inexact.truncate(32);
            inexact
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_format_short_and_never_round_to_the_ends() {
        assert_eq!(format_rate(0, 10), "0");
        assert_eq!(format_rate(0, 0), "0");
        assert_eq!(format_rate(1, 4), "0.25");
        assert_eq!(format_rate(4, 4), "1");
        assert_eq!(format_rate(1, 3), "0.3333");
        // 1 reload in 30 000 queries is not a dead tier, and 29 999 is not a perfect one.
        assert_eq!(format_rate(1, 30_000), "0.0000333");
        assert_eq!(format_rate(29_999, 30_000), "0.9999667");
        assert_eq!(format_rate(1, u64::MAX), "0.000000000000001");
        assert_eq!(format_rate(u64::MAX - 1, u64::MAX), "0.999999999999999");
        for (h, q) in [
            (1u64, 30_000u64),
            (1, 1_000_000_000),
            (999_999_999, 1_000_000_000),
        ] {
            let v: f64 = format_rate(h, q).parse().unwrap();
            assert!(v > 0.0 && v < 1.0, "{h}/{q} -> {v}");
        }
    }

    /// After a controller restart the plans expect two engine streams of a backend and only
    /// one agent has resynced: the other is listed Unknown / NotReported, so the status does
    /// not read exact; once its agent reports it, the listing is the index's own.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn planned_streams_the_index_holds_nothing_of_are_listed_not_reported() {
        use ic_shared::proto;
        let desc = |pod: &str, rank: u32| proto::StreamDescriptor {
            stream_id: format!("ns/{pod}#{rank}"),
            replica: if rank == 0 {
                pod.to_string()
            } else {
                format!("{pod}#{rank}")
            },
            dp_rank: rank,
            tenant: "ns".into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            backend: "b".into(),
            node: "n1".into(),
            offload_chunk_tokens: 0,
        };
        let snapshot = |pod: &str, rank: u32| proto::StreamSnapshot {
            coverage: proto::Coverage::Exact as i32,
            coverage_reason: String::new(),
            stream: Some(desc(pod, rank)),
            seq: 0,
            entries: vec![],
            last_event_unix_ms: 0,
            stale: false,
        };
        let index = RwLock::new(PrefixIndex::new());
        let scope = ("ns".to_string(), "m".to_string(), "vllm".to_string());
        index.write().set_planned_streams(HashMap::from([
            ("ns/engine-a#0".to_string(), scope.clone()),
            ("ns/engine-b#1".to_string(), scope),
        ]));
        index.write().resync_node("n1", &[snapshot("engine-a", 0)]);
        let pod = |name: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ns",
                    "annotations": {INJECTED_BY: "ns/b"}}}))
            .unwrap()
        };
        let pods = [pod("engine-a"), pod("engine-b")];
        let backend: CacheBackend = serde_json::from_value(serde_json::json!({
            "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
            "metadata": {"name": "b", "namespace": "ns"}, "spec": {"runtime": "VLLM"}}))
        .unwrap();
        let backends = [backend];
        let inexact = || {
            participation(
                None,
                "ns",
                "b",
                &index.replicas(),
                Some(&pods),
                Some(&backends),
            )
            .unwrap()
            .inexact_replicas
        };
        assert_eq!(
            inexact(),
            vec![ReplicaCoverage {
                replica: "engine-b#1".into(),
                coverage: "Unknown".into(),
                reason: Some("NotReported".into()),
            }]
        );
        // Its agent resyncs: nothing is missing any more.
        index.write().resync_node("n2", &[snapshot("engine-b", 1)]);
        assert_eq!(inexact(), vec![]);
    }

    /// Until this replica first derived the plans, the index cannot say which streams are
    /// missing: the status keeps its previous participation.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn before_the_first_plan_derivation_the_index_reads_unavailable() {
        let shared = crate::state::Shared::new(crate::state::LookupPolicy::default())
            .unwrap()
            .await_plans();
        assert!(IndexView::replicas(&shared).is_err());
        shared
            .plans_pending
            .store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(IndexView::replicas(&shared).unwrap(), vec![]);
    }

    #[test]
    fn pod_name_strips_rank() {
        let r = ReplicaObservation {
            replica: "engine-0#2".to_string(),
            ..Default::default()
        };
        assert_eq!(r.pod_name(), "engine-0");
    }
}
