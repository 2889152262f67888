//! The data plane's caller identity with real tokens and real RBAC: the controller (as the
//! chart's ServiceAccount) reviews a caller's bearer token (TokenReview) and asks the apiserver
//! whether the caller may read (SubjectAccessReview against the chart's
//! `inference-cache-data-plane-reader` ClusterRole).

use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{wait_for, Cluster};

async fn service_account_token(c: &Cluster, ns: &str, name: &str) -> String {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    let sas = Api::<ServiceAccount>::namespaced(c.admin.clone(), ns);
    sas.create(&PostParams::default(), &sa).await.unwrap();
    let req: TokenRequest = serde_json::from_value(json!({
        "spec": {"audiences": ["inference-cache"], "expirationSeconds": 600}
    }))
    .unwrap();
    sas.create_token_request(name, &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
}

/// `GET path` on the controller's HTTP port with an optional bearer token: the status code.
async fn get(c: &Cluster, path: &str, token: Option<&str>) -> u16 {
    let addr = format!("127.0.0.1:{}", c.env["IC_CLUSTER_HTTP_PORT"]);
    let mut s = TcpStream::connect(addr).await.unwrap();
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&out)[9..12].parse().unwrap()
}

#[tokio::test]
async fn callers_are_reviewed_by_the_real_apiserver() {
    let c = Cluster::get().await;
    let ns = c.namespace("dataplane").await;
    let reader = service_account_token(&c, &ns, "dashboard").await;
    let nobody = service_account_token(&c, &ns, "nobody").await;
    let binding_name = format!("{ns}-dashboard");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": binding_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "inference-cache-data-plane-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "dashboard", "namespace": ns}]
    }))
    .unwrap();
    let bindings = Api::<ClusterRoleBinding>::all(c.admin.clone());
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();

    assert_eq!(get(&c, "/snapshot", None).await, 401);
    assert_eq!(get(&c, "/snapshot", Some("forged")).await, 401);
    // Without a grant, /snapshot answers from the granted namespaces only (none: the index
    // holds no tenant here, so nothing is hidden); /v1/nodes and /probe are refused.
    assert_eq!(get(&c, "/snapshot", Some(&nobody)).await, 200);
    assert_eq!(get(&c, "/v1/nodes", Some(&nobody)).await, 403);
    assert_eq!(get(&c, "/probe", Some(&nobody)).await, 403);
    // RBAC caches settle within moments of the binding's create.
    wait_for(
        "the reader to be allowed",
        Duration::from_secs(60),
        || async { (get(&c, "/v1/nodes", Some(&reader)).await == 200).then_some(()) },
    )
    .await;
    assert_eq!(get(&c, "/snapshot", Some(&reader)).await, 200);

    // A token bound to a pod that is on no node carries the pod but no node name, so the
    // controller reads the pod to find one (the path apiservers without node info in tokens
    // take for every pod-bound token); the caller needs no node and is allowed.
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "dashboard-pod"},
        "spec": {"serviceAccountName": "dashboard", "schedulerName": "none",
                 "containers": [{"name": "d", "image": "dashboard:test"}]}
    }))
    .unwrap();
    let pod = Api::<Pod>::namespaced(c.admin.clone(), &ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let req: TokenRequest = serde_json::from_value(json!({
        "spec": {"audiences": ["inference-cache"], "expirationSeconds": 600,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "dashboard-pod",
                                    "uid": pod.metadata.uid}}
    }))
    .unwrap();
    let pod_bound = Api::<ServiceAccount>::namespaced(c.admin.clone(), &ns)
        .create_token_request("dashboard", &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    assert_eq!(get(&c, "/v1/nodes", Some(&pod_bound)).await, 200);
    assert_ne!(get(&c, "/probe", Some(&reader)).await, 403);

    bindings
        .delete(&binding_name, &DeleteParams::default())
        .await
        .unwrap();
    c.drop_namespace(&ns).await;
}
