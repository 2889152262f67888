//! `ic-controller run` end to end against the bare real apiserver
//! (tests/bare_apiserver_support/): leader election on a real Lease, an agent authenticated by
//! the apiserver's TokenReview (a TokenRequest token bound to its pod on its Node) over loopback
//! gRPC receiving its node plan, a failing check appearing as a CacheNode condition and as the
//! CacheBackend's advisory condition within one report interval, a node with engine pods but no
//! agent, a refused cross-node stream, and the Lease released at shutdown.
//!
//! The controller runs as a ServiceAccount of the test's namespace with the chart's controller
//! RBAC in that namespace, its lists and watches confined to it (tests/incluster_support/): the
//! cluster is shared with other tests, whose objects a leading controller would otherwise
//! reconcile.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;
mod incluster_support;

use std::time::{Duration, Instant};

use bare_apiserver_support::{create_with_status, unique, BareCluster};
use ic_controller::incluster::{
    self, InClusterConfig, LeaderElectionSettings, Overrides, WebhookSettings,
};
use ic_controller::ingest::auth::ServiceAccountRef;
use ic_controller::leader::{ElectionConfig, LeaseLock};
use ic_controller::reconcile::nodes::NodeLoopConfig;
use ic_controller::state::LookupPolicy;
use ic_shared::crd::conditions::find_condition;
use ic_shared::crd::{CacheBackend, CacheNode};
use ic_shared::plan::NodePlan;
use ic_shared::proto::{
    self, agent_message::Msg, agent_service_client::AgentServiceClient, controller_message,
    AgentMessage,
};
use incluster_support::{
    controller_client, node, pod, service_account, token, ControllerGrants, AUDIENCE,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

const LEASE: &str = "inference-cache-controller";

fn engine_pod(name: &str, node: &str, ip: &str, backend: &CacheBackend) -> Pod {
    let ns = backend.metadata.namespace.clone().unwrap();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": {
                "inferencecache.io/injected-by": format!("{ns}/cb"),
                "inferencecache.io/injected-by-uid": backend.metadata.uid,
            },
        },
        "spec": {
            "nodeName": node,
            "containers": [{
                "name": "vllm", "image": "vllm/vllm-openai",
                "command": ["vllm", "serve", "m", "--kv-events-config",
                    r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#],
            }],
        },
        "status": {"phase": "Running", "podIP": ip},
    }))
    .unwrap()
}

fn backend() -> CacheBackend {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "cb"},
        "spec": {"runtime": "VLLM", "observation": {"modelID": "m"}},
    }))
    .unwrap()
}

async fn client_for(url: &str) -> AgentServiceClient<tonic::transport::Channel> {
    AgentServiceClient::new(
        tonic::transport::Endpoint::from_shared(url.to_string())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    )
}

