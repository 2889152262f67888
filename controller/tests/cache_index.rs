//! The CacheIndex writer (issue 13 item 4; spec 000 CacheIndex carve-out, "Index
//! Participation"): one cluster-scoped `default` object, from the controller's own index and
//! what the engines report through the agents' `CounterReport` (the wire message, as the agent
//! builds it from LMCache's `lmcache:local_cache_usage` and vLLM's prefix-cache counters),
//! written by the leader only, rate-limited, validated against the generated CRD schema — pure,
//! and against the bare real apiserver (`bare_apiserver_support`: the chart's CRDs, status
//! subresource, resourceVersion preconditions). The CacheIndex name is fixed, so the tests
//! that write it take turns (`SERIAL`) and start by deleting what a previous one left.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bare_apiserver_support::{BareCluster, Faults, Step};
use ic_controller::crdgen;
use ic_controller::index::{EngineReport, PrefixIndex};
use ic_controller::leader::LeaderHandle;
use ic_controller::reconcile::cache_index::{
    desired_status, spawn_writer, CacheIndexWriter, IndexAggregate, SyncOutcome, MAX_REPLICA_ROWS,
};
use ic_controller::reconcile::clock::{Clock, SystemClock};
use ic_controller::state::Shared;
use ic_shared::crd::{find_condition, CacheIndex, CACHE_INDEX_NAME};
use ic_shared::kv::content_key::chain;
use ic_shared::proto::{self, kv_op::Op, KvOp, StoreOp, StreamCounters, StreamDelta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams};

fn desc(tenant: &str, replica: &str, rank: u32) -> proto::StreamDescriptor {
    proto::StreamDescriptor {
        stream_id: format!("{tenant}/{}#{rank}", replica.split('#').next().unwrap()),
        replica: replica.into(),
        dp_rank: rank,
        tenant: tenant.into(),
        model: "Qwen/Qwen3-8B".into(),
        hash_scheme: "vllm".into(),
        backend: format!("{tenant}/kv"),
        node: "n1".into(),
        offload_chunk_tokens: 0,
    }
}

fn store(tier: proto::Tier, tokens: std::ops::Range<u32>) -> KvOp {
    KvOp {
        op: Some(Op::Store(StoreOp {
            adapter: String::new(),
            block_size: 16,
            tier: tier as i32,
            content_keys: chain(&tokens.collect::<Vec<_>>(), 16),
        })),
    }
}

/// team-a: pod a-0 holds blocks 0..4 at T1, a-1 the same 4 plus 4 more offloaded (T2 only);
/// team-b: b-0 holds 2 blocks, and its stream is Partial (a sequence gap).
fn populated() -> PrefixIndex {
    populated_for("team-a", "team-b")
}

/// [`populated`] with tenants (engine pod namespaces) `team_a` and `team_b`.
fn populated_for(team_a: &str, team_b: &str) -> PrefixIndex {
    let mut ix = PrefixIndex::new();
    let streams = [
        (desc(team_a, "a-0", 0), proto::Coverage::Exact, ""),
        (desc(team_a, "a-1", 0), proto::Coverage::Exact, ""),
        (
            desc(team_b, "b-0", 0),
            proto::Coverage::Partial,
            "SequenceGap",
        ),
    ];
    ix.resync_node(
        "n1",
        &streams
            .iter()
            .map(|(d, c, r)| proto::StreamSnapshot {
                stream: Some(d.clone()),
                coverage: *c as i32,
                coverage_reason: r.to_string(),
                last_event_unix_ms: 1_780_000_000_000,
                ..Default::default()
            })
            .collect::<Vec<_>>(),
    );
    let deltas = [
        (0, vec![store(proto::Tier::T1, 0..64)]),
        (
            1,
            vec![
                store(proto::Tier::T1, 0..64),
                store(proto::Tier::T2, 1000..1064),
            ],
        ),
        (2, vec![store(proto::Tier::T1, 5000..5032)]),
    ];
    for (i, ops) in deltas {
        let (d, c, r) = &streams[i];
        ix.apply_delta(
            "n1",
            &StreamDelta {
                stream: Some(d.clone()),
                seq: 1,
                ops,
                coverage: *c as i32,
                coverage_reason: r.to_string(),
                ..Default::default()
            },
        )
        .unwrap();
    }
    // What the agent sends for a-0: LMCache's local cache bytes and vLLM's prefix-cache
    // counters, no tier-2 counters; for a-1 only tier-2 counters; b-0 reports nothing.
    let a0 = StreamCounters {
        stream: Some(streams[0].0.clone()),
        t2_absent: true,
        cache_memory_bytes: Some(2 * 1_073_741_824),
        prefix_cache_hits: Some(1),
        prefix_cache_queries: Some(30_000),
        observed_at_unix_ms: 1,
        ..Default::default()
    };
    let a1 = StreamCounters {
        stream: Some(streams[1].0.clone()),
        t2_hits: 5,
        t2_queries: 9,
        observed_at_unix_ms: 1,
        ..Default::default()
    };
    ix.set_engine_counters(&format!("{team_a}/a-0#0"), EngineReport::from_counters(&a0));
    ix.set_engine_counters(&format!("{team_a}/a-1#0"), EngineReport::from_counters(&a1));
    ix
}

