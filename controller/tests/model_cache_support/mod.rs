//! Shared fixtures of the `model_cache_*` integration tests (StorageClasses, catalogs,
//! requests) and a [`Harness`] over the bare real apiserver of `bare_apiserver_support` (etcd +
//! kube-apiserver with the chart's CRDs, RBAC and admission policies; no controller-manager,
//! no scheduler, no kubelet, no controller).
//!
//! Tests call the reconcilers directly and play the controllers that do not run here: the Job
//! controller (the writer Job's `status`), the PV binder (claim `spec.volumeName`, volume
//! `spec.claimRef`, both `status.phase`), and the pvc-/pv-protection controllers (their
//! finalizers on deleted claims and volumes, see [`Harness::settle`]). Everything else is the
//! real API: uids, resourceVersions, validation of PVs, PVCs, Jobs and StorageClasses, the CRDs'
//! schemas and CEL rules, DELETE preconditions, finalizers.
//!
//! Tests run in parallel with each other and with other binaries on the same cluster: every
//! harness has its own request, control and catalog namespaces and its own cache StorageClass
//! (cluster-scoped) name, handed to the reconcilers through [`ModelCacheConfig`]; lists across
//! the cluster are filtered to the harness's own objects. The reconcilers' client passes
//! through [`Faults`] ([`Harness::faults`]): injected errors and the record of their calls.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

// admission_policy_cel.rs also loads reconcile_support, which loads it too (as its own copy).
#[allow(clippy::duplicate_mod)]
#[path = "../bare_apiserver_support/mod.rs"]
pub mod bare_apiserver_support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

pub use bare_apiserver_support::{unique, BareCluster, Call, Faults, Step};
use ic_controller::reconcile::clock::FakeClock;
use ic_controller::reconcile::model_cache::{
    names, reconcile_binding, reconcile_request, Context, Error, FeatureFlags, ModelCacheConfig,
    DEFAULT_STORAGE_CLASS,
};
use ic_shared::crd::{
    annotations, find_condition, ModelCache, ModelCacheBinding, ModelCacheStatus,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolume, PersistentVolumeClaim, Secret, ServiceAccount,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

/// NVMesh provisioner.
pub const NVMESH: &str = "nvmesh-csi.excelero.com";
/// An RWX provisioner.
pub const FSS: &str = "fss.csi.oraclecloud.com";
/// Start of the fake clock (2026-01-01T00:00:00Z).
pub const T0: i64 = 1_767_225_600;
/// Name of the catalog ConfigMap (the default, in the harness's catalog namespace).
pub const CATALOG_CM: &str = "inference-cache-storage-capabilities";
/// Finalizer the StorageObjectInUseProtection admission plugin puts on every claim.
pub const PVC_PROTECTION: &str = "kubernetes.io/pvc-protection";
/// Finalizer the StorageObjectInUseProtection admission plugin puts on every volume.
pub const PV_PROTECTION: &str = "kubernetes.io/pv-protection";

/// A catalog: NVMesh (RWO+ROX, `ro`, encryption, handle rule `/` segment 1), FSS (RWX), Weka
/// (empty).
pub fn catalog_text() -> String {
    json!({"drivers": [
        {"name": NVMESH, "provider": "nvmesh", "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
         "readerMountOptions": ["ro", "norecovery", "nouuid"], "encryptionSupported": true,
         "volumeHandleNamespace": {"separator": "/", "segment": 1}},
        {"name": FSS, "provider": "oci-fss", "accessModes": ["ReadWriteMany"], "readerMountOptions": ["ro"]},
        {"name": "csi.weka.io", "provider": "weka", "accessModes": [], "readerMountOptions": []}
    ]})
    .to_string()
}

/// The catalog ConfigMap holding `text`, in namespace `ns`.
pub fn catalog_cm(ns: &str, text: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": CATALOG_CM, "namespace": ns},
        "data": {"catalog.json": text}
    }))
    .unwrap()
}

/// The cache StorageClass (default name) with `provisioner`, `reclaim` (None = unset).
pub fn storage_class(provisioner: &str, reclaim: Option<&str>) -> StorageClass {
    storage_class_named(DEFAULT_STORAGE_CLASS, provisioner, reclaim)
}

