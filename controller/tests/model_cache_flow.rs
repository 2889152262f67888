//! The model-cache runtime flow (spec 004 "Runtime flow" steps 1–6), one or more tests per step,
//! against the bare real apiserver (tests/bare_apiserver_support through
//! tests/model_cache_support): each test has its own namespaces and cache StorageClass, calls
//! the reconcilers directly and plays the Job controller and the PV binder.
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
        .flags(FeatureFlags {
            caching_support: false,
            ..FeatureFlags::default()
        })
        .build()
        .await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let s = h.status(&ns, "a").await;
    assert_eq!(s.mode, Some(CacheMode::None));
    assert!(s.binding.is_none() && s.selection.is_none());
    assert_eq!(
        h.cond(&ns, "a", SELECTED).await,
        is("True", "CachingSupportDisabled")
    );
    assert_eq!(
        h.cond(&ns, "a", READY).await,
        is("True", "NothingToProvision")
    );
    assert!(h.bindings().await.is_empty());
    assert_eq!(h.side_effects().await, 0);
}

#[tokio::test]
async fn step1_helm_model_caching_off_gates_only_helm_requests() {
    let h = Setup::rwx()
        .flags(FeatureFlags {
            helm_model_caching: false,
            ..FeatureFlags::default()
        })
        .build()
        .await;
    let ns = h.ns.clone();
    h.create_request(&helm("h", &ns, &[&h.ns_of("b")])).await;
    h.create_request(&regular("r", &ns, "r1")).await;
    h.ok(&ns, "h").await;
    h.ok(&ns, "r").await;
    assert_eq!(h.status(&ns, "h").await.mode, Some(CacheMode::None));
    assert_eq!(
        h.cond(&ns, "h", SELECTED).await,
        is("True", "HelmModelCachingDisabled")
    );
    assert_eq!(h.status(&ns, "r").await.mode, Some(CacheMode::Durable));
    assert_eq!(h.bindings().await.len(), 1);
}

#[tokio::test]
async fn step1_ephemeral_requested_records_ephemeral() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let mut mc = regular("e", &ns, "r1");
    mc.spec.durability = Some(ic_shared::crd::Durability::Ephemeral);
    h.create_request(&mc).await;
    h.ok(&ns, "e").await;
    assert_eq!(h.status(&ns, "e").await.mode, Some(CacheMode::Ephemeral));
    assert_eq!(
        h.cond(&ns, "e", SELECTED).await,
        is("True", "EphemeralRequested")
    );
    assert_eq!(h.side_effects().await, 0);
}

// ----------------------------------------------------------------------------- step 2: class, catalog, flow

