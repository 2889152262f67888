//! `RouterService.LookupRoute`: the gateways' question "which replica holds the longest cached
//! prefix of this request?" — a thin gRPC layer over [`PrefixIndex::lookup`].
//!
//! Per request the router resolves the tenant's lookup policy ([`PolicyTable`]: the namespace's
//! CachePolicy `lookupTimeoutMs` and `minimumPrefixTokens`, else the controller's defaults) and
//! runs the lookup under that budget: waiting for the index lock counts against it, and a lookup
//! over budget answers NO_HINT with reason `LookupTimeout` (fail open: the gateway routes by
//! load).
//!
//! An answer lists at most [`DEFAULT_MAX_REPLICAS`] replicas (configurable with
//! [`Router::with_max_replicas`]): the deepest, T1 before T2, then by stream id. A prompt whose
//! first block is a system prompt every replica caches would otherwise list the whole fleet.
//!
//! A request carries raw token ids, pre-computed content keys, or prompt text. Prompt text
//! (spec 000, "Block-size alignment for server-derived lookups": gateways call LookupRoute
//! "with raw token_ids / prompt_text") is tokenized with the model's own tokenizer
//! ([`crate::tokenize`]) and then looked up exactly as token ids are. Prompt text the router
//! cannot tokenize (too long, no model, no tokenizer, tokenizer never loaded or refusing the
//! text) answers NO_HINT with the [`PromptRefusal`] reason, never a gRPC error.
//!
//! In cluster the router requires a caller identity ([`Router::with_access`],
//! [`crate::access`]): the `authorization: Bearer TOKEN` metadata is verified, then `get` on
//! `cacheroutes` in the request's tenant is reviewed (refused with `PERMISSION_DENIED` and the
//! reason otherwise). A request without a tenant is answered from the namespaces the caller may
//! read only, and then says `narrowed = true`; without a cluster-wide grant a replica of another
//! namespace is never named.
//!
//! [`PrefixIndex::lookup`]: crate::index::PrefixIndex::lookup
//! [`PromptRefusal`]: crate::tokenize::PromptRefusal

use std::sync::Arc;
use std::time::Instant;

use ic_shared::limits::{MAX_BLOCK_SIZE, MAX_LOOKUP_TOKENS};
use ic_shared::proto::{self, router_service_server::RouterService};
use tonic::{Request, Response, Status};

use crate::access::{AccessRequest, CallerAuth, TenantGrant};
use crate::index::{LookupQuery, LookupResult, PolicyTable, ResolvedPolicy, LOOKUP_TIMEOUT};
use crate::state::Shared;
use crate::tokenize::{PromptRefusal, TOKENIZER_STALE};

/// `LookupRouteResponse.warnings` entry when replicas of the request's scope are not Exact
/// (`inexact_replicas` > 0), or, in cluster, before this replica first derived the node plans
/// ([`Shared::plans_pending`]): the answer may miss a replica holding a longer prefix, or a
/// NO_HINT may not be "nobody holds it".
pub const INDEX_INCOMPLETE: &str = "IndexIncomplete";

/// `LookupRouteResponse.warnings` entry of a request without a tenant that replicas of more
/// than one namespace (of those the caller may read) could answer: the replicas named may be
/// another tenant's than the caller's — the namespace is the part of `stream_id` before `/`
/// (issue 38 item 6: a pod in an unrelated namespace was named first for team-a's prompt,
/// without a word). A gateway that knows its tenant should name it; one that does not is told.
pub const SEVERAL_TENANTS: &str = "ReplicasOfSeveralTenants";

/// Replicas listed in one answer by default (the best ones).
pub const DEFAULT_MAX_REPLICAS: usize = 32;

/// The gRPC service.
#[derive(Clone)]
pub struct Router {
    shared: Arc<Shared>,
    policies: Arc<PolicyTable>,
    max_replicas: usize,
    access: Option<Arc<CallerAuth>>,
}

impl Router {
    /// A router over the shared index (and its policy table).
    pub fn new(shared: Arc<Shared>) -> Self {
        let policies = shared.index.read().policies();
        Router {
            shared,
            policies,
            max_replicas: DEFAULT_MAX_REPLICAS,
            access: None,
        }
    }

