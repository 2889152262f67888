//! The bare apiserver harness itself (tests/bare_apiserver_support/): namespaces, status
//! writes, injected faults and the call record on the real API.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;

use bare_apiserver_support::{create_with_status, BareCluster, Faults, Step};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

fn deployment(name: &str) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}
            }
        },
        "status": {"replicas": 2, "readyReplicas": 1, "availableReplicas": 1}
    }))
    .unwrap()
}

#[tokio::test]
async fn status_is_written_through_the_subresource_and_faults_answer_before_the_apiserver() {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("smoke").await;
    let api = Api::<Deployment>::namespaced(bare.admin.clone(), &ns);
    let d = create_with_status(&api, &deployment("web")).await;
    assert_eq!(d.status.unwrap().available_replicas, Some(1));
    // The apiserver defaulted the spec (a real one does; the fake did not).
    assert_eq!(
        d.spec.unwrap().strategy.unwrap().type_.as_deref(),
        Some("RollingUpdate")
    );

    let faults = Faults::new();
    faults.rule(|c| {
        if c.is("PATCH", "/status") {
            Step::conflict()
        } else {
            Step::Pass
        }
    });
    let faulty = Api::<Deployment>::namespaced(bare.client_with(faults.clone()), &ns);
    let err = faulty
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"readyReplicas": 2, "availableReplicas": 2}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict"),
        "{err:?}"
    );
    // The spec write passes through to the apiserver.
    faulty
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 3}})),
        )
        .await
        .unwrap();
    let live = api.get("web").await.unwrap();
    assert_eq!(live.spec.unwrap().replicas, Some(3));
    assert_eq!(live.status.unwrap().available_replicas, Some(1));
    let calls = faults.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[0].is("PATCH", "/web/status") && calls[0].has("deployments"));
    assert!(calls[1].is("PATCH", "/web"));
}
