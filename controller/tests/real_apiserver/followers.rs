//! Watch-driven followers: CachePolicies and CacheTenants created *after* the controller started
//! reach it through its watches (no reconcile is called by hand), and the leader writes their
//! status conditions. And the policy table those followers keep, read by the router's lookup.

use std::sync::Arc;
use std::time::Duration;

use ic_controller::reconcile::policy::{self, REASON_APPLIED, REASON_DUPLICATE};
use ic_controller::reconcile::tenants::CONDITION_WITHIN_QUOTA;
use ic_controller::router::Router;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::crd::find_condition;
use ic_shared::crd::{CachePolicy, CacheTenant, POLICY_CONDITION_APPLIED};
use ic_shared::kv::content_key::chain;
use ic_shared::proto::{self, kv_op::Op, KvOp, StoreOp, StreamDelta, StreamDescriptor};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
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

fn router_with_64_tokens(shared: &Arc<Shared>, tenant: &str) -> Router {
    let desc = StreamDescriptor {
        stream_id: format!("{tenant}/p#0"),
        replica: "p".into(),
        tenant: tenant.into(),
        model: "m".into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    };
    let mut ix = shared.index.write();
    ix.resync_node(
        "n",
        &[proto::StreamSnapshot {
            stream: Some(desc.clone()),
            coverage: proto::Coverage::Exact as i32,
            ..Default::default()
        }],
    );
    ix.apply_delta(
        "n",
        &StreamDelta {
            stream: Some(desc),
            seq: 1,
            ops: vec![KvOp {
                op: Some(Op::Store(StoreOp {
                    adapter: String::new(),
                    block_size: 16,
                    tier: proto::Tier::T1 as i32,
                    content_keys: chain(&(0..64).collect::<Vec<_>>(), 16),
                })),
            }],
            coverage: proto::Coverage::Exact as i32,
            ..Default::default()
        },
    )
    .unwrap();
    drop(ix);
    Router::new(shared.clone())
}

fn cpol(name: &str, min: i32) -> CachePolicy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CachePolicy",
        "metadata": {"name": name},
        "spec": {"minimumPrefixTokens": min}
    }))
    .unwrap()
}

fn lookup(r: &Router, tenant: &str) -> proto::LookupRouteResponse {
    r.lookup(&proto::LookupRouteRequest {
        tenant: tenant.into(),
        token_ids: (0..64).collect(),
        ..Default::default()
    })
}

/// CachePolicy reaches LookupRoute: the policies stored in a namespace are synced into the
/// router's policy table the way every controller replica does (`policy::sync` over a real
/// list, status written by the leader), and the router's own `lookup` (what
/// `RouterService.LookupRoute` answers) follows them; the oldest policy applies.
#[tokio::test]
async fn a_cache_policy_gates_lookups_of_its_namespace_until_it_is_deleted() {
    let cluster = Cluster::get().await;
    let ns = cluster.namespace("policy-lookup").await;
    let client = cluster.admin.clone();
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let router = router_with_64_tokens(&shared, &ns);
    let table = shared.index.read().policies();
    let api: Api<CachePolicy> = Api::namespaced(client.clone(), &ns);
    let sync = |write: bool| {
        let (client, table, api) = (client.clone(), table.clone(), api.clone());
        async move {
            let list = api.list(&ListParams::default()).await.unwrap().items;
            policy::sync(&client, &table, &list, write).await;
        }
    };
    assert_eq!(
        lookup(&router, &ns).decision,
        proto::Decision::PrefixMatch as i32
    );

    api.create(&PostParams::default(), &cpol("tuning", 1000))
        .await
        .unwrap();
    sync(true).await;
    let r = lookup(&router, &ns);
    assert_eq!(r.decision, proto::Decision::NoHint as i32);
    assert_eq!(r.reason, "BelowMinimumPrefixTokens");
    let st = api.get("tuning").await.unwrap().status.unwrap();
    let c = find_condition(&st.conditions, "Applied").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", REASON_APPLIED)
    );

    // A second, newer policy in the namespace (creationTimestamp has 1 s resolution) does not
    // apply and says so.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    api.create(&PostParams::default(), &cpol("later", 0))
        .await
        .unwrap();
    sync(true).await;
    assert_eq!(
        lookup(&router, &ns).decision,
        proto::Decision::NoHint as i32
    );
    let st = api.get("later").await.unwrap().status.unwrap();
    let c = find_condition(&st.conditions, "Applied").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", REASON_DUPLICATE)
    );
    assert!(c.message.contains("tuning"), "{}", c.message);

    // Deleting both: the namespace is back to the defaults.
    for name in ["tuning", "later"] {
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }
    // A follower syncs the table without writing status.
    sync(false).await;
    assert_eq!(
        lookup(&router, &ns).decision,
        proto::Decision::PrefixMatch as i32
    );
    assert!(table.list().is_empty());
    cluster.drop_namespace(&ns).await;
}
