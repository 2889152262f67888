//! The binding lifecycle (spec 004 "Cache binding"): references pruned when their request is
//! gone, zero references past the idle period → `Retiring` → exactly the named, owned objects
//! deleted → finalizer dropped; nothing unnamed or foreign touched; uninstall strips finalizers
//! and stops when it cannot.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod model_cache_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ic_controller::reconcile::model_cache::{
    names, strip_binding_finalizers, Error, UNINSTALL_MARKER,
};
use ic_shared::crd::{annotations, BindingPhase, ModelCacheBinding, ReleaseSkip};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ListParams};
use model_cache_support::*;
use serde_json::json;

/// A request `a` bound, written and read, plus an unnamed object carrying the binding's label.
async fn settled() -> (Harness, String) {
    settled_in(Setup::nvmesh()).await
}

/// [`settled`] on a prepared setup (interceptors).
async fn settled_in(setup: Setup) -> (Harness, String) {
    let h = setup.with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let b = h.bindings().await.remove(0);
    h.complete_writer(&b, NVMESH, &format!("nvmesh/{NS}/vol-1"))
        .await;
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", "Ready").await, is("True", "ReadersReady"));
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
    let b = h.binding(&name).await.unwrap();
    // An object with the binding's label that the binding does not name: never touched.
    let unnamed: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "not-named", "namespace": NS,
                     "labels": {annotations::BINDING_LABEL: name},
                     "annotations": {annotations::BINDING_UID_ANNOTATION: b.metadata.uid.clone().unwrap()}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .create(&Default::default(), &unnamed)
        .await
        .unwrap();
    // A named object that someone else replaced (foreign): left alone.
    let lease_api: Api<Lease> = Api::namespaced(h.client.clone(), CTL);
    let wname = names::writer_name(&name);
    lease_api.delete(&wname, &Default::default()).await.unwrap();
    let foreign: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": wname, "namespace": CTL}, "spec": {"holderIdentity": "someone"}
    }))
    .unwrap();
    lease_api
        .create(&Default::default(), &foreign)
        .await
        .unwrap();

    // The request goes away: the reference is pruned and the idle period starts.
    h.delete_request(NS, "a").await;
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
            object: format!("Lease {CTL}/{wname}"),
            reason: "ForeignObject".into()
        }]
    );
    assert_eq!(released_condition(&kept).1, "ObjectsKept");
    assert!(!kept
        .metadata
        .finalizers
        .clone()
        .unwrap_or_default()
        .contains(&annotations::BINDING_FINALIZER.to_string()));
    assert!(h.names::<Job>(None).await.is_empty());
    assert_eq!(
        h.names::<PersistentVolumeClaim>(Some(NS)).await,
        vec!["not-named".to_string()]
    );
    // The reader PV is gone; the writer's dynamically provisioned PV is not named and stays
    // (Retain: the storage administrator reclaims it).
    assert_eq!(
        h.names::<PersistentVolume>(None).await,
        vec![format!("pvc-{name}")]
    );
    let lease = lease_api.get(&wname).await.unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("someone")
    );
    // The order of the log: the phase moved to Retiring before the first delete (status
    // writes after the request went: the idle start, the retirement, the release record).
    let log = h.calls.log();
    let gone = log.iter().position(|l| l == "delete a").unwrap();
    let status_line = format!("status ModelCacheBinding {name}");
    let retire = gone
        + 1
        + log[gone + 1..]
            .iter()
            .enumerate()
            .filter(|(_, l)| **l == status_line)
            .nth(1)
            .unwrap()
            .0;
    let first_delete = gone
        + 1
        + log[gone + 1..]
            .iter()
            .position(|l| l.starts_with("delete "))
            .unwrap();
    assert!(retire < first_delete, "{log:#?}");
}

