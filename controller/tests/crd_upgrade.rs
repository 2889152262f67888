//! `ic-controller upgrade-crds` (the chart's pre-upgrade hook) against the in-memory API:
//! a fresh cluster gets every CRD, an old schema applied by another manager (Helm's install) is
//! replaced by this release's, and a stored version the release no longer serves stops the
//! upgrade before anything is written.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::crdgen::all_crds;
use ic_controller::crdupgrade::{upgrade, CrdAction, CrdUpgradeError};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionStatus,
};
use kube::api::{Api, Patch, PatchParams};
use kube_fake_client::ClientBuilder;
use serde_json::Value;

async fn cluster(objects: Vec<CustomResourceDefinition>) -> kube::Client {
    let mut b = ClientBuilder::new().with_resource::<CustomResourceDefinition>();
    for o in objects {
        b = b.with_object(o);
    }
    b.build().await.unwrap()
}

fn name(crd: &CustomResourceDefinition) -> String {
    crd.metadata.name.clone().unwrap()
}

/// The first version's `spec.properties` of a CRD's schema, as JSON.
fn spec_properties(crd: &CustomResourceDefinition) -> Value {
    let v = serde_json::to_value(crd).unwrap();
    v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        .clone()
}

/// The CacheBackend CRD of an "older release": one spec property missing.
fn older_cachebackend() -> (CustomResourceDefinition, String) {
    let crd = all_crds()
        .into_iter()
        .find(|c| c.spec.names.kind == "CacheBackend")
        .unwrap();
    let mut v = serde_json::to_value(&crd).unwrap();
    let props = v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]
        .as_object_mut()
        .unwrap();
    let dropped = props.keys().next_back().unwrap().clone();
    props.remove(&dropped);
    (serde_json::from_value(v).unwrap(), dropped)
}

#[tokio::test]
async fn a_fresh_cluster_gets_every_crd() {
    let client = cluster(vec![]).await;
    let done = upgrade(&client, &all_crds()).await.unwrap();
    assert_eq!(done.len(), all_crds().len());
    assert!(
        done.iter().all(|(_, a)| *a == CrdAction::Create),
        "{done:?}"
    );
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for want in all_crds() {
        let got = api.get(&name(&want)).await.unwrap();
        assert_eq!(
            spec_properties(&got),
            spec_properties(&want),
            "{}",
            name(&want)
        );
        assert_eq!(got.spec.versions.len(), want.spec.versions.len());
    }
    // Re-running is idempotent (a retried hook).
    let again = upgrade(&client_of(&api), &all_crds()).await.unwrap();
    assert!(again.iter().all(|(_, a)| *a == CrdAction::Update));
}

fn client_of(api: &Api<CustomResourceDefinition>) -> kube::Client {
    api.clone().into_client()
}

#[tokio::test]
async fn an_old_schema_applied_by_helm_is_replaced_and_missing_crds_are_created() {
    let client = cluster(vec![]).await;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let (old, dropped) = older_cachebackend();
    // Helm's install (or `kubectl apply --server-side`) owns the old fields.
    api.patch(
        &name(&old),
        &PatchParams::apply("helm"),
        &Patch::Apply(&old),
    )
    .await
    .unwrap();
    assert!(spec_properties(&api.get(&name(&old)).await.unwrap())
        .get(&dropped)
        .is_none());

    let done = upgrade(&client, &all_crds()).await.unwrap();
    for (n, action) in &done {
        let want = if *n == name(&old) {
            CrdAction::Update
        } else {
            CrdAction::Create
        };
        assert_eq!(*action, want, "{n}");
    }
    let got = api.get(&name(&old)).await.unwrap();
    assert!(
        spec_properties(&got).get(&dropped).is_some(),
        "spec.{dropped} is still missing after the upgrade"
    );
}

#[tokio::test]
async fn a_stored_version_no_longer_served_stops_the_upgrade_before_any_write() {
    let (mut old, dropped) = older_cachebackend();
    let served = old.spec.versions[0].name.clone();
    old.status = Some(CustomResourceDefinitionStatus {
        stored_versions: Some(vec!["v1alpha0".into(), served]),
        ..Default::default()
    });
    // Seeded with its status, as the API server would have recorded it.
    let client = cluster(vec![old.clone()]).await;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let before = api.list(&Default::default()).await.unwrap().items.len();
    assert_eq!(before, 1);
    let seeded = api.get(&name(&old)).await.unwrap();
    assert_eq!(
        seeded
            .status
            .and_then(|s| s.stored_versions)
            .unwrap_or_default()[0],
        "v1alpha0",
        "the in-memory API did not keep the seeded status"
    );

    let err = upgrade(&client, &all_crds()).await.unwrap_err();
    assert!(
        matches!(&err, CrdUpgradeError::StoredVersionNotServed { version, .. } if version == "v1alpha0"),
        "{err}"
    );
    assert!(err.to_string().contains(&name(&old)), "{err}");
    // Nothing was written: no new CRD, the old schema unchanged.
    assert_eq!(
        api.list(&Default::default()).await.unwrap().items.len(),
        before
    );
    assert!(spec_properties(&api.get(&name(&old)).await.unwrap())
        .get(&dropped)
        .is_none());
}
