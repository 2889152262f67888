//! CachePolicy reaches LookupRoute (issue 13 item 3): policies stored in an in-memory API are
//! synced into the router's policy table the way every controller replica does, and the
//! router's own `lookup` (what `RouterService.LookupRoute` answers) follows them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use ic_controller::reconcile::policy::{self, REASON_APPLIED, REASON_DUPLICATE};
use ic_controller::router::Router;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::crd::{find_condition, CachePolicy};
use ic_shared::kv::content_key::chain;
use ic_shared::proto::{self, kv_op::Op, KvOp, StoreOp, StreamDelta, StreamDescriptor};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube_fake_client::ClientBuilder;

fn router_with_64_tokens(shared: &Arc<Shared>) -> Router {
    let desc = StreamDescriptor {
        stream_id: "team-a/p#0".into(),
        replica: "p".into(),
        tenant: "team-a".into(),
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

fn cpol(ns: &str, name: &str, min: i32, created: &str) -> CachePolicy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CachePolicy",
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
        "spec": {"minimumPrefixTokens": min}
    }))
    .unwrap()
}

fn lookup(r: &Router) -> proto::LookupRouteResponse {
    r.lookup(&proto::LookupRouteRequest {
        tenant: "team-a".into(),
        token_ids: (0..64).collect(),
        ..Default::default()
    })
}

#[tokio::test]
async fn a_cache_policy_gates_lookups_of_its_namespace_until_it_is_deleted() {
    let client = ClientBuilder::new()
        .with_resource::<CachePolicy>()
        .with_status_subresource::<CachePolicy>()
        .build()
        .await
        .unwrap();
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let router = router_with_64_tokens(&shared);
    let table = shared.index.read().policies();
    let api: Api<CachePolicy> = Api::namespaced(client.clone(), "team-a");
    let sync = |write: bool| {
        let (client, table, api) = (client.clone(), table.clone(), api.clone());
        async move {
            let list = api.list(&ListParams::default()).await.unwrap().items;
            policy::sync(&client, &table, &list, write).await;
        }
    };
    assert_eq!(
        lookup(&router).decision,
        proto::Decision::PrefixMatch as i32
    );

    api.create(
        &PostParams::default(),
        &cpol("team-a", "tuning", 1000, "2026-01-01T00:00:00Z"),
    )
    .await
    .unwrap();
    sync(true).await;
    let r = lookup(&router);
    assert_eq!(r.decision, proto::Decision::NoHint as i32);
    assert_eq!(r.reason, "BelowMinimumPrefixTokens");
    let st = api.get("tuning").await.unwrap().status.unwrap();
    let c = find_condition(&st.conditions, "Applied").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", REASON_APPLIED)
    );

    // A second, newer policy in the namespace does not apply and says so.
    api.create(
        &PostParams::default(),
        &cpol("team-a", "later", 0, "2026-02-01T00:00:00Z"),
    )
    .await
    .unwrap();
    sync(true).await;
    assert_eq!(lookup(&router).decision, proto::Decision::NoHint as i32);
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
        lookup(&router).decision,
        proto::Decision::PrefixMatch as i32
    );
    assert!(table.list().is_empty());
}