async fn wait_until<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_mode_end_to_end() {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("run").await;
    let gpu1 = unique("gpu-1");
    let gpu2 = unique("gpu-2");
    let backends: Api<CacheBackend> = Api::namespaced(bare.admin.clone(), &ns);
    let cb = backends
        .create(&PostParams::default(), &backend())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(bare.admin.clone(), &ns);
    create_with_status(&pods, &engine_pod("vllm-0", &gpu1, "10.0.0.5", &cb)).await;
    create_with_status(&pods, &engine_pod("vllm-1", &gpu2, "10.0.0.6", &cb)).await;

    // The agent of gpu-1: its ServiceAccount, its pod on its Node, a token bound to that pod.
    service_account(&bare, &ns, "ic-agent").await;
    node(&bare, &gpu1).await;
    let agent_pod = pod(&bare, &ns, "ic-agent-gpu-1", "ic-agent", Some(&gpu1)).await;
    let agent_token = token(&bare, &ns, "ic-agent", Some(&[AUDIENCE]), Some(&agent_pod)).await;
    let agent_sa = ServiceAccountRef {
        namespace: ns.clone(),
        name: "ic-agent".into(),
    };

    let client = controller_client(
        &bare,
        &ns,
        ControllerGrants {
            cache_nodes: vec![gpu1.clone(), gpu2.clone()],
            ..Default::default()
        },
    )
    .await;
    let mut election = ElectionConfig::new("replica-1");
    election.retry_period = Duration::from_millis(100);
    // The agent's check interval: a report is stale after a few of them, far beyond this test.
    let report_interval = Duration::from_secs(30);
    let cfg = InClusterConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        agent_expiry: Duration::from_secs(60),
        policy: LookupPolicy::default(),
        webhook: WebhookSettings {
            addr: "127.0.0.1:0".parse().unwrap(),
            self_signed: true,
            ..Default::default()
        },
        leader_election: LeaderElectionSettings {
            namespace: ns.clone(),
            lease_name: LEASE.into(),
            election,
        },
        agent_service_account: agent_sa,
        token_audience: AUDIENCE.into(),
        token_cache_ttl: Duration::from_secs(60),
        review_source_limit: Default::default(),
        data_plane_auth: Some(Default::default()),
        nodes: NodeLoopConfig {
            plan_interval: Duration::from_millis(200),
            status_interval: Duration::from_millis(500),
            // Only a changed condition can be written within the report interval.
            cachenode_min_write_interval: Duration::from_secs(600),
            advisory_resync: Duration::from_secs(60),
            ..Default::default()
        },
        limits: Default::default(),
        model_cache: None,
        functional_probe: false,
        tokenizers: Default::default(),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // No overrides: agents' tokens are checked by the apiserver's TokenReview.
    let running = incluster::start(client.clone(), cfg, Overrides::default(), async {
        let _ = stop_rx.await;
    })
    .await
    .unwrap();
    let shared = running.shared.clone();
    let leader = running.leader.clone();
    wait_until("leadership", Duration::from_secs(60), || {
        let l = leader.is_leader();
        async move { l }
    })
    .await;

    // The authenticated agent of gpu-1 gets its plan: the engine pod with its publisher.
    let url = format!("http://{}", running.grpc_addr);
    let mut agent = client_for(&url).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let hello = |node: &str, token: &str| AgentMessage {
        msg: Some(Msg::Hello(proto::Hello {
            node: node.into(),
            version: "0.1.0".into(),
            token: token.into(),
            ..Default::default()
        })),
    };
    tx.send(hello(&gpu1, &agent_token)).await.unwrap();
    let mut down = agent
        .connect(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let plan = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(controller_message::Msg::Plan(p)) =
                down.message().await.unwrap().unwrap().msg
            {
                let plan = NodePlan::parse(&p.plan_json, "stream").unwrap();
                if !plan.engines.is_empty() {
                    return (p.generation, plan);
                }
            }
        }
    })
    .await
    .unwrap();
    assert!(plan.0 >= 1);
    let e = &plan.1.engines[0];
    assert_eq!(
        (e.pod.as_str(), e.backend.as_str(), e.model.as_str()),
        ("vllm-0", format!("{ns}/cb").as_str(), "m")
    );
    assert_eq!(e.kv_events[0].endpoint, "tcp://10.0.0.5:5557");
    assert_eq!(
        e.kv_events[0].replay_endpoint.as_deref(),
        Some("tcp://10.0.0.5:5558")
    );

    // gpu-1's token cannot report for gpu-2.
    let mut intruder = client_for(&url).await;
    let (itx, irx) = tokio::sync::mpsc::channel(1);
    itx.send(hello(&gpu2, &agent_token)).await.unwrap();
    let refused = intruder
        .connect(ReceiverStream::new(irx))
        .await
        .err()
        .unwrap();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);

    // A failing check shows up on the CacheNode and the backend within one report interval.
    let sent = Instant::now();
    tx.send(AgentMessage {
        msg: Some(Msg::Checks(proto::CheckReport {
            observed_at_unix_ms: ic_shared::now_unix_ms(),
            plan_generation: plan.0,
            interval_seconds: report_interval.as_secs(),
            age_ms: 0,
            results: vec![proto::CheckResult {
                name: "shm".into(),
                subject: "host".into(),
                status: proto::CheckStatus::Critical as i32,
                reason: "ShmUndersized".into(),
                message: "/dev/shm is 64.0 MiB but the plan requires 1.0 GiB".into(),
                ..Default::default()
            }],
        })),
    })
    .await
    .unwrap();
    let nodes: Api<CacheNode> = Api::all(bare.admin.clone());
    wait_until(
        "ShmHealthy=False on CacheNode gpu-1",
        report_interval,
        || {
            let nodes = nodes.clone();
            let gpu1 = gpu1.clone();
            async move {
                nodes
                    .get_opt(&gpu1)
                    .await
                    .unwrap()
                    .and_then(|n| n.status)
                    .is_some_and(|s| {
                        find_condition(&s.conditions, "ShmHealthy")
                            .is_some_and(|c| c.status == "False")
                    })
            }
        },
    )
    .await;
    wait_until(
        "NodeHealthy=False on CacheBackend cb",
        report_interval,
        || {
            let backends = backends.clone();
            async move {
                backends.get("cb").await.unwrap().status.is_some_and(|s| {
                    find_condition(&s.conditions, "NodeHealthy")
                        .is_some_and(|c| c.status == "False")
                })
            }
        },
    )
    .await;
    assert!(sent.elapsed() < report_interval);
    let cb = backends.get("cb").await.unwrap();
    let adv = find_condition(&cb.status.as_ref().unwrap().conditions, "NodeHealthy")
        .unwrap()
        .clone();
    assert_eq!(adv.reason, "NodeCheckFailing");
    assert!(
        adv.message
            .contains(&format!("{gpu1}: shm Critical (ShmUndersized)")),
        "{}",
        adv.message
    );
    assert!(
        adv.message
            .contains(&format!("No node agent is connected on {gpu2}")),
        "{}",
        adv.message
    );

    // gpu-2 runs an engine pod but has no agent: it is reported, on its CacheNode and in metrics.
    let gpu2_status = nodes.get(&gpu2).await.unwrap().status.unwrap();
    let c = find_condition(&gpu2_status.conditions, "AgentConnected").unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "AgentNotConnected")
    );
    assert_eq!(gpu2_status.engine_count, 1);
    let metrics = shared.metrics.render();
    assert!(
        metrics.contains("inferencecache_controller_nodes_without_agent 1"),
        "{metrics}"
    );
    assert!(metrics.contains("inferencecache_controller_leader 1"));

    // Shutdown releases the Lease.
    drop(tx);
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running.wait())
        .await
        .unwrap()
        .unwrap();
    let lock = LeaseLock::new(bare.admin.clone(), &ns, LEASE);
    assert_eq!(lock.read().await.unwrap().unwrap().0.holder(), None);
    // The chart created the Lease; every renewal and the release kept its labels (Helm's
    // ownership metadata lives there too).
    let lease =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(bare.admin.clone(), &ns)
            .get(LEASE)
            .await
            .unwrap();
    let labels = lease.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels
            .get("app.kubernetes.io/component")
            .map(String::as_str),
        Some("controller"),
        "{labels:?}"
    );
}
