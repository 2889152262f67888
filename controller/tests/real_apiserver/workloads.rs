//! The CacheBackend reconciler's children on a real apiserver: server-side apply that removes
//! what the controller stopped applying, the replica count handed to an HPA without a dip, and
//! garbage collection of the children when the CacheBackend goes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use ic_controller::reconcile::cachebackend::{FIELD_MANAGER, HPA_HANDOVER_MANAGER};
use ic_controller::reconcile::render::{label_value, LABEL_BACKEND};
use ic_shared::crd::CacheBackend;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use serde_json::{json, Value};

use crate::support::{backend_deployment, managed_redis, node_selector, wait_for, Cluster};

const WAIT: Duration = Duration::from_secs(60);

async fn create(client: &Client, ns: &str, cb: &CacheBackend) {
    Api::<CacheBackend>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), cb)
        .await
        .unwrap();
}

/// Every `spec.replicas` the Deployments of `ns` pass through, collected from a real watch
/// (started, and given half a second to open, before this returns); abort the handle to stop.
async fn replica_counts(
    client: &Client,
    ns: &str,
) -> (Arc<Mutex<Vec<i32>>>, tokio::task::JoinHandle<()>) {
    let seen: Arc<Mutex<Vec<i32>>> = Arc::default();
    let seen_w = seen.clone();
    let api = Api::<Deployment>::namespaced(client.clone(), ns);
    let watch = tokio::spawn(async move {
        let mut s = watcher(api, watcher::Config::default())
            .applied_objects()
            .boxed();
        while let Some(Ok(d)) = s.next().await {
            if let Some(r) = d.spec.and_then(|s| s.replicas) {
                seen_w.lock().unwrap().push(r);
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    (seen, watch)
}

/// Defect 1 of the real-control-plane issue: removing a `spec.template` override must reach the
/// Deployment. Before the applied-digest annotation, `ensure()` saw the desired object as a
/// subset of the live one and sent nothing: the pods stayed pinned.
#[tokio::test]
async fn removing_a_template_override_reaches_the_deployment() {
    let c = Cluster::get().await;
    let ns = c.namespace("override").await;
    let cb = managed_redis(
        "pinned",
        json!({"template": {
            "nodeSelector": {"disktype": "ssd"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "cache", "effect": "NoSchedule"}]
        }}),
    );
    create(&c.admin, &ns, &cb).await;
    wait_for("the Deployment with the override", WAIT, || async {
        let d = backend_deployment(&c.admin, &ns, "pinned").await?;
        (node_selector(&d) == Some(json!({"disktype": "ssd"}))).then_some(())
    })
    .await;

    Api::<CacheBackend>::namespaced(c.admin.clone(), &ns)
        .patch(
            "pinned",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": null}})),
        )
        .await
        .unwrap();
    let d = wait_for("the override removed from the Deployment", WAIT, || async {
        let d = backend_deployment(&c.admin, &ns, "pinned").await?;
        node_selector(&d).is_none().then_some(d)
    })
    .await;
    let pod = d.spec.unwrap().template.spec.unwrap();
    assert!(
        pod.tolerations.unwrap_or_default().is_empty(),
        "tolerations removed with the override"
    );
    c.drop_namespace(&ns).await;
}

/// Defect 2 of the real-control-plane issue: turning autoscaling on for a 3-replica cache server
/// must not pass through 1 replica. Server-side apply drops a field its manager stops applying;
/// the handover manager keeps the count until the HPA owns it.
#[tokio::test]
async fn enabling_autoscaling_keeps_the_replica_count() {
    let c = Cluster::get().await;
    let ns = c.namespace("autoscale").await;
    create(
        &c.admin,
        &ns,
        &managed_redis("scaled", json!({"replicas": 3})),
    )
    .await;
    wait_for("3 replicas", WAIT, || async {
        let d = backend_deployment(&c.admin, &ns, "scaled").await?;
        (d.spec?.replicas == Some(3)).then_some(())
    })
    .await;

    // Every replica count the Deployment passes through, from a real watch.
    let (seen, watch) = replica_counts(&c.admin, &ns).await;

    Api::<CacheBackend>::namespaced(c.admin.clone(), &ns)
        .patch(
            "scaled",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"autoscaling": {"maxReplicas": 6}}})),
        )
        .await
        .unwrap();
    let hpas = Api::<HorizontalPodAutoscaler>::namespaced(c.admin.clone(), &ns);
    let hpa = wait_for("the HPA", WAIT, || async {
        hpas.list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .next()
    })
    .await;
    assert_eq!(hpa.spec.as_ref().unwrap().min_replicas, Some(3));
    // A few more reconciles (the HPA's own write triggers one) before judging.
    tokio::time::sleep(Duration::from_secs(5)).await;
    watch.abort();

    let d = backend_deployment(&c.admin, &ns, "scaled").await.unwrap();
    assert_eq!(d.spec.as_ref().unwrap().replicas, Some(3));
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().all(|&r| r == 3),
        "the replica count dipped: {seen:?}"
    );
    // The controller no longer owns spec.replicas; the handover manager (then the HPA) does.
    let owners: Vec<String> = d
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|m| {
            m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.pointer("/f:spec/f:replicas").is_some())
        })
        .filter_map(|m| m.manager)
        .collect();
    assert!(!owners.iter().any(|m| m == FIELD_MANAGER), "{owners:?}");
    assert!(
        owners
            .iter()
            .any(|m| m == HPA_HANDOVER_MANAGER || m == "kube-controller-manager"),
        "{owners:?}"
    );
    c.drop_namespace(&ns).await;
}

