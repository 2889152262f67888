//! The model cache (docs/model-cache.md, spec 004) through its whole lifecycle on a real
//! apiserver, acting only through the API: as a user (the cache StorageClass, the `ModelCache`,
//! reader pods), as the CSI provisioner (the writer's PersistentVolume, pre-bound to the writer
//! claim so that the real PV controller binds them) and as the kubelet (the writer pod's
//! `pods/status`: `Succeeded`, so that the real Job controller completes the Job). The running
//! controller (the chart's ServiceAccount, RBAC and admission policies) does everything else:
//! binding, writer election, writer claim and Job, reader PVs and claims, the Pod webhook's
//! wiring, and — once the request is gone and the idle period has passed — release: every named
//! object deleted with preconditions (the real `pvc-protection` / `pv-protection` finalizers and
//! garbage collector finishing the job), `Released=True`, the finalizer dropped, the binding
//! deleted, and the writer's own volume kept (`Retain`) for the storage administrator.
//!
//! Encryption follows the controller's `ModelCacheEncryption` gate (read from `controller-args`;
//! the local cluster turns it on, cluster/chart_objects.py): with it on, the binding's decision
//! says encrypted and it names a key Secret (`<binding>-key`, control namespace) and a derived
//! StorageClass (`<binding>-enc`) that the elected writer creates before its claim — the derived
//! class hands the Secret to the driver through the standard CSI secret parameters, `Retain` —
//! the writer claim asks for the derived class, and release deletes both with the rest. Only the
//! shipped catalog's NVMesh entry can be encrypted (`encryptionSupported`, `roxReadOnly`). The
//! CSI provisioner's stand-in does what external-provisioner does with such a class: the PV gets
//! the derived class's name and `csi.nodeStageSecretRef` = the key Secret, which every reader PV
//! derived from it keeps.
//!
//! One stand-in for time: the chart runs the controller with `--model-cache-idle-seconds=3600`,
//! and the idle period is measured from the binding's own `status.idleSince`; the test moves it
//! back past the idle period (as an administrator, through `…/status`) instead of waiting an
//! hour. A deleted request reaches its binding through the binding controller's watch of
//! requests: before that watch, it was pruned only at the binding's next 5-minute resync
//! (measured here: 4.5 min after the delete), and the idle period started that much late.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use ic_controller::catalog::{derive_flow, required_modes, Catalog, DriverEntry};
use ic_controller::reconcile::model_cache::names;
use ic_controller::reconcile::model_cache::request::writer_template_digest;
use ic_controller::reconcile::model_cache::FeatureFlags;
use ic_shared::crd::{
    annotations, find_condition, AccessMode, BindingPhase, CacheMode, Flow, ModelCache,
    ModelCacheBinding, NamespacedName, RequestReference,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret, SecretReference,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{json, Value};

use crate::support::{wait_for, Cluster};

/// Every wait of these scenarios (the controller requeues a pending request every 15 s, and a
/// status write that raced another one after 15 s).
const WAIT: Duration = Duration::from_secs(90);
const SIZE: &str = "40Gi";
const URI: &str = "hf://meta-llama/Llama-3.1-8B-Instruct";
const IMAGE: &str = "ghcr.io/example/hf-fetch:1";
const CONTAINER: &str = "fetch";
/// The standard CSI parameters through which a StorageClass names the Secret external-provisioner
/// passes to `CreateVolume` and the kubelet to `NodeStageVolume` (name key, namespace key).
const CSI_SECRET_PARAMETERS: [(&str, &str); 2] = [
    (
        "csi.storage.k8s.io/provisioner-secret-name",
        "csi.storage.k8s.io/provisioner-secret-namespace",
    ),
    (
        "csi.storage.k8s.io/node-stage-secret-name",
        "csi.storage.k8s.io/node-stage-secret-namespace",
    ),
];

/// The `--model-cache-*` values the cluster's controller runs with (`controller-args`).
struct Settings {
    storage_class: String,
    control_namespace: String,
    catalog_namespace: String,
    catalog_config_map: String,
    catalog_key: String,
    idle_seconds: i64,
    writer_service_account: String,
    /// `ModelCacheEncryption` in `--model-cache-feature-gates`: new caches are encrypted.
    encryption: bool,
}

fn settings(c: &Cluster) -> Settings {
    let path = std::path::Path::new(&c.env["IC_CLUSTER_STATE"]).join("controller-args");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let arg = |flag: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{flag}=")))
            .unwrap_or_else(|| panic!("{flag} is not in {}", path.display()))
            .to_string()
    };
    assert_eq!(
        arg("--model-cache-enabled"),
        "true",
        "the chart's model cache is off"
    );
    let gates = FeatureFlags::parse(&arg("--model-cache-feature-gates")).unwrap();
    assert!(
        gates.caching_support && gates.helm_model_caching,
        "both scenarios need CachingSupport and HelmModelCaching: {gates:?}"
    );
    Settings {
        storage_class: arg("--model-cache-storage-class"),
        control_namespace: arg("--model-cache-control-namespace"),
        catalog_namespace: arg("--model-cache-catalog-namespace"),
        catalog_config_map: arg("--model-cache-catalog-config-map"),
        catalog_key: arg("--model-cache-catalog-key"),
        idle_seconds: arg("--model-cache-idle-seconds").parse().unwrap(),
        writer_service_account: arg("--model-cache-writer-service-account"),
        encryption: gates.model_cache_encryption,
    }
}

/// The cluster, the controller's settings, the cache class and what the installed catalog says
/// of its provisioner.
struct Env {
    c: Cluster,
    s: Settings,
    class: StorageClass,
    entry: DriverEntry,
    flow: Flow,
    modes: Vec<AccessMode>,
}