/// StorageClass `name` with `provisioner`, `reclaim` (None = unset: the apiserver defaults it
/// to `Delete`), parameter `pool: fast`, `WaitForFirstConsumer`.
pub fn storage_class_named(name: &str, provisioner: &str, reclaim: Option<&str>) -> StorageClass {
    let mut v = json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": name},
        "provisioner": provisioner,
        "parameters": {"pool": "fast"},
        "volumeBindingMode": "WaitForFirstConsumer"
    });
    if let Some(r) = reclaim {
        v["reclaimPolicy"] = json!(r);
    }
    serde_json::from_value(v).unwrap()
}

/// A writer template.
pub fn writer() -> Value {
    json!({"template": {"spec": {"containers": [{"name": "fetch", "image": "ghcr.io/example/fetch:1",
                                                  "args": ["--to", "/model-data"]}]}}})
}

/// A `regularModelCache` request `name` in `ns` for revision `rev`.
pub fn regular(name: &str, ns: &str, rev: &str) -> ModelCache {
    request(
        name,
        ns,
        json!({
            "source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": rev},
            "size": "40Gi", "workflow": "regularModelCache", "writer": writer()
        }),
    )
}

/// A `helmModelCache` request reading in `readers`, sharing domain `org`.
pub fn helm(name: &str, ns: &str, readers: &[&str]) -> ModelCache {
    request(
        name,
        ns,
        json!({
            "source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "r1"},
            "size": "40Gi", "workflow": "helmModelCache", "readerNamespaces": readers,
            "sharingDomain": "org", "writer": writer()
        }),
    )
}

/// A request with `spec`.
pub fn request(name: &str, ns: &str, spec: Value) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec
    }))
    .unwrap()
}

/// A 500 from the API server (what etcd trouble looks like), for [`Faults`] rules.
pub fn server_error() -> Step {
    Step::internal("injected: etcdserver: request timed out")
}

/// A 404 `NotFound` for [`Faults`] rules.
pub fn not_found(what: &str) -> Step {
    Step::Fail {
        code: 404,
        reason: "NotFound",
        message: format!("{what} not found (injected)"),
    }
}

/// A harness over the bare apiserver: the reconcilers' context with this harness's names, a
/// fake clock, and the test's own (unfaulted) admin client.
pub struct Harness {
    /// Admin client for the test's own reads and writes (no faults, not recorded).
    pub client: Client,
    /// The reconcilers' context; its client passes through [`Harness::faults`].
    pub ctx: Arc<Context>,
    /// The clock.
    pub clock: Arc<FakeClock>,
    /// Injected errors and the record of every call the reconcilers made.
    pub faults: Arc<Faults>,
    /// Request namespace (`team-a-<tag>`).
    pub ns: String,
    /// Control namespace of bindings, Leases, helm writers, key Secrets.
    pub ctl: String,
    /// Namespace of the catalog ConfigMap.
    pub cat_ns: String,
    /// The cache StorageClass (cluster-scoped, unique to the harness).
    pub sc: String,
    tag: String,
    namespaces: Arc<Mutex<BTreeSet<String>>>,
}

/// Builder of a [`Harness`].
#[derive(Default)]
pub struct Setup {
    catalog: Option<String>,
    class: Option<(String, Option<String>)>,
    flags: FeatureFlags,
}

/// Creates namespace `name` with its `default` ServiceAccount unless it exists.
async fn ensure_namespace(client: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => return,
        Err(e) => panic!("create namespace {name}: {e}"),
    }
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap();
    match Api::<ServiceAccount>::namespaced(client.clone(), name)
        .create(&PostParams::default(), &sa)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create {name}/default ServiceAccount: {e}"),
    }
}

impl Setup {
    /// The default world: the catalog and an NVMesh Retain class.
    pub fn nvmesh() -> Self {
        Setup::default()
            .catalog(&catalog_text())
            .class(NVMESH, Some("Retain"))
    }

    /// The catalog and an RWX (FSS) Retain class.
    pub fn rwx() -> Self {
        Setup::default()
            .catalog(&catalog_text())
            .class(FSS, Some("Retain"))
    }

    /// The catalog ConfigMap holds `text`.
    pub fn catalog(mut self, text: &str) -> Self {
        self.catalog = Some(text.to_string());
        self
    }

    /// The cache StorageClass has `provisioner` and `reclaim` (None = unset).
    pub fn class(mut self, provisioner: &str, reclaim: Option<&str>) -> Self {
        self.class = Some((provisioner.to_string(), reclaim.map(str::to_string)));
        self
    }

