//! The model cache (docs/model-cache.md, spec 004) through its whole lifecycle on a real
//! apiserver, acting only through the API: as a user (the cache StorageClass, the `ModelCache`,
//! a reader pod), as the CSI provisioner (the writer's PersistentVolume, pre-bound to the writer
//! claim so the real PV controller binds them) and as the kubelet (the writer pod's
//! `pods/status`: `Succeeded`, so the real Job controller completes the Job). The running
//! controller (the chart's ServiceAccount, RBAC and admission policies) does everything else:
//! binding, writer election, claim and Job, reader PV and claim, the Pod webhook's wiring, and —
//! once the request is gone and the idle period has passed — release: every named object
//! deleted with preconditions (the real `pvc-protection` / `pv-protection` finalizers and
//! garbage collector finishing the job), `Released=True`, the finalizer dropped, the binding
//! deleted, and the writer's own volume kept (`Retain`) for the storage administrator.
//!
//! Two stand-ins for time (the chart runs the controller with `--model-cache-idle-seconds=3600`
//! and a 5-minute steady resync, far beyond a test's bounded waits):
//!
//! - the binding controller watches bindings, not requests, so a deleted request is pruned from
//!   its binding at the binding's next resync; the test touches an annotation of the binding
//!   (a watch event) instead of waiting for that resync;
//! - the idle period is measured from the binding's own `status.idleSince`; the test moves it
//!   back past the idle period (as an administrator, through `…/status`) instead of waiting
//!   an hour.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use ic_controller::catalog::{derive_flow, required_modes, Catalog, DriverEntry};
use ic_controller::reconcile::model_cache::names;
use ic_controller::reconcile::model_cache::request::writer_template_digest;
use ic_shared::crd::{
    annotations, find_condition, BindingPhase, CacheMode, Flow, ModelCache, ModelCacheBinding,
    NamespacedName, RequestReference,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::Client;
use serde_json::json;

use crate::support::{wait_for, Cluster};

/// Every wait of this scenario (the controller requeues a pending request every 15 s).
const WAIT: Duration = Duration::from_secs(90);
const REQUEST: &str = "llama";
const SIZE: &str = "40Gi";
const URI: &str = "hf://meta-llama/Llama-3.1-8B-Instruct";
const IMAGE: &str = "ghcr.io/example/hf-fetch:1";

/// The `--model-cache-*` values the cluster's controller runs with (`controller-args`).
struct Settings {
    storage_class: String,
    control_namespace: String,
    catalog_namespace: String,
    catalog_config_map: String,
    catalog_key: String,
    idle_seconds: i64,
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
    Settings {
        storage_class: arg("--model-cache-storage-class"),
        control_namespace: arg("--model-cache-control-namespace"),
        catalog_namespace: arg("--model-cache-catalog-namespace"),
        catalog_config_map: arg("--model-cache-catalog-config-map"),
        catalog_key: arg("--model-cache-catalog-key"),
        idle_seconds: arg("--model-cache-idle-seconds").parse().unwrap(),
    }
}

/// The catalog the chart installed (the ConfigMap the controller reads).
async fn installed_catalog(c: &Cluster, s: &Settings) -> Catalog {
    let cm = Api::<ConfigMap>::namespaced(c.admin.clone(), &s.catalog_namespace)
        .get(&s.catalog_config_map)
        .await
        .unwrap();
    Catalog::from_config_map(&cm, &s.catalog_key).unwrap()
}

/// The cache StorageClass: created (reclaim `Retain`, the first catalog driver with a durable
/// flow, rwxReadOnly preferred) unless another test made it first; either way it must `Retain`
/// and its provisioner must derive a durable flow. Never deleted: bindings record its UID.
async fn ensure_cache_class(c: &Cluster, s: &Settings, catalog: &Catalog) -> StorageClass {
    let classes = Api::<StorageClass>::all(c.admin.clone());
    if classes.get_opt(&s.storage_class).await.unwrap().is_none() {
        let durable: Vec<&DriverEntry> = catalog
            .drivers()
            .filter(|d| derive_flow(&d.access_modes).is_some())
            .collect();
        let driver = durable
            .iter()
            .find(|d| derive_flow(&d.access_modes) == Some(Flow::RwxReadOnly))
            .or_else(|| durable.first())
            .expect("the chart's catalog has no driver with a durable flow");
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": s.storage_class,
                         "labels": {"inferencecache.io/test": "real-apiserver"}},
            "provisioner": driver.name,
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
        derive_flow(&entry.access_modes).is_some(),
        "StorageClass {} exists with provisioner {}, which derives no durable flow",
        s.storage_class,
        class.provisioner
    );
    class
}

