//! The model-cache runtime flow (spec 004 "Runtime flow" steps 1–6), one or more tests per step,
//! against the in-memory API.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod model_cache_support;

use std::time::Duration;

use ic_controller::reconcile::model_cache::names;
use ic_controller::reconcile::model_cache::FeatureFlags;
use ic_shared::crd::{
    annotations, AccessMode, BindingPhase, CacheMode, Flow, ModelCacheBinding, NamespacedName,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::Api;
use model_cache_support::*;
use serde_json::json;

const SELECTED: &str = "Selected";
const READY: &str = "Ready";

async fn only_binding(h: &Harness) -> ModelCacheBinding {
    let mut all = h.bindings().await;
    assert_eq!(all.len(), 1, "bindings: {all:#?}");
    all.remove(0)
}

// ----------------------------------------------------------------------------- step 1: gates

#[tokio::test]
async fn step1_caching_support_off_records_none_and_no_binding() {
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .flags(FeatureFlags {
            caching_support: false,
            ..FeatureFlags::default()
        })
        .build()
        .await;
    h.ok(NS, "a").await;
    let s = h.status(NS, "a").await;
    assert_eq!(s.mode, Some(CacheMode::None));
    assert!(s.binding.is_none() && s.selection.is_none());
    assert_eq!(
        h.cond(NS, "a", SELECTED).await,
        is("True", "CachingSupportDisabled")
    );
    assert_eq!(
        h.cond(NS, "a", READY).await,
        is("True", "NothingToProvision")
    );
    assert!(h.bindings().await.is_empty());
    assert_eq!(h.side_effects().await, 0);
}

#[tokio::test]
async fn step1_helm_model_caching_off_gates_only_helm_requests() {
    let h = Setup::rwx()
        .with(&helm("h", NS, &["b"]))
        .with(&regular("r", NS, "r1"))
        .flags(FeatureFlags {
            helm_model_caching: false,
            ..FeatureFlags::default()
        })
        .build()
        .await;
    h.ok(NS, "h").await;
    h.ok(NS, "r").await;
    assert_eq!(h.status(NS, "h").await.mode, Some(CacheMode::None));
    assert_eq!(
        h.cond(NS, "h", SELECTED).await,
        is("True", "HelmModelCachingDisabled")
    );
    assert_eq!(h.status(NS, "r").await.mode, Some(CacheMode::Durable));
    assert_eq!(h.bindings().await.len(), 1);
}

#[tokio::test]
async fn step1_ephemeral_requested_records_ephemeral() {
    let mut mc = regular("e", NS, "r1");
    mc.spec.durability = Some(ic_shared::crd::Durability::Ephemeral);
    let h = Setup::nvmesh().with(&mc).build().await;
    h.ok(NS, "e").await;
    assert_eq!(h.status(NS, "e").await.mode, Some(CacheMode::Ephemeral));
    assert_eq!(
        h.cond(NS, "e", SELECTED).await,
        is("True", "EphemeralRequested")
    );
    assert_eq!(h.side_effects().await, 0);
}

// ----------------------------------------------------------------------------- step 2: class, catalog, flow

#[tokio::test]
async fn step2_the_class_must_exist_and_retain() {
    for (class, reason) in [
        (None, "StorageClassNotFound"),
        (
            Some(storage_class(NVMESH, Some("Delete"))),
            "ReclaimPolicyNotRetain",
        ),
        // An unset reclaim policy is the API server's default, Delete.
        (Some(storage_class(NVMESH, None)), "ReclaimPolicyNotRetain"),
    ] {
        let mut setup = Setup::default()
            .with(&catalog_cm(&catalog_text()))
            .with(&regular("a", NS, "r1"));
        if let Some(c) = &class {
            setup = setup.with(c);
        }
        let h = setup.build().await;
        h.ok(NS, "a").await;
        let s = h.status(NS, "a").await;
        assert_eq!(s.mode, Some(CacheMode::Ephemeral), "{reason}");
        assert_eq!(h.cond(NS, "a", SELECTED).await, is("True", reason));
        assert!(h.bindings().await.is_empty());
        assert_eq!(h.side_effects().await, 0);
    }
}

#[tokio::test]
async fn step2_no_derivable_flow_means_no_durable_cache_and_says_why() {
    let no_rule = json!({"drivers": [
        {"name": NVMESH, "provider": "nvmesh", "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
         "readerMountOptions": ["ro"]}]})
    .to_string();
    let cases: Vec<(&str, String, ic_shared::crd::ModelCache, FeatureFlags, &str)> = vec![
        (
            "csi.weka.io",
            catalog_text(),
            regular("a", NS, "r1"),
            FeatureFlags::default(),
            "NoQualifiedModes",
        ),
        (
            "ebs.csi.aws.com",
            catalog_text(),
            regular("a", NS, "r1"),
            FeatureFlags::default(),
            "ProvisionerNotInCatalog",
        ),
        (
            NVMESH,
            no_rule,
            helm("a", NS, &["b"]),
            FeatureFlags::default(),
            "CrossNamespaceUnsupported",
        ),
        (
            FSS,
            catalog_text(),
            regular("a", NS, "r1"),
            FeatureFlags {
                model_cache_encryption: true,
                ..FeatureFlags::default()
            },
            "EncryptionUnsupported",
        ),
    ];
    for (provisioner, catalog, mc, flags, reason) in cases {
        let h = Setup::default()
            .with(&catalog_cm(&catalog))
            .with(&storage_class(provisioner, Some("Retain")))
            .with(&mc)
            .flags(flags)
            .build()
            .await;
        h.ok(NS, "a").await;
        let s = h.status(NS, "a").await;
        assert_eq!(s.mode, Some(CacheMode::Ephemeral), "{reason}");
        assert_eq!(h.cond(NS, "a", SELECTED).await, is("True", reason));
        let msg = ic_shared::crd::find_condition(&s.conditions, SELECTED)
            .unwrap()
            .message
            .clone();
        assert!(msg.contains(provisioner), "{reason}: {msg}");
        assert!(h.bindings().await.is_empty(), "{reason}");
        assert_eq!(h.side_effects().await, 0, "{reason}");
    }
}

#[tokio::test]
async fn step2_a_missing_or_invalid_catalog_records_nothing_and_retries() {
    for catalog in [
        None,
        Some(
            r#"{"drivers": [{"name": "x", "provider": "p", "accessModes": ["ReadOnlyMany"], "readerMountOptions": []}]}"#,
        ),
    ] {
        let mut setup = Setup::default()
            .with(&storage_class(NVMESH, Some("Retain")))
            .with(&regular("a", NS, "r1"));
        if let Some(text) = catalog {
            setup = setup.with(&catalog_cm(text));
        }
        let h = setup.build().await;
        let action = h.ok(NS, "a").await;
        assert_ne!(action, kube::runtime::controller::Action::await_change());
        let s = h.status(NS, "a").await;
        assert_eq!(s.mode, None, "nothing is recorded on a broken catalog");
        assert_eq!(
            h.cond(NS, "a", SELECTED).await,
            is("False", "CatalogInvalid")
        );
        assert!(h.bindings().await.is_empty());
        // Fixing the catalog lets the same request go on.
        match catalog {
            None => {
                Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(h.client.clone(), CAT_NS)
                    .create(&Default::default(), &catalog_cm(&catalog_text()))
                    .await
                    .unwrap();
            }
            Some(_) => h.set_catalog(&catalog_text()).await,
        }
        h.ok(NS, "a").await;
        assert_eq!(h.status(NS, "a").await.mode, Some(CacheMode::Durable));
    }
}

// ----------------------------------------------------------------------------- step 3: get or create the binding

#[tokio::test]
async fn step3_one_binding_per_identity_joined_by_every_request() {
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .with(&regular("b", NS, "r1"))
        .with(&regular("c", NS, "r2"))
        .build()
        .await;
    for n in ["a", "b", "c"] {
        h.ok(NS, n).await;
    }
    let all = h.bindings().await;
    assert_eq!(
        all.len(),
        2,
        "same source+revision share, another revision does not"
    );
    let a = h.status(NS, "a").await.binding.unwrap();
    let b = h.status(NS, "b").await.binding.unwrap();
    let c = h.status(NS, "c").await.binding.unwrap();
    assert_eq!(a, b);
    assert_ne!(a.name, c.name);
    let shared = h.binding(&a.name).await.unwrap();
    assert_eq!(shared.metadata.uid.as_deref(), Some(a.uid.as_str()));
    let refs: Vec<&str> = shared
        .references()
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(refs, vec!["a", "b"]);
    assert_eq!(shared.references()[0].uid, format!("uid-{NS}-a"));
    // Identity, finalizer, label, decision, class.
    let mc = h.request(NS, "a").await;
    let identity = names::identity_for(&mc);
    assert_eq!(shared.spec.identity, identity);
    assert_eq!(a.name, names::binding_name(&identity, 1));
    assert_eq!(
        shared.metadata.finalizers,
        Some(vec![annotations::BINDING_FINALIZER.to_string()])
    );
    assert_eq!(
        labels_of(&shared.metadata).get(annotations::IDENTITY_LABEL),
        Some(&names::identity_label(&identity))
    );
    assert_eq!(shared.spec.decision.flow, Flow::RoxReadOnly);
    assert_eq!(shared.spec.decision.provisioner, NVMESH);
    assert_eq!(
        shared.spec.decision.access_modes,
        vec![AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany]
    );
    assert_eq!(shared.spec.storage_class.name, SC);
    assert_eq!(shared.spec.storage_class.uid, "sc-uid-1");
    assert_eq!(shared.phase(), BindingPhase::Active);
}

#[tokio::test]
async fn step3_a_retiring_binding_is_never_joined() {
    let mc = regular("a", NS, "r1");
    let identity = names::identity_for(&mc);
    let old_name = names::binding_name(&identity, 1);
    let retiring: ModelCacheBinding = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCacheBinding",
        "metadata": {"name": old_name, "namespace": CTL, "uid": "old-uid",
                     "labels": {annotations::IDENTITY_LABEL: names::identity_label(&identity)},
                     "finalizers": [annotations::BINDING_FINALIZER]},
        "spec": {"identity": identity, "decision": {"provider": "nvmesh", "provisioner": NVMESH,
                 "flow": "roxReadOnly", "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
                 "catalogProfileDigest": "x"},
                 "storageClass": {"name": SC, "uid": "sc-uid-1", "reclaimPolicy": "Retain", "configurationDigest": "y"},
                 "resources": {}},
        "status": {"phase": "Retiring"}
    }))
    .unwrap();
    let h = Setup::nvmesh().with(&mc).with(&retiring).build().await;
    h.ok(NS, "a").await;
    let bound = h.status(NS, "a").await.binding.unwrap();
    assert_eq!(bound.name, names::binding_name(&identity, 2));
    assert_ne!(bound.uid, "old-uid");
    let old = h.binding(&old_name).await.unwrap();
    assert!(
        old.references().is_empty(),
        "the retiring binding gained no reference"
    );
    assert_eq!(old.phase(), BindingPhase::Retiring);
}