/// The children carry owner references the real garbage collector (kube-controller-manager)
/// follows: deleting the CacheBackend removes its Deployment and Service.
#[tokio::test]
async fn deleting_a_backend_collects_its_children() {
    let c = Cluster::get().await;
    let ns = c.namespace("gc").await;
    create(&c.admin, &ns, &managed_redis("owned", json!({}))).await;
    let lp = ListParams::default().labels(&format!("{LABEL_BACKEND}=owned"));
    let services = Api::<Service>::namespaced(c.admin.clone(), &ns);
    wait_for("the Deployment and Service", WAIT, || async {
        let d = backend_deployment(&c.admin, &ns, "owned").await;
        let s = services.list(&lp).await.ok()?.items;
        (d.is_some() && !s.is_empty()).then_some(())
    })
    .await;
    Api::<CacheBackend>::namespaced(c.admin.clone(), &ns)
        .delete("owned", &DeleteParams::foreground())
        .await
        .unwrap();
    wait_for("the children collected", WAIT, || async {
        let d = backend_deployment(&c.admin, &ns, "owned").await;
        let s = services.list(&lp).await.ok()?.items;
        (d.is_none() && s.is_empty()).then_some(())
    })
    .await;
    c.drop_namespace(&ns).await;
}

async fn count_children(client: &Client, ns: &str, backend: &str) -> (usize, usize, usize, usize) {
    let lp = ListParams::default().labels(&format!("{LABEL_BACKEND}={}", label_value(backend)));
    let n = |r: Result<usize, kube::Error>| r.unwrap_or(usize::MAX);
    (
        n(Api::<Deployment>::namespaced(client.clone(), ns)
            .list(&lp)
            .await
            .map(|l| l.items.len())),
        n(Api::<StatefulSet>::namespaced(client.clone(), ns)
            .list(&lp)
            .await
            .map(|l| l.items.len())),
        n(Api::<Service>::namespaced(client.clone(), ns)
            .list(&lp)
            .await
            .map(|l| l.items.len())),
        n(
            Api::<HorizontalPodAutoscaler>::namespaced(client.clone(), ns)
                .list(&lp)
                .await
                .map(|l| l.items.len()),
        ),
    )
}

/// A backend walked through its modes: the controller creates what each mode needs and deletes
/// what the previous one left (Deployment → StatefulSet, autoscaling on → off, managed remote
/// storage → host-only), every write as the chart's ServiceAccount under its admission policy.
#[tokio::test]
async fn mode_changes_shed_what_the_previous_mode_owned() {
    let c = Cluster::get().await;
    let ns = c.namespace("modes").await;
    let api = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);
    create(
        &c.admin,
        &ns,
        &managed_redis("walk", json!({"autoscaling": {"maxReplicas": 3}})),
    )
    .await;
    let expect = |want: (usize, usize, usize, usize), what: &'static str| {
        let (client, ns) = (c.admin.clone(), ns.clone());
        async move {
            wait_for(what, WAIT, || {
                let (client, ns) = (client.clone(), ns.clone());
                async move {
                    let got = count_children(&client, &ns, "walk").await;
                    (got == want).then_some(())
                }
            })
            .await
        }
    };
    expect((1, 0, 1, 1), "Deployment + Service + HPA").await;
    let merge = |v: Value| Patch::Merge(v);
    api.patch(
        "walk",
        &PatchParams::default(),
        &merge(json!({"spec": {"deploymentKind": "StatefulSet"}})),
    )
    .await
    .unwrap();
    expect((0, 1, 1, 1), "StatefulSet in place of the Deployment").await;
    api.patch(
        "walk",
        &PatchParams::default(),
        &merge(json!({"spec": {"autoscaling": null}})),
    )
    .await
    .unwrap();
    expect((0, 1, 1, 0), "the HPA removed").await;
    api.patch(
        "walk",
        &PatchParams::default(),
        &merge(json!({"spec": {"remoteStorage": null}})),
    )
    .await
    .unwrap();
    expect((0, 0, 0, 0), "nothing left for host-only").await;
    c.drop_namespace(&ns).await;
}