impl Env {
    /// Step 1 of every scenario: the cache StorageClass, for a catalog driver with a durable
    /// flow (one that can encrypt when the gate is on).
    async fn get() -> Env {
        let c = Cluster::get().await;
        let s = settings(&c);
        let cm = Api::<ConfigMap>::namespaced(c.admin.clone(), &s.catalog_namespace)
            .get(&s.catalog_config_map)
            .await
            .unwrap();
        let catalog = Catalog::from_config_map(&cm, &s.catalog_key).unwrap();
        let class = ensure_cache_class(&c, &s, &catalog).await;
        let entry = catalog.driver(&class.provisioner).unwrap().clone();
        let flow = derive_flow(&entry.access_modes).unwrap();
        Env {
            c,
            s,
            class,
            entry,
            flow,
            modes: required_modes(flow),
        }
    }

    fn provisioner(&self) -> &str {
        &self.class.provisioner
    }

    /// Whether new caches are encrypted (the controller's `ModelCacheEncryption` gate).
    fn encrypted(&self) -> bool {
        self.s.encryption
    }

    fn writer_mode(&self) -> String {
        self.modes.first().unwrap().as_str().to_string()
    }

    fn reader_mode(&self) -> String {
        self.modes.last().unwrap().as_str().to_string()
    }

    fn bindings(&self) -> Api<ModelCacheBinding> {
        Api::namespaced(self.c.admin.clone(), &self.s.control_namespace)
    }

    fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.c.admin.clone())
    }

    fn claims(&self, ns: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.c.admin.clone(), ns)
    }

    fn jobs(&self, ns: &str) -> Api<Job> {
        Api::namespaced(self.c.admin.clone(), ns)
    }

    fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.c.admin.clone(), ns)
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.c.admin.clone(), &self.s.control_namespace)
    }

    fn secrets(&self, ns: &str) -> Api<Secret> {
        Api::namespaced(self.c.admin.clone(), ns)
    }

    fn classes(&self) -> Api<StorageClass> {
        Api::all(self.c.admin.clone())
    }
}

/// Whether a driver can give the cache these scenarios need: a durable flow, and with the
/// encryption gate on, encryption (listed as supported, and the `roxReadOnly` shape — the only
/// one that implements it).
fn fits(entry: &DriverEntry, encryption: bool) -> bool {
    match derive_flow(&entry.access_modes) {
        None => false,
        Some(flow) => !encryption || (entry.encryption_supported && flow == Flow::RoxReadOnly),
    }
}

/// The cache StorageClass: created (reclaim `Retain`, the first catalog driver with a durable
/// flow — one that can encrypt when the gate is on —, rwxReadOnly preferred) unless another test
/// made it first; either way it must `Retain` and its provisioner must fit. Never deleted:
/// bindings record its UID.
async fn ensure_cache_class(c: &Cluster, s: &Settings, catalog: &Catalog) -> StorageClass {
    let classes = Api::<StorageClass>::all(c.admin.clone());
    if classes.get_opt(&s.storage_class).await.unwrap().is_none() {
        let durable: Vec<&DriverEntry> = catalog
            .drivers()
            .filter(|d| fits(d, s.encryption))
            .collect();
        let driver = durable
            .iter()
            .find(|d| derive_flow(&d.access_modes) == Some(Flow::RwxReadOnly))
            .or_else(|| durable.first())
            .expect("the chart's catalog has no driver that fits (durable; encrypting if gated)");
        // A parameter of the administrator's own: a derived (encrypted) class keeps it.
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": s.storage_class,
                         "labels": {"inferencecache.io/test": "real-apiserver"}},
            "provisioner": driver.name,
            "parameters": {"pool": "cache-pool"},
            "reclaimPolicy": "Retain",
            "volumeBindingMode": "Immediate"
        }))
        .unwrap();
        match classes.create(&PostParams::default(), &class).await {
            Ok(_) => {}
            // Another test created it between the read and the create.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => panic!("creating StorageClass {}: {e}", s.storage_class),
        }
    }
    let class = classes.get(&s.storage_class).await.unwrap();
    assert_eq!(
        class.reclaim_policy.as_deref(),
        Some("Retain"),
        "StorageClass {} exists without reclaimPolicy Retain",
        s.storage_class
    );
    let entry = catalog.driver(&class.provisioner).unwrap_or_else(|| {
        panic!(
            "StorageClass {} exists with provisioner {}, which the catalog does not list",
            s.storage_class, class.provisioner
        )
    });
    assert!(
        fits(entry, s.encryption),
        "StorageClass {} exists with provisioner {}, which derives no durable flow{}",
        s.storage_class,
        class.provisioner,
        if s.encryption {
            " that can encrypt"
        } else {
            ""
        }
    );
    class
}

/// A `ModelCache` `name` in `ns` for revision `revision`; `extra` is merged into `spec`.
fn request(ns: &str, name: &str, revision: &str, extra: Value) -> ModelCache {
    let mut v = json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "source": {"uri": URI, "revision": revision},
            "size": SIZE,
            "workflow": "regularModelCache",
            "writer": {"template": {"spec": {"containers": [{
                "name": CONTAINER, "image": IMAGE, "args": ["--to", "$(MODEL_CACHE_PATH)"]}]}}}
        }
    });
    for (k, val) in extra.as_object().unwrap() {
        v["spec"][k] = val.clone();
    }
    serde_json::from_value(v).unwrap()
}

/// A condition's `(status, reason)`.
fn cond(conditions: &[Condition], t: &str) -> Option<(String, String)> {
    find_condition(conditions, t).map(|c| (c.status.clone(), c.reason.clone()))
}

fn mc_cond(mc: &ModelCache, t: &str) -> Option<(String, String)> {
    cond(&mc.status.as_ref()?.conditions, t)
}

fn is(status: &str, reason: &str) -> Option<(String, String)> {
    Some((status.to_string(), reason.to_string()))
}

