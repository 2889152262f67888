//! Shared fixtures of the `model_cache_*` integration tests: StorageClasses, catalogs, requests,
//! and a harness around the in-memory API (kube-fake-client 0.3.0: no watch, so tests call the
//! reconcilers directly and play the Job controller and the volume binder by hand).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use ic_controller::reconcile::clock::FakeClock;
use ic_controller::reconcile::model_cache::{
    reconcile_binding, reconcile_request, Context, Error, FeatureFlags, ModelCacheConfig,
};
use ic_shared::crd::{find_condition, ModelCache, ModelCacheBinding, ModelCacheStatus};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::Client;
use kube_fake_client::{interceptor, ClientBuilder};
use serde_json::{json, Value};

/// Control namespace (the default).
pub const CTL: &str = "inference-cache-model-cache";
/// Namespace of the catalog ConfigMap (the default).
pub const CAT_NS: &str = "inference-cache";
/// Cache StorageClass (the default).
pub const SC: &str = "inference-cache-model-cache";
/// Request namespace.
pub const NS: &str = "team-a";
/// NVMesh provisioner.
pub const NVMESH: &str = "nvmesh-csi.excelero.com";
/// An RWX provisioner.
pub const FSS: &str = "fss.csi.oraclecloud.com";
/// Start of the fake clock (2026-01-01T00:00:00Z).
pub const T0: i64 = 1_767_225_600;

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

/// The catalog ConfigMap holding `text`.
pub fn catalog_cm(text: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "inference-cache-storage-capabilities", "namespace": CAT_NS},
        "data": {"catalog.json": text}
    }))
    .unwrap()
}

/// The cache StorageClass with `provisioner`, `reclaim` (None = unset), uid `sc-uid-1`.
pub fn storage_class(provisioner: &str, reclaim: Option<&str>) -> StorageClass {
    let mut v = json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": SC, "uid": "sc-uid-1"},
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

/// A `regularModelCache` request `name` in `ns` for revision `rev`, uid `uid-<ns>-<name>`.
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
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}"), "generation": 1},
        "spec": spec
    }))
    .unwrap()
}

/// What the tests record of API calls (through interceptors).
#[derive(Default)]
pub struct Calls {
    /// `verb kind-or-resource name` in call order.
    pub log: Mutex<Vec<String>>,
    /// Every object sent with a status replace (PUT …/status), in call order.
    pub statuses: Mutex<Vec<Value>>,
}

impl Calls {
    /// The log so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
    /// Index of the first entry starting with `prefix`.
    pub fn first(&self, prefix: &str) -> Option<usize> {
        self.log().iter().position(|l| l.starts_with(prefix))
    }
    /// The `status` of every status replace of object `name`, in call order.
    pub fn statuses_of(&self, name: &str) -> Vec<Value> {
        self.statuses
            .lock()
            .unwrap()
            .iter()
            .filter(|o| o.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
            .map(|o| o.get("status").cloned().unwrap_or(Value::Null))
            .collect()
    }
}

/// A harness over the in-memory API.
pub struct Harness {
    /// The fake client.
    pub client: Client,
    /// The reconciler context.
    pub ctx: Arc<Context>,
    /// The clock.
    pub clock: Arc<FakeClock>,
    /// Recorded calls.
    pub calls: Arc<Calls>,
}

/// Builder of a [`Harness`].
#[derive(Default)]
pub struct Setup {
    objects: Vec<Value>,
    flags: FeatureFlags,
    interceptors: Option<Box<dyn FnOnce(Arc<Calls>) -> interceptor::Funcs>>,
}

fn to_value<K: serde::Serialize>(o: &K) -> Value {
    serde_json::to_value(o).unwrap()
}

impl Setup {
    /// The default world: the catalog and an NVMesh Retain class.
    pub fn nvmesh() -> Self {
        Setup::default()
            .with(&catalog_cm(&catalog_text()))
            .with(&storage_class(NVMESH, Some("Retain")))
    }

