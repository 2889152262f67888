//! Rotation of the self-signed webhook certificate (issue 36; docs/admission.md
//! "Certificates") against the bare real apiserver (tests/bare_apiserver_support/): the shared
//! Secret, its `resourceVersion` conflicts and the webhook configurations' `caBundle` are the
//! apiserver's own; the admission server runs in-process, and a TLS client checks the
//! certificate it actually serves after each step.
//!
//! Time is injected: the Secrets are seeded with certificates issued in the past (so that the
//! real clock of the TLS client still accepts them) and [`CertKeeper::tick`] is given the
//! instant to decide at; nothing sleeps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bare_apiserver_support;
mod incluster_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bare_apiserver_support::{unique, BareCluster, Faults, Step};
use futures::FutureExt;
use ic_controller::adapters::Registry as AdapterRegistry;
use ic_controller::admission::ca_bundle::{
    self, CertKeeper, CertMetrics, RotationPolicy, SelfSignedSecret, StoredBundle,
};
use ic_controller::admission::server::{self, RunningServer, ServerConfig};
use ic_controller::admission::tls::{self, TlsSource};
use ic_controller::admission::{Admission, StaticBackends, UnwiredPods};
use incluster_support::{controller_client, ControllerGrants};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;

const DAY: i64 = 86_400;
const SECRET: &str = "inference-cache-webhook-self-signed";
const SERVICE: &str = "ic-webhook";

struct Env {
    bare: BareCluster,
    ns: String,
    config: String,
}

async fn env() -> Env {
    let bare = BareCluster::get().await;
    let ns = bare.namespace("certrot").await;
    let config = unique("ic-certrot");
    // Webhook configurations without rules: the apiserver never calls them; only their
    // caBundle matters here.
    let hooks = |names: &[&str]| {
        names
            .iter()
            .map(|n| {
                json!({"name": n, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "clientConfig": {"service": {"name": SERVICE, "namespace": ns, "path": "/x"}}})
            })
            .collect::<Vec<_>>()
    };
    let m: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": config}, "webhooks": hooks(&["m1.inferencecache.io", "m2.inferencecache.io"])}))
    .unwrap();
    let v: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": config}, "webhooks": hooks(&["v1.inferencecache.io"])}))
    .unwrap();
    Api::<MutatingWebhookConfiguration>::all(bare.admin.clone())
        .create(&PostParams::default(), &m)
        .await
        .unwrap();
    Api::<ValidatingWebhookConfiguration>::all(bare.admin.clone())
        .create(&PostParams::default(), &v)
        .await
        .unwrap();
    Env { bare, ns, config }
}

fn now() -> i64 {
    ca_bundle::unix_now()
}

fn sans(ns: &str) -> Vec<String> {
    tls::service_dns_names(SERVICE, ns)
}

fn settings(env: &Env) -> SelfSignedSecret {
    SelfSignedSecret {
        namespace: env.ns.clone(),
        name: SECRET.to_string(),
        subject_alt_names: sans(&env.ns),
        webhook_config: Some(env.config.clone()),
        policy: RotationPolicy::default(),
    }
}

/// A bundle issued `age_days` ago: a CA of `ca_days` and a leaf of `leaf_days`.
fn issued(ns: &str, age_days: i64, ca_days: u64, leaf_days: u64) -> StoredBundle {
    let at = now() - age_days * DAY;
    let ca = tls::generate_ca(at, Duration::from_secs(ca_days * 86_400)).unwrap();
    let leaf =
        tls::issue_serving(&ca, &sans(ns), at, Duration::from_secs(leaf_days * 86_400)).unwrap();
    StoredBundle {
        ca_pem: Some(ca.cert_pem),
        ca_key_pem: Some(ca.key_pem),
        cert_pem: Some(leaf.cert_pem),
        key_pem: Some(leaf.key_pem),
        updated_at: Some(at),
    }
}

async fn seed(env: &Env, b: &StoredBundle) {
    Api::<Secret>::namespaced(env.bare.admin.clone(), &env.ns)
        .create(&PostParams::default(), &b.to_secret(&env.ns, SECRET))
        .await
        .unwrap();
}