/// Asserts that `meta` carries the binding's label, UID annotation and managed-by label (what
/// release checks before it deletes anything).
fn assert_owned(what: &str, meta: &ObjectMeta, b: &ModelCacheBinding) {
    let labels = meta.labels.clone().unwrap_or_default();
    let annots = meta.annotations.clone().unwrap_or_default();
    assert_eq!(
        labels.get(annotations::BINDING_LABEL),
        b.metadata.name.as_ref(),
        "{what}: binding label ({labels:?})"
    );
    assert_eq!(
        labels
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("inference-cache"),
        "{what}: managed-by label"
    );
    assert_eq!(
        annots.get(annotations::BINDING_UID_ANNOTATION),
        b.metadata.uid.as_ref(),
        "{what}: binding UID annotation ({annots:?})"
    );
}

fn has_binding_finalizer(b: &ModelCacheBinding) -> bool {
    b.metadata
        .finalizers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|f| f == annotations::BINDING_FINALIZER)
}

/// A volume handle as the driver makes it for a volume consumed in `ns`: where the catalog says
/// the handle encodes the consuming namespace (NVMesh: four `:`-separated elements, the
/// namespace last), `ns` sits at that segment; otherwise the handle does not name it.
fn volume_handle(entry: &DriverEntry, ns: &str, volume: &str) -> String {
    match &entry.volume_handle_namespace {
        Some(rule) => {
            let segment = rule.segment as usize;
            let mut parts: Vec<String> = (0..=segment.max(2)).map(|i| format!("part{i}")).collect();
            parts[0] = "cache-pool".to_string();
            parts[1] = volume.to_string();
            parts[segment] = ns.to_string();
            parts.join(&rule.separator)
        }
        None => format!("cache-pool/{volume}"),
    }
}

fn storage_request(c: &PersistentVolumeClaim) -> Option<String> {
    c.spec
        .as_ref()?
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")
        .map(|q| q.0.clone())
}

fn claim_phase(c: &PersistentVolumeClaim) -> Option<String> {
    c.status.as_ref()?.phase.clone()
}

fn volume_phase(pv: &PersistentVolume) -> Option<String> {
    pv.status.as_ref()?.phase.clone()
}

fn one(mode: String) -> Option<Vec<String>> {
    Some(vec![mode])
}

/// A server-side dry run of a reader pod in `ns` asking for `cache` (`name` or
/// `namespace/name`): what the Pod webhook makes of it (nothing is stored).
async fn dry_run_reader_pod(env: &Env, ns: &str, cache: &str, n: usize) -> Pod {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("reader-{n}"),
                     "annotations": {annotations::MODEL_CACHE: cache}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.2"}]}
    }))
    .unwrap();
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    env.pods(ns).create(&pp, &pod).await.unwrap()
}

/// `Some(claim)` when the pod mounts volume `model-data` from a claim, read-only, and its
/// container mounts it read-only at `/model-data`.
fn wired_claim(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let volume = spec
        .volumes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|v| v.name == "model-data")?;
    let claim = volume.persistent_volume_claim.as_ref()?;
    assert_eq!(claim.read_only, Some(true), "reader volume is read-only");
    let mount = spec.containers[0]
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| m.name == "model-data")
        .expect("the container mounts model-data");
    assert_eq!(mount.read_only, Some(true), "reader mount is read-only");
    assert_eq!(mount.mount_path, "/model-data");
    Some(claim.claim_name.clone())
}

/// Waits until a reader pod in `ns` asking for `cache` is wired (`want` = the claim) or left
/// alone (`want` = `None`); the webhook's store of requests catches up within seconds.
async fn wait_wiring(env: &Env, ns: &str, cache: &str, want: Option<&str>) {
    let mut n = 0;
    let what = match want {
        Some(claim) => format!("a reader pod in {ns} wired to {claim}"),
        None => format!("a reader pod in {ns} left unwired"),
    };
    wait_for(&what, WAIT, || {
        n += 1;
        let n = n;
        async move {
            let got = wired_claim(&dry_run_reader_pod(env, ns, cache, n).await);
            (got.as_deref() == want).then_some(())
        }
    })
    .await;
}

