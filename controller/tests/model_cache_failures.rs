//! One test per row of spec 004's "Failure rules" table, against the in-memory API.
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
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let before = h.bindings().await.remove(0);
    // The catalog now gives NVMesh other reader options and a handle rule, and the class is
    // replaced by another NVMesh class (new UID, other parameters).
    h.set_catalog(
        &json!({"drivers": [{"name": NVMESH, "provider": "nvmesh-2",
        "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "readerMountOptions": ["ro"]}]})
        .to_string(),
    )
    .await;
    h.replace_class(NVMESH, "Retain").await;
    // A new request for the same cache joins the binding and its recorded decision.
    h.create_request(&regular("b", NS, "r1")).await;
    h.ok(NS, "b").await;
    h.ok(NS, "a").await;
    let after = h.bindings().await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].spec, before.spec);
    assert_eq!(after[0].references().len(), 2);
    let sb = h.status(NS, "b").await;
    assert_eq!(sb.mode, Some(CacheMode::Durable));
    assert_eq!(sb.binding, h.status(NS, "a").await.binding);
    // b's selection records what the catalog says now; the binding, not it, decides the flow.
    assert_ne!(
        sb.selection.unwrap().decision_digest,
        h.status(NS, "a").await.selection.unwrap().decision_digest
    );
    assert_eq!(
        after[0].spec.decision.reader_mount_options,
        vec!["ro", "norecovery", "nouuid"]
    );
    assert_eq!(after[0].spec.storage_class.uid, "sc-uid-1");
    // A gate switched off afterwards changes nothing either (mode and binding are final).
    h.ok(NS, "a").await;
    assert_eq!(h.status(NS, "a").await.mode, Some(CacheMode::Durable));
}

// ----------------------------------------------------------------------------- row 2

/// A request whose durable selection was recorded but whose binding create failed.
async fn selected_but_unbound() -> Harness {
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .intercept(|calls| {
            let fail = Arc::new(AtomicBool::new(true));
            recording(calls).create(move |ctx| {
                let kind = ctx
                    .object
                    .get("kind")
                    .and_then(|k| k.as_str())
                    .unwrap_or("");
                if kind == "ModelCacheBinding" && fail.swap(false, Ordering::SeqCst) {
                    return Err(server_error());
                }
                Ok(None)
            })
        })
        .build()
        .await;
    assert!(h.reconcile(NS, "a").await.is_err());
    let s = h.status(NS, "a").await;
    assert!(s.selection.is_some() && s.binding.is_none() && s.mode.is_none());
    assert!(h.bindings().await.is_empty());
    h
}

#[tokio::test]
async fn row2_catalog_drift_before_the_binding_exists_fails_before_any_side_effect() {
    let h = selected_but_unbound().await;
    h.set_catalog(
        &json!({"drivers": [{"name": NVMESH, "provider": "nvmesh",
        "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "readerMountOptions": ["ro"]}]})
        .to_string(),
    )
    .await;
    h.ok(NS, "a").await;
    assert_eq!(
        h.cond(NS, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    assert!(h.bindings().await.is_empty());
    assert_eq!(h.side_effects().await, 0);
    assert_eq!(h.status(NS, "a").await.mode, None);
}

#[tokio::test]
async fn row2_class_drift_before_the_binding_exists_fails_before_any_side_effect() {
    for (provisioner, reclaim) in [(NVMESH, "Retain"), (FSS, "Retain"), (NVMESH, "Delete")] {
        let h = selected_but_unbound().await;
        h.replace_class(provisioner, reclaim).await;
        h.ok(NS, "a").await;
        assert_eq!(
            h.cond(NS, "a", READY).await,
            is("False", "ConfigurationDrifted"),
            "{provisioner} {reclaim}"
        );
        assert!(h.bindings().await.is_empty());
        assert_eq!(h.side_effects().await, 0);
        let s = h.status(NS, "a").await;
        assert_eq!(
            s.mode, None,
            "not even ephemeral: the recorded selection stands"
        );
    }
    // Class deleted outright.
    let h = selected_but_unbound().await;
    Api::<k8s_openapi::api::storage::v1::StorageClass>::all(h.client.clone())
        .delete(SC, &Default::default())
        .await
        .unwrap();
    h.ok(NS, "a").await;
    assert_eq!(
        h.cond(NS, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    assert_eq!(h.side_effects().await, 0);
}

#[tokio::test]
async fn row2_no_drift_means_the_interrupted_request_goes_on() {
    let h = selected_but_unbound().await;
    h.ok(NS, "a").await;
    assert_eq!(h.status(NS, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(h.bindings().await.len(), 1);
}

// ----------------------------------------------------------------------------- row 3

async fn bound_request() -> (Harness, ModelCacheBinding) {
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let b = h.bindings().await.remove(0);
    (h, b)
}

async fn assert_never_rebound(h: &Harness, reason: &str, recorded: &ic_shared::crd::BindingRef) {
    let jobs_before = h.names::<Job>(None).await;
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", READY).await, is("False", reason));
    let s = h.status(NS, "a").await;
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
    let (h, b) = bound_request().await;
    let recorded = h.status(NS, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), CTL);
    let mut r = b.clone();
    r.status.as_mut().unwrap().phase = Some(BindingPhase::Retiring);
    api.replace_status(&recorded.name, &PostParams::default(), &r)
        .await
        .unwrap();
    assert_never_rebound(&h, "BindingRetiring", &recorded).await;
}

#[tokio::test]
async fn row3_a_missing_binding_fails_the_request_and_is_never_rebound() {
    let (h, _) = bound_request().await;
    let recorded = h.status(NS, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), CTL);
    api.delete(&recorded.name, &Default::default())
        .await
        .unwrap();
    assert_never_rebound(&h, "BindingMissing", &recorded).await;
    assert!(h.bindings().await.is_empty());
}

#[tokio::test]
async fn row3_a_binding_recreated_under_the_same_name_is_missing() {
    let (h, b) = bound_request().await;
    let recorded = h.status(NS, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), CTL);
    api.delete(&recorded.name, &Default::default())
        .await
        .unwrap();
    let mut again = b.clone();
    again.metadata.uid = None;
    again.metadata.resource_version = None;
    api.create(&PostParams::default(), &again).await.unwrap();
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", READY).await, is("False", "BindingMissing"));
    assert_eq!(h.status(NS, "a").await.binding, Some(recorded));
}

#[tokio::test]
async fn row3_a_binding_without_this_reference_fails_the_request() {
    let (h, b) = bound_request().await;
    let recorded = h.status(NS, "a").await.binding.unwrap();
    let api: Api<ModelCacheBinding> = Api::namespaced(h.client.clone(), CTL);
    let mut r = b.clone();
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
    let mc = regular("a", NS, "r1");
    let bname = names::binding_name(&names::identity_for(&mc), 1);
    let squatter: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": names::writer_name(&bname), "namespace": NS, "labels": {"app": "mine"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    let h = Setup::nvmesh().with(&mc).with(&squatter).build().await;
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", READY).await, is("False", "ForeignObject"));
    let pvc = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
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
    let mc = regular("a", NS, "r1");
    let bname = names::binding_name(&names::identity_for(&mc), 1);
    // Right label, another binding's UID (e.g. a binding of the same name that was deleted).
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": names::writer_name(&bname), "namespace": NS,
                     "labels": {annotations::BINDING_LABEL: bname},
                     "annotations": {annotations::BINDING_UID_ANNOTATION: "some-older-uid"}},
        "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}], "restartPolicy": "Never"}}}
    }))
    .unwrap();
    let h = Setup::nvmesh().with(&mc).with(&job).build().await;
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", READY).await, is("False", "ForeignObject"));
    // Released later, the binding leaves it alone (see model_cache_lifecycle.rs for release).
    let j = Api::<Job>::namespaced(h.client.clone(), NS)
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
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{NS}/vol-1"))
        .await;
    h.ok(NS, "a").await;
    let bname = b.metadata.name.clone().unwrap();
    let pv = Api::<PersistentVolume>::all(h.client.clone())
        .get(&names::reader_pv(&bname, NS))
        .await
        .unwrap();
    let claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .get(&names::reader_claim(&bname))
        .await
        .unwrap();
    let pvs = pv.spec.unwrap();
    let cs = claim.spec.unwrap();
    // The writer PV had storageClassName SC; the reader pair has none on both sides: the PV's
    // is cleared and the claim's is the empty string (no default class is ever assigned).
    assert_eq!(
        pvs.storage_class_name.unwrap_or_default(),
        cs.storage_class_name.clone().unwrap()
    );
    assert_eq!(cs.storage_class_name.as_deref(), Some(""));
    assert_eq!(cs.volume_name.as_deref(), pv.metadata.name.as_deref());
    let cref = pvs.claim_ref.unwrap();
    assert_eq!(cref.name.as_deref(), claim.metadata.name.as_deref());
    assert_eq!(cref.namespace.as_deref(), Some(NS));
    assert_eq!(pvs.access_modes, cs.access_modes);
    assert_eq!(pvs.volume_mode, cs.volume_mode);
    assert_eq!(
        pvs.capacity.unwrap()["storage"],
        cs.resources.unwrap().requests.unwrap()["storage"]
    );
}

// ----------------------------------------------------------------------------- row 6

/// Runs request `a` once with a 500 injected into the `n`-th call of the chosen kind, and
/// checks that nothing changed past the last successful write.
#[tokio::test]
async fn row6_transient_errors_requeue_without_changing_state() {
    // (what fails, the interceptor)
    type Inject = Box<dyn Fn(Arc<Calls>) -> kube_fake_client::interceptor::Funcs>;
    let cases: Vec<(&str, Inject)> = vec![
        (
            "get StorageClass",
            Box::new(|c| {
                recording(c).get(|ctx| {
                    if ctx.name == SC {
                        Err(server_error())
                    } else {
                        Ok(None)
                    }
                })
            }),
        ),
        (
            "list bindings",
            Box::new(|c| {
                let fail = Arc::new(AtomicBool::new(true));
                recording(c).list(move |ctx| {
                    if ctx.namespace == Some(CTL) && fail.swap(false, Ordering::SeqCst) {
                        Err(server_error())
                    } else {
                        Ok(None)
                    }
                })
            }),
        ),
        (
            "add reference",
            Box::new(|c| {
                recording(c).replace_status(|ctx| {
                    if ctx.object.get("kind").and_then(|k| k.as_str()) == Some("ModelCacheBinding")
                    {
                        Err(server_error())
                    } else {
                        Ok(None)
                    }
                })
            }),
        ),
        (
            "record binding on request",
            Box::new(|c| {
                let n = Arc::new(AtomicUsize::new(0));
                recording(c).patch_status(move |_| {
                    // The first request status write (the selection) passes, the second fails.
                    if n.fetch_add(1, Ordering::SeqCst) == 1 {
                        Err(server_error())
                    } else {
                        Ok(None)
                    }
                })
            }),
        ),
    ];
    for (case, inject) in cases {
        let h = Setup::nvmesh()
            .with(&regular("a", NS, "r1"))
            .intercept(inject)
            .build()
            .await;
        let err = h.reconcile(NS, "a").await;
        assert!(err.is_err(), "{case}: expected an error to requeue");
        let s = h.status(NS, "a").await;
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
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .intercept(|c| {
            let fail = Arc::new(AtomicBool::new(true));
            recording(c).replace_status(move |ctx| {
                if ctx.object.get("kind").and_then(|k| k.as_str()) == Some("ModelCacheBinding")
                    && fail.swap(false, Ordering::SeqCst)
                {
                    Err(server_error())
                } else {
                    Ok(None)
                }
            })
        })
        .build()
        .await;
    assert!(h.reconcile(NS, "a").await.is_err());
    assert_eq!(h.side_effects().await, 0);
    h.ok(NS, "a").await;
    let s = h.status(NS, "a").await;
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
    h.delete_request(NS, "a").await;
    let h = Setup::default()
        .with(&b)
        .intercept(|c| {
            recording(c).get(|ctx| {
                if ctx.name == "a" {
                    Err(server_error())
                } else {
                    Ok(None)
                }
            })
        })
        .build()
        .await;
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
    let mc = regular("a", NS, "r1");
    let bname = names::binding_name(&names::identity_for(&mc), 1);
    let claim = names::reader_claim(&bname);
    let squatter: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": NS, "labels": {"app": "mine"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    let hidden = claim.clone();
    let h = Setup::nvmesh()
        .with(&mc)
        .with(&squatter)
        .intercept(move |calls| {
            let first = Arc::new(AtomicBool::new(true));
            recording(calls).get(move |ctx| {
                // Our read misses it: it appears right after.
                if ctx.name == hidden && first.swap(false, Ordering::SeqCst) {
                    return Err(kube_fake_client::Error::NotFound {
                        kind: "persistentvolumeclaims".into(),
                        name: ctx.name.to_string(),
                        namespace: ctx.namespace.to_string(),
                    });
                }
                Ok(None)
            })
        })
        .build()
        .await;
    h.ok(NS, "a").await;
    let b = h.bindings().await.remove(0);
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{NS}/vol-1"))
        .await;
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", READY).await, is("False", "ForeignObject"));
    let pvc = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
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
    assert_ne!(h.cond(NS, "a", READY).await, is("True", "ReadersReady"));
}

/// Item 6: `provider` is a diagnostics label that gates nothing: editing it between the
/// recorded selection and the binding is not drift.
#[tokio::test]
async fn row2_a_provider_label_edit_is_not_drift() {
    let h = selected_but_unbound().await;
    let mut catalog: serde_json::Value = serde_json::from_str(&catalog_text()).unwrap();
    catalog["drivers"][0]["provider"] = json!("excelero-nvmesh");
    h.set_catalog(&catalog.to_string()).await;
    h.ok(NS, "a").await;
    assert_eq!(h.status(NS, "a").await.mode, Some(CacheMode::Durable));
    assert_eq!(h.bindings().await.len(), 1);
    assert_ne!(
        h.cond(NS, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
    // Anything that gates (here the reader mount options) still is drift.
    let h = selected_but_unbound().await;
    let mut catalog: serde_json::Value = serde_json::from_str(&catalog_text()).unwrap();
    catalog["drivers"][0]["readerMountOptions"] = json!(["ro"]);
    h.set_catalog(&catalog.to_string()).await;
    h.ok(NS, "a").await;
    assert_eq!(
        h.cond(NS, "a", READY).await,
        is("False", "ConfigurationDrifted")
    );
}

/// Item 10: an edit inside `spec.writer.template` (which the API server's CEL cannot see, see
/// model_cache_cel.rs) is refused by the controller before anything is provisioned from it.
#[tokio::test]
async fn a_writer_template_edit_the_api_server_admits_is_refused() {
    let h = selected_but_unbound().await;
    let recorded = h.status(NS, "a").await.writer_template_digest.unwrap();
    assert_eq!(recorded.len(), 64);
    let api: Api<ic_shared::crd::ModelCache> = Api::namespaced(h.client.clone(), NS);
    let mut mc = api.get("a").await.unwrap();
    mc.spec.writer.template =
        json!({"spec": {"containers": [{"name": "fetch", "image": "ghcr.io/example/other:2"}]}});
    api.replace("a", &PostParams::default(), &mc).await.unwrap();
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", READY).await, is("False", "SpecChanged"));
    let s = h.status(NS, "a").await;
    assert_eq!(
        s.writer_template_digest,
        Some(recorded),
        "the record is final"
    );
    assert!(s.binding.is_none() && s.mode.is_none());
    assert!(h.bindings().await.is_empty());
    assert_eq!(h.side_effects().await, 0);
    // The same template again (an edit undone) goes on.
    mc = api.get("a").await.unwrap();
    mc.spec.writer.template = regular("a", NS, "r1").spec.writer.template;
    api.replace("a", &PostParams::default(), &mc).await.unwrap();
    h.ok(NS, "a").await;
    assert_eq!(h.status(NS, "a").await.mode, Some(CacheMode::Durable));
}