fn validate(status: &serde_json::Value) {
    let crd = crdgen::all_crds()
        .into_iter()
        .find(|c| c.spec.names.kind == "CacheIndex")
        .unwrap();
    let schema = serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap();
    let doc = serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheIndex",
        "metadata": {"name": "default"}, "spec": {}, "status": status,
    });
    let v = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = v.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "schema: {errors:?}");
}

#[test]
fn the_status_carries_per_replica_memory_tenants_tiers_and_coverage() {
    let ix = populated();
    let s = desired_status(
        &IndexAggregate::of(&ix),
        None,
        ic_controller::reconcile::clock::to_time(Timestamp::now()),
    );
    validate(&serde_json::to_value(&s).unwrap());
    assert_eq!(s.replica_count, 3);
    let ids: Vec<(&str, &str)> = s
        .replicas
        .iter()
        .map(|r| (r.tenant.as_str(), r.id.as_str()))
        .collect();
    assert_eq!(
        ids,
        [("team-a", "a-0"), ("team-a", "a-1"), ("team-b", "b-0")]
    );
    let a0 = &s.replicas[0];
    assert_eq!(a0.cache_memory_bytes, Some(2_147_483_648));
    // 1 hit in 30 000 lookups is not 0.
    assert_eq!(a0.hit_rate.as_deref(), Some("0.0000333"));
    assert_eq!(a0.backend.as_deref(), Some("team-a/kv"));
    assert_eq!(a0.prefix_count, 4);
    // Not reported: absent, never 0.
    assert_eq!(s.replicas[1].cache_memory_bytes, None);
    assert_eq!(s.replicas[1].hit_rate, None);
    assert_eq!(s.replicas[1].prefix_count, 8);
    assert_eq!(s.replicas[2].coverage.as_deref(), Some("Partial"));
    assert_eq!(
        s.replicas[2].coverage_reason.as_deref(),
        Some("SequenceGap")
    );

    // Distinct prefixes: team-a's 4 shared blocks count once, plus its 4 offloaded ones.
    let tenants: Vec<(&str, i64, i64, Option<&str>)> = s
        .tenants
        .iter()
        .map(|t| {
            (
                t.id.as_str(),
                t.index_entries,
                t.memory_used,
                t.hit_rate.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        tenants,
        [("team-a", 8, 0, Some("0.0000333")), ("team-b", 2, 0, None)]
    );
    assert_eq!((s.prefixes.total, s.prefixes.t1, s.prefixes.t2), (10, 6, 4));
    assert_eq!(
        s.tenants.iter().map(|t| t.index_entries).sum::<i64>(),
        s.prefixes.total
    );
    let complete = find_condition(&s.conditions, "Complete").unwrap();
    assert_eq!(
        (complete.status.as_str(), complete.reason.as_str()),
        ("True", "AllReplicas")
    );
    let exact = find_condition(&s.conditions, "Exact").unwrap();
    assert_eq!(
        (exact.status.as_str(), exact.reason.as_str()),
        ("False", "InexactReplicas")
    );
    assert!(
        exact.message.contains("1 of 3") && exact.message.contains("1 Partial"),
        "{}",
        exact.message
    );
    assert_eq!(s.observed_server.as_deref(), Some("in-process"));
}

#[test]
fn too_many_replicas_are_truncated_loudly() {
    let mut ix = PrefixIndex::new();
    let n = MAX_REPLICA_ROWS + 5;
    ix.resync_node(
        "n1",
        &(0..n)
            .map(|i| proto::StreamSnapshot {
                stream: Some(desc("t", &format!("p-{i:05}"), 0)),
                coverage: proto::Coverage::Exact as i32,
                ..Default::default()
            })
            .collect::<Vec<_>>(),
    );
    let s = desired_status(
        &IndexAggregate::of(&ix),
        None,
        ic_controller::reconcile::clock::to_time(Timestamp::now()),
    );
    assert_eq!(s.replicas.len(), MAX_REPLICA_ROWS);
    assert_eq!(s.replica_count as usize, n);
    let c = find_condition(&s.conditions, "Complete").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "ReplicasTruncated")
    );
    assert!(c.message.contains(&n.to_string()), "{}", c.message);
}