// ----------------------------------------------------------------------------- step 4: reference first

#[tokio::test]
async fn step4_reference_and_binding_are_persisted_before_any_storage_side_effect() {
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let log = h.calls.log();
    let first_storage = log
        .iter()
        .position(|l| {
            [
                "create Lease",
                "create PersistentVolumeClaim",
                "create Job",
                "create PersistentVolume",
                "create Secret",
                "create StorageClass",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .unwrap_or_else(|| panic!("no storage side effect in {log:#?}"));
    let created = h.calls.first("create ModelCacheBinding").unwrap();
    let referenced = h.calls.first("status ModelCacheBinding").unwrap();
    let recorded = log
        .iter()
        .enumerate()
        .filter(|(_, l)| l.as_str() == "status a")
        .map(|(i, _)| i)
        .find(|i| *i > referenced)
        .unwrap_or_else(|| panic!("request status not written after the reference: {log:#?}"));
    assert!(
        created < referenced && referenced < recorded && recorded < first_storage,
        "{log:#?}"
    );
    // The request's record is exactly the binding's name and UID.
    let b = only_binding(&h).await;
    let s = h.status(NS, "a").await;
    assert_eq!(
        s.binding.as_ref().unwrap().name,
        b.metadata.name.clone().unwrap()
    );
    assert_eq!(
        s.binding.as_ref().unwrap().uid,
        b.metadata.uid.clone().unwrap()
    );
    assert_eq!(s.mode, Some(CacheMode::Durable));
    assert_eq!(s.selection.as_ref().unwrap().provisioner, NVMESH);
}

// ----------------------------------------------------------------------------- step 5: writer, readers

#[tokio::test]
async fn step5_one_writer_then_readers_derived_from_its_volume() {
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .with(&regular("b", NS, "r1"))
        .build()
        .await;
    h.ok(NS, "a").await;
    h.ok(NS, "b").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    let wname = names::writer_name(&bname);
    // One Lease held by the first request, one writer claim and Job, in the request namespace.
    let lease = Api::<Lease>::namespaced(h.client.clone(), CTL)
        .get(&wname)
        .await
        .unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some(format!("uid-{NS}-a").as_str())
    );
    assert_eq!(h.names::<Job>(None).await, vec![wname.clone()]);
    assert_eq!(h.cond(NS, "a", READY).await, is("False", "WriterRunning"));
    assert_eq!(
        h.cond(NS, "b", READY).await,
        is("False", "WriterRunning"),
        "b waits for the Job a's election created"
    );
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .get(&wname)
        .await
        .unwrap();
    let cs = claim.spec.clone().unwrap();
    assert_eq!(cs.access_modes, Some(vec!["ReadWriteOnce".to_string()]));
    assert_eq!(cs.storage_class_name.as_deref(), Some(SC));
    assert_eq!(cs.resources.unwrap().requests.unwrap()["storage"].0, "40Gi");
    assert_eq!(
        labels_of(&claim.metadata).get(annotations::BINDING_LABEL),
        Some(&bname)
    );
    // The writer Job mounts the claim read-write and knows what to fetch.
    let job = Api::<Job>::namespaced(h.client.clone(), NS)
        .get(&wname)
        .await
        .unwrap();
    let pod = job.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    let vol = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "model-data")
        .unwrap();
    assert_eq!(vol.persistent_volume_claim.unwrap().claim_name, wname);
    let c = &pod.containers[0];
    assert_eq!(
        c.volume_mounts.as_ref().unwrap()[0].mount_path,
        "/model-data"
    );
    let env: Vec<(String, String)> = c
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    assert!(env.contains(&("MODEL_SOURCE_REVISION".into(), "r1".into())));
    // No reader before the writer finished.
    assert!(h.names::<PersistentVolume>(None).await.is_empty());

    h.complete_writer(&b, NVMESH, &format!("nvmesh/{NS}/vol-1"))
        .await;
    h.ok(NS, "a").await;
    h.ok(NS, "b").await;
    let b = only_binding(&h).await;
    assert_eq!(
        b.status.as_ref().unwrap().writer_volume_name.as_deref(),
        Some(format!("pvc-{bname}").as_str())
    );
    // Reader PV: a static copy of the writer's PV.
    let pv_name = names::reader_pv(&bname, NS);
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&pv_name)
        .await
        .unwrap();
    let spec = pv.spec.clone().unwrap();
    assert_eq!(spec.storage_class_name, None, "storageClassName cleared");
    let csi = spec.csi.unwrap();
    assert_eq!(csi.read_only, Some(true));
    assert_eq!(
        csi.volume_handle,
        format!("nvmesh/{NS}/vol-1"),
        "same namespace: handle unchanged"
    );
    assert_eq!(csi.fs_type.as_deref(), Some("xfs"));
    assert_eq!(
        spec.mount_options,
        Some(vec!["ro".into(), "norecovery".into(), "nouuid".into()])
    );
    assert_eq!(spec.access_modes, Some(vec!["ReadOnlyMany".to_string()]));
    assert_eq!(
        spec.persistent_volume_reclaim_policy.as_deref(),
        Some("Retain")
    );
    let cref = spec.claim_ref.unwrap();
    assert_eq!(
        (cref.namespace.as_deref(), cref.name.as_deref()),
        (Some(NS), Some(names::reader_claim(&bname).as_str()))
    );
    assert!(!pv
        .metadata
        .annotations
        .unwrap()
        .contains_key("pv.kubernetes.io/provisioned-by"));
    // Reader claim pre-bound by name.
    let rc = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .get(&names::reader_claim(&bname))
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(rc.volume_name.as_deref(), Some(pv_name.as_str()));
    assert_eq!(rc.storage_class_name.as_deref(), Some(""));
    assert_eq!(rc.access_modes, Some(vec!["ReadOnlyMany".to_string()]));
    for n in ["a", "b"] {
        let s = h.status(NS, n).await;
        assert_eq!(h.cond(NS, n, READY).await, is("True", "ReadersReady"));
        assert_eq!(
            s.reader_claim.as_deref(),
            Some(names::reader_claim(&bname).as_str())
        );
        assert_eq!(s.reader_namespaces, vec![NS.to_string()]);
    }
    // Still one writer Job, one reader PV for the namespace.
    assert_eq!(h.names::<Job>(None).await.len(), 1);
    assert_eq!(h.names::<PersistentVolume>(None).await.len(), 2);
}