    /// Sets the feature flags.
    pub fn flags(mut self, flags: FeatureFlags) -> Self {
        self.flags = flags;
        self
    }

    /// Creates the harness's namespaces, catalog and class, and the reconcilers' context.
    pub async fn build(self) -> Harness {
        let bare = BareCluster::get().await;
        let tag = unique("mc");
        let name = |logical: &str| format!("{logical}-{tag}");
        let (ns, ctl, cat_ns, sc) = (name("team-a"), name("ctl"), name("cat"), name("mc-sc"));
        let client = bare.admin.clone();
        for n in [&ns, &ctl, &cat_ns] {
            ensure_namespace(&client, n).await;
        }
        if let Some(text) = &self.catalog {
            Api::<ConfigMap>::namespaced(client.clone(), &cat_ns)
                .create(&PostParams::default(), &catalog_cm(&cat_ns, text))
                .await
                .unwrap();
        }
        if let Some((provisioner, reclaim)) = &self.class {
            Api::<StorageClass>::all(client.clone())
                .create(
                    &PostParams::default(),
                    &storage_class_named(&sc, provisioner, reclaim.as_deref()),
                )
                .await
                .unwrap();
        }
        let faults = Faults::new();
        let faulty = bare.client_with(faults.clone());
        let clock = Arc::new(FakeClock::new(Timestamp::from_second(T0).unwrap()));
        let config = ModelCacheConfig {
            control_namespace: ctl.clone(),
            storage_class: sc.clone(),
            catalog_namespace: cat_ns.clone(),
            flags: self.flags,
            ..ModelCacheConfig::default()
        };
        let ctx = Arc::new(Context::new(
            faulty,
            config,
            clock.clone(),
            Arc::new(AtomicBool::new(true)),
        ));
        Harness {
            client,
            ctx,
            clock,
            faults,
            namespaces: Arc::new(Mutex::new(
                [&ns, &ctl, &cat_ns].into_iter().cloned().collect(),
            )),
            ns,
            ctl,
            cat_ns,
            sc,
            tag,
        }
    }
}

impl Harness {
    /// The same API, names, clock and faults, with the reconcilers running under `flags`.
    pub fn with_flags(&self, flags: FeatureFlags) -> Harness {
        let mut config = self.ctx.config.clone();
        config.flags = flags;
        Harness {
            client: self.client.clone(),
            ctx: Arc::new(Context::new(
                self.ctx.client.clone(),
                config,
                self.clock.clone(),
                Arc::new(AtomicBool::new(true)),
            )),
            clock: self.clock.clone(),
            faults: self.faults.clone(),
            ns: self.ns.clone(),
            ctl: self.ctl.clone(),
            cat_ns: self.cat_ns.clone(),
            sc: self.sc.clone(),
            tag: self.tag.clone(),
            namespaces: self.namespaces.clone(),
        }
    }

    /// This harness's name for namespace `logical` (`ns-b` → `ns-b-mc-<pid>-<n>`). Created by
    /// [`Harness::namespace`], or by [`Harness::create_request`] for a request's namespaces.
    pub fn ns_of(&self, logical: &str) -> String {
        format!("{logical}-{}", self.tag)
    }

    /// Creates this harness's namespace `logical` (see [`Harness::ns_of`]) unless it exists.
    pub async fn namespace(&self, logical: &str) -> String {
        let name = self.ns_of(logical);
        self.ensure(&name).await;
        name
    }

    async fn ensure(&self, name: &str) {
        let new = self.namespaces.lock().unwrap().insert(name.to_string());
        if new {
            ensure_namespace(&self.client, name).await;
        }
    }

    fn all_namespaces(&self) -> Vec<String> {
        self.namespaces.lock().unwrap().iter().cloned().collect()
    }

    /// Name of the writer's volume the tests create for binding `binding` in
    /// [`Harness::complete_writer`] (unique to the harness: PVs are cluster-scoped).
    pub fn writer_pv(&self, binding: &str) -> String {
        format!("pvc-{binding}-{}", self.tag)
    }

    /// Runs one reconcile of request `ns/name`.
    pub async fn reconcile(&self, ns: &str, name: &str) -> Result<Action, Error> {
        let stub = regular(name, ns, "stub");
        reconcile_request(Arc::new(stub), self.ctx.clone()).await
    }