/// The CacheIndex is a singleton with a fixed name ([`CACHE_INDEX_NAME`], not configurable): the
/// tests that write it (and the CacheTenant statuses the leader's loop writes beside it) run one
/// at a time in this binary, each from no stored CacheIndex.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Deletes the stored CacheIndex (a previous test's or run's) and waits until it is gone.
async fn no_cache_index(bare: &BareCluster) {
    let api = Api::<CacheIndex>::all(bare.admin.clone());
    match api.delete(CACHE_INDEX_NAME, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("deleting the CacheIndex: {e}"),
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while api.get_opt(CACHE_INDEX_NAME).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the CacheIndex is not gone"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn stored(client: &kube::Client) -> Option<CacheIndex> {
    Api::<CacheIndex>::all(client.clone())
        .get_opt(CACHE_INDEX_NAME)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_writer_creates_writes_on_change_and_is_rate_limited() {
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    no_cache_index(&bare).await;
    let client = bare.admin.clone();
    let mut w = CacheIndexWriter::new(client.clone(), Duration::from_secs(15));
    let mut ix = populated();
    let t0 = Timestamp::from_second(1_800_000_000).unwrap();
    assert_eq!(
        w.sync(&IndexAggregate::of(&ix), t0).await.unwrap(),
        SyncOutcome::Written
    );
    let first = stored(&client).await.unwrap().status.unwrap();
    validate(&serde_json::to_value(&first).unwrap());
    assert_eq!(first.replicas[0].cache_memory_bytes, Some(2_147_483_648));
    // Nothing changed: nothing written, lastUpdated stays.
    let t1 = Timestamp::from_second(1_800_000_100).unwrap();
    assert_eq!(
        w.sync(&IndexAggregate::of(&ix), t1).await.unwrap(),
        SyncOutcome::Unchanged
    );
    // The engine's cache grew: written, but not before min_interval after the last write.
    let grown = StreamCounters {
        stream: Some(desc("team-a", "a-0", 0)),
        t2_absent: true,
        cache_memory_bytes: Some(3 * 1_073_741_824),
        ..Default::default()
    };
    ix.set_engine_counters("team-a/a-0#0", EngineReport::from_counters(&grown));
    let mut w2 = CacheIndexWriter::new(client.clone(), Duration::from_secs(15));
    assert_eq!(
        w2.sync(&IndexAggregate::of(&ix), t1).await.unwrap(),
        SyncOutcome::Written,
        "a fresh writer (new leader) reads what is stored and writes the change"
    );
    ix.set_engine_counters(
        "team-a/a-0#0",
        EngineReport {
            cache_memory_bytes: Some(1),
            ..Default::default()
        },
    );
    let t2 = Timestamp::from_second(1_800_000_105).unwrap();
    assert_eq!(
        w2.sync(&IndexAggregate::of(&ix), t2).await.unwrap(),
        SyncOutcome::RateLimited
    );
    let t3 = Timestamp::from_second(1_800_000_116).unwrap();
    assert_eq!(
        w2.sync(&IndexAggregate::of(&ix), t3).await.unwrap(),
        SyncOutcome::Written
    );
    let last = stored(&client).await.unwrap().status.unwrap();
    assert_eq!(last.replicas[0].cache_memory_bytes, Some(1));
    assert_eq!(
        last.last_updated.as_ref().map(|t| t.0.as_second()),
        Some(1_800_000_116)
    );
    // The engine stops reporting memory: the field goes away in the stored object too.
    ix.set_engine_counters("team-a/a-0#0", EngineReport::default());
    let t4 = Timestamp::from_second(1_800_000_200).unwrap();
    w2.sync(&IndexAggregate::of(&ix), t4).await.unwrap();
    let gone = stored(&client).await.unwrap().status.unwrap();
    assert_eq!(gone.replicas[0].cache_memory_bytes, None);
}

/// A status written by someone else (the other replica around a leadership hand-over) is seen
/// on the next pass and corrected, although this writer's own index did not change.
#[tokio::test]
async fn a_status_overwritten_by_another_writer_is_corrected() {
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    no_cache_index(&bare).await;
    let client = bare.admin.clone();
    let ix = populated();
    let mut w = CacheIndexWriter::new(client.clone(), Duration::from_secs(15));
    let t0 = Timestamp::from_second(1_800_000_000).unwrap();
    assert_eq!(
        w.sync(&IndexAggregate::of(&ix), t0).await.unwrap(),
        SyncOutcome::Written
    );
    let ours = stored(&client).await.unwrap().status.unwrap();
    // The other writer's view: an empty index.
    let mut other = CacheIndexWriter::new(client.clone(), Duration::from_secs(15));
    assert_eq!(
        other
            .sync(&IndexAggregate::of(&PrefixIndex::default()), t0)
            .await
            .unwrap(),
        SyncOutcome::Written
    );
    assert_ne!(stored(&client).await.unwrap().status.unwrap(), ours);
    let t1 = Timestamp::from_second(1_800_000_100).unwrap();
    assert_eq!(
        w.sync(&IndexAggregate::of(&ix), t1).await.unwrap(),
        SyncOutcome::Written,
        "the writer trusted its own last write over the stored object"
    );
    let fixed = stored(&client).await.unwrap().status.unwrap();
    assert_eq!(fixed.replicas, ours.replicas);
    assert_eq!(fixed.prefixes, ours.prefixes);
}

/// A write computed from a read that another writer overtook is refused by the resourceVersion
/// precondition (409 from the apiserver): the newer object stays, the outcome says so, the next
/// pass writes.
#[tokio::test]
async fn a_write_from_an_overtaken_read_is_refused() {
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    no_cache_index(&bare).await;
    let interfered = Arc::new(AtomicBool::new(false));
    let flag = interfered.clone();
    let other_writer = bare.admin.clone();
    let faults = Faults::new();
    faults.rule(move |c| {
        if c.is("PATCH", &format!("/cacheindexes/{CACHE_INDEX_NAME}/status"))
            && !flag.swap(true, Ordering::SeqCst)
        {
            // Between the writer's read and its PATCH, another writer's update lands.
            let api = Api::<CacheIndex>::all(other_writer.clone());
            Step::Before(Box::pin(async move {
                let mut o = api.get(CACHE_INDEX_NAME).await.unwrap();
                let mut st = o.status.clone().unwrap_or_default();
                st.replica_count = 4242;
                o.status = Some(st);
                api.replace_status(CACHE_INDEX_NAME, &PostParams::default(), &o)
                    .await
                    .unwrap();
            }))
        } else {
            Step::Pass
        }
    });
    let client = bare.client_with(faults.clone());
    let ix = populated();
    let mut w = CacheIndexWriter::new(client.clone(), Duration::from_secs(15));
    let t0 = Timestamp::from_second(1_800_000_000).unwrap();
    assert_eq!(
        w.sync(&IndexAggregate::of(&ix), t0).await.unwrap(),
        SyncOutcome::Conflict
    );
    assert!(interfered.load(Ordering::SeqCst));
    // The refusal is the apiserver's: the writer's PATCH was sent (after the other write).
    let patches: Vec<_> = faults
        .calls()
        .into_iter()
        .filter(|c| c.is("PATCH", "/status") && c.has("cacheindexes"))
        .collect();
    assert_eq!(patches.len(), 1, "{patches:?}");
    assert_eq!(
        stored(&client).await.unwrap().status.unwrap().replica_count,
        4242,
        "the overtaken write replaced the newer object"
    );
    let t1 = Timestamp::from_second(1_800_000_020).unwrap();
    assert_eq!(
        w.sync(&IndexAggregate::of(&ix), t1).await.unwrap(),
        SyncOutcome::Written
    );
    let st = stored(&client).await.unwrap().status.unwrap();
    assert_eq!(
        st.replica_count,
        desired_status(
            &IndexAggregate::of(&ix),
            None,
            ic_controller::reconcile::clock::to_time(t1)
        )
        .replica_count
    );
    assert_ne!(st.replica_count, 4242);
}

#[tokio::test]
async fn only_the_leader_writes() {
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    no_cache_index(&bare).await;
    let client = bare.admin.clone();
    let shared = Arc::new(Shared::new(Default::default()).unwrap());
    *shared.index.write() = populated();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let follower = spawn_writer(
        client.clone(),
        shared.clone(),
        LeaderHandle::fixed(false),
        clock.clone(),
        Duration::from_millis(10),
        Duration::ZERO,
        stop_rx.clone(),
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        stored(&client).await.is_none(),
        "a follower wrote the CacheIndex"
    );
    let leader = spawn_writer(
        client.clone(),
        shared,
        LeaderHandle::fixed(true),
        clock,
        Duration::from_millis(10),
        Duration::ZERO,
        stop_rx,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while stored(&client).await.and_then(|o| o.status).is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the leader never wrote"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).unwrap();
    follower.await.unwrap();
    leader.await.unwrap();
}

fn tenant(ns: &str, name: &str, spec: serde_json::Value) -> ic_shared::crd::CacheTenant {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheTenant",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }))
    .unwrap()
}

/// CacheTenant (spec 000 carve-out: no memory quota; issue 15: the entry quota is enforced):
/// every replica gives its index the quotas of the stored CacheTenants; the index evicts the
/// tenant's oldest prefixes; the leader writes `indexEntries`, `evictedEntries` and
/// `WithinQuota`. The tenants are this test's namespaces; `sync_tenants` writes every
/// CacheTenant of the cluster, so what it wrote of this test's is read from the requests sent.
#[tokio::test]
async fn cache_tenants_quotas_are_enforced_and_reported() {
    use ic_controller::reconcile::tenants::{quotas, sync_tenants};
    use ic_shared::crd::CacheTenant;
    // The leader loop of `only_the_leader_writes` writes every CacheTenant too.
    let _serial = SERIAL.lock().await;
    let bare = BareCluster::get().await;
    let team_a = bare.namespace("tenant-a").await;
    let team_b = bare.namespace("tenant-b").await;
    let ops = bare.namespace("tenant-ops").await;
    let idle = bare.namespace("tenant-idle").await;
    let fixtures = vec![
        tenant(
            &team_a,
            "quota",
            serde_json::json!({"quota": {"maxIndexEntries": 6}}),
        ),
        tenant(
            &team_b,
            "roomy",
            serde_json::json!({"quota": {"maxIndexEntries": 5}}),
        ),
        // A second CacheTenant of team-a: the smaller quota applies.
        tenant(
            &team_a,
            "tighter",
            serde_json::json!({"quota": {"maxIndexEntries": 5}}),
        ),
        // Another namespace naming team-a: never enforced (it could evict team-a's entries).
        tenant(
            &ops,
            "names-team-a",
            serde_json::json!({"tenantID": team_a, "quota": {"maxIndexEntries": 0}}),
        ),
        tenant(&idle, "nothing", serde_json::json!({})),
    ];
    let mut objects = Vec::new();
    for o in fixtures {
        let ns = o.metadata.namespace.clone().unwrap();
        objects.push(
            Api::<CacheTenant>::namespaced(bare.admin.clone(), &ns)
                .create(&PostParams::default(), &o)
                .await
                .unwrap(),
        );
    }
    let faults = Faults::new();
    let client = bare.client_with(faults.clone());
    let q = quotas(&objects);
    assert_eq!(q.get(team_a.as_str()), Some(&5));
    assert_eq!(q.get(team_b.as_str()), Some(&5));
    assert_eq!(q.len(), 2);

    let mut ix = populated_for(&team_a, &team_b);
    ix.set_tenant_quotas(q);
    let agg = IndexAggregate::of(&ix);
    // team-a held 8 distinct prefixes: the 3 oldest went.
    assert_eq!(agg.blocks_by_tenant.get(team_a.as_str()), Some(&5));
    assert_eq!(agg.quota_evictions.get(team_a.as_str()), Some(&3));
    let s = desired_status(
        &agg,
        None,
        ic_controller::reconcile::clock::to_time(Timestamp::now()),
    );
    assert!(s
        .replicas
        .iter()
        .filter(|r| r.tenant == team_a)
        .all(|r| r.coverage.as_deref() == Some("Partial")
            && r.coverage_reason.as_deref() == Some("TenantQuotaExceeded")));

    // This test's CacheTenants whose status was written by the requests since `from`.
    let ours = [&team_a, &team_b, &ops, &idle];
    let written_of_ours = |from: usize| -> Vec<String> {
        faults.calls()[from..]
            .iter()
            .filter(|c| c.is("PATCH", "/status") && c.has("cachetenants"))
            .filter(|c| ours.iter().any(|ns| c.has(ns)))
            .map(|c| c.path.clone())
            .collect()
    };
    let now = ic_controller::reconcile::clock::to_time(Timestamp::now());
    let written = sync_tenants(&client, &agg, now.clone()).await.unwrap();
    assert_eq!(written_of_ours(0).len(), 5, "{:?}", written_of_ours(0));
    assert!(written >= 5, "{written}");
    // Nothing changed: nothing written.
    let before = faults.calls().len();
    sync_tenants(&client, &agg, now).await.unwrap();
    assert_eq!(written_of_ours(before), Vec::<String>::new());
    let get = |ns: &str, name: &'static str| {
        let api: Api<CacheTenant> = Api::namespaced(client.clone(), ns);
        async move { api.get(name).await.unwrap() }
    };
    let quota = get(&team_a, "quota").await;
    let a = quota.status.unwrap();
    assert_eq!((a.index_entries, a.evicted_entries), (Some(5), Some(3)));
    assert_eq!(a.observed_generation, quota.metadata.generation);
    let c = find_condition(&a.conditions, "WithinQuota").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "QuotaExceeded")
    );
    assert!(c.message.contains("evicted 3"), "{}", c.message);
    let b = get(&team_b, "roomy").await.status.unwrap();
    assert_eq!((b.index_entries, b.evicted_entries), (Some(2), Some(0)));
    let c = find_condition(&b.conditions, "WithinQuota").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "WithinQuota")
    );
    let named = get(&ops, "names-team-a").await.status.unwrap();
    assert_eq!(
        named.index_entries,
        Some(5),
        "spec.tenantID names the tenant"
    );
    let idle = get(&idle, "nothing").await.status.unwrap();
    assert_eq!((idle.index_entries, idle.evicted_entries), (Some(0), None));
    let c = find_condition(&idle.conditions, "WithinQuota").unwrap();
    assert_eq!(c.reason, "NoQuota");
}

/// The rows are bounded by bytes too: long model ids cannot push the object toward etcd's limit.
#[test]
fn rows_are_bounded_by_bytes_and_say_so() {
    use ic_controller::reconcile::cache_index::MAX_REPLICA_BYTES;
    let mut ix = PrefixIndex::new();
    ix.resync_node(
        "n1",
        &(0..600)
            .map(|i| {
                let mut d = desc("t", &format!("p-{i:04}"), 0);
                d.model = "m".repeat(1000);
                proto::StreamSnapshot {
                    stream: Some(d),
                    coverage: proto::Coverage::Exact as i32,
                    ..Default::default()
                }
            })
            .collect::<Vec<_>>(),
    );
    let s = desired_status(
        &IndexAggregate::of(&ix),
        None,
        ic_controller::reconcile::clock::to_time(Timestamp::now()),
    );
    let bytes = serde_json::to_vec(&s.replicas).unwrap().len();
    assert!(bytes <= MAX_REPLICA_BYTES, "{bytes}");
    assert!(s.replicas.len() < 600 && !s.replicas.is_empty());
    assert_eq!(s.replica_count, 600);
    let c = find_condition(&s.conditions, "Complete").unwrap();
    assert_eq!(c.reason, "ReplicasTruncated");
}