#[tokio::test]
async fn step5_the_lease_passes_on_when_an_elected_writer_never_starts() {
    let mut broken = regular("a", NS, "r1");
    broken.spec.writer.template = json!({"spec": {"containers": []}});
    let h = Setup::nvmesh()
        .with(&broken)
        .with(&regular("b", NS, "r1"))
        .build()
        .await;
    h.ok(NS, "a").await;
    assert_eq!(
        h.cond(NS, "a", READY).await,
        is("False", "WriterTemplateInvalid")
    );
    h.ok(NS, "b").await;
    assert_eq!(
        h.cond(NS, "b", READY).await,
        is("False", "WriterElectedElsewhere")
    );
    assert!(h.names::<Job>(None).await.is_empty());
    h.clock.advance(Duration::from_secs(601));
    h.ok(NS, "b").await;
    assert_eq!(h.cond(NS, "b", READY).await, is("False", "WriterRunning"));
    let bname = only_binding(&h).await.metadata.name.unwrap();
    let lease = Api::<Lease>::namespaced(h.client.clone(), CTL)
        .get(&names::writer_name(&bname))
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(
        lease.holder_identity.as_deref(),
        Some(format!("uid-{NS}-b").as_str())
    );
    assert_eq!(lease.lease_transitions, Some(1));
    assert_eq!(h.names::<Job>(Some(NS)).await.len(), 1);
}