#[tokio::test]
async fn a_returning_reference_ends_the_idle_period() {
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let name = h.bindings().await.remove(0).metadata.name.unwrap();
    h.delete_request(NS, "a").await;
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
    h.create_request(&regular("b", NS, "r1")).await;
    h.ok(NS, "b").await;
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
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
    h.ok(NS, "a").await;
    let name = h.bindings().await.remove(0).metadata.name.unwrap();
    h.delete_request(NS, "a").await;
    h.create_request(&regular("a", NS, "r1")).await;
    // The old UID's reference is stale even though ns/name exist.
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.unwrap().references().is_empty());
    // The new request joins with its own UID.
    h.ok(NS, "a").await;
    let refs = h.binding(&name).await.unwrap().references().to_vec();
    assert_eq!(refs.len(), 1);
    assert_ne!(refs[0].uid, format!("uid-{NS}-a"));
}

/// Every object of the settled world, for seeding another harness (the in-memory API cannot set
/// a deletionTimestamp: the binding is re-seeded with one).
async fn world_of(h: &Harness, deleted_binding: &str) -> Setup {
    let mut setup = Setup::nvmesh();
    let mut b = h.binding(deleted_binding).await.unwrap();
    b.metadata.deletion_timestamp = Some(ic_shared::crd::now());
    b.metadata.resource_version = None;
    setup = setup.with(&b);
    for c in Api::<PersistentVolumeClaim>::all(h.client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        setup = setup.with(&c);
    }
    for pv in Api::<PersistentVolume>::all(h.client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        setup = setup.with(&pv);
    }
    for j in Api::<Job>::all(h.client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        setup = setup.with(&j);
    }
    for l in Api::<Lease>::all(h.client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        setup = setup.with(&l);
    }
    setup.with(&h.request(NS, "a").await)
}

/// Issue 17 item 2: deleting a binding that a live request references releases nothing; it is
/// marked Retiring (never joined again), and released only once it has had zero references
/// for the idle period.
#[tokio::test]
async fn a_binding_deleted_while_referenced_releases_nothing_until_idle() {
    let (h, name) = settled().await;
    let h2 = world_of(&h, &name).await.build().await;
    let before = h2.side_effects().await;
    assert_eq!(before, h.side_effects().await);
    h2.reconcile_binding(&name).await.unwrap();
    let b = h2.binding(&name).await.unwrap();
    assert_eq!(b.phase(), BindingPhase::Retiring, "never joined again");
    assert_eq!(b.references().len(), 1, "the live reference is kept");
    assert_eq!(h2.side_effects().await, before, "nothing released");
    assert!(!h2.calls.log().iter().any(|l| l.starts_with("delete ")));
    // Hours later, still referenced: still nothing released.
    h2.clock.advance(Duration::from_secs(10 * 3600));
    h2.reconcile_binding(&name).await.unwrap();
    assert_eq!(h2.side_effects().await, before);
    // The request sees the binding retiring and is never rebound.
    h2.ok(NS, "a").await;
    assert_eq!(
        h2.cond(NS, "a", "Ready").await,
        is("False", "BindingRetiring")
    );
    assert_eq!(h2.bindings().await.len(), 1);
    // The request goes: the idle period starts; only past it is everything released.
    h2.delete_request(NS, "a").await;
    h2.reconcile_binding(&name).await.unwrap();
    assert_eq!(h2.side_effects().await, before);
    h2.clock.advance(Duration::from_secs(3599));
    h2.reconcile_binding(&name).await.unwrap();
    assert_eq!(h2.side_effects().await, before);
    h2.clock.advance(Duration::from_secs(1));
    h2.reconcile_binding(&name).await.unwrap();
    assert!(h2.binding(&name).await.is_none());
    assert!(h2.names::<Job>(None).await.is_empty());
    // Released=True was recorded before the finalizer went.
    let last = h2.calls.statuses_of(&name).pop().unwrap();
    let released = last["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Released")
        .unwrap();
    assert_eq!(released["status"], "True");
    assert_eq!(released["reason"], "Released");
}

