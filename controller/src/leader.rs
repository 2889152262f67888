//! Lease-based leader election (`coordination.k8s.io/v1` Lease; DESIGN.md "Two binaries": the
//! controller is a leader-elected Deployment).
//!
//! Every replica serves reads (router, `/snapshot`, `/v1/nodes`, agent streams and node plans);
//! only the holder of the Lease writes status (CacheNode, the CacheBackend advisory condition,
//! the reconcilers' status, Events and child objects).
//!
//! The election is split as STYLE.md asks ("pure decisions, effectful edges"):
//!
//! - [`Elector`] is a pure state machine over an injected time: it is told what the Lease looks
//!   like ([`Elector::observe`]) and answers what to write ([`Elector::next_step`]). It follows
//!   client-go's rules: another holder's lease counts as expired only when the record has not
//!   changed for `leaseDurationSeconds` *as measured on our own clock since we first saw that
//!   record* (so clock skew between replicas does not matter); an empty holder means the lease
//!   was released and may be taken at once; a holder that failed to renew for `renew_deadline`
//!   stops acting as leader ([`Elector::is_leader`]) before anyone else may take over
//!   (`renew_deadline` < `lease_duration`).
//! - [`LeaseLock`] is the thin kube layer: read, create, and replace with the observed
//!   `resourceVersion` (a concurrent writer gets 409 and simply loses this round). A replace
//!   keeps the labels, annotations and owner references it read: the chart creates the Lease
//!   (so that `helm uninstall` deletes it) and Helm's ownership metadata must survive renewals.
//! - [`spawn`] runs attempts every `retry_period`, publishes leadership through a
//!   [`LeaderHandle`], and releases the Lease on shutdown so a successor need not wait.
//!
//! Written here rather than taken from a crate (issue 42 item 4): `kube-lease-manager` 0.13.1,
//! the maintained one on kube 5, keeps a cut-off leader's leadership `true` indefinitely (no
//! renew deadline), clears an expired holder with a patch that carries no `resourceVersion`,
//! and needs PATCH on the Lease; docs/architecture.md "Not yet done" gives the run that showed it.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::Client;
use prometheus::{IntCounter, IntGauge, Registry};
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::reconcile::clock::Clock;

/// Default `leaseDurationSeconds` (client-go's default).
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// Default renew deadline: a leader that could not renew for this long stops writing.
pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Default pause between attempts.
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);

/// Election timing and identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionConfig {
    /// This replica's identity, written as `holderIdentity` (unique per process).
    pub identity: String,
    /// How long a lease is valid after its last renewal, as seen by the other candidates.
    pub lease_duration: Duration,
    /// How long the holder keeps acting as leader without a successful renewal. Must be
    /// shorter than `lease_duration`.
    pub renew_deadline: Duration,
    /// Pause between attempts.
    pub retry_period: Duration,
}

impl ElectionConfig {
    /// The defaults (15 s lease, 10 s renew deadline, 2 s retry) for `identity`.
    pub fn new(identity: impl Into<String>) -> Self {
        ElectionConfig {
            identity: identity.into(),
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_deadline: DEFAULT_RENEW_DEADLINE,
            retry_period: DEFAULT_RETRY_PERIOD,
        }
    }
}

/// The election-relevant part of a Lease's spec.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    /// `holderIdentity`; `None` (or empty) when released.
    pub holder: Option<String>,
    /// `leaseDurationSeconds`.
    pub lease_duration_seconds: i32,
    /// `acquireTime`.
    pub acquire_time: Option<Timestamp>,
    /// `renewTime`.
    pub renew_time: Option<Timestamp>,
    /// `leaseTransitions`.
    pub transitions: i32,
}

impl LeaseRecord {
    /// Reads the record from a Lease spec (absent fields read as empty / zero).
    pub fn from_spec(spec: Option<&LeaseSpec>) -> Self {
        let Some(s) = spec else {
            return LeaseRecord::default();
        };
        LeaseRecord {
            holder: s.holder_identity.clone().filter(|h| !h.is_empty()),
            lease_duration_seconds: s.lease_duration_seconds.unwrap_or(0),
            acquire_time: s.acquire_time.as_ref().map(|t| t.0),
            renew_time: s.renew_time.as_ref().map(|t| t.0),
            transitions: s.lease_transitions.unwrap_or(0),
        }
    }

    /// The Lease spec carrying this record.
    pub fn to_spec(&self) -> LeaseSpec {
        LeaseSpec {
            holder_identity: self.holder.clone(),
            lease_duration_seconds: Some(self.lease_duration_seconds),
            acquire_time: self.acquire_time.map(MicroTime),
            renew_time: self.renew_time.map(MicroTime),
            lease_transitions: Some(self.transitions),
            ..Default::default()
        }
    }