#[tokio::test]
async fn step5_helm_readers_in_other_namespaces_get_rewritten_handles() {
    let h = Setup::nvmesh()
        .with(&helm("h1", NS, &["ns-b", "ns-c"]))
        .with(&helm("h2", "team-z", &["ns-c", "ns-d"]))
        .build()
        .await;
    h.ok(NS, "h1").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    // The writer runs in the control namespace with the writer service account.
    let job = Api::<Job>::namespaced(h.client.clone(), CTL)
        .get(&names::writer_name(&bname))
        .await
        .unwrap();
    let pod = job.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("default"));
    assert_eq!(pod.automount_service_account_token, Some(false));
    // Reader objects of the first request are named by the binding's spec.
    assert!(b
        .spec
        .resources
        .persistent_volumes
        .contains(&names::reader_pv(&bname, "ns-b")));
    // The second request (same sharing domain "org", another namespace) joins; its new reader
    // namespace is recorded on the binding before anything is created there.
    h.ok("team-z", "h2").await;
    let b = only_binding(&h).await;
    assert_eq!(b.references().len(), 2);
    let extra = b
        .status
        .as_ref()
        .unwrap()
        .additional_resources
        .clone()
        .unwrap();
    assert_eq!(
        extra.persistent_volumes,
        vec![names::reader_pv(&bname, "ns-d")]
    );
    assert_eq!(
        extra.persistent_volume_claims,
        vec![NamespacedName::new("ns-d", names::reader_claim(&bname))]
    );
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{CTL}/vol-7"))
        .await;
    h.ok(NS, "h1").await;
    h.ok("team-z", "h2").await;
    for ns in ["ns-b", "ns-c", "ns-d"] {
        let pv = Api::<PersistentVolume>::all(h.client.clone())
            .get(&names::reader_pv(&bname, ns))
            .await
            .unwrap();
        assert_eq!(
            pv.spec.unwrap().csi.unwrap().volume_handle,
            format!("nvmesh/{ns}/vol-7")
        );
        Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), ns)
            .get(&names::reader_claim(&bname))
            .await
            .unwrap();
    }
    assert_eq!(
        h.status("team-z", "h2").await.reader_namespaces,
        vec!["ns-c", "ns-d"]
    );
    assert_eq!(h.cond(NS, "h1", READY).await, is("True", "ReadersReady"));
}

