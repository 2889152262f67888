//! Shared fixtures of the `reconcile_*` integration tests: CacheBackends, engine and server
//! pods, index replicas (pure values in namespace [`NS`]), and [`Harness`]: the CacheBackend
//! reconciler over the bare real apiserver of `bare_apiserver_support` (etcd + kube-apiserver,
//! the chart's CRDs, RBAC and admission policies; no controller-manager, kubelet, controller or
//! webhook). Each harness works in a fresh namespace of its own ([`Harness::ns`]): fixtures are
//! moved into it when the harness creates them. Nothing else writes to that API, so tests call
//! `reconcile` directly and play the Deployment controller and the kubelet by writing `status`
//! through the status subresource.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use ic_controller::reconcile::cachebackend::events::RecordingEventSink;
use ic_controller::reconcile::cachebackend::index_view::{FakeIndex, ReplicaObservation};
use ic_controller::reconcile::cachebackend::probe::FakeProber;
use ic_controller::reconcile::cachebackend::status::Settings;
use ic_controller::reconcile::clock::FakeClock;
use ic_controller::reconcile::{reconcile, Context};
use ic_shared::crd::{find_condition, CacheBackend, CacheBackendStatus};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

/// The bare real apiserver harness (`tests/bare_apiserver_support/`): [`bare::BareCluster`],
/// [`bare::Faults`] and [`bare::Step`] for injected faults and the request record.
#[path = "../bare_apiserver_support/mod.rs"]
pub mod bare;

use bare::{create_with_status, BareCluster, Faults};

/// Namespace of every fixture (a [`Harness`] moves what it creates into its own namespace).
pub const NS: &str = "ml";
/// Start of the fake clock (2026-01-01T00:00:00Z).
pub const T0: i64 = 1_767_225_600;

/// A CacheBackend `name` in [`NS`] with `spec` (JSON), uid `uid-<name>`, generation 1.
pub fn backend(name: &str, spec: Value) -> CacheBackend {
    let mut cb: CacheBackend = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"), "generation": 1},
        "spec": spec,
    }))
    .unwrap();
    cb.status = None;
    cb
}

/// Sets an annotation on a CacheBackend.
pub fn annotate(mut cb: CacheBackend, key: &str, value: &str) -> CacheBackend {
    cb.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.to_string(), value.to_string());
    cb
}

/// A vLLM backend with a Managed Redis tier selecting `app=vllm` pods.
pub fn managed_redis(name: &str) -> CacheBackend {
    backend(
        name,
        json!({
            "runtime": "VLLM",
            "remoteStorage": {"provider": "Redis", "ownership": "Managed"},
            "engineSelector": {"matchLabels": {"app": "vllm"}},
            "observation": {"modelID": "Qwen/Qwen3", "firstEventTimeout": "5m"}
        }),
    )
}

/// A host-only vLLM backend selecting `app=vllm` pods.
pub fn host_only(name: &str) -> CacheBackend {
    backend(
        name,
        json!({
            "runtime": "VLLM",
            "engineSelector": {"matchLabels": {"app": "vllm"}},
            "observation": {"firstEventTimeout": "5m"}
        }),
    )
}

/// An events-only backend selecting `app=vllm` pods.
pub fn events_only(name: &str) -> CacheBackend {
    backend(
        name,
        json!({
            "runtime": "VLLM",
            "integration": {"mode": "EventsOnly"},
            "engineSelector": {"matchLabels": {"app": "vllm"}},
            "observation": {"modelID": "Qwen/Qwen3", "firstEventTimeout": "5m"}
        }),
    )
}

/// An External backend of `provider` with `endpoint`.
pub fn external(name: &str, provider: &str, endpoint: &str) -> CacheBackend {
    backend(
        name,
        json!({
            "runtime": "VLLM",
            "remoteStorage": {"provider": provider, "ownership": "External", "endpoint": endpoint},
        }),
    )
}

