//! `ic-controller run` serves the admission webhooks (issue 4 deliverable 1, issue 6
//! deliverable 1) against the bare real apiserver (tests/bare_apiserver_support/): two replicas
//! share one self-signed CA through a real Secret, the CA is written into (and kept in) both
//! webhook configurations, the Pod webhook wires a pod against the live CacheBackend list and
//! mounts a ModelCache reader claim, and the CacheBackend webhooks reject an invalid object.
//!
//! The replicas run as a ServiceAccount of the test's namespace with the chart's controller
//! RBAC in that namespace plus the chart's self-signed-mode grants (the webhook Secret, the
//! test's own webhook configurations by name), their lists and watches confined to the
//! namespace (tests/incluster_support/). The webhook configurations have unique names and no
//! rules: the apiserver never calls them (the full cluster's tests in
//! `tests/real_apiserver/admission.rs` cover the apiserver calling the chart's webhooks).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;
mod incluster_support;

use std::time::{Duration, Instant};

use bare_apiserver_support::{create_with_status, unique, BareCluster};
use base64::Engine as _;
use ic_controller::admission::ca_bundle;
use ic_controller::admission::server::WebhookClient;
use ic_controller::incluster::{
    self, InClusterConfig, LeaderElectionSettings, Overrides, Running, WebhookSettings,
};
use ic_controller::ingest::auth::ServiceAccountRef;
use ic_controller::leader::ElectionConfig;
use ic_controller::reconcile::model_cache::ModelCacheConfig;
use ic_controller::state::LookupPolicy;
use ic_shared::crd::{CacheBackend, ModelCache};
use incluster_support::{controller_client, ControllerGrants};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{json, Value};

const SECRET: &str = "inference-cache-webhook-tls";
const SERVICE: &str = "inference-cache-webhook";

/// One test's namespace (the controller's, and the tenant's) and webhook configurations' name.
struct Env {
    bare: BareCluster,
    ns: String,
    config: String,
}

async fn env() -> Env {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("webhooks").await;
    Env {
        bare,
        ns,
        config: unique("ic-webhooks"),
    }
}

/// The replicas' client: the chart's controller RBAC in `env.ns`, and what the chart grants in
/// self-signed mode (chart/templates/controller-rbac.yaml): get the webhook Secret by name,
/// create Secrets, get and update this test's webhook configurations by name. ModelCaches are
/// read (the Pod webhook's store), not written: the test sets the status the model-cache
/// controller would (a leading replica's writes to it are refused).
async fn client(env: &Env) -> kube::Client {
    controller_client(
        &env.bare,
        &env.ns,
        ControllerGrants {
            namespaced: vec![
                json!({"apiGroups": [""], "resources": ["secrets"], "resourceNames": [SECRET],
                       "verbs": ["get"]}),
                json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}),
                json!({"apiGroups": ["inferencecache.io"], "resources": ["modelcaches"],
                       "verbs": ["get", "list", "watch"]}),
            ],
            cluster: vec![json!({"apiGroups": ["admissionregistration.k8s.io"],
                "resources": ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
                "resourceNames": [env.config], "verbs": ["get", "update"]})],
            ..Default::default()
        },
    )
    .await
}

fn backend() -> CacheBackend {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "mistral"},
        "spec": {"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                 "ownership": "External", "endpoint": "lm://lmcache:65432"},
                 "engineSelector": {"matchLabels": {"app": "mistral-7b"}}}}))
    .unwrap()
}

