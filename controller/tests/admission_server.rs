//! The real HTTPS admission server on 127.0.0.1: real AdmissionReview JSON in, the exact
//! `admission.k8s.io/v1` wire format out (TESTING.md "Admission wire format"), self-signed and
//! hot-reloaded file certificates, and the Pod webhook's fail-open paths.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use ic_controller::adapters::Registry;
use ic_controller::admission::review::AdmissionRequest;
use ic_controller::admission::server::{self, ServerConfig, WebhookClient};
use ic_controller::admission::tls::{self, SelfSignedOptions, TlsSource};
use ic_controller::admission::{
    Admission, PodDecision, PodMutator, Route, StaticBackends, UnwiredPods,
};
use ic_shared::crd::CacheBackend;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde_json::{json, Value};

fn admission(pods: Arc<dyn PodMutator>) -> Arc<Admission> {
    Arc::new(Admission::new(
        Arc::new(Registry::builtin()),
        Arc::new(StaticBackends::default()),
        pods,
    ))
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn self_signed() -> TlsSource {
    TlsSource::SelfSigned(SelfSignedOptions {
        subject_alt_names: vec!["127.0.0.1".into(), "localhost".into()],
        write_dir: None,
    })
}

fn review(uid: &str, operation: &str, kind: &str, object: Value, old: Option<Value>) -> Vec<u8> {
    let (group, version, resource) = if kind == "Pod" {
        ("", "v1", "pods")
    } else {
        ("inferencecache.io", "v1alpha1", "cachebackends")
    };
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": object.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
            "namespace": "team-a",
            "operation": operation,
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    }))
    .unwrap()
}

fn cb(spec: Value) -> Value {
    json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
           "metadata": {"name": "cache", "namespace": "team-a", "uid": "5e1f"}, "spec": spec})
}

fn pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "vllm-", "namespace": "team-a", "labels": {"app": "vllm"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                    "args": ["--model", "Qwen/Qwen3-8B"]}]}})
}