/// A pod named `name` in [`NS`] with labels, annotations and uid `uid-<name>`.
pub fn pod(name: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let annotations: BTreeMap<String, String> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                     "labels": labels, "annotations": annotations},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.9.1",
                                 "command": ["vllm", "serve", "facebook/opt-125m"]}]},
    }))
    .unwrap()
}

/// An engine pod `name` (label `app=vllm`) injected by `cb` (its namespace, [`NS`] when it has
/// none, and its uid), owned by the ReplicaSet of engine Deployment `deploy` (`<deploy>-abc123`,
/// pod-template-hash `abc123`).
pub fn injected_engine(name: &str, cb: &CacheBackend, deploy: &str) -> Pod {
    let by = format!(
        "{}/{}",
        cb.metadata.namespace.as_deref().unwrap_or(NS),
        cb.metadata.name.as_deref().unwrap()
    );
    let uid = cb.metadata.uid.clone().unwrap();
    let mut p = pod(
        name,
        &[("app", "vllm"), ("pod-template-hash", "abc123")],
        &[
            ("inferencecache.io/injected-by", by.as_str()),
            ("inferencecache.io/injected-by-uid", uid.as_str()),
        ],
    );
    p.metadata.owner_references = Some(vec![serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{deploy}-abc123"),
        "uid": format!("uid-rs-{deploy}"), "controller": true
    }))
    .unwrap()]);
    p
}

/// Puts the pod's `vllm` container in CrashLoopBackOff.
pub fn crash_looping(mut p: Pod) -> Pod {
    p.status = Some(
        serde_json::from_value(json!({
            "phase": "Running",
            "containerStatuses": [{
                "name": "vllm", "ready": false, "restartCount": 4, "image": "i", "imageID": "",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}
            }]
        }))
        .unwrap(),
    );
    p
}

/// Wires `p` through the real Pod webhook for a host-only backend annotated
/// `inferencecache.io/lmcache-kernel-check: <mode>` (`strict` or `report-only`), so its
/// `lmcache-kernel-check` init container is the adapter's own (program, env names, mode).
pub fn wired_for_kernel_check(p: Pod, mode: &str) -> Pod {
    use ic_controller::admission::pod::{mutate_pod, PodWebhookConfig};
    let cb = annotate(
        host_only("kc"),
        "inferencecache.io/lmcache-kernel-check",
        mode,
    );
    let mut v = serde_json::to_value(&p).unwrap();
    let out = mutate_pod(&v, NS, &[cb], &PodWebhookConfig::default());
    let ops = out
        .patch
        .unwrap_or_else(|| panic!("not wired: {}", out.reason));
    let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).unwrap();
    json_patch::patch(&mut v, &patch).unwrap();
    let wired: Pod = serde_json::from_value(v).unwrap();
    assert!(wired
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .is_some_and(|ics| ics.iter().any(|c| c.name == "lmcache-kernel-check")));
    wired
}

/// Sets the state of the pod's kernel-check init container (`state` is the ContainerState JSON).
pub fn with_kernel_check_state(mut p: Pod, state: Value) -> Pod {
    let mut status = p
        .status
        .take()
        .map(|s| serde_json::to_value(s).unwrap())
        .unwrap_or(json!({}));
    status["initContainerStatuses"] = json!([{
        "name": "lmcache-kernel-check", "ready": false, "restartCount": 0, "image": "i",
        "imageID": "", "state": state
    }]);
    p.status = Some(serde_json::from_value(status).unwrap());
    p
}

/// [`wired_for_kernel_check`] (`strict` or `report-only`) with the init container in `state`.
pub fn with_kernel_check(p: Pod, state: Value, strict: bool) -> Pod {
    let mode = if strict { "strict" } else { "report-only" };
    with_kernel_check_state(wired_for_kernel_check(p, mode), state)
}