/// Retires the settled binding `name` (request gone, idle period over) and runs one pass.
async fn retire(h: &Harness, name: &str) {
    h.delete_request(NS, "a").await;
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
    let armed = Arc::new(AtomicBool::new(false));
    let arm = armed.clone();
    let mc = regular("a", NS, "r1");
    let claim = names::reader_claim(&names::binding_name(&names::identity_for(&mc), 1));
    let claim_in = claim.clone();
    let setup = Setup::nvmesh().intercept(move |c| {
        recording(c).get(move |ctx| {
            if ctx.name != claim_in || !arm.swap(false, Ordering::SeqCst) {
                return Ok(None);
            }
            // The release reads the owned claim; right after, someone replaces it with their
            // own claim under the same name.
            let owned: PersistentVolumeClaim = ctx.client.get(ctx.namespace, ctx.name)?;
            ctx.client
                .delete::<PersistentVolumeClaim>(ctx.namespace, ctx.name)?;
            let mut theirs = owned.clone();
            theirs.metadata = kube::api::ObjectMeta {
                name: owned.metadata.name.clone(),
                namespace: owned.metadata.namespace.clone(),
                labels: Some([("app".to_string(), "theirs".to_string())].into()),
                ..Default::default()
            };
            theirs.spec.as_mut().unwrap().volume_name = None;
            ctx.client
                .create(ctx.namespace, &theirs, &Default::default())?;
            Ok(Some(serde_json::to_value(&owned)?))
        })
    });
    let (h, name) = settled_in(setup).await;
    h.delete_request(NS, "a").await;
    h.reconcile_binding(&name).await.unwrap();
    h.clock.advance(Duration::from_secs(3600));
    armed.store(true, Ordering::SeqCst);
    h.reconcile_binding(&name).await.unwrap();
    let theirs = Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .get(&claim)
        .await
        .expect("the replacing claim is never deleted");
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
            object: format!("PersistentVolumeClaim {NS}/{claim}"),
            reason: "ChangedSinceRead".into()
        }]
    );
    // Everything else it owned is gone.
    assert!(h.names::<Job>(None).await.is_empty());
    // Next pass: the object is read as foreign now; still never deleted; only foreign objects
    // are left, so the finalizer goes while the binding keeps the record.
    h.reconcile_binding(&name).await.unwrap();
    let b = h.binding(&name).await.unwrap();
    assert_eq!(
        b.status.as_ref().unwrap().release_skipped[0].reason,
        "ForeignObject"
    );
    assert!(!b
        .metadata
        .finalizers
        .unwrap_or_default()
        .contains(&annotations::BINDING_FINALIZER.to_string()));
    assert!(
        Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
            .get_opt(&claim)
            .await
            .unwrap()
            .is_some()
    );
    // Once the operator removes it, the next pass finishes.
    Api::<PersistentVolumeClaim>::namespaced(h.client.clone(), NS)
        .delete(&claim, &Default::default())
        .await
        .unwrap();
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.is_none());
}

/// Issue 17 item 9: the writer claim is deleted only while its PV still has reclaim policy
/// `Retain`, re-read at release ("configuration drift never authorizes data deletion").
#[tokio::test]
async fn release_keeps_a_claim_whose_volume_no_longer_retains() {
    let (h, name) = settled().await;
    let pvs: Api<PersistentVolume> = Api::all(h.client.clone());
    let writer_pv = format!("pvc-{name}");
    let set_policy = |p: &'static str| {
        let pvs = pvs.clone();
        let writer_pv = writer_pv.clone();
        async move {
            pvs.patch(
                &writer_pv,
                &Default::default(),
                &kube::api::Patch::Merge(json!({"spec": {"persistentVolumeReclaimPolicy": p}})),
            )
            .await
            .unwrap();
        }
    };
    set_policy("Delete").await;
    retire(&h, &name).await;
    let wname = names::writer_name(&name);
    let claims = h.names::<PersistentVolumeClaim>(Some(NS)).await;
    assert_eq!(claims, vec![wname.clone()], "only the writer claim is kept");
    let b = h.binding(&name).await.expect("the binding stays");
    assert_eq!(
        b.status.as_ref().unwrap().release_skipped,
        vec![ReleaseSkip {
            object: format!("PersistentVolumeClaim {NS}/{wname}"),
            reason: "VolumeNotRetained".into()
        }]
    );
    assert_eq!(released_condition(&b).1, "ObjectsKept");
    assert!(
        b.metadata
            .finalizers
            .unwrap()
            .contains(&annotations::BINDING_FINALIZER.to_string()),
        "an owned object is still protected"
    );
    // Retain again: the next pass releases it and the binding goes.
    set_policy("Retain").await;
    h.reconcile_binding(&name).await.unwrap();
    assert!(h.binding(&name).await.is_none());
    assert!(h.names::<PersistentVolumeClaim>(Some(NS)).await.is_empty());
}