async fn stored(env: &Env) -> (StoredBundle, String) {
    let s: Secret = Api::namespaced(env.bare.admin.clone(), &env.ns)
        .get(SECRET)
        .await
        .unwrap();
    let rv = s.metadata.resource_version.clone().unwrap();
    (StoredBundle::from_secret(&s), rv)
}

/// The `caBundle` of every webhook of both configurations (three).
async fn ca_bundles(env: &Env) -> Vec<String> {
    let admin = env.bare.admin.clone();
    let m: MutatingWebhookConfiguration = Api::all(admin.clone()).get(&env.config).await.unwrap();
    let v: ValidatingWebhookConfiguration = Api::all(admin).get(&env.config).await.unwrap();
    let m = m
        .webhooks
        .unwrap_or_default()
        .into_iter()
        .map(|w| w.client_config);
    let v = v
        .webhooks
        .unwrap_or_default()
        .into_iter()
        .map(|w| w.client_config);
    m.chain(v)
        .map(|c| String::from_utf8(c.ca_bundle.map(|b| b.0).unwrap_or_default()).unwrap())
        .collect()
}

fn certs(pem: &str) -> Vec<Vec<u8>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .map(|c| c.unwrap().to_vec())
        .collect()
}

/// The in-process admission server, serving `b`'s pair.
async fn serve(b: &StoredBundle) -> RunningServer {
    let admission = Arc::new(Admission::new(
        Arc::new(AdapterRegistry::builtin()),
        Arc::new(StaticBackends::default()),
        Arc::new(UnwiredPods),
    ));
    let tls = TlsSource::Pem {
        cert_pem: b.cert_pem.clone().unwrap(),
        key_pem: b.key_pem.clone().unwrap(),
        ca_pem: b.ca_pem.clone(),
    };
    server::start(
        admission,
        ServerConfig::new("127.0.0.1:0".parse().unwrap(), tls),
    )
    .await
    .unwrap()
}

/// The leaf certificate (DER) `addr` serves to a client that trusts only `ca_pem` and dials
/// the Service name, as the apiserver does; `Err` when the handshake fails.
async fn served_leaf(addr: SocketAddr, ca_pem: &str, ns: &str) -> Result<Vec<u8>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from(format!("{SERVICE}.{ns}.svc")).unwrap();
    let stream = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, conn) = stream.get_ref();
    Ok(conn.peer_certificates().unwrap()[0].to_vec())
}

