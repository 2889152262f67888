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

/// `token` with its claims edited by `edit` and signed again with the cluster's ServiceAccount
/// signing key (`pki/sa.key`, RS256, the same `kid`): a token the apiserver itself could have
/// issued, with the lifetime the test chooses.
fn resigned(c: &Cluster, token: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    use base64::Engine;
    let mut parts = token.split('.');
    let (header, claims) = (parts.next().unwrap(), parts.next().unwrap());
    let mut claims: serde_json::Value =
        serde_json::from_slice(&URL_SAFE_NO_PAD.decode(claims).unwrap()).unwrap();
    edit(&mut claims);
    let signing_input = format!(
        "{header}.{}",
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap())
    );
    let pem = std::fs::read_to_string(format!("{}/pki/sa.key", c.env["IC_CLUSTER_STATE"])).unwrap();
    let der: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    let key = ring::signature::RsaKeyPair::from_pkcs8(&STANDARD.decode(der).unwrap()).unwrap();
    let mut sig = vec![0; key.public().modulus_len()];
    key.sign(
        &ring::signature::RSA_PKCS1_SHA256,
        &ring::rand::SystemRandom::new(),
        signing_input.as_bytes(),
        &mut sig,
    )
    .unwrap();
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(sig))
}

/// An expired agent token is refused by the real TokenReview; the same claims re-signed with
/// their lifetime intact pass, so the expiry (nothing else about the re-signed token) is why.
/// (TokenRequest's shortest lifetime is 10 min, so the expired token is the issued one with its
/// `iat`/`nbf`/`exp` moved an hour back.)
#[tokio::test]
async fn an_expired_agent_token_is_refused() {
    let c = Cluster::get().await;
    let ns = c.env["IC_CLUSTER_NAMESPACE"].clone();
    ensure_node(&c.admin, "identity-node-c").await;
    let pod = format!("agent-c-{}", std::process::id());
    let issued = pod_token(&c.admin, &ns, &pod, "identity-node-c", 3600).await;
    let controller = c.client("IC_CLUSTER_CONTROLLER_KUBECONFIG").await;
    let auth = AgentAuthenticator::new(
        Arc::new(KubeTokenVerifier::new(controller)),
        AUDIENCE,
        format!("{ns}:inference-cache-agent").parse().unwrap(),
    );

    let fresh = resigned(&c, &issued, |_| {});
    let id = auth
        .authenticate(&hello("identity-node-c", &fresh))
        .await
        .unwrap();
    assert_eq!(id.node, "identity-node-c");

    let expired = resigned(&c, &issued, |claims| {
        for key in ["iat", "nbf", "exp"] {
            let t = claims[key].as_i64().unwrap();
            claims[key] = serde_json::json!(t - 3 * 3600);
        }
    });
    let err = auth
        .authenticate(&hello("identity-node-c", &expired))
        .await
        .unwrap_err();
    assert!(matches!(err, AuthError::Rejected(_)), "{err:?}");
    Api::<Pod>::namespaced(c.admin.clone(), &ns)
        .delete(&pod, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
}