#[tokio::test]
async fn step2_the_class_must_exist_and_retain() {
    for (class, reason) in [
        (None, "StorageClassNotFound"),
        (Some(Some("Delete")), "ReclaimPolicyNotRetain"),
        // An unset reclaim policy is the API server's default, Delete.
        (Some(None), "ReclaimPolicyNotRetain"),
    ] {
        let mut setup = Setup::default().catalog(&catalog_text());
        if let Some(reclaim) = class {
            setup = setup.class(NVMESH, reclaim);
        }
        let h = setup.build().await;
        if class == Some(None) {
            // The apiserver defaulted it.
            assert_eq!(h.class().await.reclaim_policy.as_deref(), Some("Delete"));
        }
        let ns = h.ns.clone();
        h.create_request(&regular("a", &ns, "r1")).await;
        h.ok(&ns, "a").await;
        let s = h.status(&ns, "a").await;
        assert_eq!(s.mode, Some(CacheMode::Ephemeral), "{reason}");
        assert_eq!(h.cond(&ns, "a", SELECTED).await, is("True", reason));
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
    // (provisioner, catalog, helm request?, flags, reason)
    let cases: Vec<(&str, String, bool, FeatureFlags, &str)> = vec![
        (
            "csi.weka.io",
            catalog_text(),
            false,
            FeatureFlags::default(),
            "NoQualifiedModes",
        ),
        (
            "ebs.csi.aws.com",
            catalog_text(),
            false,
            FeatureFlags::default(),
            "ProvisionerNotInCatalog",
        ),
        (
            NVMESH,
            no_rule,
            true,
            FeatureFlags::default(),
            "CrossNamespaceUnsupported",
        ),
        (
            FSS,
            catalog_text(),
            false,
            FeatureFlags {
                model_cache_encryption: true,
                ..FeatureFlags::default()
            },
            "EncryptionUnsupported",
        ),
    ];
    for (provisioner, catalog, is_helm, flags, reason) in cases {
        let h = Setup::default()
            .catalog(&catalog)
            .class(provisioner, Some("Retain"))
            .flags(flags)
            .build()
            .await;
        let ns = h.ns.clone();
        let mc = if is_helm {
            helm("a", &ns, &[&h.ns_of("b")])
        } else {
            regular("a", &ns, "r1")
        };
        h.create_request(&mc).await;
        h.ok(&ns, "a").await;
        let s = h.status(&ns, "a").await;
        assert_eq!(s.mode, Some(CacheMode::Ephemeral), "{reason}");
        assert_eq!(h.cond(&ns, "a", SELECTED).await, is("True", reason));
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
        let mut setup = Setup::default().class(NVMESH, Some("Retain"));
        if let Some(text) = catalog {
            setup = setup.catalog(text);
        }
        let h = setup.build().await;
        let ns = h.ns.clone();
        h.create_request(&regular("a", &ns, "r1")).await;
        let action = h.ok(&ns, "a").await;
        assert_ne!(action, kube::runtime::controller::Action::await_change());
        let s = h.status(&ns, "a").await;
        assert_eq!(s.mode, None, "nothing is recorded on a broken catalog");
        assert_eq!(
            h.cond(&ns, "a", SELECTED).await,
            is("False", "CatalogInvalid")
        );
        assert!(h.bindings().await.is_empty());
        // Fixing the catalog lets the same request go on.
        match catalog {
            None => h.create_catalog(&catalog_text()).await,
            Some(_) => h.set_catalog(&catalog_text()).await,
        }
        h.ok(&ns, "a").await;
        assert_eq!(h.status(&ns, "a").await.mode, Some(CacheMode::Durable));
    }
}

// ----------------------------------------------------------------------------- step 3: get or create the binding

#[tokio::test]
async fn step3_one_binding_per_identity_joined_by_every_request() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    for (n, rev) in [("a", "r1"), ("b", "r1"), ("c", "r2")] {
        h.create_request(&regular(n, &ns, rev)).await;
    }
    for n in ["a", "b", "c"] {
        h.ok(&ns, n).await;
    }
    let all = h.bindings().await;
    assert_eq!(
        all.len(),
        2,
        "same source+revision share, another revision does not"
    );
    let a = h.status(&ns, "a").await.binding.unwrap();
    let b = h.status(&ns, "b").await.binding.unwrap();
    let c = h.status(&ns, "c").await.binding.unwrap();
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
    assert_eq!(shared.references()[0].uid, h.uid(&ns, "a").await);
    // Identity, finalizer, label, decision, class.
    let mc = h.request(&ns, "a").await;
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
    assert_eq!(shared.spec.storage_class.name, h.sc);
    assert_eq!(
        Some(shared.spec.storage_class.uid.clone()),
        h.class().await.metadata.uid
    );
    assert_eq!(shared.phase(), BindingPhase::Active);
}

