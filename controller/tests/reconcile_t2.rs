//! Tier-2 counters end to end on the controller side (spec 000 `indexParticipation.t2HitRate`,
//! condition `T2Degraded`): an agent stream over real loopback gRPC reports its streams'
//! engine counters (`CounterReport`), `/snapshot` shows them as `t2Hits` / `t2Queries`, and a
//! CacheBackend reconcile over the real in-process index publishes the query-weighted
//! `t2HitRate`, `T2Degraded`, and the `inferencecache_backend_t2_hit_rate` gauge on the
//! controller's `/metrics`. The CacheBackend, its children and the engine pods live on the bare
//! real apiserver (`bare_apiserver_support`, through `reconcile_support::Harness`: a namespace
//! per test); the reconciler is called directly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod agent_stream_support;
mod http_support;
mod reconcile_support;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use agent_stream_support::*;
use http_support::http_get;
use ic_controller::http::{router, HttpState};
use ic_controller::reconcile::Context;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::proto::{agent_message::Msg, AgentMessage, CounterReport, StreamCounters};
use reconcile_support::*;

/// A controller's gRPC ingest and HTTP endpoints on loopback; returns (gRPC URL, HTTP address).
async fn serve(shared: Arc<Shared>) -> (String, String) {
    let grpc = serve_ingest(shared.clone()).await;
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = http.local_addr().unwrap();
    let app = router(HttpState {
        shared,
        ready: Arc::new(AtomicBool::new(true)),
        access: None,
    });
    tokio::spawn(async move { axum::serve(http, app).await });
    (grpc, http_addr.to_string())
}

/// The vLLM engines of `kv` in namespace `ns` (16-token blocks).
fn engines(ns: &str) -> Engines {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    Engines {
        namespace: leak(ns.to_string()),
        model: "m",
        hash_scheme: "vllm",
        backend: leak(format!("{ns}/kv")),
        block_size: 16,
        key_base: 0xabc0,
    }
}

fn counters(e: &Engines, c: &[(&str, u64, u64)]) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Counters(CounterReport {
            streams: c
                .iter()
                .map(|(pod, hits, queries)| StreamCounters {
                    stream: Some(e.descriptor(pod)),
                    t2_hits: *hits,
                    t2_queries: *queries,
                    observed_at_unix_ms: 1,
                    ..Default::default()
                })
                .collect(),
        })),
    }
}