#[tokio::test]
async fn step5_rwx_flow_shares_the_handle_across_namespaces() {
    let h = Setup::rwx().with(&helm("h", NS, &["ns-b"])).build().await;
    h.ok(NS, "h").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    assert_eq!(b.spec.decision.flow, Flow::RwxReadOnly);
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), CTL)
        .get(&names::writer_name(&bname))
        .await
        .unwrap();
    assert_eq!(
        claim.spec.unwrap().access_modes,
        Some(vec!["ReadWriteMany".to_string()])
    );
    h.complete_writer(&b, FSS, "ocid1.filesystem.oc1..x:10.0.0.5:/export")
        .await;
    h.ok(NS, "h").await;
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&names::reader_pv(&bname, "ns-b"))
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(
        pv.csi.as_ref().unwrap().volume_handle,
        "ocid1.filesystem.oc1..x:10.0.0.5:/export"
    );
    assert_eq!(pv.csi.unwrap().read_only, Some(true));
    assert_eq!(pv.access_modes, Some(vec!["ReadWriteMany".to_string()]));
    assert_eq!(pv.mount_options, Some(vec!["ro".to_string()]));
}

#[tokio::test]
async fn step5_an_encrypted_cache_owns_its_key_and_class() {
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .flags(FeatureFlags {
            model_cache_encryption: true,
            ..FeatureFlags::default()
        })
        .build()
        .await;
    h.ok(NS, "a").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    assert!(b.spec.decision.encrypted);
    assert_eq!(
        b.spec.resources.secrets,
        vec![NamespacedName::new(CTL, names::key_secret(&bname))]
    );
    assert_eq!(
        b.spec.resources.storage_classes,
        vec![names::encrypted_class(&bname)]
    );
    let secret = Api::<Secret>::namespaced(h.client.clone(), CTL)
        .get(&names::key_secret(&bname))
        .await
        .unwrap();
    assert_eq!(secret.data.unwrap()["key"].0.len(), 64);
    let sc = Api::<StorageClass>::all(h.client.clone())
        .get(&names::encrypted_class(&bname))
        .await
        .unwrap();
    let params = sc.parameters.unwrap();
    assert_eq!(
        params["csi.storage.k8s.io/node-stage-secret-name"],
        names::key_secret(&bname)
    );
    assert_eq!(
        params["pool"], "fast",
        "the base class's parameters are kept"
    );
    assert_eq!(sc.reclaim_policy.as_deref(), Some("Retain"));
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .get(&names::writer_name(&bname))
        .await
        .unwrap();
    assert_eq!(
        claim.spec.unwrap().storage_class_name,
        Some(names::encrypted_class(&bname))
    );
}

