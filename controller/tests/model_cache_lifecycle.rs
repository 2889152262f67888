//! The binding lifecycle (spec 004 "Cache binding"): references pruned when their request is
//! gone, zero references past the idle period → `Retiring` → exactly the named, owned objects
//! deleted → finalizer dropped; nothing unnamed or foreign touched; uninstall strips finalizers
//! and stops when it cannot.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod model_cache_support;

use std::time::Duration;

use ic_controller::reconcile::model_cache::{names, strip_binding_finalizers, Error};
use ic_shared::crd::{annotations, BindingPhase, ModelCacheBinding};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ListParams};
use model_cache_support::*;
use serde_json::json;

/// A request `a` bound, written and read, plus an unnamed object carrying the binding's label.
async fn settled() -> (Harness, String) {
    let h = Setup::nvmesh().with(&regular("a", NS, "r1")).build().await;
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

    // Past it: Retiring, then release.
    h.clock.advance(Duration::from_secs(1));
    h.reconcile_binding(&name).await.unwrap();
    assert!(
        h.binding(&name).await.is_none(),
        "finalizer dropped and binding deleted"
    );
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
    // The order of the log: the phase moved to Retiring before the first delete.
    let log = h.calls.log();
    let retire = log
        .iter()
        .rposition(|l| l == &format!("status ModelCacheBinding {name}"))
        .unwrap();
    let gone = log.iter().position(|l| l == "delete a").unwrap();
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

#[tokio::test]
async fn a_binding_being_deleted_releases_what_it_owns_then_goes() {
    let (h, name) = settled().await;
    let mut b = h.binding(&name).await.unwrap();
    // Seed a copy with a deletionTimestamp (the in-memory API cannot set one on delete).
    b.metadata.deletion_timestamp = Some(ic_shared::crd::now());
    b.metadata.resource_version = None;
    let claims = h.names::<PersistentVolumeClaim>(None).await;
    let h2 = Setup::default()
        .with(&b)
        .with(
            &Api::<Job>::namespaced(h.client.clone(), NS)
                .get(&names::writer_name(&name))
                .await
                .unwrap(),
        )
        .build()
        .await;
    assert_eq!(claims.len(), 2);
    h2.reconcile_binding(&name).await.unwrap();
    assert!(h2.binding(&name).await.is_none());
    assert!(h2.names::<Job>(None).await.is_empty());
    let log = h2.calls.log();
    assert!(
        log.iter()
            .any(|l| l == &format!("status ModelCacheBinding {name}")),
        "phase Retiring recorded: {log:#?}"
    );
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
