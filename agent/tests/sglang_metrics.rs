//! SGLang HiCache host-tier counters (issue 19 item 4) from SGLang's own `/metrics` pages to the
//! controller stream.
//!
//! The pages (`testdata/metrics/sglang-0.5.23-*.metrics`) are rendered by SGLang 0.5.23's own metrics
//! collectors (`scripts/sglang-metrics-page.py`); the first test renders them again from the
//! wheel (`scripts/fetch-sglang.sh`, which `scripts/setup.sh` runs) and requires the same samples, so
//! the committed pages stay what SGLang serves. The second runs an agent whose plan names an
//! SGLang engine, serves the pages in turn on a loopback `/metrics` and records what reaches a
//! stand-in controller: nothing while the engine exports no host tier, then each change of the
//! written / served tokens, including an engine restart that counts from 0 again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::{http_get, start_scraping_agent, Page, ScrapingAgent};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan};
use ic_shared::proto::{agent_message::Msg, AgentMessage};
use parking_lot::Mutex;
use tokio::sync::mpsc;

const SCENARIOS: [&str; 5] = ["roundtrip", "written", "idle", "no-hicache", "dp2"];

fn sglang_page(scenario: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../testdata/metrics/sglang-0.5.23-{scenario}.metrics"
    ));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A page's samples and HELP/TYPE lines, sorted, with the values of SGLang's per-process `pid`
/// label blanked: what two renders of one scenario share (the multiprocess collector orders
/// families by directory order, and process ids differ).
fn normalized(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text
        .lines()
        .filter(|l| {
            !l.is_empty()
                && (!l.starts_with('#') || l.starts_with("# HELP") || l.starts_with("# TYPE"))
        })
        .map(|l| {
            let mut out = String::with_capacity(l.len());
            let mut rest = l;
            while let Some(i) = rest.find("pid=\"") {
                out.push_str(&rest[..i + 5]);
                rest = &rest[i + 5..];
                let end = rest.find('"').unwrap_or(rest.len());
                out.push('_');
                rest = &rest[end..];
            }
            out.push_str(rest);
            out
        })
        .collect();
    lines.sort();
    lines
}

/// Where `scripts/fetch-sglang.sh` put the wheel's files and its venv.
fn sglang_dir() -> PathBuf {
    let base = std::env::var_os("IC_SGLANG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ci-cache/sglang")
        });
    assert!(
        base.join("0.5.23/sglang/srt/observability/metrics_collector.py")
            .is_file()
            && base.join("venv/bin/python").is_file(),
        "SGLang 0.5.23 metrics files not found under {}: run scripts/setup.sh \
         (or scripts/fetch-sglang.sh) or set IC_SGLANG_DIR",
        base.display()
    );
    base
}

#[test]
fn the_committed_pages_are_what_sglang_s_own_collectors_render() {
    let dir = sglang_dir();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/sglang-metrics-page.py");
    for scenario in SCENARIOS {
        let out = std::process::Command::new(dir.join("venv/bin/python"))
            .arg(&script)
            .arg(dir.join("0.5.23"))
            .arg(scenario)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{scenario}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let fresh = String::from_utf8(out.stdout).unwrap();
        let committed = sglang_page(scenario);
        assert!(committed.starts_with(&format!("# SGLang 0.5.23 /metrics, scenario {scenario}:")));
        let (a, b) = (normalized(&fresh), normalized(&committed));
        assert!(a.len() > 50, "{scenario}: only {} lines rendered", a.len());
        assert_eq!(
            a, b,
            "{scenario}: re-render differs from testdata/metrics; regenerate it"
        );
    }
}

fn plan(metrics_url: String, ranks: u32) -> NodePlan {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    NodePlan {
        engines: vec![EnginePlan {
            namespace: "team-a".into(),
            pod: "sglang-0".into(),
            model: "Qwen/Qwen3-8B".into(),
            hash_scheme: HashScheme::Sglang,
            keeps_l2: true,
            backend: "team-a/hicache".into(),
            kv_events: (0..ranks)
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

/// (stream id, written, served) of each stream of a report.
type HostRow = (String, Option<u64>, Option<u64>);

/// The next `CounterReport`'s host-tier fields, skipping other messages.
async fn next_host(rx: &mut mpsc::UnboundedReceiver<AgentMessage>, what: &str) -> Vec<HostRow> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap();
        if let Some(Msg::Counters(r)) = m.msg {
            return r
                .streams
                .into_iter()
                .map(|c| {
                    // SGLang exports no vLLM tier-2 counters: never read as 0.
                    assert!(c.t2_absent, "{c:?}");
                    assert_eq!((c.prefix_cache_hits, c.cache_memory_bytes), (None, None));
                    (
                        c.stream.unwrap().stream_id,
                        c.host_tier_written_tokens,
                        c.host_tier_served_tokens,
                    )
                })
                .collect();
        }
    }
}

fn row(written: Option<u64>, served: Option<u64>) -> Vec<HostRow> {
    vec![("team-a/sglang-0#0".to_string(), written, served)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_tier_counters_reach_the_controller_and_absent_stays_absent() {
    // First SGLang serves metrics without a host tier (HiCache off): nothing to report.
    let page: Page = Arc::new(Mutex::new(sglang_page("no-hicache")));
    let ScrapingAgent {
        state,
        agent,
        mut received,
        ..
    } = start_scraping_agent(&page, |url| plan(url, 1)).await;
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
            "no counters while the engine exports no host tier"
        );
    }

    // HiCache on, no traffic yet: the host tier is there, its counters read 0.
    *page.lock() = sglang_page("idle");
    assert_eq!(
        next_host(&mut received, "idle").await,
        row(Some(0), Some(0))
    );
    *page.lock() = sglang_page("written");
    assert_eq!(
        next_host(&mut received, "written").await,
        row(Some(3072), Some(0))
    );
    *page.lock() = sglang_page("roundtrip");
    assert_eq!(
        next_host(&mut received, "round trip").await,
        row(Some(3072), Some(2048))
    );
    let report = http_get(&agent.http_addr.to_string(), "/v1/report");
    let doc: serde_json::Value =
        serde_json::from_str(report.split_once("\r\n\r\n").unwrap().1).unwrap();
    let c = &doc["engineCounters"][0];
    assert_eq!(
        (
            &c["hostTierWrittenTokens"],
            &c["hostTierServedTokens"],
            &c["t2Hits"]
        ),
        (
            &serde_json::json!(3072),
            &serde_json::json!(2048),
            &serde_json::Value::Null
        )
    );

    // The engine restarted: it counts from 0 again, and the report says so at once.
    *page.lock() = sglang_page("idle");
    assert_eq!(
        next_host(&mut received, "restart").await,
        row(Some(0), Some(0))
    );

    // HiCache gone (the pod rolled without it): the stream leaves the report.
    *page.lock() = sglang_page("no-hicache");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !state.engine_counters.latest().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the stream stayed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_attention_dp_each_rank_reports_its_own_writes_and_the_pod_s_reads() {
    let page: Page = Arc::new(Mutex::new(sglang_page("dp2")));
    let ScrapingAgent {
        agent,
        mut received,
        ..
    } = start_scraping_agent(&page, |url| plan(url, 2)).await;
    assert_eq!(
        next_host(&mut received, "dp2").await,
        vec![
            ("team-a/sglang-0#0".to_string(), Some(2048), Some(1024)),
            ("team-a/sglang-0#1".to_string(), Some(0), Some(1024)),
        ]
    );
    agent.abort();
}