#[tokio::test]
async fn step3_a_retiring_binding_is_never_joined() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let mc = regular("a", &ns, "r1");
    let identity = names::identity_for(&mc);
    let old_name = names::binding_name(&identity, 1);
    let sc_uid = h.class().await.metadata.uid.unwrap();
    let retiring: ModelCacheBinding = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCacheBinding",
        "metadata": {"name": old_name, "namespace": h.ctl,
                     "labels": {annotations::IDENTITY_LABEL: names::identity_label(&identity)},
                     "finalizers": [annotations::BINDING_FINALIZER]},
        "spec": {"identity": identity, "decision": {"provider": "nvmesh", "provisioner": NVMESH,
                 "flow": "roxReadOnly", "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
                 "catalogProfileDigest": "x"},
                 "storageClass": {"name": h.sc, "uid": sc_uid, "reclaimPolicy": "Retain", "configurationDigest": "y"},
                 "resources": {}},
        "status": {"phase": "Retiring"}
    }))
    .unwrap();
    let old_uid = h.create(&retiring).await.metadata.uid.unwrap();
    h.create_request(&mc).await;
    h.ok(&ns, "a").await;
    let bound = h.status(&ns, "a").await.binding.unwrap();
    assert_eq!(bound.name, names::binding_name(&identity, 2));
    assert_ne!(bound.uid, old_uid);
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
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let log = h.faults.calls();
    let first_storage = log
        .iter()
        .position(|c| {
            c.method == "POST"
                && [
                    "leases",
                    "persistentvolumeclaims",
                    "jobs",
                    "persistentvolumes",
                    "secrets",
                    "storageclasses",
                ]
                .iter()
                .any(|r| c.path.ends_with(&format!("/{r}")))
        })
        .unwrap_or_else(|| panic!("no storage side effect in {log:#?}"));
    let created = log
        .iter()
        .position(|c| c.is("POST", "/modelcachebindings"))
        .unwrap();
    let referenced = log
        .iter()
        .position(|c| {
            c.method == "PUT" && c.has("modelcachebindings") && c.path.ends_with("/status")
        })
        .unwrap();
    let recorded = log
        .iter()
        .enumerate()
        .filter(|(_, c)| c.is("PATCH", "/modelcaches/a/status"))
        .map(|(i, _)| i)
        .find(|i| *i > referenced)
        .unwrap_or_else(|| panic!("request status not written after the reference: {log:#?}"));
    assert!(
        created < referenced && referenced < recorded && recorded < first_storage,
        "{log:#?}"
    );
    // The request's record is exactly the binding's name and UID.
    let b = only_binding(&h).await;
    let s = h.status(&ns, "a").await;
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
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.create_request(&regular("b", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    h.ok(&ns, "b").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    let wname = names::writer_name(&bname);
    // One Lease held by the first request, one writer claim and Job, in the request namespace.
    let lease = Api::<Lease>::namespaced(h.client.clone(), &h.ctl)
        .get(&wname)
        .await
        .unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity,
        Some(h.uid(&ns, "a").await)
    );
    assert_eq!(h.names::<Job>(None).await, vec![wname.clone()]);
    assert_eq!(h.cond(&ns, "a", READY).await, is("False", "WriterRunning"));
    assert_eq!(
        h.cond(&ns, "b", READY).await,
        is("False", "WriterRunning"),
        "b waits for the Job a's election created"
    );
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
        .get(&wname)
        .await
        .unwrap();
    let cs = claim.spec.clone().unwrap();
    assert_eq!(cs.access_modes, Some(vec!["ReadWriteOnce".to_string()]));
    assert_eq!(cs.storage_class_name.as_deref(), Some(h.sc.as_str()));
    assert_eq!(cs.resources.unwrap().requests.unwrap()["storage"].0, "40Gi");
    assert_eq!(
        labels_of(&claim.metadata).get(annotations::BINDING_LABEL),
        Some(&bname)
    );
    // The writer Job mounts the claim read-write and knows what to fetch.
    let job = Api::<Job>::namespaced(h.client.clone(), &ns)
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

    h.complete_writer(&b, NVMESH, &format!("nvmesh/{ns}/vol-1"))
        .await;
    h.ok_binding_readers(&ns, "a").await;
    h.ok_binding_readers(&ns, "b").await;
    let b = only_binding(&h).await;
    assert_eq!(
        b.status.as_ref().unwrap().writer_volume_name,
        Some(h.writer_pv(&bname))
    );
    // Reader PV: a static copy of the writer's PV.
    let pv_name = names::reader_pv(&bname, &ns);
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
        format!("nvmesh/{ns}/vol-1"),
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
        (
            Some(ns.as_str()),
            Some(names::reader_claim(&bname).as_str())
        )
    );
    assert!(!pv
        .metadata
        .annotations
        .unwrap()
        .contains_key("pv.kubernetes.io/provisioned-by"));
    // Reader claim pre-bound by name.
    let rc = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
        .get(&names::reader_claim(&bname))
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(rc.volume_name.as_deref(), Some(pv_name.as_str()));
    assert_eq!(rc.storage_class_name.as_deref(), Some(""));
    assert_eq!(rc.access_modes, Some(vec!["ReadOnlyMany".to_string()]));
    for n in ["a", "b"] {
        let s = h.status(&ns, n).await;
        assert_eq!(h.cond(&ns, n, READY).await, is("True", "ReadersReady"));
        assert_eq!(
            s.reader_claim.as_deref(),
            Some(names::reader_claim(&bname).as_str())
        );
        assert_eq!(s.reader_namespaces, vec![ns.clone()]);
    }
    // Still one writer Job, one reader PV for the namespace.
    assert_eq!(h.names::<Job>(None).await.len(), 1);
    assert_eq!(h.names::<PersistentVolume>(None).await.len(), 2);
}

