//! Tier-2 counters from an engine's `/metrics` to the controller stream: a running agent
//! (`runtime::start_with`) whose plan names a vLLM engine with two data-parallel ranks and its
//! `metricsUrl`, a loopback HTTP server serving a real-format vLLM `/metrics` page
//! (`tests/data/vllm-dp2.metrics`: HELP/TYPE lines, `engine` and `model_name` labels), and a
//! stand-in controller that records what arrives. Absent counters send nothing; present ones
//! arrive per stream (each rank its engine's series), again after every resync, and whenever
//! they change; the scrapes are counted by outcome.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::{http_get, start_scraping_agent, Page, ScrapingAgent};

use std::sync::Arc;
use std::time::Duration;

use ic_shared::plan::{EnginePlan, KvEventSource, NodePlan};
use ic_shared::proto::{agent_message::Msg, controller_message, AgentMessage, ResyncRequest};
use parking_lot::Mutex;
use tokio::sync::mpsc;

const VLLM_DP2: &str = include_str!("data/vllm-dp2.metrics");

fn plan(metrics_url: String) -> NodePlan {
    // Nothing listens on the KV-event endpoints: the SUB sockets keep retrying, which does not
    // matter here.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    NodePlan {
        engines: vec![EnginePlan {
            namespace: "team-a".into(),
            pod: "vllm-0".into(),
            model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            keeps_l2: true,
            backend: "team-a/cb".into(),
            kv_events: (0..2)
                .map(|rank| KvEventSource {
                    endpoint: format!("tcp://127.0.0.1:{}", port + rank as u16),
                    dp_rank: rank,
                    ..Default::default()
                })
                .collect(),
            metrics_url: Some(metrics_url),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The next `CounterReport` as (stream id, replica, hits, queries), skipping other messages;
/// also returns the kinds of the messages skipped on the way.
async fn next_counters(
    rx: &mut mpsc::UnboundedReceiver<AgentMessage>,
    what: &str,
) -> (Vec<(String, String, u64, u64)>, Vec<&'static str>) {
    let mut skipped = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap();
        match m.msg {
            Some(Msg::Counters(r)) => {
                let got = r
                    .streams
                    .into_iter()
                    .map(|c| {
                        let d = c.stream.unwrap();
                        assert!(c.observed_at_unix_ms > 0);
                        (d.stream_id, d.replica, c.t2_hits, c.t2_queries)
                    })
                    .collect();
                return (got, skipped);
            }
            Some(Msg::Hello(_)) => skipped.push("hello"),
            Some(Msg::Resync(_)) | Some(Msg::ResyncChunk(_)) => skipped.push("resync"),
            Some(Msg::Checks(_)) => skipped.push("checks"),
            Some(Msg::KvDeltas(_)) => skipped.push("deltas"),
            Some(Msg::Heartbeat(_)) => skipped.push("heartbeat"),
            None => skipped.push("empty"),
        }
    }
}

fn expected(hits1: u64) -> Vec<(String, String, u64, u64)> {
    vec![
        ("team-a/vllm-0#0".into(), "vllm-0".into(), 10240, 40960),
        ("team-a/vllm-0#1".into(), "vllm-0#1".into(), hits1, 12288),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_counters_reach_the_controller_per_stream_after_every_resync_and_on_change() {
    // First the engine exports no tier-2 counters (no KV connector traffic yet).
    let page: Page = Arc::new(Mutex::new(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n"
            .to_string(),
    ));
    let ScrapingAgent {
        state,
        agent,
        fake,
        mut received,
    } = start_scraping_agent(&page, plan).await;

    // Absent counters are never sent (tier 2 "not exercised" must not read as 0).
    for _ in 0..200 {
        if state.engine_counters.scrapes("absent") >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(state.engine_counters.scrapes("absent") >= 3);
    while let Ok(m) = received.try_recv() {
        assert!(
            !matches!(m.msg, Some(Msg::Counters(_))),
            "no counters while the engine exports none"
        );
    }

    // The real page: each rank gets its engine's series.
    *page.lock() = VLLM_DP2.to_string();
    let (got, _) = next_counters(&mut received, "the first counters").await;
    assert_eq!(got, expected(0));

    // The controller asks for a resync: the counters follow it (a Resync resets them there).
    fake.send(controller_message::Msg::ResyncRequest(ResyncRequest {
        reason: "test".into(),
    }))
    .await;
    let (got, skipped) = next_counters(&mut received, "counters after the resync").await;
    assert_eq!(got, expected(0));
    assert_eq!(skipped.last(), Some(&"resync"), "{skipped:?}");

    // Rank 1's engine starts hitting: a new report.
    *page.lock() = VLLM_DP2.replace(
        "vllm:external_prefix_cache_hits_total{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0",
        "vllm:external_prefix_cache_hits_total{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 4096.0",
    );
    let (got, _) = next_counters(&mut received, "the changed counters").await;
    assert_eq!(got, expected(4096));

    // Unchanged values are not resent on every scrape.
    let before = state.engine_counters.scrapes("ok");
    while state.engine_counters.scrapes("ok") < before + 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while let Ok(m) = received.try_recv() {
        assert!(
            !matches!(m.msg, Some(Msg::Counters(_))),
            "resent unchanged counters"
        );
    }

    // The agent's own /metrics counts the scrapes by outcome; /v1/report shows the counters.
    let metrics = http_get(&agent.http_addr.to_string(), "/metrics");
    assert!(
        metrics.lines().any(|l| l
            .starts_with("inferencecache_agent_engine_metrics_scrapes_total{outcome=\"absent\"}")),
        "{metrics}"
    );
    assert!(metrics.contains("inferencecache_agent_engine_metrics_scrapes_total{outcome=\"ok\"}"));
    let report = http_get(&agent.http_addr.to_string(), "/v1/report");
    let doc: serde_json::Value =
        serde_json::from_str(report.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(doc["engineCounters"][1]["streamId"], "team-a/vllm-0#1");
    assert_eq!(doc["engineCounters"][1]["t2Hits"], 4096);
    agent.abort();
}