    /// The catalog and an RWX (FSS) Retain class.
    pub fn rwx() -> Self {
        Setup::default()
            .with(&catalog_cm(&catalog_text()))
            .with(&storage_class(FSS, Some("Retain")))
    }

    /// Adds an object.
    pub fn with<K: serde::Serialize>(mut self, o: &K) -> Self {
        let mut v = to_value(o);
        if v.get("apiVersion").is_none() {
            panic!("fixture without apiVersion: {v}");
        }
        if v.get("status").is_some_and(Value::is_null) {
            v.as_object_mut().unwrap().remove("status");
        }
        self.objects.push(v);
        self
    }

    /// Sets the feature flags.
    pub fn flags(mut self, flags: FeatureFlags) -> Self {
        self.flags = flags;
        self
    }

    /// Installs interceptors built from the shared call log.
    pub fn intercept(mut self, f: impl FnOnce(Arc<Calls>) -> interceptor::Funcs + 'static) -> Self {
        self.interceptors = Some(Box::new(f));
        self
    }

    /// Builds the harness.
    pub async fn build(self) -> Harness {
        let calls = Arc::new(Calls::default());
        let mut b = ClientBuilder::new()
            .with_resource::<ModelCache>()
            .with_status_subresource::<ModelCache>()
            .with_resource::<ModelCacheBinding>()
            .with_status_subresource::<ModelCacheBinding>()
            .with_status_subresource::<Job>()
            .with_status_subresource::<PersistentVolumeClaim>()
            .with_status_subresource::<PersistentVolume>()
            .with_runtime_objects(self.objects);
        b = match self.interceptors {
            Some(f) => b.with_interceptor_funcs(f(calls.clone())),
            None => b.with_interceptor_funcs(recording(calls.clone())),
        };
        let client = with_delete_preconditions(b.build().await.unwrap());
        let clock = Arc::new(FakeClock::new(Timestamp::from_second(T0).unwrap()));
        let config = ModelCacheConfig {
            flags: self.flags,
            ..ModelCacheConfig::default()
        };
        let ctx = Arc::new(Context::new(
            client.clone(),
            config,
            clock.clone(),
            Arc::new(AtomicBool::new(true)),
        ));
        Harness {
            client,
            ctx,
            clock,
            calls,
        }
    }
}

/// kube-fake-client 0.3.0 ignores `DeleteOptions.preconditions`; the API server answers a
/// DELETE whose precondition `uid` or `resourceVersion` differs from the stored object with
/// 409 Conflict ("Precondition failed: UID in precondition: …, UID in object meta: …"). This
/// wraps the in-memory API in a service that does the same: a DELETE with preconditions first
/// GETs the object at the same path and compares.
pub fn with_delete_preconditions(inner: Client) -> Client {
    let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let inner = inner.clone();
        async move {
            if req.method() != http::Method::DELETE {
                return inner.send(req).await;
            }
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await?;
            let opts: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let pre = opts.get("preconditions").cloned().unwrap_or(Value::Null);
            let want_uid = pre.get("uid").and_then(Value::as_str).map(str::to_string);
            let want_rv = pre
                .get("resourceVersion")
                .and_then(Value::as_str)
                .map(str::to_string);
            if want_uid.is_some() || want_rv.is_some() {
                let get = http::Request::get(parts.uri.path())
                    .body(kube::client::Body::empty())
                    .unwrap();
                let res = inner.send(get).await?;
                if res.status().is_success() {
                    let stored: Value =
                        serde_json::from_slice(&res.into_body().collect_bytes().await?)
                            .unwrap_or(Value::Null);
                    let meta = |k: &str| {
                        stored
                            .pointer(&format!("/metadata/{k}"))
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    };
                    let mismatch = |want: &Option<String>, k: &str| {
                        want.as_ref().is_some_and(|w| Some(w.clone()) != meta(k))
                    };
                    if mismatch(&want_uid, "uid") || mismatch(&want_rv, "resourceVersion") {
                        let status = json!({
                            "kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "reason": "Conflict", "code": 409,
                            "message": format!(
                                "Precondition failed: UID in precondition: {:?}, UID in object meta: {:?}",
                                want_uid, meta("uid")
                            ),
                        });
                        return Ok(http::Response::builder()
                            .status(409)
                            .header("content-type", "application/json")
                            .body(kube::client::Body::from(
                                serde_json::to_vec(&status).unwrap(),
                            ))
                            .unwrap());
                    }
                }
            }
            inner
                .send(http::Request::from_parts(
                    parts,
                    kube::client::Body::from(bytes),
                ))
                .await
        }
    });
    Client::new(svc, "default")
}

