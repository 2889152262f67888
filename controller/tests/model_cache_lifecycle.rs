//! The binding lifecycle (spec 004 "Cache binding"): references pruned when their request is
//! gone, zero references past the idle period → `Retiring` → exactly the named, owned objects
//! deleted → finalizer dropped; nothing unnamed or foreign touched; uninstall strips finalizers
//! and stops when it cannot.
//!
//! Against the bare real apiserver (tests/bare_apiserver_support through
//! tests/model_cache_support): each test has its own namespaces and cache StorageClass; DELETE
//! preconditions, finalizers and 409s are the apiserver's own. The tests play the Job
//! controller, the PV binder and the pvc-/pv-protection controllers (`Harness::settle`), and
//! inject other writers' changes between the reconcilers' reads and writes with `Faults`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod model_cache_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use ic_controller::reconcile::model_cache::{
    names, strip_binding_finalizers, Error, UNINSTALL_MARKER,
};
use ic_shared::crd::{
    annotations, BindingPhase, ModelCacheBinding, ModelCacheBindingStatus, ReleaseSkip,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use model_cache_support::*;
use serde_json::json;

/// A request `a` bound, written and read (its reader claim bound).
async fn settled() -> (Harness, String) {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let b = h.bindings().await.remove(0);
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{ns}/vol-1"))
        .await;
    h.ok_binding_readers(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", "Ready").await, is("True", "ReadersReady"));
    (h, b.metadata.name.unwrap())
}

#[tokio::test]
async fn a_referenced_binding_stays_active() {
    let (h, name) = settled().await;
    h.reconcile_binding(&name).await.unwrap();
    h.clock.advance(Duration::from_secs(10 * 3600));
    h.reconcile_binding(&name).await.unwrap();
    let b = h.binding(&name).await.unwrap();
    assert_eq!(b.phase(), BindingPhase::Active);
    assert_eq!(b.references().len(), 1);
    assert!(b.status.unwrap().idle_since.is_none());
}

#[tokio::test]
async fn zero_references_past_the_idle_period_retire_and_release_exactly_what_is_named() {
    let (h, name) = settled().await;
    let ns = h.ns.clone();
    let b = h.binding(&name).await.unwrap();
    // An object with the binding's label that the binding does not name: never touched.
    let unnamed: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "not-named", "namespace": ns,
                     "labels": {annotations::BINDING_LABEL: name},
                     "annotations": {annotations::BINDING_UID_ANNOTATION: b.metadata.uid.clone().unwrap()}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    h.create(&unnamed).await;
    // A named object that someone else replaced (foreign): left alone.
    let lease_api: Api<Lease> = Api::namespaced(h.client.clone(), &h.ctl);
    let wname = names::writer_name(&name);
    lease_api.delete(&wname, &Default::default()).await.unwrap();
    let foreign: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": wname, "namespace": h.ctl}, "spec": {"holderIdentity": "someone"}
    }))
    .unwrap();
    lease_api
        .create(&Default::default(), &foreign)
        .await
        .unwrap();

    // The request goes away: the reference is pruned and the idle period starts.
    h.delete_request(&ns, "a").await;
    let mark = h.faults.calls().len();
    h.reconcile_binding(&name).await.unwrap();
    let b = h.binding(&name).await.unwrap();
    assert!(b.references().is_empty());
    assert_eq!(b.phase(), BindingPhase::Active);
    let idle_since = b.status.as_ref().unwrap().idle_since.clone().unwrap();
    assert_eq!(idle_since.0.as_second(), T0);
    // Before the idle period ends nothing happens.
    h.clock.advance(Duration::from_secs(3599));
    h.reconcile_binding(&name).await.unwrap();
    assert_eq!(
        h.binding(&name).await.unwrap().phase(),
        BindingPhase::Active
    );
    assert_eq!(h.names::<Job>(None).await.len(), 1);

    // Past it: Retiring, then release. The foreign Lease is kept and listed; with only foreign
    // objects left the finalizer is dropped, and the binding stays as the record.
    h.clock.advance(Duration::from_secs(1));
    h.reconcile_binding(&name).await.unwrap();
    let kept = h.binding(&name).await.expect("kept with the list");
    assert_eq!(kept.phase(), BindingPhase::Retiring);
    assert_eq!(
        kept.status.as_ref().unwrap().release_skipped,
        vec![ReleaseSkip {
            object: format!("Lease {}/{wname}", h.ctl),
            reason: "ForeignObject".into()
        }]
    );
    assert_eq!(released_condition(&kept).1, "ObjectsKept");
    assert!(!has_binding_finalizer(&kept));
    // The protection controllers let the deleted claims and volume go (no pod uses them).
    h.settle().await;
    assert!(h.names::<Job>(None).await.is_empty());
    assert_eq!(
        h.names::<PersistentVolumeClaim>(Some(&ns)).await,
        vec!["not-named".to_string()]
    );
    // The reader PV is gone; the writer's dynamically provisioned PV is not named and stays
    // (Retain: the storage administrator reclaims it).
    assert_eq!(
        h.names::<PersistentVolume>(None).await,
        vec![h.writer_pv(&name)]
    );
    let lease = lease_api.get(&wname).await.unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("someone")
    );
    // The order of the reconciler's calls: the phase moved to Retiring before the first
    // delete (status writes after the request went: the idle start, the retirement, the
    // release record).
    let log = h.calls_since(mark);
    let status_of = format!("/modelcachebindings/{name}/status");
    let retire = log
        .iter()
        .enumerate()
        .filter(|(_, c)| c.is("PUT", &status_of))
        .nth(1)
        .unwrap()
        .0;
    let first_delete = log.iter().position(|c| c.method == "DELETE").unwrap();
    assert!(retire < first_delete, "{log:#?}");
    assert_eq!(
        log.iter().filter(|c| c.is("PUT", &status_of)).count(),
        3,
        "{log:#?}"
    );
}

