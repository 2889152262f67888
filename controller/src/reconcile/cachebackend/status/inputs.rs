//! What the status machine is given: its cadences ([`Settings`]), what one reconcile observed
//! ([`Observed`], with the owned workload read into a [`WorkloadState`]) and the in-process
//! memory of earlier reconciles ([`Memory`]).

use std::collections::BTreeMap;
use std::time::Duration;

use ic_shared::crd::{CacheBackend, DeploymentKind};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use crate::reconcile::cachebackend::index_view::{IndexUnavailable, ReplicaObservation};
use crate::reconcile::cachebackend::path::PathKind;

/// Cadences and rate limits of the status machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Steady requeue cadence (spec: 30 s).
    pub steady_requeue: Duration,
    /// Requeue cadence while matched engine pods differ from the desired replica sum (5 s).
    pub churn_requeue: Duration,
    /// Functional-probe rate-limit window per backend (~30 s).
    pub probe_interval: Duration,
    /// Minimum interval between two cascades of one backend (~30 s).
    pub cascade_min_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            steady_requeue: Duration::from_secs(30),
            churn_requeue: Duration::from_secs(5),
            probe_interval: Duration::from_secs(30),
            cascade_min_interval: Duration::from_secs(30),
        }
    }
}

/// The observed state of the owned workload, kind-neutral.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkloadState {
    /// Deployment or StatefulSet.
    pub kind: DeploymentKind,
    /// Object name.
    pub name: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// `status.observedGeneration`.
    pub observed_generation: i64,
    /// `spec.replicas` (1 when unset, as the API server defaults it).
    pub spec_replicas: i32,
    /// `status.replicas` (pods of every revision).
    pub replicas: i32,
    /// `status.updatedReplicas`.
    pub updated_replicas: i32,
    /// `status.readyReplicas`.
    pub ready_replicas: i32,
    /// `status.availableReplicas`.
    pub available_replicas: i32,
    /// Deployment `Progressing` reason `NewReplicaSetAvailable`: the last rollout completed.
    pub rollout_completed: bool,
    /// Deployment `Progressing` reason `ProgressDeadlineExceeded`: the rollout is stuck.
    pub progress_deadline_exceeded: bool,
    /// Pods the workload may have unavailable and still be Available, as the Deployment
    /// controller reads it: `spec.strategy.rollingUpdate.maxUnavailable` resolved against the
    /// desired replicas (default 25 %, rounded down; 0 for `Recreate` and StatefulSets).
    pub max_unavailable: i32,
}

/// `maxUnavailable` (an int or a percentage, default `25%`) resolved against `desired`, rounded
/// down as the Deployment controller does.
pub fn resolve_max_unavailable(
    v: Option<&k8s_openapi::apimachinery::pkg::util::intstr::IntOrString>,
    desired: i32,
) -> i32 {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let n = match v {
        Some(IntOrString::Int(n)) => *n,
        Some(IntOrString::String(s)) => match s.trim().strip_suffix('%').map(str::parse::<i64>) {
            Some(Ok(p)) => (i64::from(desired.max(0)) * p.clamp(0, 100) / 100) as i32,
            _ => 0,
        },
        None => desired.max(0) / 4,
    };
    n.clamp(0, desired.max(0))
}

