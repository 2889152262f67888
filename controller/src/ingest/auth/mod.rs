//! Agent authentication for in-cluster mode (DESIGN.md "Contracts between the two binaries":
//! Auth).
//!
//! The agent presents its projected service-account token (audience `inference-cache`) in
//! `Hello.token`. The controller:
//!
//! 1. verifies the token with a `TokenReview` (`authentication.k8s.io/v1`) for that audience,
//!    through the [`TokenVerifier`] trait ([`KubeTokenVerifier`] in cluster, [`FakeTokenVerifier`]
//!    in tests), with results cached for a TTL ([`CachingVerifier`]);
//! 2. requires the agent's service account: username `system:serviceaccount:NS:NAME`;
//! 3. binds the token's node to `Hello.node`: a pod-bound token carries the node in the
//!    `authentication.kubernetes.io/node-name` extra field (Kubernetes ≥ 1.30); when it does not,
//!    the kube verifier looks the token's pod (`…/pod-name`, `…/pod-uid`) up and takes its
//!    `spec.nodeName`. A token without any node binding is refused.
//!
//! **Per-pod subscribers** (`ic-agent subscribe`, the kvevent-subscriber sidecar) run with the
//! *engine pod's* service account, so they cannot pass rule 2. Their Hello carries
//! `pod_subscriber {namespace, pod}` ([`PodScope`]) and is checked by another rule instead:
//!
//! 1. the same TokenReview (audience `inference-cache`);
//! 2. the token must be pod-bound: extras `authentication.kubernetes.io/pod-name` and
//!    `…/pod-uid`, username `system:serviceaccount:NS:NAME`;
//! 3. the token's namespace (the service account's) = `pod_subscriber.namespace`, its pod name =
//!    `pod_subscriber.pod`, and its node (as in rule 3 above) = `Hello.node`.
//!
//! Any service account may do this, but only for its own pod: such a stream may then report only
//! streams of that pod ([`PodScope::authorize`]: tenant = the namespace, replica = the pod or
//! `pod#rank`, stream id `namespace/pod#rank`). Node-agent Hellos (no `pod_subscriber`) are
//! checked exactly as before.
//!
//! Refusals map to gRPC statuses ([`AuthError::to_status`]): no token, an invalid token or a
//! wrong audience → `Unauthenticated`; a valid token of another service account, without a node
//! or pod binding, bound to another node, namespace or pod, or a subscriber reporting another
//! pod's stream → `PermissionDenied`; a malformed `pod_subscriber` → `InvalidArgument`; the
//! TokenReview API failing → `Unavailable` (the agent retries). Standalone mode runs without an
//! authenticator (a subscriber's streams are still held to the pod its Hello names).
//!
//! This file holds the rules ([`AgentAuthenticator`], [`AuthError`]); the verifier they ask is
//! in `verifier` ([`TokenVerifier`], [`KubeTokenVerifier`]), the cache and the per-source
//! TokenReview limit in front of it in `cache` ([`CachingVerifier`], [`SourceLimiter`]), and
//! what a Hello claims in `identity` ([`ServiceAccountRef`], [`PodScope`]).

use std::sync::Arc;

use prometheus::{IntCounterVec, Opts, Registry};
use std::time::Instant;
use thiserror::Error;
use tonic::Status;

mod cache;
mod identity;
mod verifier;

pub use cache::{
    parse_reviews_per_second, CachingVerifier, MonotonicClock, ReviewSourceLimit, SourceLimiter,
    DEFAULT_CACHE_ENTRIES, DEFAULT_CACHE_TTL, DEFAULT_NEGATIVE_CACHE_TTL,
    DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE, DEFAULT_REVIEW_BURST_PER_SOURCE, MAX_REVIEW_SOURCES,
};
pub use identity::{PodScope, ServiceAccountRef};
pub use verifier::{
    FakeTokenVerifier, KubeTokenVerifier, TokenIdentity, TokenVerifier, VerifyError,
    EXTRA_NODE_NAME, EXTRA_POD_NAME, EXTRA_POD_UID,
};

/// Default token audience.
pub const DEFAULT_AUDIENCE: &str = "inference-cache";