fn binding_with_finalizer(name: &str) -> ModelCacheBinding {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCacheBinding",
        "metadata": {"name": name, "namespace": CTL, "finalizers": [annotations::BINDING_FINALIZER, "example.com/other"]},
        "spec": {"identity": {"workflow": "regularModelCache", "sharingDomainDigest": "a", "cacheHandleDigest": "b"},
                 "decision": {"provisioner": NVMESH, "flow": "roxReadOnly", "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "catalogProfileDigest": "c"},
                 "storageClass": {"name": SC, "uid": "u", "reclaimPolicy": "Retain", "configurationDigest": "d"},
                 "resources": {"jobs": [{"namespace": NS, "name": "j"}]}}
    }))
    .unwrap()
}

#[tokio::test]
async fn uninstall_strips_only_our_finalizer_and_deletes_nothing() {
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": NS},
        "spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x"}], "restartPolicy": "Never"}}}
    }))
    .unwrap();
    let h = Setup::default()
        .with(&binding_with_finalizer("b1"))
        .with(&binding_with_finalizer("b2"))
        .with(&job)
        .build()
        .await;
    assert_eq!(strip_binding_finalizers(&h.client, CTL).await.unwrap(), 2);
    for b in h.bindings().await {
        assert_eq!(
            b.metadata.finalizers,
            Some(vec!["example.com/other".to_string()])
        );
    }
    assert_eq!(h.names::<Job>(None).await, vec!["j".to_string()]);
    // Idempotent.
    assert_eq!(strip_binding_finalizers(&h.client, CTL).await.unwrap(), 0);
}

#[tokio::test]
async fn uninstall_stops_when_a_finalizer_cannot_be_stripped() {
    let attempts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = attempts.clone();
    let h = Setup::default()
        .with(&binding_with_finalizer("b1"))
        .with(&binding_with_finalizer("b2"))
        .intercept(move |c| {
            recording(c).patch(move |_| {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Err(server_error())
            })
        })
        .build()
        .await;
    match strip_binding_finalizers(&h.client, CTL).await {
        Err(Error::StripFinalizer { name, .. }) => assert!(name == "b1" || name == "b2"),
        other => panic!("expected StripFinalizer, got {other:?}"),
    }
    // It stopped at the first failure: one attempt, both bindings keep their finalizer.
    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 1);
    let all = Api::<ModelCacheBinding>::namespaced(h.client.clone(), CTL)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    for b in all {
        assert!(b
            .metadata
            .finalizers
            .unwrap()
            .contains(&annotations::BINDING_FINALIZER.to_string()));
    }
    // The list failing stops it too.
    let h = Setup::default()
        .with(&binding_with_finalizer("b1"))
        .intercept(|c| recording(c).list(|_| Err(server_error())))
        .build()
        .await;
    assert!(matches!(
        strip_binding_finalizers(&h.client, CTL).await,
        Err(Error::Kube(_))
    ));
}

// ------------------------------------------------------------------ issue 17 item 8: uninstall

async fn marker_exists_in(h: &Harness) -> bool {
    Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(h.client.clone(), CTL)
        .get_opt(UNINSTALL_MARKER)
        .await
        .unwrap()
        .is_some()
}

