//! `ProbeT2Failed` through the CacheBackend reconciler (issue 19 item 2; spec 000
//! "Functional-probe gate"): the controller's in-process prober with the real tier-2 prober
//! against a real `redis-server` and LMCache's own server, driven by reconciles of a
//! CacheBackend on the bare real apiserver (`bare_apiserver_support`, through
//! `reconcile_support::Harness`: a namespace per test; the harness plays the Deployment
//! controller). A tier that breaks turns `FunctionalProbeOK` and `Ready` to
//! False/`ProbeT2Failed` with the tier's own error in the message; the next probe after it heals
//! turns both back; a transport-free in-process probe never reports `ProbeError`.
//!
//! One stand-in: cluster DNS. The reconciler publishes `status.endpoint` as the rendered
//! Service's name (`kv-redis.<namespace>.svc:6379`), which resolves only in a cluster, so the
//! prober under test is wrapped to dial the local server's address instead; everything else
//! (gate, stages, messages, conditions) is the product's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod reconcile_support;
mod t2_support;

use std::sync::Arc;

use futures::future::BoxFuture;
use ic_controller::probe::in_process_prober;
use ic_controller::reconcile::cachebackend::status::Settings;
use ic_controller::reconcile::Context;
use ic_controller::state::{LookupPolicy, Shared};
use ic_controller::t2probe::{ProviderT2Prober, T2Outcome, T2Prober};
use ic_shared::crd::{CacheBackend, CacheBackendStatus};
use reconcile_support::*;
use serde_json::json;
use t2_support::{LmCacheServer, Redis};

/// The real prober, dialling `addr` in place of the Service name in `status.endpoint`.
struct AtAddress {
    addr: String,
    inner: ProviderT2Prober,
}

impl T2Prober for AtAddress {
    fn probe<'a>(&'a self, cb: &'a CacheBackend, nonce: u64) -> BoxFuture<'a, T2Outcome> {
        Box::pin(async move {
            let mut cb = cb.clone();
            let st = cb.status.get_or_insert_with(Default::default);
            let published = st.endpoint.clone().unwrap_or_default();
            let scheme = published
                .split_once("://")
                .map(|(s, _)| format!("{s}://"))
                .unwrap_or_default();
            assert!(
                !published.is_empty(),
                "the reconciler published no endpoint"
            );
            st.endpoint = Some(format!("{scheme}{}", self.addr));
            self.inner.probe(&cb, nonce).await
        })
    }
}

/// A harness over `cb` whose reconciler runs the in-process prober with the real tier-2 stage
/// against `addr`; the backend's Deployment is Available and one engine pod published events.
async fn gate(cb: CacheBackend, deployment: &str, addr: String) -> Harness {
    let mut h = Harness::new(vec![cb], false).await;
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let prober = in_process_prober(
        shared,
        Some(Arc::new(AtAddress {
            addr,
            inner: ProviderT2Prober::default(),
        })),
    );
    h.ctx = Arc::new(
        Context::new(
            h.client.clone(),
            h.index.clone(),
            h.events.clone(),
            h.clock.clone(),
            h.leader.clone(),
        )
        .with_settings(Settings::default())
        .with_prober(prober),
    );
    h.add_pod(pod("engine-0", &[("app", "vllm")], &[])).await;
    h.reconcile("kv").await;
    h.settle_deployment(deployment, 1).await;
    h.index.set(vec![h.replica("engine-0", 5, h.now_ms())]);
    h
}

fn message(st: &CacheBackendStatus, ty: &str) -> String {
    cond(st, ty).unwrap().message.clone()
}

/// The status after the next probe window (31 s on) and a reconcile.
async fn after_the_next_probe(h: &Harness) -> CacheBackendStatus {
    h.advance(31);
    h.reconcile("kv").await;
    h.status("kv").await
}

/// Asserts the probe passed and `Ready` is the KV-event gate's.
fn assert_probe_ok(st: &CacheBackendStatus) {
    assert_eq!(sr(st, "FunctionalProbeOK"), is("True", "ProbeOK"));
    assert_eq!(sr(st, "Ready"), is("True", "KVEventsObserved"));
}

/// Asserts `FunctionalProbeOK` and `Ready` are False/ProbeT2Failed with the same message;
/// returns it.
fn assert_probe_t2_failed(st: &CacheBackendStatus) -> String {
    assert_eq!(sr(st, "FunctionalProbeOK"), is("False", "ProbeT2Failed"));
    assert_eq!(sr(st, "Ready"), is("False", "ProbeT2Failed"));
    let m = message(st, "FunctionalProbeOK");
    assert!(
        message(st, "Ready").contains(&m),
        "{}",
        message(st, "Ready")
    );
    m
}

#[tokio::test]
async fn a_redis_tier_that_refuses_writes_is_probe_t2_failed_until_it_heals() {
    let r = Redis::start();
    let h = gate(managed_redis("kv"), "kv-redis", r.endpoint()).await;
    h.reconcile("kv").await;
    assert_probe_ok(&h.status("kv").await);

    // Full and not allowed to evict: Redis answers OOM to the probe's SET.
    r.config_set("maxmemory-policy", "noeviction").await;
    r.config_set("maxmemory", "1").await;
    let m = assert_probe_t2_failed(&after_the_next_probe(&h).await);
    assert!(m.contains("put (SET)") && m.contains("OOM"), "{m}");

    r.config_set("maxmemory", "0").await;
    assert_probe_ok(&after_the_next_probe(&h).await);
}

#[tokio::test]
async fn an_lmcache_server_that_goes_away_is_probe_t2_failed_and_recovers_after_a_restart() {
    let srv = LmCacheServer::start();
    let cb = backend(
        "kv",
        json!({
            "runtime": "VLLM",
            "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"},
            "engineSelector": {"matchLabels": {"app": "vllm"}},
            "observation": {"modelID": "Qwen/Qwen3", "firstEventTimeout": "5m"}
        }),
    );
    let addr = srv.endpoint();
    let h = gate(cb, "kv-lmcache-server", addr.clone()).await;
    h.reconcile("kv").await;
    assert_probe_ok(&h.status("kv").await);

    drop(srv);
    let m = assert_probe_t2_failed(&after_the_next_probe(&h).await);
    assert!(
        m.contains("LMCache server") && m.contains(&addr) && m.contains("connection"),
        "{m}"
    );

    // Rate-limited reconcile inside the window: the failure is re-applied, not lost.
    h.advance(5);
    h.reconcile("kv").await;
    assert_eq!(
        sr(&h.status("kv").await, "Ready"),
        is("False", "ProbeT2Failed")
    );

    // Restarted (empty: the server keeps nothing across restarts): the next probe passes.
    let _srv = LmCacheServer::start_on(srv_port(&addr));
    assert_probe_ok(&after_the_next_probe(&h).await);
}

fn srv_port(addr: &str) -> u16 {
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}