fn secret_writes(faults: &Faults) -> Vec<String> {
    faults
        .calls()
        .into_iter()
        .filter(|c| c.has("secrets") && c.method != "GET")
        .map(|c| format!("{} {}", c.method, c.path))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaf_within_the_renewal_window_is_renewed_by_the_same_ca_and_served_without_restart() {
    let env = env().await;
    // 250 days into a one-year leaf: a third of it is left, renewal is due.
    let old = issued(&env.ns, 250, 3650, 365);
    seed(&env, &old).await;
    let running = serve(&old).await;
    let ca = old.ca_pem.clone().unwrap();
    assert_eq!(
        served_leaf(running.local_addr, &ca, &env.ns).await.unwrap(),
        certs(old.cert_pem.as_ref().unwrap())[0]
    );
    let registry = prometheus::Registry::new();
    let expiry = prometheus::IntGauge::new("expiry", "h").unwrap();
    let mut keeper = CertKeeper::new(env.bare.admin.clone(), settings(&env))
        .with_metrics(CertMetrics::register(&registry).unwrap());
    keeper.serve_into(running.rustls.clone(), Some(expiry.clone()));

    let report = keeper.tick(now()).await.unwrap();
    assert_eq!(report.action, Some("issue_leaf"), "{report:?}");
    assert!(report.reloaded);
    let (new, _) = stored(&env).await;
    assert_ne!(new.cert_pem, old.cert_pem);
    assert_eq!(new.ca_pem, old.ca_pem, "same CA");
    assert_eq!(new.ca_key_pem, old.ca_key_pem);
    assert_eq!(
        ca_bundles(&env).await,
        vec![ca.clone(); 3],
        "caBundle: the one CA"
    );
    // The running server serves the new leaf, to a client trusting the unchanged caBundle.
    let served = served_leaf(running.local_addr, &ca, &env.ns).await.unwrap();
    assert_eq!(served, certs(new.cert_pem.as_ref().unwrap())[0]);
    let not_after = tls::leaf_not_after_unix(new.cert_pem.as_ref().unwrap().as_bytes()).unwrap();
    assert_eq!(expiry.get(), not_after);
    assert!(not_after > now() + 364 * DAY, "a fresh one-year leaf");
    // Done: the next round writes nothing.
    assert_eq!(keeper.tick(now()).await.unwrap().action, None);
    running.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_leaf_is_left_alone() {
    let env = env().await;
    let fresh = issued(&env.ns, 10, 3650, 365);
    seed(&env, &fresh).await;
    let faults = Faults::new();
    let mut keeper = CertKeeper::new(env.bare.client_with(faults.clone()), settings(&env));
    for _ in 0..2 {
        let report = keeper.tick(now()).await.unwrap();
        assert_eq!(report.action, None, "{report:?}");
        assert!(report.problems.is_empty(), "{report:?}");
    }
    assert_eq!(secret_writes(&faults), Vec::<String>::new());
    assert!(faults
        .calls()
        .iter()
        .any(|c| c.is("GET", &format!("/secrets/{SECRET}"))));
    assert_eq!(stored(&env).await.0, fresh);
    assert_eq!(
        keeper.served().unwrap().cert_pem,
        fresh.cert_pem.clone().unwrap()
    );
    // Its CA was put into the webhook configurations all the same.
    assert_eq!(
        ca_bundles(&env).await,
        vec![fresh.ca_pem.clone().unwrap(); 3]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_racing_a_renewal_end_with_one_bundle() {
    let env = env().await;
    let old = issued(&env.ns, 300, 3650, 365);
    seed(&env, &old).await;
    let (_, rv_before) = stored(&env).await;

    // Replica B's whole round lands between replica A's read and its write.
    let b_served: Arc<Mutex<Option<String>>> = Arc::default();
    let faults = Faults::new();
    let fired = Arc::new(AtomicBool::new(false));
    {
        let (admin, cfg, b_served, fired) = (
            env.bare.admin.clone(),
            settings(&env),
            b_served.clone(),
            fired.clone(),
        );
        faults.rule(move |c| {
            if c.is("PUT", &format!("/secrets/{SECRET}")) && !fired.swap(true, Ordering::SeqCst) {
                let (admin, cfg, b_served) = (admin.clone(), cfg.clone(), b_served.clone());
                Step::Before(
                    async move {
                        let mut b = CertKeeper::new(admin, cfg);
                        let report = b.tick(now()).await.unwrap();
                        assert_eq!(report.action, Some("issue_leaf"), "{report:?}");
                        *b_served.lock().unwrap() = Some(b.served().unwrap().cert_pem.clone());
                    }
                    .boxed(),
                )
            } else {
                Step::Pass
            }
        });
    }
    let registry = prometheus::Registry::new();
    let metrics = CertMetrics::register(&registry).unwrap();
    let mut a = CertKeeper::new(env.bare.client_with(faults.clone()), settings(&env))
        .with_metrics(metrics.clone());
    let report = a.tick(now()).await.unwrap();
    assert!(fired.load(Ordering::SeqCst), "B ran before A's write");
    assert!(
        report.conflict,
        "A's write was refused with 409: {report:?}"
    );
    assert_eq!(report.action, None);
    assert_eq!(
        metrics
            .writes
            .with_label_values(&["issue_leaf", "conflict"])
            .get(),
        1
    );

    // One bundle: the Secret holds B's leaf, and both replicas serve it.
    let (now_stored, rv_after) = stored(&env).await;
    let b_leaf = b_served.lock().unwrap().clone().unwrap();
    assert_eq!(now_stored.cert_pem.as_deref(), Some(b_leaf.as_str()));
    assert_eq!(a.served().unwrap().cert_pem, b_leaf);
    assert_ne!(Some(b_leaf), old.cert_pem);
    assert_eq!(now_stored.ca_pem, old.ca_pem);
    assert_ne!(rv_after, rv_before);
    // Exactly one write landed (B's): A sent one PUT, refused, and did not retry.
    assert_eq!(
        secret_writes(&faults).len(),
        1,
        "{:?}",
        secret_writes(&faults)
    );
    assert_eq!(a.tick(now()).await.unwrap().action, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_near_expiry_goes_through_the_overlap_under_the_charts_grants() {
    let env = env().await;
    // The chart's self-signed grants (chart/templates/controller-rbac.yaml): the Secret by name
    // (get, update), create; the webhook configurations by name (get, update).
    let client = controller_client(
        &env.bare,
        &env.ns,
        ControllerGrants {
            namespaced: vec![
                json!({"apiGroups": [""], "resources": ["secrets"], "resourceNames": [SECRET],
                       "verbs": ["get", "update"]}),
                json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}),
            ],
            cluster: vec![json!({"apiGroups": ["admissionregistration.k8s.io"],
                "resources": ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
                "resourceNames": [env.config], "verbs": ["get", "update"]})],
            ..Default::default()
        },
    )
    .await;
    // Day 25 of a 30-day CA whose leaf runs to the CA's end.
    let old = issued(&env.ns, 25, 30, 30);
    seed(&env, &old).await;
    let old_ca = old.ca_pem.clone().unwrap();
    let running = serve(&old).await;
    let mut keeper = CertKeeper::new(client, settings(&env));
    keeper.serve_into(running.rustls.clone(), None);
    let overlap = RotationPolicy::default().overlap.as_secs() as i64;
    let t1 = now();

    // Step 2: a new CA first in ca.crt, the old kept; caBundle carries both; the old leaf serves.
    let r = keeper.tick(t1).await.unwrap();
    assert_eq!(r.action, Some("add_ca"), "{r:?}");
    let (s1, _) = stored(&env).await;
    let both = s1.ca_pem.clone().unwrap();
    assert_eq!(certs(&both).len(), 2);
    assert_eq!(
        certs(&both)[1],
        certs(&old_ca)[0],
        "the old CA kept after the new"
    );
    let new_ca = tls::parse_certs(both.as_bytes()).unwrap();
    let new_ca_pem = {
        let der = &certs(&both)[0];
        format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            base64_encode(der)
        )
    };
    assert!(new_ca[0].not_after > now() + 3000 * DAY);
    assert_eq!(ca_bundles(&env).await, vec![both.clone(); 3]);
    assert_eq!(s1.cert_pem, old.cert_pem);
    assert_eq!(
        served_leaf(running.local_addr, &both, &env.ns)
            .await
            .unwrap(),
        certs(old.cert_pem.as_ref().unwrap())[0]
    );

    // Within the overlap nothing more happens.
    let r = keeper.tick(t1 + overlap - 60).await.unwrap();
    assert_eq!(r.action, None, "{r:?}");
    assert!(r.waiting.is_some(), "{r:?}");

    // Step 3: the overlap has passed and caBundle carries the new CA: a leaf of the new CA,
    // served at once; caBundle still both.
    let r = keeper.tick(t1 + overlap).await.unwrap();
    assert_eq!(r.action, Some("issue_leaf"), "{r:?}");
    assert!(r.reloaded);
    let (s2, _) = stored(&env).await;
    assert_eq!(s2.ca_pem.as_deref(), Some(both.as_str()));
    assert_eq!(ca_bundles(&env).await, vec![both.clone(); 3]);
    assert_eq!(
        served_leaf(running.local_addr, &new_ca_pem, &env.ns)
            .await
            .unwrap(),
        certs(s2.cert_pem.as_ref().unwrap())[0],
        "a client trusting only the new CA accepts the served leaf"
    );
    assert!(served_leaf(running.local_addr, &old_ca, &env.ns)
        .await
        .is_err());

    // Step 4: an overlap later the old CA is dropped.
    let r = keeper.tick(t1 + 2 * overlap - 60).await.unwrap();
    assert_eq!(r.action, None, "{r:?}");
    let r = keeper.tick(t1 + 2 * overlap).await.unwrap();
    assert_eq!(r.action, Some("drop_old_cas"), "{r:?}");
    let (s3, _) = stored(&env).await;
    assert_eq!(
        certs(s3.ca_pem.as_ref().unwrap()),
        vec![certs(&both)[0].clone()]
    );
    assert_eq!(ca_bundles(&env).await, vec![s3.ca_pem.clone().unwrap(); 3]);
    assert_eq!(s3.cert_pem, s2.cert_pem);
    assert_eq!(keeper.tick(t1 + 2 * overlap).await.unwrap().action, None);
    running.shutdown();
}

fn base64_encode(der: &[u8]) -> String {
    use base64::Engine as _;
    let b = base64::engine::general_purpose::STANDARD.encode(der);
    b.as_bytes()
        .chunks(64)
        .map(|c| String::from_utf8(c.to_vec()).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_secret_is_reported_and_repaired_and_an_unrepairable_one_is_a_clear_error() {
    let env = env().await;
    let good = issued(&env.ns, 10, 3650, 365);
    // A junk serving key: re-issued by the (intact) CA, caBundle unchanged.
    let mut bad = good.clone();
    bad.key_pem = Some("not a key".to_string());
    seed(&env, &bad).await;
    let registry = prometheus::Registry::new();
    let metrics = CertMetrics::register(&registry).unwrap();
    let problem = |p: &str| metrics.problem.with_label_values(&[p]).get();
    let mut keeper =
        CertKeeper::new(env.bare.admin.clone(), settings(&env)).with_metrics(metrics.clone());
    let r = keeper.tick(now()).await.unwrap();
    assert_eq!(r.action, Some("issue_leaf"), "{r:?}");
    assert_eq!(r.problems, vec![ca_bundle::SecretProblem::LeafInvalid]);
    assert_eq!(problem("LeafInvalid"), 1);
    let (s, _) = stored(&env).await;
    assert_eq!(s.ca_pem, good.ca_pem);
    assert!(ca_bundle::assess(&s, now()).problems.is_empty());
    keeper.tick(now()).await.unwrap();
    assert_eq!(problem("LeafInvalid"), 0, "cleared once repaired");

    // Junk ca.crt and tls.crt (a kubernetes.io/tls Secret cannot lose the key: the apiserver
    // requires tls.crt and tls.key): a new CA and leaf.
    let mut junk = StoredBundle::from_secret(
        &Api::<Secret>::namespaced(env.bare.admin.clone(), &env.ns)
            .get(SECRET)
            .await
            .unwrap(),
    );
    junk.ca_pem = Some("garbage".to_string());
    junk.cert_pem = Some("garbage".to_string());
    let api: Api<Secret> = Api::namespaced(env.bare.admin.clone(), &env.ns);
    let mut secret = api.get(SECRET).await.unwrap();
    secret.data = junk.to_secret(&env.ns, SECRET).data;
    api.replace(SECRET, &PostParams::default(), &secret)
        .await
        .unwrap();
    let r = keeper.tick(now()).await.unwrap();
    assert_eq!(r.action, Some("regenerate"), "{r:?}");
    assert_eq!(problem("CaCertInvalid"), 1);
    let (s, _) = stored(&env).await;
    assert!(ca_bundle::assess(&s, now()).problems.is_empty());
    assert_ne!(s.ca_pem, good.ca_pem);
    assert_eq!(ca_bundles(&env).await, vec![s.ca_pem.clone().unwrap(); 3]);

    // A replica starting on a Secret it cannot repair (the write is refused) gets an error
    // that names the Secret and the problem: never a panic, never a silent exit.
    let mut secret = api.get(SECRET).await.unwrap();
    secret
        .data
        .as_mut()
        .unwrap()
        .insert("tls.key".into(), k8s_openapi::ByteString(b"junk".to_vec()));
    api.replace(SECRET, &PostParams::default(), &secret)
        .await
        .unwrap();
    let faults = Faults::new();
    faults.rule(|c| {
        if c.method == "PUT" && c.has("secrets") {
            Step::Fail {
                code: 403,
                reason: "Forbidden",
                message: "secrets is forbidden: cannot update".into(),
            }
        } else {
            Step::Pass
        }
    });
    let registry = prometheus::Registry::new();
    let metrics = CertMetrics::register(&registry).unwrap();
    let mut starting =
        CertKeeper::new(env.bare.client_with(faults), settings(&env)).with_metrics(metrics.clone());
    let err = starting.tick(now()).await.unwrap_err().to_string();
    assert!(err.contains(SECRET) && err.contains("tls.key"), "{err}");
    assert!(starting.served().is_none());
    assert_eq!(metrics.problem.with_label_values(&["LeafInvalid"]).get(), 1);
    assert_eq!(metrics.problem.with_label_values(&["ApiError"]).get(), 1);
    assert_eq!(
        metrics
            .writes
            .with_label_values(&["issue_leaf", "failed"])
            .get(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_written_before_rotation_gets_a_ca_key_through_the_overlap() {
    let env = env().await;
    // What earlier versions stored: ca.crt, tls.crt, tls.key, no ca.key, no annotation.
    let mut legacy = issued(&env.ns, 400, 3650, 3650);
    legacy.ca_key_pem = None;
    legacy.updated_at = None;
    seed(&env, &legacy).await;
    let mut keeper = CertKeeper::new(env.bare.admin.clone(), settings(&env));
    let r = keeper.tick(now()).await.unwrap();
    assert_eq!(r.action, Some("add_ca"), "{r:?}");
    assert!(r.problems.is_empty(), "{r:?}");
    let (s, _) = stored(&env).await;
    assert!(s.ca_key_pem.is_some());
    assert_eq!(certs(s.ca_pem.as_ref().unwrap()).len(), 2);
    // The old leaf keeps serving until the overlap has passed.
    assert_eq!(s.cert_pem, legacy.cert_pem);
    assert_eq!(
        keeper.served().unwrap().cert_pem,
        legacy.cert_pem.clone().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_not_labelled_as_the_controllers_is_served_but_never_written() {
    let env = env().await;
    let due = issued(&env.ns, 300, 3650, 365);
    let mut secret = due.to_secret(&env.ns, SECRET);
    secret.metadata.labels = None;
    Api::<Secret>::namespaced(env.bare.admin.clone(), &env.ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let faults = Faults::new();
    let registry = prometheus::Registry::new();
    let metrics = CertMetrics::register(&registry).unwrap();
    let mut keeper = CertKeeper::new(env.bare.client_with(faults.clone()), settings(&env))
        .with_metrics(metrics.clone());
    let r = keeper.tick(now()).await.unwrap();
    assert_eq!(r.action, None, "{r:?}");
    assert!(r.waiting.unwrap().contains("not labelled"));
    assert_eq!(secret_writes(&faults), Vec::<String>::new());
    assert_eq!(
        keeper.served().unwrap().cert_pem,
        due.cert_pem.clone().unwrap()
    );
    assert_eq!(metrics.problem.with_label_values(&["NotManaged"]).get(), 1);
}

/// A fresh install: the first check creates the Secret and puts its CA into the webhook
/// configurations in the same round (the CacheBackend webhook fails closed: before this, every
/// CacheBackend write was refused until the next check, a minute later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_check_creates_the_secret_and_publishes_its_ca_at_once() {
    let env = env().await;
    let mut keeper = CertKeeper::new(env.bare.admin.clone(), settings(&env));
    let report = keeper.tick(now()).await.unwrap();
    assert_eq!(report.action, Some("create"), "{report:?}");
    let (created, _) = stored(&env).await;
    let ca = created
        .ca_pem
        .clone()
        .expect("the created Secret holds ca.crt");
    assert_eq!(ca_bundles(&env).await, vec![ca; 3]);
    assert_eq!(keeper.served().unwrap().cert_pem, created.cert_pem.unwrap());
}