/// Why an agent stream was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AuthError {
    /// `Hello.token` is empty.
    #[error("Hello.token is empty: the agent must present its projected service-account token (audience {audience:?})")]
    MissingToken {
        /// The expected audience.
        audience: String,
    },
    /// The token did not verify.
    #[error("the agent's token was rejected: {0}")]
    Rejected(String),
    /// Verification could not run.
    #[error("cannot verify the agent's token right now: {0}")]
    Unavailable(String),
    /// A valid token of another identity.
    #[error("the token authenticates as {got:?}, but only the agent service account {want:?} may open agent streams")]
    WrongServiceAccount {
        /// The token's username.
        got: String,
        /// The required username.
        want: String,
    },
    /// The token is not bound to a node.
    #[error("the token of {username:?} is not bound to a node (use a projected, pod-bound service-account token; Kubernetes >= 1.30 adds the node name)")]
    NoNodeBinding {
        /// The token's username.
        username: String,
    },
    /// The token belongs to another node than Hello names.
    #[error("the token is bound to node {token_node:?} but Hello names node {hello_node:?}: an agent may only report for its own node")]
    NodeMismatch {
        /// Node the token is bound to.
        token_node: String,
        /// Node in Hello.
        hello_node: String,
    },
    /// `Hello.pod_subscriber` is present but incomplete.
    #[error("invalid Hello.pod_subscriber: {0}")]
    InvalidSubscriber(String),
    /// A subscriber's token is not bound to a pod.
    #[error("the token of {username:?} is not bound to a pod (a per-pod subscriber must present its pod's projected service-account token, which carries the {EXTRA_POD_NAME} and {EXTRA_POD_UID} extras)")]
    NoPodBinding {
        /// The token's username.
        username: String,
    },
    /// A subscriber's token belongs to a service account of another namespace.
    #[error("the token belongs to namespace {token_namespace:?} but Hello.pod_subscriber names namespace {hello_namespace:?}: a subscriber may only report for its own pod")]
    NamespaceMismatch {
        /// Namespace of the token's service account (= its pod's).
        token_namespace: String,
        /// Namespace in Hello.
        hello_namespace: String,
    },
    /// A subscriber's token belongs to another pod.
    #[error("the token is bound to pod {token_pod:?} but Hello.pod_subscriber names pod {hello_pod:?}: a subscriber may only report for its own pod")]
    PodMismatch {
        /// Pod the token is bound to.
        token_pod: String,
        /// Pod in Hello.
        hello_pod: String,
    },
    /// The source address caused more TokenReviews than its share (a cache miss each).
    #[error("too many token reviews from {source_addr}: at most {burst} at once and {per_second} per second per source address; retry later")]
    RateLimited {
        /// The caller's address.
        source_addr: String,
        /// The bucket size.
        burst: u32,
        /// The refill rate (reviews per second).
        per_second: String,
    },
    /// A subscriber's pod is not an engine pod the node plans know (or the plans are not
    /// derived yet, `plans_pending`).
    #[error("{0}")]
    NotPlanned(String),
    /// This replica has not derived node plans yet, so it cannot tell a planned engine pod.
    #[error("the controller has not derived its node plans yet, so it cannot check that pod {0:?} is a planned engine pod; retry shortly")]
    PlansPending(String),
    /// A subscriber reported a stream of another pod or namespace.
    #[error("the subscriber of pod {pod:?} may only report that pod's streams: stream {stream_id:?} has {field} {got:?}, expected {want:?}")]
    StreamOutOfScope {
        /// `namespace/pod` the stream is bound to.
        pod: String,
        /// The offending stream id.
        stream_id: String,
        /// Which descriptor field mismatched: `tenant`, `replica` or `stream id`.
        field: &'static str,
        /// Its value.
        got: String,
        /// The value the pod allows.
        want: String,
    },
}