    /// Runs one reconcile of request `ns/name`, which must succeed.
    pub async fn ok(&self, ns: &str, name: &str) -> Action {
        self.reconcile(ns, name)
            .await
            .unwrap_or_else(|e| panic!("reconcile {ns}/{name}: {e}"))
    }

    /// Reconciles request `ns/name`, playing the PV binder for every reader claim a pass left
    /// `Pending` (one reader namespace per pass, as the controller creates them), until the
    /// request no longer waits for one. Returns the last pass's action.
    pub async fn ok_binding_readers(&self, ns: &str, name: &str) -> Action {
        for _ in 0..16 {
            let action = self.ok(ns, name).await;
            if self.cond(ns, name, "Ready").await != is("False", "ReaderClaimPending") {
                return action;
            }
            assert!(
                self.bind_readers().await > 0,
                "{ns}/{name} waits for a reader claim the binder cannot bind"
            );
        }
        panic!("{ns}/{name} still waits for reader claims");
    }

    /// Runs one reconcile of binding `name`.
    pub async fn reconcile_binding(&self, name: &str) -> Result<Action, Error> {
        let mut stub = ModelCacheBinding::default();
        stub.metadata.name = Some(name.to_string());
        stub.metadata.namespace = Some(self.ctl.clone());
        reconcile_binding(Arc::new(stub), self.ctx.clone()).await
    }

    /// Request `ns/name`.
    pub async fn request(&self, ns: &str, name: &str) -> ModelCache {
        Api::<ModelCache>::namespaced(self.client.clone(), ns)
            .get(name)
            .await
            .unwrap()
    }

    /// UID of request `ns/name`.
    pub async fn uid(&self, ns: &str, name: &str) -> String {
        self.request(ns, name).await.metadata.uid.unwrap()
    }

    /// Status of request `ns/name` (default when unset).
    pub async fn status(&self, ns: &str, name: &str) -> ModelCacheStatus {
        self.request(ns, name).await.status.unwrap_or_default()
    }

    /// `(status, reason)` of condition `type_` of request `ns/name`.
    pub async fn cond(&self, ns: &str, name: &str, type_: &str) -> Option<(String, String)> {
        let s = self.status(ns, name).await;
        find_condition(&s.conditions, type_).map(|c| (c.status.clone(), c.reason.clone()))
    }

    /// Every binding (of the control namespace).
    pub async fn bindings(&self) -> Vec<ModelCacheBinding> {
        Api::<ModelCacheBinding>::namespaced(self.client.clone(), &self.ctl)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
    }

    /// Binding `name`, if present.
    pub async fn binding(&self, name: &str) -> Option<ModelCacheBinding> {
        Api::<ModelCacheBinding>::namespaced(self.client.clone(), &self.ctl)
            .get_opt(name)
            .await
            .unwrap()
    }

