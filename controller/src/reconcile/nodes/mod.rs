//! Node plans, CacheNode status and the CacheBackend node advisory (DESIGN.md "Data flows" 3
//! and 6; `docs/in-cluster.md`).
//!
//! - [`plans`] — pure: each node's [`NodePlan`](ic_shared::plan::NodePlan) from engine pods
//!   and CacheBackends.
//! - [`cachenode`] — pure status computation, a rate limiter, and the CacheNode writer.
//! - [`advisory`] — pure `NodeHealthy` advisory per CacheBackend, and its writer.
//! - [`reader_advisory`] — pure `ReadersHealthy` advisory per ModelCache (the agents'
//!   reader-volume checks of the binding's reader mounts), and its writer.
//!
//! Two loops tie them to the cluster:
//!
//! - the **plan publisher** ([`spawn_plan_publisher`], leader only — agents keep a stream to
//!   every replica, so the leader reaches them all with one consistent generation sequence):
//!   every `plan_interval` it lists Pods and CacheBackends ([`publish_plans_once`]), derives the
//!   plans and hands them to the registry, which pushes changed plans down the agents' streams. A node with engine pods
//!   and no connected agent is logged (once, when it becomes so) and counted in
//!   `inferencecache_controller_nodes_without_agent`;
//! - the **status writer** ([`spawn_status_writer`], acts only on the leader): on every agent
//!   connect, disconnect and check report (coalesced over [`DEBOUNCE`]) and every
//!   `status_interval`, it writes the CacheNodes ([`write_cachenodes`]) and, when the advisory
//!   verdicts changed or every `advisory_resync`, the CacheBackends' advisory condition and
//!   (once the plan book is authoritative, so a fresh leader does not clear conditions before
//!   its first plans) the ModelCaches' `ReadersHealthy` condition ([`write_reader_advisories`]).

pub mod advisory;
pub mod cachenode;
pub mod plans;
pub mod reader_advisory;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ic_shared::crd::{CacheBackend, ModelCache};
use ic_shared::plan::NodePlan;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::Client;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::index::ReplicaSnapshot;
use crate::ingest::registry::{NodeRecord, PublishReport};
use crate::leader::LeaderHandle;
use crate::reconcile::clock::{to_time, Clock};
use crate::state::Shared;

use cachenode::{CacheNodeWriter, NodeView, WriteDecision};

/// How long the status writer waits after a wake-up to coalesce a burst of reports.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// Timing of the node loops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLoopConfig {
    /// Pause between plan derivations (default 10 s).
    pub plan_interval: Duration,
    /// Pause between status passes without any agent activity (default 5 s).
    pub status_interval: Duration,
    /// At most one CacheNode write per node per this interval unless a condition status changed
    /// (default 30 s).
    pub cachenode_min_write_interval: Duration,
    /// At most one CacheIndex status write per this interval (default 15 s); the CacheIndex is
    /// compared with the index every `status_interval`.
    pub cacheindex_min_write_interval: Duration,
    /// Advisory conditions are re-checked against the API at least this often even when the
    /// verdicts did not change (repairs drift; default 60 s).
    pub advisory_resync: Duration,
    /// Namespace of the ModelCacheBindings (names the binding of a reader mount in plans).
    pub model_cache_control_namespace: String,
}

impl Default for NodeLoopConfig {
    fn default() -> Self {
        NodeLoopConfig {
            plan_interval: Duration::from_secs(10),
            status_interval: Duration::from_secs(5),
            cachenode_min_write_interval: Duration::from_secs(30),
            cacheindex_min_write_interval: Duration::from_secs(15),
            advisory_resync: Duration::from_secs(60),
            model_cache_control_namespace:
                crate::reconcile::model_cache::ModelCacheConfig::default().control_namespace,
        }
    }
}

/// Metrics of the node loops (`inferencecache_controller_…`).
#[derive(Clone)]
pub struct NodesMetrics {
    /// Plan updates queued on agent streams.
    pub plans_sent_total: IntCounter,
    /// Nodes with engine pods in their plan but no connected agent.
    pub nodes_without_agent: IntGauge,
    /// Plan issues of the leader's last derivation, by reason (none on a follower).
    pub plan_issues: prometheus::IntGaugeVec,
    /// CacheNode sync outcomes (`written`, `unchanged`, `rate_limited`, `error`).
    pub cachenode_syncs_total: IntCounterVec,
    /// Advisory condition writes (`written`, `error`).
    pub advisory_writes_total: IntCounterVec,
    /// `ReadersHealthy` condition writes on ModelCaches (`written`, `error`).
    pub reader_advisory_writes_total: IntCounterVec,
}

