//! The controller's Job creation on the real kube-apiserver (issue 38 item 7; docs/security.md
//! "The agent mounts only what its checks read", "The controller's Jobs"): its ClusterRole may
//! `create jobs` in every namespace (request-namespace writers need it), so the chart's
//! default-on `…-model-cache-writes` ValidatingAdmissionPolicy is what keeps it to its own
//! Jobs. As the controller's service account (impersonated by the admin), with server-side dry
//! runs: a labelled writer Job in the control namespace under another service account is
//! refused, the same Job under the writer service account is admitted, and an unlabelled Job in
//! another namespace is refused.
//!
//! Run: `IC_BARE_CLUSTER_DIR=target/cluster/bare-dev cargo test -p ic-controller --test
//! model_cache_job_policy`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;

use bare_apiserver_support::{unique, BareCluster};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;

const CONTROL_NAMESPACE: &str = "inference-cache-model-cache";

fn job(service_account: &str, labelled: bool) -> Job {
    let labels = if labelled {
        json!({"app.kubernetes.io/managed-by": "inference-cache",
               "inferencecache.io/model-cache-binding": "b"})
    } else {
        json!({})
    };
    serde_json::from_value(json!({
        "metadata": {"name": unique("writer"), "labels": labels},
        "spec": {"template": {"spec": {
            "serviceAccountName": service_account,
            "restartPolicy": "Never",
            "containers": [{"name": "w", "image": "busybox"}]
        }}}
    }))
    .unwrap()
}

async fn as_controller(c: &BareCluster) -> Client {
    let kc = Kubeconfig::read_from(&c.env["IC_CLUSTER_KUBECONFIG"]).unwrap();
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    config.auth_info.impersonate = Some(format!(
        "system:serviceaccount:{}:{}-controller",
        c.env["IC_CLUSTER_NAMESPACE"], c.env["IC_CLUSTER_RELEASE"]
    ));
    Client::try_from(config).unwrap()
}

async fn refusal(api: &Api<Job>, j: &Job) -> String {
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&dry, j).await {
        Ok(_) => String::new(),
        Err(kube::Error::Api(s)) => s.message,
        Err(e) => panic!("{e:?}"),
    }
}

#[tokio::test]
async fn the_controller_may_create_only_its_own_writer_jobs() {
    let c = BareCluster::get().await;
    let controller = as_controller(&c).await;
    let control = Api::<Job>::namespaced(controller.clone(), CONTROL_NAMESPACE);

    let other = refusal(&control, &job("kube-admin-ish", true)).await;
    assert!(
        other.contains("inference-cache-controller-model-cache-writes")
            && other.contains("must run as the writer service account"),
        "a control-namespace Job as another service account must be refused: {other:?}"
    );
    let writer = refusal(&control, &job("default", true)).await;
    assert_eq!(writer, "", "the writer Job must be admitted");

    let ns = c.namespace("jobs").await;
    let unlabelled = refusal(
        &Api::<Job>::namespaced(controller, &ns),
        &job("default", false),
    )
    .await;
    assert!(
        unlabelled.contains("inference-cache-controller-model-cache-writes"),
        "an unlabelled Job must be refused: {unlabelled:?}"
    );
}