impl AuthError {
    /// The gRPC status the stream is refused with.
    pub fn to_status(&self) -> Status {
        let msg = self.to_string();
        match self {
            AuthError::MissingToken { .. } | AuthError::Rejected(_) => Status::unauthenticated(msg),
            AuthError::Unavailable(_) | AuthError::PlansPending(_) => Status::unavailable(msg),
            AuthError::RateLimited { .. } => Status::resource_exhausted(msg),
            AuthError::InvalidSubscriber(_) => Status::invalid_argument(msg),
            AuthError::NotPlanned(_) => Status::permission_denied(msg),
            AuthError::WrongServiceAccount { .. }
            | AuthError::NoNodeBinding { .. }
            | AuthError::NodeMismatch { .. }
            | AuthError::NoPodBinding { .. }
            | AuthError::NamespaceMismatch { .. }
            | AuthError::PodMismatch { .. }
            | AuthError::StreamOutOfScope { .. } => Status::permission_denied(msg),
        }
    }

    /// The `reason` of `agent_streams_total{outcome="rejected"}` this failure counts under
    /// (coarser than [`Self::label`], which `agent_auth_total{result}` keeps).
    pub fn rejection(&self) -> crate::metrics::labels::StreamRejection {
        use crate::metrics::labels::StreamRejection as R;
        match self {
            AuthError::MissingToken { .. } | AuthError::Rejected(_) => R::Unauthenticated,
            AuthError::Unavailable(_) => R::ReviewUnavailable,
            AuthError::RateLimited { .. } => R::ReviewRateLimited,
            AuthError::InvalidSubscriber(_) => R::InvalidHello,
            AuthError::NotPlanned(_) | AuthError::PlansPending(_) => R::NotPlanned,
            AuthError::WrongServiceAccount { .. }
            | AuthError::NoNodeBinding { .. }
            | AuthError::NodeMismatch { .. }
            | AuthError::NoPodBinding { .. }
            | AuthError::NamespaceMismatch { .. }
            | AuthError::PodMismatch { .. }
            | AuthError::StreamOutOfScope { .. } => R::WrongIdentity,
        }
    }

    /// Stable metric label.
    pub fn label(&self) -> &'static str {
        match self {
            AuthError::MissingToken { .. } => "missing_token",
            AuthError::Rejected(_) => "rejected",
            AuthError::Unavailable(_) => "unavailable",
            AuthError::WrongServiceAccount { .. } => "wrong_service_account",
            AuthError::NoNodeBinding { .. } => "no_node_binding",
            AuthError::NodeMismatch { .. } => "node_mismatch",
            AuthError::InvalidSubscriber(_) => "invalid_subscriber",
            AuthError::NoPodBinding { .. } => "no_pod_binding",
            AuthError::NamespaceMismatch { .. } => "namespace_mismatch",
            AuthError::PodMismatch { .. } => "pod_mismatch",
            AuthError::StreamOutOfScope { .. } => "stream_out_of_scope",
            AuthError::RateLimited { .. } => "rate_limited",
            AuthError::NotPlanned(_) => "not_planned",
            AuthError::PlansPending(_) => "plans_pending",
        }
    }
}

/// A stream's authenticated identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentIdentity {
    /// The token's username.
    pub username: String,
    /// The node the token (and so the stream) is bound to.
    pub node: String,
    /// For a per-pod subscriber: the pod it may report for. `None` for a node agent.
    pub scope: Option<PodScope>,
    /// For a per-pod subscriber: the UID of the pod its token is bound to (the `pod-uid`
    /// extra), checked against the plan's.
    pub pod_uid: Option<String>,
}

/// Checks agents' Hello messages: token, service account, node binding.
pub struct AgentAuthenticator {
    verifier: Arc<dyn TokenVerifier>,
    audience: String,
    service_account: ServiceAccountRef,
    outcomes: Option<IntCounterVec>,
    sources: SourceLimiter,
    limited: Option<prometheus::IntCounter>,
}

impl AgentAuthenticator {
    /// Accepts tokens `verifier` validates for `audience` that authenticate as
    /// `service_account`.
    pub fn new(
        verifier: Arc<dyn TokenVerifier>,
        audience: impl Into<String>,
        service_account: ServiceAccountRef,
    ) -> Self {
        AgentAuthenticator {
            verifier,
            audience: audience.into(),
            service_account,
            outcomes: None,
            sources: SourceLimiter::default(),
            limited: None,
        }
    }

    /// Limits the TokenReviews each source address may cause (cache misses only; default
    /// [`DEFAULT_REVIEW_BURST_PER_SOURCE`] at once, [`DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE`]
    /// per second).
    pub fn with_source_limit(mut self, burst: u32, per_second: f64) -> Self {
        self.sources = SourceLimiter::new(burst, per_second);
        self
    }