    /// Whether a cluster-scoped object (as JSON) is this harness's: the cache class, a volume
    /// whose `claimRef` points into one of its namespaces, a class whose CSI secret parameters
    /// name one of them (an encrypted cache's derived class).
    fn owns_cluster_object(&self, v: &Value) -> bool {
        let ours = self.all_namespaces();
        let in_ours = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .is_some_and(|n| ours.iter().any(|o| o == n))
        };
        v.pointer("/metadata/name").and_then(Value::as_str) == Some(self.sc.as_str())
            || in_ours("/spec/claimRef/namespace")
            || in_ours("/parameters/csi.storage.k8s.io~1node-stage-secret-namespace")
    }

    /// Names (sorted) of the objects of kind `K` in `ns`; `None`: in every namespace of this
    /// harness (namespaced kinds) or this harness's own (cluster-scoped kinds, see
    /// `owns_cluster_object`). Objects being deleted are included.
    pub async fn names<K>(&self, ns: Option<&str>) -> Vec<String>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
        K::Scope: ScopeApi,
    {
        let mut out = Vec::new();
        let lists: Vec<Option<String>> = match ns {
            Some(ns) => vec![Some(ns.to_string())],
            None if K::Scope::NAMESPACED => self.all_namespaces().into_iter().map(Some).collect(),
            None => vec![None],
        };
        for ns in lists {
            let api: Api<K> = K::Scope::api(self.client.clone(), ns.as_deref());
            for o in api.list(&ListParams::default()).await.unwrap().items {
                if !K::Scope::NAMESPACED
                    && !self.owns_cluster_object(&serde_json::to_value(&o).unwrap())
                {
                    continue;
                }
                out.push(o.meta().name.clone().unwrap_or_default());
            }
        }
        out.sort();
        out
    }

    /// Counts of the storage side effects: claims, PVs, Jobs, Leases, Secrets, and
    /// StorageClasses other than the cache class — this harness's only.
    pub async fn side_effects(&self) -> usize {
        self.names::<PersistentVolumeClaim>(None).await.len()
            + self.names::<PersistentVolume>(None).await.len()
            + self.names::<Job>(None).await.len()
            + self.names::<Lease>(None).await.len()
            + self.names::<Secret>(None).await.len()
            + self
                .names::<StorageClass>(None)
                .await
                .iter()
                .filter(|n| **n != self.sc)
                .count()
    }

    /// Plays the Job controller, the CSI provisioner and the volume binder for binding `b`: the
    /// writer Job succeeded (`SuccessCriteriaMet`, `Complete`), a CSI PV
    /// ([`Harness::writer_pv`], driver `driver`, handle `handle`, the claim's class, Retain)
    /// was provisioned for the writer claim, and the two are bound (claim `spec.volumeName`,
    /// volume `claimRef` with the claim's UID, both `Bound`).
    pub async fn complete_writer(&self, b: &ModelCacheBinding, driver: &str, handle: &str) {
        let bname = b.metadata.name.clone().unwrap();
        let job = b.spec.resources.jobs[0].clone();
        let now = Timestamp::from_second(Timestamp::now().as_second())
            .unwrap()
            .to_string();
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &job.namespace);
        jobs.patch_status(
            &job.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "startTime": now, "completionTime": now, "succeeded": 1,
                "conditions": [
                    {"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": now},
                    {"type": "Complete", "status": "True", "lastTransitionTime": now}]}})),
        )
        .await
        .unwrap();
        let claims: Api<PersistentVolumeClaim> =
            Api::namespaced(self.client.clone(), &job.namespace);
        let claim = claims.get(&job.name).await.unwrap();
        let class = claim.spec.as_ref().unwrap().storage_class_name.clone();
        let pv_name = self.writer_pv(&bname);
        let pv: PersistentVolume = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "annotations": {"pv.kubernetes.io/provisioned-by": driver}},
            "spec": {
                "accessModes": claim.spec.as_ref().unwrap().access_modes,
                "capacity": {"storage": "40Gi"},
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": class,
                "volumeMode": "Filesystem", "mountOptions": ["discard"],
                "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                             "namespace": job.namespace, "name": job.name,
                             "uid": claim.metadata.uid},
                "csi": {"driver": driver, "volumeHandle": handle, "fsType": "xfs",
                        "volumeAttributes": {"pool": "fast"}}
            }
        }))
        .unwrap();
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        pvs.create(&PostParams::default(), &pv).await.unwrap();
        self.mark_bound(&claim, &pv_name).await;
        // The binder sets a claim's spec.volumeName once (the one change of a claim's spec the
        // apiserver admits besides its size).
        claims
            .patch(
                &job.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"volumeName": pv_name}})),
            )
            .await
            .unwrap();
    }

    /// The binder's last step for claim `c` and volume `pv`: both `Bound`.
    async fn mark_bound(&self, c: &PersistentVolumeClaim, pv: &str) {
        let ns = c.metadata.namespace.clone().unwrap();
        let name = c.metadata.name.clone().unwrap();
        let spec = c.spec.clone().unwrap();
        Api::<PersistentVolume>::all(self.client.clone())
            .patch_status(
                pv,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Bound"}})),
            )
            .await
            .unwrap();
        let size = spec
            .resources
            .and_then(|r| r.requests)
            .and_then(|r| r.get("storage").cloned());
        Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), &ns)
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Bound",
                    "accessModes": spec.access_modes, "capacity": {"storage": size}}})),
            )
            .await
            .unwrap();
    }

    /// Plays the PV binder for pre-bound pairs: every claim of this harness that names a volume
    /// (`spec.volumeName`) whose `claimRef` names the claim, and is not `Bound` yet, gets the
    /// claim's UID in the volume's `claimRef` and both become `Bound`. Returns how many.
    pub async fn bind_readers(&self) -> usize {
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let mut bound = 0;
        for ns in self.all_namespaces() {
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
            for c in claims.list(&ListParams::default()).await.unwrap().items {
                let phase = c.status.as_ref().and_then(|s| s.phase.clone());
                let Some(volume) = c.spec.as_ref().and_then(|s| s.volume_name.clone()) else {
                    continue;
                };
                if phase.as_deref() == Some("Bound") || c.metadata.deletion_timestamp.is_some() {
                    continue;
                }
                let Some(pv) = pvs.get_opt(&volume).await.unwrap() else {
                    continue;
                };
                let cref = pv
                    .spec
                    .as_ref()
                    .and_then(|s| s.claim_ref.clone())
                    .unwrap_or_default();
                if cref.namespace.as_deref() != Some(ns.as_str())
                    || cref.name != c.metadata.name
                    || cref
                        .uid
                        .as_ref()
                        .is_some_and(|u| Some(u) != c.metadata.uid.as_ref())
                {
                    continue;
                }
                pvs.patch(
                    &volume,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"claimRef": {"uid": c.metadata.uid}}})),
                )
                .await
                .unwrap();
                self.mark_bound(&c, &volume).await;
                bound += 1;
            }
        }
        bound
    }

    /// Plays the pvc-protection and pv-protection controllers (no pod uses anything here): drops
    /// their finalizers from this harness's claims and volumes being deleted, so that they go.
    pub async fn settle(&self) {
        let drop_finalizer = |fins: Option<Vec<String>>, f: &str| -> Option<Value> {
            let fins = fins.unwrap_or_default();
            fins.iter()
                .any(|x| x == f)
                .then(|| json!({"metadata": {"finalizers": fins.iter().filter(|x| *x != f).collect::<Vec<_>>()}}))
        };
        for ns in self.all_namespaces() {
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
            for c in claims.list(&ListParams::default()).await.unwrap().items {
                if c.metadata.deletion_timestamp.is_none() {
                    continue;
                }
                if let Some(p) = drop_finalizer(c.metadata.finalizers.clone(), PVC_PROTECTION) {
                    let name = c.metadata.name.clone().unwrap();
                    ignore_gone(
                        claims
                            .patch(&name, &PatchParams::default(), &Patch::Merge(p))
                            .await,
                    );
                }
            }
        }
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        for pv in pvs.list(&ListParams::default()).await.unwrap().items {
            if pv.metadata.deletion_timestamp.is_none()
                || !self.owns_cluster_object(&serde_json::to_value(&pv).unwrap())
            {
                continue;
            }
            if let Some(p) = drop_finalizer(pv.metadata.finalizers.clone(), PV_PROTECTION) {
                let name = pv.metadata.name.clone().unwrap();
                ignore_gone(
                    pvs.patch(&name, &PatchParams::default(), &Patch::Merge(p))
                        .await,
                );
            }
        }
    }

    /// Deletes claim `ns/name` as an operator would, the pvc-protection controller finishing
    /// the job: gone when this returns.
    pub async fn delete_claim(&self, ns: &str, name: &str) {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), ns);
        ignore_gone(
            claims
                .delete(name, &DeleteParams::default())
                .await
                .map(|_| ()),
        );
        self.settle().await;
        assert!(
            claims.get_opt(name).await.unwrap().is_none(),
            "{ns}/{name} still there"
        );
    }

    /// Deletes request `ns/name` (no finalizer: gone at once).
    pub async fn delete_request(&self, ns: &str, name: &str) {
        Api::<ModelCache>::namespaced(self.client.clone(), ns)
            .delete(name, &Default::default())
            .await
            .unwrap();
    }

    /// Creates request `mc` (its namespace and reader namespaces are created first when they
    /// are new); returns it as stored (with the server's UID).
    pub async fn create_request(&self, mc: &ModelCache) -> ModelCache {
        let ns = mc.metadata.namespace.clone().unwrap();
        self.ensure(&ns).await;
        for r in &mc.spec.reader_namespaces {
            self.ensure(r).await;
        }
        Api::<ModelCache>::namespaced(self.client.clone(), &ns)
            .create(&PostParams::default(), mc)
            .await
            .unwrap()
    }

    /// Creates `obj` (namespaced in its `metadata.namespace`, else cluster-scoped) and writes
    /// its `status` through the subresource when it has one; returns it as stored.
    pub async fn create<K>(&self, obj: &K) -> K
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
        K::Scope: ScopeApi,
    {
        let ns = obj.meta().namespace.clone();
        let api: Api<K> = K::Scope::api(self.client.clone(), ns.as_deref());
        bare_apiserver_support::create_with_status(&api, obj).await
    }

    /// Replaces the catalog ConfigMap's text.
    pub async fn set_catalog(&self, text: &str) {
        let cms: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.cat_ns);
        cms.patch(
            CATALOG_CM,
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"catalog.json": text}})),
        )
        .await
        .unwrap();
    }

    /// Creates the catalog ConfigMap holding `text`.
    pub async fn create_catalog(&self, text: &str) {
        Api::<ConfigMap>::namespaced(self.client.clone(), &self.cat_ns)
            .create(&PostParams::default(), &catalog_cm(&self.cat_ns, text))
            .await
            .unwrap();
    }

    /// The cache StorageClass as stored.
    pub async fn class(&self) -> StorageClass {
        Api::<StorageClass>::all(self.client.clone())
            .get(&self.sc)
            .await
            .unwrap()
    }

    /// Deletes the cache StorageClass.
    pub async fn delete_class(&self) {
        Api::<StorageClass>::all(self.client.clone())
            .delete(&self.sc, &Default::default())
            .await
            .unwrap();
    }

    /// Deletes the cache StorageClass and creates another one of `provisioner` under the same
    /// name (its provisioner and parameters are immutable: a change is a new class, new UID).
    pub async fn replace_class(&self, provisioner: &str, reclaim: &str) -> StorageClass {
        self.delete_class().await;
        Api::<StorageClass>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &storage_class_named(&self.sc, provisioner, Some(reclaim)),
            )
            .await
            .unwrap()
    }

    /// The binding name `mc` (as it would be stored: namespace set) gets at `generation`.
    pub fn binding_name_of(&self, mc: &ModelCache, generation: u32) -> String {
        names::binding_name(&names::identity_for(mc), generation)
    }

    /// Removes finalizer `f` from binding `name` (as the finalizer's owner would).
    pub async fn drop_binding_finalizer(&self, name: &str, f: &str) {
        let api: Api<ModelCacheBinding> = Api::namespaced(self.client.clone(), &self.ctl);
        let b = api.get(name).await.unwrap();
        let fins: Vec<String> = b
            .metadata
            .finalizers
            .unwrap_or_default()
            .into_iter()
            .filter(|x| x != f)
            .collect();
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": fins,
                                              "resourceVersion": b.metadata.resource_version}})),
        )
        .await
        .unwrap();
    }

    /// The calls the reconcilers made from index `from` of [`Faults::calls`] on.
    pub fn calls_since(&self, from: usize) -> Vec<Call> {
        self.faults.calls().split_off(from)
    }
}