fn kind_of(v: &Value) -> String {
    v.get("kind")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string()
}

fn name_of(v: &Value) -> String {
    v.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string()
}

/// Interceptors that only record creates, status writes and deletes.
pub fn recording(calls: Arc<Calls>) -> interceptor::Funcs {
    let c1 = calls.clone();
    let c2 = calls.clone();
    let c3 = calls.clone();
    let c4 = calls.clone();
    let c5 = calls;
    interceptor::Funcs::new()
        .create(move |ctx| {
            c1.log.lock().unwrap().push(format!(
                "create {} {}",
                kind_of(ctx.object),
                name_of(ctx.object)
            ));
            Ok(None)
        })
        .patch_status(move |ctx| {
            c2.log.lock().unwrap().push(format!("status {}", ctx.name));
            Ok(None)
        })
        .replace_status(move |ctx| {
            c3.log
                .lock()
                .unwrap()
                .push(format!("status {} {}", kind_of(ctx.object), ctx.name));
            c3.statuses.lock().unwrap().push(ctx.object.clone());
            Ok(None)
        })
        .delete(move |ctx| {
            c4.log.lock().unwrap().push(format!("delete {}", ctx.name));
            Ok(None)
        })
        .replace(move |ctx| {
            c5.log
                .lock()
                .unwrap()
                .push(format!("replace {} {}", kind_of(ctx.object), ctx.name));
            Ok(None)
        })
}

/// A 500 from the API server.
pub fn server_error() -> kube_fake_client::Error {
    kube_fake_client::Error::Internal("injected: etcdserver: request timed out".into())
}

impl Harness {
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

    /// Runs one reconcile of binding `name`.
    pub async fn reconcile_binding(&self, name: &str) -> Result<Action, Error> {
        let mut stub = ModelCacheBinding::default();
        stub.metadata.name = Some(name.to_string());
        stub.metadata.namespace = Some(CTL.to_string());
        reconcile_binding(Arc::new(stub), self.ctx.clone()).await
    }

    /// Request `ns/name`.
    pub async fn request(&self, ns: &str, name: &str) -> ModelCache {
        Api::<ModelCache>::namespaced(self.client.clone(), ns)
            .get(name)
            .await
            .unwrap()
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

    /// Every binding.
    pub async fn bindings(&self) -> Vec<ModelCacheBinding> {
        Api::<ModelCacheBinding>::namespaced(self.client.clone(), CTL)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
    }

    /// Binding `name`, if present.
    pub async fn binding(&self, name: &str) -> Option<ModelCacheBinding> {
        Api::<ModelCacheBinding>::namespaced(self.client.clone(), CTL)
            .get_opt(name)
            .await
            .unwrap()
    }

    /// Names of every object of kind `K` in `ns` (`None`: cluster scope / all namespaces).
    pub async fn names<K>(&self, ns: Option<&str>) -> Vec<String>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
        K::Scope: ScopeApi,
    {
        let api: Api<K> = K::Scope::api(self.client.clone(), ns);
        let mut v: Vec<String> = api
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|o| o.meta().name.clone().unwrap_or_default())
            .collect();
        v.sort();
        v
    }