    /// Counts outcomes in `inferencecache_controller_agent_auth_total{result}` registered in
    /// `registry` (`ok` or an [`AuthError::label`]).
    pub fn with_metrics(mut self, registry: &Registry) -> Result<Self, prometheus::Error> {
        let c = IntCounterVec::new(
            Opts::new(
                "inferencecache_controller_agent_auth_total",
                "Agent stream authentications, by result (ok or the refusal reason).",
            ),
            &["result"],
        )?;
        registry.register(Box::new(c.clone()))?;
        self.outcomes = Some(c);
        let limited = prometheus::IntCounter::new(
            "inferencecache_controller_token_reviews_limited_total",
            "Agent and subscriber Hellos refused without a TokenReview because their source address used up its review budget (cache misses only).",
        )?;
        registry.register(Box::new(limited.clone()))?;
        self.limited = Some(limited);
        Ok(self)
    }

    /// The required service account.
    pub fn service_account(&self) -> &ServiceAccountRef {
        &self.service_account
    }

    /// Authenticates a stream's Hello: the node-agent rule, or, when the Hello carries
    /// `pod_subscriber`, the per-pod subscriber rule (module docs).
    pub async fn authenticate(
        &self,
        hello: &ic_shared::proto::Hello,
    ) -> Result<AgentIdentity, AuthError> {
        self.authenticate_from(hello, None).await
    }

    /// [`Self::authenticate`] for a Hello that came from `source`: a token the cache does not
    /// answer costs a TokenReview, and each source address may cause at most its share of them
    /// ([`SourceLimiter`]); beyond it the stream is refused with `ResourceExhausted` and no
    /// review, counted in `inferencecache_controller_token_reviews_limited_total`.
    pub async fn authenticate_from(
        &self,
        hello: &ic_shared::proto::Hello,
        source: Option<std::net::IpAddr>,
    ) -> Result<AgentIdentity, AuthError> {
        let result = self.check(hello, source).await;
        if let Some(c) = &self.outcomes {
            let label = match &result {
                Ok(_) => "ok",
                Err(e) => e.label(),
            };
            c.with_label_values(&[label]).inc();
        }
        result
    }

    async fn verify(
        &self,
        hello: &ic_shared::proto::Hello,
        source: Option<std::net::IpAddr>,
    ) -> Result<TokenIdentity, AuthError> {
        let token = hello.token.trim();
        if token.is_empty() {
            return Err(AuthError::MissingToken {
                audience: self.audience.clone(),
            });
        }
        if let Some(source) = source {
            if self.verifier.cached(token, &self.audience).is_none()
                && !self.sources.try_take(source, Instant::now())
            {
                if let Some(c) = &self.limited {
                    c.inc();
                }
                return Err(AuthError::RateLimited {
                    source_addr: source.to_string(),
                    burst: self.sources.burst(),
                    per_second: self.sources.per_second().to_string(),
                });
            }
        }
        self.verifier
            .verify(token, &self.audience)
            .await
            .map_err(|e| match e {
                VerifyError::Rejected(m) => AuthError::Rejected(m),
                VerifyError::Unavailable(m) => AuthError::Unavailable(m),
            })
    }

    async fn check(
        &self,
        hello: &ic_shared::proto::Hello,
        source: Option<std::net::IpAddr>,
    ) -> Result<AgentIdentity, AuthError> {
        if let Some(scope) = PodScope::from_hello(hello)? {
            return self.check_subscriber(hello, scope, source).await;
        }
        let id = self.verify(hello, source).await?;
        let want = self.service_account.username();
        if id.username != want {
            return Err(AuthError::WrongServiceAccount {
                got: id.username,
                want,
            });
        }
        let Some(node) = id.node.clone().filter(|n| !n.is_empty()) else {
            return Err(AuthError::NoNodeBinding {
                username: id.username,
            });
        };
        if node != hello.node {
            return Err(AuthError::NodeMismatch {
                token_node: node,
                hello_node: hello.node.clone(),
            });
        }
        Ok(AgentIdentity {
            username: id.username,
            node,
            scope: None,
            pod_uid: None,
        })
    }

