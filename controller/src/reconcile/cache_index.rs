//! The `CacheIndex` status writer (spec 000 "Index Participation", the CacheIndex carve-out;
//! `docs/crds.md` "CacheIndex").
//!
//! One cluster-scoped `CacheIndex` named [`CACHE_INDEX_NAME`], written by the leader only, from
//! the controller's own in-process index. [`desired_status`] is pure: from the index's
//! per-replica snapshot, its per-tenant and per-tier block counts and the stored status it
//! computes the whole status:
//!
//! - `replicas[]`: one row per engine stream (pod × data-parallel rank): tenant, owning
//!   backend (the plan's `<namespace>/<name>`, from the webhook's injected-by annotation),
//!   model, prefix count, coverage, newest event, and what the engine itself reports through
//!   the node agent's scrape of its `/metrics`: `cacheMemoryBytes` = LMCache's
//!   `lmcache:local_cache_usage`, `hitRate` = `vllm:prefix_cache_hits_total /
//!   vllm:prefix_cache_queries_total`. Either is absent when not reported (never 0).
//!   At most [`MAX_REPLICA_ROWS`] rows and [`MAX_REPLICA_BYTES`] of them (the object must stay
//!   far below etcd's 1.5 MiB);
//!   `replicaCount` is always the full count and `Complete=False/ReplicasTruncated` says so.
//! - `tenants[]`: distinct prefixes per tenant (they sum to `prefixes.total`), the tenant's
//!   query-weighted hit rate, and `memoryUsed` always 0 (deprecated by the spec: per-tenant
//!   memory double-counts shared engines).
//! - `prefixes`: distinct blocks, those some replica holds at T1, those held only at T2.
//! - `Exact`: True only when every replica's coverage is Exact; False counts the others.
//!
//! `lastUpdated` moves only when the content changes. [`CacheIndexWriter`] reads the stored
//! object once per `min_interval`, writes only when the status differs from it (at most once per
//! `min_interval`), creates the object when missing, and writes conditionally on the
//! resourceVersion it read (409 → nothing written, read again).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::crd::conditions::{new_condition, set_condition, ConditionStatus};
use ic_shared::crd::{
    index_condition, CacheIndex, CacheIndexSpec, CacheIndexStatus, PrefixSummary,
    ReplicaCacheStatus, TenantCacheStatus, CACHE_INDEX_NAME,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::index::ReplicaSnapshot;
use crate::leader::LeaderHandle;
use crate::reconcile::cachebackend::index_view::format_rate;
use crate::reconcile::clock::{to_time, Clock};
use crate::state::Shared;

/// Most rows in `status.replicas`.
pub const MAX_REPLICA_ROWS: usize = 2000;

/// Most bytes of `status.replicas` (serialized JSON): far below etcd's 1.5 MiB object limit,
/// with room for the managed-fields entry the list-map costs.
pub const MAX_REPLICA_BYTES: usize = 512 * 1024;

/// `status.observedServer` for the controller's own index.
pub const OBSERVED_IN_PROCESS: &str = "in-process";

pub use super::index_aggregate::{IndexAggregate, FIELD_MANAGER};

/// Condition reasons.
pub mod reason {
    /// Complete=True.
    pub const ALL_REPLICAS: &str = "AllReplicas";
    /// Complete=False: more replicas than [`super::MAX_REPLICA_ROWS`].
    pub const REPLICAS_TRUNCATED: &str = "ReplicasTruncated";
    /// Exact=True.
    pub const ALL_REPLICAS_EXACT: &str = "AllReplicasExact";
    /// Exact=False.
    pub const INEXACT_REPLICAS: &str = "InexactReplicas";
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn hit_rate(r: &ReplicaSnapshot) -> Option<String> {
    match (r.prefix_cache_hits, r.prefix_cache_queries) {
        (Some(h), Some(q)) if q > 0 => Some(format_rate(h.min(q), q)),
        _ => None,
    }
}

fn replica_row(r: &ReplicaSnapshot) -> ReplicaCacheStatus {
    ReplicaCacheStatus {
        id: r.replica.clone(),
        tenant: r.tenant.clone(),
        backend: (!r.backend.is_empty()).then(|| r.backend.clone()),
        model: (!r.model.is_empty()).then(|| r.model.clone()),
        prefix_count: count(r.prefix_count),
        cache_memory_bytes: r
            .cache_memory_bytes
            .map(|b| i64::try_from(b).unwrap_or(i64::MAX)),
        hit_rate: hit_rate(r),
        last_event_at: (r.last_event_unix_ms > 0)
            .then(|| Timestamp::from_millisecond(r.last_event_unix_ms).ok())
            .flatten()
            .map(to_time),
        coverage: Some(r.coverage.to_string()),
        coverage_reason: r.coverage_reason.map(str::to_string),
    }
}

/// The status without `lastUpdated` and condition times, for change detection.
fn content(s: &CacheIndexStatus) -> CacheIndexStatus {
    let mut c = s.clone();
    c.last_updated = None;
    for cond in &mut c.conditions {
        cond.last_transition_time = Time(Timestamp::UNIX_EPOCH);
    }
    c
}

/// The whole CacheIndex status for `agg`, carrying `prior`'s condition transition times and
/// `lastUpdated` when nothing changed (module docs).
pub fn desired_status(
    agg: &IndexAggregate,
    prior: Option<&CacheIndexStatus>,
    now: Time,
) -> CacheIndexStatus {
    let snap = &agg.snapshot;
    let mut rows: Vec<ReplicaCacheStatus> = snap.replicas.iter().map(replica_row).collect();
    rows.sort_by(|a, b| (&a.tenant, &a.id).cmp(&(&b.tenant, &b.id)));
    // Rows with the same (tenant, id) would break the list-map key: keep the first.
    rows.dedup_by(|b, a| a.tenant == b.tenant && a.id == b.id);
    let total_replicas = rows.len();
    let mut bytes = 0usize;
    let fit = rows
        .iter()
        .take(MAX_REPLICA_ROWS)
        .take_while(|r| {
            bytes += serde_json::to_vec(r).map_or(usize::MAX / 2, |v| v.len() + 1);
            bytes <= MAX_REPLICA_BYTES
        })
        .count();
    rows.truncate(fit);

    let mut tenants: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
    for (t, n) in &agg.blocks_by_tenant {
        tenants.entry(t.as_str()).or_default().0 = *n;
    }
    for r in &snap.replicas {
        let e = tenants.entry(r.tenant.as_str()).or_default();
        if let (Some(h), Some(q)) = (r.prefix_cache_hits, r.prefix_cache_queries) {
            e.1 = e.1.saturating_add(h.min(q));
            e.2 = e.2.saturating_add(q);
        }
    }
    let tenants: Vec<TenantCacheStatus> = tenants
        .into_iter()
        .map(|(id, (entries, hits, queries))| TenantCacheStatus {
            id: id.to_string(),
            index_entries: count(entries),
            hit_rate: (queries > 0).then(|| format_rate(hits, queries)),
            memory_used: 0,
        })
        .collect();

    let mut conditions = prior.map(|p| p.conditions.clone()).unwrap_or_default();
    let complete = if total_replicas > rows.len() {
        new_condition(
            index_condition::COMPLETE,
            ConditionStatus::False,
            reason::REPLICAS_TRUNCATED,
            format!(
                "{total_replicas} replicas report; status.replicas lists the first {} by \
                 (tenant, id). The controller's /snapshot lists them all.",
                rows.len()
            ),
            None,
            now.clone(),
        )
    } else {
        new_condition(
            index_condition::COMPLETE,
            ConditionStatus::True,
            reason::ALL_REPLICAS,
            "status.replicas lists every reporting replica.",
            None,
            now.clone(),
        )
    };
    set_condition(&mut conditions, complete);
    let mut inexact: BTreeMap<&str, usize> = BTreeMap::new();
    for r in snap.replicas.iter().filter(|r| r.coverage != "Exact") {
        *inexact.entry(r.coverage).or_default() += 1;
    }
    let exact = if inexact.is_empty() {
        new_condition(
            index_condition::EXACT,
            ConditionStatus::True,
            reason::ALL_REPLICAS_EXACT,
            "The index holds exactly what every reporting engine holds.",
            None,
            now.clone(),
        )
    } else {
        let by_state: Vec<String> = inexact.iter().map(|(s, n)| format!("{n} {s}")).collect();
        new_condition(
            index_condition::EXACT,
            ConditionStatus::False,
            reason::INEXACT_REPLICAS,
            format!(
                "{} of {total_replicas} replicas are not exact ({}); see status.replicas[].\
                 coverage and coverageReason, and docs/kv-events.md \"Coverage\".",
                inexact.values().sum::<usize>(),
                by_state.join(", ")
            ),
            None,
            now.clone(),
        )
    };
    set_condition(&mut conditions, exact);

    let mut status = CacheIndexStatus {
        replicas: rows,
        replica_count: i32::try_from(total_replicas).unwrap_or(i32::MAX),
        tenants,
        prefixes: PrefixSummary {
            total: count(snap.blocks),
            t1: count(agg.blocks_by_tier.0),
            t2: count(agg.blocks_by_tier.1),
        },
        observed_server: Some(OBSERVED_IN_PROCESS.to_string()),
        last_updated: None,
        conditions,
    };
    status.last_updated = match prior {
        Some(p) if content(p) == content(&status) => p.last_updated.clone(),
        _ => Some(now),
    };
    status
}

/// Writes the CacheIndex (the leader's job).
///
/// Every pass that is [`Self::due`] reads the stored object (one GET per `min_interval`) rather
/// than trusting what this writer last wrote: after a leadership hand-over the other replica may
/// have written since, and a cached copy would call a stale object `Unchanged` for as long as the
/// index stays the same. The write is a merge patch that carries the resourceVersion of that
/// read, so a status computed from a read that another writer has overtaken is refused by the
/// API server (409) instead of overwriting the newer one ([`SyncOutcome::Conflict`]).
pub struct CacheIndexWriter {
    api: Api<CacheIndex>,
    min_interval: Duration,
    last_write: Option<Timestamp>,
    last_check: Option<Timestamp>,
}

/// What one [`CacheIndexWriter::sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncOutcome {
    /// The status was written.
    Written,
    /// The stored status is already current.
    Unchanged,
    /// Changed, but the last write was less than `min_interval` ago.
    RateLimited,
    /// Another writer changed the object between this pass's read and its write (HTTP 409 on
    /// the resourceVersion precondition): nothing was written; the next pass reads again.
    Conflict,
}

/// The merge patch that replaces the whole status with `desired`, conditional on the object
/// still being at `resource_version` (the API server answers 409 otherwise). Absent optional
/// fields become `null`, so they are removed from the stored object too.
///
/// # Errors
/// Serializing `desired` (not expected for this type).
pub fn status_patch(
    desired: &CacheIndexStatus,
    resource_version: Option<&str>,
) -> Result<serde_json::Value, serde_json::Error> {
    let mut body = serde_json::to_value(desired)?;
    if let serde_json::Value::Object(m) = &mut body {
        for k in [
            "replicas",
            "tenants",
            "observedServer",
            "lastUpdated",
            "conditions",
        ] {
            m.entry(k.to_string()).or_insert(serde_json::Value::Null);
        }
    }
    let mut patch = serde_json::json!({ "status": body });
    if let Some(rv) = resource_version {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    Ok(patch)
}

impl CacheIndexWriter {
    /// A writer that writes at most once per `min_interval`.
    pub fn new(client: Client, min_interval: Duration) -> Self {
        CacheIndexWriter {
            api: Api::all(client),
            min_interval,
            last_write: None,
            last_check: None,
        }
    }

    /// Whether a [`Self::sync`] now could write: nothing checked for `min_interval`. The loop
    /// builds the aggregate (a walk of every block) only then.
    pub fn due(&self, now: Timestamp) -> bool {
        self.last_check
            .is_none_or(|t| now.duration_since(t).as_secs_f64() >= self.min_interval.as_secs_f64())
    }

    /// Forgets when it last checked and wrote (on gaining leadership: check at once).
    pub fn reset(&mut self) {
        self.last_write = None;
        self.last_check = None;
    }

    /// The stored object, created (with no status) when missing.
    async fn read_or_create(&self) -> Result<CacheIndex, kube::Error> {
        if let Some(o) = self.api.get_opt(CACHE_INDEX_NAME).await? {
            return Ok(o);
        }
        let obj = CacheIndex::new(CACHE_INDEX_NAME, CacheIndexSpec {});
        match self.api.create(&PostParams::default(), &obj).await {
            Ok(o) => Ok(o),
            // Created by another writer meanwhile: read theirs.
            Err(kube::Error::Api(e)) if e.code == 409 => self.api.get(CACHE_INDEX_NAME).await,
            Err(e) => Err(e),
        }
    }

    /// Brings the CacheIndex up to date with `agg` (subject to the rate limit); creates it when
    /// missing.
    ///
    /// # Errors
    /// The API's (other than the 409 of [`SyncOutcome::Conflict`]); the next call reads again.
    pub async fn sync(
        &mut self,
        agg: &IndexAggregate,
        now: Timestamp,
    ) -> Result<SyncOutcome, kube::Error> {
        let stored = self.read_or_create().await?;
        self.last_check = Some(now);
        let current = stored.status.as_ref();
        let desired = desired_status(agg, current, to_time(now));
        if current == Some(&desired) {
            return Ok(SyncOutcome::Unchanged);
        }
        if let Some(last) = self.last_write {
            let since = now.duration_since(last);
            if since.as_secs_f64() < self.min_interval.as_secs_f64() {
                return Ok(SyncOutcome::RateLimited);
            }
        }
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        let patch = status_patch(&desired, stored.metadata.resource_version.as_deref())
            .map_err(kube::Error::SerdeError)?;
        match self
            .api
            .patch_status(CACHE_INDEX_NAME, &params, &Patch::Merge(patch))
            .await
        {
            Ok(_) => {
                self.last_write = Some(now);
                Ok(SyncOutcome::Written)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(SyncOutcome::Conflict),
            Err(e) => Err(e),
        }
    }
}

/// The leader-only loop: every `interval` it wakes, and once per `min_interval` it reads the
/// index and runs [`CacheIndexWriter::sync`] (a write only when changed), and the CacheTenant
/// statuses from the same aggregate ([`super::tenants::sync_tenants`]). Followers write
/// nothing.
pub fn spawn_writer(
    client: Client,
    shared: Arc<Shared>,
    leader: LeaderHandle,
    clock: Arc<dyn Clock>,
    interval: Duration,
    min_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut writer = CacheIndexWriter::new(client.clone(), min_interval);
        let mut was_leader = false;
        loop {
            let is_leader = leader.is_leader();
            if is_leader && !was_leader {
                writer.reset();
            }
            was_leader = is_leader;
            let now = clock.now();
            if is_leader && writer.due(now) {
                let agg = IndexAggregate::of(&shared.index.read());
                match writer.sync(&agg, now).await {
                    Ok(SyncOutcome::Conflict) => warn!(
                        "the CacheIndex changed between read and write (another writer); \
                         nothing written, reading again next pass"
                    ),
                    Ok(_) => {}
                    Err(e) => {
                        warn!(error = %e, "writing the CacheIndex status failed; retrying next pass")
                    }
                }
                if let Err(e) = super::tenants::sync_tenants(&client, &agg, to_time(now)).await {
                    warn!(error = %e, "listing CacheTenants failed; retrying later");
                }
            }
            let stop = tokio::select! {
                _ = tokio::time::sleep(interval) => false,
                r = shutdown.changed() => r.is_err() || *shutdown.borrow(),
            };
            if stop {
                break;
            }
        }
    })
}