#[tokio::test]
async fn a_returning_reference_ends_the_idle_period() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    h.ok(&ns, "a").await;
    let name = h.bindings().await.remove(0).metadata.name.unwrap();
    h.delete_request(&ns, "a").await;
    h.reconcile_binding(&name).await.unwrap();
    assert!(h
        .binding(&name)
        .await
        .unwrap()
        .status
        .unwrap()
        .idle_since
        .is_some());
    h.clock.advance(Duration::from_secs(1800));
    h.create_request(&regular("b", &ns, "r1")).await;
    h.ok(&ns, "b").await;
    let b = h.binding(&name).await.unwrap();
    assert!(b.status.as_ref().unwrap().idle_since.is_none());
    h.clock.advance(Duration::from_secs(7200));
    h.reconcile_binding(&name).await.unwrap();
    assert_eq!(
        h.binding(&name).await.unwrap().phase(),
        BindingPhase::Active
    );
}

#[tokio::test]
async fn a_request_recreated_under_the_same_name_is_another_referrer() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    let old_uid = h
        .create_request(&regular("a", &ns, "r1"))
        .await
        .metadata
        .uid
        .unwrap();
    h.ok(&ns, "a").await;
    let name = h.bindings().await.remove(0).metadata.name.unwrap();
    h.delete_request(&ns, "a").await;
    let new_uid = h
        .create_request(&regular("a", &ns, "r1"))
        .await
        .metadata
        .uid
        .unwrap();
    assert_ne!(new_uid, old_uid);
    // The old UID's reference is stale even though ns/name exist.
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.unwrap().references().is_empty());
    // The new request joins with its own UID.
    h.ok(&ns, "a").await;
    let refs = h.binding(&name).await.unwrap().references().to_vec();
    assert_eq!(refs.len(), 1);
    assert_ne!(refs[0].uid, old_uid);
    assert_eq!(refs[0].uid, new_uid);
}

