//! Who may read the data plane (docs/security.md "Authenticated data plane"; issue 15 item 5).
//!
//! In cluster, `RouterService.LookupRoute` and the HTTP reads `/snapshot`, `/v1/nodes`,
//! `/v1/nodes/{node}` and `/probe` require a caller identity, checked the way the
//! controller-runtime metrics endpoint (and kube-rbac-proxy) checks it:
//!
//! 1. **Authentication**: a bearer token (gRPC metadata or HTTP header `authorization: Bearer
//!    TOKEN`) verified by a `TokenReview` for an audience (`--caller-audience`, default
//!    [`DEFAULT_CALLER_AUDIENCE`]) through the same [`TokenVerifier`] (and its cache) that
//!    authenticates agent streams ([`crate::ingest::auth`]).
//! 2. **Authorization**: a `SubjectAccessReview` (`authorization.k8s.io/v1`) of the token's user,
//!    groups, uid and extras against one [`AccessRequest`]:
//!    - `LookupRoute` for tenant N: `get` on the virtual resource
//!      `cacheroutes.inferencecache.io` in namespace N ([`AccessRequest::routes`]). A request
//!      without a tenant is first checked cluster-wide (namespace `""`); without that grant it is
//!      answered from the granted namespaces only ([`CallerAuth::visible_tenants`]) and says so
//!      (`LookupRouteResponse.narrowed`).
//!    - `/snapshot`: `list` on `cacheroutes` the same way (cluster-wide, else per namespace,
//!      narrowed: the document's `narrowed` is set).
//!    - `/v1/nodes`: `list` on `cachenodes.inferencecache.io`; `/v1/nodes/{node}`: `get` on that
//!      CacheNode — what `kubectl get cachenodes` needs for the same facts.
//!    - `/probe`: the non-resource URL `/probe` with verb `get` or `post` (the HTTP method).
//!
//! Refusals ([`AccessError`]): no token → 401 / `UNAUTHENTICATED`; a token the TokenReview
//! rejects (invalid, expired, wrong audience) → 401 / `UNAUTHENTICATED`; a SubjectAccessReview
//! that does not allow → 403 / `PERMISSION_DENIED` with its reason; the API server unreachable,
//! or every review slot busy past [`DEFAULT_REVIEW_WAIT`] → 503 / `UNAVAILABLE` (fail closed:
//! nothing is answered without a verdict).
//!
//! Bounds: review results (allowed and denied) are cached per (user, request) for
//! [`DEFAULT_REVIEW_TTL`] in at most [`DEFAULT_MAX_CACHED_REVIEWS`] entries (expired first, then
//! the oldest are dropped); token verifications are cached by the agent path's
//! [`CachingVerifier`](crate::ingest::auth::CachingVerifier) (bounded the same way). At most
//! [`DEFAULT_MAX_CONCURRENT_REVIEWS`] TokenReviews and SubjectAccessReviews run at once
//! ([`ReviewLimiter`], shared by both and by the agent streams' TokenReviews), so a flood of
//! distinct tokens neither grows memory nor hammers the API server.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use kube::Client;
use parking_lot::Mutex;
use prometheus::{IntCounterVec, Opts, Registry};
use thiserror::Error;
use tokio::sync::Semaphore;
use tonic::Status;

use crate::ingest::auth::{MonotonicClock, TokenIdentity, TokenVerifier, VerifyError};

/// Default audience of callers' tokens.
pub const DEFAULT_CALLER_AUDIENCE: &str = "inference-cache";
/// API group of the virtual and real resources callers are authorized against.
pub const API_GROUP: &str = "inferencecache.io";
/// Virtual resource (no CRD) whose `get` / `list` in namespace N grants reading N's routes.
pub const ROUTES_RESOURCE: &str = "cacheroutes";
/// The CacheNode resource (`/v1/nodes` shows what CacheNodes hold).
pub const NODES_RESOURCE: &str = "cachenodes";
/// How long a review verdict is cached.
pub const DEFAULT_REVIEW_TTL: Duration = Duration::from_secs(30);
/// Most cached review verdicts.
pub const DEFAULT_MAX_CACHED_REVIEWS: usize = 4096;
/// Most TokenReviews and SubjectAccessReviews in flight at once.
pub const DEFAULT_MAX_CONCURRENT_REVIEWS: usize = 16;
/// How long a request waits for a review slot before it is answered 503.
pub const DEFAULT_REVIEW_WAIT: Duration = Duration::from_secs(2);

