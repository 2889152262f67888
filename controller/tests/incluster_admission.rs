//! `ic-controller run` serves the admission webhooks (issue 4 deliverable 1, issue 6
//! deliverable 1) against the in-memory API: two replicas share one self-signed CA through a
//! Secret, the CA is written into (and kept in) both webhook configurations, the Pod webhook
//! wires a pod against the live CacheBackend list and mounts a ModelCache reader claim, and the
//! CacheBackend webhooks reject an invalid object.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use ic_controller::admission::ca_bundle;
use ic_controller::admission::server::WebhookClient;
use ic_controller::incluster::{
    self, InClusterConfig, LeaderElectionSettings, Overrides, Running, WebhookSettings,
};
use ic_controller::ingest::auth::{FakeTokenVerifier, ServiceAccountRef};
use ic_controller::leader::ElectionConfig;
use ic_controller::reconcile::model_cache::ModelCacheConfig;
use ic_controller::state::LookupPolicy;
use ic_shared::crd::{CacheBackend, ModelCache};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube_fake_client::ClientBuilder;
use serde_json::{json, Value};

const NS: &str = "ic-system";
const CONFIG: &str = "inference-cache-webhooks";
const SECRET: &str = "inference-cache-webhook-tls";
const SERVICE: &str = "inference-cache-webhook";

fn backend() -> CacheBackend {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "mistral", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                 "ownership": "External", "endpoint": "lm://lmcache:65432"},
                 "engineSelector": {"matchLabels": {"app": "mistral-7b"}}}}))
    .unwrap()
}

fn model_cache() -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llama", "namespace": "team-a", "uid": "mc-1"},
        "spec": {"source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "main"},
                 "size": "20Gi", "workflow": "regularModelCache",
                 "writer": {"template": {"spec": {"restartPolicy": "Never",
                     "containers": [{"name": "fill", "image": "busybox"}]}}}},
        "status": {"mode": "durable", "binding": {"name": "mcb-x-1", "uid": "u"},
                   "readerClaim": "mcb-x-1-reader", "readerNamespaces": ["team-a"],
                   "conditions": [{"type": "Ready", "status": "True", "reason": "ReadersReady",
                                   "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    }))
    .unwrap()
}

fn webhook_configs() -> (MutatingWebhookConfiguration, ValidatingWebhookConfiguration) {
    let hooks = |names: &[&str], path: &str| -> Value {
        Value::Array(
            names
                .iter()
                .map(|n| {
                    json!({"name": n, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                       "clientConfig": {"service": {"name": SERVICE, "namespace": NS, "path": path}}})
                })
                .collect(),
        )
    };
    let m = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIG},
        "webhooks": hooks(&["mcachebackend.inferencecache.io", "mpod.inferencecache.io"], "/mutate-pod"),
    }))
    .unwrap();
    let v = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": CONFIG},
        "webhooks": hooks(&["vcachebackend.inferencecache.io"], "/validate-cachebackend"),
    }))
    .unwrap();
    (m, v)
}

fn config(identity: &str) -> InClusterConfig {
    let mut election = ElectionConfig::new(identity);
    election.retry_period = Duration::from_millis(100);
    InClusterConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        agent_expiry: Duration::from_secs(60),
        policy: LookupPolicy::default(),
        webhook: WebhookSettings {
            addr: "127.0.0.1:0".parse().unwrap(),
            self_signed: true,
            config_name: Some(CONFIG.into()),
            service: Some(SERVICE.into()),
            tls_secret: Some(SECRET.into()),
            ca_bundle_resync: Duration::from_millis(200),
            ..Default::default()
        },
        leader_election: LeaderElectionSettings {
            namespace: NS.into(),
            lease_name: "inference-cache-controller".into(),
            election,
        },
        agent_service_account: ServiceAccountRef {
            namespace: NS.into(),
            name: "inference-cache-agent".into(),
        },
        token_audience: "inference-cache".into(),
        token_cache_ttl: Duration::from_secs(60),
        data_plane_auth: Some(Default::default()),
        limits: Default::default(),
        nodes: Default::default(),
        model_cache: Some(ModelCacheConfig::default()),
        functional_probe: true,
        tokenizers: Default::default(),
    }
}

