//! Real identities on the bare real apiserver (tests/bare_apiserver_support/) for the tests of
//! agent and caller authentication and of `ic-controller run` (incluster_*.rs,
//! data_plane_auth.rs): ServiceAccounts, Nodes and Pods to bind tokens to, TokenRequest tokens
//! (the apiserver's real TokenReview checks them), RBAC grants that the apiserver's real
//! SubjectAccessReview answers from, and a client that authenticates as a ServiceAccount.
//!
//! [`controller_client`] is the in-cluster controller's identity in these tests: a
//! ServiceAccount of the test's namespace with the chart's controller ClusterRole bound in that
//! namespace only, and a client that confines the controller's cluster-wide lists and watches
//! to that namespace. A leading controller reconciles every CacheBackend, ModelCache and engine
//! pod it sees; on a cluster that other tests share, it must see and be able to write only its
//! own test's objects.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, PostParams};
use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::{json, Value};

use crate::bare_apiserver_support::{unique, BareCluster};

/// The audience agents' and callers' tokens carry (the chart's `auth.tokenAudience`).
pub const AUDIENCE: &str = "inference-cache";

/// The chart's controller ClusterRole (installed on the bare cluster with the chart's RBAC).
pub const CHART_CONTROLLER_ROLE: &str = "inference-cache-controller";
/// The chart's leader-election Lease (controller-lease.yaml; `--leader-election-lease-name`).
pub const CHART_LEASE: &str = "inference-cache-controller";