/// What a caller asks to do: the attributes of one SubjectAccessReview.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AccessRequest {
    /// A verb on a resource of [`API_GROUP`] (`resourceAttributes`).
    Resource {
        /// `get` or `list`.
        verb: &'static str,
        /// [`ROUTES_RESOURCE`] or [`NODES_RESOURCE`].
        resource: &'static str,
        /// Namespace; empty = cluster-wide (or a cluster-scoped resource).
        namespace: String,
        /// Object name; empty = any.
        name: String,
    },
    /// A verb on a URL path (`nonResourceAttributes`).
    Path {
        /// The lowercased HTTP method (`get`, `post`).
        verb: &'static str,
        /// The path, e.g. `/probe`.
        path: &'static str,
    },
}

impl AccessRequest {
    /// `verb` on `cacheroutes` in `namespace` (empty = every namespace).
    pub fn routes(verb: &'static str, namespace: &str) -> Self {
        AccessRequest::Resource {
            verb,
            resource: ROUTES_RESOURCE,
            namespace: namespace.to_string(),
            name: String::new(),
        }
    }

    /// `verb` on `cachenodes` (cluster-scoped), named `name` (empty = any).
    pub fn nodes(verb: &'static str, name: &str) -> Self {
        AccessRequest::Resource {
            verb,
            resource: NODES_RESOURCE,
            namespace: String::new(),
            name: name.to_string(),
        }
    }

    fn spec(&self, user: &TokenIdentity) -> SubjectAccessReviewSpec {
        let mut spec = SubjectAccessReviewSpec {
            user: Some(user.username.clone()),
            uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
            groups: Some(user.groups.clone()),
            extra: Some(user.extra.clone()).filter(|e| !e.is_empty()),
            ..Default::default()
        };
        match self {
            AccessRequest::Resource {
                verb,
                resource,
                namespace,
                name,
            } => {
                spec.resource_attributes = Some(ResourceAttributes {
                    group: Some(API_GROUP.to_string()),
                    resource: Some(resource.to_string()),
                    verb: Some(verb.to_string()),
                    namespace: Some(namespace.clone()).filter(|n| !n.is_empty()),
                    name: Some(name.clone()).filter(|n| !n.is_empty()),
                    ..Default::default()
                });
            }
            AccessRequest::Path { verb, path } => {
                spec.non_resource_attributes = Some(NonResourceAttributes {
                    path: Some(path.to_string()),
                    verb: Some(verb.to_string()),
                });
            }
        }
        spec
    }
}

impl fmt::Display for AccessRequest {
    /// `get cacheroutes.inferencecache.io in namespace "team-a"`, `post /probe`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AccessRequest::Resource {
                verb,
                resource,
                namespace,
                name,
            } => {
                write!(f, "{verb} {resource}.{API_GROUP}")?;
                if !name.is_empty() {
                    write!(f, " {name:?}")?;
                }
                if namespace.is_empty() {
                    if *resource == ROUTES_RESOURCE {
                        write!(f, " in every namespace")?;
                    }
                    Ok(())
                } else {
                    write!(f, " in namespace {namespace:?}")
                }
            }
            AccessRequest::Path { verb, path } => write!(f, "{verb} {path}"),
        }
    }
}

/// A SubjectAccessReview's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// `status.allowed` (and not `status.denied`).
    pub allowed: bool,
    /// `status.reason`, or `status.evaluationError`, or a default text.
    pub reason: String,
}

/// Answers SubjectAccessReviews.
#[tonic::async_trait]
pub trait AccessReviewer: Send + Sync {
    /// Whether `user` may do `request`; [`VerifyError::Unavailable`] when no verdict could be
    /// had (the caller fails closed).
    async fn review(
        &self,
        user: &TokenIdentity,
        request: &AccessRequest,
    ) -> Result<Verdict, VerifyError>;
}

/// SubjectAccessReview against the cluster's API server. Needs RBAC `create` on
/// `authorization.k8s.io/subjectaccessreviews`.
#[derive(Clone)]
pub struct KubeAccessReviewer {
    client: Client,
}