    /// The holder, if the lease is held.
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_deref().filter(|h| !h.is_empty())
    }
}

/// What an attempt should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No Lease exists: create it with this record.
    Create(LeaseRecord),
    /// Replace the observed Lease with this record (renewal, takeover of an expired or
    /// released lease).
    Update(LeaseRecord),
    /// Another candidate holds a valid lease.
    Follow {
        /// The current holder.
        holder: String,
        /// When, on our clock, the lease expires unless it is renewed.
        until: Timestamp,
    },
}

/// The election state machine of one candidate. Pure: every method takes the current time.
#[derive(Debug, Clone)]
pub struct Elector {
    cfg: ElectionConfig,
    observed: Option<LeaseRecord>,
    /// Our time when `observed` was first seen in its current form.
    observed_at: Option<Timestamp>,
    /// Our time of the last successful create/renew by us.
    renewed_at: Option<Timestamp>,
}

fn add(at: Timestamp, d: Duration) -> Timestamp {
    let step = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    at.checked_add(step).unwrap_or(Timestamp::MAX)
}

impl Elector {
    /// A candidate that has seen nothing yet.
    pub fn new(cfg: ElectionConfig) -> Self {
        Elector {
            cfg,
            observed: None,
            observed_at: None,
            renewed_at: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ElectionConfig {
        &self.cfg
    }

    /// Records the Lease as just read (`None`: it does not exist). The observation time moves
    /// only when the record changed, which is what expiry is measured from.
    pub fn observe(&mut self, current: Option<&LeaseRecord>, now: Timestamp) {
        if self.observed.as_ref() != current || self.observed_at.is_none() {
            self.observed = current.cloned();
            self.observed_at = Some(now);
        }
    }

    fn lease_secs(&self) -> i32 {
        i32::try_from(self.cfg.lease_duration.as_secs())
            .unwrap_or(i32::MAX)
            .max(1)
    }

    fn fresh(&self, now: Timestamp, transitions: i32) -> LeaseRecord {
        LeaseRecord {
            holder: Some(self.cfg.identity.clone()),
            lease_duration_seconds: self.lease_secs(),
            acquire_time: Some(now),
            renew_time: Some(now),
            transitions,
        }
    }

    /// What to write now, given the last observation.
    pub fn next_step(&self, now: Timestamp) -> Step {
        // The API stores MicroTime: keep what we write equal to what we read back.
        let now = Timestamp::from_microsecond(now.as_microsecond()).unwrap_or(now);
        let Some(rec) = &self.observed else {
            return Step::Create(self.fresh(now, 0));
        };
        match rec.holder() {
            Some(h) if h == self.cfg.identity => Step::Update(LeaseRecord {
                holder: Some(self.cfg.identity.clone()),
                lease_duration_seconds: self.lease_secs(),
                acquire_time: rec.acquire_time.or(Some(now)),
                renew_time: Some(now),
                transitions: rec.transitions,
            }),
            Some(h) => {
                let secs = if rec.lease_duration_seconds > 0 {
                    rec.lease_duration_seconds
                } else {
                    self.lease_secs()
                };
                let seen = self.observed_at.unwrap_or(now);
                let until = add(seen, Duration::from_secs(secs.unsigned_abs().into()));
                if now < until {
                    Step::Follow {
                        holder: h.to_string(),
                        until,
                    }
                } else {
                    Step::Update(self.fresh(now, rec.transitions.saturating_add(1)))
                }
            }
            None => Step::Update(self.fresh(now, rec.transitions.saturating_add(1))),
        }
    }

    /// Records a successful create/replace of `written` at `now`.
    pub fn succeeded(&mut self, written: LeaseRecord, now: Timestamp) {
        self.observed = Some(written);
        self.observed_at = Some(now);
        self.renewed_at = Some(now);
    }

    /// True while we hold the lease and renewed it within the renew deadline.
    pub fn is_leader(&self, now: Timestamp) -> bool {
        let holds = self
            .observed
            .as_ref()
            .and_then(|r| r.holder())
            .is_some_and(|h| h == self.cfg.identity);
        holds
            && self
                .renewed_at
                .is_some_and(|t| now < add(t, self.cfg.renew_deadline))
    }

    /// The current holder as last observed.
    pub fn holder(&self) -> Option<&str> {
        self.observed.as_ref().and_then(|r| r.holder())
    }

    /// The record that releases our lease (holder cleared, 1 s duration), or `None` when we
    /// do not hold it.
    pub fn release_record(&self, now: Timestamp) -> Option<LeaseRecord> {
        let rec = self.observed.as_ref()?;
        if rec.holder() != Some(self.cfg.identity.as_str()) {
            return None;
        }
        Some(LeaseRecord {
            holder: None,
            lease_duration_seconds: 1,
            acquire_time: rec.acquire_time,
            renew_time: Some(now),
            transitions: rec.transitions,
        })
    }

    /// Forgets our leadership (after a release or on shutdown).
    pub fn stepped_down(&mut self) {
        self.renewed_at = None;
    }
}

/// Errors of the kube layer.
#[derive(Debug, Error)]
pub enum LeaderError {
    /// Reading or writing the Lease failed (other than a lost race).
    #[error("Lease {namespace}/{name}: {source}")]
    Api {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// The API error.
        source: kube::Error,
    },
}

/// The Lease object an election runs on.
#[derive(Clone)]
pub struct LeaseLock {
    api: Api<Lease>,
    namespace: String,
    name: String,
    /// Labels, annotations and owner references of the last read, written back by `replace`.
    kept: Arc<std::sync::Mutex<ObjectMeta>>,
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl LeaseLock {
    /// The Lease `namespace/name`.
    pub fn new(client: Client, namespace: &str, name: &str) -> Self {
        LeaseLock {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
            kept: Arc::default(),
        }
    }

    fn err(&self, source: kube::Error) -> LeaderError {
        LeaderError::Api {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            source,
        }
    }

    /// The Lease's record and `resourceVersion`, or `None` when it does not exist.
    pub async fn read(&self) -> Result<Option<(LeaseRecord, Option<String>)>, LeaderError> {
        let lease = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.err(e))?;
        if let Some(l) = &lease {
            let meta = ObjectMeta {
                labels: l.metadata.labels.clone(),
                annotations: l.metadata.annotations.clone(),
                owner_references: l.metadata.owner_references.clone(),
                ..Default::default()
            };
            if let Ok(mut kept) = self.kept.lock() {
                *kept = meta;
            }
        }
        Ok(lease.map(|l| {
            (
                LeaseRecord::from_spec(l.spec.as_ref()),
                l.metadata.resource_version,
            )
        }))
    }

    fn object(&self, rec: &LeaseRecord, resource_version: Option<String>) -> Lease {
        let kept = match (&resource_version, self.kept.lock()) {
            (Some(_), Ok(k)) => k.clone(),
            _ => ObjectMeta::default(),
        };
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                resource_version,
                ..kept
            },
            spec: Some(rec.to_spec()),
        }
    }