/// Issue 17 item 2: deleting a binding that a live request references releases nothing; it is
/// marked Retiring (never joined again), and released only once it has had zero references
/// for the idle period. (The delete only sets `deletionTimestamp`: the finalizer holds it.)
#[tokio::test]
async fn a_binding_deleted_while_referenced_releases_nothing_until_idle() {
    let (h, name) = settled().await;
    let ns = h.ns.clone();
    Api::<ModelCacheBinding>::namespaced(h.client.clone(), &h.ctl)
        .delete(&name, &Default::default())
        .await
        .unwrap();
    assert!(h
        .binding(&name)
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_some());
    let before = h.side_effects().await;
    let mark = h.faults.calls().len();
    h.reconcile_binding(&name).await.unwrap();
    let b = h.binding(&name).await.unwrap();
    assert_eq!(b.phase(), BindingPhase::Retiring, "never joined again");
    assert_eq!(b.references().len(), 1, "the live reference is kept");
    assert_eq!(h.side_effects().await, before, "nothing released");
    assert!(!h.calls_since(mark).iter().any(|c| c.method == "DELETE"));
    // Hours later, still referenced: still nothing released.
    h.clock.advance(Duration::from_secs(10 * 3600));
    h.reconcile_binding(&name).await.unwrap();
    assert_eq!(h.side_effects().await, before);
    // The request sees the binding retiring and is never rebound.
    h.ok(&ns, "a").await;
    assert_eq!(
        h.cond(&ns, "a", "Ready").await,
        is("False", "BindingRetiring")
    );
    assert_eq!(h.bindings().await.len(), 1);
    // The request goes: the idle period starts; only past it is everything released.
    h.delete_request(&ns, "a").await;
    h.reconcile_binding(&name).await.unwrap();
    assert_eq!(h.side_effects().await, before);
    h.clock.advance(Duration::from_secs(3599));
    h.reconcile_binding(&name).await.unwrap();
    assert_eq!(h.side_effects().await, before);
    assert!(!h.calls_since(mark).iter().any(|c| c.method == "DELETE"));
    // What the binding says just before its finalizer goes (the finalizer patch).
    let last: Arc<Mutex<Option<ModelCacheBindingStatus>>> = Arc::default();
    let (seen, client, ctl, finalizer_patch) = (
        last.clone(),
        h.client.clone(),
        h.ctl.clone(),
        format!("/modelcachebindings/{name}"),
    );
    let bname = name.clone();
    h.faults.rule(move |c| {
        if !c.is("PATCH", &finalizer_patch) {
            return Step::Pass;
        }
        let (seen, client, ctl, bname) = (seen.clone(), client.clone(), ctl.clone(), bname.clone());
        Step::Before(
            async move {
                let b = Api::<ModelCacheBinding>::namespaced(client, &ctl)
                    .get(&bname)
                    .await
                    .unwrap();
                *seen.lock().unwrap() = b.status;
            }
            .boxed(),
        )
    });
    h.clock.advance(Duration::from_secs(1));
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.is_none());
    h.settle().await;
    assert!(h.names::<Job>(None).await.is_empty());
    // Released=True was recorded before the finalizer went.
    let last = last
        .lock()
        .unwrap()
        .clone()
        .expect("the finalizer was patched");
    let released = ic_shared::crd::find_condition(&last.conditions, "Released").unwrap();
    assert_eq!(released.status, "True");
    assert_eq!(released.reason, "Released");
}

/// Retires the settled binding `name` (request gone, idle period over) and runs one pass.
async fn retire(h: &Harness, name: &str) {
    h.delete_request(&h.ns, "a").await;
    h.reconcile_binding(name).await.unwrap();
    h.clock.advance(Duration::from_secs(3600));
    h.reconcile_binding(name).await.unwrap();
}