impl KubeAccessReviewer {
    /// A reviewer using `client`.
    pub fn new(client: Client) -> Self {
        KubeAccessReviewer { client }
    }
}

#[tonic::async_trait]
impl AccessReviewer for KubeAccessReviewer {
    async fn review(
        &self,
        user: &TokenIdentity,
        request: &AccessRequest,
    ) -> Result<Verdict, VerifyError> {
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let sar = SubjectAccessReview {
            metadata: Default::default(),
            spec: request.spec(user),
            status: None,
        };
        let answer = api
            .create(&PostParams::default(), &sar)
            .await
            .map_err(|e| VerifyError::Unavailable(format!("SubjectAccessReview: {e}")))?;
        let Some(status) = answer.status else {
            return Err(VerifyError::Unavailable(
                "SubjectAccessReview: the API server returned no status".into(),
            ));
        };
        let reason = status
            .reason
            .filter(|r| !r.is_empty())
            .or(status.evaluation_error.filter(|e| !e.is_empty()))
            .unwrap_or_else(|| {
                if status.allowed {
                    "allowed".into()
                } else {
                    "no RBAC rule allows it".into()
                }
            });
        Ok(Verdict {
            allowed: status.allowed && !status.denied.unwrap_or(false),
            reason,
        })
    }
}

/// Bounds the TokenReviews and SubjectAccessReviews in flight: a review waits at most `wait`
/// for one of `max` slots, else it fails with [`VerifyError::Unavailable`].
#[derive(Clone)]
pub struct ReviewLimiter {
    slots: Arc<Semaphore>,
    max: usize,
    wait: Duration,
}

impl ReviewLimiter {
    /// `max` concurrent reviews (at least 1), each waiting at most `wait` for a slot.
    pub fn new(max: usize, wait: Duration) -> Self {
        let max = max.max(1);
        ReviewLimiter {
            slots: Arc::new(Semaphore::new(max)),
            max,
            wait,
        }
    }

    /// Runs `review` in a slot.
    async fn run<T>(
        &self,
        review: impl std::future::Future<Output = Result<T, VerifyError>>,
    ) -> Result<T, VerifyError> {
        let permit = tokio::time::timeout(self.wait, self.slots.acquire())
            .await
            .map_err(|_| {
                VerifyError::Unavailable(format!(
                    "all {} review slots stayed busy for {:?}",
                    self.max, self.wait
                ))
            })?
            .map_err(|_| VerifyError::Unavailable("the review limiter is closed".into()))?;
        let out = review.await;
        drop(permit);
        out
    }

    /// A [`TokenVerifier`] that runs `inner`'s verifications in this limiter's slots (put it
    /// under the [`CachingVerifier`](crate::ingest::auth::CachingVerifier), so cache hits take
    /// no slot).
    pub fn verifier<V: TokenVerifier>(&self, inner: V) -> LimitedVerifier<V> {
        LimitedVerifier {
            inner,
            limiter: self.clone(),
        }
    }
}

/// A token verifier whose calls are bounded by a [`ReviewLimiter`].
pub struct LimitedVerifier<V> {
    inner: V,
    limiter: ReviewLimiter,
}

#[tonic::async_trait]
impl<V: TokenVerifier> TokenVerifier for LimitedVerifier<V> {
    async fn verify(&self, token: &str, audience: &str) -> Result<TokenIdentity, VerifyError> {
        self.limiter.run(self.inner.verify(token, audience)).await
    }
}

/// Why a data-plane request was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AccessError {
    /// No bearer token.
    #[error("no bearer token: send `authorization: Bearer TOKEN` with a service-account token for audience {audience:?}")]
    MissingToken {
        /// The expected audience.
        audience: String,
    },
    /// The TokenReview did not authenticate the token (invalid, expired, wrong audience).
    #[error("the bearer token was rejected: {0}")]
    Rejected(String),
    /// The SubjectAccessReview did not allow the request.
    #[error("{user:?} may not {request}: {reason}")]
    Denied {
        /// The token's username.
        user: String,
        /// What was asked.
        request: String,
        /// The SubjectAccessReview's reason.
        reason: String,
    },
    /// No verdict could be had (API server unreachable, review slots busy): refused.
    #[error("cannot check the caller's access right now, so the request is refused: {0}")]
    Unavailable(String),
}