    /// The per-pod subscriber rule: a pod-bound token of the pod, namespace and node Hello names.
    async fn check_subscriber(
        &self,
        hello: &ic_shared::proto::Hello,
        scope: PodScope,
        source: Option<std::net::IpAddr>,
    ) -> Result<AgentIdentity, AuthError> {
        let id = self.verify(hello, source).await?;
        let namespace = id
            .username
            .strip_prefix("system:serviceaccount:")
            .and_then(|r| r.split_once(':'))
            .map(|(ns, _)| ns.to_string());
        let (Some(namespace), Some(pod), Some(uid)) = (
            namespace,
            id.extra_value(EXTRA_POD_NAME),
            id.extra_value(EXTRA_POD_UID),
        ) else {
            return Err(AuthError::NoPodBinding {
                username: id.username,
            });
        };
        if namespace != scope.namespace {
            return Err(AuthError::NamespaceMismatch {
                token_namespace: namespace,
                hello_namespace: scope.namespace,
            });
        }
        if pod != scope.pod {
            return Err(AuthError::PodMismatch {
                token_pod: format!("{namespace}/{pod}"),
                hello_pod: scope.pod_ref(),
            });
        }
        let Some(node) = id.node.clone().filter(|n| !n.is_empty()) else {
            return Err(AuthError::NoNodeBinding {
                username: id.username,
            });
        };
        if node != scope.node {
            return Err(AuthError::NodeMismatch {
                token_node: node,
                hello_node: scope.node,
            });
        }
        let pod_uid = Some(uid.to_string());
        Ok(AgentIdentity {
            username: id.username,
            node,
            scope: Some(scope),
            pod_uid,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn agent_sa() -> ServiceAccountRef {
        "inference-cache:inference-cache-agent".parse().unwrap()
    }

    /// Tokens: engine pod `team-a/vllm-a` on node-1 (its own service account), engine pod
    /// `team-b/vllm-b` on node-1, a team-a token bound to the node only, the agent's token.
    fn authenticator() -> AgentAuthenticator {
        let engine_a: ServiceAccountRef = "team-a:vllm".parse().unwrap();
        let engine_b: ServiceAccountRef = "team-b:vllm".parse().unwrap();
        let verifier = FakeTokenVerifier::new()
            .with_pod_token("tok-a", &engine_a, Some("node-1"), Some("vllm-a"))
            .with_pod_token("tok-b", &engine_b, Some("node-1"), Some("vllm-b"))
            .with_token("tok-node-only", &engine_a, Some("node-1"))
            .with_pod_token("tok-agent", &agent_sa(), Some("node-1"), Some("agent-xyz"));
        AgentAuthenticator::new(Arc::new(verifier), DEFAULT_AUDIENCE, agent_sa())
    }

    pub(super) fn subscriber_hello(
        node: &str,
        ns: &str,
        pod: &str,
        token: &str,
    ) -> ic_shared::proto::Hello {
        ic_shared::proto::Hello {
            node: node.into(),
            token: token.into(),
            pod_subscriber: Some(ic_shared::proto::PodSubscriber {
                namespace: ns.into(),
                pod: pod.into(),
            }),
            ..Default::default()
        }
    }

    pub(super) fn agent_hello(node: &str, token: &str) -> ic_shared::proto::Hello {
        ic_shared::proto::Hello {
            node: node.into(),
            token: token.into(),
            ..Default::default()
        }
    }

    fn desc(
        tenant: &str,
        replica: &str,
        stream_id: &str,
        rank: u32,
    ) -> ic_shared::proto::StreamDescriptor {
        ic_shared::proto::StreamDescriptor {
            stream_id: stream_id.into(),
            replica: replica.into(),
            dp_rank: rank,
            tenant: tenant.into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_pod_bound_token_may_report_its_own_pod_in_its_namespace() {
        let auth = authenticator();
        let id = auth
            .authenticate(&subscriber_hello("node-1", "team-a", "vllm-a", "tok-a"))
            .await
            .unwrap();
        assert_eq!(id.username, "system:serviceaccount:team-a:vllm");
        assert_eq!(id.node, "node-1");
        let scope = id.scope.unwrap();
        assert_eq!(scope.reporter_key(), "node-1/team-a/vllm-a");
        scope
            .authorize(&desc("team-a", "vllm-a", "team-a/vllm-a#0", 0))
            .unwrap();
        scope
            .authorize(&desc("team-a", "vllm-a#1", "team-a/vllm-a#1", 1))
            .unwrap();
    }

    #[tokio::test]
    async fn a_subscriber_may_not_report_another_pod_or_namespace() {
        let scope = authenticator()
            .authenticate(&subscriber_hello("node-1", "team-a", "vllm-a", "tok-a"))
            .await
            .unwrap()
            .scope
            .unwrap();
        let cases = [
            // Pod B of the same namespace.
            (
                desc("team-a", "vllm-b", "team-a/vllm-b#0", 0),
                "has replica \"vllm-b\", expected \"vllm-a\"",
            ),
            // Its own pod name, but another namespace (tenant).
            (
                desc("team-b", "vllm-a", "team-b/vllm-a#0", 0),
                "has tenant \"team-b\", expected \"team-a\"",
            ),
            // Right tenant and replica, but another pod's stream id (would replace its entries).
            (
                desc("team-a", "vllm-a", "team-a/vllm-b#0", 0),
                "has stream id \"team-a/vllm-b#0\", expected \"team-a/vllm-a#0\"",
            ),
            // A rank suffix that does not match the rank.
            (
                desc("team-a", "vllm-a#2", "team-a/vllm-a#1", 1),
                "has replica \"vllm-a#2\", expected \"vllm-a#1\"",
            ),
        ];
        for (d, text) in cases {
            let err = scope.authorize(&d).unwrap_err();
            assert_eq!(err.label(), "stream_out_of_scope");
            let st = err.to_status();
            assert_eq!(st.code(), tonic::Code::PermissionDenied);
            assert!(st.message().contains(text), "{}", st.message());
            assert!(
                st.message().contains("\"team-a/vllm-a\""),
                "names the pod: {}",
                st.message()
            );
        }
    }

    #[tokio::test]
    async fn a_subscriber_hello_for_another_pod_namespace_or_node_is_refused() {
        let auth = authenticator();
        let cases = [
            // Pod A's token claiming pod B.
            (
                subscriber_hello("node-1", "team-a", "vllm-b", "tok-a"),
                "pod_mismatch",
                "bound to pod \"team-a/vllm-a\" but Hello.pod_subscriber names pod \"team-a/vllm-b\"",
            ),
            // Pod A's token claiming its pod name in another namespace.
            (
                subscriber_hello("node-1", "team-b", "vllm-a", "tok-a"),
                "namespace_mismatch",
                "namespace \"team-a\" but Hello.pod_subscriber names namespace \"team-b\"",
            ),
            // Pod B's token (namespace team-b) claiming pod A.
            (
                subscriber_hello("node-1", "team-a", "vllm-a", "tok-b"),
                "namespace_mismatch",
                "namespace \"team-b\"",
            ),
            // Pod A's token from another node.
            (
                subscriber_hello("node-2", "team-a", "vllm-a", "tok-a"),
                "node_mismatch",
                "bound to node \"node-1\" but Hello names node \"node-2\"",
            ),
            // A token without pod binding.
            (
                subscriber_hello("node-1", "team-a", "vllm-a", "tok-node-only"),
                "no_pod_binding",
                "not bound to a pod",
            ),
        ];
        for (hello, label, text) in cases {
            let err = auth.authenticate(&hello).await.unwrap_err();
            assert_eq!(err.label(), label, "{err}");
            let st = err.to_status();
            assert_eq!(st.code(), tonic::Code::PermissionDenied, "{err}");
            assert!(st.message().contains(text), "{}", st.message());
        }
        // Unverifiable tokens stay Unauthenticated; a malformed claim is InvalidArgument.
        let err = auth
            .authenticate(&subscriber_hello("node-1", "team-a", "vllm-a", ""))
            .await
            .unwrap_err();
        assert_eq!(err.to_status().code(), tonic::Code::Unauthenticated);
        let err = auth
            .authenticate(&subscriber_hello("node-1", "team-a", "", "tok-a"))
            .await
            .unwrap_err();
        assert_eq!(err.to_status().code(), tonic::Code::InvalidArgument);
        let err = auth
            .authenticate(&subscriber_hello("node-1", "team/a", "vllm-a", "tok-a"))
            .await
            .unwrap_err();
        assert_eq!(err.label(), "invalid_subscriber");
    }

    #[tokio::test]
    async fn node_agent_streams_keep_the_agent_rule() {
        let auth = authenticator();
        let id = auth
            .authenticate(&agent_hello("node-1", "tok-agent"))
            .await
            .unwrap();
        assert_eq!(id.scope, None, "an agent is not scoped to a pod");
        // An engine pod's token without the subscriber claim is not the agent.
        let err = auth
            .authenticate(&agent_hello("node-1", "tok-a"))
            .await
            .unwrap_err();
        assert_eq!(err.label(), "wrong_service_account");
        assert_eq!(err.to_status().code(), tonic::Code::PermissionDenied);
        let err = auth
            .authenticate(&agent_hello("node-2", "tok-agent"))
            .await
            .unwrap_err();
        assert_eq!(err.label(), "node_mismatch");
    }

    /// Issue 38 item 8: every garbage token cost one TokenReview (4 000 requests, 4 004
    /// reviews). One source address now causes at most its burst (then its refill rate); the
    /// rest are refused without a review and counted; a cached token costs nothing and other
    /// sources keep their own budget; a repeated garbage token is answered from the cache,
    /// which keeps only its hash.
    #[tokio::test]
    async fn token_reviews_are_limited_per_source_and_rejections_are_cached_by_hash() {
        let fake = Arc::new(FakeTokenVerifier::new().with_pod_token(
            "tok-agent",
            &agent_sa(),
            Some("node-1"),
            Some("agent-xyz"),
        ));
        let registry = Registry::new();
        let auth = AgentAuthenticator::new(
            Arc::new(CachingVerifier::new(fake.clone())),
            DEFAULT_AUDIENCE,
            agent_sa(),
        )
        .with_source_limit(4, 0.0)
        .with_metrics(&registry)
        .unwrap();
        let attacker: std::net::IpAddr = "10.0.0.66".parse().unwrap();
        let agent: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        // The agent's token is reviewed once and cached.
        auth.authenticate_from(&agent_hello("node-1", "tok-agent"), Some(attacker))
            .await
            .unwrap();
        let mut labels = Vec::new();
        for i in 0..100 {
            let err = auth
                .authenticate_from(
                    &agent_hello("node-1", &format!("garbage-{i}")),
                    Some(attacker),
                )
                .await
                .unwrap_err();
            labels.push(err.label());
        }
        assert_eq!(
            fake.calls(),
            4,
            "the burst of 4, the agent's review included"
        );
        assert_eq!(labels.iter().filter(|l| **l == "rejected").count(), 3);
        assert_eq!(labels.iter().filter(|l| **l == "rate_limited").count(), 97);
        let err = auth
            .authenticate_from(&agent_hello("node-1", "garbage-99"), Some(attacker))
            .await
            .unwrap_err();
        assert_eq!(err.to_status().code(), tonic::Code::ResourceExhausted);
        assert!(err.to_string().contains("10.0.0.66"), "{err}");
        // A cached answer costs no review, so the limited source still gets it.
        auth.authenticate_from(&agent_hello("node-1", "tok-agent"), Some(attacker))
            .await
            .unwrap();
        // A cached rejection too: no review, no budget.
        assert_eq!(
            auth.authenticate_from(&agent_hello("node-1", "garbage-0"), Some(attacker))
                .await
                .unwrap_err()
                .label(),
            "rejected"
        );
        // Another source has its own budget.
        assert_eq!(
            auth.authenticate_from(&agent_hello("node-1", "garbage-x"), Some(agent))
                .await
                .unwrap_err()
                .label(),
            "rejected"
        );
        assert_eq!(fake.calls(), 5);
        let mut text = String::new();
        for f in registry.gather() {
            if f.name() == "inferencecache_controller_token_reviews_limited_total" {
                text = format!("{:?}", f.get_metric()[0].get_counter().get_value());
            }
        }
        assert_eq!(text, "98.0");
    }
}