// ----------------------------------------------------------------------------- step 6: the binding stays authoritative

#[tokio::test]
async fn step6_catalog_flag_and_class_changes_after_binding_never_alter_it() {
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let before = only_binding(&h).await;
    h.complete_writer(&before, NVMESH, &format!("nvmesh/{NS}/vol-1"))
        .await;
    // Everything changes after the binding exists: the catalog drops NVMesh's options and
    // qualifies another driver, the class is replaced, caching is switched off.
    h.set_catalog(&json!({"drivers": [{"name": FSS, "provider": "oci-fss", "accessModes": ["ReadWriteMany"], "readerMountOptions": []}]}).to_string()).await;
    h.replace_class(FSS, "Retain").await;
    let h2 = {
        // Same API, flags now off.
        let mut cfg = h.ctx.config.clone();
        cfg.flags = FeatureFlags {
            caching_support: false,
            helm_model_caching: false,
            model_cache_encryption: true,
        };
        model_cache_support::Harness {
            client: h.client.clone(),
            ctx: std::sync::Arc::new(ic_controller::reconcile::model_cache::Context::new(
                h.client.clone(),
                cfg,
                h.clock.clone(),
                std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
            )),
            clock: h.clock.clone(),
            calls: h.calls.clone(),
        }
    };
    h2.ok(NS, "a").await;
    let after = only_binding(&h2).await;
    assert_eq!(after.spec, before.spec, "the binding's spec never changes");
    assert_eq!(h2.status(NS, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(h2.cond(NS, "a", READY).await, is("True", "ReadersReady"));
    // Readers follow the recorded decision, not the edited catalog.
    let bname = after.metadata.name.clone().unwrap();
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&names::reader_pv(&bname, NS))
        .await
        .unwrap();
    assert_eq!(
        pv.spec.unwrap().mount_options,
        Some(vec!["ro".into(), "norecovery".into(), "nouuid".into()])
    );
}

#[tokio::test]
async fn step6_a_replaced_class_stops_provisioning_instead_of_switching() {
    // The binding exists and references the request, but no writer claim yet; then the class
    // is replaced (new UID, another provisioner).
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .intercept(|calls| {
            let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
            model_cache_support::recording(calls).create(move |ctx| {
                let kind = ctx
                    .object
                    .get("kind")
                    .and_then(|k| k.as_str())
                    .unwrap_or("");
                if kind == "Lease" && fail.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    return Err(server_error());
                }
                Ok(None)
            })
        })
        .build()
        .await;
    assert!(
        h.reconcile(NS, "a").await.is_err(),
        "the Lease create failed transiently"
    );
    let before = only_binding(&h).await;
    assert_eq!(h.status(NS, "a").await.mode, Some(CacheMode::Durable));
    h.replace_class(FSS, "Retain").await;
    h.ok(NS, "a").await;
    assert_eq!(
        h.cond(NS, "a", READY).await,
        is("False", "StorageClassChanged")
    );
    assert!(
        h.names::<PersistentVolumeClaim>(None).await.is_empty(),
        "nothing provisioned from the new class"
    );
    assert!(h.names::<Job>(None).await.is_empty());
    assert_eq!(only_binding(&h).await.spec, before.spec);
}

