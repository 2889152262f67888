//! The TokenReview verifier: [`TokenVerifier`] (verify a bearer token for an audience into a
//! [`TokenIdentity`]), its cluster implementation [`KubeTokenVerifier`] (a TokenReview, with the
//! pod lookup for tokens without a node extra) and the fixed-table [`FakeTokenVerifier`] of
//! tests and demos.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::Client;
use parking_lot::Mutex;
use thiserror::Error;

use super::ServiceAccountRef;

/// Extra field of a pod-bound service-account token naming the node the pod runs on.
pub const EXTRA_NODE_NAME: &str = "authentication.kubernetes.io/node-name";
/// Extra field naming the pod a bound token belongs to.
pub const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
/// Extra field carrying that pod's UID.
pub const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// Who a verified token belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenIdentity {
    /// `status.user.username`, e.g. `system:serviceaccount:ns:name`.
    pub username: String,
    /// `status.user.uid`.
    pub uid: String,
    /// `status.user.groups`.
    pub groups: Vec<String>,
    /// `status.user.extra`.
    pub extra: BTreeMap<String, Vec<String>>,
    /// The node the token is bound to: the `…/node-name` extra, or the bound pod's node.
    pub node: Option<String>,
}

impl TokenIdentity {
    /// The first value of an extra field.
    pub fn extra_value(&self, key: &str) -> Option<&str> {
        self.extra
            .get(key)
            .and_then(|v| v.first())
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

/// Why a token could not be verified.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VerifyError {
    /// The token is invalid, expired, revoked, or not valid for the audience.
    #[error("token rejected: {0}")]
    Rejected(String),
    /// The verification itself failed (API unreachable, RBAC); says nothing about the token.
    #[error("token verification unavailable: {0}")]
    Unavailable(String),
}

/// Verifies a bearer token for an audience.
#[tonic::async_trait]
pub trait TokenVerifier: Send + Sync {
    /// The identity the token authenticates as, or why not.
    async fn verify(&self, token: &str, audience: &str) -> Result<TokenIdentity, VerifyError>;

    /// A cached answer for (`token`, `audience`) that costs no review, when this verifier
    /// keeps one ([`CachingVerifier`](super::CachingVerifier)); `None` otherwise (the default).
    fn cached(&self, _token: &str, _audience: &str) -> Option<Result<TokenIdentity, VerifyError>> {
        None
    }
}

/// TokenReview against the cluster's API server. Needs RBAC `create` on
/// `authentication.k8s.io/tokenreviews` (and `get` on pods for the node fallback).
#[derive(Clone)]
pub struct KubeTokenVerifier {
    client: Client,
}

impl KubeTokenVerifier {
    /// A verifier using `client`.
    pub fn new(client: Client) -> Self {
        KubeTokenVerifier { client }
    }

    /// The node of the pod a bound token names (`None` when it cannot be determined).
    async fn node_of_bound_pod(&self, id: &TokenIdentity) -> Result<Option<String>, VerifyError> {
        let Some(pod_name) = id.extra_value(EXTRA_POD_NAME) else {
            return Ok(None);
        };
        // system:serviceaccount:NS:NAME — the pod lives in the service account's namespace.
        let Some(ns) = id
            .username
            .strip_prefix("system:serviceaccount:")
            .and_then(|r| r.split(':').next())
        else {
            return Ok(None);
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let pod = pods
            .get_opt(pod_name)
            .await
            .map_err(|e| VerifyError::Unavailable(format!("get pod {ns}/{pod_name}: {e}")))?;
        let Some(pod) = pod else {
            return Err(VerifyError::Rejected(format!(
                "the token's pod {ns}/{pod_name} no longer exists"
            )));
        };
        if let Some(want) = id.extra_value(EXTRA_POD_UID) {
            if pod.metadata.uid.as_deref() != Some(want) {
                return Err(VerifyError::Rejected(format!(
                    "the token's pod {ns}/{pod_name} was replaced (uid differs)"
                )));
            }
        }
        Ok(pod.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty()))
    }
}

#[tonic::async_trait]
impl TokenVerifier for KubeTokenVerifier {
    async fn verify(&self, token: &str, audience: &str) -> Result<TokenIdentity, VerifyError> {
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            metadata: Default::default(),
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![audience.to_string()]),
            },
            status: None,
        };
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| VerifyError::Unavailable(format!("TokenReview: {e}")))?;
        let status = answer.status.unwrap_or_default();
        if !status.authenticated.unwrap_or(false) {
            return Err(VerifyError::Rejected(
                status
                    .error
                    .filter(|e| !e.is_empty())
                    .unwrap_or_else(|| "the API server did not authenticate the token".into()),
            ));
        }
        // An audience-aware API server echoes the audience; an empty list means "valid for the
        // API server's own audience", which is not ours.
        let audiences = status.audiences.unwrap_or_default();
        if !audiences.iter().any(|a| a == audience) {
            return Err(VerifyError::Rejected(format!(
                "the token is not valid for audience {audience:?} (reviewed audiences: {audiences:?})"
            )));
        }
        let user = status.user.unwrap_or_default();
        let mut id = TokenIdentity {
            username: user.username.unwrap_or_default(),
            uid: user.uid.unwrap_or_default(),
            groups: user.groups.unwrap_or_default(),
            extra: user.extra.unwrap_or_default(),
            node: None,
        };
        id.node = match id.extra_value(EXTRA_NODE_NAME) {
            Some(n) => Some(n.to_string()),
            None => self.node_of_bound_pod(&id).await?,
        };
        Ok(id)
    }
}