fn request(ns: &str, revision: &str) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": REQUEST, "namespace": ns},
        "spec": {
            "source": {"uri": URI, "revision": revision},
            "size": SIZE,
            "workflow": "regularModelCache",
            "writer": {"template": {"spec": {"containers": [{
                "name": "fetch", "image": IMAGE, "args": ["--to", "$(MODEL_CACHE_PATH)"]}]}}}
        }
    }))
    .unwrap()
}

/// A condition's `(status, reason)`.
fn cond(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    t: &str,
) -> Option<(String, String)> {
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
fn assert_owned(what: &str, meta: &ObjectMeta, binding: &str, uid: &str) {
    let labels = meta.labels.clone().unwrap_or_default();
    let annots = meta.annotations.clone().unwrap_or_default();
    assert_eq!(
        labels.get(annotations::BINDING_LABEL).map(String::as_str),
        Some(binding),
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
        annots
            .get(annotations::BINDING_UID_ANNOTATION)
            .map(String::as_str),
        Some(uid),
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

/// A volume handle as the driver would make it: where the catalog says the handle encodes the
/// consuming namespace (NVMesh: four `:`-separated elements, the namespace last), `ns` sits at
/// that segment.
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

fn phase_of_claim(c: &PersistentVolumeClaim) -> Option<String> {
    c.status.as_ref()?.phase.clone()
}

fn phase_of_volume(pv: &PersistentVolume) -> Option<String> {
    pv.status.as_ref()?.phase.clone()
}

/// A server-side dry run of a reader pod asking for the cache: what the Pod webhook makes of it
/// (nothing is stored).
async fn dry_run_reader_pod(admin: &Client, ns: &str, n: usize) -> Pod {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("reader-{n}"),
                     "annotations": {annotations::MODEL_CACHE: REQUEST}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.2"}]}
    }))
    .unwrap();
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    Api::<Pod>::namespaced(admin.clone(), ns)
        .create(&pp, &pod)
        .await
        .unwrap()
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

#[tokio::test]
async fn a_model_cache_is_filled_read_and_released() {
    let c = Cluster::get().await;
    let s = settings(&c);
    let catalog = installed_catalog(&c, &s).await;

    // ---- 1. The cache StorageClass, for a catalog driver with a durable flow.
    let class = ensure_cache_class(&c, &s, &catalog).await;
    let provisioner = class.provisioner.clone();
    let entry = catalog.driver(&provisioner).unwrap().clone();
    let flow = derive_flow(&entry.access_modes).unwrap();
    let modes = required_modes(flow);
    let writer_mode = modes.first().unwrap().as_str();
    let reader_mode = modes.last().unwrap().as_str();

    // ---- 2. The request; the binding, the writer Lease, claim and Job.
    let ns = c.namespace("model-cache").await;
    let revision = format!("rev-{}", std::process::id());
    let mcs = Api::<ModelCache>::namespaced(c.admin.clone(), &ns);
    let created = mcs
        .create(&PostParams::default(), &request(&ns, &revision))
        .await
        .unwrap();
    let mc_uid = created.metadata.uid.clone().unwrap();

    let mc = wait_for("the request bound to a binding", WAIT, || async {
        let mc = mcs.get(REQUEST).await.ok()?;
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
    assert_eq!(selection.provisioner, provisioner);
    assert_eq!(selection.flow, flow);
    assert_eq!(selection.storage_class_name, s.storage_class);
    assert_eq!(
        Some(selection.storage_class_uid.as_str()),
        class.metadata.uid.as_deref()
    );
    // The digest of the writer template as the apiserver stored it, recorded before any side
    // effect.
    assert_eq!(
        st.writer_template_digest.as_deref(),
        Some(writer_template_digest(&mc).as_str())
    );

    let identity = names::identity_for(&mc);
    let bindings = Api::<ModelCacheBinding>::namespaced(c.admin.clone(), &s.control_namespace);
    let same_identity = bindings
        .list(&ListParams::default().labels(&format!(
            "{}={}",
            annotations::IDENTITY_LABEL,
            names::identity_label(&identity)
        )))
        .await
        .unwrap()
        .items;
    assert_eq!(same_identity.len(), 1, "one binding per identity");
    let binding = same_identity.into_iter().next().unwrap();
    let bname = binding.metadata.name.clone().unwrap();
    let buid = binding.metadata.uid.clone().unwrap();
    let recorded = st.binding.clone().unwrap();
    assert_eq!(
        (recorded.name.as_str(), recorded.uid.as_str()),
        (bname.as_str(), buid.as_str())
    );
    assert_eq!(bname, names::binding_name(&identity, 1));
    assert!(has_binding_finalizer(&binding), "{:?}", binding.metadata);
    assert_eq!(binding.phase(), BindingPhase::Active);
    assert_eq!(
        binding.references(),
        [RequestReference {
            namespace: ns.clone(),
            name: REQUEST.to_string(),
            uid: mc_uid.clone()
        }]
    );
    let d = &binding.spec.decision;
    assert_eq!(d.provisioner, provisioner);
    assert_eq!(d.flow, flow);
    assert_eq!(d.access_modes, modes);
    assert_eq!(d.reader_mount_options, entry.reader_mount_options);
    assert_eq!(d.volume_handle_namespace, entry.volume_handle_namespace);
    assert!(!d.encrypted, "the chart leaves ModelCacheEncryption off");
    assert_eq!(binding.spec.storage_class.name, s.storage_class);
    assert_eq!(
        Some(binding.spec.storage_class.uid.as_str()),
        class.metadata.uid.as_deref()
    );
    let wname = names::writer_name(&bname);
    let rclaim = names::reader_claim(&bname);
    let rpv = names::reader_pv(&bname, &ns);
    let res = &binding.spec.resources;
    assert_eq!(res.jobs, [NamespacedName::new(&ns, &wname)]);
    assert_eq!(
        res.lease,
        Some(NamespacedName::new(&s.control_namespace, &wname))
    );
    let mut claims_named = res.persistent_volume_claims.clone();
    claims_named.sort();
    let mut want = vec![
        NamespacedName::new(&ns, &rclaim),
        NamespacedName::new(&ns, &wname),
    ];
    want.sort();
    assert_eq!(claims_named, want);
    assert_eq!(res.persistent_volumes, std::slice::from_ref(&rpv));
    assert!(res.secrets.is_empty() && res.storage_classes.is_empty());

    let jobs = Api::<Job>::namespaced(c.admin.clone(), &ns);
    let claims = Api::<PersistentVolumeClaim>::namespaced(c.admin.clone(), &ns);
    let leases = Api::<Lease>::namespaced(c.admin.clone(), &s.control_namespace);
    let pvs = Api::<PersistentVolume>::all(c.admin.clone());
    let pods = Api::<Pod>::namespaced(c.admin.clone(), &ns);

    let job = wait_for("the writer Job", WAIT, || async {
        jobs.get_opt(&wname).await.ok()?
    })
    .await;
    // The writer election: the Lease names this request.
    let lease = leases.get(&wname).await.unwrap();
    assert_owned("writer Lease", &lease.metadata, &bname, &buid);
    assert_eq!(
        lease.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some(mc_uid.as_str())
    );
    // The writer claim: the flow's writer mode, the request's size, from the cache class.
    let wclaim = claims.get(&wname).await.unwrap();
    assert_owned("writer claim", &wclaim.metadata, &bname, &buid);
    let spec = wclaim.spec.as_ref().unwrap();
    assert_eq!(
        spec.access_modes.as_deref(),
        Some(&[writer_mode.to_string()][..])
    );
    assert_eq!(
        spec.storage_class_name.as_deref(),
        Some(s.storage_class.as_str())
    );
    assert_eq!(storage_request(&wclaim).as_deref(), Some(SIZE));
    assert_eq!(phase_of_claim(&wclaim).as_deref(), Some("Pending"));
    // The writer Job: the request's template, volume model-data on the writer claim.
    assert_owned("writer Job", &job.metadata, &bname, &buid);
    let tpl = &job.spec.as_ref().unwrap().template;
    assert_eq!(
        tpl.metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref())
            .and_then(|l| l.get(annotations::BINDING_LABEL))
            .map(String::as_str),
        Some(bname.as_str())
    );
    let pod_spec = tpl.spec.as_ref().unwrap();
    assert_eq!(pod_spec.restart_policy.as_deref(), Some("Never"));
    let vol = pod_spec
        .volumes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|v| v.name == "model-data")
        .expect("volume model-data");
    let pvc_src = vol.persistent_volume_claim.as_ref().unwrap();
    assert_eq!(pvc_src.claim_name, wname);
    assert_ne!(
        pvc_src.read_only,
        Some(true),
        "the writer mounts read-write"
    );
    let container = &pod_spec.containers[0];
    assert_eq!(container.image.as_deref(), Some(IMAGE));
    let env: Vec<(String, String)> = container
        .env
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect();
    for (k, v) in [
        ("MODEL_CACHE_PATH", "/model-data"),
        ("MODEL_SOURCE_URI", URI),
        ("MODEL_SOURCE_REVISION", revision.as_str()),
    ] {
        assert!(
            env.contains(&(k.to_string(), v.to_string())),
            "{k}={v} in {env:?}"
        );
    }
    wait_for("Ready=False WriterRunning", WAIT, || async {
        let mc = mcs.get(REQUEST).await.ok()?;
        (mc_cond(&mc, "Ready") == is("False", "WriterRunning")).then_some(())
    })
    .await;
    // Not ready: the Pod webhook leaves a reader pod alone.
    assert_eq!(
        wired_claim(&dry_run_reader_pod(&c.admin, &ns, 0).await),
        None
    );

    // ---- 3a. The provisioner's part: a PV for the writer claim, pre-bound to it; the real PV
    // controller binds the pair.
    let wclaim_uid = wclaim.metadata.uid.clone().unwrap();
    let wpv_name = format!("pvc-{wclaim_uid}");
    let handle = volume_handle(&entry, &ns, &wpv_name);
    let wpv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": wpv_name,
                     "labels": {"inferencecache.io/test": "real-apiserver"},
                     "annotations": {"pv.kubernetes.io/provisioned-by": provisioner}},
        "spec": {
            "accessModes": [writer_mode],
            "capacity": {"storage": SIZE},
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": s.storage_class,
            "volumeMode": "Filesystem",
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "namespace": ns, "name": wname, "uid": wclaim_uid},
            "csi": {"driver": provisioner, "volumeHandle": handle, "fsType": "xfs",
                    "volumeAttributes": {"pool": "cache-pool"}}
        }
    }))
    .unwrap();
    pvs.create(&PostParams::default(), &wpv).await.unwrap();
    wait_for(
        "the writer claim bound by the PV controller",
        WAIT,
        || async {
            let cl = claims.get(&wname).await.ok()?;
            let bound = phase_of_claim(&cl).as_deref() == Some("Bound")
                && cl.spec.as_ref()?.volume_name.as_deref() == Some(wpv_name.as_str());
            let pv = pvs.get(&wpv_name).await.ok()?;
            (bound && phase_of_volume(&pv).as_deref() == Some("Bound")).then_some(())
        },
    )
    .await;
    // Job done only when the claim is bound and the Job complete: still running.
    let mc = mcs.get(REQUEST).await.unwrap();
    assert_eq!(mc_cond(&mc, "Ready"), is("False", "WriterRunning"));

    // ---- 3b. The kubelet's part: the writer pod ran and exited 0; the real Job controller
    // completes the Job.
    let job_pods = ListParams::default().labels(&format!("batch.kubernetes.io/job-name={wname}"));
    let pod = wait_for("the writer pod", WAIT, || async {
        pods.list(&job_pods).await.ok()?.items.into_iter().next()
    })
    .await;
    let pod_name = pod.metadata.name.clone().unwrap();
    let ps = pod.spec.as_ref().unwrap();
    assert!(ps.volumes.as_deref().unwrap_or_default().iter().any(|v| v
        .persistent_volume_claim
        .as_ref()
        .map(|p| p.claim_name.as_str())
        == Some(wname.as_str())));
    let now = Time(Timestamp::now());
    pods.patch_status(
        &pod_name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Succeeded",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted",
                            "lastTransitionTime": now}],
            "containerStatuses": [{
                "name": "fetch", "image": IMAGE, "imageID": "", "ready": false,
                "restartCount": 0, "started": false,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                         "startedAt": now, "finishedAt": now}}
            }]
        }})),
    )
    .await
    .unwrap();
    wait_for("the writer Job Complete", WAIT, || async {
        let j = jobs.get(&wname).await.ok()?;
        let st = j.status?;
        let complete = st
            .conditions
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Complete" && c.status == "True");
        (complete && st.succeeded == Some(1)).then_some(())
    })
    .await;

    // ---- 4. Readers: a reader PV derived from the writer's, a claim pre-bound to it; Ready.
    let mc = wait_for("Ready=True ReadersReady", WAIT, || async {
        let mc = mcs.get(REQUEST).await.ok()?;
        (mc_cond(&mc, "Ready") == is("True", "ReadersReady")).then_some(mc)
    })
    .await;
    let st = mc.status.clone().unwrap();
    assert_eq!(st.reader_claim.as_deref(), Some(rclaim.as_str()));
    assert_eq!(st.reader_namespaces, std::slice::from_ref(&ns));
    assert_eq!(st.mode, Some(CacheMode::Durable));
    let binding = bindings.get(&bname).await.unwrap();
    assert_eq!(
        binding
            .status
            .as_ref()
            .unwrap()
            .writer_volume_name
            .as_deref(),
        Some(wpv_name.as_str()),
        "the binding records the writer's volume"
    );
    let reader = pvs.get(&rpv).await.unwrap();
    assert_owned("reader PV", &reader.metadata, &bname, &buid);
    let rs = reader.spec.as_ref().unwrap();
    let csi = rs.csi.as_ref().unwrap();
    assert_eq!(csi.driver, provisioner);
    // Same namespace as the writer: the handle is the writer's, unchanged.
    assert_eq!(csi.volume_handle, handle);
    assert_eq!(csi.read_only, Some(true));
    assert_eq!(
        rs.mount_options.clone().unwrap_or_default(),
        entry.reader_mount_options
    );
    assert_eq!(rs.storage_class_name.as_deref().unwrap_or(""), "");
    assert_eq!(
        rs.persistent_volume_reclaim_policy.as_deref(),
        Some("Retain")
    );
    assert_eq!(
        rs.access_modes.as_deref(),
        Some(&[reader_mode.to_string()][..])
    );
    assert_eq!(
        rs.capacity
            .as_ref()
            .and_then(|c| c.get("storage"))
            .map(|q| q.0.as_str()),
        Some(SIZE)
    );
    let cref = rs.claim_ref.as_ref().unwrap();
    assert_eq!(
        (cref.namespace.as_deref(), cref.name.as_deref()),
        (Some(ns.as_str()), Some(rclaim.as_str()))
    );
    assert_eq!(phase_of_volume(&reader).as_deref(), Some("Bound"));
    let rc = claims.get(&rclaim).await.unwrap();
    assert_owned("reader claim", &rc.metadata, &bname, &buid);
    let rcs = rc.spec.as_ref().unwrap();
    assert_eq!(rcs.storage_class_name.as_deref(), Some(""));
    assert_eq!(rcs.volume_name.as_deref(), Some(rpv.as_str()));
    assert_eq!(
        rcs.access_modes.as_deref(),
        Some(&[reader_mode.to_string()][..])
    );
    assert_eq!(phase_of_claim(&rc).as_deref(), Some("Bound"));

    // A reader pod asking for the cache is wired to the reader claim, read-only (the Pod
    // webhook as the apiserver calls it; its store of requests catches up within seconds).
    let mut n = 0;
    let wired = wait_for("a reader pod wired to the reader claim", WAIT, || {
        n += 1;
        let (admin, ns) = (c.admin.clone(), ns.clone());
        async move { wired_claim(&dry_run_reader_pod(&admin, &ns, n).await) }
    })
    .await;
    assert_eq!(wired, rclaim);

    // ---- 5. The request goes: the binding keeps everything through the idle period, then
    // retires and releases exactly what it names.
    mcs.delete(REQUEST, &DeleteParams::default()).await.unwrap();
    wait_for("the request gone", WAIT, || async {
        mcs.get_opt(REQUEST).await.ok()?.is_none().then_some(())
    })
    .await;
    // The webhook no longer wires pods to it.
    let mut n = 100;
    wait_for("a reader pod left unwired", WAIT, || {
        n += 1;
        let (admin, ns) = (c.admin.clone(), ns.clone());
        async move {
            wired_claim(&dry_run_reader_pod(&admin, &ns, n).await)
                .is_none()
                .then_some(())
        }
    })
    .await;

    // Stand-in for the binding's 5-minute resync: any watch event makes it look again.
    bindings
        .patch(
            &bname,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "inferencecache.io/test-resync": Timestamp::now().to_string()}}})),
        )
        .await
        .unwrap();
    let idle = wait_for(
        "the reference pruned and the idle period started",
        WAIT,
        || async {
            let b = bindings.get(&bname).await.ok()?;
            let since = b.status.as_ref()?.idle_since.clone()?;
            b.references().is_empty().then_some((b, since))
        },
    )
    .await;
    let (b, since) = idle;
    assert_eq!(b.phase(), BindingPhase::Active, "idle, not yet retiring");
    assert!(has_binding_finalizer(&b));
    let age = Timestamp::now().duration_since(since.0);
    assert!(
        age >= SignedDuration::ZERO - SignedDuration::from_secs(5)
            && age < SignedDuration::from_secs(120),
        "idleSince {since:?} is the pruning time"
    );
    // Within the idle period nothing is released.
    assert!(jobs.get_opt(&wname).await.unwrap().is_some());
    assert!(claims.get_opt(&wname).await.unwrap().is_some());
    assert!(claims.get_opt(&rclaim).await.unwrap().is_some());
    assert!(pvs.get_opt(&rpv).await.unwrap().is_some());
    assert!(leases.get_opt(&wname).await.unwrap().is_some());

    // Every state of the binding from here on, as a watch sees it.
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let seen_w = seen.clone();
    let wapi = bindings.clone();
    let field = format!("metadata.name={bname}");
    let watch = tokio::spawn(async move {
        let mut s = watcher(wapi, watcher::Config::default().fields(&field)).boxed();
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
    let past = Timestamp::now() - SignedDuration::from_secs(s.idle_seconds + 60);
    let past = Time(Timestamp::from_second(past.as_second()).unwrap());
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
    // A release pass may race the real PV binder: deleting the reader claim makes it update
    // the reader PV's status (Bound → Released) between the controller's read of the PV and
    // its preconditioned delete, which the apiserver refuses (409): the PV is kept as
    // ChangedSinceRead, with the finalizer, and read again on the next pass. Nothing is ever
    // kept for another reason here (every named object is the binding's, every volume Retains).
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
                        .all(|(o, r)| r == "ChangedSinceRead"
                            && o == &format!("PersistentVolume {rpv}")),
                "only the reader PV's race with the PV binder keeps anything: {seen:#?}"
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

    // What the binding named is gone (the protection finalizers cleared by the real
    // controller-manager, the writer pod collected with its Job).
    wait_for("the named objects gone", WAIT, || async {
        let gone = jobs.get_opt(&wname).await.ok()?.is_none()
            && pods.list(&job_pods).await.ok()?.items.is_empty()
            && claims.get_opt(&wname).await.ok()?.is_none()
            && claims.get_opt(&rclaim).await.ok()?.is_none()
            && pvs.get_opt(&rpv).await.ok()?.is_none()
            && leases.get_opt(&wname).await.ok()?.is_none();
        gone.then_some(())
    })
    .await;
    // The writer's volume is not named: under Retain it stays, Released, for the storage
    // administrator — the cache's data is never deleted by the controller.
    let kept = wait_for("the writer volume Released", WAIT, || async {
        let pv = pvs.get_opt(&wpv_name).await.ok()??;
        (phase_of_volume(&pv).as_deref() == Some("Released")).then_some(pv)
    })
    .await;
    assert!(kept.metadata.deletion_timestamp.is_none());
    assert_eq!(
        kept.spec
            .as_ref()
            .unwrap()
            .persistent_volume_reclaim_policy
            .as_deref(),
        Some("Retain")
    );

    // The storage administrator reclaims it; the namespace goes.
    pvs.delete(&wpv_name, &DeleteParams::default())
        .await
        .unwrap();
    c.drop_namespace(&ns).await;
}