impl AccessError {
    /// The gRPC status.
    pub fn to_status(&self) -> Status {
        let msg = self.to_string();
        match self {
            AccessError::MissingToken { .. } | AccessError::Rejected(_) => {
                Status::unauthenticated(msg)
            }
            AccessError::Denied { .. } => Status::permission_denied(msg),
            AccessError::Unavailable(_) => Status::unavailable(msg),
        }
    }

    /// The HTTP status.
    pub fn http_status(&self) -> StatusCode {
        match self {
            AccessError::MissingToken { .. } | AccessError::Rejected(_) => StatusCode::UNAUTHORIZED,
            AccessError::Denied { .. } => StatusCode::FORBIDDEN,
            AccessError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Stable metric label.
    pub fn label(&self) -> &'static str {
        match self {
            AccessError::MissingToken { .. } => "missing_token",
            AccessError::Rejected(_) => "rejected",
            AccessError::Denied { .. } => "denied",
            AccessError::Unavailable(_) => "unavailable",
        }
    }
}

/// The token of an `authorization` value `Bearer TOKEN` (scheme case-insensitive); `None`
/// for another scheme or an empty token.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Which tenants a caller may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantGrant {
    /// Every namespace (a cluster-wide grant).
    All,
    /// Only these; the answer is narrowed to them.
    Only(Arc<BTreeSet<String>>),
}

impl TenantGrant {
    /// Whether `tenant` is visible.
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            TenantGrant::All => true,
            TenantGrant::Only(set) => set.contains(tenant),
        }
    }
}

type ReviewKey = (String, String, Vec<String>, AccessRequest);

struct CachedVerdict {
    at: Instant,
    verdict: Verdict,
}

/// Settings of a [`CallerAuth`].
#[derive(Debug, Clone)]
pub struct CallerAuthSettings {
    /// Audience callers' tokens must carry.
    pub audience: String,
    /// How long a verdict is cached.
    pub review_ttl: Duration,
    /// Most cached verdicts.
    pub max_cached_reviews: usize,
}

impl Default for CallerAuthSettings {
    fn default() -> Self {
        CallerAuthSettings {
            audience: DEFAULT_CALLER_AUDIENCE.to_string(),
            review_ttl: DEFAULT_REVIEW_TTL,
            max_cached_reviews: DEFAULT_MAX_CACHED_REVIEWS,
        }
    }
}

/// Authenticates and authorizes data-plane callers (module docs).
pub struct CallerAuth {
    verifier: Arc<dyn TokenVerifier>,
    reviewer: Arc<dyn AccessReviewer>,
    limiter: ReviewLimiter,
    settings: CallerAuthSettings,
    clock: MonotonicClock,
    verdicts: Mutex<HashMap<ReviewKey, CachedVerdict>>,
    outcomes: Option<IntCounterVec>,
}

impl CallerAuth {
    /// Verifies tokens with `verifier` (bound it with `limiter.verifier(…)` under its cache)
    /// and reviews access with `reviewer`, in `limiter`'s slots.
    pub fn new(
        verifier: Arc<dyn TokenVerifier>,
        reviewer: Arc<dyn AccessReviewer>,
        limiter: ReviewLimiter,
        settings: CallerAuthSettings,
    ) -> Self {
        CallerAuth {
            verifier,
            reviewer,
            limiter,
            settings,
            clock: Arc::new(Instant::now),
            verdicts: Mutex::new(HashMap::new()),
            outcomes: None,
        }
    }

    /// Replaces the time source (tests).
    pub fn with_clock(mut self, clock: MonotonicClock) -> Self {
        self.clock = clock;
        self
    }

    /// Counts outcomes in `inferencecache_controller_caller_auth_total{result}` (`ok` or an
    /// [`AccessError::label`]) registered in `registry`.
    pub fn with_metrics(mut self, registry: &Registry) -> Result<Self, prometheus::Error> {
        let c = IntCounterVec::new(
            Opts::new(
                "inferencecache_controller_caller_auth_total",
                "Data-plane requests (LookupRoute, /snapshot, /v1/nodes, /probe) by access result (ok or the refusal reason).",
            ),
            &["result"],
        )?;
        registry.register(Box::new(c.clone()))?;
        self.outcomes = Some(c);
        Ok(self)
    }

    /// The audience callers' tokens must carry.
    pub fn audience(&self) -> &str {
        &self.settings.audience
    }