fn released_condition(b: &ModelCacheBinding) -> (String, String, String) {
    let c =
        ic_shared::crd::find_condition(&b.status.as_ref().unwrap().conditions, "Released").unwrap();
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

/// Issue 17 item 3: an object replaced between the ownership read and the delete is never
/// deleted: the delete carries the read UID as a precondition; the API server refuses it.
#[tokio::test]
async fn release_never_deletes_an_object_replaced_after_the_ownership_read() {
    let (h, name) = settled().await;
    let ns = h.ns.clone();
    let claim = names::reader_claim(&name);
    // Right before the release's delete of the (owned, read) reader claim, someone deletes
    // it and creates their own claim under the same name.
    let armed = Arc::new(AtomicBool::new(false));
    let (arm, client, ns_in, claim_in) =
        (armed.clone(), h.client.clone(), ns.clone(), claim.clone());
    h.faults.rule(move |c| {
        if !(c.method == "DELETE"
            && c.has("persistentvolumeclaims")
            && c.has(&claim_in)
            && arm.swap(false, Ordering::SeqCst))
        {
            return Step::Pass;
        }
        let (client, ns, claim) = (client.clone(), ns_in.clone(), claim_in.clone());
        Step::Before(
            async move {
                let api = Api::<PersistentVolumeClaim>::namespaced(client, &ns);
                let owned = api.get(&claim).await.unwrap();
                api.delete(&claim, &DeleteParams::default()).await.unwrap();
                // The pvc-protection controller lets it go (no pod uses it).
                api.patch(
                    &claim,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": []}})),
                )
                .await
                .unwrap();
                assert!(api.get_opt(&claim).await.unwrap().is_none());
                let mut theirs = owned.clone();
                theirs.metadata = kube::api::ObjectMeta {
                    name: owned.metadata.name.clone(),
                    namespace: owned.metadata.namespace.clone(),
                    labels: Some([("app".to_string(), "theirs".to_string())].into()),
                    ..Default::default()
                };
                theirs.spec.as_mut().unwrap().volume_name = None;
                theirs.status = None;
                api.create(&PostParams::default(), &theirs).await.unwrap();
            }
            .boxed(),
        )
    });
    h.delete_request(&ns, "a").await;
    h.reconcile_binding(&name).await.unwrap();
    h.clock.advance(Duration::from_secs(3600));
    armed.store(true, Ordering::SeqCst);
    h.reconcile_binding(&name).await.unwrap();
    assert!(
        !armed.load(Ordering::SeqCst),
        "the release deleted the claim"
    );
    h.settle().await;
    let claims = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns);
    let theirs = claims
        .get(&claim)
        .await
        .expect("the replacing claim is never deleted");
    assert!(theirs.metadata.deletion_timestamp.is_none());
    assert_eq!(
        labels_of(&theirs.metadata).get("app").map(String::as_str),
        Some("theirs")
    );
    // The binding stays with the kept object listed, and says so.
    let b = h.binding(&name).await.expect("kept for the operator");
    let (status, reason, message) = released_condition(&b);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "ObjectsKept"));
    assert!(message.contains(&claim), "{message}");
    let kept = &b.status.as_ref().unwrap().release_skipped;
    assert_eq!(
        kept,
        &vec![ReleaseSkip {
            object: format!("PersistentVolumeClaim {ns}/{claim}"),
            reason: "ChangedSinceRead".into()
        }]
    );
    // Everything else it owned is gone.
    assert!(h.names::<Job>(None).await.is_empty());
    assert_eq!(
        h.names::<PersistentVolumeClaim>(Some(&ns)).await,
        vec![claim.clone()]
    );
    // Next pass: the object is read as foreign now; still never deleted; only foreign objects
    // are left, so the finalizer goes while the binding keeps the record.
    h.reconcile_binding(&name).await.unwrap();
    let b = h.binding(&name).await.unwrap();
    assert_eq!(
        b.status.as_ref().unwrap().release_skipped[0].reason,
        "ForeignObject"
    );
    assert!(!has_binding_finalizer(&b));
    let theirs = claims.get_opt(&claim).await.unwrap().unwrap();
    assert!(theirs.metadata.deletion_timestamp.is_none());
    // Once the operator removes it, the next pass finishes.
    h.delete_claim(&ns, &claim).await;
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.is_none());
}