/// Server-side apply with another field manager on the same Deployment: a label another
/// manager adds stays (the controller never applied it), a field the controller owns that the
/// other manager changed is taken back on the next reconcile (forced apply), and the other
/// manager's field survives that apply.
#[tokio::test]
async fn another_managers_fields_stay_and_ours_are_restored() {
    let c = Cluster::get().await;
    let ns = c.namespace("managers").await;
    create(&c.admin, &ns, &managed_redis("shared", json!({}))).await;
    let d = wait_for("the Deployment", WAIT, || {
        backend_deployment(&c.admin, &ns, "shared")
    })
    .await;
    let name = d.metadata.name.clone().unwrap();
    let image = d
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .image
        .clone()
        .unwrap();
    let container = d
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .name
        .clone();
    // Another manager: its own label, and (forced) the controller's container image.
    let other = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": {"team.example/owner": "platform"}},
        "spec": {"template": {"spec": {"containers": [{"name": container, "image": "registry.example/redis:patched"}]}}}
    });
    let deployments = Api::<Deployment>::namespaced(c.admin.clone(), &ns);
    deployments
        .patch(
            &name,
            &PatchParams::apply("platform-team").force(),
            &Patch::Apply(&other),
        )
        .await
        .unwrap();
    // The owned-object watch brings the controller back, which re-applies its image.
    wait_for("the controller's image restored", WAIT, || async {
        let d = deployments.get(&name).await.ok()?;
        let img = d.spec?.template.spec?.containers[0].image.clone()?;
        (img == image).then_some(())
    })
    .await;
    let d = deployments.get(&name).await.unwrap();
    assert_eq!(
        d.metadata
            .labels
            .unwrap()
            .get("team.example/owner")
            .map(String::as_str),
        Some("platform"),
        "the other manager's label stays"
    );
    c.drop_namespace(&ns).await;
}

/// The status write is guarded by the resourceVersion it was computed from: against the real
/// API a stale one is a 409 (the reconciler then retries from a fresh read) and nothing is
/// written.
#[tokio::test]
async fn a_status_write_from_a_stale_read_is_a_conflict() {
    let c = Cluster::get().await;
    let ns = c.namespace("conflict").await;
    create(&c.admin, &ns, &managed_redis("raced", json!({}))).await;
    let api = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);
    let read = api.get("raced").await.unwrap();
    let stale_rv = read.metadata.resource_version.clone().unwrap();
    // Someone else writes in between (a label: a new resourceVersion).
    api.patch(
        "raced",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .unwrap();
    let mut next = read.status.clone().unwrap_or_default();
    next.endpoint = Some("written-from-a-stale-read".into());
    let patch = ic_controller::reconcile::cachebackend::status_patch(
        read.status.as_ref(),
        &next,
        Some(&stale_rv),
    )
    .unwrap();
    let err = api
        .patch_status("raced", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 409),
        "{err:?}"
    );
    let now = api.get("raced").await.unwrap();
    assert_ne!(
        now.status.and_then(|s| s.endpoint).as_deref(),
        Some("written-from-a-stale-read")
    );
    c.drop_namespace(&ns).await;
}

/// A cache server created with autoscaling starts at the HPA's floor, not at the Deployment
/// default of 1 (which it ran for ~15 s, until the HPA first acted), and the count is not left
/// owned by the controller, whose next apply would drop it.
#[tokio::test]
async fn a_backend_created_with_autoscaling_starts_at_its_floor() {
    let c = Cluster::get().await;
    let ns = c.namespace("autocreate").await;
    let (seen, watch) = replica_counts(&c.admin, &ns).await;
    create(
        &c.admin,
        &ns,
        &managed_redis(
            "floor",
            json!({"replicas": 3, "autoscaling": {"maxReplicas": 6}}),
        ),
    )
    .await;
    let d = wait_for("the Deployment", WAIT, || {
        backend_deployment(&c.admin, &ns, "floor")
    })
    .await;
    // A spec change makes the controller apply again: the count must survive it.
    Api::<CacheBackend>::namespaced(c.admin.clone(), &ns)
        .patch(
            "floor",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": {"nodeSelector": {"zone": "b"}}}})),
        )
        .await
        .unwrap();
    wait_for("the re-applied Deployment", WAIT, || async {
        let d = backend_deployment(&c.admin, &ns, "floor").await?;
        node_selector(&d).is_some().then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    watch.abort();
    let seen = seen.lock().unwrap().clone();
    assert!(
        !seen.is_empty() && seen.iter().all(|&r| r == 3),
        "replica counts seen: {seen:?}"
    );
    let d = backend_deployment(&c.admin, &ns, "floor")
        .await
        .unwrap_or(d);
    assert_eq!(d.spec.unwrap().replicas, Some(3));
    c.drop_namespace(&ns).await;
}
