//! SGLang HiCache host-tier readiness end to end on the controller side (issue 19 item 4,
//! condition `HiCacheHostTier`; `docs/kv-events.md` "SGLang HiCache readiness"): a node agent
//! over real loopback gRPC reports its SGLang streams' host-tier counters (`CounterReport`,
//! `StreamCounters.host_tier_*`), and a CacheBackend reconcile of an `(SGLang, SGLangHiCache)`
//! backend over the controller's real in-process state publishes the advisory condition. The
//! CacheBackend and the engine pods live on the bare real apiserver (`bare_apiserver_support`,
//! through `reconcile_support::Harness`: a namespace per test); the reconciler is called
//! directly.
//!
//! The numbers are what the agent reads from SGLang 0.5.23's own `/metrics` pages
//! (`testdata/metrics/sglang-0.5.23-{idle,written,roundtrip}.metrics`, parsed in
//! `agent/src/engine_metrics/prom.rs` and `agent/tests/sglang_metrics.rs`): idle 0 / 0, written
//! 3072 / 0, round trip 3072 / 2048 (tokens written to / served from the host tier).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod agent_stream_support;
mod reconcile_support;

use std::sync::Arc;

use agent_stream_support::*;
use ic_controller::reconcile::Context;
use ic_controller::state::{LookupPolicy, Shared};
use ic_shared::proto::{agent_message::Msg, AgentMessage, CounterReport, StreamCounters};
use k8s_openapi::api::core::v1::Pod;
use reconcile_support::*;
use serde_json::json;

const HICACHE: &str = "HiCacheHostTier";
const HINT: &str = "SGLang exposes its host-tier counters only with --enable-metrics (checked \
                    in 0.5.23); add it to the engine to get this condition";

/// An SGLang engine pod with HiCache and metrics on (labels `app=sglang`).
fn sglang_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                     "labels": {"app": "sglang"}},
        "spec": {"containers": [{"name": "sglang", "image": "lmsysorg/sglang:v0.5.23",
            "command": ["python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B",
                        "--host", "0.0.0.0", "--enable-metrics", "--enable-hierarchical-cache",
                        "--hicache-ratio", "2.0",
                        "--kv-events-config", "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}"]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7"},
    }))
    .unwrap()
}

/// The SGLang engines of `hc` in namespace `ns` (64-token pages).
fn engines(ns: &str) -> Engines {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    Engines {
        namespace: leak(ns.to_string()),
        model: "Qwen/Qwen3-8B",
        hash_scheme: "sglang",
        backend: leak(format!("{ns}/hc")),
        block_size: 64,
        key_base: 0x5a00,
    }
}

/// A report of `(pod, host-tier pair)`: `None` is what the agent sends when SGLang exports no
/// host tier or its last scrape failed.
fn host(e: &Engines, c: &[(&str, Option<(u64, u64)>)]) -> AgentMessage {
    AgentMessage {
        msg: Some(Msg::Counters(CounterReport {
            streams: c
                .iter()
                .map(|(pod, h)| StreamCounters {
                    stream: Some(e.descriptor(pod)),
                    t2_absent: true,
                    host_tier_written_tokens: h.map(|h| h.0),
                    host_tier_served_tokens: h.map(|h| h.1),
                    observed_at_unix_ms: 1,
                    ..Default::default()
                })
                .collect(),
        })),
    }
}

/// Sends a host-tier report of `e`'s engines and waits until the controller holds exactly those
/// readings.
async fn report(
    e: &Engines,
    agent: &AgentStream,
    shared: &Shared,
    c: &[(&str, Option<(u64, u64)>)],
) {
    agent.tx.send(host(e, c)).await.unwrap();
    until("the readings", || {
        let held = shared.host_tier.read();
        c.iter().all(|(pod, h)| {
            held.get(&format!("{}/{pod}#0", e.namespace))
                .map(|r| (r.written_tokens, r.served_tokens))
                == *h
        })
    })
    .await;
}

/// `(status, reason, message, lastTransitionTime)` of HiCacheHostTier after a reconcile 30 s on.
async fn host_tier(h: &Harness) -> (String, String, String, String) {
    h.advance(30);
    h.reconcile("hc").await;
    let st = h.status("hc").await;
    for absent in ["Ready", "Degraded", "Progressing", "T2Degraded"] {
        assert!(
            cond(&st, absent).is_none(),
            "the HiCache path publishes no {absent}"
        );
    }
    let c = cond(&st, HICACHE).expect("HiCacheHostTier is published");
    (
        c.status.clone(),
        c.reason.clone(),
        c.message.clone(),
        c.last_transition_time.0.to_string(),
    )
}