fn ignore_gone<T>(r: Result<T, kube::Error>) {
    match r {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => panic!("{e}"),
    }
}

/// Api constructor by scope.
pub trait ScopeApi {
    /// Whether the kind is namespaced.
    const NAMESPACED: bool;
    /// `Api::all` for cluster scope; `Api::namespaced` or `Api::all` for namespaced.
    fn api<K>(client: Client, ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = Self>;
}

impl ScopeApi for k8s_openapi::ClusterResourceScope {
    const NAMESPACED: bool = false;
    fn api<K>(client: Client, _ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = Self>,
    {
        Api::all(client)
    }
}

impl ScopeApi for k8s_openapi::NamespaceResourceScope {
    const NAMESPACED: bool = true;
    fn api<K>(client: Client, ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = Self>,
    {
        match ns {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        }
    }
}

/// Labels of an object as a map (empty when none).
pub fn labels_of(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> BTreeMap<String, String> {
    meta.labels.clone().unwrap_or_default()
}

/// A `(status, reason)` pair.
pub fn is(status: &str, reason: &str) -> Option<(String, String)> {
    Some((status.to_string(), reason.to_string()))
}

/// Whether binding `b` carries the model cache's finalizer.
pub fn has_binding_finalizer(b: &ModelCacheBinding) -> bool {
    b.metadata
        .finalizers
        .clone()
        .unwrap_or_default()
        .iter()
        .any(|f| f == annotations::BINDING_FINALIZER)
}