#[tokio::test]
async fn https_server_speaks_the_apiserver_wire_format() {
    let running = server::start(
        admission(Arc::new(UnwiredPods)),
        ServerConfig::new(loopback(), self_signed()),
    )
    .await
    .unwrap();
    let ca = running
        .ca_pem
        .clone()
        .expect("self-signed mode returns the CA");
    let client = WebhookClient::new(running.local_addr, &ca, "127.0.0.1").unwrap();
    let mut conn = client.connect().await.unwrap();

    let (status, body) = conn.get("/healthz").await.unwrap();
    assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));

    // Defaulting: a base64 JSON Patch with patchType, uid echoed.
    let (status, body) = conn
        .post(
            "/mutate-cachebackend",
            &review(
                "uid-mutate",
                "CREATE",
                "CacheBackend",
                cb(json!({"runtime": "VLLM"})),
                None,
            ),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert!(text.starts_with(r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"uid-mutate","allowed":true,"patch":"W3si"#), "{text}");
    assert!(text.contains(r#""patchType":"JSONPatch""#), "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let patch = base64::engine::general_purpose::STANDARD
        .decode(v["response"]["patch"].as_str().unwrap())
        .unwrap();
    let patch: Value = serde_json::from_slice(&patch).unwrap();
    assert!(patch
        .as_array()
        .unwrap()
        .iter()
        .any(|op| op["path"] == "/spec/integration"));

    // A fully defaulted object: no patch, hence no patchType.
    let full = cb(json!({"runtime": "VLLM",
        "integration": {"mode": "Offload", "role": "ReadWrite", "failOpen": true},
        "observation": {"firstEventTimeout": "5m"}}));
    let (_, body) = conn
        .post(
            "/mutate-cachebackend",
            &review("uid-2", "CREATE", "CacheBackend", full.clone(), None),
        )
        .await
        .unwrap();
    let text = String::from_utf8(body).unwrap();
    assert_eq!(
        text,
        r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"uid-2","allowed":true}}"#
    );

    // Validation: admitted with warnings as plain strings.
    let mooncake = cb(json!({"runtime": "VLLM",
        "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}}));
    let (_, body) = conn
        .post(
            "/validate-cachebackend",
            &review("uid-3", "CREATE", "CacheBackend", mooncake, None),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true);
    assert!(v["response"]["warnings"][0]
        .as_str()
        .unwrap()
        .starts_with("spec.integration.engineHostNetwork is not set"));
    assert!(v["response"].get("patchType").is_none());

    // Validation: denied, 422 Invalid with field-scoped causes.
    let bad = cb(
        json!({"runtime": "SGLang", "integration": {"role": "ReadOnly"},
        "remoteStorage": {"provider": "Redis", "ownership": "External", "endpoint": "lm://redis:6379"}}),
    );
    let (_, body) = conn
        .post(
            "/validate-cachebackend",
            &review("uid-4", "CREATE", "CacheBackend", bad, None),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    let r = &v["response"];
    assert_eq!(r["uid"], "uid-4");
    assert_eq!(r["allowed"], false);
    assert_eq!(r["status"]["code"], 422);
    assert_eq!(r["status"]["reason"], "Invalid");
    assert_eq!(r["status"]["status"], "Failure");
    assert!(r["status"]["message"]
        .as_str()
        .unwrap()
        .starts_with(r#"CacheBackend.inferencecache.io "cache" is invalid: ["#));
    let causes = r["status"]["details"]["causes"].as_array().unwrap();
    let fields: Vec<&str> = causes
        .iter()
        .map(|c| c["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["spec.remoteStorage.endpoint", "spec.integration.role"]
    );
    assert_eq!(causes[0]["reason"], "FieldValueInvalid");
    assert_eq!(causes[1]["reason"], "FieldValueNotSupported");
    assert_eq!(r["status"]["details"]["kind"], "CacheBackend");
    assert_eq!(r["status"]["details"]["group"], "inferencecache.io");
    assert!(r.get("patch").is_none() && r.get("patchType").is_none());

    // UPDATE keeps the old violations out.
    let old = cb(json!({"runtime": "SGLang",
        "remoteStorage": {"provider": "Redis", "ownership": "External", "endpoint": "redis:0"}}));
    let mut new = old.clone();
    new["metadata"]["labels"] = json!({"x": "y"});
    let (_, body) = conn
        .post(
            "/validate-cachebackend",
            &review("uid-5", "UPDATE", "CacheBackend", new, Some(old)),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true, "{v}");

    // Pod webhook: always allowed; no patch → no patchType; the reason in status.message.
    let (_, body) = conn
        .post(
            "/mutate-pod",
            &review("uid-pod", "CREATE", "Pod", pod(), None),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["uid"], "uid-pod");
    assert_eq!(v["response"]["allowed"], true);
    assert_eq!(v["response"]["status"]["code"], 200);
    assert!(v["response"].get("patchType").is_none());

    // Undecodable bodies: CacheBackend routes deny with 400 (uid recovered), the Pod route allows.
    let junk = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"uid-junk","operation":17}}"#;
    let (status, body) = conn.post("/validate-cachebackend", junk).await.unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["response"]["uid"], "uid-junk");
    assert_eq!(v["response"]["allowed"], false);
    assert_eq!(v["response"]["status"]["code"], 400);
    let (_, body) = conn.post("/mutate-pod", b"not json at all").await.unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true);

    running.shutdown();
    running.wait().await.unwrap();
}

fn der(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec()
}

#[tokio::test]
async fn file_certificates_are_hot_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let sans = vec!["127.0.0.1".to_string(), "localhost".to_string()];
    let first = tls::generate_self_signed(&sans).unwrap();
    let paths = tls::write_bundle(dir.path(), &first).unwrap();
    let expiry = prometheus::IntGauge::new("expiry", "test").unwrap();
    let mut cfg = ServerConfig::new(
        loopback(),
        TlsSource::Files {
            cert: paths.cert.clone(),
            key: paths.key.clone(),
            reload_interval: Duration::from_millis(50),
        },
    );
    cfg.cert_expiry = Some(expiry.clone());
    let running = server::start(admission(Arc::new(UnwiredPods)), cfg)
        .await
        .unwrap();
    assert!(running.ca_pem.is_none());
    // The expiry metric reads the served certificate: ten years from yesterday.
    let first_not_after = tls::leaf_not_after_unix(first.cert_pem.as_bytes()).unwrap();
    assert_eq!(expiry.get(), first_not_after);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let years = (first_not_after - now) as f64 / (365.25 * 86_400.0);
    assert!((9.9..10.1).contains(&years), "{years} years");
    // A sentinel the reload must overwrite (both pairs expire on the same day).
    expiry.set(1);
    let addr = running.local_addr;

    let c1 = WebhookClient::new(addr, &first.ca_pem, "localhost").unwrap();
    let mut conn = c1.connect().await.unwrap();
    assert_eq!(conn.peer_certificate().unwrap(), der(&first.cert_pem));
    let (status, _) = conn.get("/healthz").await.unwrap();
    assert_eq!(status, 200);

    // A half-rotated pair (new certificate, old key) is refused; the old one keeps serving.
    let second = tls::generate_self_signed(&sans).unwrap();
    std::fs::write(&paths.cert, &second.cert_pem).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut conn_mid = c1.connect().await.unwrap();
    assert_eq!(conn_mid.peer_certificate().unwrap(), der(&first.cert_pem));
    assert_eq!(conn_mid.get("/healthz").await.unwrap().0, 200);

    // Completing the rotation: new connections get the new certificate.
    tls::write_bundle(dir.path(), &second).unwrap();
    let c2 = WebhookClient::new(addr, &second.ca_pem, "localhost").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(mut c) = c2.connect().await {
            assert_eq!(c.peer_certificate().unwrap(), der(&second.cert_pem));
            let (status, body) = c
                .post(
                    "/mutate-pod",
                    &review("uid-rot", "CREATE", "Pod", pod(), None),
                )
                .await
                .unwrap();
            assert_eq!(status, 200);
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["response"]["allowed"], true);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the rotated certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The metric follows the reload (the half-rotated pair never set it).
    assert_eq!(
        expiry.get(),
        tls::leaf_not_after_unix(second.cert_pem.as_bytes()).unwrap()
    );
    // The old CA no longer verifies new connections.
    assert!(c1.connect().await.is_err());
    // The connection opened before the rotation still works.
    assert_eq!(conn.get("/healthz").await.unwrap().0, 200);

    running.shutdown();
    running.wait().await.unwrap();
}

#[test]
fn self_signed_ca_goes_into_webhook_configurations() {
    let b = tls::generate_self_signed(&tls::service_dns_names(
        "inference-cache-webhook",
        "ic-system",
    ))
    .unwrap();
    let mut cfg = json!({"apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "webhooks": [{"name": "vcachebackend.inferencecache.io",
                      "clientConfig": {"service": {"name": "inference-cache-webhook",
                                                   "namespace": "ic-system",
                                                   "path": "/validate-cachebackend"}}}]});
    assert_eq!(tls::set_ca_bundle(&mut cfg, &b.ca_pem), 1);
    let bundle = cfg["webhooks"][0]["clientConfig"]["caBundle"]
        .as_str()
        .unwrap();
    assert_eq!(bundle, b.ca_bundle_base64());
    let pem = base64::engine::general_purpose::STANDARD
        .decode(bundle)
        .unwrap();
    assert_eq!(String::from_utf8(pem).unwrap(), b.ca_pem);
}

struct Panics;
impl PodMutator for Panics {
    fn mutate(&self, _: &AdmissionRequest, _: &Value, _: &[Arc<CacheBackend>]) -> PodDecision {
        #[allow(clippy::panic)]
        {
            panic!("adapter bug")
        }
    }
}

struct BadPatch;
impl PodMutator for BadPatch {
    fn mutate(&self, _: &AdmissionRequest, _: &Value, _: &[Arc<CacheBackend>]) -> PodDecision {
        PodDecision {
            reason: "wired".into(),
            patch: serde_json::from_value(
                json!([{"op": "replace", "path": "/spec/nope/x", "value": 1}]),
            )
            .unwrap(),
            warnings: vec![],
        }
    }
}

struct NotAPatch;
impl PodMutator for NotAPatch {
    fn mutate(&self, _: &AdmissionRequest, _: &Value, _: &[Arc<CacheBackend>]) -> PodDecision {
        PodDecision {
            reason: "wired".into(),
            patch: vec![json!({"op": "frobnicate", "path": "/x"})],
            warnings: vec![],
        }
    }
}

struct Labels;
impl PodMutator for Labels {
    fn mutate(
        &self,
        _: &AdmissionRequest,
        _: &Value,
        backends: &[Arc<CacheBackend>],
    ) -> PodDecision {
        PodDecision {
            reason: format!("saw {} backends", backends.len()),
            patch: serde_json::from_value(json!([
                {"op": "add", "path": "/metadata/annotations", "value": {"inferencecache.io/injected-by": "team-a/cache"}}
            ]))
            .unwrap(),
            warnings: vec!["w".into()],
        }
    }
}

#[test]
fn pod_webhook_never_blocks_a_pod() {
    let body = review("uid-p", "CREATE", "Pod", pod(), None);
    for pods in [
        Arc::new(Panics) as Arc<dyn PodMutator>,
        Arc::new(BadPatch),
        Arc::new(NotAPatch),
    ] {
        let a = admission(pods);
        let out = a.handle_bytes(Route::MutatePod, &body);
        let v: Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(v["response"]["allowed"], true, "{v}");
        assert_eq!(v["response"]["uid"], "uid-p");
        assert!(v["response"].get("patch").is_none(), "{v}");
        assert!(v["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("admitted unwired"));
    }
    // UPDATE and non-pod objects pass through.
    let a = admission(Arc::new(Labels));
    let upd = review("uid-u", "UPDATE", "Pod", pod(), Some(pod()));
    let v: Value = serde_json::from_slice(&a.handle_bytes(Route::MutatePod, &upd).body).unwrap();
    assert_eq!(v["response"]["allowed"], true);
    assert!(v["response"].get("patch").is_none());
}

#[test]
fn pod_webhook_lists_backends_of_the_pod_namespace() {
    let mut mine: CacheBackend = serde_json::from_value(cb(json!({"runtime": "VLLM"}))).unwrap();
    mine.metadata.namespace = Some("team-a".into());
    let mut other = mine.clone();
    other.metadata.namespace = Some("team-b".into());
    let a = Admission::new(
        Arc::new(Registry::builtin()),
        Arc::new(StaticBackends::new([mine, other])),
        Arc::new(Labels),
    );
    let out = a.handle_bytes(Route::MutatePod, &review("u", "CREATE", "Pod", pod(), None));
    let v: Value = serde_json::from_slice(&out.body).unwrap();
    let r = &v["response"];
    assert_eq!(r["status"]["message"], "saw 1 backends");
    assert_eq!(r["patchType"], "JSONPatch");
    assert_eq!(r["warnings"], json!(["w"]));
    assert!(r["patch"].as_str().unwrap().starts_with("W3si"));
}

#[tokio::test]
async fn fixture_pod_is_wired_over_https_and_readmission_has_no_patch() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/pods/01-vllm-docs-nvidia-sh-c.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let pod: Value = serde_yaml::from_str(&text).unwrap();
    let backend: CacheBackend = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "mistral", "namespace": "team-a", "uid": "u-1"},
        "spec": {"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer",
                 "ownership": "External", "endpoint": "lm://lmcache:65432"},
                 "engineSelector": {"matchLabels": {"app": "mistral-7b"}}}}))
    .unwrap();
    let a = Arc::new(Admission::new(
        Arc::new(Registry::builtin()),
        Arc::new(StaticBackends::new([backend])),
        Arc::new(ic_controller::admission::PodWebhook::default()),
    ));
    let running = server::start(a, ServerConfig::new(loopback(), self_signed()))
        .await
        .unwrap();
    let client = WebhookClient::new(
        running.local_addr,
        running.ca_pem.as_deref().unwrap(),
        "localhost",
    )
    .unwrap();
    let mut conn = client.connect().await.unwrap();
    let (_, body) = conn
        .post(
            "/mutate-pod",
            &review("uid-w", "CREATE", "Pod", pod.clone(), None),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    let r = &v["response"];
    assert_eq!(r["allowed"], true);
    assert_eq!(r["patchType"], "JSONPatch", "{v}");
    let ops: Vec<json_patch::PatchOperation> = serde_json::from_slice(
        &base64::engine::general_purpose::STANDARD
            .decode(r["patch"].as_str().unwrap())
            .unwrap(),
    )
    .unwrap();
    let mut wired = pod;
    json_patch::patch(&mut wired, &ops).unwrap();
    assert_eq!(
        wired["metadata"]["annotations"]["inferencecache.io/injected-by"],
        "team-a/mistral"
    );
    let (_, body) = conn
        .post(
            "/mutate-pod",
            &review("uid-w2", "CREATE", "Pod", wired, None),
        )
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true);
    assert!(v["response"].get("patch").is_none(), "{v}");
    assert!(v["response"].get("patchType").is_none(), "{v}");
    running.shutdown();
    running.wait().await.unwrap();
}

#[tokio::test]
async fn a_shared_pem_pair_is_served() {
    // Several replicas serving one self-signed bundle (kept in a Secret) present the same CA.
    let b = tls::generate_self_signed(&["localhost".to_string()]).unwrap();
    let running = server::start(
        admission(Arc::new(UnwiredPods)),
        ServerConfig::new(
            loopback(),
            TlsSource::Pem {
                cert_pem: b.cert_pem.clone(),
                key_pem: b.key_pem.clone(),
                ca_pem: Some(b.ca_pem.clone()),
            },
        ),
    )
    .await
    .unwrap();
    assert_eq!(running.ca_pem.as_deref(), Some(b.ca_pem.as_str()));
    let c = WebhookClient::new(running.local_addr, &b.ca_pem, "localhost").unwrap();
    let mut conn = c.connect().await.unwrap();
    assert_eq!(conn.peer_certificate().unwrap(), der(&b.cert_pem));
    assert_eq!(conn.get("/healthz").await.unwrap().0, 200);
    running.shutdown();
    running.wait().await.unwrap();
}
