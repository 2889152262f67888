//! `ic-controller upgrade-crds` (the chart's pre-upgrade hook) against the bare real apiserver
//! (tests/bare_apiserver_support/): a fresh cluster gets every CRD, an old schema applied by
//! another manager (Helm's install) is replaced by this release's (objects written under the old
//! schema lose the missing field, and read back with the new schema's default after the
//! upgrade), and a stored version the release no longer serves stops the upgrade before
//! anything is written.
//!
//! The CRDs are this release's ([`all_crds`], the objects `chart/crds/` holds), each copied under
//! a test group of its own (`<plural>.t-<pid>-<n>.inferencecache.test`): CRDs are cluster-scoped
//! and the installed `inferencecache.io` ones are shared with every other test on the cluster.
//! Each test deletes its copies at the end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;

use std::future::Future;
use std::time::{Duration, Instant};

use bare_apiserver_support::{unique, BareCluster};
use ic_controller::crdgen::all_crds;
use ic_controller::crdupgrade::{upgrade, CrdAction, CrdUpgradeError};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use serde_json::{json, Value};

/// The field the "older release" of CacheBackend lacks: `spec.type`, which this release's
/// schema defaults (`LMCache`), so an object stored without it reads back defaulted.
const DROPPED: &str = "type";

fn name(crd: &CustomResourceDefinition) -> String {
    crd.metadata.name.clone().unwrap()
}

/// A test group of its own: `t-<pid>-<n>.inferencecache.test`.
fn test_group() -> String {
    format!("{}.inferencecache.test", unique("t"))
}

/// `crds` moved to `group` (and renamed `<plural>.<group>`, as the apiserver requires).
fn in_group(crds: Vec<CustomResourceDefinition>, group: &str) -> Vec<CustomResourceDefinition> {
    crds.into_iter()
        .map(|mut c| {
            c.spec.group = group.to_string();
            c.metadata.name = Some(format!("{}.{group}", c.spec.names.plural));
            c
        })
        .collect()
}

/// This release's CRDs under `group`.
fn release(group: &str) -> Vec<CustomResourceDefinition> {
    in_group(all_crds(), group)
}

/// This release's CRD of `kind` under `group`.
fn release_crd(group: &str, kind: &str) -> CustomResourceDefinition {
    release(group)
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap()
}

/// The first version's `spec.properties` of a CRD's schema, as JSON.
fn spec_properties(crd: &CustomResourceDefinition) -> Value {
    let v = serde_json::to_value(crd).unwrap();
    v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        .clone()
}

/// The CacheBackend CRD of an "older release" under `group`: `spec.type` missing.
fn older_cachebackend(group: &str) -> CustomResourceDefinition {
    let mut v = serde_json::to_value(release_crd(group, "CacheBackend")).unwrap();
    let props = v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]
        .as_object_mut()
        .unwrap();
    assert!(props.remove(DROPPED).is_some(), "spec.{DROPPED} is gone");
    serde_json::from_value(v).unwrap()
}

/// The CRDs of `group` in the cluster.
async fn crds_of(
    api: &Api<CustomResourceDefinition>,
    group: &str,
) -> Vec<CustomResourceDefinition> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|c| c.spec.group == group)
        .collect()
}

/// Deletes the CRDs of `group` (the apiserver removes their objects itself).
async fn delete_group(api: &Api<CustomResourceDefinition>, group: &str) {
    for c in crds_of(api, group).await {
        let _ = api.delete(&name(&c), &DeleteParams::default()).await;
    }
}

/// Polls `f` every 200 ms until it returns `Some`, for at most 60 s.
async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the CRD `crd_name` is `Established` (its objects are served).
async fn established(api: &Api<CustomResourceDefinition>, crd_name: &str) {
    wait_for(&format!("{crd_name} Established"), || async {
        let c = api.get(crd_name).await.ok()?;
        c.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
            .then_some(())
    })
    .await;
}

/// The CacheBackend objects of `group`'s CRD, version `version`, in `ns`.
fn backends(client: &kube::Client, group: &str, version: &str, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: group.to_string(),
        version: version.to_string(),
        api_version: format!("{group}/{version}"),
        kind: "CacheBackend".into(),
        plural: "cachebackends".into(),
    };
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn backend(group: &str, version: &str, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": format!("{group}/{version}"), "kind": "CacheBackend",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap()
}

#[tokio::test]
async fn a_fresh_cluster_gets_every_crd() {
    let bare = BareCluster::get().await;
    let group = test_group();
    let desired = release(&group);
    let done = upgrade(&bare.admin, &desired).await.unwrap();
    assert_eq!(done.len(), all_crds().len());
    assert!(
        done.iter().all(|(_, a)| *a == CrdAction::Create),
        "{done:?}"
    );
    let api: Api<CustomResourceDefinition> = Api::all(bare.admin.clone());
    let mut generations = Vec::new();
    for want in &desired {
        let got = api.get(&name(want)).await.unwrap();
        assert_eq!(
            spec_properties(&got),
            spec_properties(want),
            "{}",
            name(want)
        );
        assert_eq!(got.spec.versions.len(), want.spec.versions.len());
        generations.push(got.metadata.generation);
    }
    // Re-running is idempotent (a retried hook): applied again, changed nothing.
    let again = upgrade(&bare.admin, &desired).await.unwrap();
    assert!(again.iter().all(|(_, a)| *a == CrdAction::Update));
    for (want, generation) in desired.iter().zip(generations) {
        let got = api.get(&name(want)).await.unwrap();
        assert_eq!(got.metadata.generation, generation, "{}", name(want));
    }
    delete_group(&api, &group).await;
}