/// Step 2: the request is bound. Checks the recorded selection and the binding: one per
/// identity, generation 1, its finalizer, `Active`, this request as its only reference, the
/// catalog's decision, the class's UID, and the names of everything it will own (writer claim,
/// Job and Lease; a reader claim and PV per reader namespace).
async fn bound(
    env: &Env,
    mc: &ModelCache,
    writer_ns: &str,
    readers: &[String],
) -> (ModelCache, ModelCacheBinding) {
    let ns = mc.metadata.namespace.clone().unwrap();
    let name = mc.metadata.name.clone().unwrap();
    let mcs = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns);
    let mc = wait_for("the request bound to a binding", WAIT, || async {
        let mc = mcs.get(&name).await.ok()?;
        mc.status.as_ref()?.binding.as_ref()?;
        Some(mc)
    })
    .await;
    let st = mc.status.clone().unwrap();
    assert_eq!(st.mode, Some(CacheMode::Durable));
    assert_eq!(
        mc_cond(&mc, "Selected"),
        is("True", "DurableFlowSelected"),
        "{st:#?}"
    );
    let selection = st.selection.clone().expect("the selection is recorded");
    assert_eq!(selection.provisioner, env.provisioner());
    assert_eq!(selection.flow, env.flow);
    assert_eq!(selection.storage_class_name, env.s.storage_class);
    assert_eq!(
        Some(&selection.storage_class_uid),
        env.class.metadata.uid.as_ref()
    );
    // The digest of the writer template as the apiserver stored it, recorded before any side
    // effect.
    assert_eq!(
        st.writer_template_digest.as_deref(),
        Some(writer_template_digest(&mc).as_str())
    );

    let identity = names::identity_for(&mc);
    let lp = ListParams::default().labels(&format!(
        "{}={}",
        annotations::IDENTITY_LABEL,
        names::identity_label(&identity)
    ));
    let mut same_identity = env.bindings().list(&lp).await.unwrap().items;
    assert_eq!(same_identity.len(), 1, "one binding per identity");
    let b = same_identity.remove(0);
    let bname = b.metadata.name.clone().unwrap();
    let recorded = st.binding.clone().unwrap();
    assert_eq!(Some(&recorded.name), b.metadata.name.as_ref());
    assert_eq!(Some(&recorded.uid), b.metadata.uid.as_ref());
    assert_eq!(bname, names::binding_name(&identity, 1));
    assert!(has_binding_finalizer(&b), "{:?}", b.metadata);
    assert_eq!(b.phase(), BindingPhase::Active);
    assert_eq!(
        b.references(),
        [RequestReference {
            namespace: ns.clone(),
            name: name.clone(),
            uid: mc.metadata.uid.clone().unwrap()
        }]
    );
    let d = &b.spec.decision;
    assert_eq!(d.provisioner, env.provisioner());
    assert_eq!(d.flow, env.flow);
    assert_eq!(d.access_modes, env.modes);
    assert_eq!(d.reader_mount_options, env.entry.reader_mount_options);
    assert_eq!(d.volume_handle_namespace, env.entry.volume_handle_namespace);
    assert_eq!(
        d.encrypted,
        env.encrypted(),
        "the decision follows the ModelCacheEncryption gate ({:?})",
        env.s.encryption
    );
    assert_eq!(b.spec.storage_class.name, env.s.storage_class);
    assert_eq!(
        Some(&b.spec.storage_class.uid),
        env.class.metadata.uid.as_ref()
    );
    let wname = names::writer_name(&bname);
    let res = &b.spec.resources;
    assert_eq!(res.jobs, [NamespacedName::new(writer_ns, &wname)]);
    assert_eq!(
        res.lease,
        Some(NamespacedName::new(&env.s.control_namespace, &wname))
    );
    let mut claims = res.persistent_volume_claims.clone();
    claims.sort();
    let mut want: Vec<NamespacedName> = readers
        .iter()
        .map(|r| NamespacedName::new(r, names::reader_claim(&bname)))
        .chain([NamespacedName::new(writer_ns, &wname)])
        .collect();
    want.sort();
    assert_eq!(claims, want);
    let mut pvs = res.persistent_volumes.clone();
    pvs.sort();
    let mut want: Vec<String> = readers
        .iter()
        .map(|r| names::reader_pv(&bname, r))
        .collect();
    want.sort();
    assert_eq!(pvs, want);
    if env.encrypted() {
        // The key Secret and the derived class, named before anything is created.
        assert_eq!(
            res.secrets,
            [NamespacedName::new(
                &env.s.control_namespace,
                names::key_secret(&bname)
            )]
        );
        assert_eq!(res.storage_classes, [names::encrypted_class(&bname)]);
    } else {
        assert!(res.secrets.is_empty() && res.storage_classes.is_empty());
    }
    (mc, b)
}

/// Step 2, continued: the writer Lease names the request, the writer claim asks the cache class
/// for the flow's writer mode and the request's size, and the writer Job runs the request's
/// template with volume `model-data` on that claim. The request reads `WriterRunning`.
async fn writer_started(env: &Env, mc: &ModelCache, b: &ModelCacheBinding, writer_ns: &str) -> Job {
    let bname = b.metadata.name.clone().unwrap();
    let wname = names::writer_name(&bname);
    let job = wait_for("the writer Job", WAIT, || async {
        env.jobs(writer_ns).get_opt(&wname).await.ok()?
    })
    .await;
    let lease = env.leases().get(&wname).await.unwrap();
    assert_owned("writer Lease", &lease.metadata, b);
    assert_eq!(
        lease.spec.as_ref().unwrap().holder_identity,
        mc.metadata.uid,
        "the writer election names the request"
    );
    // The elected writer makes the encryption objects before its claim.
    let writer_class = if env.encrypted() {
        encryption_objects(env, b).await
    } else {
        env.s.storage_class.clone()
    };
    let claim = env.claims(writer_ns).get(&wname).await.unwrap();
    assert_owned("writer claim", &claim.metadata, b);
    let spec = claim.spec.as_ref().unwrap();
    assert_eq!(spec.access_modes, one(env.writer_mode()));
    assert_eq!(
        spec.storage_class_name.as_deref(),
        Some(writer_class.as_str()),
        "the writer claim asks for the derived class when encrypted, else the cache class"
    );
    assert_eq!(storage_request(&claim).as_deref(), Some(SIZE));
    // No provisioner runs here: pending until the stand-in provisions it.
    assert_eq!(claim_phase(&claim).as_deref(), Some("Pending"));

    assert_owned("writer Job", &job.metadata, b);
    let tpl = &job.spec.as_ref().unwrap().template;
    assert_eq!(
        tpl.metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref())
            .and_then(|l| l.get(annotations::BINDING_LABEL)),
        Some(&bname)
    );
    let pod = tpl.spec.as_ref().unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    let vol = pod
        .volumes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|v| v.name == "model-data")
        .expect("volume model-data");
    let src = vol.persistent_volume_claim.as_ref().unwrap();
    assert_eq!(src.claim_name, wname);
    assert_ne!(src.read_only, Some(true), "the writer mounts read-write");
    let container = &pod.containers[0];
    assert_eq!(container.image.as_deref(), Some(IMAGE));
    let mount = container
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| m.name == "model-data")
        .expect("the writer mounts model-data");
    assert_eq!(mount.mount_path, "/model-data");
    assert_ne!(mount.read_only, Some(true));
    let env_vars: Vec<(String, String)> = container
        .env
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect();
    let source = &mc.spec.source;
    for (k, v) in [
        ("MODEL_CACHE_PATH", "/model-data"),
        ("MODEL_SOURCE_URI", source.uri.as_str()),
        ("MODEL_SOURCE_REVISION", source.revision.as_str()),
    ] {
        assert!(
            env_vars.contains(&(k.to_string(), v.to_string())),
            "{k}={v} in {env_vars:?}"
        );
    }
    let ns = mc.metadata.namespace.clone().unwrap();
    let name = mc.metadata.name.clone().unwrap();
    let mcs = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns);
    wait_for("Ready=False WriterRunning", WAIT, || async {
        let mc = mcs.get(&name).await.ok()?;
        (mc_cond(&mc, "Ready") == is("False", "WriterRunning")).then_some(())
    })
    .await;
    job
}