impl NodesMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let p = "inferencecache_controller_";
        let plans_sent_total = IntCounter::new(
            format!("{p}node_plans_sent_total"),
            "Node plan updates queued on agent streams.",
        )?;
        let nodes_without_agent = IntGauge::new(
            format!("{p}nodes_without_agent"),
            "Nodes running engine pods whose node agent is not connected to this replica.",
        )?;
        let plan_issues = prometheus::IntGaugeVec::new(
            Opts::new(
                format!("{p}node_plan_issues"),
                "Engine pods (or parts of them) the last plan derivation could not plan, by reason (exported by the leader only; a replica that loses leadership drops its series).",
            ),
            &["reason"],
        )?;
        let cachenode_syncs_total = IntCounterVec::new(
            Opts::new(
                format!("{p}cachenode_syncs_total"),
                "CacheNode status syncs, by outcome.",
            ),
            &["outcome"],
        )?;
        let advisory_writes_total = IntCounterVec::new(
            Opts::new(
                format!("{p}node_advisory_writes_total"),
                "Writes of the NodeHealthy advisory condition on CacheBackends, by outcome.",
            ),
            &["outcome"],
        )?;
        let reader_advisory_writes_total = IntCounterVec::new(
            Opts::new(
                format!("{p}reader_advisory_writes_total"),
                "Writes of the ReadersHealthy advisory condition on ModelCaches, by outcome.",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(plans_sent_total.clone()))?;
        registry.register(Box::new(nodes_without_agent.clone()))?;
        registry.register(Box::new(plan_issues.clone()))?;
        registry.register(Box::new(cachenode_syncs_total.clone()))?;
        registry.register(Box::new(advisory_writes_total.clone()))?;
        registry.register(Box::new(reader_advisory_writes_total.clone()))?;
        Ok(NodesMetrics {
            plans_sent_total,
            nodes_without_agent,
            plan_issues,
            cachenode_syncs_total,
            advisory_writes_total,
            reader_advisory_writes_total,
        })
    }
}

async fn list_pods_and_backends(
    client: &Client,
) -> Result<(Vec<Pod>, Vec<CacheBackend>), kube::Error> {
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let backends = Api::<CacheBackend>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    Ok((pods, backends))
}

/// On a replica that does not lead: derives the plans only to learn which engine pods run on
/// which node, and records that as the node scope agents' streams are held to
/// ([`crate::ingest::scope`]). Nothing is published.
pub async fn derive_node_scope_once(client: &Client, shared: &Shared) -> Result<(), kube::Error> {
    let (pods, backends) = list_pods_and_backends(client).await?;
    let derived = plans::derive_plans(&pods, &backends);
    record_derived_plans(shared, &derived.plans);
    Ok(())
}

/// What every replica keeps from derived plans: the node scope agents' streams are held to
/// ([`crate::ingest::scope`]) and the streams the index expects
/// ([`crate::index::PrefixIndex::set_planned_streams`]: a planned stream with no replica —
/// after a controller restart, until its agent resyncs — makes answers of its scope say
/// `IndexIncomplete`). The index write lock is taken only when the planned streams changed.
pub fn record_derived_plans(shared: &Shared, plans: &BTreeMap<String, ic_shared::plan::NodePlan>) {
    shared.nodes.lock().set_node_scope(plans);
    let planned = crate::index::planned_streams(plans.values());
    if !shared.index.read().planned_streams_are(&planned) {
        let mut ix = shared.index.write();
        ix.set_planned_streams(planned);
        shared.update_index_gauges(&ix);
    }
    // After the index knows what to expect: a lookup in between must not read "complete".
    shared
        .plans_pending
        .store(false, std::sync::atomic::Ordering::Release);
}