#[tokio::test]
async fn an_old_schema_applied_by_helm_is_replaced_and_missing_crds_are_created() {
    let bare = BareCluster::get().await;
    let group = test_group();
    let ns = bare.namespace("crd-upgrade").await;
    let api: Api<CustomResourceDefinition> = Api::all(bare.admin.clone());
    let old = older_cachebackend(&group);
    // Helm's install (or `kubectl apply --server-side`) owns the old fields.
    api.patch(
        &name(&old),
        &PatchParams::apply("helm"),
        &Patch::Apply(&old),
    )
    .await
    .unwrap();
    assert!(spec_properties(&api.get(&name(&old)).await.unwrap())
        .get(DROPPED)
        .is_none());
    established(&api, &name(&old)).await;

    // Under the old schema the apiserver prunes the field this release added, on every write.
    let version = old.spec.versions[0].name.clone();
    let objects = backends(&bare.admin, &group, &version, &ns);
    let spec = json!({"runtime": "VLLM", "type": "SGLangHiCache",
                      "engineSelector": {"matchLabels": {"app": "x"}}});
    let created = objects
        .create(
            &PostParams::default(),
            &backend(&group, &version, "old", spec),
        )
        .await
        .unwrap();
    assert!(
        created.data["spec"].get(DROPPED).is_none(),
        "{}",
        created.data
    );

    let done = upgrade(&bare.admin, &release(&group)).await.unwrap();
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
        spec_properties(&got).get(DROPPED).is_some(),
        "spec.{DROPPED} is still missing after the upgrade"
    );
    assert_eq!(
        got.status.unwrap().stored_versions.unwrap(),
        vec![version.clone()]
    );

    // The object stored under the old schema reads back with the new schema's default (the
    // apiserver serves the new schema a moment after the CRD changes) …
    let read = wait_for(
        "the old object read with the new schema's default",
        || async {
            let o = objects.get("old").await.unwrap();
            o.data["spec"].get(DROPPED).is_some().then_some(o)
        },
    )
    .await;
    assert_eq!(read.data["spec"][DROPPED], "LMCache", "{}", read.data);
    // … and the field is kept on writes again.
    let patched = objects
        .patch(
            "old",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {DROPPED: "SGLangHiCache"}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data["spec"][DROPPED], "SGLangHiCache");
    assert_eq!(
        objects.get("old").await.unwrap().data["spec"][DROPPED],
        "SGLangHiCache"
    );
    delete_group(&api, &group).await;
}

#[tokio::test]
async fn a_stored_version_no_longer_served_stops_the_upgrade_before_any_write() {
    let bare = BareCluster::get().await;
    let group = test_group();
    let ns = bare.namespace("crd-upgrade").await;
    let api: Api<CustomResourceDefinition> = Api::all(bare.admin.clone());
    // An older release served CachePolicy as v1alpha0 only, and objects were stored so. It is
    // not the first CRD of the release: applying in order would have written the ones before it.
    let kind = "CachePolicy";
    let desired = release(&group);
    let position = desired
        .iter()
        .position(|c| c.spec.names.kind == kind)
        .unwrap();
    assert!(position > 0);
    let mut old = release_crd(&group, kind);
    let served = old.spec.versions[0].name.clone();
    old.spec.versions[0].name = "v1alpha0".into();
    api.create(&PostParams::default(), &old).await.unwrap();
    established(&api, &name(&old)).await;
    let ar = ApiResource {
        group: group.clone(),
        version: "v1alpha0".into(),
        api_version: format!("{group}/v1alpha0"),
        kind: kind.into(),
        plural: old.spec.names.plural.clone(),
    };
    let policy: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{group}/v1alpha0"), "kind": kind,
        "metadata": {"name": "stored-as-v1alpha0"}, "spec": {}
    }))
    .unwrap();
    Api::<DynamicObject>::namespaced_with(bare.admin.clone(), &ns, &ar)
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    let seeded = api.get(&name(&old)).await.unwrap();
    assert_eq!(
        seeded.status.and_then(|s| s.stored_versions).unwrap(),
        vec!["v1alpha0".to_string()],
        "the apiserver records the storage version"
    );

    let err = upgrade(&bare.admin, &desired).await.unwrap_err();
    assert!(
        matches!(&err, CrdUpgradeError::StoredVersionNotServed { version, .. } if version == "v1alpha0"),
        "{err}"
    );
    assert!(err.to_string().contains(&name(&old)), "{err}");
    // Nothing was written: no other CRD of the release, the old one unchanged.
    let now = crds_of(&api, &group).await;
    assert_eq!(
        now.iter().map(name).collect::<Vec<_>>(),
        vec![name(&old)],
        "CRDs before {kind} were applied"
    );
    let unchanged = api.get(&name(&old)).await.unwrap();
    assert_eq!(unchanged.spec.versions.len(), 1);
    assert_eq!(unchanged.spec.versions[0].name, "v1alpha0");
    assert_eq!(unchanged.metadata.generation, seeded.metadata.generation);

    // What the hook spares the release: the apiserver itself refuses a CRD that stops serving
    // a stored version, but only once the CRDs before it were already applied.
    let new = desired.iter().find(|c| c.spec.names.kind == kind).unwrap();
    assert_eq!(new.spec.versions[0].name, served);
    let refused = api
        .patch(
            &name(new),
            &PatchParams::apply("helm").force(),
            &Patch::Apply(new),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, kube::Error::Api(s) if s.code == 422 && s.message.contains("storedVersions")),
        "{refused:?}"
    );
    delete_group(&api, &group).await;
}