/// Step 2, encrypted: the key Secret in the control namespace (the binding's label, UID
/// annotation and managed-by label; `Opaque`, `data.key` = 32 random bytes as hex) and the
/// derived StorageClass (the same, cluster-scoped): the cache class's provisioner, parameters
/// and binding mode, plus the CSI provisioner and node-stage secret parameters naming the key
/// Secret and `encrypted: "true"`, reclaim `Retain`. Returns the derived class's name.
async fn encryption_objects(env: &Env, b: &ModelCacheBinding) -> String {
    let bname = b.metadata.name.clone().unwrap();
    let control = &env.s.control_namespace;
    let key = names::key_secret(&bname);
    let secret = env.secrets(control).get(&key).await.unwrap();
    assert_owned("key Secret", &secret.metadata, b);
    assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    let data = secret.data.clone().unwrap_or_default();
    assert_eq!(
        data.keys().collect::<Vec<_>>(),
        ["key"],
        "the key Secret holds the key only"
    );
    let hex = &data["key"].0;
    assert!(
        hex.len() == 64 && hex.iter().all(|c| c.is_ascii_hexdigit()),
        "data.key is 32 bytes as hex ({} characters)",
        hex.len()
    );

    let derived_name = names::encrypted_class(&bname);
    let derived = env.classes().get(&derived_name).await.unwrap();
    assert_owned("derived StorageClass", &derived.metadata, b);
    assert_eq!(derived.provisioner, env.provisioner());
    assert_eq!(derived.reclaim_policy.as_deref(), Some("Retain"));
    assert_eq!(derived.volume_binding_mode, env.class.volume_binding_mode);
    assert_eq!(derived.mount_options, env.class.mount_options);
    let params = derived.parameters.clone().unwrap_or_default();
    let mut want = env.class.parameters.clone().unwrap_or_default();
    for (name, namespace) in CSI_SECRET_PARAMETERS {
        want.insert(name.to_string(), key.clone());
        want.insert(namespace.to_string(), control.clone());
    }
    want.insert("encrypted".to_string(), "true".to_string());
    assert_eq!(
        params, want,
        "the cache class's parameters, the key Secret for the driver, encrypted"
    );
    derived_name
}

/// Step 3a, the CSI provisioner's part: a PV for the writer claim (named and annotated as
/// external-provisioner names them, a handle for the writer's namespace, the claim's class),
/// pre-bound to it by `claimRef`; the real PV controller binds the pair. Where the class names a
/// node-stage secret (an encrypted cache's derived class), the PV carries it as
/// `csi.nodeStageSecretRef`, as external-provisioner sets it. Returns the PV's name and handle.
async fn provision_writer_volume(env: &Env, writer_ns: &str, claim: &str) -> (String, String) {
    let claims = env.claims(writer_ns);
    let pvc = claims.get(claim).await.unwrap();
    let uid = pvc.metadata.uid.clone().unwrap();
    let class_name = pvc
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap();
    let class = env.classes().get(&class_name).await.unwrap();
    let params = class.parameters.clone().unwrap_or_default();
    let (stage_name, stage_ns) = CSI_SECRET_PARAMETERS[1];
    let stage_secret = params.get(stage_name).map(
        |n| json!({"name": n, "namespace": params.get(stage_ns).cloned().unwrap_or_default()}),
    );
    let name = format!("pvc-{uid}");
    let handle = volume_handle(&env.entry, writer_ns, &name);
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": name,
                     "labels": {"inferencecache.io/test": "real-apiserver"},
                     "annotations": {"pv.kubernetes.io/provisioned-by": env.provisioner()}},
        "spec": {
            "accessModes": [env.writer_mode()],
            "capacity": {"storage": SIZE},
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": class_name,
            "volumeMode": "Filesystem",
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "namespace": writer_ns, "name": claim, "uid": uid},
            "csi": {"driver": env.provisioner(), "volumeHandle": handle, "fsType": "xfs",
                    "volumeAttributes": {"pool": "cache-pool"},
                    "nodeStageSecretRef": stage_secret}
        }
    }))
    .unwrap();
    let pvs = env.pvs();
    pvs.create(&PostParams::default(), &pv).await.unwrap();
    wait_for(
        "the writer claim bound by the PV controller",
        WAIT,
        || async {
            let c = claims.get(claim).await.ok()?;
            let bound = claim_phase(&c).as_deref() == Some("Bound")
                && c.spec.as_ref()?.volume_name.as_deref() == Some(name.as_str());
            let pv = pvs.get(&name).await.ok()?;
            (bound && volume_phase(&pv).as_deref() == Some("Bound")).then_some(())
        },
    )
    .await;
    (name, handle)
}

fn job_pods(job: &str) -> ListParams {
    ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}"))
}

/// Step 3b, the kubelet's part: the writer pod (created by the real Job controller, with the
/// writer claim as its volume) ran and exited 0 (`pods/status`); the real Job controller
/// completes the Job.
async fn writer_pod_succeeds(env: &Env, writer_ns: &str, job: &str) {
    let pods = env.pods(writer_ns);
    let pod = wait_for("the writer pod", WAIT, || async {
        pods.list(&job_pods(job))
            .await
            .ok()?
            .items
            .into_iter()
            .next()
    })
    .await;
    let claims: Vec<String> = pod
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.persistent_volume_claim.as_ref())
        .map(|p| p.claim_name.clone())
        .collect();
    assert_eq!(
        claims,
        [job.to_string()],
        "the writer pod mounts the writer claim"
    );
    let now = Time(Timestamp::now());
    pods.patch_status(
        pod.metadata.name.as_deref().unwrap(),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Succeeded",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted",
                            "lastTransitionTime": now}],
            "containerStatuses": [{
                "name": CONTAINER, "image": IMAGE, "imageID": "", "ready": false,
                "restartCount": 0, "started": false,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                         "startedAt": now, "finishedAt": now}}
            }]
        }})),
    )
    .await
    .unwrap();
    let jobs = env.jobs(writer_ns);
    wait_for("the writer Job Complete", WAIT, || async {
        let st = jobs.get(job).await.ok()?.status?;
        let complete = st
            .conditions
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Complete" && c.status == "True");
        (complete && st.succeeded == Some(1)).then_some(())
    })
    .await;
}