/// A ModelCache whose reader claim is ready for pods of `ns` (its status as the model-cache
/// controller would have written it).
fn model_cache(ns: &str) -> ModelCache {
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llama"},
        "spec": {"source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "main"},
                 "size": "20Gi", "workflow": "regularModelCache",
                 "writer": {"template": {"spec": {"restartPolicy": "Never",
                     "containers": [{"name": "fill", "image": "busybox"}]}}}},
        "status": {"mode": "durable", "binding": {"name": "mcb-x-1", "uid": "u"},
                   "readerClaim": "mcb-x-1-reader", "readerNamespaces": [ns],
                   "conditions": [{"type": "Ready", "status": "True", "reason": "ReadersReady",
                                   "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    }))
    .unwrap()
}

/// The webhook configurations `env.config`, pointing at the webhook Service in `env.ns`. They
/// have no rules (and select only the test's namespace): the apiserver never calls them.
fn webhook_configs(env: &Env) -> (MutatingWebhookConfiguration, ValidatingWebhookConfiguration) {
    let hooks = |names: &[&str], path: &str| -> Value {
        Value::Array(
            names
                .iter()
                .map(|n| {
                    json!({"name": n, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                       "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": env.ns}},
                       "clientConfig": {"service": {"name": SERVICE, "namespace": env.ns, "path": path}}})
                })
                .collect(),
        )
    };
    let m = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": env.config},
        "webhooks": hooks(&["mcachebackend.inferencecache.io", "mpod.inferencecache.io"], "/mutate-pod"),
    }))
    .unwrap();
    let v = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": env.config},
        "webhooks": hooks(&["vcachebackend.inferencecache.io"], "/validate-cachebackend"),
    }))
    .unwrap();
    (m, v)
}

fn config(env: &Env, identity: &str) -> InClusterConfig {
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
            config_name: Some(env.config.clone()),
            service: Some(SERVICE.into()),
            tls_secret: Some(SECRET.into()),
            ca_bundle_resync: Duration::from_millis(200),
            ..Default::default()
        },
        leader_election: LeaderElectionSettings {
            namespace: env.ns.clone(),
            lease_name: "inference-cache-controller".into(),
            election,
        },
        agent_service_account: ServiceAccountRef {
            namespace: env.ns.clone(),
            name: "inference-cache-agent".into(),
        },
        token_audience: "inference-cache".into(),
        token_cache_ttl: Duration::from_secs(60),
        review_source_limit: Default::default(),
        data_plane_auth: Some(Default::default()),
        limits: Default::default(),
        nodes: Default::default(),
        model_cache: Some(ModelCacheConfig::default()),
        functional_probe: true,
        tokenizers: Default::default(),
    }
}

async fn start(
    env: &Env,
    client: kube::Client,
    identity: &str,
) -> (Running, tokio::sync::oneshot::Sender<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let running = incluster::start(client, config(env, identity), Overrides::default(), async {
        let _ = rx.await;
    })
    .await
    .unwrap();
    (running, tx)
}