    /// Creates the Lease. `Ok(false)` when another candidate created it first (409).
    pub async fn create(&self, rec: &LeaseRecord) -> Result<bool, LeaderError> {
        match self
            .api
            .create(&PostParams::default(), &self.object(rec, None))
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Ok(false),
            Err(e) => Err(self.err(e)),
        }
    }

    /// Replaces the Lease, expecting `resource_version`. `Ok(false)` when it changed in the
    /// meantime (409).
    pub async fn replace(
        &self,
        rec: &LeaseRecord,
        resource_version: Option<String>,
    ) -> Result<bool, LeaderError> {
        match self
            .api
            .replace(
                &self.name,
                &PostParams::default(),
                &self.object(rec, resource_version),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Ok(false),
            Err(e) => Err(self.err(e)),
        }
    }
}

/// One election round: read the Lease, decide, write. Returns whether we lead afterwards.
/// An API error leaves the elector as it was (leadership then lapses after the renew
/// deadline).
pub async fn attempt(
    elector: &mut Elector,
    lock: &LeaseLock,
    clock: &dyn Clock,
) -> Result<bool, LeaderError> {
    let now = clock.now();
    let current = lock.read().await?;
    let rv = current.as_ref().and_then(|c| c.1.clone());
    elector.observe(current.as_ref().map(|c| &c.0), now);
    match elector.next_step(now) {
        Step::Follow { .. } => {}
        Step::Create(rec) => {
            if lock.create(&rec).await? {
                elector.succeeded(rec, now);
            }
        }
        Step::Update(rec) => {
            if lock.replace(&rec, rv).await? {
                elector.succeeded(rec, now);
            }
        }
    }
    Ok(elector.is_leader(clock.now()))
}