/// Issue 17 item 4: with the catalog the chart ships, `helmModelCache` on NVMesh is durable
/// (spec 004: "roxReadOnly does so only on NVMesh, whose volume handle encodes the consuming
/// namespace and is rewritten per reader"). The handle is shaped as NVMesh 3.2 cross-namespace
/// volumes encode it per NVCA's `updateSecondaryPVVolumeHandle` (four colon-separated
/// elements, the consuming PVC's namespace last); the first three elements here are stand-ins.
#[tokio::test]
async fn step5_the_shipped_catalog_crosses_namespaces_on_nvmesh() {
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../chart/files/catalog.json"),
    )
    .unwrap();
    let h = Setup::default()
        .with(&catalog_cm(&shipped))
        .with(&storage_class(NVMESH, Some("Retain")))
        .with(&helm("h", NS, &["ns-b", "ns-c"]))
        .build()
        .await;
    h.ok(NS, "h").await;
    assert_eq!(h.status(NS, "h").await.mode, Some(CacheMode::Durable));
    let b = only_binding(&h).await;
    assert_eq!(b.spec.decision.flow, Flow::RoxReadOnly);
    let bname = b.metadata.name.clone().unwrap();
    h.complete_writer(&b, NVMESH, &format!("zone-a:csi-0d3f9a:xfs:{CTL}"))
        .await;
    h.ok(NS, "h").await;
    assert_eq!(h.cond(NS, "h", READY).await, is("True", "ReadersReady"));
    for ns in ["ns-b", "ns-c"] {
        let pv = Api::<PersistentVolume>::all(h.client.clone())
            .get(&names::reader_pv(&bname, ns))
            .await
            .unwrap();
        assert_eq!(
            pv.spec.unwrap().csi.unwrap().volume_handle,
            format!("zone-a:csi-0d3f9a:xfs:{ns}")
        );
    }
}

/// A reader claim that is not Bound (recreated while its Retain reader volume still names the
/// deleted claim, so the binder never binds it) makes Ready False / ReaderClaimPending: pods are
/// wired by Ready, and a claim that never binds would leave them Pending with nothing pointing
/// at the cache. Bound again, Ready is True again.
#[tokio::test]
async fn a_reader_claim_that_is_not_bound_holds_ready() {
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../chart/files/catalog.json"),
    )
    .unwrap();
    let h = Setup::default()
        .with(&catalog_cm(&shipped))
        .with(&storage_class(NVMESH, Some("Retain")))
        .with(&helm("h", NS, &["ns-b"]))
        .build()
        .await;
    h.ok(NS, "h").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    h.complete_writer(&b, NVMESH, &format!("zone-a:csi-0d3f9a:xfs:{CTL}"))
        .await;
    h.ok(NS, "h").await;
    assert_eq!(h.cond(NS, "h", READY).await, is("True", "ReadersReady"));
    let claims = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), "ns-b");
    let set_phase = |phase: &'static str| {
        let claims = claims.clone();
        let name = names::reader_claim(&bname);
        async move {
            claims
                .patch_status(
                    &name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"status": {"phase": phase}})),
                )
                .await
                .unwrap();
        }
    };
    set_phase("Pending").await;
    h.ok(NS, "h").await;
    assert_eq!(
        h.cond(NS, "h", READY).await,
        is("False", "ReaderClaimPending")
    );
    set_phase("Bound").await;
    h.ok(NS, "h").await;
    assert_eq!(h.cond(NS, "h", READY).await, is("True", "ReadersReady"));
}