/// Step 4: `Ready=True ReadersReady`; the binding records the writer's volume; each reader
/// namespace has a reader PV derived from it (same driver, the handle for that namespace,
/// `csi.readOnly`, the catalog's mount options, no class, `Retain`, the reader mode, pre-bound
/// to the reader claim) and a reader claim (`storageClassName: ""`, naming the PV), bound by the
/// real PV controller.
async fn readers_ready(
    env: &Env,
    mc: &ModelCache,
    b: &ModelCacheBinding,
    readers: &[String],
    writer_volume: &str,
) {
    let ns = mc.metadata.namespace.clone().unwrap();
    let name = mc.metadata.name.clone().unwrap();
    let bname = b.metadata.name.clone().unwrap();
    let rclaim = names::reader_claim(&bname);
    let mcs = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns);
    let mc = wait_for("Ready=True ReadersReady", WAIT, || async {
        let mc = mcs.get(&name).await.ok()?;
        (mc_cond(&mc, "Ready") == is("True", "ReadersReady")).then_some(mc)
    })
    .await;
    let st = mc.status.clone().unwrap();
    assert_eq!(st.reader_claim.as_ref(), Some(&rclaim));
    assert_eq!(st.reader_namespaces, readers);
    assert_eq!(st.mode, Some(CacheMode::Durable));
    let b = env.bindings().get(&bname).await.unwrap();
    assert_eq!(
        b.status.as_ref().unwrap().writer_volume_name.as_deref(),
        Some(writer_volume),
        "the binding records the writer's volume"
    );
    for r in readers {
        let pv = env.pvs().get(&names::reader_pv(&bname, r)).await.unwrap();
        assert_owned("reader PV", &pv.metadata, &b);
        let spec = pv.spec.as_ref().unwrap();
        let csi = spec.csi.as_ref().unwrap();
        assert_eq!(csi.driver, env.provisioner());
        assert_eq!(
            csi.volume_handle,
            volume_handle(&env.entry, r, writer_volume),
            "the writer's handle, for reader namespace {r}"
        );
        assert_eq!(csi.read_only, Some(true));
        // Readers of an encrypted cache stage the volume with the same key.
        let key = env.encrypted().then(|| SecretReference {
            name: Some(names::key_secret(&bname)),
            namespace: Some(env.s.control_namespace.clone()),
        });
        assert_eq!(
            csi.node_stage_secret_ref, key,
            "the reader PV keeps the writer PV's node-stage secret"
        );
        assert_eq!(
            spec.mount_options.clone().unwrap_or_default(),
            env.entry.reader_mount_options
        );
        assert_eq!(spec.storage_class_name.as_deref().unwrap_or(""), "");
        assert_eq!(
            spec.persistent_volume_reclaim_policy.as_deref(),
            Some("Retain")
        );
        assert_eq!(spec.access_modes, one(env.reader_mode()));
        assert_eq!(
            spec.capacity
                .as_ref()
                .and_then(|c| c.get("storage"))
                .map(|q| q.0.as_str()),
            Some(SIZE)
        );
        let cref = spec.claim_ref.as_ref().unwrap();
        assert_eq!(cref.namespace.as_ref(), Some(r));
        assert_eq!(cref.name.as_ref(), Some(&rclaim));
        assert_eq!(volume_phase(&pv).as_deref(), Some("Bound"));
        let claim = env.claims(r).get(&rclaim).await.unwrap();
        assert_owned("reader claim", &claim.metadata, &b);
        let cs = claim.spec.as_ref().unwrap();
        assert_eq!(cs.storage_class_name.as_deref(), Some(""));
        assert_eq!(cs.volume_name, pv.metadata.name);
        assert_eq!(cs.access_modes, one(env.reader_mode()));
        assert_eq!(claim_phase(&claim).as_deref(), Some("Bound"));
    }
}