/// `(t2Hits, t2Queries)` of `stream` in the `/snapshot` JSON.
fn snapshot_t2(http: &str, stream: &str) -> Option<(Option<u64>, Option<u64>)> {
    let doc: serde_json::Value = serde_json::from_str(&http_get(http, "/snapshot")).unwrap();
    doc["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["streamId"] == stream)
        .map(|r| (r["t2Hits"].as_u64(), r["t2Queries"].as_u64()))
}

fn gauge_line(http: &str) -> Option<String> {
    http_get(http, "/metrics")
        .lines()
        .find(|l| l.starts_with("inferencecache_backend_t2_hit_rate{"))
        .map(str::to_string)
}

/// A controller's index, HTTP and agent gRPC on loopback; the CacheBackend reconciler over
/// that index with one Ready managed-Redis backend `kv` and engine pods `engine-0`/`engine-1`;
/// and a node agent that said Hello and resynced both engines' streams.
struct Setup {
    shared: Arc<Shared>,
    http: String,
    h: Harness,
    agent: AgentStream,
    engines: Engines,
}

async fn setup() -> Setup {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let (grpc, http) = serve(shared.clone()).await;

    // The CacheBackend reconciler over the real in-process index.
    let mut h = Harness::new(vec![managed_redis("kv")], false).await;
    h.ctx = Arc::new(Context::new(
        h.client.clone(),
        shared.clone(),
        h.events.clone(),
        h.clock.clone(),
        h.leader.clone(),
    ));
    for p in ["engine-0", "engine-1"] {
        h.add_pod(pod(p, &[("app", "vllm")], &[])).await;
    }
    h.reconcile("kv").await;
    h.settle_deployment("kv-redis", 1).await;

    // A node agent: Hello, Resync of its two engine streams.
    let engines = engines(&h.ns);
    let agent = connect(
        &grpc,
        "gpu-1",
        engines.resync(&["engine-0", "engine-1"], h.now_ms()),
    )
    .await;
    until("the resync", || shared.index.read().replica_count() == 2).await;
    Setup {
        shared,
        http,
        h,
        agent,
        engines,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reported_counters_reach_snapshot_status_conditions_and_the_gauge() {
    let Setup {
        http,
        h,
        agent,
        engines,
        ..
    } = setup().await;
    let tx = agent.tx.clone();
    let stream = |pod: &str| format!("{}/{pod}#0", h.ns);
    let gauge = |rate: &str| {
        format!(
            r#"inferencecache_backend_t2_hit_rate{{backend="{}"}} {rate}"#,
            h.key("kv")
        )
    };

    // Before any counters: tier 2 not exercised — no t2HitRate, no T2Degraded, no gauge series.
    assert_eq!(
        snapshot_t2(&http, &stream("engine-0")),
        Some((None, None)),
        "absent, never 0"
    );
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(sr(&st, "Ready"), is("True", "KVEventsObserved"));
    assert!(st
        .index_participation
        .as_ref()
        .unwrap()
        .t2_hit_rate
        .is_none());
    assert!(sr(&st, "T2Degraded").is_none());
    assert_eq!(gauge_line(&http), None);

    // Counters: 20 of 60 and 5 of 40 → query-weighted 25 / 100.
    tx.send(counters(
        &engines,
        &[("engine-0", 20, 60), ("engine-1", 5, 40)],
    ))
    .await
    .unwrap();
    until("the counters in /snapshot", || {
        snapshot_t2(&http, &stream("engine-1")) == Some((Some(5), Some(40)))
    })
    .await;
    assert_eq!(
        snapshot_t2(&http, &stream("engine-0")),
        Some((Some(20), Some(60)))
    );
    h.advance(30);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(
        st.index_participation
            .as_ref()
            .unwrap()
            .t2_hit_rate
            .as_deref(),
        Some("0.25")
    );
    assert_eq!(sr(&st, "T2Degraded"), is("False", "T2Serving"));
    assert_eq!(gauge_line(&http).as_deref(), Some(gauge("0.25").as_str()));
    assert_eq!(
        h.ctx.metrics().unwrap().t2_hit_rate(&h.key("kv")),
        Some(0.25)
    );

    // A tier that is queried but never hits (the engines restarted, the store is broken).
    tx.send(counters(
        &engines,
        &[("engine-0", 0, 80), ("engine-1", 0, 20)],
    ))
    .await
    .unwrap();
    until("the zero-hit counters", || {
        snapshot_t2(&http, &stream("engine-1")) == Some((Some(0), Some(20)))
    })
    .await;
    h.advance(30);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(
        st.index_participation
            .as_ref()
            .unwrap()
            .t2_hit_rate
            .as_deref(),
        Some("0")
    );
    assert_eq!(sr(&st, "T2Degraded"), is("True", "T2ZeroHitRate"));
    assert_eq!(
        sr(&st, "Ready"),
        is("True", "KVEventsObserved"),
        "never gates Ready"
    );
    assert_eq!(gauge_line(&http).as_deref(), Some(gauge("0").as_str()));

    // A resync resets the index's counters until the agent resends them: the status keeps its
    // last rate (presence is load-bearing; it never falls back to "not exercised").
    tx.send(engines.resync(&["engine-0", "engine-1"], h.now_ms()))
        .await
        .unwrap();
    until("the reset", || {
        snapshot_t2(&http, &stream("engine-0")) == Some((None, None))
    })
    .await;
    h.advance(30);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert_eq!(
        st.index_participation
            .as_ref()
            .unwrap()
            .t2_hit_rate
            .as_deref(),
        Some("0")
    );
    assert_eq!(sr(&st, "T2Degraded"), is("True", "T2ZeroHitRate"));

    // The backend is deleted: its gauge series goes.
    h.api::<ic_shared::crd::CacheBackend>()
        .delete("kv", &Default::default())
        .await
        .unwrap();
    h.reconcile("kv").await;
    assert_eq!(gauge_line(&http), None);
}

/// Issue 19 item 3: `indexParticipation.hitRate` — the engines' prefix-cache hit rate,
/// query-weighted over the backend's replicas, from what the agent sends (`StreamCounters` with
/// `prefix_cache_{hits,queries}` and no tier-2 readings: `t2_absent`). Unset until reported;
/// tier 2 stays "not exercised".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_counters_set_the_backends_hit_rate() {
    let Setup {
        shared,
        h,
        agent,
        engines,
        ..
    } = setup().await;
    let tx = agent.tx.clone();
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    assert!(st.index_participation.as_ref().unwrap().hit_rate.is_none());

    // engine-0: 900 of 1000 tokens hit; engine-1: 0 of 3000 → (900 + 0) / 4000.
    let report = AgentMessage {
        msg: Some(Msg::Counters(CounterReport {
            streams: [("engine-0", 900, 1000), ("engine-1", 0, 3000)]
                .iter()
                .map(|(pod, hits, queries)| StreamCounters {
                    stream: Some(engines.descriptor(pod)),
                    t2_absent: true,
                    prefix_cache_hits: Some(*hits),
                    prefix_cache_queries: Some(*queries),
                    observed_at_unix_ms: 1,
                    ..Default::default()
                })
                .collect(),
        })),
    };
    tx.send(report).await.unwrap();
    until("the prefix-cache counters", || {
        shared
            .index
            .read()
            .snapshot()
            .replicas
            .iter()
            .all(|r| r.prefix_cache_queries.is_some())
    })
    .await;
    h.advance(30);
    h.reconcile("kv").await;
    let st = h.status("kv").await;
    let ip = st.index_participation.as_ref().unwrap();
    assert_eq!(ip.hit_rate.as_deref(), Some("0.225"));
    assert!(ip.t2_hit_rate.is_none(), "t2_absent is not a zero reading");
    assert!(sr(&st, "T2Degraded").is_none());
}