/// A Ready cache-server pod of backend `cb_name` for provider `slug` (`redis`, …).
pub fn server_pod(name: &str, uid: &str, cb_name: &str, slug: &str, restarts: i32) -> Pod {
    let mut p = pod(
        name,
        &[
            ("inferencecache.io/cachebackend", cb_name),
            ("app.kubernetes.io/component", "cache-server"),
            ("app.kubernetes.io/name", slug),
        ],
        &[],
    );
    p.metadata.uid = Some(uid.to_string());
    p.spec = Some(
        serde_json::from_value(json!({"containers": [{"name": slug, "image": "x"}, {"name": "istio-proxy", "image": "y"}]}))
            .unwrap(),
    );
    p.status = Some(
        serde_json::from_value(json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": slug, "ready": true, "restartCount": restarts, "image": "x", "imageID": ""},
                {"name": "istio-proxy", "ready": true, "restartCount": 7, "image": "y", "imageID": ""}
            ]
        }))
        .unwrap(),
    );
    p
}

/// An engine Deployment `name` whose pod template carries `labels`, with `replicas`.
pub fn engine_deployment(name: &str, labels: &[(&str, &str)], replicas: i32) -> Deployment {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}
        }
    }))
    .unwrap()
}

/// An index replica of pod `pod` in [`NS`] holding `prefixes` blocks, last event at `ms`.
pub fn replica(pod: &str, prefixes: u64, last_event_ms: i64) -> ReplicaObservation {
    replica_in(NS, pod, prefixes, last_event_ms)
}

/// [`replica`] in namespace `ns`.
pub fn replica_in(ns: &str, pod: &str, prefixes: u64, last_event_ms: i64) -> ReplicaObservation {
    ReplicaObservation {
        tenant: ns.to_string(),
        replica: pod.to_string(),
        prefix_count: prefixes,
        last_event_unix_ms: last_event_ms,
        coverage: "Exact",
        ..Default::default()
    }
}

/// The condition `type_` of `status`.
pub fn cond<'a>(status: &'a CacheBackendStatus, type_: &str) -> Option<&'a Condition> {
    find_condition(&status.conditions, type_)
}

/// `(status, reason)` of condition `type_`, or `None`.
pub fn sr(status: &CacheBackendStatus, type_: &str) -> Option<(String, String)> {
    cond(status, type_).map(|c| (c.status.clone(), c.reason.clone()))
}

/// `Some((status, reason))` as owned strings.
pub fn is(status: &str, reason: &str) -> Option<(String, String)> {
    Some((status.to_string(), reason.to_string()))
}

/// `obj` made ready to be created in namespace `ns`: the namespace set, and what the apiserver
/// assigns itself (uid, resourceVersion, creationTimestamp, generation) cleared.
pub fn in_namespace<K: Resource>(mut obj: K, ns: &str) -> K {
    let m = obj.meta_mut();
    m.namespace = Some(ns.to_string());
    m.uid = None;
    m.resource_version = None;
    m.creation_timestamp = None;
    m.generation = None;
    obj
}

/// A reconcile harness over the bare real apiserver, in a namespace of its own.
pub struct Harness {
    /// This harness's namespace: every object it creates lives there.
    pub ns: String,
    /// The reconciler's client (through [`Faults`] when built with
    /// [`with_faults`](Self::with_faults)).
    pub client: Client,
    /// The admin client the harness itself reads and writes with (never faulted).
    pub admin: Client,
    /// The reconciler context.
    pub ctx: Arc<Context>,
    /// The clock.
    pub clock: Arc<FakeClock>,
    /// Recorded Events.
    pub events: Arc<RecordingEventSink>,
    /// The faked index.
    pub index: Arc<FakeIndex>,
    /// The scripted prober (wired only when the harness was built with a prober).
    pub prober: Arc<FakeProber>,
    /// The leader flag.
    pub leader: Arc<AtomicBool>,
}

impl Harness {
    /// A harness over `cbs` (created in a fresh namespace, their `status`, if any, written
    /// through the subresource); `probe` wires the scripted prober (the probe gate on).
    pub async fn new(cbs: Vec<CacheBackend>, probe: bool) -> Self {
        Self::build(cbs, probe, None).await
    }