/// Deletes the request and waits until it is gone (it carries no finalizer).
async fn delete_request(env: &Env, mc: &ModelCache) {
    let ns = mc.metadata.namespace.clone().unwrap();
    let name = mc.metadata.name.clone().unwrap();
    let mcs = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns);
    mcs.delete(&name, &DeleteParams::default()).await.unwrap();
    wait_for("the request gone", WAIT, || async {
        mcs.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
}

/// One observation of the binding by a watch.
#[derive(Debug, Clone)]
struct Seen {
    phase: BindingPhase,
    /// The `Released` condition's (status, reason).
    released: Option<(String, String)>,
    /// `status.releaseSkipped` as (object, reason).
    skipped: Vec<(String, String)>,
    finalizer: bool,
    deleted: bool,
}

/// Step 5, after the request was deleted: the binding prunes the reference and starts the idle
/// period, keeping everything; past it, it retires, releases exactly what it names (watched:
/// `Retiring` before anything is released, never back to `Active`, `Released=True` written while
/// the finalizer still protects, then the finalizer dropped and the binding deleted); the real
/// controller-manager clears the claims' and PVs' protection finalizers and collects the writer
/// pod with its Job; an encrypted cache's key Secret and derived StorageClass are deleted with
/// the rest. The writer's own volume, which the binding does not name, stays `Released`
/// (`Retain`, still naming the derived class when encrypted) until the storage administrator
/// (the test) deletes it.
async fn released_after_idle(env: &Env, b: &ModelCacheBinding, writer_volume: &str) {
    let bname = b.metadata.name.clone().unwrap();
    let bindings = env.bindings();
    let res = b.all_resources();

    // No nudge: the request's deletion reaches the binding through its watch of requests, well
    // within the 5-minute resync it once waited for.
    let (idle, since) = wait_for(
        "the reference pruned and the idle period started",
        Duration::from_secs(60),
        || async {
            let b = bindings.get(&bname).await.ok()?;
            let since = b.status.as_ref()?.idle_since.clone()?;
            b.references().is_empty().then_some((b, since))
        },
    )
    .await;
    assert_eq!(idle.phase(), BindingPhase::Active, "idle, not yet retiring");
    assert!(has_binding_finalizer(&idle));
    let age = Timestamp::now().duration_since(since.0);
    assert!(
        age > SignedDuration::from_secs(-5) && age < SignedDuration::from_secs(120),
        "idleSince {since:?} is when the reference was pruned"
    );
    // Within the idle period nothing is released.
    for j in &res.jobs {
        assert!(env
            .jobs(&j.namespace)
            .get_opt(&j.name)
            .await
            .unwrap()
            .is_some());
    }
    for c in &res.persistent_volume_claims {
        let claim = env.claims(&c.namespace).get_opt(&c.name).await.unwrap();
        assert!(claim.is_some_and(|c| c.metadata.deletion_timestamp.is_none()));
    }
    for pv in &res.persistent_volumes {
        assert!(env.pvs().get_opt(pv).await.unwrap().is_some());
    }
    for s in &res.secrets {
        assert!(env
            .secrets(&s.namespace)
            .get_opt(&s.name)
            .await
            .unwrap()
            .is_some());
    }
    for sc in &res.storage_classes {
        assert!(env.classes().get_opt(sc).await.unwrap().is_some());
    }
    assert_eq!(
        (res.secrets.len(), res.storage_classes.len()),
        if env.encrypted() { (1, 1) } else { (0, 0) },
        "an encrypted cache names its key Secret and derived class"
    );
    let lease = res.lease.clone().unwrap();
    assert!(env.leases().get_opt(&lease.name).await.unwrap().is_some());

    // Every state of the binding from here on, as a watch sees it.
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let seen_w = seen.clone();
    let field = format!("metadata.name={bname}");
    let watch = tokio::spawn(async move {
        let mut s = watcher(bindings, watcher::Config::default().fields(&field)).boxed();
        while let Some(ev) = s.next().await {
            let (b, deleted) = match ev {
                Ok(watcher::Event::Apply(b) | watcher::Event::InitApply(b)) => (b, false),
                Ok(watcher::Event::Delete(b)) => (b, true),
                _ => continue,
            };
            let st = b.status.clone().unwrap_or_default();
            seen_w.lock().unwrap().push(Seen {
                phase: b.phase(),
                released: cond(&st.conditions, "Released"),
                skipped: st
                    .release_skipped
                    .iter()
                    .map(|k| (k.object.clone(), k.reason.clone()))
                    .collect(),
                finalizer: has_binding_finalizer(&b),
                deleted,
            });
        }
    });
    wait_for("the watch started", WAIT, || async {
        (!seen.lock().unwrap().is_empty()).then_some(())
    })
    .await;

    // Stand-in for the idle period (an hour in the chart): idleSince moved back past it.
    let past = Timestamp::now() - SignedDuration::from_secs(env.s.idle_seconds + 60);
    let past = Time(Timestamp::from_second(past.as_second()).unwrap());
    let bindings = env.bindings();
    bindings
        .patch_status(
            &bname,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"idleSince": past}})),
        )
        .await
        .unwrap();
    wait_for("the binding released and deleted", WAIT, || async {
        bindings.get_opt(&bname).await.ok()?.is_none().then_some(())
    })
    .await;
    wait_for("the watch saw the deletion", WAIT, || async {
        seen.lock().unwrap().iter().any(|s| s.deleted).then_some(())
    })
    .await;
    watch.abort();
    let seen = seen.lock().unwrap().clone();
    let retiring = seen
        .iter()
        .position(|s| s.phase == BindingPhase::Retiring)
        .unwrap_or_else(|| panic!("never Retiring: {seen:#?}"));
    assert!(
        seen[retiring..]
            .iter()
            .all(|s| s.phase == BindingPhase::Retiring),
        "Retiring never returns to Active: {seen:#?}"
    );
    assert!(
        seen[..retiring].iter().all(|s| s.released.is_none()),
        "nothing is released before the binding is Retiring: {seen:#?}"
    );
    // A release pass may race the real PV binder: deleting a reader claim makes it update the
    // reader PV's status (Bound → Released) between the controller's read of the PV and its
    // preconditioned delete, which the apiserver refuses (409): the PV is kept as
    // ChangedSinceRead, with the finalizer, and read again on the next pass. Nothing is ever
    // kept for another reason here (every named object is the binding's, every volume Retains).
    let reader_pvs: Vec<String> = res
        .persistent_volumes
        .iter()
        .map(|pv| format!("PersistentVolume {pv}"))
        .collect();
    for s in &seen {
        if s.released == is("False", "ObjectsKept") {
            assert!(
                s.finalizer,
                "the finalizer stays while objects are kept: {seen:#?}"
            );
            assert!(
                !s.skipped.is_empty()
                    && s.skipped
                        .iter()
                        .all(|(o, r)| r == "ChangedSinceRead" && reader_pvs.contains(o)),
                "only a reader PV's race with the PV binder keeps anything: {seen:#?}"
            );
        }
    }
    let released = seen
        .iter()
        .position(|s| s.released == is("True", "Released"))
        .unwrap_or_else(|| panic!("never Released=True: {seen:#?}"));
    assert!(
        seen[released].skipped.is_empty(),
        "Released=True lists nothing kept: {seen:#?}"
    );
    assert!(
        seen[..=released].iter().all(|s| s.finalizer),
        "Released=True is written while the finalizer still protects the objects: {seen:#?}"
    );
    let last = seen.last().unwrap();
    assert!(
        last.deleted && !last.finalizer && last.released == is("True", "Released"),
        "deleted, released, without its finalizer: {seen:#?}"
    );

    // What the binding named is gone: the protection finalizers cleared by the real
    // controller-manager, the writer pod collected with its Job.
    wait_for("every named object gone", WAIT, || async {
        for j in &res.jobs {
            if env
                .jobs(&j.namespace)
                .get_opt(&j.name)
                .await
                .ok()?
                .is_some()
                || !env
                    .pods(&j.namespace)
                    .list(&job_pods(&j.name))
                    .await
                    .ok()?
                    .items
                    .is_empty()
            {
                return None;
            }
        }
        for c in &res.persistent_volume_claims {
            if env
                .claims(&c.namespace)
                .get_opt(&c.name)
                .await
                .ok()?
                .is_some()
            {
                return None;
            }
        }
        for pv in &res.persistent_volumes {
            if env.pvs().get_opt(pv).await.ok()?.is_some() {
                return None;
            }
        }
        // An encrypted cache's key Secret and derived class, deleted by the controller.
        for s in &res.secrets {
            if env
                .secrets(&s.namespace)
                .get_opt(&s.name)
                .await
                .ok()?
                .is_some()
            {
                return None;
            }
        }
        for sc in &res.storage_classes {
            if env.classes().get_opt(sc).await.ok()?.is_some() {
                return None;
            }
        }
        env.leases()
            .get_opt(&lease.name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    // The writer's volume is not named: under Retain it stays, Released, for the storage
    // administrator — the controller never deletes the cache's data.
    let kept = wait_for("the writer volume Released", WAIT, || async {
        let pv = env.pvs().get_opt(writer_volume).await.ok()??;
        (volume_phase(&pv).as_deref() == Some("Released")).then_some(pv)
    })
    .await;
    assert!(kept.metadata.deletion_timestamp.is_none());
    let kept_spec = kept.spec.as_ref().unwrap();
    assert_eq!(
        kept_spec.persistent_volume_reclaim_policy.as_deref(),
        Some("Retain")
    );
    assert_eq!(
        kept_spec.storage_class_name.as_deref(),
        Some(
            res.storage_classes
                .first()
                .unwrap_or(&env.s.storage_class)
                .as_str()
        ),
        "the writer volume came from the derived class when encrypted"
    );
    // The storage administrator reclaims it.
    env.pvs()
        .delete(writer_volume, &DeleteParams::default())
        .await
        .unwrap();
}

/// `regularModelCache`: writer and reader in the request's namespace.
#[tokio::test]
async fn a_model_cache_is_filled_read_and_released() {
    let env = Env::get().await;
    let ns = env.c.namespace("model-cache").await;
    let readers = vec![ns.clone()];
    let revision = format!("rev-{}", std::process::id());
    let created = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &request(&ns, "llama", &revision, json!({})),
        )
        .await
        .unwrap();

    let (mc, b) = bound(&env, &created, &ns, &readers).await;
    let job = writer_started(&env, &mc, &b, &ns).await;
    let wname = job.metadata.name.clone().unwrap();
    // Not ready: the Pod webhook leaves a reader pod alone.
    assert_eq!(
        wired_claim(&dry_run_reader_pod(&env, &ns, "llama", 0).await),
        None
    );

    let (volume, _) = provision_writer_volume(&env, &ns, &wname).await;
    // Done only when the claim is bound and the Job complete: still running.
    let now = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns)
        .get("llama")
        .await
        .unwrap();
    assert_eq!(mc_cond(&now, "Ready"), is("False", "WriterRunning"));
    writer_pod_succeeds(&env, &ns, &wname).await;

    readers_ready(&env, &mc, &b, &readers, &volume).await;
    // A reader pod asking for the cache is wired to the reader claim, read-only (the Pod
    // webhook as the apiserver calls it).
    let rclaim = names::reader_claim(b.metadata.name.as_deref().unwrap());
    wait_wiring(&env, &ns, "llama", Some(&rclaim)).await;

    delete_request(&env, &mc).await;
    // The webhook no longer wires pods to it.
    wait_wiring(&env, &ns, "llama", None).await;
    released_after_idle(&env, &b, &volume).await;
    env.c.drop_namespace(&ns).await;
}