    /// Requires a caller identity on the gRPC method (module docs); without it (standalone,
    /// the in-process probe) every request is answered.
    pub fn with_access(mut self, access: Arc<CallerAuth>) -> Self {
        self.access = Some(access);
        self
    }

    /// Lists at most `n` replicas per answer (0 = every replica with a match).
    pub fn with_max_replicas(mut self, n: usize) -> Self {
        self.max_replicas = n;
        self
    }

    /// The lookup policy table the router reads (fill it from CachePolicy objects).
    pub fn policies(&self) -> &Arc<PolicyTable> {
        &self.policies
    }

    /// Answers one request (the same path the gRPC method and the functional probe use), over
    /// every tenant.
    ///
    /// With `prompt_text`, the text is tokenized first (blocking CPU work: up to
    /// [`MAX_PROMPT_TEXT_BYTES`](ic_shared::limits::MAX_PROMPT_TEXT_BYTES) of text; the gRPC
    /// method runs it on a blocking thread) and its ids replace `token_ids`.
    pub fn lookup(&self, req: &proto::LookupRouteRequest) -> proto::LookupRouteResponse {
        self.lookup_visible(req, &TenantGrant::All)
    }

    /// Answers one request from the replicas of the tenants `grant` allows only; the answer
    /// says `narrowed` when `grant` is not [`TenantGrant::All`].
    pub fn lookup_visible(
        &self,
        req: &proto::LookupRouteRequest,
        grant: &TenantGrant,
    ) -> proto::LookupRouteResponse {
        let started = Instant::now();
        let mut warnings = Vec::new();
        let mut prompt_tokens = 0;
        let token_ids = match &req.prompt_text {
            None => req.token_ids.clone(),
            Some(text) => {
                let add_special = req.add_special_tokens.unwrap_or(true);
                match self.shared.tokenizers.encode(&req.model, text, add_special) {
                    Ok(enc) => {
                        if enc.stale {
                            warnings.push(TOKENIZER_STALE.to_string());
                        }
                        prompt_tokens = u32::try_from(enc.ids.len()).unwrap_or(u32::MAX);
                        enc.ids
                    }
                    Err(refusal) => return self.refuse_prompt(started, req.block_size, refusal),
                }
            }
        };
        let policy = self.policies.resolve_or(
            &req.tenant,
            ResolvedPolicy {
                // Where no CachePolicy sets one, `--lookup-timeout-ms` (issue 38 item 5: a
                // lookup without a budget took 8.6 s).
                lookup_timeout: Some(self.shared.policy.default_lookup_timeout()),
                minimum_prefix_tokens: self.shared.policy.minimum_prefix_tokens,
            },
        );
        let deadline = policy.lookup_timeout.map(|b| started + b);
        let q = LookupQuery {
            tenant: req.tenant.clone(),
            model: req.model.clone(),
            hash_scheme: req.hash_scheme.clone(),
            adapter: req.adapter.clone(),
            token_ids,
            content_keys: req.content_keys.clone(),
            block_size: (req.block_size > 0).then_some(req.block_size),
            minimum_prefix_tokens: policy.minimum_prefix_tokens,
            deadline,
            max_replicas: self.max_replicas,
            visible_tenants: match grant {
                TenantGrant::All => None,
                TenantGrant::Only(set) => Some(set.clone()),
            },
        };
        let waiting = Instant::now();
        let guard = self.shared.index_read_for_lookup(deadline);
        self.shared
            .metrics
            .lookup_lock_wait_seconds
            .observe(waiting.elapsed().as_secs_f64());
        let mut several_tenants = false;
        let result = match guard {
            Some(ix) => {
                several_tenants = q.tenant.is_empty() && ix.spans_tenants(&q);
                ix.lookup(&q)
            }
            None => LookupResult {
                prefix_match: false,
                replicas: Vec::new(),
                block_size: q.block_size.unwrap_or(0),
                request_blocks: 0,
                reason: LOOKUP_TIMEOUT.to_string(),
                inexact_replicas: 0,
            },
        };
        let m = &self.shared.metrics;
        m.lookup_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        m.lookups_total
            .with_label_values(&[if result.prefix_match {
                "prefix_match"
            } else {
                "no_hint"
            }])
            .inc();
        if result.inexact_replicas > 0
            || self
                .shared
                .plans_pending
                .load(std::sync::atomic::Ordering::Acquire)
        {
            warnings.push(INDEX_INCOMPLETE.to_string());
        }
        let mut answer = to_proto(result);
        if several_tenants {
            warnings.push(SEVERAL_TENANTS.to_string());
        }
        answer.warnings = warnings;
        answer.prompt_tokens = prompt_tokens;
        answer.narrowed = !matches!(grant, TenantGrant::All);
        answer
    }