/// Releases the lease if we hold it (holder cleared), so a successor need not wait for expiry.
pub async fn release(
    elector: &mut Elector,
    lock: &LeaseLock,
    clock: &dyn Clock,
) -> Result<(), LeaderError> {
    let now = clock.now();
    let current = lock.read().await?;
    let rv = current.as_ref().and_then(|c| c.1.clone());
    elector.observe(current.as_ref().map(|c| &c.0), now);
    if let Some(rec) = elector.release_record(now) {
        lock.replace(&rec, rv).await?;
    }
    elector.stepped_down();
    Ok(())
}

/// Whether this replica currently leads. Cheap to clone.
#[derive(Clone, Debug)]
pub struct LeaderHandle {
    rx: watch::Receiver<bool>,
    // Keeps a fixed handle's channel open.
    _fixed: Option<Arc<watch::Sender<bool>>>,
}

impl LeaderHandle {
    /// A handle fed by `rx`.
    pub fn new(rx: watch::Receiver<bool>) -> Self {
        LeaderHandle { rx, _fixed: None }
    }

    /// A handle that always answers `leader` (tests; single-writer setups without election).
    pub fn fixed(leader: bool) -> Self {
        let (tx, rx) = watch::channel(leader);
        LeaderHandle {
            rx,
            _fixed: Some(Arc::new(tx)),
        }
    }

    /// True while this replica holds the Lease.
    pub fn is_leader(&self) -> bool {
        *self.rx.borrow()
    }

    /// A receiver that changes when leadership does.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }
}

/// Election metrics (`inferencecache_controller_leader…`).
#[derive(Clone)]
pub struct LeaderMetrics {
    /// 1 while this replica leads.
    pub is_leader: IntGauge,
    /// Times this replica became leader.
    pub acquired_total: IntCounter,
}

impl LeaderMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let is_leader = IntGauge::new(
            "inferencecache_controller_leader",
            "1 while this controller replica holds the leader-election Lease, else 0.",
        )?;
        let acquired_total = IntCounter::new(
            "inferencecache_controller_leader_acquired_total",
            "Times this controller replica became the leader.",
        )?;
        registry.register(Box::new(is_leader.clone()))?;
        registry.register(Box::new(acquired_total.clone()))?;
        Ok(LeaderMetrics {
            is_leader,
            acquired_total,
        })
    }
}

/// A running election.
pub struct Election {
    /// Leadership as it changes.
    pub handle: LeaderHandle,
    /// The election task; it ends (after releasing the Lease) once `shutdown` fires.
    pub task: JoinHandle<()>,
}

/// Starts the election loop: an attempt every `retry_period` until `shutdown` turns true, then
/// a release.
pub fn spawn(
    lock: LeaseLock,
    cfg: ElectionConfig,
    clock: Arc<dyn Clock>,
    metrics: Option<LeaderMetrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Election {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let retry = cfg.retry_period;
        let mut elector = Elector::new(cfg);
        loop {
            let leading = match attempt(&mut elector, &lock, clock.as_ref()).await {
                Ok(l) => l,
                Err(e) => {
                    warn!(error = %e, "leader election attempt failed");
                    elector.is_leader(clock.now())
                }
            };
            let was = *tx.borrow();
            if leading != was {
                if leading {
                    info!(identity = %elector.config().identity, "became the leader: this replica now writes status");
                    if let Some(m) = &metrics {
                        m.acquired_total.inc();
                    }
                } else {
                    info!(identity = %elector.config().identity, holder = ?elector.holder(), "not the leader: this replica only serves reads");
                }
                tx.send_replace(leading);
            }
            if let Some(m) = &metrics {
                m.is_leader.set(i64::from(leading));
            }
            let stop = tokio::select! {
                _ = tokio::time::sleep(retry) => false,
                _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => true,
            };
            if stop {
                break;
            }
        }
        tx.send_replace(false);
        if let Some(m) = &metrics {
            m.is_leader.set(0);
        }
        if let Err(e) = release(&mut elector, &lock, clock.as_ref()).await {
            warn!(error = %e, "could not release the leader-election Lease");
        }
    });
    Election {
        handle: LeaderHandle::new(rx),
        task,
    }
}

/// A process-unique identity: `base` (the pod name) plus a random-ish suffix, so that a
/// restarted container with the same pod name is a new candidate.
pub fn unique_identity(base: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{base}_{:08x}{:04x}", nanos, std::process::id() & 0xffff)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn no_lease_means_create() {
        let e = Elector::new(ElectionConfig::new("a"));
        match e.next_step(at(100)) {
            Step::Create(r) => {
                assert_eq!(r.holder(), Some("a"));
                assert_eq!(r.transitions, 0);
                assert_eq!(r.lease_duration_seconds, 15);
            }
            s => panic!("{s:?}"),
        }
    }
}
