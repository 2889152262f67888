//! The standalone stack end to end, in one process but over real sockets: `ic-controller
//! standalone` on loopback gRPC/HTTP, an `ic-agent` runtime connected to it running the real
//! host checks, and a real ZMQ publisher replaying genuine vLLM frames. Covers the foundation
//! issue's acceptance: the node shows up with its checks, the agent's report agrees with
//! `ic-agent check`, LookupRoute answers PREFIX_MATCH / NO_HINT, and a controller restart is healed
//! by the agent's resync without restarting the agent.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::stack::{free_port, kv_fixture, start_controller};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ic_agent::checks::{Checks, ChecksConfig};
use ic_agent::kv::publish::{publish_fixture, PublishOptions};
use ic_agent::link::LinkConfig;
use ic_agent::runtime::{self, RunConfig};
use ic_agent::state::AgentState;
use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource, NodePlan, ShmRequirement};
use ic_shared::proto::{
    router_service_client::RouterServiceClient, Decision, LookupRouteRequest, LookupRouteResponse,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET over plain HTTP/1.1 and parse the JSON body.
async fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).unwrap();
    let status: u16 = text[9..12].parse().unwrap();
    let body = text.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

async fn wait_for<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out after {limit:?} waiting for {what}");
}

async fn lookup(grpc: SocketAddr, tokens: std::ops::Range<u32>) -> Option<LookupRouteResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut client = RouterServiceClient::new(channel);
    client
        .lookup_route(LookupRouteRequest {
            token_ids: tokens.collect(),
            ..Default::default()
        })
        .await
        .ok()
        .map(|r| r.into_inner())
}