/// Issue 17 item 9: the writer claim is deleted only while its PV still has reclaim policy
/// `Retain`, re-read at release ("configuration drift never authorizes data deletion").
#[tokio::test]
async fn release_keeps_a_claim_whose_volume_no_longer_retains() {
    let (h, name) = settled().await;
    let ns = h.ns.clone();
    let pvs: Api<PersistentVolume> = Api::all(h.client.clone());
    let writer_pv = h.writer_pv(&name);
    let set_policy = |p: &'static str| {
        let pvs = pvs.clone();
        let writer_pv = writer_pv.clone();
        async move {
            pvs.patch(
                &writer_pv,
                &Default::default(),
                &Patch::Merge(json!({"spec": {"persistentVolumeReclaimPolicy": p}})),
            )
            .await
            .unwrap();
        }
    };
    set_policy("Delete").await;
    retire(&h, &name).await;
    h.settle().await;
    let wname = names::writer_name(&name);
    let claims = h.names::<PersistentVolumeClaim>(Some(&ns)).await;
    assert_eq!(claims, vec![wname.clone()], "only the writer claim is kept");
    let writer_claim = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), &ns)
        .get(&wname)
        .await
        .unwrap();
    assert!(
        writer_claim.metadata.deletion_timestamp.is_none(),
        "never deleted"
    );
    let b = h.binding(&name).await.expect("the binding stays");
    assert_eq!(
        b.status.as_ref().unwrap().release_skipped,
        vec![ReleaseSkip {
            object: format!("PersistentVolumeClaim {ns}/{wname}"),
            reason: "VolumeNotRetained".into()
        }]
    );
    assert_eq!(released_condition(&b).1, "ObjectsKept");
    assert!(
        has_binding_finalizer(&b),
        "an owned object is still protected"
    );
    // Retain again: the next pass releases it and the binding goes.
    set_policy("Retain").await;
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.is_none());
    h.settle().await;
    assert!(h.names::<PersistentVolumeClaim>(Some(&ns)).await.is_empty());
}

/// A binding `name` in `ctl` with our finalizer and another one, naming Job `ns/j`.
fn binding_with_finalizer(h: &Harness, name: &str) -> ModelCacheBinding {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCacheBinding",
        "metadata": {"name": name, "namespace": h.ctl, "finalizers": [annotations::BINDING_FINALIZER, "example.com/other"]},
        "spec": {"identity": {"workflow": "regularModelCache", "sharingDomainDigest": "a".repeat(64), "cacheHandleDigest": "b".repeat(64)},
                 "decision": {"provider": "nvmesh", "provisioner": NVMESH, "flow": "roxReadOnly", "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "catalogProfileDigest": "c"},
                 "storageClass": {"name": h.sc, "uid": "u", "reclaimPolicy": "Retain", "configurationDigest": "d"},
                 "resources": {"jobs": [{"namespace": h.ns, "name": "j"}]}}
    }))
    .unwrap()
}