    /// [`new`](Self::new) whose reconciler client passes every request through `faults` first
    /// (injected errors, another writer landing before a request, the request record). The
    /// harness's own reads and writes use the admin client and are neither faulted nor recorded.
    pub async fn with_faults(cbs: Vec<CacheBackend>, probe: bool, faults: Arc<Faults>) -> Self {
        Self::build(cbs, probe, Some(faults)).await
    }

    async fn build(cbs: Vec<CacheBackend>, probe: bool, faults: Option<Arc<Faults>>) -> Self {
        let bare = BareCluster::get().await;
        let ns = bare.namespace("reconcile").await;
        let admin = bare.admin.clone();
        let client = match faults {
            Some(f) => bare.client_with(f),
            None => admin.clone(),
        };
        let clock = Arc::new(FakeClock::new(Timestamp::from_second(T0).unwrap()));
        let events = Arc::new(RecordingEventSink::new());
        let index = Arc::new(FakeIndex::new());
        let prober = Arc::new(FakeProber::new());
        let leader = Arc::new(AtomicBool::new(true));
        let mut ctx = Context::new(
            client.clone(),
            index.clone(),
            events.clone(),
            clock.clone(),
            leader.clone(),
        )
        .with_settings(Settings::default());
        if probe {
            ctx = ctx.with_prober(prober.clone());
        }
        let h = Harness {
            ns,
            client,
            admin,
            ctx: Arc::new(ctx),
            clock,
            events,
            index,
            prober,
            leader,
        };
        for cb in cbs {
            h.add_cb(cb).await;
        }
        h
    }

    /// A controller restart: the same API and clock, fresh in-process memory.
    pub fn restart_controller(&mut self) {
        self.ctx = Arc::new(
            Context::new(
                self.client.clone(),
                self.index.clone(),
                self.events.clone(),
                self.clock.clone(),
                self.leader.clone(),
            )
            .with_settings(Settings::default()),
        );
    }

