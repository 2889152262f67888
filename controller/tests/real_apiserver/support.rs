//! The real control plane of `scripts/cluster.sh up` (etcd + kube-apiserver +
//! kube-controller-manager + kube-scheduler built from their Go modules, the chart's CRDs, RBAC,
//! admission policies and webhooks installed, ic-controller running as the chart's
//! ServiceAccount). These tests never skip: without a running cluster they fail and say how to
//! start one.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use ic_controller::reconcile::render::{label_value, LABEL_BACKEND};
use ic_shared::crd::CacheBackend;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;

/// The audience agents' tokens carry (the chart's `auth.tokenAudience`).
pub const AUDIENCE: &str = "inference-cache";

/// What `scripts/cluster.sh up` wrote to `cluster.env`.
pub struct Cluster {
    /// `IC_CLUSTER_*` values.
    pub env: HashMap<String, String>,
    /// A client with the admin kubeconfig (`system:masters`).
    pub admin: Client,
}

/// The state directory's `cluster.env`: `$IC_CLUSTER_DIR/cluster.env`, else
/// `<workspace>/target/cluster/run/cluster.env`.
pub fn env_file() -> PathBuf {
    match std::env::var_os("IC_CLUSTER_DIR") {
        Some(d) => PathBuf::from(d).join("cluster.env"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/cluster/run/cluster.env"),
    }
}

impl Cluster {
    /// The running cluster. Panics (the test fails, it never skips) when there is none.
    pub async fn get() -> Cluster {
        // The test build has two rustls providers (features unified with dev-dependencies).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let path = env_file();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "no real control plane: {} ({e}). Start one with `scripts/cluster.sh up` \
                 (scripts/test.sh does this itself).",
                path.display()
            )
        });
        let env: HashMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let admin = client_from(&env["IC_CLUSTER_KUBECONFIG"]).await;
        Cluster { env, admin }
    }

    /// A client with the kubeconfig at `IC_CLUSTER_<key>`.
    pub async fn client(&self, key: &str) -> Client {
        client_from(&self.env[key]).await
    }

    /// A fresh namespace `<prefix>-<pid>-<n>` labelled `inferencecache.io/test=real-apiserver`
    /// (deleted by [`Cluster::drop_namespace`]).
    pub async fn namespace(&self, prefix: &str) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"inferencecache.io/test": "real-apiserver"}}
        }))
        .unwrap();
        Api::<Namespace>::all(self.admin.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        // Pods need the namespace's `default` ServiceAccount, which the controller-manager
        // creates a moment later.
        let sas = Api::<ServiceAccount>::namespaced(self.admin.clone(), &name);
        wait_for(
            "the default ServiceAccount",
            Duration::from_secs(30),
            || async { sas.get_opt("default").await.ok().flatten() },
        )
        .await;
        name
    }

    /// Deletes a test namespace (the controller-manager's namespace controller empties it).
    pub async fn drop_namespace(&self, name: &str) {
        let _ = Api::<Namespace>::all(self.admin.clone())
            .delete(name, &DeleteParams::background())
            .await;
    }
}

async fn client_from(path: &str) -> Client {
    let kc = Kubeconfig::read_from(path).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// Polls `f` every 200 ms until it returns `Some`, for at most `timeout`; panics naming `what`
/// and the last value seen otherwise.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Creates Node `name` (no kubelet behind it) unless it exists.
pub async fn ensure_node(admin: &Client, name: &str) {
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    match Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("{e}"),
    }
}

/// A pod of the agent's ServiceAccount on `node` in `ns` and a token for [`AUDIENCE`] bound to
/// it, valid for `seconds`.
pub async fn pod_token(admin: &Client, ns: &str, pod: &str, node: &str, seconds: i64) -> String {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": pod},
        "spec": {"serviceAccountName": "inference-cache-agent", "nodeName": node,
                 "containers": [{"name": "agent", "image": "ic-agent:test"}]}
    }))
    .unwrap();
    let created = Api::<Pod>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .unwrap();
    let req: TokenRequest = serde_json::from_value(json!({
        "spec": {"audiences": [AUDIENCE], "expirationSeconds": seconds,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod,
                                    "uid": created.metadata.uid}}
    }))
    .unwrap();
    Api::<ServiceAccount>::namespaced(admin.clone(), ns)
        .create_token_request("inference-cache-agent", &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
}

/// A binary of this workspace's debug build (`scripts/test.sh` builds them all first).
pub fn workspace_bin(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = target.join("debug").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build -p {name}` (scripts/test.sh builds every binary first)",
        path.display()
    );
    path
}

/// A CacheBackend with a controller-managed Redis tier (a Deployment + Service per backend),
/// selecting pods labelled `app: <name>`; `extra` is merged into `spec`.
pub fn managed_redis(name: &str, extra: serde_json::Value) -> CacheBackend {
    let mut v = json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": name},
        "spec": {
            "runtime": "SGLang",
            "type": "LMCache",
            "lmCache": {"chunkSizeTokens": 256, "hostMemory": {"capacity": "1Gi"}},
            "remoteStorage": {
                "provider": "Redis",
                "ownership": "Managed",
                "redis": {"image": "docker.io/library/redis:7.4-alpine"}
            },
            "engineSelector": {"matchLabels": {"app": name}}
        }
    });
    for (k, val) in extra.as_object().into_iter().flatten() {
        v["spec"][k] = val.clone();
    }
    serde_json::from_value(v).unwrap()
}

/// A host-only vLLM + LMCache CacheBackend `name` selecting pods labelled `app: <app>`, created
/// in `ns`.
pub async fn create_host_backend(admin: &Client, ns: &str, name: &str, app: &str) {
    let backend: CacheBackend = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": name},
        "spec": {"runtime": "VLLM", "type": "LMCache",
                 "lmCache": {"chunkSizeTokens": 256, "hostMemory": {"capacity": "1Gi"}},
                 "engineSelector": {"matchLabels": {"app": app}}}
    }))
    .unwrap();
    Api::<CacheBackend>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &backend)
        .await
        .unwrap();
}

/// The Deployment the controller renders for `backend` in `ns`, found by its label.
pub async fn backend_deployment(admin: &Client, ns: &str, backend: &str) -> Option<Deployment> {
    let lp = ListParams::default().labels(&format!("{LABEL_BACKEND}={}", label_value(backend)));
    Api::<Deployment>::namespaced(admin.clone(), ns)
        .list(&lp)
        .await
        .ok()?
        .items
        .into_iter()
        .next()
}

/// The pod template's `nodeSelector` of `d`, as JSON.
pub fn node_selector(d: &Deployment) -> Option<serde_json::Value> {
    let spec = d.spec.as_ref()?.template.spec.as_ref()?;
    spec.node_selector
        .as_ref()
        .map(|s| serde_json::to_value(s).unwrap())
}