#[tokio::test]
async fn uninstall_strips_only_our_finalizer_and_deletes_nothing() {
    let h = Setup::default().build().await;
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": h.ns},
        "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}], "restartPolicy": "Never"}}}
    }))
    .unwrap();
    h.create(&binding_with_finalizer(&h, "b1")).await;
    h.create(&binding_with_finalizer(&h, "b2")).await;
    h.create(&job).await;
    assert_eq!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl)
            .await
            .unwrap(),
        2
    );
    let all = h.bindings().await;
    assert_eq!(all.len(), 2);
    for b in all {
        assert_eq!(
            b.metadata.finalizers,
            Some(vec!["example.com/other".to_string()])
        );
    }
    assert_eq!(h.names::<Job>(None).await, vec!["j".to_string()]);
    assert!(!h.faults.calls().iter().any(|c| c.method == "DELETE"));
    // Idempotent.
    assert_eq!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl)
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn uninstall_stops_when_a_finalizer_cannot_be_stripped() {
    let h = Setup::default().build().await;
    h.create(&binding_with_finalizer(&h, "b1")).await;
    h.create(&binding_with_finalizer(&h, "b2")).await;
    h.faults.rule(|c| {
        if c.method == "PATCH" && c.has("modelcachebindings") {
            server_error()
        } else {
            Step::Pass
        }
    });
    match strip_binding_finalizers(&h.ctx.client, &h.ctl).await {
        Err(Error::StripFinalizer { name, .. }) => assert!(name == "b1" || name == "b2"),
        other => panic!("expected StripFinalizer, got {other:?}"),
    }
    // It stopped at the first failure: one attempt, both bindings keep their finalizer.
    let attempts = h
        .faults
        .calls()
        .iter()
        .filter(|c| c.method == "PATCH" && c.has("modelcachebindings"))
        .count();
    assert_eq!(attempts, 1);
    let all = h.bindings().await;
    assert_eq!(all.len(), 2);
    for b in all {
        assert!(has_binding_finalizer(&b));
    }
    // The list failing stops it too.
    let h = Setup::default().build().await;
    h.create(&binding_with_finalizer(&h, "b1")).await;
    h.faults.rule(|c| {
        if c.is("GET", "/modelcachebindings") {
            server_error()
        } else {
            Step::Pass
        }
    });
    assert!(matches!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl).await,
        Err(Error::Kube(_))
    ));
    assert!(has_binding_finalizer(&h.binding("b1").await.unwrap()));
}

// ------------------------------------------------------------------ issue 17 item 8: uninstall

async fn marker_exists_in(h: &Harness) -> bool {
    Api::<ConfigMap>::namespaced(h.client.clone(), &h.ctl)
        .get_opt(UNINSTALL_MARKER)
        .await
        .unwrap()
        .is_some()
}

#[tokio::test]
async fn uninstall_stops_new_bindings_before_it_strips() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create(&binding_with_finalizer(&h, "b1")).await;
    h.create_request(&regular("a", &ns, "r1")).await;
    assert_eq!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl)
            .await
            .unwrap(),
        1
    );
    assert!(marker_exists_in(&h).await);
    let log = h.faults.calls();
    assert!(
        log[0].is("POST", &format!("/namespaces/{}/configmaps", h.ctl)),
        "the marker comes before anything else: {log:#?}"
    );
    // A request reconciled now creates no binding: nothing can add a finalizer after the strip.
    h.ok(&ns, "a").await;
    assert_eq!(h.cond(&ns, "a", "Ready").await, is("False", "Uninstalling"));
    let names: Vec<String> = h
        .bindings()
        .await
        .into_iter()
        .map(|b| b.metadata.name.unwrap())
        .collect();
    assert_eq!(names, vec!["b1".to_string()]);
    assert_eq!(h.side_effects().await, 0);
}

/// The controller read "no marker" just before the hook created it, and its create lands after
/// the hook's last list: the controller sees the marker after its create and strips the
/// finalizer it just added.
#[tokio::test]
async fn a_binding_created_as_the_uninstall_begins_loses_its_finalizer() {
    let h = Setup::nvmesh().build().await;
    let ns = h.ns.clone();
    h.create_request(&regular("a", &ns, "r1")).await;
    let (client, ctl) = (h.client.clone(), h.ctl.clone());
    h.faults.rule(move |c| {
        if !c.is("POST", "/modelcachebindings") {
            return Step::Pass;
        }
        let (client, ctl) = (client.clone(), ctl.clone());
        Step::Before(
            async move {
                let marker: ConfigMap = serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": UNINSTALL_MARKER, "namespace": ctl}
                }))
                .unwrap();
                Api::<ConfigMap>::namespaced(client, &ctl)
                    .create(&PostParams::default(), &marker)
                    .await
                    .unwrap();
            }
            .boxed(),
        )
    });
    h.ok(&ns, "a").await;
    let all = h.bindings().await;
    assert_eq!(all.len(), 1);
    assert!(!has_binding_finalizer(&all[0]));
    assert_eq!(h.cond(&ns, "a", "Ready").await, is("False", "Uninstalling"));
    assert_eq!(h.side_effects().await, 0);
}