#[tokio::test]
async fn uninstall_stops_new_bindings_before_it_strips() {
    let h = Setup::nvmesh()
        .with(&binding_with_finalizer("b1"))
        .with(&regular("a", NS, "r1"))
        .build()
        .await;
    assert_eq!(strip_binding_finalizers(&h.client, CTL).await.unwrap(), 1);
    assert!(marker_exists_in(&h).await);
    let log = h.calls.log();
    let marker = log
        .iter()
        .position(|l| l == &format!("create ConfigMap {UNINSTALL_MARKER}"))
        .unwrap();
    assert_eq!(marker, 0, "the marker comes before anything else: {log:#?}");
    // A request reconciled now creates no binding: nothing can add a finalizer after the strip.
    h.ok(NS, "a").await;
    assert_eq!(h.cond(NS, "a", "Ready").await, is("False", "Uninstalling"));
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
    let h = Setup::nvmesh()
        .with(&regular("a", NS, "r1"))
        .intercept(|c| {
            recording(c).create(|ctx| {
                if ctx.object["kind"] == "ModelCacheBinding" {
                    let marker: k8s_openapi::api::core::v1::ConfigMap =
                        serde_json::from_value(json!({
                            "apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": UNINSTALL_MARKER, "namespace": CTL}
                        }))
                        .unwrap();
                    ctx.client.create(CTL, &marker, &Default::default())?;
                }
                Ok(None)
            })
        })
        .build()
        .await;
    h.ok(NS, "a").await;
    let all = h.bindings().await;
    assert_eq!(all.len(), 1);
    assert!(!all[0]
        .metadata
        .finalizers
        .clone()
        .unwrap_or_default()
        .contains(&annotations::BINDING_FINALIZER.to_string()));
    assert_eq!(h.cond(NS, "a", "Ready").await, is("False", "Uninstalling"));
    assert_eq!(h.side_effects().await, 0);
}

#[tokio::test]
async fn uninstall_strips_bindings_that_appear_while_it_strips() {
    let created = Arc::new(AtomicBool::new(false));
    let once = created.clone();
    let h = Setup::default()
        .with(&binding_with_finalizer("b1"))
        .intercept(move |c| {
            recording(c).patch(move |ctx| {
                if !once.swap(true, Ordering::SeqCst) {
                    // An older controller creates another binding mid-strip.
                    ctx.client
                        .create(CTL, &binding_with_finalizer("b2"), &Default::default())?;
                }
                Ok(None)
            })
        })
        .build()
        .await;
    assert_eq!(strip_binding_finalizers(&h.client, CTL).await.unwrap(), 2);
    for b in h.bindings().await {
        assert_eq!(
            b.metadata.finalizers,
            Some(vec!["example.com/other".to_string()])
        );
    }
}

#[tokio::test]
async fn uninstall_with_no_crd_has_nothing_to_strip() {
    let h = Setup::default()
        .intercept(|c| {
            recording(c).list(|ctx| {
                if ctx.namespace == Some(CTL) {
                    Err(kube_fake_client::Error::NotFound {
                        kind: "modelcachebindings".into(),
                        name: String::new(),
                        namespace: CTL.into(),
                    })
                } else {
                    Ok(None)
                }
            })
        })
        .build()
        .await;
    assert_eq!(strip_binding_finalizers(&h.client, CTL).await.unwrap(), 0);
}

/// The finalizer patch carries the read resourceVersion: a finalizer another controller added
/// in between is not overwritten (a plain merge patch replaces the whole list).
#[tokio::test]
async fn uninstall_keeps_a_finalizer_added_concurrently() {
    let raced = Arc::new(AtomicBool::new(false));
    let once = raced.clone();
    let h = Setup::default()
        .with(&binding_with_finalizer("b1"))
        .intercept(move |c| {
            recording(c).patch(move |ctx| {
                if !once.swap(true, Ordering::SeqCst) {
                    let mut b: ModelCacheBinding = ctx.client.get(CTL, ctx.name)?;
                    b.metadata
                        .finalizers
                        .get_or_insert_with(Vec::new)
                        .push("example.com/late".into());
                    ctx.client.update(CTL, &b, &Default::default())?;
                }
                Ok(None)
            })
        })
        .build()
        .await;
    assert_eq!(strip_binding_finalizers(&h.client, CTL).await.unwrap(), 1);
    let b = h.binding("b1").await.unwrap();
    assert_eq!(
        b.metadata.finalizers,
        Some(vec![
            "example.com/other".to_string(),
            "example.com/late".to_string()
        ])
    );
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