async fn start(
    client: kube::Client,
    identity: &str,
) -> (Running, tokio::sync::oneshot::Sender<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let running = incluster::start(
        client,
        config(identity),
        Overrides {
            token_verifier: Some(Arc::new(FakeTokenVerifier::new())),
            access_reviewer: None,
            clock: None,
        },
        async {
            let _ = rx.await;
        },
    )
    .await
    .unwrap();
    (running, tx)
}

fn review(uid: &str, kind: &str, object: Value) -> Vec<u8> {
    let (group, version, resource) = if kind == "Pod" {
        ("", "v1", "pods")
    } else {
        ("inferencecache.io", "v1alpha1", "cachebackends")
    };
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "namespace": "team-a", "operation": "CREATE",
            "userInfo": {"username": "kubernetes-admin"},
            "object": object, "dryRun": false
        }
    }))
    .unwrap()
}

fn decode_patch(response: &Value) -> Vec<json_patch::PatchOperation> {
    let b64 = response["patch"]
        .as_str()
        .unwrap_or_else(|| panic!("no patch: {response}"));
    serde_json::from_slice(
        &base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap(),
    )
    .unwrap()
}

async fn ca_bundles(client: &kube::Client) -> Vec<String> {
    let m: MutatingWebhookConfiguration = Api::all(client.clone()).get(CONFIG).await.unwrap();
    let v: ValidatingWebhookConfiguration = Api::all(client.clone()).get(CONFIG).await.unwrap();
    let mut out: Vec<String> = m
        .webhooks
        .iter()
        .flatten()
        .map(|w| {
            w.client_config
                .ca_bundle
                .as_ref()
                .map(|b| String::from_utf8(b.0.clone()).unwrap())
                .unwrap_or_default()
        })
        .collect();
    out.extend(v.webhooks.iter().flatten().map(|w| {
        w.client_config
            .ca_bundle
            .as_ref()
            .map(|b| String::from_utf8(b.0.clone()).unwrap())
            .unwrap_or_default()
    }));
    out
}

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn run_serves_webhooks_with_a_shared_self_signed_ca_kept_in_both_configurations() {
    let (mutating, validating) = webhook_configs();
    let client = ClientBuilder::new()
        .with_resource::<CacheBackend>()
        .with_status_subresource::<CacheBackend>()
        .with_resource::<ModelCache>()
        .with_status_subresource::<ModelCache>()
        .with_object(backend())
        .with_object(model_cache())
        .with_object(mutating)
        .with_object(validating)
        .build()
        .await
        .unwrap();

    let (first, stop_first) = start(client.clone(), "replica-1").await;
    let addr = first.webhook_addr.expect("webhooks are served");

    // The bundle is in the Secret, and its CA in every webhook of both configurations.
    let secret: Secret = Api::namespaced(client.clone(), NS)
        .get(SECRET)
        .await
        .unwrap();
    let data = secret.data.unwrap();
    let ca_pem = String::from_utf8(data[ca_bundle::CA_KEY].0.clone()).unwrap();
    assert!(ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    eventually("caBundle on all three webhooks", || {
        let client = client.clone();
        let ca_pem = ca_pem.clone();
        async move { ca_bundles(&client).await == vec![ca_pem.clone(); 3] }
    })
    .await;

    // The apiserver's view: TLS to the service name, trusting only the caBundle.
    let https = WebhookClient::new(addr, &ca_pem, &format!("{SERVICE}.{NS}.svc")).unwrap();
    let mut conn = https.connect().await.unwrap();

    // A pod matching the live CacheBackend is wired, and its ModelCache claim mounted.
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "mistral-0", "namespace": "team-a", "labels": {"app": "mistral-7b"},
                     "annotations": {"inferencecache.io/model-cache": "llama"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                 "args": ["--model", "mistralai/Mistral-7B-Instruct-v0.3"]}]}});
    let (status, body) = conn
        .post("/mutate-pod", &review("uid-pod", "Pod", pod.clone()))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    let r = &v["response"];
    assert_eq!(r["uid"], "uid-pod");
    assert_eq!(r["allowed"], true);
    assert_eq!(r["patchType"], "JSONPatch", "{v}");
    let mut wired = pod;
    json_patch::patch(&mut wired, &decode_patch(r)).unwrap();
    assert_eq!(
        wired["metadata"]["annotations"]["inferencecache.io/injected-by"],
        "team-a/mistral"
    );
    let volumes = wired["spec"]["volumes"].as_array().unwrap();
    let model_data = volumes.iter().find(|v| v["name"] == "model-data").unwrap();
    assert_eq!(
        model_data["persistentVolumeClaim"]["claimName"],
        "mcb-x-1-reader"
    );
    assert_eq!(model_data["persistentVolumeClaim"]["readOnly"], true);
    // Re-admission of the wired pod: no patch at all.
    let (_, body) = conn
        .post("/mutate-pod", &review("uid-pod-2", "Pod", wired))
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(v["response"].get("patch").is_none(), "{v}");
    assert!(v["response"].get("patchType").is_none(), "{v}");

    // The CacheBackend webhooks: an invalid object is refused with a field-scoped message.
    let bad = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "bad", "namespace": "team-a"},
        "spec": {"runtime": "VLLM", "replicas": 0, "autoscaling": {"maxReplicas": 3}}});
    let (_, body) = conn
        .post(
            "/validate-cachebackend",
            &review("uid-cb", "CacheBackend", bad),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], false, "{v}");
    assert_eq!(v["response"]["uid"], "uid-cb");

    // A second replica serves a certificate of the same CA (it reads the Secret).
    let (second, stop_second) = start(client.clone(), "replica-2").await;
    let https2 = WebhookClient::new(
        second.webhook_addr.unwrap(),
        &ca_pem,
        &format!("{SERVICE}.{NS}.svc"),
    )
    .unwrap();
    let mut conn2 = https2.connect().await.unwrap();
    let (status, _) = conn2.get("/healthz").await.unwrap();
    assert_eq!(status, 200);

    // A `helm upgrade` that resets the caBundle is repaired within the resync interval.
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let mut m = api.get(CONFIG).await.unwrap();
    for w in m.webhooks.iter_mut().flatten() {
        w.client_config.ca_bundle = None;
    }
    api.replace(CONFIG, &PostParams::default(), &m)
        .await
        .unwrap();
    eventually("caBundle restored", || {
        let client = client.clone();
        let ca_pem = ca_pem.clone();
        async move { ca_bundles(&client).await == vec![ca_pem.clone(); 3] }
    })
    .await;

    stop_first.send(()).unwrap();
    stop_second.send(()).unwrap();
    first.wait().await.unwrap();
    second.wait().await.unwrap();
}

#[tokio::test]
async fn a_secret_without_a_bundle_stops_the_start_with_a_clear_error() {
    let foreign: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NS},
        "data": {"something": "eA=="}
    }))
    .unwrap();
    let client = ClientBuilder::new()
        .with_resource::<CacheBackend>()
        .with_resource::<ModelCache>()
        .with_object(foreign)
        .build()
        .await
        .unwrap();
    let (_tx, rx) = tokio::sync::oneshot::channel::<()>();
    let err = match incluster::start(
        client,
        config("replica-1"),
        Overrides {
            token_verifier: Some(Arc::new(FakeTokenVerifier::new())),
            access_reviewer: None,
            clock: None,
        },
        async {
            let _ = rx.await;
        },
    )
    .await
    {
        Ok(_) => panic!("started with an unusable Secret"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(SECRET) && err.contains("has no ca.crt"),
        "{err}"
    );
}