impl WorkloadState {
    /// From a live Deployment.
    pub fn from_deployment(d: &Deployment) -> Self {
        let st = d.status.clone().unwrap_or_default();
        let progressing = st
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "Progressing")
            .and_then(|c| c.reason.clone());
        WorkloadState {
            kind: DeploymentKind::Deployment,
            name: d.metadata.name.clone().unwrap_or_default(),
            generation: d.metadata.generation.unwrap_or(0),
            observed_generation: st.observed_generation.unwrap_or(0),
            spec_replicas: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
            replicas: st.replicas.unwrap_or(0),
            updated_replicas: st.updated_replicas.unwrap_or(0),
            ready_replicas: st.ready_replicas.unwrap_or(0),
            available_replicas: st.available_replicas.unwrap_or(0),
            rollout_completed: progressing.as_deref() == Some("NewReplicaSetAvailable"),
            progress_deadline_exceeded: progressing.as_deref() == Some("ProgressDeadlineExceeded"),
            max_unavailable: {
                let spec = d.spec.as_ref();
                let desired = spec.and_then(|s| s.replicas).unwrap_or(1);
                match spec.and_then(|s| s.strategy.as_ref()) {
                    Some(st) if st.type_.as_deref() == Some("Recreate") => 0,
                    st => resolve_max_unavailable(
                        st.and_then(|s| s.rolling_update.as_ref())
                            .and_then(|r| r.max_unavailable.as_ref()),
                        desired,
                    ),
                }
            },
        }
    }

    /// From a live StatefulSet (no Progressing condition: completion comes from the revisions).
    pub fn from_statefulset(s: &StatefulSet) -> Self {
        let st = s.status.clone().unwrap_or_default();
        WorkloadState {
            kind: DeploymentKind::StatefulSet,
            name: s.metadata.name.clone().unwrap_or_default(),
            generation: s.metadata.generation.unwrap_or(0),
            observed_generation: st.observed_generation.unwrap_or(0),
            spec_replicas: s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
            replicas: st.replicas,
            updated_replicas: st.updated_replicas.unwrap_or(0),
            ready_replicas: st.ready_replicas.unwrap_or(0),
            available_replicas: st.available_replicas.unwrap_or(0),
            rollout_completed: st.current_revision.is_some()
                && st.current_revision == st.update_revision,
            progress_deadline_exceeded: false,
            max_unavailable: 0,
        }
    }
}

/// Everything one reconcile observed. Owned data so tests can build it by hand.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The live CacheBackend (its `status` is the prior status).
    pub backend: CacheBackend,
    /// Clock reading for this reconcile.
    pub now: Timestamp,
    /// The owned workload of the desired kind, when it exists (Managed only).
    pub workload: Option<WorkloadState>,
    /// Whether any owned workload existed when the reconcile started (before shedding).
    pub owned_workload_present: bool,
    /// `status.endpoint` of a Managed backend: the rendered Service's address.
    pub service_endpoint: Option<String>,
    /// Labels selecting the managed cache-server pods (Managed only).
    pub server_selector: Option<BTreeMap<String, String>>,
    /// Cache-server container names on the owned pod template.
    pub server_containers: Vec<String>,
    /// Pods of the backend's namespace; `None` when the list failed.
    pub pods: Option<Vec<Pod>>,
    /// Deployments of the namespace; `None` when the list failed.
    pub deployments: Option<Vec<Deployment>>,
    /// CacheBackends of the namespace (for index attribution); `None` when the list failed.
    pub backends: Option<Vec<CacheBackend>>,
    /// The index's replicas, or why it could not be read.
    pub index: Result<Vec<ReplicaObservation>, IndexUnavailable>,
    /// Whether the controller runs the functional-probe gate (a prober is wired).
    pub probe_enabled: bool,
}

impl Observed {
    /// A minimal observation of `backend` at `now`: nothing owned, no pods, empty index.
    pub fn new(backend: CacheBackend, now: Timestamp) -> Self {
        Observed {
            backend,
            now,
            workload: None,
            owned_workload_present: false,
            service_endpoint: None,
            server_selector: None,
            server_containers: Vec::new(),
            pods: Some(Vec::new()),
            deployments: Some(Vec::new()),
            backends: Some(Vec::new()),
            index: Ok(Vec::new()),
            probe_enabled: false,
        }
    }
}

/// In-process memory of earlier reconciles of one backend (lost on restart; the durable
/// parts of the state machine live in `status`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// The path of the last successful reconcile.
    pub last_path: Option<PathKind>,
    /// When the functional probe last ran.
    pub last_probe_at: Option<Timestamp>,
    /// When the last cascade restart ran.
    pub last_cascade_at: Option<Timestamp>,
}
