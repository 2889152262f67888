//! `ic-agent subscribe`, the binary itself: its `--help`, refusal of unusable flags, and a run
//! against a real ZMQ publisher replaying genuine vLLM 0.24.0 frames and a stand-in controller
//! (an `AgentService` server on loopback that records what arrives): Hello names the pod, a
//! node plan pushed down the stream is ignored, the resync answers carry exactly the blocks and
//! tiers a fresh replay gives (`--ignore-block-removed=true`: the removed block at T2), /metrics
//! and /healthz answer, and SIGTERM ends the process cleanly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::{free_port, http_get, FakeController};

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ic_agent::kv::{publish_fixture, Fixture, PublishOptions, StreamConfig, StreamState};
use ic_shared::kv::decode::decode_batch;
use ic_shared::proto::{
    agent_message::Msg, controller_message, AgentMessage, NodePlanUpdate, ResyncRequest,
    StreamSnapshot,
};
use tokio::sync::mpsc;

const BIN: &str = env!("CARGO_BIN_EXE_ic-agent");

/// The vLLM 0.24.0 golden recording (`testdata/kv-events`).
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events/vllm-0.24.0.json")
}

/// Environment the binary must not inherit from the test runner.
const ENV: &[&str] = &[
    "IC_KV_ENDPOINT",
    "IC_KV_REPLAY_ENDPOINT",
    "IC_KV_TOPIC",
    "IC_HASH_SCHEME",
    "IC_MODEL_ID",
    "POD_NAMESPACE",
    "POD_NAME",
    "IC_DATA_PARALLEL_RANK",
    "IC_BLOCK_SIZE",
    "IC_IGNORE_BLOCK_REMOVED",
    "IC_CONTROLLER",
    "IC_TOKEN_FILE",
    "NODE_NAME",
    "IC_METRICS_ADDR",
];

fn ic_agent() -> Command {
    let mut c = Command::new(BIN);
    for v in ENV {
        c.env_remove(v);
    }
    c
}

