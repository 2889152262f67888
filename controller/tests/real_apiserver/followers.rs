//! Watch-driven followers: CachePolicies and CacheTenants created *after* the controller started
//! reach it through its watches (no reconcile is called by hand), and the leader writes their
//! status conditions.

use std::time::Duration;

use ic_controller::reconcile::policy::{REASON_APPLIED, REASON_DUPLICATE};
use ic_controller::reconcile::tenants::CONDITION_WITHIN_QUOTA;
use ic_shared::crd::{CachePolicy, CacheTenant, POLICY_CONDITION_APPLIED};
use kube::api::{Api, PostParams};
use serde_json::{json, Value};

use crate::support::{wait_for, Cluster};

fn condition(status: &Value, type_: &str) -> Option<Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

#[tokio::test]
async fn policies_and_tenants_are_followed_through_watches() {
    let c = Cluster::get().await;
    let ns = c.namespace("followers").await;
    let policies = Api::<CachePolicy>::namespaced(c.admin.clone(), &ns);
    let policy = |name: &str| -> CachePolicy {
        serde_json::from_value(json!({
            "apiVersion": "inferencecache.io/v1alpha1", "kind": "CachePolicy",
            "metadata": {"name": name},
            "spec": {"lookupTimeoutMs": 20, "minimumPrefixTokens": 64}
        }))
        .unwrap()
    };
    policies
        .create(&PostParams::default(), &policy("first"))
        .await
        .unwrap();
    let reason = |name: &'static str| {
        let policies = policies.clone();
        async move {
            let p = policies.get(name).await.ok()?;
            let st = serde_json::to_value(p.status?).ok()?;
            condition(&st, POLICY_CONDITION_APPLIED)?["reason"]
                .as_str()
                .map(str::to_string)
        }
    };
    wait_for(
        "the first policy Applied",
        Duration::from_secs(30),
        || async { (reason("first").await.as_deref() == Some(REASON_APPLIED)).then_some(()) },
    )
    .await;
    // A second policy in the namespace is the duplicate; the oldest keeps applying.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    policies
        .create(&PostParams::default(), &policy("second"))
        .await
        .unwrap();
    wait_for(
        "the second policy a duplicate",
        Duration::from_secs(30),
        || async { (reason("second").await.as_deref() == Some(REASON_DUPLICATE)).then_some(()) },
    )
    .await;

    let tenants = Api::<CacheTenant>::namespaced(c.admin.clone(), &ns);
    let tenant: CacheTenant = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheTenant",
        "metadata": {"name": "team"},
        "spec": {"tenantID": "team", "quota": {"maxIndexEntries": 1000}}
    }))
    .unwrap();
    tenants
        .create(&PostParams::default(), &tenant)
        .await
        .unwrap();
    wait_for(
        "the tenant's WithinQuota",
        Duration::from_secs(60),
        || async {
            let t = tenants.get("team").await.ok()?;
            let st = serde_json::to_value(t.status?).ok()?;
            condition(&st, CONDITION_WITHIN_QUOTA)
        },
    )
    .await;
    c.drop_namespace(&ns).await;
}
