//! The Pod webhook fails open, as the apiserver runs the chart's configuration: a second
//! controller replica answers the chart's `mpod` webhook for one namespace; pods are wired while
//! it runs; after it is killed (and while a webhook endpoint hangs past the chart's timeout)
//! pods are still created, unwired, and the leader records a Warning `NotInjected` on each.

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ic_controller::admission::pod::ANNOTATION_INJECTED_BY;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

use crate::support::{create_host_backend, wait_for, Cluster};

struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A second replica of the chart's controller (same identity and Lease: a follower, which
/// serves webhooks and writes nothing) with its webhook listener on `port`.
fn second_replica(c: &Cluster, port: u16) -> Replica {
    let state = &c.env["IC_CLUSTER_STATE"];
    let args: Vec<String> = std::fs::read_to_string(format!("{state}/controller-args"))
        .unwrap()
        .lines()
        .map(|a| match a.split_once('=') {
            Some(("--webhook-addr", _)) => format!("--webhook-addr=127.0.0.1:{port}"),
            Some(("--grpc-addr", _)) => "--grpc-addr=127.0.0.1:0".to_string(),
            Some(("--http-addr", _)) => "--http-addr=127.0.0.1:0".to_string(),
            Some(("--health-addr", _)) => "--health-addr=127.0.0.1:0".to_string(),
            _ => a.to_string(),
        })
        .collect();
    Replica(
        Command::new(&c.env["IC_CLUSTER_CONTROLLER_BIN"])
            .args(&args)
            .args(["--kubeconfig", &c.env["IC_CLUSTER_CONTROLLER_KUBECONFIG"]])
            .env("POD_NAMESPACE", &c.env["IC_CLUSTER_NAMESPACE"])
            .env("IC_LEADER_ELECTION_IDENTITY", "fail-open-replica")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// The chart's rendered Pod webhook, answered at `url` and matching namespace `ns` only.
fn pod_webhook_for(c: &Cluster, name: &str, ns: &str, url: &str) -> MutatingWebhookConfiguration {
    let state = &c.env["IC_CLUSTER_STATE"];
    let text = std::fs::read_to_string(format!("{state}/objects-webhooks.yaml")).unwrap();
    let mut hook: Value = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter_map(|d: Value| (d["kind"] == "MutatingWebhookConfiguration").then_some(d))
        .flat_map(|d| d["webhooks"].as_array().unwrap().clone())
        .find(|w| {
            w["clientConfig"]["url"]
                .as_str()
                .unwrap()
                .ends_with("/mutate-pod")
        })
        .unwrap();
    hook["clientConfig"]["url"] = json!(url);
    hook["namespaceSelector"] = json!({"matchLabels": {"kubernetes.io/metadata.name": ns}});
    hook["objectSelector"] = json!({});
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [hook],
    }))
    .unwrap()
}

fn engine(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": "llm"}},
        "spec": {"containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.11.2",
            "command": ["vllm", "serve", "Qwen/Qwen3-8B"]}]}
    }))
    .unwrap()
}

fn wired(p: &Pod) -> bool {
    p.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(ANNOTATION_INJECTED_BY))
}

async fn not_injected_event(c: &Cluster, ns: &str, pod: &str) -> Option<Event> {
    Api::<Event>::namespaced(c.admin.clone(), ns)
        .list(&ListParams::default())
        .await
        .ok()?
        .items
        .into_iter()
        .find(|e| {
            e.reason.as_deref() == Some("NotInjected")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
        })
}

#[tokio::test]
async fn pods_are_admitted_unwired_and_marked_when_the_webhook_is_gone() {
    let c = Cluster::get().await;
    let ns = c.namespace("failopen").await;
    // The cluster-wide configuration leaves this namespace to the one below.
    Api::<Namespace>::all(c.admin.clone())
        .patch(
            &ns,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"inferencecache.io/webhook": "disabled"}}}),
            ),
        )
        .await
        .unwrap();
    create_host_backend(&c.admin, &ns, "hostcache", "llm").await;

    let port = free_port();
    let replica = second_replica(&c, port);
    let configs = Api::<MutatingWebhookConfiguration>::all(c.admin.clone());
    let config_name = format!("fail-open-{ns}");
    configs
        .create(
            &PostParams::default(),
            &pod_webhook_for(
                &c,
                &config_name,
                &ns,
                &format!("https://127.0.0.1:{port}/mutate-pod"),
            ),
        )
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(c.admin.clone(), &ns);
    let mut n = 0;
    wait_for(
        "a pod wired by the second replica",
        Duration::from_secs(60),
        || {
            n += 1;
            let pods = pods.clone();
            async move {
                let p = pods
                    .create(&PostParams::default(), &engine(&format!("wired-{n}")))
                    .await
                    .unwrap();
                wired(&p).then_some(())
            }
        },
    )
    .await;

    // The webhook's process is gone: connection refused, failurePolicy Ignore.
    drop(replica);
    let p = pods
        .create(&PostParams::default(), &engine("after-stop"))
        .await
        .unwrap();
    assert!(!wired(&p), "{:?}", p.metadata.annotations);

    // A webhook that accepts connections and never answers: the apiserver gives up after the
    // chart's timeoutSeconds and admits the pod.
    let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hang_port = hang.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((s, _)) = hang.accept().await {
            open.push(s);
        }
    });
    let mut cfg = configs.get(&config_name).await.unwrap();
    cfg.webhooks.as_mut().unwrap()[0].client_config.url =
        Some(format!("https://127.0.0.1:{hang_port}/mutate-pod"));
    configs
        .replace(&config_name, &PostParams::default(), &cfg)
        .await
        .unwrap();
    let timeout = cfg.webhooks.as_ref().unwrap()[0].timeout_seconds.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t0 = Instant::now();
    let p = pods
        .create(&PostParams::default(), &engine("after-hang"))
        .await
        .unwrap();
    let took = t0.elapsed();
    assert!(!wired(&p));
    assert!(
        took >= Duration::from_secs(timeout as u64 - 1)
            && took < Duration::from_secs(timeout as u64 + 10),
        "admitted after {took:?} (timeoutSeconds {timeout})"
    );
    held.abort();

    // Both unwired pods are marked for the operator.
    for pod in ["after-stop", "after-hang"] {
        let e = wait_for("a NotInjected Event", Duration::from_secs(60), || {
            not_injected_event(&c, &ns, pod)
        })
        .await;
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert!(
            e.note
                .as_deref()
                .unwrap_or_default()
                .contains("did not see it"),
            "{:?}",
            e.note
        );
    }
    configs
        .delete(&config_name, &DeleteParams::default())
        .await
        .unwrap();
    c.drop_namespace(&ns).await;
}