/// Lists every Pod and CacheBackend (and ModelCache, for reader mounts), derives the plans,
/// records them as the node scope ([`crate::ingest::scope`]) and publishes them through the
/// registry. Returns what the registry did. A failing ModelCache
/// list (e.g. the CRD is not installed) only leaves reader mounts out. Plan issues are counted
/// in `node_plan_issues` and logged once when they appear (warn) and when they clear (info),
/// through `issue_log`.
pub async fn publish_plans_once(
    client: &Client,
    shared: &Shared,
    model_cache_control_namespace: &str,
    metrics: Option<&NodesMetrics>,
    issue_log: &mut plans::PlanIssueLog,
) -> Result<PublishReport, kube::Error> {
    let (pods, backends) = list_pods_and_backends(client).await?;
    let mut derived = plans::derive_plans(&pods, &backends);
    record_derived_plans(shared, &derived.plans);
    match Api::<ModelCache>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(caches) => plans::add_reader_mounts(
            &mut derived.plans,
            crate::reconcile::model_cache::plan::reader_mounts(
                &caches.items,
                &pods,
                model_cache_control_namespace,
            ),
        ),
        Err(e) => debug!(error = %e, "cannot list ModelCaches; node plans carry no reader mounts"),
    }
    let (appeared, cleared) = issue_log.update(&derived.issues);
    for i in appeared {
        warn!(pod = %i.pod, node = ?i.node, reason = i.reason, "node plan issue: {}", i.message);
    }
    for (pod, reason) in cleared {
        info!(pod = %pod, reason, "node plan issue cleared");
    }
    if let Some(m) = metrics {
        m.plan_issues.reset();
        for i in &derived.issues {
            m.plan_issues.with_label_values(&[i.reason]).inc();
        }
    }
    let base = u64::try_from(crate::state::now_unix_ms()).unwrap_or(1);
    let report = shared.nodes.lock().publish_plans(derived.plans, base);
    if let Some(m) = metrics {
        m.plans_sent_total.inc_by(report.sent.len() as u64);
        m.nodes_without_agent.set(report.unserved.len() as i64);
    }
    for (node, generation) in &report.sent {
        debug!(node = %node, generation, "node plan sent");
    }
    for node in &report.pending {
        warn!(node = %node, "agent stream queue full; the node plan will be resent");
    }
    Ok(report)
}

/// On the leader, runs [`publish_plans_once`] every `interval` (and at once when leadership is
/// gained) until `shutdown` turns true — on other replicas [`derive_node_scope_once`]; logs nodes that newly run engine pods without a
/// connected agent. A replica that does not lead withdraws its plans: agents keep a stream to
/// every replica, and plans come from the leader only, so every agent sees one consistent
/// sequence of generations.
pub fn spawn_plan_publisher(
    client: Client,
    shared: Arc<Shared>,
    leader: LeaderHandle,
    metrics: Option<NodesMetrics>,
    cfg: NodeLoopConfig,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let interval = cfg.plan_interval;
    tokio::spawn(async move {
        let mut unserved: BTreeSet<String> = BTreeSet::new();
        let mut issue_log = plans::PlanIssueLog::default();
        let mut leading = leader.subscribe();
        let mut was_leader = false;
        loop {
            let is_leader = leader.is_leader();
            if is_leader {
                match publish_plans_once(
                    &client,
                    &shared,
                    &cfg.model_cache_control_namespace,
                    metrics.as_ref(),
                    &mut issue_log,
                )
                .await
                {
                    Ok(report) => {
                        let now: BTreeSet<String> = report.unserved.into_iter().collect();
                        for n in now.difference(&unserved) {
                            warn!(node = %n, "engine pods run on this node but its node agent is not connected: the node is not checked and its KV events are not indexed");
                        }
                        for n in unserved.difference(&now) {
                            info!(node = %n, "node agent connected (or the node's engine pods are gone)");
                        }
                        unserved = now;
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot list pods and CacheBackends to derive node plans")
                    }
                }
            } else {
                if was_leader {
                    shared.nodes.lock().withdraw_plans();
                    unserved.clear();
                    issue_log.clear();
                    if let Some(m) = &metrics {
                        // Plan figures are the leader's: a follower exports none.
                        m.nodes_without_agent.set(0);
                        m.plan_issues.reset();
                    }
                }
                // Every replica accepts agent streams, so every replica holds them to the
                // node scope.
                if let Err(e) = derive_node_scope_once(&client, &shared).await {
                    warn!(error = %e, "cannot list pods and CacheBackends to derive the node scope");
                }
            }
            was_leader = is_leader;
            // A (re)connecting agent gets its node's current plan from the registry at once;
            // this loop only follows pods, CacheBackends and leadership.
            let stop = tokio::select! {
                _ = tokio::time::sleep(interval) => false,
                r = leading.changed() => {
                    if r.is_err() {
                        tokio::time::sleep(interval).await;
                    }
                    false
                }
                _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => true,
            };
            if stop {
                break;
            }
        }
    })
}

/// A consistent copy of what the writers need from the shared state.
#[derive(Debug, Clone, Default)]
pub struct NodeSnapshot {
    /// Agents' records by node.
    pub records: BTreeMap<String, NodeRecord>,
    /// Current plans by node.
    pub plans: BTreeMap<String, NodePlan>,
    /// Index streams by node.
    pub replicas: BTreeMap<String, Vec<ReplicaSnapshot>>,
    /// Whether `plans` is this replica's derived plan book (false before the first plan pass
    /// of a leadership, or on a replica that does not lead).
    pub plans_authoritative: bool,
}