fn check_keys(checks: &Value) -> Vec<(String, String, String, String)> {
    let mut v: Vec<_> = checks
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["subject"].as_str().unwrap().to_string(),
                c["status"].as_str().unwrap().to_string(),
                c["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standalone_stack_reports_checks_routes_prefixes_and_survives_a_controller_restart() {
    let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let controller = start_controller(grpc).await;

    let pub_port = free_port();
    let replay_port = free_port();
    let plan = NodePlan {
        shm: Some(ShmRequirement {
            required_bytes: 1 << 20,
        }),
        engines: vec![EnginePlan {
            namespace: "default".into(),
            pod: "vllm-0".into(),
            model: "demo-model".into(),
            hash_scheme: HashScheme::Vllm,
            block_size: 16,
            keeps_l2: true,
            kv_events: vec![KvEventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
                topic: String::new(),
                dp_rank: 0,
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let state = AgentState::new("node-under-test".into(), plan.clone()).unwrap();
    let mut link = LinkConfig::new(format!("http://{grpc}"));
    link.backoff_max = Duration::from_millis(500);
    let agent = runtime::start(
        RunConfig {
            link: Some(link),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            metrics_addr: None,
            check_interval: Duration::from_secs(1),
            limits: Default::default(),
            http_bearer_token_file: None,
        },
        state,
        Checks::new(&ChecksConfig::default()),
    )
    .await
    .unwrap();

    // The node shows up with its shm, ports and GPU results within 10 s.
    wait_for("the node in /v1/nodes", Duration::from_secs(10), || async {
        let (_, doc) = get_json(controller.http, "/v1/nodes").await;
        doc["nodes"].as_array().is_some_and(|n| {
            n.iter().any(|n| {
                n["node"] == "node-under-test"
                    && n["connected"] == true
                    && ["shm", "ports", "gpu"].iter().all(|c| {
                        n["checks"]
                            .as_array()
                            .is_some_and(|cs| cs.iter().any(|x| x["name"] == *c))
                    })
            })
        })
    })
    .await;

    // The agent's report agrees with a one-shot `ic-agent check` on the same plan.
    let (status, report) = get_json(agent.http_addr, "/v1/report").await;
    assert_eq!(status, 200);
    let oneshot = Checks::new(&ChecksConfig::default()).run_all(&plan);
    let oneshot = ic_agent::checks::report_json("node-under-test", &oneshot);
    assert_eq!(
        check_keys(&report["checks"]),
        check_keys(&oneshot["checks"])
    );
    assert_eq!(report["node"], "node-under-test");

    // Attach a replayed vLLM 0.24 engine (map-encoded events); the recording ends before its
    // final AllBlocksCleared so the state stays.
    let publisher = tokio::spawn(async move {
        let opts = PublishOptions {
            connect_wait: Duration::from_millis(1500),
            linger: Duration::from_secs(30),
            until_seq: Some(8),
            ..Default::default()
        };
        publish_fixture(
            &kv_fixture("vllm-0.24.0.json"),
            &format!("tcp://127.0.0.1:{pub_port}"),
            Some(&format!("tcp://127.0.0.1:{replay_port}")),
            &opts,
        )
        .await
    });

    wait_for(
        "PREFIX_MATCH for tokens 0..32",
        Duration::from_secs(15),
        || async {
            lookup(controller.grpc, 0..32)
                .await
                .is_some_and(|r| r.decision == Decision::PrefixMatch as i32)
        },
    )
    .await;
    // Every published batch (seq 0..=8) applied on the agent and acknowledged into the index.
    let hub = agent.state.hub.clone();
    wait_for("the last published batch", Duration::from_secs(15), || {
        let hub = hub.clone();
        async move { hub.status().first().and_then(|s| s.last_seq) == Some(8) }
    })
    .await;
    let delta_seq = hub.status()[0].delta_seq;
    wait_for(
        "the index to apply every delta",
        Duration::from_secs(10),
        || async {
            controller
                .shared
                .index
                .read()
                .snapshot()
                .replicas
                .first()
                .map(|r| r.seq)
                == Some(delta_seq)
        },
    )
    .await;
    let hit = lookup(controller.grpc, 0..32).await.unwrap();
    assert_eq!(hit.replicas[0].replica, "vllm-0");
    assert_eq!(hit.replicas[0].node, "node-under-test");
    assert_eq!(hit.replicas[0].matched_blocks, 2);
    assert_eq!(hit.replicas[0].matched_tokens, 32);
    assert_eq!(hit.block_size, 16);
    let miss = lookup(controller.grpc, 500..532).await.unwrap();
    assert_eq!(miss.decision, Decision::NoHint as i32);
    assert!(miss.replicas.is_empty());
    let before = controller.shared.index.read().snapshot();

    // Restart the controller on the same port; the agent reconnects and resyncs.
    controller.stop().await;
    let controller = start_controller(grpc).await;
    assert_eq!(controller.shared.index.read().entry_count(), 0);

    wait_for(
        "the index to come back",
        Duration::from_secs(10),
        || async {
            lookup(controller.grpc, 0..32)
                .await
                .is_some_and(|r| r.decision == Decision::PrefixMatch as i32)
        },
    )
    .await;
    let after = controller.shared.index.read().snapshot();
    assert_eq!(after.entries, before.entries);
    assert_eq!(after.blocks, before.blocks);
    assert_eq!(
        after
            .replicas
            .iter()
            .map(|r| (&r.stream_id, r.prefix_count, r.t2_blocks))
            .collect::<Vec<_>>(),
        before
            .replicas
            .iter()
            .map(|r| (&r.stream_id, r.prefix_count, r.t2_blocks))
            .collect::<Vec<_>>()
    );
    wait_for(
        "the node back in /v1/nodes",
        Duration::from_secs(10),
        || async {
            let (_, doc) = get_json(controller.http, "/v1/nodes").await;
            doc["nodes"][0]["node"] == "node-under-test"
                && doc["nodes"][0]["checks"]
                    .as_array()
                    .is_some_and(|c| !c.is_empty())
        },
    )
    .await;

    publisher.abort();
    agent.abort();
    controller.stop().await;
}

/// Every controller replica serves reads, so every replica must hold every node's state: the
/// agent keeps one stream per controller and the delta fan-out keeps each gap-free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_feeds_every_controller_replica_the_same_index() {
    let a = start_controller(format!("127.0.0.1:{}", free_port()).parse().unwrap()).await;
    let b = start_controller(format!("127.0.0.1:{}", free_port()).parse().unwrap()).await;
    let pub_port = free_port();
    let plan = NodePlan {
        engines: vec![EnginePlan {
            pod: "vllm-0".into(),
            model: "demo-model".into(),
            kv_events: vec![KvEventSource {
                endpoint: format!("tcp://127.0.0.1:{pub_port}"),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let state = AgentState::new("fan-out-node".into(), plan).unwrap();
    let mut link = LinkConfig::new(format!("http://{}, http://{}", a.grpc, b.grpc));
    link.backoff_max = Duration::from_millis(500);
    let agent = runtime::start(
        RunConfig {
            link: Some(link),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            metrics_addr: None,
            check_interval: Duration::from_secs(1),
            limits: Default::default(),
            http_bearer_token_file: None,
        },
        state,
        Checks::new(&ChecksConfig::default()),
    )
    .await
    .unwrap();
    let publisher = tokio::spawn(async move {
        let opts = PublishOptions {
            connect_wait: Duration::from_millis(1500),
            linger: Duration::from_secs(30),
            until_seq: Some(8),
            ..Default::default()
        };
        publish_fixture(
            &kv_fixture("vllm-0.24.0.json"),
            &format!("tcp://127.0.0.1:{pub_port}"),
            None,
            &opts,
        )
        .await
    });
    let hub = agent.state.hub.clone();
    wait_for("the last published batch", Duration::from_secs(15), || {
        let hub = hub.clone();
        async move { hub.status().first().and_then(|s| s.last_seq) == Some(8) }
    })
    .await;
    let delta_seq = hub.status()[0].delta_seq;
    for c in [&a, &b] {
        wait_for(
            "both replicas to apply every delta",
            Duration::from_secs(10),
            || async {
                c.shared
                    .index
                    .read()
                    .snapshot()
                    .replicas
                    .first()
                    .map(|r| r.seq)
                    == Some(delta_seq)
            },
        )
        .await;
    }
    // Each replica's coverage age is its own clock's (milliseconds since it last heard the
    // agent): present on both, compared apart from the rest.
    let mut sa = a.shared.index.read().snapshot();
    let mut sb = b.shared.index.read().snapshot();
    for r in sa.replicas.iter_mut().chain(sb.replicas.iter_mut()) {
        let age = r
            .coverage_age_ms
            .take()
            .expect("every replica carries its coverage age");
        assert!(age < 10_000, "the agent was heard {age} ms ago");
    }
    assert!(sa.entries > 0);
    assert_eq!(sa, sb);
    let mut ra = lookup(a.grpc, 0..64).await.unwrap();
    let mut rb = lookup(b.grpc, 0..64).await.unwrap();
    for m in ra.replicas.iter_mut().chain(rb.replicas.iter_mut()) {
        assert!(
            m.coverage_age_ms.take().is_some(),
            "every match carries its coverage age"
        );
    }
    assert_eq!(ra, rb);
    assert_eq!(ra.decision, Decision::PrefixMatch as i32);
    assert_eq!(agent.state.link.read().connected_count(), 2);
    publisher.abort();
    agent.abort();
    a.stop().await;
    b.stop().await;
}