    /// Counts of the storage side effects: claims (all namespaces), PVs, Jobs, Leases, Secrets,
    /// and StorageClasses other than the cache class.
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
                .filter(|n| n.as_str() != SC)
                .count()
    }

    /// Plays the Job controller and the volume binder for binding `b`: the writer Job succeeded,
    /// its claim is bound to a new CSI PV (`handle`, driver `driver`, class `SC`, Retain).
    pub async fn complete_writer(&self, b: &ModelCacheBinding, driver: &str, handle: &str) {
        let bname = b.metadata.name.clone().unwrap();
        let job = b.spec.resources.jobs[0].clone();
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &job.namespace);
        jobs.patch_status(
            &job.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"succeeded": 1, "conditions": [
                {"type": "Complete", "status": "True"}]}})),
        )
        .await
        .unwrap();
        let pv_name = format!("pvc-{bname}");
        let pv: PersistentVolume = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "annotations": {"pv.kubernetes.io/provisioned-by": driver}},
            "spec": {
                "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "40Gi"},
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": SC,
                "volumeMode": "Filesystem", "mountOptions": ["discard"],
                "claimRef": {"namespace": job.namespace, "name": job.name, "uid": "writer-claim-uid"},
                "csi": {"driver": driver, "volumeHandle": handle, "fsType": "xfs",
                        "volumeAttributes": {"pool": "fast"}}
            }
        }))
        .unwrap();
        Api::<PersistentVolume>::all(self.client.clone())
            .create(&PostParams::default(), &pv)
            .await
            .unwrap();
        let claims: Api<PersistentVolumeClaim> =
            Api::namespaced(self.client.clone(), &job.namespace);
        let mut c = claims.get(&job.name).await.unwrap();
        c.spec.as_mut().unwrap().volume_name = Some(pv_name);
        claims
            .replace(&job.name, &PostParams::default(), &c)
            .await
            .unwrap();
    }

    /// Deletes request `ns/name`.
    pub async fn delete_request(&self, ns: &str, name: &str) {
        Api::<ModelCache>::namespaced(self.client.clone(), ns)
            .delete(name, &Default::default())
            .await
            .unwrap();
    }

    /// Creates a request.
    pub async fn create_request(&self, mc: &ModelCache) {
        let ns = mc.metadata.namespace.clone().unwrap();
        let mut mc = mc.clone();
        mc.metadata.uid = None;
        Api::<ModelCache>::namespaced(self.client.clone(), &ns)
            .create(&PostParams::default(), &mc)
            .await
            .unwrap();
    }

    /// Replaces the catalog ConfigMap's text.
    pub async fn set_catalog(&self, text: &str) {
        let cms: Api<ConfigMap> = Api::namespaced(self.client.clone(), CAT_NS);
        cms.patch(
            "inference-cache-storage-capabilities",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"catalog.json": text}})),
        )
        .await
        .unwrap();
    }

    /// Deletes the cache StorageClass and creates another one of `provisioner`, with a new UID.
    pub async fn replace_class(&self, provisioner: &str, reclaim: &str) {
        let classes: Api<StorageClass> = Api::all(self.client.clone());
        classes.delete(SC, &Default::default()).await.unwrap();
        let mut sc = storage_class(provisioner, Some(reclaim));
        sc.metadata.uid = None;
        classes.create(&PostParams::default(), &sc).await.unwrap();
    }
}

/// Api constructor by scope.
pub trait ScopeApi {
    /// `Api::all` for cluster scope; `Api::namespaced` or `Api::all` for namespaced.
    fn api<K>(client: Client, ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = Self>;
}

impl ScopeApi for k8s_openapi::ClusterResourceScope {
    fn api<K>(client: Client, _ns: Option<&str>) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = Self>,
    {
        Api::all(client)
    }
}

impl ScopeApi for k8s_openapi::NamespaceResourceScope {
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