impl NodeSnapshot {
    /// Copies the registry and the index.
    pub fn take(shared: &Shared) -> Self {
        let (records, plans, plans_authoritative) = {
            let nodes = shared.nodes.lock();
            (
                nodes
                    .list()
                    .into_iter()
                    .map(|r| (r.node.clone(), r))
                    .collect::<BTreeMap<_, _>>(),
                nodes.plans(),
                nodes.plans_authoritative(),
            )
        };
        let mut replicas: BTreeMap<String, Vec<ReplicaSnapshot>> = BTreeMap::new();
        for r in shared.index.read().snapshot().replicas {
            replicas.entry(r.node.clone()).or_default().push(r);
        }
        NodeSnapshot {
            records,
            plans,
            replicas,
            plans_authoritative,
        }
    }

    /// Nodes that get a CacheNode: every node whose agent connected since start, and every
    /// node with engine pods in its plan.
    pub fn nodes(&self) -> BTreeSet<String> {
        let mut out: BTreeSet<String> = self.records.keys().cloned().collect();
        out.extend(
            self.plans
                .iter()
                .filter(|(_, p)| !p.engines.is_empty())
                .map(|(n, _)| n.clone()),
        );
        out
    }
}

/// One CacheNode pass over every node in `snap`. Returns the decision per node; API errors are
/// logged and counted, and leave the node for the next pass.
pub async fn write_cachenodes(
    writer: &mut CacheNodeWriter,
    snap: &NodeSnapshot,
    clock: &dyn Clock,
    metrics: Option<&NodesMetrics>,
) -> BTreeMap<String, Result<WriteDecision, String>> {
    let mut out = BTreeMap::new();
    let empty: Vec<ReplicaSnapshot> = Vec::new();
    for node in snap.nodes() {
        let view = NodeView {
            node: &node,
            record: snap.records.get(&node),
            plan: snap.plans.get(&node),
            replicas: snap.replicas.get(&node).unwrap_or(&empty),
            plans_authoritative: snap.plans_authoritative,
        };
        let res = writer.sync_node(&view, clock.now()).await;
        let label = match &res {
            Ok(WriteDecision::Write(_)) => "written",
            Ok(WriteDecision::Unchanged) => "unchanged",
            Ok(WriteDecision::RateLimited) => "rate_limited",
            Err(_) => "error",
        };
        if let Some(m) = metrics {
            m.cachenode_syncs_total.with_label_values(&[label]).inc();
        }
        if let Err(e) = &res {
            warn!(node = %node, error = %e, "cannot write CacheNode status");
        }
        out.insert(node, res.map_err(|e| e.to_string()));
    }
    out
}

/// The controller clock in Unix ms (what a record's `report_received_unix_ms` is in).
fn now_ms(clock: &dyn Clock) -> i64 {
    clock.now().as_millisecond()
}

/// Lists the CacheBackends and writes the advisory condition where it differs.
pub async fn write_advisories(
    client: &Client,
    snap: &NodeSnapshot,
    clock: &dyn Clock,
    metrics: Option<&NodesMetrics>,
) -> Result<advisory::AdvisoryReport, kube::Error> {
    let desired = advisory::advisories(&snap.plans, &snap.records, now_ms(clock));
    let backends = Api::<CacheBackend>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let report = advisory::sync_advisories(client, &backends, &desired, to_time(clock.now())).await;
    if let Some(m) = metrics {
        m.advisory_writes_total
            .with_label_values(&["written"])
            .inc_by(report.written.len() as u64);
        m.advisory_writes_total
            .with_label_values(&["error"])
            .inc_by(report.failed.len() as u64);
    }
    for (b, e) in &report.failed {
        warn!(backend = %b, error = %e, "cannot write the NodeHealthy advisory condition");
    }
    Ok(report)
}

/// Lists the ModelCaches and writes the `ReadersHealthy` condition where it differs from the
/// verdict of the request's binding ([`reader_advisory`]). `control_namespace` qualifies
/// binding names as the plans do ([`NodeLoopConfig::model_cache_control_namespace`]). The list
/// error is returned (the caller logs it at debug: with the model cache off the CRD or the RBAC
/// is absent).
pub async fn write_reader_advisories(
    client: &Client,
    snap: &NodeSnapshot,
    control_namespace: &str,
    clock: &dyn Clock,
    metrics: Option<&NodesMetrics>,
) -> Result<advisory::AdvisoryReport, kube::Error> {
    let desired = reader_advisory::reader_advisories(&snap.plans, &snap.records, now_ms(clock));
    let caches = Api::<ModelCache>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let report = reader_advisory::sync_reader_conditions(
        client,
        &caches,
        control_namespace,
        &desired,
        to_time(clock.now()),
    )
    .await;
    if let Some(m) = metrics {
        m.reader_advisory_writes_total
            .with_label_values(&["written"])
            .inc_by(report.written.len() as u64);
        m.reader_advisory_writes_total
            .with_label_values(&["error"])
            .inc_by(report.failed.len() as u64);
    }
    for (mc, e) in &report.failed {
        warn!(modelcache = %mc, error = %e, "cannot write the ReadersHealthy condition");
    }
    Ok(report)
}