    /// Cached verdicts now (at most the configured bound).
    pub fn cached_reviews(&self) -> usize {
        self.verdicts.lock().len()
    }

    fn count(&self, result: &Result<(), AccessError>) {
        if let Some(c) = &self.outcomes {
            let label = match result {
                Ok(()) => "ok",
                Err(e) => e.label(),
            };
            c.with_label_values(&[label]).inc();
        }
    }

    /// The caller of an `authorization` value.
    pub async fn authenticate(
        &self,
        authorization: Option<&str>,
    ) -> Result<TokenIdentity, AccessError> {
        let result = self.authenticate_uncounted(authorization).await;
        if let Err(e) = &result {
            self.count(&Err(e.clone()));
        }
        result
    }

    async fn authenticate_uncounted(
        &self,
        authorization: Option<&str>,
    ) -> Result<TokenIdentity, AccessError> {
        let Some(token) = authorization.and_then(bearer_token) else {
            return Err(AccessError::MissingToken {
                audience: self.settings.audience.clone(),
            });
        };
        self.verifier
            .verify(token, &self.settings.audience)
            .await
            .map_err(|e| match e {
                VerifyError::Rejected(m) => AccessError::Rejected(m),
                VerifyError::Unavailable(m) => AccessError::Unavailable(m),
            })
    }

    /// The verdict for `user` and `request`, from the cache or a review.
    async fn verdict(
        &self,
        user: &TokenIdentity,
        request: &AccessRequest,
    ) -> Result<Verdict, AccessError> {
        let key: ReviewKey = (
            user.username.clone(),
            user.uid.clone(),
            user.groups.clone(),
            request.clone(),
        );
        let now = (self.clock)();
        if let Some(hit) = self.verdicts.lock().get(&key) {
            if now.duration_since(hit.at) < self.settings.review_ttl {
                return Ok(hit.verdict.clone());
            }
        }
        let verdict = self
            .limiter
            .run(self.reviewer.review(user, request))
            .await
            .map_err(|e| match e {
                VerifyError::Rejected(m) | VerifyError::Unavailable(m) => {
                    AccessError::Unavailable(m)
                }
            })?;
        self.store(key, verdict.clone(), (self.clock)());
        Ok(verdict)
    }

    fn store(&self, key: ReviewKey, verdict: Verdict, now: Instant) {
        let max = self.settings.max_cached_reviews.max(1);
        let ttl = self.settings.review_ttl;
        let mut cache = self.verdicts.lock();
        if cache.len() >= max && !cache.contains_key(&key) {
            cache.retain(|_, e| now.duration_since(e.at) < ttl);
            while cache.len() >= max {
                let oldest = cache
                    .iter()
                    .min_by_key(|(_, e)| e.at)
                    .map(|(k, _)| k.clone());
                match oldest {
                    Some(k) => cache.remove(&k),
                    None => break,
                };
            }
        }
        cache.insert(key, CachedVerdict { at: now, verdict });
    }

    /// Whether `user` may do `request`: `Ok` or [`AccessError::Denied`] with the reason.
    pub async fn authorize(
        &self,
        user: &TokenIdentity,
        request: &AccessRequest,
    ) -> Result<(), AccessError> {
        let result = match self.verdict(user, request).await {
            Ok(v) if v.allowed => Ok(()),
            Ok(v) => Err(AccessError::Denied {
                user: user.username.clone(),
                request: request.to_string(),
                reason: v.reason,
            }),
            Err(e) => Err(e),
        };
        self.count(&result);
        result
    }

    /// Authenticates `authorization` and authorizes `request`.
    pub async fn check(
        &self,
        authorization: Option<&str>,
        request: &AccessRequest,
    ) -> Result<TokenIdentity, AccessError> {
        let user = self.authenticate(authorization).await?;
        self.authorize(&user, request).await?;
        Ok(user)
    }

    /// Which of `tenants` `user` may `verb` routes of: [`TenantGrant::All`] with a cluster-wide
    /// grant, else the namespaces whose own review allows. Any review without a verdict fails
    /// the whole request (fail closed); a caller granted none of them is still answered (with
    /// nothing), not refused.
    pub async fn visible_tenants(
        &self,
        user: &TokenIdentity,
        verb: &'static str,
        tenants: impl IntoIterator<Item = String>,
    ) -> Result<TenantGrant, AccessError> {
        let result = self.visible_tenants_uncounted(user, verb, tenants).await;
        self.count(&result.as_ref().map(|_| ()).map_err(Clone::clone));
        result
    }

