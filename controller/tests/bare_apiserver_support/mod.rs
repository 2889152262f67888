//! The bare real apiserver of `scripts/cluster.sh up --bare` (etcd + kube-apiserver built from
//! their Go modules, the chart's CRDs, RBAC and admission policies; no controller-manager,
//! scheduler, kubelet, controller or webhooks), for tests that call the reconcilers themselves.
//!
//! Nothing else writes to this API, so a test decides every step: it creates objects, runs one
//! reconcile, and plays the Deployment controller or the kubelet by writing `status`. What the
//! apiserver defines is real here: server-side apply and field managers, `resourceVersion`
//! conflicts, `generation` (bumped on spec changes only), status subresources, finalizers and
//! deletion, CEL rules of the CRDs, defaulting and validation of built-in kinds.
//!
//! - [`BareCluster::get`]: the admin client; fails (never skips) when no bare cluster runs and
//!   says how to start one. `scripts/test.sh` starts one in `target/cluster/bare`; another
//!   state directory is named by `IC_BARE_CLUSTER_DIR`.
//! - [`BareCluster::namespace`]: a fresh namespace per test (with its `default` ServiceAccount,
//!   which the ServiceAccount admission plugin needs for pods and no controller-manager creates
//!   here). No namespace controller runs either: namespaces are never deleted, each run of
//!   `scripts/test.sh` starts a fresh cluster.
//! - [`create_with_status`]: create, then write the object's `status` through the subresource.
//! - [`Faults`]: a client layer that answers chosen requests with an error `Status` (or runs a
//!   step before forwarding them) and records every request: the fault cases and call orders
//!   the in-memory fake once gave, on the real API.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The bare cluster's `cluster.env` and an admin client.
pub struct BareCluster {
    /// `IC_CLUSTER_*` values of the bare cluster.
    pub env: HashMap<String, String>,
    /// A client with the admin kubeconfig (`system:masters`).
    pub admin: Client,
    config: Config,
}

/// `$IC_BARE_CLUSTER_DIR/cluster.env`, else `<workspace>/target/cluster/bare/cluster.env`.
pub fn env_file() -> PathBuf {
    match std::env::var_os("IC_BARE_CLUSTER_DIR") {
        Some(d) => PathBuf::from(d).join("cluster.env"),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/cluster/bare/cluster.env")
        }
    }
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A name unique in this run: `<prefix>-<pid>-<n>` (DNS-1123; for namespaces and
/// cluster-scoped objects, which tests running in parallel must not share).
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

impl BareCluster {
    /// The running bare cluster. Panics (the test fails, it never skips) when there is none.
    pub async fn get() -> BareCluster {
        // The test build has two rustls providers (features unified with dev-dependencies).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let path = env_file();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "no bare apiserver: {} ({e}). Start one with \
                 `IC_CLUSTER_DIR=target/cluster/bare IC_CLUSTER_ETCD_PORT=23801 \
                 IC_CLUSTER_API_PORT=16453 scripts/cluster.sh up --bare` \
                 (scripts/test.sh does this itself).",
                path.display()
            )
        });
        let env: HashMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            env.get("IC_CLUSTER_MODE").map(String::as_str),
            Some("bare"),
            "{} is not a bare cluster (`cluster.sh up --bare`)",
            path.display()
        );
        let kc = Kubeconfig::read_from(&env["IC_CLUSTER_KUBECONFIG"]).unwrap();
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .unwrap();
        let admin = Client::try_from(config.clone()).unwrap();
        BareCluster { env, admin, config }
    }

    /// A fresh namespace `<prefix>-<pid>-<n>` with its `default` ServiceAccount.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = unique(prefix);
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(self.admin.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        let sa: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap();
        Api::<ServiceAccount>::namespaced(self.admin.clone(), &name)
            .create(&PostParams::default(), &sa)
            .await
            .unwrap();
        name
    }

    /// An admin client whose requests pass through `faults` first.
    pub fn client_with(&self, faults: Arc<Faults>) -> Client {
        kube::client::ClientBuilder::try_from(self.config.clone())
            .unwrap()
            .with_layer(&FaultLayer(faults))
            .build()
    }
}

/// Creates `obj` through `api`, then writes its `status` (when it has one) through the status
/// subresource, as the controller that owns the status would. Returns the stored object.
pub async fn create_with_status<K>(api: &Api<K>, obj: &K) -> K
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let created = api.create(&PostParams::default(), obj).await.unwrap();
    let status = serde_json::to_value(obj).unwrap().get("status").cloned();
    match status {
        Some(s) if !s.is_null() => {
            let name = created.meta().name.clone().unwrap();
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": s})),
            )
            .await
            .unwrap()
        }
        _ => created,
    }
}