#[tokio::test]
async fn uninstall_strips_bindings_that_appear_while_it_strips() {
    let h = Setup::default().build().await;
    h.create(&binding_with_finalizer(&h, "b1")).await;
    let once = AtomicBool::new(false);
    let (client, b2) = (h.client.clone(), binding_with_finalizer(&h, "b2"));
    h.faults.rule(move |c| {
        if !(c.method == "PATCH" && c.has("modelcachebindings"))
            || once.swap(true, Ordering::SeqCst)
        {
            return Step::Pass;
        }
        // An older controller creates another binding mid-strip.
        let (client, b2) = (client.clone(), b2.clone());
        Step::Before(
            async move {
                let ns = b2.metadata.namespace.clone().unwrap();
                Api::<ModelCacheBinding>::namespaced(client, &ns)
                    .create(&PostParams::default(), &b2)
                    .await
                    .unwrap();
            }
            .boxed(),
        )
    });
    assert_eq!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl)
            .await
            .unwrap(),
        2
    );
    let all = h.bindings().await;
    assert_eq!(all.len(), 2);
    for b in all {
        assert_eq!(
            b.metadata.finalizers,
            Some(vec!["example.com/other".to_string()])
        );
    }
}

#[tokio::test]
async fn uninstall_with_no_crd_has_nothing_to_strip() {
    let h = Setup::default().build().await;
    let ctl = h.ctl.clone();
    h.faults.rule(move |c| {
        if c.is("GET", "/modelcachebindings") && c.has(&ctl) {
            not_found("the server could not find the requested resource (modelcachebindings)")
        } else {
            Step::Pass
        }
    });
    assert_eq!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl)
            .await
            .unwrap(),
        0
    );
}

/// The finalizer patch carries the read resourceVersion: a finalizer another controller added
/// in between is not overwritten (a plain merge patch replaces the whole list); the apiserver
/// answers the stale patch 409 and the strip reads again.
#[tokio::test]
async fn uninstall_keeps_a_finalizer_added_concurrently() {
    let h = Setup::default().build().await;
    h.create(&binding_with_finalizer(&h, "b1")).await;
    let once = AtomicBool::new(false);
    let (client, ctl) = (h.client.clone(), h.ctl.clone());
    h.faults.rule(move |c| {
        if !(c.method == "PATCH" && c.has("modelcachebindings"))
            || once.swap(true, Ordering::SeqCst)
        {
            return Step::Pass;
        }
        let (client, ctl) = (client.clone(), ctl.clone());
        Step::Before(
            async move {
                let api = Api::<ModelCacheBinding>::namespaced(client, &ctl);
                let mut b = api.get("b1").await.unwrap();
                b.metadata
                    .finalizers
                    .get_or_insert_with(Vec::new)
                    .push("example.com/late".into());
                api.replace("b1", &PostParams::default(), &b).await.unwrap();
            }
            .boxed(),
        )
    });
    assert_eq!(
        strip_binding_finalizers(&h.ctx.client, &h.ctl)
            .await
            .unwrap(),
        1
    );
    let b = h.binding("b1").await.unwrap();
    assert_eq!(
        b.metadata.finalizers,
        Some(vec![
            "example.com/other".to_string(),
            "example.com/late".to_string()
        ])
    );
    // The first patch was refused (stale resourceVersion), the second one went through.
    let patches = h
        .faults
        .calls()
        .iter()
        .filter(|c| c.is("PATCH", "/modelcachebindings/b1"))
        .count();
    assert_eq!(patches, 2);
}

/// The marker's name crosses a boundary (the controller's RBAC in the chart grants `get` on it
/// by name): the chart names the very ConfigMap the code creates and reads.
#[test]
fn the_chart_grants_the_marker_the_code_uses() {
    let rbac = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../chart/templates/model-cache-rbac.yaml"),
    )
    .unwrap();
    assert!(
        rbac.contains(&format!("resourceNames: [\"{UNINSTALL_MARKER}\"]")),
        "chart/templates/model-cache-rbac.yaml must grant get on {UNINSTALL_MARKER}"
    );
}