/// Polls `f` every 100 ms until it returns `Some`, for at most `limit`; panics naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates ServiceAccount `name` in `ns`.
pub async fn service_account(bare: &BareCluster, ns: &str, name: &str) {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<ServiceAccount>::namespaced(bare.admin.clone(), ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
}

/// Creates Node `name` (no kubelet behind it): a token bound to a pod on a node names the node
/// and its uid, so the apiserver needs the Node. `name` must be unique to the test.
pub async fn node(bare: &BareCluster, name: &str) {
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Node>::all(bare.admin.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap();
}

/// Creates pod `name` of ServiceAccount `sa` in `ns`, on `node` when given (else unscheduled:
/// no scheduler runs here).
pub async fn pod(bare: &BareCluster, ns: &str, name: &str, sa: &str, node: Option<&str>) -> Pod {
    let mut spec = json!({"serviceAccountName": sa,
                          "containers": [{"name": "agent", "image": "ic-agent:test"}]});
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    let p: Pod = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
    Api::<Pod>::namespaced(bare.admin.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .unwrap()
}

/// A TokenRequest token of ServiceAccount `sa` in `ns`, for `audiences` (`None`: the
/// apiserver's own), bound to `bound` when given, valid for an hour.
pub async fn token(
    bare: &BareCluster,
    ns: &str,
    sa: &str,
    audiences: Option<&[&str]>,
    bound: Option<&Pod>,
) -> String {
    let mut spec = json!({"expirationSeconds": 3600});
    if let Some(a) = audiences {
        spec["audiences"] = json!(a);
    }
    if let Some(p) = bound {
        spec["boundObjectRef"] = json!({"kind": "Pod", "apiVersion": "v1",
            "name": p.metadata.name, "uid": p.metadata.uid});
    }
    let req: TokenRequest = serde_json::from_value(json!({ "spec": spec })).unwrap();
    Api::<ServiceAccount>::namespaced(bare.admin.clone(), ns)
        .create_token_request(sa, &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
}

/// A client of the bare cluster that authenticates with bearer `token` instead of the admin
/// certificate.
pub async fn client_with_token(bare: &BareCluster, token: &str) -> Client {
    let mut kc = Kubeconfig::read_from(&bare.env["IC_CLUSTER_KUBECONFIG"]).unwrap();
    for user in &mut kc.auth_infos {
        user.auth_info = Some(AuthInfo {
            token: Some(token.to_string().into()),
            ..Default::default()
        });
    }
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// `system:serviceaccount:<ns>:<name>`.
pub fn sa_user(ns: &str, name: &str) -> String {
    format!("system:serviceaccount:{ns}:{name}")
}

/// Waits until the apiserver's SubjectAccessReview allows `user` (a ServiceAccount, with its
/// groups) the `attributes` (`resourceAttributes` or `nonResourceAttributes` as JSON): RBAC
/// follows new bindings through an informer, a moment after their create.
pub async fn wait_allowed(bare: &BareCluster, user: &str, attributes: Value) {
    let ns = user.split(':').nth(2).unwrap_or_default().to_string();
    let mut spec = json!({"user": user, "groups": [
        "system:serviceaccounts", format!("system:serviceaccounts:{ns}"), "system:authenticated"]});
    for (k, v) in attributes.as_object().unwrap() {
        spec[k] = v.clone();
    }
    let sar: SubjectAccessReview = serde_json::from_value(json!({ "spec": spec })).unwrap();
    let api = Api::<SubjectAccessReview>::all(bare.admin.clone());
    wait_for(
        &format!("RBAC to allow {user} {attributes}"),
        Duration::from_secs(60),
        || async {
            let answer = api.create(&PostParams::default(), &sar).await.unwrap();
            answer.status.filter(|s| s.allowed).map(|_| ())
        },
    )
    .await;
}

/// Creates `ClusterRole` `name` with `rules` (JSON PolicyRules).
pub async fn cluster_role(bare: &BareCluster, name: &str, rules: Value) {
    let role: ClusterRole =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).unwrap();
    Api::<ClusterRole>::all(bare.admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
}

/// Binds ClusterRole `role` to ServiceAccount `ns`/`sa` cluster-wide (a ClusterRoleBinding of a
/// unique name).
pub async fn bind_cluster_role(bare: &BareCluster, role: &str, ns: &str, sa: &str) {
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": unique(&format!("{sa}-{role}"))},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(bare.admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

/// Binds `kind` (`Role` or `ClusterRole`) `role` to ServiceAccount `sa_ns`/`sa` in namespace
/// `ns` only (a RoleBinding).
pub async fn bind_in_namespace(
    bare: &BareCluster,
    ns: &str,
    kind: &str,
    role: &str,
    sa_ns: &str,
    sa: &str,
) {
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": unique(&format!("{sa}-{}", role.to_lowercase()))},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_ns}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(bare.admin.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

/// Creates Role `name` in `ns` with `rules` (JSON PolicyRules).
pub async fn role(bare: &BareCluster, ns: &str, name: &str, rules: Value) {
    let role: Role =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).unwrap();
    Api::<Role>::namespaced(bare.admin.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
}

/// What the in-cluster controller of a test may do beyond the chart's grants in its namespace.
#[derive(Default)]
pub struct ControllerGrants {
    /// CacheNodes it may read and write the status of (the test's own nodes). Creating one
    /// cannot be narrowed by name; the controller creates only those of nodes it sees.
    pub cache_nodes: Vec<String>,
    /// More rules in the test's namespace (e.g. the self-signed webhook Secret).
    pub namespaced: Vec<Value>,
    /// More cluster-scoped rules (e.g. the test's webhook configurations, by name).
    pub cluster: Vec<Value>,
}

/// The in-cluster controller's identity for a test in `ns`: ServiceAccount `ic-controller` of
/// `ns` with
///
/// - the chart's controller ClusterRole bound in `ns` (a RoleBinding: its namespaced rules, in
///   `ns` only), and the chart's controller Role's rules (its Lease) copied into `ns`, with the
///   Lease itself (the chart creates it; the controller may only read and update it);
/// - the cluster-scoped part of the chart's ClusterRole: TokenReviews, SubjectAccessReviews and
///   `grants.cache_nodes`; not the cluster's one CacheIndex, which other tests write;
/// - `grants`' extra rules.
///
/// Returns a client authenticating as that account whose cluster-wide lists and watches of
/// namespaced kinds are confined to `ns` ([`confined`]), once RBAC allows it what it was
/// granted.
pub async fn controller_client(bare: &BareCluster, ns: &str, grants: ControllerGrants) -> Client {
    let sa = "ic-controller";
    service_account(bare, ns, sa).await;
    bind_in_namespace(bare, ns, "ClusterRole", CHART_CONTROLLER_ROLE, ns, sa).await;
    let chart_role = Api::<Role>::namespaced(bare.admin.clone(), "inference-cache")
        .get(CHART_CONTROLLER_ROLE)
        .await
        .unwrap();
    let mut rules = serde_json::to_value(chart_role.rules.unwrap_or_default()).unwrap();
    rules
        .as_array_mut()
        .unwrap()
        .extend(grants.namespaced.iter().cloned());
    role(bare, ns, sa, rules).await;
    bind_in_namespace(bare, ns, "Role", sa, ns, sa).await;
    // The chart's Lease, as `helm install` creates it (controller-lease.yaml).
    let chart_lease = Api::<Lease>::namespaced(bare.admin.clone(), "inference-cache")
        .get(CHART_LEASE)
        .await
        .unwrap();
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": CHART_LEASE, "labels": chart_lease.metadata.labels},
        "spec": {}
    }))
    .unwrap();
    Api::<Lease>::namespaced(bare.admin.clone(), ns)
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
    let mut cluster_rules = vec![
        json!({"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
               "verbs": ["create"]}),
        json!({"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
               "verbs": ["create"]}),
    ];
    if !grants.cache_nodes.is_empty() {
        cluster_rules.push(json!({"apiGroups": ["inferencecache.io"],
            "resources": ["cachenodes"], "verbs": ["create"]}));
        cluster_rules.push(json!({"apiGroups": ["inferencecache.io"],
            "resources": ["cachenodes", "cachenodes/status"], "resourceNames": grants.cache_nodes,
            "verbs": ["get", "patch"]}));
    }
    cluster_rules.extend(grants.cluster);
    let cluster_role_name = unique(&format!("{ns}-controller"));
    cluster_role(bare, &cluster_role_name, Value::Array(cluster_rules)).await;
    bind_cluster_role(bare, &cluster_role_name, ns, sa).await;

    let user = sa_user(ns, sa);
    wait_allowed(
        bare,
        &user,
        json!({"resourceAttributes": {"group": "inferencecache.io", "resource": "cachebackends",
               "verb": "watch", "namespace": ns}}),
    )
    .await;
    wait_allowed(
        bare,
        &user,
        json!({"resourceAttributes": {"group": "coordination.k8s.io", "resource": "leases",
               "verb": "update", "namespace": ns, "name": CHART_LEASE}}),
    )
    .await;
    wait_allowed(
        bare,
        &user,
        json!({"resourceAttributes": {"group": "authentication.k8s.io",
               "resource": "tokenreviews", "verb": "create"}}),
    )
    .await;
    let token = token(bare, ns, sa, None, None).await;
    confined(client_with_token(bare, &token).await, ns)
}

/// Namespaced kinds, by API path prefix and plural, whose cluster-wide lists and watches
/// [`confined`] narrows to one namespace.
const NAMESPACED: &[(&str, &str)] = &[
    ("/api/v1", "pods"),
    ("/api/v1", "services"),
    ("/api/v1", "secrets"),
    ("/api/v1", "configmaps"),
    ("/api/v1", "events"),
    ("/api/v1", "persistentvolumeclaims"),
    ("/apis/apps/v1", "deployments"),
    ("/apis/apps/v1", "statefulsets"),
    ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    ("/apis/batch/v1", "jobs"),
    ("/apis/coordination.k8s.io/v1", "leases"),
    ("/apis/events.k8s.io/v1", "events"),
    ("/apis/inferencecache.io/v1alpha1", "cachebackends"),
    ("/apis/inferencecache.io/v1alpha1", "cachepolicies"),
    ("/apis/inferencecache.io/v1alpha1", "cachetenants"),
    ("/apis/inferencecache.io/v1alpha1", "modelcaches"),
    ("/apis/inferencecache.io/v1alpha1", "modelcachebindings"),
];

/// `path` narrowed to `ns` when it lists a namespaced kind across the cluster.
fn confine_path(path: &str, ns: &str) -> Option<String> {
    NAMESPACED.iter().find_map(|(prefix, plural)| {
        (path == format!("{prefix}/{plural}")).then(|| format!("{prefix}/namespaces/{ns}/{plural}"))
    })
}

/// The service [`confined`] puts in front of a client.
#[derive(Clone)]
struct Confined {
    inner: Client,
    namespace: String,
}

impl tower::Service<http::Request<kube::client::Body>> for Confined {
    type Response = http::Response<kube::client::Body>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Self::Response, kube::Error>>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), kube::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: http::Request<kube::client::Body>) -> Self::Future {
        if req.method() == http::Method::GET {
            if let Some(path) = confine_path(req.uri().path(), &self.namespace) {
                let uri = match req.uri().query() {
                    Some(q) => format!("{path}?{q}"),
                    None => path,
                };
                *req.uri_mut() = uri.parse().unwrap();
            }
        }
        let inner = self.inner.clone();
        Box::pin(async move { inner.send(req).await })
    }
}

/// `client` with its cluster-wide lists and watches of namespaced kinds (pods, CacheBackends,
/// ModelCaches, …) sent for namespace `ns` only: the controller under test sees its test's
/// objects as the whole cluster. Every other request passes unchanged; the apiserver answers
/// all of them.
pub fn confined(client: Client, ns: &str) -> Client {
    Client::new(
        Confined {
            inner: client,
            namespace: ns.to_string(),
        },
        ns,
    )
}
