//! The functional probe's tier-2 stage against a real `redis-server` (issue 19 item 2; spec 000
//! "Functional-probe gate" Stage C): a put / get / delete through the managed Redis tier,
//! failing with Redis's own error when the tier refuses writes or is gone, skipped with a
//! reason for tiers the controller has no client for. CI installs `redis-server` (.ci/run).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ic_controller::probe::in_process_prober;
use ic_controller::reconcile::cachebackend::probe::{ProbeOutcome, StageResult};
use ic_controller::state::{LookupPolicy, Shared};
use ic_controller::t2probe::{
    redis_round_trip, ProviderT2Prober, T2Outcome, T2ProbeConfig, T2Prober,
};
use ic_shared::crd::CacheBackend;

struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start() -> Redis {
        Redis::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Redis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server; .ci/run does)");
        let r = Redis { child, port };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return r;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not listen on {port}");
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn config_set(&self, key: &str, value: &str) {
        let client = redis::Client::open(format!("redis://{}/", self.endpoint())).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(key)
            .arg(value)
            .query_async(&mut c)
            .await
            .unwrap();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn managed(provider: &str, endpoint: &str) -> CacheBackend {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "kv", "namespace": "ml"},
        "spec": {"runtime": "VLLM", "remoteStorage": {"provider": provider, "ownership": "Managed"}},
        "status": {"endpoint": endpoint}
    }))
    .unwrap()
}

fn prober() -> ProviderT2Prober {
    ProviderT2Prober::new(T2ProbeConfig {
        timeout: Duration::from_secs(2),
    })
}

#[tokio::test]
async fn a_working_redis_tier_round_trips_and_keeps_nothing() {
    let r = Redis::start();
    let cb = managed("Redis", &r.endpoint());
    match prober().probe(&cb, 7).await {
        T2Outcome::Ok(m) => assert!(m.contains(&r.endpoint()), "{m}"),
        other => panic!("{other:?}"),
    }
    // The probe key is gone again.
    let client = redis::Client::open(format!("redis://{}/", r.endpoint())).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let n: i64 = redis::cmd("DBSIZE").query_async(&mut c).await.unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn a_redis_that_refuses_writes_fails_with_its_own_error() {
    let r = Redis::start();
    // A tier too small for anything, that may not evict: Redis answers OOM to every write.
    r.config_set("maxmemory-policy", "noeviction").await;
    r.config_set("maxmemory", "1").await;
    match prober().probe(&managed("Redis", &r.endpoint()), 1).await {
        T2Outcome::Failed(m) => {
            assert!(m.contains("put (SET)") && m.contains("OOM"), "{m}")
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_redis_that_is_gone_fails_and_the_gate_publishes_the_stage_failure() {
    let r = Redis::start();
    let endpoint = r.endpoint();
    drop(r);
    let cb = managed("Redis", &endpoint);
    match prober().probe(&cb, 2).await {
        T2Outcome::Failed(m) => assert!(m.contains("connection"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Through the gate's in-process prober: ingest and routing pass, t2 fails with the message
    // the gate turns into FunctionalProbeOK=False/ProbeT2Failed.
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let gate = in_process_prober(shared.clone(), Some(Arc::new(prober())));
    match gate.probe(&cb).await {
        ProbeOutcome::Completed(s) => {
            assert_eq!((s.ingest, s.routing), (StageResult::Ok, StageResult::Ok));
            match s.t2 {
                StageResult::Failed(m) => assert!(m.contains(&endpoint), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        shared.index.read().replica_count(),
        0,
        "the probe stream is removed"
    );
}

#[tokio::test]
async fn tiers_without_a_client_are_skipped_with_the_reason() {
    for (provider, endpoint, want) in [
        ("LMCacheServer", "lm://kv-lmcache.ml.svc:65432", "lm://"),
        (
            "Mooncake",
            "mooncakestore://kv-mooncake.ml.svc:50051",
            "transfer engine",
        ),
    ] {
        match prober().probe(&managed(provider, endpoint), 3).await {
            T2Outcome::Skipped(m) => assert!(m.contains(want), "{provider}: {m}"),
            other => panic!("{provider}: {other:?}"),
        }
    }
    let no_endpoint = managed("Redis", "");
    assert!(matches!(
        prober().probe(&no_endpoint, 4).await,
        T2Outcome::Skipped(_)
    ));
}

/// A tier slower than the library's own defaults (500 ms response) but within the probe's 2 s
/// is not a failure: a Redis busy for 700 ms (a fork for BGSAVE, an AOF rewrite) still passes.
#[tokio::test]
async fn a_slow_but_working_tier_passes_within_the_configured_timeout() {
    let r = Redis::start_with(&["--enable-debug-command", "yes"]);
    let endpoint = r.endpoint();
    let busy = {
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let client = redis::Client::open(format!("redis://{endpoint}/")).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            let _: redis::RedisResult<()> = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("0.7")
                .query_async(&mut c)
                .await;
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    let got = prober().probe(&managed("Redis", &endpoint), 9).await;
    assert!(matches!(got, T2Outcome::Ok(_)), "{got:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the tier was not busy"
    );
    let _ = busy.await;
}

/// A server that accepts and never answers: each step is bounded by the timeout.
#[tokio::test]
async fn a_tier_that_hangs_is_bounded_by_the_timeout() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let _keep = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    // 1.5 s: longer than the client library's own connect / response defaults (1 s / 500 ms),
    // so an early failure would show they still applied.
    let started = std::time::Instant::now();
    let err = redis_round_trip(&addr.to_string(), "k", "v", Duration::from_millis(1500))
        .await
        .unwrap_err();
    assert!(
        err.contains("connection") && (err.contains("did not answer") || err.contains("timed out")),
        "{err}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        started.elapsed()
    );
}