    async fn visible_tenants_uncounted(
        &self,
        user: &TokenIdentity,
        verb: &'static str,
        tenants: impl IntoIterator<Item = String>,
    ) -> Result<TenantGrant, AccessError> {
        if self
            .verdict(user, &AccessRequest::routes(verb, ""))
            .await?
            .allowed
        {
            return Ok(TenantGrant::All);
        }
        let mut granted = BTreeSet::new();
        for t in tenants {
            if t.is_empty() {
                continue;
            }
            if self
                .verdict(user, &AccessRequest::routes(verb, &t))
                .await?
                .allowed
            {
                granted.insert(t);
            }
        }
        Ok(TenantGrant::Only(Arc::new(granted)))
    }
}

/// A reviewer over a fixed grant table (tests): `user` may `verb` routes in the namespaces
/// listed (`"*"` = cluster-wide), `cachenodes`, and the paths listed. Counts calls.
#[derive(Default)]
pub struct FakeAccessReviewer {
    grants: Mutex<BTreeMap<String, BTreeSet<String>>>,
    unavailable: Mutex<Option<String>>,
    calls: std::sync::atomic::AtomicUsize,
}

impl FakeAccessReviewer {
    /// Nothing is allowed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allows `user` the request whose [`AccessRequest`] display is `what` (e.g.
    /// `get cacheroutes.inferencecache.io in namespace "team-a"`).
    pub fn allow(self, user: &str, what: &str) -> Self {
        self.grants
            .lock()
            .entry(user.to_string())
            .or_default()
            .insert(what.to_string());
        self
    }

    /// Makes every review fail with [`VerifyError::Unavailable`] (`None` restores).
    pub fn set_unavailable(&self, why: Option<&str>) {
        *self.unavailable.lock() = why.map(str::to_string);
    }

    /// Reviews answered so far.
    pub fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[tonic::async_trait]
impl AccessReviewer for FakeAccessReviewer {
    async fn review(
        &self,
        user: &TokenIdentity,
        request: &AccessRequest,
    ) -> Result<Verdict, VerifyError> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(why) = self.unavailable.lock().clone() {
            return Err(VerifyError::Unavailable(why));
        }
        let allowed = self
            .grants
            .lock()
            .get(&user.username)
            .is_some_and(|g| g.contains(&request.to_string()));
        Ok(Verdict {
            allowed,
            reason: if allowed {
                "granted".into()
            } else {
                "no grant in the fake table".into()
            },
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_value() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("abc"), None);
    }

    #[test]
    fn requests_become_the_review_attributes_kubernetes_checks() {
        let user = TokenIdentity {
            username: "system:serviceaccount:gw:gateway".into(),
            uid: "u1".into(),
            groups: vec!["system:serviceaccounts".into()],
            ..Default::default()
        };
        let spec = AccessRequest::routes("get", "team-a").spec(&user);
        let ra = spec.resource_attributes.unwrap();
        assert_eq!(ra.group.as_deref(), Some(API_GROUP));
        assert_eq!(ra.resource.as_deref(), Some("cacheroutes"));
        assert_eq!(ra.verb.as_deref(), Some("get"));
        assert_eq!(ra.namespace.as_deref(), Some("team-a"));
        assert_eq!(
            spec.user.as_deref(),
            Some("system:serviceaccount:gw:gateway")
        );
        assert_eq!(spec.uid.as_deref(), Some("u1"));
        // Cluster-wide: no namespace at all (the API server reads "" as every namespace).
        let ra = AccessRequest::routes("list", "")
            .spec(&user)
            .resource_attributes
            .unwrap();
        assert_eq!(ra.namespace, None);
        let nra = AccessRequest::Path {
            verb: "post",
            path: "/probe",
        }
        .spec(&user)
        .non_resource_attributes
        .unwrap();
        assert_eq!(
            (nra.verb.as_deref(), nra.path.as_deref()),
            (Some("post"), Some("/probe"))
        );
        assert_eq!(
            AccessRequest::nodes("get", "n1").to_string(),
            "get cachenodes.inferencecache.io \"n1\""
        );
    }
}