#[tokio::test]
async fn step5_the_lease_passes_on_when_an_elected_writer_never_starts() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let mut broken = regular("a", &ns, "r1");
    broken.spec.writer.template = json!({"spec": {"containers": []}});
    h.create_request(&broken).await;
    h.create_request(&regular("b", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    assert_eq!(
        h.cond(&ns, "a", READY).await,
        is("False", "WriterTemplateInvalid")
    );
    h.ok(&ns, "b").await;
    assert_eq!(
        h.cond(&ns, "b", READY).await,
        is("False", "WriterElectedElsewhere")
    );
    assert!(h.names::<Job>(None).await.is_empty());
    h.clock.advance(Duration::from_secs(601));
    h.ok(&ns, "b").await;
    assert_eq!(h.cond(&ns, "b", READY).await, is("False", "WriterRunning"));
    let bname = only_binding(&h).await.metadata.name.unwrap();
    let lease = Api::<Lease>::namespaced(h.client.clone(), &h.ctl)
        .get(&names::writer_name(&bname))
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(lease.holder_identity, Some(h.uid(&ns, "b").await));
    assert_eq!(lease.lease_transitions, Some(1));
    assert_eq!(h.names::<Job>(Some(&ns)).await.len(), 1);
}

#[tokio::test]
async fn step5_helm_readers_in_other_namespaces_get_rewritten_handles() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let (z, nb, nc, nd) = (
        h.ns_of("team-z"),
        h.ns_of("ns-b"),
        h.ns_of("ns-c"),
        h.ns_of("ns-d"),
    );
    h.create_request(&helm("h1", &ns, &[&nb, &nc])).await;
    h.create_request(&helm("h2", &z, &[&nc, &nd])).await;
    h.ok(&ns, "h1").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    // The writer runs in the control namespace with the writer service account.
    let job = Api::<Job>::namespaced(h.client.clone(), &h.ctl)
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
        .contains(&names::reader_pv(&bname, &nb)));
    // The second request (same sharing domain "org", another namespace) joins; its new reader
    // namespace is recorded on the binding before anything is created there.
    h.ok(&z, "h2").await;
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
        vec![names::reader_pv(&bname, &nd)]
    );
    assert_eq!(
        extra.persistent_volume_claims,
        vec![NamespacedName::new(
            nd.as_str(),
            names::reader_claim(&bname)
        )]
    );
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{}/vol-7", h.ctl))
        .await;
    h.ok_binding_readers(&ns, "h1").await;
    h.ok_binding_readers(&z, "h2").await;
    for rns in [&nb, &nc, &nd] {
        let pv = Api::<PersistentVolume>::all(h.client.clone())
            .get(&names::reader_pv(&bname, rns))
            .await
            .unwrap();
        assert_eq!(
            pv.spec.unwrap().csi.unwrap().volume_handle,
            format!("nvmesh/{rns}/vol-7")
        );
        Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), rns)
            .get(&names::reader_claim(&bname))
            .await
            .unwrap();
    }
    assert_eq!(
        h.status(&z, "h2").await.reader_namespaces,
        vec![nc.clone(), nd.clone()]
    );
    assert_eq!(h.cond(&ns, "h1", READY).await, is("True", "ReadersReady"));
    assert_eq!(h.cond(&z, "h2", READY).await, is("True", "ReadersReady"));
}

