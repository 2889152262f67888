//! Agent identity with real ServiceAccount tokens: a TokenRequest bound to a Pod on a node,
//! checked by the controller's TokenReview client running **as the chart's controller
//! ServiceAccount** (so the chart's RBAC must allow the review), with the node the apiserver
//! puts into the token.

use std::sync::Arc;

use ic_controller::ingest::auth::{AgentAuthenticator, AuthError, KubeTokenVerifier};
use ic_shared::proto::Hello;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};

use crate::support::{ensure_node, pod_token, Cluster, AUDIENCE};

fn hello(node: &str, token: &str) -> Hello {
    Hello {
        node: node.to_string(),
        token: token.to_string(),
        ..Default::default()
    }
}

#[tokio::test]
async fn agent_tokens_are_bound_to_their_node_and_pod() {
    let c = Cluster::get().await;
    let ns = c.env["IC_CLUSTER_NAMESPACE"].clone();
    ensure_node(&c.admin, "identity-node-a").await;
    ensure_node(&c.admin, "identity-node-b").await;
    let suffix = std::process::id();
    let pod_a = format!("agent-a-{suffix}");
    let token_a = pod_token(&c.admin, &ns, &pod_a, "identity-node-a", 3600).await;

    // The TokenReview is sent with the controller's own credentials (the chart's RBAC).
    let controller = c.client("IC_CLUSTER_CONTROLLER_KUBECONFIG").await;
    let auth = AgentAuthenticator::new(
        Arc::new(KubeTokenVerifier::new(controller)),
        AUDIENCE,
        format!("{ns}:inference-cache-agent").parse().unwrap(),
    );
    let id = auth
        .authenticate(&hello("identity-node-a", &token_a))
        .await
        .unwrap();
    assert_eq!(id.node, "identity-node-a");
    assert_eq!(
        id.username,
        format!("system:serviceaccount:{ns}:inference-cache-agent")
    );

    // Node A's token cannot speak for node B.
    let err = auth
        .authenticate(&hello("identity-node-b", &token_a))
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::NodeMismatch { .. }), "{err:?}");

    // A string the apiserver never issued is refused by the review.
    let err = auth
        .authenticate(&hello("identity-node-a", "not-a-token"))
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::Rejected(_)), "{err:?}");

    // Once its pod is gone, the bound token is refused (after the apiserver's own cache of
    // successful authentications, 10 s by default, runs out).
    Api::<Pod>::namespaced(c.admin.clone(), &ns)
        .delete(&pod_a, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let mut refused = None;
    for _ in 0..150 {
        match auth.authenticate(&hello("identity-node-a", &token_a)).await {
            Err(e) => {
                refused = Some(e);
                break;
            }
            Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
        }
    }
    assert!(
        matches!(refused, Some(AuthError::Rejected(_))),
        "a deleted pod's token: {refused:?}"
    );
}