fn hicache() -> ic_shared::crd::CacheBackend {
    backend(
        "hc",
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2.0"},
               "engineSelector": {"matchLabels": {"app": "sglang"}},
               "observation": {"modelID": "Qwen/Qwen3-8B"}}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_tier_condition_follows_current_readings_only() {
    let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
    let grpc = serve_ingest(shared.clone()).await;
    let mut h = Harness::new(vec![hicache()], false).await;
    h.ctx = Arc::new(Context::new(
        h.client.clone(),
        shared.clone(),
        h.events.clone(),
        h.clock.clone(),
        h.leader.clone(),
    ));
    for p in ["sglang-0", "sglang-1"] {
        h.add_pod(sglang_pod(p)).await;
    }
    let e = engines(&h.ns);

    // No agent yet: no stream, no reading.
    let (s, r, m, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str()),
        ("Unknown", "HostTierSignalUnavailable")
    );
    assert!(m.starts_with(HINT), "{m}");
    assert!(m.contains("sglang-0: no KV-event stream"), "{m}");

    // The agent follows both engines; SGLang exports no host tier yet (HiCache gauge not logged,
    // or metrics without it): still no signal, and it says so per pod.
    let agent = connect(
        &grpc,
        "gpu-1",
        e.resync(&["sglang-0", "sglang-1"], h.now_ms()),
    )
    .await;
    until("the resync", || shared.index.read().replica_count() == 2).await;
    report(
        &e,
        &agent,
        &shared,
        &[("sglang-0", None), ("sglang-1", None)],
    )
    .await;
    let (s, r, m, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str()),
        ("Unknown", "HostTierSignalUnavailable")
    );
    assert_eq!(
        m,
        format!(
            "{HINT} (no current host-tier reading from sglang-0: no host-tier counters on its \
             /metrics, sglang-1: no host-tier counters on its /metrics)."
        )
    );

    // The idle page: the host tier is there, nothing written or served.
    report(&e, &agent, &shared, &[("sglang-0", Some((0, 0)))]).await;
    let (s, r, m, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str(), m.as_str()),
        (
            "Unknown",
            "HostTierNotExercised",
            "no host-tier write and read observed yet (0 tokens written, 0 served)"
        )
    );

    // The written page: backups, every hit from the GPU — a write is no round trip.
    report(&e, &agent, &shared, &[("sglang-0", Some((3072, 0)))]).await;
    let (s, r, m, unknown_since) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str(), m.as_str()),
        (
            "Unknown",
            "HostTierNotExercised",
            "no host-tier write and read observed yet (3072 tokens written, 0 served)"
        )
    );

    // The round-trip page.
    report(&e, &agent, &shared, &[("sglang-0", Some((3072, 2048)))]).await;
    let (s, r, m, true_since) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str(), m.as_str()),
        (
            "True",
            "HostTierRoundTrip",
            "sglang-0: 3072 tokens written to and 2048 served from the host tier"
        )
    );
    assert_ne!(
        true_since, unknown_since,
        "a transition moves lastTransitionTime"
    );
    assert!(
        h.events
            .events()
            .iter()
            .all(|e| !e.event.reason.contains("HostTier")),
        "no Event, as T2Degraded"
    );

    // The engine restarts: the agent's scrape fails and it drops the pair — Unknown, not True.
    report(&e, &agent, &shared, &[("sglang-0", None)]).await;
    let (s, r, _, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str()),
        ("Unknown", "HostTierSignalUnavailable")
    );
    // The restarted engine counts from 0.
    report(&e, &agent, &shared, &[("sglang-0", Some((0, 0)))]).await;
    let (s, r, _, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str()),
        ("Unknown", "HostTierNotExercised")
    );

    // A round trip again; then the agent goes away: no reading outlives its connection.
    report(&e, &agent, &shared, &[("sglang-0", Some((3072, 2048)))]).await;
    assert_eq!(host_tier(&h).await.1, "HostTierRoundTrip");
    drop(agent);
    until("the disconnect", || shared.host_tier.read().is_empty()).await;
    let (s, r, m, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str()),
        ("Unknown", "HostTierSignalUnavailable")
    );
    assert!(
        m.contains("sglang-0: its node agent is disconnected"),
        "{m}"
    );

    // The agent comes back: its resync alone brings nothing back; its next report does.
    let agent = connect(
        &grpc,
        "gpu-1",
        e.resync(&["sglang-0", "sglang-1"], h.now_ms()),
    )
    .await;
    until("the second resync", || {
        shared
            .index
            .read()
            .snapshot()
            .replicas
            .iter()
            .all(|r| r.coverage_reason != Some(ic_shared::kv::coverage::AGENT_DISCONNECTED))
    })
    .await;
    assert_eq!(host_tier(&h).await.1, "HostTierSignalUnavailable");
    report(
        &e,
        &agent,
        &shared,
        &[
            ("sglang-0", Some((3072, 2048))),
            ("sglang-1", Some((64, 0))),
        ],
    )
    .await;
    assert_eq!(host_tier(&h).await.1, "HostTierRoundTrip");

    // A resync (asked for by the controller, or the agent's own) resets the readings until
    // the agent resends them.
    agent
        .tx
        .send(e.resync(&["sglang-0", "sglang-1"], h.now_ms()))
        .await
        .unwrap();
    until("the reset", || shared.host_tier.read().is_empty()).await;
    assert_eq!(host_tier(&h).await.1, "HostTierSignalUnavailable");
    report(&e, &agent, &shared, &[("sglang-0", Some((3072, 2048)))]).await;
    assert_eq!(host_tier(&h).await.1, "HostTierRoundTrip");

    // The pod that did the round trip is deleted: its reading no longer counts.
    h.delete_pod("sglang-0").await;
    let (s, r, m, _) = host_tier(&h).await;
    assert_eq!(
        (s.as_str(), r.as_str()),
        ("Unknown", "HostTierSignalUnavailable")
    );
    assert!(
        m.contains("sglang-1: no host-tier counters on its /metrics"),
        "{m}"
    );

    // Switched to events-only (no host tier wired): the condition goes.
    h.patch_cb(
        "hc",
        json!({"spec": {"integration": {"mode": "EventsOnly"}}}),
    )
    .await;
    h.advance(30);
    h.reconcile("hc").await;
    assert!(cond(&h.status("hc").await, HICACHE).is_none());
}