/// A verifier over a fixed token table (tests, demos). Counts calls.
#[derive(Default)]
pub struct FakeTokenVerifier {
    tokens: Mutex<HashMap<String, TokenIdentity>>,
    unavailable: Mutex<Option<String>>,
    calls: AtomicUsize,
}

impl FakeTokenVerifier {
    /// An empty table: every token is rejected.
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts `token` as service account `sa` bound to `node` (builder style).
    pub fn with_token(self, token: &str, sa: &ServiceAccountRef, node: Option<&str>) -> Self {
        self.with_pod_token(token, sa, node, None)
    }

    /// Accepts `token` as service account `sa` bound to `node` and, with `pod = Some(name)`, to
    /// that pod (the `pod-name` and `pod-uid` extras a kubelet-projected token carries).
    pub fn with_pod_token(
        self,
        token: &str,
        sa: &ServiceAccountRef,
        node: Option<&str>,
        pod: Option<&str>,
    ) -> Self {
        let mut extra = BTreeMap::new();
        if let Some(n) = node {
            extra.insert(EXTRA_NODE_NAME.to_string(), vec![n.to_string()]);
        }
        if let Some(p) = pod {
            extra.insert(EXTRA_POD_NAME.to_string(), vec![p.to_string()]);
            extra.insert(EXTRA_POD_UID.to_string(), vec![format!("uid-of-{p}")]);
        }
        self.with_identity(
            token,
            TokenIdentity {
                username: sa.username(),
                uid: format!("uid-{token}"),
                groups: vec![
                    "system:serviceaccounts".to_string(),
                    format!("system:serviceaccounts:{}", sa.namespace),
                ],
                extra,
                node: node.map(str::to_string),
            },
        )
    }

    /// Accepts `token` as exactly `identity`.
    pub fn with_identity(self, token: &str, identity: TokenIdentity) -> Self {
        self.tokens.lock().insert(token.to_string(), identity);
        self
    }

    /// Makes every call fail with [`VerifyError::Unavailable`] (`None` restores).
    pub fn set_unavailable(&self, why: Option<&str>) {
        *self.unavailable.lock() = why.map(str::to_string);
    }

    /// Number of `verify` calls so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }
}

#[tonic::async_trait]
impl TokenVerifier for FakeTokenVerifier {
    async fn verify(&self, token: &str, _audience: &str) -> Result<TokenIdentity, VerifyError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = self.unavailable.lock().clone() {
            return Err(VerifyError::Unavailable(why));
        }
        self.tokens
            .lock()
            .get(token)
            .cloned()
            .ok_or_else(|| VerifyError::Rejected("unknown token".into()))
    }
}

#[tonic::async_trait]
impl<T: TokenVerifier + ?Sized> TokenVerifier for Arc<T> {
    async fn verify(&self, token: &str, audience: &str) -> Result<TokenIdentity, VerifyError> {
        (**self).verify(token, audience).await
    }

    fn cached(&self, token: &str, audience: &str) -> Option<Result<TokenIdentity, VerifyError>> {
        (**self).cached(token, audience)
    }
}
