//! The controller across a kube-apiserver restart and an etcd compaction (`scripts/cluster.sh
//! restart kube-apiserver`): its watches break, its Lease renewals fail, and a watch resumed
//! from a compacted resourceVersion gets `410 Gone`. Afterwards it must re-list, regain the Lease
//! and reconcile both what changed while it was blind and what comes next.
//!
//! A test binary of its own: cargo runs test binaries one after another, so the restart never
//! lands in the middle of the `real_apiserver` suite's tests.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
#[path = "real_apiserver/support.rs"]
mod support;

use std::process::Command;
use std::time::Duration;

use ic_shared::crd::CacheBackend;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

use support::{backend_deployment, managed_redis, node_selector, wait_for, Cluster};

/// Compacts etcd at its current revision (etcd's JSON gateway), so every older
/// resourceVersion is gone.
async fn compact_etcd(c: &Cluster) {
    let etcd = &c.env["IC_CLUSTER_ETCD"];
    let status = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "POST",
            &format!("{etcd}/v3/kv/range"),
            "-d",
            r#"{"key":"AA=="}"#,
        ])
        .output()
        .unwrap();
    assert!(status.status.success(), "etcd range: {status:?}");
    let body: Value = serde_json::from_slice(&status.stdout).unwrap();
    let revision = body["header"]["revision"].as_str().unwrap().to_string();
    let out = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "POST",
            &format!("{etcd}/v3/kv/compaction"),
            "-d",
            &json!({"revision": revision, "physical": true}).to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "etcd compaction: {out:?}");
}

fn cluster_sh(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/cluster.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cluster.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn the_controller_recovers_from_an_apiserver_restart_and_a_compaction() {
    let c = Cluster::get().await;
    let ns = c.namespace("restart").await;
    let backends = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);
    backends
        .create(&PostParams::default(), &managed_redis("before", json!({})))
        .await
        .unwrap();
    wait_for("the first Deployment", Duration::from_secs(60), || {
        backend_deployment(&c.admin, &ns, "before")
    })
    .await;

    // Down long enough for the controller's Lease renewals to fail past their deadline.
    cluster_sh(&["restart", "kube-apiserver"]);
    // Everything older than now is compacted: watches resuming from their last
    // resourceVersion get 410 Gone and must re-list.
    compact_etcd(&c).await;
    let c = Cluster::get().await;

    // A change to an existing backend and a new backend, both made after the restart.
    backends
        .patch(
            "before",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": {"nodeSelector": {"zone": "a"}}}})),
        )
        .await
        .unwrap();
    backends
        .create(&PostParams::default(), &managed_redis("after", json!({})))
        .await
        .unwrap();
    wait_for(
        "the new backend's Deployment",
        Duration::from_secs(120),
        || backend_deployment(&c.admin, &ns, "after"),
    )
    .await;
    wait_for(
        "the changed backend's Deployment",
        Duration::from_secs(120),
        || async {
            let d = backend_deployment(&c.admin, &ns, "before").await?;
            (node_selector(&d) == Some(json!({"zone": "a"}))).then_some(())
        },
    )
    .await;
    // The chart's controller holds its Lease again.
    let lease = Api::<Lease>::namespaced(c.admin.clone(), &c.env["IC_CLUSTER_NAMESPACE"])
        .get("inference-cache-controller")
        .await
        .unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("ic-controller-local")
    );
    c.drop_namespace(&ns).await;
}