    /// NO_HINT for prompt text that got no lookup, counted by reason.
    fn refuse_prompt(
        &self,
        started: Instant,
        block_size: u32,
        refusal: PromptRefusal,
    ) -> proto::LookupRouteResponse {
        let m = &self.shared.metrics;
        m.prompt_text_refusals_total
            .with_label_values(&[refusal.label()])
            .inc();
        m.lookup_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        m.lookups_total.with_label_values(&["no_hint"]).inc();
        to_proto(LookupResult {
            prefix_match: false,
            replicas: Vec::new(),
            block_size,
            request_blocks: 0,
            reason: refusal.reason().to_string(),
            inexact_replicas: 0,
        })
    }

    /// The tenants the caller of `request` may read for `req` (module docs), or the refusal.
    async fn grant(
        &self,
        request: &Request<proto::LookupRouteRequest>,
    ) -> Result<TenantGrant, Status> {
        let Some(access) = &self.access else {
            return Ok(TenantGrant::All);
        };
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let user = access
            .authenticate(authorization)
            .await
            .map_err(|e| e.to_status())?;
        let tenant = &request.get_ref().tenant;
        if !tenant.is_empty() {
            access
                .authorize(&user, &AccessRequest::routes("get", tenant))
                .await
                .map_err(|e| e.to_status())?;
            return Ok(TenantGrant::All);
        }
        let tenants = self.shared.index.read().tenants();
        access
            .visible_tenants(&user, "get", tenants)
            .await
            .map_err(|e| e.to_status())
    }
}

fn to_proto(r: LookupResult) -> proto::LookupRouteResponse {
    let now_ms = crate::index::mono_ms();
    proto::LookupRouteResponse {
        decision: if r.prefix_match {
            proto::Decision::PrefixMatch
        } else {
            proto::Decision::NoHint
        } as i32,
        replicas: r
            .replicas
            .into_iter()
            .map(|m| proto::ReplicaMatch {
                replica: m.names.replica.clone(),
                stream_id: m.names.stream_id.clone(),
                node: m.names.node.clone(),
                dp_rank: m.dp_rank,
                matched_blocks: m.matched_blocks,
                matched_tokens: m.matched_tokens,
                block_size: m.block_size,
                tier: m.tier.to_proto() as i32,
                backend: m.names.backend.clone(),
                coverage: m.coverage.state.to_proto() as i32,
                coverage_reason: m.coverage.reason_str().to_string(),
                coverage_age_ms: m.coverage_age_ms(now_ms),
            })
            .collect(),
        block_size: r.block_size,
        request_blocks: r.request_blocks,
        reason: r.reason,
        inexact_replicas: r.inexact_replicas,
        warnings: Vec::new(),
        prompt_tokens: 0,
        narrowed: false,
    }
}