    /// An API of this harness's namespace over the admin client.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    /// `<ns>/<name>` in this harness's namespace.
    pub fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.ns)
    }

    /// [`replica`] in this harness's namespace.
    pub fn replica(&self, pod: &str, prefixes: u64, last_event_ms: i64) -> ReplicaObservation {
        replica_in(&self.ns, pod, prefixes, last_event_ms)
    }

    /// Creates `obj` in this namespace (then its `status` through the subresource, when it has
    /// one); returns the stored object.
    pub async fn create<K>(&self, obj: K) -> K
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + Serialize
            + DeserializeOwned
            + std::fmt::Debug,
    {
        create_with_status(&self.api::<K>(), &in_namespace(obj, &self.ns)).await
    }

    /// Creates a CacheBackend through the API (its CRD schema and CEL rules); returns the stored
    /// object (server-assigned uid).
    pub async fn add_cb(&self, cb: CacheBackend) -> CacheBackend {
        self.create(cb).await
    }

    /// Runs one reconcile of backend `name`.
    pub async fn reconcile(&self, name: &str) -> Action {
        self.try_reconcile(name).await.unwrap()
    }

    /// Runs one reconcile of backend `name`, returning its error.
    pub async fn try_reconcile(
        &self,
        name: &str,
    ) -> Result<Action, ic_controller::reconcile::Error> {
        let mut stub = backend(name, json!({"runtime": "VLLM"}));
        stub.metadata.namespace = Some(self.ns.clone());
        reconcile(Arc::new(stub), self.ctx.clone()).await
    }

    /// The live CacheBackend.
    pub async fn cb(&self, name: &str) -> CacheBackend {
        self.api::<CacheBackend>().get(name).await.unwrap()
    }

    /// The live status (default when unset).
    pub async fn status(&self, name: &str) -> CacheBackendStatus {
        self.cb(name).await.status.unwrap_or_default()
    }

    /// Merge-patches the CacheBackend (spec or metadata).
    pub async fn patch_cb(&self, name: &str, patch: Value) {
        self.api::<CacheBackend>()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Creates a pod (then writes its `status`, as the kubelet would); returns the stored pod
    /// (server-assigned uid).
    pub async fn add_pod(&self, p: Pod) -> Pod {
        self.create(p).await
    }

    /// Plays the kubelet: writes `p`'s status onto the live pod of the same name through the
    /// status subresource (a container restarted in place: same pod, same uid), or creates the
    /// pod when there is none. Returns the stored pod.
    pub async fn replace_pod(&self, p: Pod) -> Pod {
        let api = self.api::<Pod>();
        let name = p.metadata.name.clone().unwrap();
        let Some(mut live) = api.get_opt(&name).await.unwrap() else {
            return self.add_pod(p).await;
        };
        let mut status = p.status.unwrap_or_default();
        let old = live.status.take().unwrap_or_default();
        // Set by the apiserver at create; not the kubelet's to change.
        status.qos_class = status.qos_class.or(old.qos_class);
        live.status = Some(status);
        api.replace_status(&name, &PostParams::default(), &live)
            .await
            .unwrap()
    }

    /// Deletes a pod at once (grace period 0: no kubelet is there to confirm a graceful stop).
    pub async fn delete_pod(&self, name: &str) {
        self.api::<Pod>()
            .delete(
                name,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
    }

    /// Creates a Deployment; returns the stored one.
    pub async fn add_deployment(&self, d: Deployment) -> Deployment {
        self.create(d).await
    }

    /// Plays the Deployment controller for `name`: `available` of the desired replicas
    /// available, rollout complete, observedGeneration current.
    pub async fn settle_deployment(&self, name: &str, available: i32) {
        self.deployment_status(name, None, available, true).await;
    }

    /// Sets a Deployment's status through the status subresource: `updated` (default: desired)
    /// updated replicas, `available` available and ready, rollout-complete marker `complete`.
    pub async fn deployment_status(
        &self,
        name: &str,
        updated: Option<i32>,
        available: i32,
        complete: bool,
    ) {
        let api = self.api::<Deployment>();
        let d = api.get(name).await.unwrap();
        let desired = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        let updated = updated.unwrap_or(desired);
        let reason = if complete {
            "NewReplicaSetAvailable"
        } else {
            "ReplicaSetUpdated"
        };
        let patch = json!({"status": {
            "observedGeneration": d.metadata.generation,
            "replicas": desired.max(updated).max(available),
            "updatedReplicas": updated,
            "readyReplicas": available,
            "availableReplicas": available,
            "conditions": [{"type": "Progressing", "status": "True", "reason": reason}]
        }});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// The owned Deployment, if any.
    pub async fn deployment(&self, name: &str) -> Option<Deployment> {
        self.api::<Deployment>().get_opt(name).await.unwrap()
    }

    /// The owned StatefulSet, if any.
    pub async fn statefulset(&self, name: &str) -> Option<StatefulSet> {
        self.api::<StatefulSet>().get_opt(name).await.unwrap()
    }

    /// The owned Service, if any.
    pub async fn service(&self, name: &str) -> Option<Service> {
        self.api::<Service>().get_opt(name).await.unwrap()
    }

    /// The owned HPA, if any.
    pub async fn hpa(&self, name: &str) -> Option<HorizontalPodAutoscaler> {
        self.api::<HorizontalPodAutoscaler>()
            .get_opt(name)
            .await
            .unwrap()
    }

    /// Advances the clock by `secs` seconds.
    pub fn advance(&self, secs: u64) {
        self.clock.advance(std::time::Duration::from_secs(secs));
    }

    /// Unix ms of the clock now.
    pub fn now_ms(&self) -> i64 {
        use ic_controller::reconcile::clock::Clock;
        self.clock.now().as_millisecond()
    }
}
