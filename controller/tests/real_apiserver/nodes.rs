//! A real `ic-agent run` on a (kubelet-less) Node, authenticated with a TokenRequest token bound
//! to its pod: the controller creates the node's CacheNode from the agent's reports, and the
//! CacheBackend whose engine pod runs on that node gets its `NodeHealthy` advisory condition.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ic_controller::admission::pod::ANNOTATION_INJECTED_BY;
use ic_controller::reconcile::nodes::advisory::CONDITION_TYPE as NODE_HEALTHY;
use ic_shared::crd::{CacheBackend, CacheNode};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::support::{
    create_host_backend, ensure_node, pod_token, wait_for, workspace_bin, Cluster,
};

struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn an_agent_reports_its_node_into_cachenode_and_backend_status() {
    let c = Cluster::get().await;
    let node = format!("agent-node-{}", std::process::id());
    ensure_node(&c.admin, &node).await;
    let ns = c.namespace("nodes").await;
    create_host_backend(&c.admin, &ns, "hosted", "engine").await;
    // An engine pod on the node, wired by the webhook (retried until the webhook's
    // CacheBackend store has the new backend).
    let pods = Api::<Pod>::namespaced(c.admin.clone(), &ns);
    let mut n = 0;
    wait_for(
        "a wired engine pod on the node",
        Duration::from_secs(30),
        || {
            n += 1;
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": format!("engine-{n}"), "labels": {"app": "engine"}},
                "spec": {"nodeName": node, "containers": [{
                    "name": "vllm", "image": "vllm/vllm-openai:v0.11.2",
                    "command": ["vllm", "serve", "Qwen/Qwen3-8B"]}]}
            }))
            .unwrap();
            let pods = pods.clone();
            async move {
                let p = pods.create(&PostParams::default(), &pod).await.unwrap();
                p.metadata
                    .annotations
                    .unwrap_or_default()
                    .contains_key(ANNOTATION_INJECTED_BY)
                    .then_some(())
            }
        },
    )
    .await;

    let token_file = tempfile::NamedTempFile::new().unwrap();
    let agent_ns = c.env["IC_CLUSTER_NAMESPACE"].clone();
    let token = pod_token(&c.admin, &agent_ns, &format!("agent-{node}"), &node, 3600).await;
    std::fs::write(token_file.path(), token).unwrap();
    let _agent = Agent(
        Command::new(workspace_bin("ic-agent"))
            .args([
                "run",
                "--node",
                &node,
                "--controller",
                &format!("http://127.0.0.1:{}", c.env["IC_CLUSTER_GRPC_PORT"]),
                "--token-file",
                token_file.path().to_str().unwrap(),
                "--http-addr=127.0.0.1:0",
                "--check-interval-seconds=2",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let nodes = Api::<CacheNode>::all(c.admin.clone());
    let cache_node = wait_for(
        "the node's CacheNode with conditions",
        Duration::from_secs(90),
        || async {
            let cn = nodes.get_opt(&node).await.ok()??;
            let st = cn.status.as_ref()?;
            (!st.conditions.is_empty()).then_some(cn)
        },
    )
    .await;
    let st = cache_node.status.unwrap();
    assert!(
        st.agent_version.is_some() && st.last_report_time.is_some(),
        "the agent's own report: {st:?}"
    );

    let backends = Api::<CacheBackend>::namespaced(c.admin.clone(), &ns);
    wait_for(
        "the backend's NodeHealthy advisory",
        Duration::from_secs(90),
        || async {
            let b = backends.get("hosted").await.ok()?;
            b.status?
                .conditions
                .iter()
                .any(|c| c.type_ == NODE_HEALTHY)
                .then_some(())
        },
    )
    .await;
    c.drop_namespace(&ns).await;
}