/// One request the client sent: method, path and query (`/api/v1/namespaces/ns/pods/p`,
/// `labelSelector=…`).
#[derive(Clone, Debug)]
pub struct Call {
    /// `GET`, `POST`, `PUT`, `PATCH`, `DELETE`.
    pub method: String,
    /// The URL path.
    pub path: String,
    /// The URL query (empty when none).
    pub query: String,
}

impl Call {
    /// `method` on a path ending in `suffix` (e.g. `("PATCH", "/status")`).
    pub fn is(&self, method: &str, suffix: &str) -> bool {
        self.method == method && self.path.ends_with(suffix)
    }

    /// The path has `segment` as one of its `/`-separated parts (a resource plural such as
    /// `storageclasses`, or an object name).
    pub fn has(&self, segment: &str) -> bool {
        self.path.split('/').any(|p| p == segment)
    }
}

/// What [`Faults`] does with one request.
pub enum Step {
    /// Send it on.
    Pass,
    /// Answer it with a `Status` of `code` and `reason` (e.g. `409 Conflict`, `500
    /// InternalError`, `503 ServiceUnavailable`) without sending it.
    Fail {
        /// HTTP status code.
        code: u16,
        /// The Status `reason` (`Conflict`, `InternalError`, …).
        reason: &'static str,
        /// The Status `message`.
        message: String,
    },
    /// Run this first (another writer's update landing between a read and a write), then send it.
    Before(BoxFuture<'static, ()>),
}

impl Step {
    /// `409 Conflict` as the apiserver words a stale `resourceVersion`.
    pub fn conflict() -> Step {
        Step::Fail {
            code: 409,
            reason: "Conflict",
            message: "Operation cannot be fulfilled: the object has been modified; please apply \
                      your changes to the latest version and try again"
                .into(),
        }
    }

    /// `500 InternalError` with `message`.
    pub fn internal(message: &str) -> Step {
        Step::Fail {
            code: 500,
            reason: "InternalError",
            message: message.into(),
        }
    }
}

type Rule = Box<dyn Fn(&Call) -> Step + Send + Sync>;

/// Injected faults and a record of every request, shared by the client layer and the test.
#[derive(Default)]
pub struct Faults {
    rules: Mutex<Vec<Rule>>,
    calls: Mutex<Vec<Call>>,
}

impl Faults {
    /// No faults yet.
    pub fn new() -> Arc<Faults> {
        Arc::new(Faults::default())
    }

    /// Adds a rule; the first rule that answers other than [`Step::Pass`] decides.
    pub fn rule(&self, rule: impl Fn(&Call) -> Step + Send + Sync + 'static) {
        self.rules.lock().unwrap().push(Box::new(rule));
    }

    /// Every request so far, in order (watches included).
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn decide(&self, call: &Call) -> Step {
        self.calls.lock().unwrap().push(call.clone());
        for rule in self.rules.lock().unwrap().iter() {
            match rule(call) {
                Step::Pass => continue,
                other => return other,
            }
        }
        Step::Pass
    }
}

struct FaultLayer(Arc<Faults>);

impl<S> tower::Layer<S> for FaultLayer {
    type Service = FaultService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        FaultService {
            inner: Arc::new(tokio::sync::Mutex::new(inner)),
            faults: self.0.clone(),
        }
    }
}

/// The service [`Faults`] puts in the client's stack. The inner service (kube's, not `Clone`)
/// sits behind a lock held only while a request is handed to it.
pub struct FaultService<S> {
    inner: Arc<tokio::sync::Mutex<S>>,
    faults: Arc<Faults>,
}

type OutBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

impl<S, B> tower::Service<http::Request<kube::client::Body>> for FaultService<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<OutBody>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness of the inner service is awaited per request, under the lock.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<kube::client::Body>) -> Self::Future {
        let call = Call {
            method: req.method().to_string(),
            path: req.uri().path().to_string(),
            query: req.uri().query().unwrap_or_default().to_string(),
        };
        let step = self.faults.decide(&call);
        let inner = self.inner.clone();
        Box::pin(async move {
            let send = |req| async move {
                let fut = {
                    let mut svc = inner.lock().await;
                    tower::ServiceExt::ready(&mut *svc)
                        .await
                        .map_err(Into::into)?;
                    svc.call(req)
                };
                let resp = fut.await.map_err(Into::into)?;
                Ok::<_, BoxError>(resp.map(|b| b.map_err(Into::into).boxed_unsync()))
            };
            match step {
                Step::Pass => send(req).await,
                Step::Before(first) => {
                    first.await;
                    send(req).await
                }
                Step::Fail {
                    code,
                    reason,
                    message,
                } => {
                    let body = json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "message": message, "reason": reason, "code": code,
                    });
                    let body = Full::new(Bytes::from(body.to_string()))
                        .map_err(|never| match never {})
                        .boxed_unsync();
                    Ok(http::Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(body)
                        .unwrap())
                }
            }
        })
    }
}