/// Refuses a request above the lookup caps: more than [`MAX_LOOKUP_TOKENS`] token ids or
/// content keys, or a block size above [`MAX_BLOCK_SIZE`] (docs/security.md "Input bounds").
fn check_bounds(req: &proto::LookupRouteRequest) -> Result<(), Status> {
    for (field, n) in [
        ("token_ids", req.token_ids.len()),
        ("content_keys", req.content_keys.len()),
    ] {
        if n > MAX_LOOKUP_TOKENS {
            return Err(Status::invalid_argument(format!(
                "LookupRouteRequest.{field} has {n} entries, above the cap of {MAX_LOOKUP_TOKENS}"
            )));
        }
    }
    if req.block_size > MAX_BLOCK_SIZE {
        return Err(Status::invalid_argument(format!(
            "LookupRouteRequest.block_size {} is above the cap of {MAX_BLOCK_SIZE} tokens",
            req.block_size
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl RouterService for Router {
    async fn lookup_route(
        &self,
        request: Request<proto::LookupRouteRequest>,
    ) -> Result<Response<proto::LookupRouteResponse>, Status> {
        let grant = self.grant(&request).await?;
        let req = request.into_inner();
        if req.prompt_text.is_some() {
            if !req.token_ids.is_empty() || !req.content_keys.is_empty() {
                return Err(Status::invalid_argument(
                    "LookupRouteRequest carries prompt_text together with token_ids or content_keys; send one of them",
                ));
            }
        } else if req.token_ids.is_empty() && req.content_keys.is_empty() {
            return Err(Status::invalid_argument(
                "LookupRouteRequest needs token_ids, content_keys or prompt_text",
            ));
        }
        check_bounds(&req)?;
        if req.prompt_text.is_none() {
            return Ok(Response::new(self.lookup_visible(&req, &grant)));
        }
        // Tokenizing up to 1 MiB of text is CPU work: keep it off the async workers.
        let started = Instant::now();
        let router = self.clone();
        let (model, block_size) = (req.model.clone(), req.block_size);
        let answer =
            match tokio::task::spawn_blocking(move || router.lookup_visible(&req, &grant)).await {
                Ok(a) => a,
                Err(e) => {
                    tracing::error!(model, error = %e, "prompt_text lookup task failed");
                    self.refuse_prompt(started, block_size, PromptRefusal::TokenizationFailed)
                }
            };
        Ok(Response::new(answer))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Duration;

    use ic_shared::kv::content_key::chain;
    use ic_shared::proto::{kv_op::Op, KvOp, StoreOp, StreamDelta, StreamDescriptor};

    use super::*;
    use crate::state::LookupPolicy;

    fn router_with_prefix() -> Router {
        router_with(LookupPolicy::default(), &["team-a"], 16)
    }

    /// A router whose index holds, for each tenant, replica `p` with `tokens` tokens (blocks
    /// of 4) of the prompt `0..`.
    fn router_with(policy: LookupPolicy, tenants: &[&str], tokens: u32) -> Router {
        let shared = Arc::new(Shared::new(policy).unwrap());
        for (i, tenant) in tenants.iter().enumerate() {
            hold_prefix(&shared, &format!("n{i}"), tenant, tokens - 4 * i as u32);
        }
        Router::new(shared)
    }

    fn hold_prefix(shared: &Shared, node: &str, tenant: &str, tokens: u32) {
        let desc = StreamDescriptor {
            stream_id: format!("{tenant}/p#0"),
            replica: "p".into(),
            tenant: tenant.into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        };
        {
            let mut ix = shared.index.write();
            ix.resync_node(
                node,
                &[proto::StreamSnapshot {
                    stream: Some(desc.clone()),
                    ..Default::default()
                }],
            );
            ix.apply_delta(
                node,
                &StreamDelta {
                    coverage: ic_shared::proto::Coverage::Exact as i32,
                    coverage_reason: String::new(),
                    stream: Some(desc),
                    seq: 1,
                    ops: vec![KvOp {
                        op: Some(Op::Store(StoreOp {
                            adapter: String::new(),
                            block_size: 4,
                            tier: proto::Tier::T1 as i32,
                            content_keys: chain(&(0..tokens).collect::<Vec<_>>(), 4),
                        })),
                    }],
                    last_event_unix_ms: 1,
                },
            )
            .unwrap();
        }
    }

    /// Issue 38 item 5: lookups had no deadline unless a CachePolicy set one (a 1 M-token
    /// lookup took 8.6 s). `--lookup-timeout-ms` now applies where none is set, tenant-less
    /// lookups included; a CachePolicy's own value still wins.
    #[test]
    fn lookups_without_a_cache_policy_get_the_default_budget() {
        let r = router_with(
            LookupPolicy {
                lookup_timeout: Some(Duration::from_millis(20)),
                ..Default::default()
            },
            &["team-a"],
            16,
        );
        let shared = r.shared.clone();
        let held = shared.index.write();
        assert_eq!(r.lookup(&req("team-a", 16)).reason, LOOKUP_TIMEOUT);
        assert_eq!(r.lookup(&req("", 16)).reason, LOOKUP_TIMEOUT);
        drop(held);
        assert_eq!(
            r.lookup(&req("team-a", 16)).decision,
            proto::Decision::PrefixMatch as i32
        );
        assert_eq!(
            crate::state::LookupPolicy::default().default_lookup_timeout(),
            crate::state::DEFAULT_LOOKUP_TIMEOUT
        );
    }

    /// Issue 38 item 6: a replica of an unrelated namespace was named first for team-a's prompt
    /// in a tenant-less lookup, without a word. The answer now says so.
    #[test]
    fn a_tenantless_answer_naming_several_namespaces_says_so() {
        // `intruder` holds 16 tokens, team-a 12: the intruder ranks first.
        let r = router_with(LookupPolicy::default(), &["intruder", "team-a"], 16);
        let a = r.lookup(&req("", 16));
        assert_eq!(a.replicas[0].stream_id, "intruder/p#0");
        assert!(a.warnings.contains(&SEVERAL_TENANTS.to_string()), "{a:?}");
        // Naming the tenant: only its own replica, no warning.
        let a = r.lookup(&req("team-a", 16));
        assert_eq!(a.replicas.len(), 1);
        assert!(!a.warnings.contains(&SEVERAL_TENANTS.to_string()), "{a:?}");
        // A prompt both hold: the answer lists both namespaces, and says so.
        let r = router_with(LookupPolicy::default(), &["intruder", "team-a"], 16);
        let a = r.lookup(&req("", 8));
        assert!(a.warnings.contains(&SEVERAL_TENANTS.to_string()), "{a:?}");
        // One namespace only: nothing to say.
        let r = router_with(LookupPolicy::default(), &["team-a"], 16);
        assert!(r.lookup(&req("", 16)).warnings.is_empty());
    }

    fn req(tenant: &str, n: u32) -> proto::LookupRouteRequest {
        proto::LookupRouteRequest {
            tenant: tenant.into(),
            token_ids: (0..n).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn namespace_policy_gates_short_requests_and_matches() {
        let r = router_with_prefix();
        assert_eq!(
            r.lookup(&req("team-a", 16)).decision,
            proto::Decision::PrefixMatch as i32
        );
        r.policies().set_policy("team-a", None, Some(32));
        let a = r.lookup(&req("team-a", 16));
        assert_eq!(a.decision, proto::Decision::NoHint as i32);
        assert_eq!(a.reason, "BelowMinimumPrefixTokens");
        // A long request whose match is only 16 tokens is gated too.
        let a = r.lookup(&req("team-a", 40));
        assert_eq!(a.reason, "BelowMinimumPrefixTokens");
        // Other namespaces keep the defaults.
        r.policies().set_policy("team-b", None, Some(1000));
        r.policies().remove_policy("team-a");
        assert_eq!(
            r.lookup(&req("team-a", 16)).decision,
            proto::Decision::PrefixMatch as i32
        );
    }

    #[test]
    fn lookup_over_budget_answers_no_hint_lookup_timeout() {
        let r = router_with_prefix();
        r.policies().set_policy("team-a", Some(20), None);
        // A writer holding the index past the budget: the lookup gives up instead of waiting.
        let shared = r.shared.clone();
        let held = shared.index.write();
        let started = Instant::now();
        let a = r.lookup(&req("team-a", 16));
        let waited = started.elapsed();
        drop(held);
        assert_eq!(a.decision, proto::Decision::NoHint as i32);
        assert_eq!(a.reason, LOOKUP_TIMEOUT);
        assert!(waited >= Duration::from_millis(20) && waited < Duration::from_secs(2));
        // The wait is the read-lock histogram's: one lookup, counted in its ≥ 10 ms buckets.
        let w = &shared.metrics.lookup_lock_wait_seconds;
        assert_eq!(w.get_sample_count(), 1);
        assert!(w.get_sample_sum() >= 0.02, "{}", w.get_sample_sum());
        // Within budget it answers normally; 0 means no budget.
        assert_eq!(
            r.lookup(&req("team-a", 16)).decision,
            proto::Decision::PrefixMatch as i32
        );
        r.policies().set_policy("team-a", Some(0), None);
        let _held = shared.index.read();
        assert_eq!(
            r.lookup(&req("team-a", 16)).decision,
            proto::Decision::PrefixMatch as i32
        );
    }
}