/// The leader-only status loop: CacheNodes and advisory conditions (module docs).
pub fn spawn_status_writer(
    client: Client,
    shared: Arc<Shared>,
    leader: LeaderHandle,
    clock: Arc<dyn Clock>,
    cfg: NodeLoopConfig,
    metrics: Option<NodesMetrics>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut writer = CacheNodeWriter::new(client.clone(), cfg.cachenode_min_write_interval);
        let mut changes = shared.node_changes();
        let mut leading = leader.subscribe();
        let mut was_leader = false;
        let mut last_advisories: Option<BTreeMap<String, advisory::NodeAdvisory>> = None;
        let mut last_advisory_sync: Option<tokio::time::Instant> = None;
        let mut last_readers: Option<BTreeMap<String, reader_advisory::ReaderAdvisory>> = None;
        let mut last_readers_sync: Option<tokio::time::Instant> = None;
        loop {
            let is_leader = leader.is_leader();
            if is_leader && !was_leader {
                writer.reset();
                last_advisories = None;
                last_readers = None;
            }
            was_leader = is_leader;
            if is_leader {
                let snap = NodeSnapshot::take(&shared);
                write_cachenodes(&mut writer, &snap, clock.as_ref(), metrics.as_ref()).await;
                // Before the first plan pass of a leadership the plans are empty: writing the
                // advisory then would remove NodeHealthy from every backend ("no scheduled
                // engine pod") until the pass, with a fresh transition time.
                let desired =
                    advisory::advisories(&snap.plans, &snap.records, now_ms(clock.as_ref()));
                let due = last_advisory_sync.is_none_or(|t| t.elapsed() >= cfg.advisory_resync);
                if snap.plans_authoritative && (last_advisories.as_ref() != Some(&desired) || due) {
                    match write_advisories(&client, &snap, clock.as_ref(), metrics.as_ref()).await {
                        Ok(r) if r.failed.is_empty() => {
                            last_advisories = Some(desired);
                            last_advisory_sync = Some(tokio::time::Instant::now());
                        }
                        Ok(_) => {}
                        Err(e) => {
                            warn!(error = %e, "cannot list CacheBackends for the node advisory")
                        }
                    }
                }
                if snap.plans_authoritative {
                    let desired = reader_advisory::reader_advisories(
                        &snap.plans,
                        &snap.records,
                        now_ms(clock.as_ref()),
                    );
                    let due = last_readers_sync.is_none_or(|t| t.elapsed() >= cfg.advisory_resync);
                    if last_readers.as_ref() != Some(&desired) || due {
                        match write_reader_advisories(
                            &client,
                            &snap,
                            &cfg.model_cache_control_namespace,
                            clock.as_ref(),
                            metrics.as_ref(),
                        )
                        .await
                        {
                            Ok(r) if r.failed.is_empty() => {
                                last_readers = Some(desired);
                                last_readers_sync = Some(tokio::time::Instant::now());
                            }
                            Ok(_) => {}
                            Err(e) => {
                                debug!(error = %e, "cannot list ModelCaches; the ReadersHealthy condition is not written");
                                // Forbidden / not found: the model cache is off (no RBAC, no
                                // CRD). Try again at the resync or when a verdict changes,
                                // not on every pass; other errors retry on the next pass.
                                if matches!(&e, kube::Error::Api(a) if a.code == 403 || a.code == 404)
                                {
                                    last_readers = Some(desired);
                                    last_readers_sync = Some(tokio::time::Instant::now());
                                }
                            }
                        }
                    }
                }
            }
            let stop = tokio::select! {
                _ = tokio::time::sleep(cfg.status_interval) => false,
                r = changes.changed() => {
                    tokio::time::sleep(if r.is_ok() { DEBOUNCE } else { cfg.status_interval }).await;
                    false
                }
                r = leading.changed() => {
                    if r.is_err() {
                        tokio::time::sleep(cfg.status_interval).await;
                    }
                    false
                }
                _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => true,
            };
            if stop {
                break;
            }
        }
    })
}