/// `helmModelCache`: the writer runs in the control namespace as the writer service account
/// (no API token; the chart's admission policy checks it), and two other namespaces read it,
/// each through a reader PV whose handle names that namespace where the driver's does.
#[tokio::test]
async fn a_helm_model_cache_is_read_in_other_namespaces_and_released() {
    let env = Env::get().await;
    let ns = env.c.namespace("model-cache-helm").await;
    let mut readers = vec![
        env.c.namespace("model-cache-reader").await,
        env.c.namespace("model-cache-reader").await,
    ];
    readers.sort();
    let control = env.s.control_namespace.clone();
    let revision = format!("rev-helm-{}", std::process::id());
    let created = Api::<ModelCache>::namespaced(env.c.admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &request(
                &ns,
                "shared",
                &revision,
                json!({"workflow": "helmModelCache", "readerNamespaces": readers}),
            ),
        )
        .await
        .unwrap();

    let (mc, b) = bound(&env, &created, &control, &readers).await;
    let job = writer_started(&env, &mc, &b, &control).await;
    let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        pod.service_account_name.as_ref(),
        Some(&env.s.writer_service_account)
    );
    assert_eq!(pod.automount_service_account_token, Some(false));
    let wname = job.metadata.name.clone().unwrap();

    let (volume, _) = provision_writer_volume(&env, &control, &wname).await;
    writer_pod_succeeds(&env, &control, &wname).await;
    readers_ready(&env, &mc, &b, &readers, &volume).await;
    // Reader pods in the reader namespaces ask for it by namespace/name.
    let rclaim = names::reader_claim(b.metadata.name.as_deref().unwrap());
    let cache = format!("{ns}/shared");
    for r in &readers {
        wait_wiring(&env, r, &cache, Some(&rclaim)).await;
    }

    delete_request(&env, &mc).await;
    released_after_idle(&env, &b, &volume).await;
    env.c.drop_namespace(&ns).await;
    for r in &readers {
        env.c.drop_namespace(r).await;
    }
}