#[tokio::test]
async fn step5_rwx_flow_shares_the_handle_across_namespaces() {
    let h = Setup::rwx().build().await;
    let ns = h.ns.clone();
    let nb = h.ns_of("ns-b");
    h.create_request(&helm("h", &ns, &[&nb])).await;
    h.ok(&ns, "h").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    assert_eq!(b.spec.decision.flow, Flow::RwxReadOnly);
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &h.ctl)
        .get(&names::writer_name(&bname))
        .await
        .unwrap();
    assert_eq!(
        claim.spec.unwrap().access_modes,
        Some(vec!["ReadWriteMany".to_string()])
    );
    h.complete_writer(&b, FSS, "ocid1.filesystem.oc1..x:10.0.0.5:/export")
        .await;
    h.ok_binding_readers(&ns, "h").await;
    assert_eq!(h.cond(&ns, "h", READY).await, is("True", "ReadersReady"));
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&names::reader_pv(&bname, &nb))
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
        .flags(FeatureFlags {
            model_cache_encryption: true,
            ..FeatureFlags::default()
        })
        .build()
        .await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    assert!(b.spec.decision.encrypted);
    assert_eq!(
        b.spec.resources.secrets,
        vec![NamespacedName::new(
            h.ctl.as_str(),
            names::key_secret(&bname)
        )]
    );
    assert_eq!(
        b.spec.resources.storage_classes,
        vec![names::encrypted_class(&bname)]
    );
    let secret = Api::<Secret>::namespaced(h.client.clone(), &h.ctl)
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
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
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
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let before = only_binding(&h).await;
    h.complete_writer(&before, NVMESH, &format!("nvmesh/{ns}/vol-1"))
        .await;
    // Everything changes after the binding exists: the catalog drops NVMesh's options and
    // qualifies another driver, the class is replaced, caching is switched off.
    h.set_catalog(&json!({"drivers": [{"name": FSS, "provider": "oci-fss", "accessModes": ["ReadWriteMany"], "readerMountOptions": []}]}).to_string()).await;
    h.replace_class(FSS, "Retain").await;
    // Same API, flags now off.
    let h2 = h.with_flags(FeatureFlags {
        caching_support: false,
        helm_model_caching: false,
        model_cache_encryption: true,
    });
    h2.ok_binding_readers(&ns, "a").await;
    let after = only_binding(&h2).await;
    assert_eq!(after.spec, before.spec, "the binding's spec never changes");
    assert_eq!(h2.status(&ns, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(h2.cond(&ns, "a", READY).await, is("True", "ReadersReady"));
    // Readers follow the recorded decision, not the edited catalog.
    let bname = after.metadata.name.clone().unwrap();
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&names::reader_pv(&bname, &ns))
        .await
        .unwrap();
    assert_eq!(
        pv.spec.unwrap().mount_options,
        Some(vec!["ro".into(), "norecovery".into(), "nouuid".into()])
    );
}