#[test]
fn help_explains_every_flag_with_its_environment_variable_and_default() {
    let out = ic_agent().args(["subscribe", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "--endpoint",
        "--replay",
        "--topic",
        "--hash-scheme",
        "--model-id",
        "--tenant",
        "--replica-id",
        "--data-parallel-rank",
        "--ignore-block-removed",
        "--controller",
        "--token-file",
        "--node",
        "--metrics-addr",
        "POD_NAMESPACE",
        "POD_NAME",
        "NODE_NAME",
        "IC_CONTROLLER",
        "http://127.0.0.1:50051",
        "/var/run/secrets/inference-cache/token",
        "T2",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    let top = ic_agent().arg("--help").output().unwrap();
    assert!(String::from_utf8_lossy(&top.stdout).contains("subscribe"));
}

#[test]
fn unusable_flags_exit_2_naming_the_flag() {
    let base = [
        "subscribe",
        "--endpoint=tcp://127.0.0.1:1",
        "--model-id=m",
        "--tenant=ns",
        "--replica-id=p",
    ];
    let out = ic_agent()
        .args(base)
        .arg("--hash-scheme=trtllm")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("vllm or sglang"));
    let out = ic_agent()
        .args(base)
        .args(["--hash-scheme=vllm", "--block-size=0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--block-size"));
}

type Entry = (String, u32, u64, i32);

fn ground_truth(final_seq: u64) -> BTreeSet<Entry> {
    let fx = Fixture::load(&fixture()).unwrap();
    let mut st = StreamState::new(StreamConfig {
        keeps_l2: true,
        block_size: 16,
        ..StreamConfig::default()
    });
    for f in fx.frames("dp0").into_iter().filter(|f| f.seq <= final_seq) {
        st.apply(f.seq, &decode_batch(&f.payload).unwrap(), 0);
    }
    st.snapshot()
        .1
        .into_iter()
        .map(|e| (e.adapter, e.block_size, e.content_key, e.tier))
        .collect()
}

fn entries(s: &StreamSnapshot) -> BTreeSet<Entry> {
    s.entries
        .iter()
        .map(|e| (e.adapter.clone(), e.block_size, e.content_key, e.tier))
        .collect()
}

/// The next message other than a coverage heartbeat (sent every second whatever else flows;
/// `coverage_heartbeat.rs` in the controller tests what they do).
async fn next_message(rx: &mut mpsc::UnboundedReceiver<AgentMessage>, what: &str) -> AgentMessage {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap();
        if !matches!(m.msg, Some(Msg::Heartbeat(_))) {
            return m;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_streams_one_engine_to_the_controller_and_stops_on_sigterm() {
    // Stand-in controller.
    let (fake, grpc, mut received) = FakeController::start().await;
    // Engine publisher: dp0 frames 0..=8 (the recording ends before its AllBlocksCleared).
    let (pub_port, replay_port, metrics_port) = (free_port(), free_port(), free_port());
    let publisher = tokio::spawn(async move {
        let opts = PublishOptions {
            connect_wait: Duration::from_millis(1500),
            interval: Duration::from_millis(50),
            linger: Duration::from_secs(60),
            until_seq: Some(8),
            ..Default::default()
        };
        publish_fixture(
            &fixture(),
            &format!("tcp://127.0.0.1:{pub_port}"),
            Some(&format!("tcp://127.0.0.1:{replay_port}")),
            &opts,
        )
        .await
        .unwrap();
    });
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "tok-123\n").unwrap();

    // The sidecar's command line, as the Pod webhook renders it (after $(POD_*) expansion).
    let mut child = ic_agent()
        .args([
            "subscribe".to_string(),
            format!("--endpoint=tcp://127.0.0.1:{pub_port}"),
            "--hash-scheme=vllm".to_string(),
            "--model-id=meta-llama/Llama-3.2-1B-Instruct".to_string(),
            "--tenant=team-a".to_string(),
            "--replica-id=vllm-0".to_string(),
            "--ignore-block-removed=true".to_string(),
            format!("--controller={grpc}"),
            format!("--replay=tcp://127.0.0.1:{replay_port}"),
            format!("--token-file={}", token.display()),
            format!("--metrics-addr=127.0.0.1:{metrics_port}"),
        ])
        .env("NODE_NAME", "node-1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
        .spawn()
        .unwrap();

    // Hello names the pod.
    let Some(Msg::Hello(hello)) = next_message(&mut received, "Hello").await.msg else {
        panic!("the first message must be Hello");
    };
    assert_eq!(hello.node, "node-1");
    assert_eq!(hello.token, "tok-123");
    let pod = hello.pod_subscriber.unwrap();
    assert_eq!(
        (pod.namespace.as_str(), pod.pod.as_str()),
        ("team-a", "vllm-0")
    );
    assert!(hello.capabilities.contains(&"pod-subscriber".to_string()));
    assert!(!hello.capabilities.contains(&"checks".to_string()));
    // Then the resync of its one stream.
    let Some(Msg::Resync(first)) = next_message(&mut received, "Resync").await.msg else {
        panic!("Resync must follow Hello");
    };
    assert_eq!(first.streams.len(), 1);
    let d = first.streams[0].stream.clone().unwrap();
    assert_eq!(d.stream_id, "team-a/vllm-0#0");
    assert_eq!(d.replica, "vllm-0");
    assert_eq!(d.tenant, "team-a");
    assert_eq!(d.model, "meta-llama/Llama-3.2-1B-Instruct");
    assert_eq!(d.hash_scheme, "vllm");

    // A node plan sent down a subscriber's stream is ignored (its stream stays the only one).
    fake.send(controller_message::Msg::Plan(NodePlanUpdate {
        generation: 7,
        plan_json: r#"{"engines":[{"namespace":"x","pod":"other","kvEvents":[{"endpoint":"tcp://127.0.0.1:1"}]}]}"#.into(),
    }))
    .await;

    // After the last frame, ask for a resync until it shows the full state.
    let truth = ground_truth(8);
    assert!(truth
        .iter()
        .any(|e| e.3 == ic_shared::proto::Tier::T2 as i32));
    let start = Instant::now();
    let mut deltas = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        fake.send(controller_message::Msg::ResyncRequest(ResyncRequest {
            reason: "test".into(),
        }))
        .await;
        let snap = loop {
            match next_message(&mut received, "Resync").await.msg {
                Some(Msg::Resync(r)) => break r,
                Some(Msg::KvDeltas(b)) => {
                    deltas += b.deltas.len();
                    for d in &b.deltas {
                        assert_eq!(d.stream.as_ref().unwrap().stream_id, "team-a/vllm-0#0");
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        assert_eq!(snap.streams.len(), 1, "the plan was ignored");
        if entries(&snap.streams[0]) == truth {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no resync with the full state: {:?}",
            entries(&snap.streams[0])
        );
    }
    assert!(deltas > 0, "live changes went up as deltas");

    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let health = http_get(&metrics_addr, "/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let metrics = http_get(&metrics_addr, "/metrics");
    assert!(
        metrics
            .contains("inferencecache_agent_kv_batches_decoded_total{stream=\"team-a/vllm-0#0\"}"),
        "{metrics}"
    );

    // SIGTERM: a clean exit.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(stderr.contains("ignoring a node plan"), "{stderr}");
    publisher.abort();
}