fn review(ns: &str, uid: &str, kind: &str, object: Value) -> Vec<u8> {
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
            "namespace": ns, "operation": "CREATE",
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

async fn ca_bundles(client: &kube::Client, config: &str) -> Vec<String> {
    let m: MutatingWebhookConfiguration = Api::all(client.clone()).get(config).await.unwrap();
    let v: ValidatingWebhookConfiguration = Api::all(client.clone()).get(config).await.unwrap();
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
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_serves_webhooks_with_a_shared_self_signed_ca_kept_in_both_configurations() {
    let env = env().await;
    let admin = env.bare.admin.clone();
    let ns = env.ns.clone();
    let (mutating, validating) = webhook_configs(&env);
    let mutating_api: Api<MutatingWebhookConfiguration> = Api::all(admin.clone());
    let validating_api: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    mutating_api
        .create(&PostParams::default(), &mutating)
        .await
        .unwrap();
    validating_api
        .create(&PostParams::default(), &validating)
        .await
        .unwrap();
    Api::<CacheBackend>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &backend())
        .await
        .unwrap();
    create_with_status(
        &Api::<ModelCache>::namespaced(admin.clone(), &ns),
        &model_cache(&ns),
    )
    .await;
    let client = client(&env).await;

    let (first, stop_first) = start(&env, client.clone(), "replica-1").await;
    let addr = first.webhook_addr.expect("webhooks are served");

    // The bundle is in the Secret, and its CA in every webhook of both configurations.
    let secret: Secret = Api::namespaced(admin.clone(), &ns)
        .get(SECRET)
        .await
        .unwrap();
    let data = secret.data.unwrap();
    let ca_pem = String::from_utf8(data[ca_bundle::CA_KEY].0.clone()).unwrap();
    assert!(ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    eventually("caBundle on all three webhooks", || {
        let admin = admin.clone();
        let ca_pem = ca_pem.clone();
        let config = env.config.clone();
        async move { ca_bundles(&admin, &config).await == vec![ca_pem.clone(); 3] }
    })
    .await;

    // The apiserver's view: TLS to the service name, trusting only the caBundle.
    let https = WebhookClient::new(addr, &ca_pem, &format!("{SERVICE}.{ns}.svc")).unwrap();
    let mut conn = https.connect().await.unwrap();

    // A pod matching the live CacheBackend is wired, and its ModelCache claim mounted.
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "mistral-0", "namespace": ns, "labels": {"app": "mistral-7b"},
                     "annotations": {"inferencecache.io/model-cache": "llama"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                 "args": ["--model", "mistralai/Mistral-7B-Instruct-v0.3"]}]}});
    let (status, body) = conn
        .post("/mutate-pod", &review(&ns, "uid-pod", "Pod", pod.clone()))
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
        format!("{ns}/mistral")
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
        .post("/mutate-pod", &review(&ns, "uid-pod-2", "Pod", wired))
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(v["response"].get("patch").is_none(), "{v}");
    assert!(v["response"].get("patchType").is_none(), "{v}");

    // The CacheBackend webhooks: an invalid object is refused with a field-scoped message.
    let bad = json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "bad", "namespace": ns},
        "spec": {"runtime": "VLLM", "replicas": 0, "autoscaling": {"maxReplicas": 3}}});
    let (_, body) = conn
        .post(
            "/validate-cachebackend",
            &review(&ns, "uid-cb", "CacheBackend", bad),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], false, "{v}");
    assert_eq!(v["response"]["uid"], "uid-cb");

    // A second replica serves a certificate of the same CA (it reads the Secret).
    let (second, stop_second) = start(&env, client.clone(), "replica-2").await;
    let https2 = WebhookClient::new(
        second.webhook_addr.unwrap(),
        &ca_pem,
        &format!("{SERVICE}.{ns}.svc"),
    )
    .unwrap();
    let mut conn2 = https2.connect().await.unwrap();
    let (status, _) = conn2.get("/healthz").await.unwrap();
    assert_eq!(status, 200);

    // A `helm upgrade` that resets the caBundle is repaired within the resync interval.
    let mut m = mutating_api.get(&env.config).await.unwrap();
    for w in m.webhooks.iter_mut().flatten() {
        w.client_config.ca_bundle = None;
    }
    mutating_api
        .replace(&env.config, &PostParams::default(), &m)
        .await
        .unwrap();
    eventually("caBundle restored", || {
        let admin = admin.clone();
        let ca_pem = ca_pem.clone();
        let config = env.config.clone();
        async move { ca_bundles(&admin, &config).await == vec![ca_pem.clone(); 3] }
    })
    .await;

    stop_first.send(()).unwrap();
    stop_second.send(()).unwrap();
    first.wait().await.unwrap();
    second.wait().await.unwrap();
    mutating_api
        .delete(&env.config, &DeleteParams::default())
        .await
        .unwrap();
    validating_api
        .delete(&env.config, &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_secret_without_a_bundle_stops_the_start_with_a_clear_error() {
    let env = env().await;
    let foreign: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": SECRET},
        "data": {"something": "eA=="}
    }))
    .unwrap();
    Api::<Secret>::namespaced(env.bare.admin.clone(), &env.ns)
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();
    let client = client(&env).await;
    let (_tx, rx) = tokio::sync::oneshot::channel::<()>();
    let err = match incluster::start(
        client,
        config(&env, "replica-1"),
        Overrides::default(),
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