#[tokio::test]
async fn step6_a_replaced_class_stops_provisioning_instead_of_switching() {
    // The binding exists and references the request, but no writer claim yet (the Lease create
    // failed transiently); then the class is replaced (new UID, another provisioner).
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    h.faults.rule(move |c| {
        if c.is("POST", "/leases") && fail.swap(false, std::sync::atomic::Ordering::SeqCst) {
            server_error()
        } else {
            Step::Pass
        }
    });
    assert!(
        h.reconcile(&ns, "a").await.is_err(),
        "the Lease create failed transiently"
    );
    let before = only_binding(&h).await;
    assert_eq!(h.status(&ns, "a").await.mode, Some(CacheMode::Durable));
    h.replace_class(FSS, "Retain").await;
    h.ok(&ns, "a").await;
    assert_eq!(
        h.cond(&ns, "a", READY).await,
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
        .catalog(&shipped)
        .class(NVMESH, Some("Retain"))
        .build()
        .await;
    let ns = h.ns.clone();
    let (nb, nc) = (h.ns_of("ns-b"), h.ns_of("ns-c"));
    h.create_request(&helm("h", &ns, &[&nb, &nc])).await;
    h.ok(&ns, "h").await;
    assert_eq!(h.status(&ns, "h").await.mode, Some(CacheMode::Durable));
    let b = only_binding(&h).await;
    assert_eq!(b.spec.decision.flow, Flow::RoxReadOnly);
    let bname = b.metadata.name.clone().unwrap();
    h.complete_writer(&b, NVMESH, &format!("zone-a:csi-0d3f9a:xfs:{}", h.ctl))
        .await;
    h.ok_binding_readers(&ns, "h").await;
    assert_eq!(h.cond(&ns, "h", READY).await, is("True", "ReadersReady"));
    for rns in [&nb, &nc] {
        let pv = Api::<PersistentVolume>::all(h.client.clone())
            .get(&names::reader_pv(&bname, rns))
            .await
            .unwrap();
        assert_eq!(
            pv.spec.unwrap().csi.unwrap().volume_handle,
            format!("zone-a:csi-0d3f9a:xfs:{rns}")
        );
    }
}

/// A reader claim that is not Bound (recreated while its Retain reader volume still names the
/// deleted claim, so the binder never binds it) makes Ready False / ReaderClaimPending: pods are
/// wired by Ready, and a claim that never binds would leave them Pending with nothing pointing
/// at the cache. Bound again, Ready is True again. On the real apiserver every new claim reads
/// `Pending` until the binder binds it: the first pass after the writer finished already waits.
#[tokio::test]
async fn a_reader_claim_that_is_not_bound_holds_ready() {
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../chart/files/catalog.json"),
    )
    .unwrap();
    let h = Setup::default()
        .catalog(&shipped)
        .class(NVMESH, Some("Retain"))
        .build()
        .await;
    let ns = h.ns.clone();
    let nb = h.ns_of("ns-b");
    h.create_request(&helm("h", &ns, &[&nb])).await;
    h.ok(&ns, "h").await;
    let b = only_binding(&h).await;
    let bname = b.metadata.name.clone().unwrap();
    h.complete_writer(&b, NVMESH, &format!("zone-a:csi-0d3f9a:xfs:{}", h.ctl))
        .await;
    // The claim just created reads Pending (the apiserver's default phase).
    h.ok(&ns, "h").await;
    assert_eq!(
        h.cond(&ns, "h", READY).await,
        is("False", "ReaderClaimPending")
    );
    assert_eq!(h.bind_readers().await, 1);
    h.ok(&ns, "h").await;
    assert_eq!(h.cond(&ns, "h", READY).await, is("True", "ReadersReady"));
    let claims = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &nb);
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
    h.ok(&ns, "h").await;
    assert_eq!(
        h.cond(&ns, "h", READY).await,
        is("False", "ReaderClaimPending")
    );
    set_phase("Bound").await;
    h.ok(&ns, "h").await;
    assert_eq!(h.cond(&ns, "h", READY).await, is("True", "ReadersReady"));
}
