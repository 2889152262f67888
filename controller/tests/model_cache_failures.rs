//! One test per row of spec 004's "Failure rules" table, against the bare real apiserver
//! (tests/bare_apiserver_support through tests/model_cache_support): each test has its own
//! namespaces and cache StorageClass; transient API errors are injected into the reconcilers'
//! client by `Faults` rules matching method and path.
//!
//! | Event | Result |
//! |---|---|
//! | Catalog, class, or gate changes after the binding exists | Binding stays authoritative |
//! | Class or catalog drifts before the binding exists | Fail before any side effect |
//! | Binding is `Retiring`, missing, or lacks this request's reference | Fail; never rebind |
//! | Object has foreign or missing ownership | Never adopt or delete it |
//! | Reader PV and claim disagree on class | Never binds; prevented by construction |
//! | Transient API error | Requeue without changing state |
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod model_cache_support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ic_controller::reconcile::model_cache::names;
use ic_shared::crd::{annotations, BindingPhase, CacheMode, ModelCacheBinding};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, PostParams};
use model_cache_support::*;
use serde_json::json;

const READY: &str = "Ready";

// ----------------------------------------------------------------------------- row 1

#[tokio::test]
async fn row1_catalog_class_or_gate_change_after_the_binding_exists_leaves_it_authoritative() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let first_class = h.class().await.metadata.uid.unwrap();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let before = h.bindings().await.remove(0);
    // The catalog now gives NVMesh other reader options and a handle rule, and the class is
    // replaced by another NVMesh class (new UID, other parameters).
    h.set_catalog(
        &json!({"drivers": [{"name": NVMESH, "provider": "nvmesh-2",
        "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "readerMountOptions": ["ro"]}]})
        .to_string(),
    )
    .await;
    let replaced = h.replace_class(NVMESH, "Retain").await;
    assert_ne!(replaced.metadata.uid.as_ref(), Some(&first_class));
    // A new request for the same cache joins the binding and its recorded decision.
    h.create_request(&regular("b", &ns, "r1")).await;
    h.ok(&ns, "b").await;
    h.ok(&ns, "a").await;
    let after = h.bindings().await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].spec, before.spec);
    assert_eq!(after[0].references().len(), 2);
    let sb = h.status(&ns, "b").await;
    assert_eq!(sb.mode, Some(CacheMode::Durable));
    assert_eq!(sb.binding, h.status(&ns, "a").await.binding);
    // b's selection records what the catalog says now; the binding, not it, decides the flow.
    assert_ne!(
        sb.selection.unwrap().decision_digest,
        h.status(&ns, "a").await.selection.unwrap().decision_digest
    );
    assert_eq!(
        after[0].spec.decision.reader_mount_options,
        vec!["ro", "norecovery", "nouuid"]
    );
    assert_eq!(after[0].spec.storage_class.uid, first_class);
    // A gate switched off afterwards changes nothing either (mode and binding are final).
    let off = h.with_flags(ic_controller::reconcile::model_cache::FeatureFlags {
        caching_support: false,
        ..Default::default()
    });
    off.ok(&ns, "a").await;
    assert_eq!(h.status(&ns, "a").await.mode, Some(CacheMode::Durable));
}

// ----------------------------------------------------------------------------- row 2

/// A request whose durable selection was recorded but whose binding create failed.
async fn selected_but_unbound() -> Harness {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    let fail = Arc::new(AtomicBool::new(true));
    h.faults.rule(move |c| {
        if c.is("POST", "/modelcachebindings") && fail.swap(false, Ordering::SeqCst) {
            server_error()
        } else {
            Step::Pass
        }
    });
    assert!(h.reconcile(&ns, "a").await.is_err());
    let s = h.status(&ns, "a").await;
    assert!(s.selection.is_some() && s.binding.is_none() && s.mode.is_none());
    assert!(h.bindings().await.is_empty());
    h
}

#[tokio::test]
async fn row2_catalog_drift_before_the_binding_exists_fails_before_any_side_effect() {
    let h = selected_but_unbound().await;
    let ns = h.ns.clone();
    h.set_catalog(
        &json!({"drivers": [{"name": NVMESH, "provider": "nvmesh",
        "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "readerMountOptions": ["ro"]}]})
        .to_string(),
    )
    .await;
    h.ok(&ns, "a").await;
    assert_eq!(
        h.cond(&ns, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    assert!(h.bindings().await.is_empty());
    assert_eq!(h.side_effects().await, 0);
    assert_eq!(h.status(&ns, "a").await.mode, None);
}

#[tokio::test]
async fn row2_class_drift_before_the_binding_exists_fails_before_any_side_effect() {
    for (provisioner, reclaim) in [(NVMESH, "Retain"), (FSS, "Retain"), (NVMESH, "Delete")] {
        let h = selected_but_unbound().await;
        let ns = h.ns.clone();
        h.replace_class(provisioner, reclaim).await;
        h.ok(&ns, "a").await;
        assert_eq!(
            h.cond(&ns, "a", READY).await,
            is("False", "ConfigurationDrifted"),
            "{provisioner} {reclaim}"
        );
        assert!(h.bindings().await.is_empty());
        assert_eq!(h.side_effects().await, 0);
        let s = h.status(&ns, "a").await;
        assert_eq!(
            s.mode, None,
            "not even ephemeral: the recorded selection stands"
        );
    }
    // Class deleted outright.
    let h = selected_but_unbound().await;
    let ns = h.ns.clone();
    h.delete_class().await;
    h.ok(&ns, "a").await;
    assert_eq!(
        h.cond(&ns, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    assert_eq!(h.side_effects().await, 0);
}

#[tokio::test]
async fn row2_no_drift_means_the_interrupted_request_goes_on() {
    let h = selected_but_unbound().await;
    let ns = h.ns.clone();
    h.ok(&ns, "a").await;
    assert_eq!(h.status(&ns, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(h.bindings().await.len(), 1);
}

// ----------------------------------------------------------------------------- row 3

async fn bound_request() -> (Harness, ModelCacheBinding) {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let b = h.bindings().await.remove(0);
    (h, b)
}

async fn assert_never_rebound(h: &Harness, reason: &str, recorded: &ic_shared::crd::BindingRef) {
    let ns = h.ns.clone();
    let jobs_before = h.names::<Job>(None).await;
    h.ok(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", READY).await, is("False", reason));
    let s = h.status(&ns, "a").await;
    assert_eq!(
        s.binding.as_ref(),
        Some(recorded),
        "the recorded binding never changes"
    );
    // No other binding was created or joined, nothing new provisioned.
    assert!(h
        .bindings()
        .await
        .iter()
        .all(|b| b.metadata.name.as_deref() == Some(recorded.name.as_str())));
    assert_eq!(h.names::<Job>(None).await, jobs_before);
}

#[tokio::test]
async fn row3_a_retiring_binding_fails_the_request_and_is_never_rebound() {
    let (h, _) = bound_request().await;
    let recorded = h.status(&h.ns, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), &h.ctl);
    let mut r = h.binding(&recorded.name).await.unwrap();
    r.status.as_mut().unwrap().phase = Some(BindingPhase::Retiring);
    api.replace_status(&recorded.name, &PostParams::default(), &r)
        .await
        .unwrap();
    assert_never_rebound(&h, "BindingRetiring", &recorded).await;
}

/// A binding that is deleted (its finalizer keeps it while it releases) is retiring too.
#[tokio::test]
async fn row3_a_binding_being_deleted_fails_the_request_and_is_never_rebound() {
    let (h, _) = bound_request().await;
    let recorded = h.status(&h.ns, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), &h.ctl);
    api.delete(&recorded.name, &Default::default())
        .await
        .unwrap();
    assert!(h
        .binding(&recorded.name)
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_some());
    assert_never_rebound(&h, "BindingRetiring", &recorded).await;
}

#[tokio::test]
async fn row3_a_missing_binding_fails_the_request_and_is_never_rebound() {
    let (h, _) = bound_request().await;
    let recorded = h.status(&h.ns, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), &h.ctl);
    api.delete(&recorded.name, &Default::default())
        .await
        .unwrap();
    // Gone: its finalizer removed (as the binding controller does once it released).
    h.drop_binding_finalizer(&recorded.name, annotations::BINDING_FINALIZER)
        .await;
    assert!(h.binding(&recorded.name).await.is_none());
    assert_never_rebound(&h, "BindingMissing", &recorded).await;
    assert!(h.bindings().await.is_empty());
}

#[tokio::test]
async fn row3_a_binding_recreated_under_the_same_name_is_missing() {
    let (h, b) = bound_request().await;
    let ns = h.ns.clone();
    let recorded = h.status(&ns, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), &h.ctl);
    api.delete(&recorded.name, &Default::default())
        .await
        .unwrap();
    h.drop_binding_finalizer(&recorded.name, annotations::BINDING_FINALIZER)
        .await;
    let mut again = b.clone();
    again.metadata = kube::api::ObjectMeta {
        name: b.metadata.name.clone(),
        namespace: b.metadata.namespace.clone(),
        labels: b.metadata.labels.clone(),
        finalizers: b.metadata.finalizers.clone(),
        ..Default::default()
    };
    let again = h.create(&again).await;
    assert_ne!(again.metadata.uid.as_ref(), Some(&recorded.uid));
    h.ok(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", READY).await, is("False", "BindingMissing"));
    assert_eq!(h.status(&ns, "a").await.binding, Some(recorded));
}

#[tokio::test]
async fn row3_a_binding_without_this_reference_fails_the_request() {
    let (h, _) = bound_request().await;
    let recorded = h.status(&h.ns, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), &h.ctl);
    let mut r = h.binding(&recorded.name).await.unwrap();
    r.status.as_mut().unwrap().request_references.clear();
    api.replace_status(&recorded.name, &PostParams::default(), &r)
        .await
        .unwrap();
    assert_never_rebound(&h, "ReferenceMissing", &recorded).await;
    assert!(
        h.binding(&recorded.name)
            .await
            .unwrap()
            .references()
            .is_empty(),
        "the reference is not silently re-added"
    );
}

// ----------------------------------------------------------------------------- row 4

#[tokio::test]
async fn row4_an_object_with_missing_ownership_is_never_adopted() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let mc = regular("a", &ns, "r1");
    let bname = h.binding_name_of(&mc, 1);
    let squatter: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": names::writer_name(&bname), "namespace": ns, "labels": {"app": "mine"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    h.create(&squatter).await;
    h.create_request(&mc).await;
    h.ok(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", READY).await, is("False", "ForeignObject"));
    let pvc = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
        .get(&names::writer_name(&bname))
        .await
        .unwrap();
    assert_eq!(
        labels_of(&pvc.metadata).get(annotations::BINDING_LABEL),
        None,
        "not adopted"
    );
    assert!(
        h.names::<Job>(None).await.is_empty(),
        "no writer on someone else's claim"
    );
}

#[tokio::test]
async fn row4_an_object_owned_by_another_binding_is_foreign() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let mc = regular("a", &ns, "r1");
    let bname = h.binding_name_of(&mc, 1);
    // Right label, another binding's UID (e.g. a binding of the same name that was deleted).
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": names::writer_name(&bname), "namespace": ns,
                     "labels": {annotations::BINDING_LABEL: bname},
                     "annotations": {annotations::BINDING_UID_ANNOTATION: "some-older-uid"}},
        "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}], "restartPolicy": "Never"}}}
    }))
    .unwrap();
    h.create(&job).await;
    h.create_request(&mc).await;
    h.ok(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", READY).await, is("False", "ForeignObject"));
    // Released later, the binding leaves it alone (see model_cache_lifecycle.rs for release).
    let j = Api::<Job>::namespaced(h.client.clone(), &ns)
        .get(&names::writer_name(&bname))
        .await
        .unwrap();
    assert_eq!(
        j.metadata.annotations.unwrap()[annotations::BINDING_UID_ANNOTATION],
        "some-older-uid"
    );
}

// ----------------------------------------------------------------------------- row 5

#[tokio::test]
async fn row5_reader_pv_and_claim_agree_by_construction() {
    let (h, b) = bound_request().await;
    let ns = h.ns.clone();
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{ns}/vol-1"))
        .await;
    h.ok_binding_readers(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", READY).await, is("True", "ReadersReady"));
    let bname = b.metadata.name.clone().unwrap();
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&names::reader_pv(&bname, &ns))
        .await
        .unwrap();
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
        .get(&names::reader_claim(&bname))
        .await
        .unwrap();
    let pvs = pv.spec.unwrap();
    let cs = claim.spec.unwrap();
    // The writer PV had the cache class; the reader pair has none on both sides: the PV's is
    // cleared and the claim's is the empty string (no default class is ever assigned — the
    // apiserver kept both as written).
    assert_eq!(
        pvs.storage_class_name.unwrap_or_default(),
        cs.storage_class_name.clone().unwrap()
    );
    assert_eq!(cs.storage_class_name.as_deref(), Some(""));
    assert_eq!(cs.volume_name.as_deref(), pv.metadata.name.as_deref());
    let cref = pvs.claim_ref.unwrap();
    assert_eq!(cref.name.as_deref(), claim.metadata.name.as_deref());
    assert_eq!(cref.namespace.as_deref(), Some(ns.as_str()));
    assert_eq!(pvs.access_modes, cs.access_modes);
    assert_eq!(pvs.volume_mode, cs.volume_mode);
    assert_eq!(
        pvs.capacity.unwrap()["storage"],
        cs.resources.unwrap().requests.unwrap()["storage"]
    );
}

// ----------------------------------------------------------------------------- row 6

/// Runs request `a` once with a 500 injected into the chosen call, and checks that nothing
/// changed past the last successful write.
#[tokio::test]
async fn row6_transient_errors_requeue_without_changing_state() {
    type Rule = Box<dyn Fn(&Harness) -> Box<dyn Fn(&Call) -> Step + Send + Sync>>;
    let cases: Vec<(&str, Rule)> = vec![
        (
            "get StorageClass",
            Box::new(|h: &Harness| {
                let sc = h.sc.clone();
                Box::new(move |c: &Call| {
                    if c.method == "GET" && c.has("storageclasses") && c.has(&sc) {
                        server_error()
                    } else {
                        Step::Pass
                    }
                })
            }),
        ),
        (
            "list bindings",
            Box::new(|h: &Harness| {
                let ctl = h.ctl.clone();
                let fail = AtomicBool::new(true);
                Box::new(move |c: &Call| {
                    if c.is("GET", "/modelcachebindings")
                        && c.has(&ctl)
                        && fail.swap(false, Ordering::SeqCst)
                    {
                        server_error()
                    } else {
                        Step::Pass
                    }
                })
            }),
        ),
        (
            "add reference",
            Box::new(|_: &Harness| {
                Box::new(|c: &Call| {
                    if c.method == "PUT"
                        && c.has("modelcachebindings")
                        && c.path.ends_with("/status")
                    {
                        server_error()
                    } else {
                        Step::Pass
                    }
                })
            }),
        ),
        (
            "record binding on request",
            Box::new(|_: &Harness| {
                let n = AtomicUsize::new(0);
                Box::new(move |c: &Call| {
                    // The first request status write (the selection) passes, the second fails.
                    if c.is("PATCH", "/modelcaches/a/status")
                        && n.fetch_add(1, Ordering::SeqCst) == 1
                    {
                        server_error()
                    } else {
                        Step::Pass
                    }
                })
            }),
        ),
    ];
    for (case, rule) in cases {
        let h = Setup::nvmesh().build().await;
        let ns = h.ns.clone();
        h.create_request(&regular("a", &ns, "r1")).await;
        h.faults.rule(rule(&h));
        let err = h.reconcile(&ns, "a").await;
        assert!(err.is_err(), "{case}: expected an error to requeue");
        let s = h.status(&ns, "a").await;
        assert!(s.binding.is_none() && s.mode.is_none(), "{case}: {s:?}");
        assert_eq!(h.side_effects().await, 0, "{case}: no storage side effect");
        for b in h.bindings().await {
            // A binding may exist (created before the failure) but holds no reference unless
            // the reference write itself succeeded, and nothing it names exists.
            if case != "record binding on request" {
                assert!(b.references().is_empty(), "{case}");
            }
        }
    }
}

#[tokio::test]
async fn row6_the_next_pass_after_a_transient_error_completes() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    let fail = AtomicBool::new(true);
    h.faults.rule(move |c| {
        if c.method == "PUT"
            && c.has("modelcachebindings")
            && c.path.ends_with("/status")
            && fail.swap(false, Ordering::SeqCst)
        {
            server_error()
        } else {
            Step::Pass
        }
    });
    assert!(h.reconcile(&ns, "a").await.is_err());
    assert_eq!(h.side_effects().await, 0);
    h.ok(&ns, "a").await;
    let s = h.status(&ns, "a").await;
    assert_eq!(s.mode, Some(CacheMode::Durable));
    let b = h.bindings().await;
    assert_eq!(
        b.len(),
        1,
        "the retry joined the binding the failed pass created"
    );
    assert_eq!(b[0].references().len(), 1);
}

#[tokio::test]
async fn row6_a_transient_error_in_the_binding_lifecycle_changes_nothing() {
    let (h, b) = bound_request().await;
    let name = b.metadata.name.clone().unwrap();
    // The request is gone; a get of it fails transiently during the prune.
    h.delete_request(&h.ns, "a").await;
    h.faults.rule(|c| {
        if c.is("GET", "/modelcaches/a") {
            server_error()
        } else {
            Step::Pass
        }
    });
    let before = h.binding(&name).await.unwrap();
    assert!(h.reconcile_binding(&name).await.is_err());
    let after = h.binding(&name).await.unwrap();
    assert_eq!(after.status, before.status);
    assert_eq!(after.metadata.finalizers, before.metadata.finalizers);
    assert_eq!(
        after.metadata.resource_version, before.metadata.resource_version,
        "nothing written"
    );
}

// ------------------------------------------------------------------ issue 17

/// Item 3: a reader claim someone else creates between our read and our create (our create
/// answers 409) is never taken for ours: the request is not Ready, and the claim is untouched.
#[tokio::test]
async fn row4_a_reader_claim_created_concurrently_by_someone_else_is_never_adopted() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let mc = regular("a", &ns, "r1");
    let bname = h.binding_name_of(&mc, 1);
    let claim = names::reader_claim(&bname);
    let squatter: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": ns, "labels": {"app": "mine"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    h.create(&squatter).await;
    h.create_request(&mc).await;
    let hidden = claim.clone();
    let first = AtomicBool::new(true);
    h.faults.rule(move |c| {
        // Our read misses it: it appears right after.
        if c.method == "GET"
            && c.has("persistentvolumeclaims")
            && c.has(&hidden)
            && first.swap(false, Ordering::SeqCst)
        {
            not_found(&format!("persistentvolumeclaims {hidden:?}"))
        } else {
            Step::Pass
        }
    });
    h.ok(&ns, "a").await;
    let b = h.bindings().await.remove(0);
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{ns}/vol-1"))
        .await;
    h.ok(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", READY).await, is("False", "ForeignObject"));
    // The read was answered 404, then the create reached the apiserver (which refused it:
    // 409 AlreadyExists).
    let calls = h.faults.calls();
    let read = calls
        .iter()
        .position(|c| c.method == "GET" && c.has("persistentvolumeclaims") && c.has(&claim))
        .unwrap();
    assert!(
        calls[read..]
            .iter()
            .any(|c| c.is("POST", &format!("/namespaces/{ns}/persistentvolumeclaims"))),
        "{calls:#?}"
    );
    let pvc = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
        .get(&claim)
        .await
        .unwrap();
    assert_eq!(
        labels_of(&pvc.metadata).get("app").map(String::as_str),
        Some("mine")
    );
    assert_eq!(
        labels_of(&pvc.metadata).get(annotations::BINDING_LABEL),
        None
    );
    // The pod webhook wires pods by Ready alone: nothing would mount the squatter's claim.
    assert_ne!(h.cond(&ns, "a", READY).await, is("True", "ReadersReady"));
}

/// Item 6: `provider` is a diagnostics label that gates nothing: editing it between the
/// recorded selection and the binding is not drift.
#[tokio::test]
async fn row2_a_provider_label_edit_is_not_drift() {
    let h = selected_but_unbound().await;
    let ns = h.ns.clone();
    let mut catalog: serde_json::Value = serde_json::from_str(&catalog_text()).unwrap();
    catalog["drivers"][0]["provider"] = json!("excelero-nvmesh");
    h.set_catalog(&catalog.to_string()).await;
    h.ok(&ns, "a").await;
    assert_eq!(h.status(&ns, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(h.bindings().await.len(), 1);
    assert_ne!(
        h.cond(&ns, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    // Anything that gates (here the reader mount options) still is drift.
    let h = selected_but_unbound().await;
    let ns = h.ns.clone();
    let mut catalog: serde_json::Value = serde_json::from_str(&catalog_text()).unwrap();
    catalog["drivers"][0]["readerMountOptions"] = json!(["ro"]);
    h.set_catalog(&catalog.to_string()).await;
    h.ok(&ns, "a").await;
    assert_eq!(
        h.cond(&ns, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
}

/// Item 10: an edit inside `spec.writer.template` is never provisioned from. The real
/// apiserver (v1.36) refuses it itself: the CRD's `self == oldSelf` rule on `spec` does see
/// inside the `x-kubernetes-preserve-unknown-fields` template (model_cache_cel.rs and the
/// CRD's description say it cannot, from the kube-cel interpreter; the real apiserver shows
/// otherwise). The controller's own check (`status.writerTemplateDigest`, compared every
/// pass) is then a second line: a recorded digest that differs from the stored template — as
/// after an edit admitted before the rule existed — fails the request `SpecChanged` before
/// anything is provisioned, and the same template again goes on.
#[tokio::test]
async fn a_writer_template_edit_is_refused() {
    let h = selected_but_unbound().await;
    let ns = h.ns.clone();
    let recorded = h.status(&ns, "a").await.writer_template_digest.unwrap();
    assert_eq!(recorded.len(), 64);
    let api: Api<ic_shared::crd::ModelCache> = Api::namespaced(h.client.clone(), &ns);
    let mut mc = api.get("a").await.unwrap();
    let original = mc.spec.writer.template.clone();
    mc.spec.writer.template =
        json!({"spec": {"containers": [{"name": "fetch", "image": "ghcr.io/example/other:2"}]}});
    let err = api
        .replace("a", &PostParams::default(), &mc)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422 && s.message.contains("spec is immutable")),
        "{err:?}"
    );
    assert_eq!(api.get("a").await.unwrap().spec.writer.template, original);

    // The controller's check: a request whose recorded digest is not its template's.
    let edited = regular("e", &ns, "r1");
    h.create_request(&edited).await;
    let mut other = edited.clone();
    other.spec.writer.template = mc.spec.writer.template.clone();
    let other_digest =
        ic_controller::reconcile::model_cache::request::writer_template_digest(&other);
    api.patch_status(
        "e",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"writerTemplateDigest": other_digest}})),
    )
    .await
    .unwrap();
    h.ok(&ns, "e").await;
    assert_eq!(h.cond(&ns, "e", READY).await, is("False", "SpecChanged"));
    let s = h.status(&ns, "e").await;
    assert_eq!(
        s.writer_template_digest,
        Some(other_digest),
        "the record is final"
    );
    assert!(s.binding.is_none() && s.mode.is_none());
    assert!(h.bindings().await.is_empty());
    assert_eq!(h.side_effects().await, 0);
    // The unedited request goes on.
    h.ok(&ns, "a").await;
    assert_eq!(h.status(&ns, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(
        h.status(&ns, "a").await.writer_template_digest,
        Some(recorded)
    );
}

// ------------------------------------------------- row 6: a lost `status.binding` write

/// Request `a` whose pass added its reference to the binding and then lost the write that
/// records the binding on the request (`status.binding`, mode `durable`): a 500 on its second
/// status write (the first records the selection). Returns the binding holding the reference.
async fn referenced_but_unrecorded() -> (Harness, ModelCacheBinding) {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    let n = Arc::new(AtomicUsize::new(0));
    h.faults.rule(move |c| {
        if c.is("PATCH", "/modelcaches/a/status") && n.fetch_add(1, Ordering::SeqCst) == 1 {
            server_error()
        } else {
            Step::Pass
        }
    });
    assert!(h.reconcile(&ns, "a").await.is_err());
    let s = h.status(&ns, "a").await;
    assert!(s.binding.is_none() && s.mode.is_none(), "{s:?}");
    let b = h.bindings().await.remove(0);
    let uid = h.uid(&ns, "a").await;
    assert!(b.references().iter().any(|r| r.uid == uid));
    (h, b)
}

/// The request binds to the binding that holds its reference, as recorded there.
async fn assert_bound_to(h: &Harness, b: &ModelCacheBinding) {
    let s = h.status(&h.ns, "a").await;
    assert_eq!(s.mode, Some(CacheMode::Durable), "{s:?}");
    let recorded = s.binding.expect("status.binding");
    assert_eq!(Some(&recorded.name), b.metadata.name.as_ref());
    assert_eq!(Some(&recorded.uid), b.metadata.uid.as_ref());
    assert_eq!(h.bindings().await.len(), 1, "no second binding");
}

#[tokio::test]
async fn a_lost_binding_record_then_a_gate_change_binds_to_the_held_binding() {
    let (h, b) = referenced_but_unrecorded().await;
    let ns = h.ns.clone();
    // CachingSupport switched off before the retry: the binding already holds the request's
    // reference (step 4), so the gate no longer decides (step 6).
    let off = h.with_flags(ic_controller::reconcile::model_cache::FeatureFlags {
        caching_support: false,
        ..Default::default()
    });
    off.ok(&ns, "a").await;
    assert_bound_to(&h, &b).await;
    // The binding keeps a live reference, so it does not idle.
    h.reconcile_binding(b.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    let after = h
        .binding(b.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(after.references().len(), 1);
}

#[tokio::test]
async fn a_lost_binding_record_then_a_catalog_change_binds_to_the_held_binding() {
    let (h, b) = referenced_but_unrecorded().await;
    let ns = h.ns.clone();
    h.set_catalog(
        &json!({"drivers": [{"name": NVMESH, "provider": "nvmesh",
        "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "readerMountOptions": ["ro"]}]})
        .to_string(),
    )
    .await;
    h.ok(&ns, "a").await;
    assert_ne!(
        h.cond(&ns, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    assert_bound_to(&h, &b).await;
}

/// A request already left final without the binding (mode `none`, as a pass before the fix
/// wrote it) no longer keeps the binding's reference alive: the binding prunes it and idles.
#[tokio::test]
async fn a_reference_of_a_request_that_ended_without_the_binding_is_released() {
    let (h, b) = referenced_but_unrecorded().await;
    let ns = h.ns.clone();
    let api: Api<ic_shared::crd::ModelCache> = Api::namespaced(h.client.clone(), &ns);
    api.patch_status(
        "a",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"mode": "none"}})),
    )
    .await
    .unwrap();
    let name = b.metadata.name.clone().unwrap();
    h.reconcile_binding(&name).await.unwrap();
    let after = h.binding(&name).await.unwrap();
    assert!(after.references().is_empty(), "{:?}", after.status);
    assert!(after.status.as_ref().unwrap().idle_since.is_some());
}
