//! The functional probe behind `/probe` (spec 000 "Functional-probe gate"): a deterministic
//! synthetic round trip through the cache plane, stage by stage.
//!
//! - **ingest** — registers a throw-away probe stream under its own pseudo-node and applies a
//!   synthetic `StreamDelta` (one `Store` of a synthetic prompt's content keys) through the same
//!   [`PrefixIndex::resync_node`] / [`PrefixIndex::apply_delta`] the agents' stream uses, then
//!   reads the stream's entries back.
//! - **routing** — asks the real [`Router`] (policy, budget, key derivation from raw token ids,
//!   scoring) for the synthetic prompt and expects PREFIX_MATCH on the probe replica at full
//!   depth.
//! - **t2** — the spec's Stage C: for the gate (one CacheBackend), a put / get through the
//!   backend's own remote tier ([`crate::t2probe`]); `/probe` itself names no backend, so
//!   there it is skipped.
//!
//! The probe stream is removed afterwards whatever happened. Each stage is `ok`, `failed` or
//! `skipped` with a diagnostic a person can act on; a stage after a failed one is skipped.
//!
//! [`PrefixIndex::resync_node`]: crate::index::PrefixIndex::resync_node
//! [`PrefixIndex::apply_delta`]: crate::index::PrefixIndex::apply_delta

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ic_shared::kv::content_key;
use ic_shared::limits::{MAX_BLOCK_SIZE, MAX_NAME_BYTES};
use ic_shared::proto::{self, kv_op::Op};
use serde::{Deserialize, Serialize};

use crate::router::Router;
use crate::state::Shared;

/// Tenant, model and scheme used when the request names none.
pub const PROBE_DEFAULT: &str = "inferencecache-probe";

/// Prefix of the pseudo-node a probe stream is registered under.
pub const PROBE_NODE_PREFIX: &str = "inferencecache-probe/";

/// Most synthetic tokens one probe builds (blocks × block size): a probe for a tenant whose
/// minimum prefix is longer fails its routing stage with `BelowMinimumPrefixTokens` instead of
/// allocating more.
pub const PROBE_MAX_TOKENS: u32 = 65_536;

/// Where to probe: the coordinates a gateway would look up for the backend under test.
/// [`ProbeRequest::validate`] bounds every field before anything is allocated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProbeRequest {
    /// Tenant (namespace); default `inferencecache-probe`.
    pub tenant: Option<String>,
    /// Model id; default `inferencecache-probe`.
    pub model: Option<String>,
    /// `vllm` or `sglang`; default `vllm`.
    pub hash_scheme: Option<String>,
    /// Block size in tokens; default 16, at most [`MAX_BLOCK_SIZE`].
    pub block_size: Option<u32>,
    /// CacheBackend (`namespace/name`) the probe is for; only echoed in the stream descriptor.
    pub backend: Option<String>,
}

impl ProbeRequest {
    /// Checks every size parameter against its cap: `blockSize` at most [`MAX_BLOCK_SIZE`],
    /// each string at most [`MAX_NAME_BYTES`] bytes.
    ///
    /// # Errors
    /// The first field over its cap, with the cap, as a sentence for a 400 answer.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(b) = self.block_size {
            if b > MAX_BLOCK_SIZE {
                return Err(format!(
                    "blockSize {b} is above the cap of {MAX_BLOCK_SIZE} tokens"
                ));
            }
        }
        let strings = [
            ("tenant", &self.tenant),
            ("model", &self.model),
            ("hashScheme", &self.hash_scheme),
            ("backend", &self.backend),
        ];
        for (field, value) in strings {
            if let Some(v) = value {
                if v.len() > MAX_NAME_BYTES {
                    return Err(format!(
                        "{field} is {} bytes, above the cap of {MAX_NAME_BYTES}",
                        v.len()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A stage's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StageStatus {
    /// Round-tripped.
    Ok,
    /// Broken; see the message.
    Failed,
    /// Not run; see the message.
    Skipped,
}

/// One stage's outcome with its diagnostic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StageReport {
    /// `ok`, `failed` or `skipped`.
    pub status: StageStatus,
    /// What happened, in a sentence.
    pub message: String,
}

impl StageReport {
    fn ok(message: impl Into<String>) -> Self {
        StageReport {
            status: StageStatus::Ok,
            message: message.into(),
        }
    }

    fn failed(message: impl Into<String>) -> Self {
        StageReport {
            status: StageStatus::Failed,
            message: message.into(),
        }
    }

    fn skipped(message: impl Into<String>) -> Self {
        StageReport {
            status: StageStatus::Skipped,
            message: message.into(),
        }
    }
}

/// The three stages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeStages {
    /// A synthetic event through the real ingest path into the index.
    pub ingest: StageReport,
    /// A lookup through the real router finds it.
    pub routing: StageReport,
    /// Tier-2 put/get through the backend's remote tier (skipped for `/probe` itself).
    pub t2: StageReport,
}

/// The `/probe` answer (JSON, camelCase).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeReport {
    /// True when no stage failed.
    pub ok: bool,
    /// Per-stage outcomes.
    pub stages: ProbeStages,
    /// The probe stream used (removed again).
    pub stream_id: String,
    /// Wall time of the whole probe, milliseconds.
    pub duration_ms: f64,
}

static PROBE_SEQ: AtomicU64 = AtomicU64::new(1);

/// Synthetic prompt of `blocks` blocks; token ids in a range tokenizers do not produce, varied
/// per probe so concurrent probes never share keys.
fn synthetic_tokens(nonce: u64, block_size: u32, blocks: u32) -> Vec<u32> {
    let base = 0xF000_0000u32 | ((nonce as u32 & 0xFFFF) << 12);
    (0..block_size.saturating_mul(blocks))
        .map(|i| base.wrapping_add(i))
        .collect()
}

/// Runs the probe against `shared`'s index through `router`. `req` is expected to pass
/// [`ProbeRequest::validate`]; a larger block size is clamped to [`MAX_BLOCK_SIZE`] and the
/// prompt to [`PROBE_MAX_TOKENS`] whatever the caller.
pub fn run(shared: &Shared, router: &Router, req: &ProbeRequest) -> ProbeReport {
    let started = Instant::now();
    let nonce = PROBE_SEQ.fetch_add(1, Ordering::Relaxed);
    let tenant = req
        .tenant
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| PROBE_DEFAULT.to_string());
    let model = req
        .model
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| PROBE_DEFAULT.to_string());
    let hash_scheme = req
        .hash_scheme
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "vllm".to_string());
    let block_size = req
        .block_size
        .filter(|b| *b > 0)
        .unwrap_or(16)
        .min(MAX_BLOCK_SIZE);
    let node = format!("{PROBE_NODE_PREFIX}{}-{nonce}", std::process::id());
    let stream_id = format!("{tenant}/inferencecache-probe-{nonce}#0");
    let desc = proto::StreamDescriptor {
        stream_id: stream_id.clone(),
        replica: format!("inferencecache-probe-{nonce}"),
        dp_rank: 0,
        tenant: tenant.clone(),
        model: model.clone(),
        hash_scheme: hash_scheme.clone(),
        backend: req.backend.clone().unwrap_or_default(),
        node: node.clone(),
        offload_chunk_tokens: 0,
    };
    // Long enough to pass the tenant's minimum-prefix gate.
    let minimum = router
        .policies()
        .resolve_or(
            &tenant,
            crate::index::ResolvedPolicy {
                lookup_timeout: None,
                minimum_prefix_tokens: shared.policy.minimum_prefix_tokens,
            },
        )
        .minimum_prefix_tokens;
    let blocks = minimum
        .div_ceil(block_size)
        .clamp(4, 4096)
        .min((PROBE_MAX_TOKENS / block_size).max(1));
    let tokens = synthetic_tokens(nonce, block_size, blocks);
    let keys = content_key::chain(&tokens, block_size as usize);

    let ingest = {
        let mut ix = shared.index_write(crate::state::WriteHold::Probe);
        // The probe's blocks do not count against the tenant's quota: they would evict as many
        // of its real entries (the probe removes its own at the end).
        ix.add_quota_headroom(&tenant, keys.len());
        ix.resync_node(
            &node,
            &[proto::StreamSnapshot {
                stream: Some(desc.clone()),
                seq: 0,
                entries: Vec::new(),
                last_event_unix_ms: 0,
                stale: false,
                coverage: proto::Coverage::Exact as i32,
                coverage_reason: String::new(),
            }],
        );
        let delta = proto::StreamDelta {
            stream: Some(desc.clone()),
            seq: 1,
            ops: vec![proto::KvOp {
                op: Some(Op::Store(proto::StoreOp {
                    adapter: String::new(),
                    block_size,
                    tier: proto::Tier::T1 as i32,
                    content_keys: keys.clone(),
                })),
            }],
            last_event_unix_ms: ic_shared::now_unix_ms(),
            coverage: proto::Coverage::Exact as i32,
            coverage_reason: String::new(),
        };
        let report = match ix.apply_delta(&node, &delta) {
            Err(e) => StageReport::failed(format!(
                "synthesized event refused by the index ingest path ({e}); agents' deltas would be refused the same way"
            )),
            Ok(()) => {
                let held: Vec<u64> = ix
                    .stream_entries(&stream_id)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|e| e.content_key)
                    .collect();
                let mut want = keys.clone();
                want.sort_unstable();
                let mut got = held;
                got.sort_unstable();
                if got == want {
                    StageReport::ok(format!(
                        "a synthetic {}-block delta for {stream_id} was applied and read back",
                        keys.len()
                    ))
                } else {
                    StageReport::failed(format!(
                        "synthesized event not in index — {} of {} blocks read back; the in-process index ingest path is broken",
                        got.len(),
                        want.len()
                    ))
                }
            }
        };
        shared.update_index_gauges(&ix);
        report
    };

    let routing = if ingest.status != StageStatus::Ok {
        StageReport::skipped("not run: the ingest stage failed")
    } else {
        let answer = router.lookup(&proto::LookupRouteRequest {
            tenant: tenant.clone(),
            model: model.clone(),
            hash_scheme: hash_scheme.clone(),
            adapter: String::new(),
            token_ids: tokens,
            content_keys: Vec::new(),
            block_size: 0,
            prompt_text: None,
            add_special_tokens: None,
        });
        let ours = answer.replicas.iter().find(|m| m.stream_id == stream_id);
        if answer.decision != proto::Decision::PrefixMatch as i32 {
            StageReport::failed(format!(
                "the router answered NO_HINT ({}) for a prefix the index holds; lookups for tenant {tenant:?}, model {model:?}, scheme {hash_scheme:?} cannot hit",
                if answer.reason.is_empty() { "no reason" } else { &answer.reason }
            ))
        } else {
            match ours {
                Some(m) if m.matched_blocks as usize == keys.len() => StageReport::ok(format!(
                    "the router found the probe replica with all {} blocks ({} tokens)",
                    m.matched_blocks, m.matched_tokens
                )),
                Some(m) => StageReport::failed(format!(
                    "the router matched {} of {} blocks of the probe prefix; key derivation or chunking (block size {}) disagrees with ingest",
                    m.matched_blocks,
                    keys.len(),
                    answer.block_size
                )),
                None => StageReport::failed(
                    "the router answered PREFIX_MATCH without the probe replica; routing answers do not reflect the index",
                ),
            }
        }
    };

    {
        let mut ix = shared.index_write(crate::state::WriteHold::Probe);
        ix.remove_node(&node);
        ix.remove_quota_headroom(&tenant, keys.len());
        shared.update_index_gauges(&ix);
    }
    let t2 = StageReport::skipped(
        "this probe names no CacheBackend tier; the gate probes each backend's own tier",
    );
    let ok = ![&ingest, &routing, &t2]
        .iter()
        .any(|s| s.status == StageStatus::Failed);
    ProbeReport {
        ok,
        stages: ProbeStages {
            ingest,
            routing,
            t2,
        },
        stream_id,
        duration_ms: started.elapsed().as_secs_f64() * 1000.0,
    }
}

/// The functional-probe gate's in-process prober (spec 000 "Functional-probe gate"): the index
/// lives in this process, so the CacheBackend reconciler runs [`run`] directly instead of
/// calling a `/probe` URL. The probe uses its own tenant and model (a namespace's CachePolicy
/// cannot make it miss) and the backend's hash scheme (`vllm` / `sglang` from
/// `spec.runtime`). With `t2`, Stage C is a real put / get through the backend's own remote tier
/// ([`crate::t2probe`]) once ingest and routing passed; without, it is skipped. Its per-stage
/// report maps onto the gate's stage results; an in-process probe has no transport, so it never
/// answers `TransportError`.
pub fn in_process_prober(
    shared: Arc<Shared>,
    t2: Option<Arc<dyn crate::t2probe::T2Prober>>,
) -> Arc<dyn crate::reconcile::cachebackend::probe::Prober> {
    Arc::new(InProcessProber {
        router: Router::new(shared.clone()),
        shared,
        t2,
    })
}

struct InProcessProber {
    shared: Arc<Shared>,
    router: Router,
    t2: Option<Arc<dyn crate::t2probe::T2Prober>>,
}

impl crate::reconcile::cachebackend::probe::Prober for InProcessProber {
    fn probe<'a>(
        &'a self,
        cb: &'a ic_shared::crd::CacheBackend,
    ) -> futures::future::BoxFuture<'a, crate::reconcile::cachebackend::probe::ProbeOutcome> {
        Box::pin(async move {
            let req = ProbeRequest {
                hash_scheme: Some(
                    match cb.spec.runtime {
                        ic_shared::crd::Runtime::Vllm => "vllm",
                        ic_shared::crd::Runtime::SgLang => "sglang",
                    }
                    .to_string(),
                ),
                backend: Some(format!(
                    "{}/{}",
                    cb.metadata.namespace.as_deref().unwrap_or_default(),
                    cb.metadata.name.as_deref().unwrap_or_default()
                )),
                ..Default::default()
            };
            let mut report = run(&self.shared, &self.router, &req);
            if let Some(t2) = &self.t2 {
                report.stages.t2 = if report.ok {
                    use crate::t2probe::T2Outcome;
                    match t2
                        .probe(cb, PROBE_SEQ.fetch_add(1, Ordering::Relaxed))
                        .await
                    {
                        T2Outcome::Ok(m) => StageReport::ok(m),
                        T2Outcome::Failed(m) => StageReport::failed(m),
                        T2Outcome::Skipped(m) => StageReport::skipped(m),
                    }
                } else {
                    StageReport::skipped("not run: an earlier stage failed")
                };
                report.ok = report.stages.t2.status != StageStatus::Failed && report.ok;
            }
            outcome_of(&report)
        })
    }
}

/// A `/probe` report as the gate's [`ProbeOutcome`](crate::reconcile::cachebackend::probe::ProbeOutcome).
pub fn outcome_of(report: &ProbeReport) -> crate::reconcile::cachebackend::probe::ProbeOutcome {
    use crate::reconcile::cachebackend::probe::{self as gate, ProbeOutcome};
    let stage = |s: &StageReport| match s.status {
        StageStatus::Ok => gate::StageResult::Ok,
        StageStatus::Skipped => gate::StageResult::Skipped,
        StageStatus::Failed => gate::StageResult::Failed(s.message.clone()),
    };
    ProbeOutcome::Completed(gate::ProbeStages {
        ingest: stage(&report.stages.ingest),
        routing: stage(&report.stages.routing),
        t2: stage(&report.stages.t2),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::state::LookupPolicy;

    #[test]
    fn probe_round_trips_and_leaves_nothing_behind() {
        let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
        let router = Router::new(shared.clone());
        let r = run(&shared, &router, &ProbeRequest::default());
        assert!(r.ok, "{r:?}");
        assert_eq!(r.stages.ingest.status, StageStatus::Ok);
        assert_eq!(r.stages.routing.status, StageStatus::Ok);
        assert_eq!(r.stages.t2.status, StageStatus::Skipped);
        assert_eq!(shared.index.read().replica_count(), 0);
        assert_eq!(shared.index.read().entry_count(), 0);
        // The probe's block size is not left registered.
        assert!(shared.index.read().block_sizes().is_empty());
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["stages"]["ingest"]["status"], "ok");
        assert!(json["durationMs"].is_number());
    }

    #[test]
    fn a_probe_of_a_tenant_at_its_quota_evicts_none_of_its_entries() {
        let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
        let router = Router::new(shared.clone());
        let stream = proto::StreamDescriptor {
            stream_id: "team-a/engine-0#0".into(),
            replica: "engine-0".into(),
            tenant: "team-a".into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        };
        {
            let mut ix = shared.index.write();
            ix.set_tenant_quotas(std::collections::HashMap::from([("team-a".to_string(), 8)]));
            ix.resync_node(
                "gpu-1",
                &[proto::StreamSnapshot {
                    stream: Some(stream),
                    coverage: proto::Coverage::Exact as i32,
                    entries: (1..=8)
                        .map(|k| proto::BlockEntry {
                            block_size: 16,
                            content_key: k,
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }],
            );
        }
        let r = run(
            &shared,
            &router,
            &ProbeRequest {
                tenant: Some("team-a".into()),
                model: Some("m".into()),
                ..Default::default()
            },
        );
        assert!(r.ok, "{r:?}");
        let ix = shared.index.read();
        assert_eq!(ix.stream_entries("team-a/engine-0#0").unwrap().len(), 8);
        assert_eq!(ix.quota_evictions().get("team-a"), None);
        let snap = ix.snapshot();
        assert_eq!(snap.replicas.len(), 1);
        assert_eq!(
            (snap.replicas[0].coverage, snap.replicas[0].coverage_reason),
            ("Exact", None)
        );
    }

    #[test]
    fn a_policy_that_cannot_hit_fails_the_routing_stage_with_its_reason() {
        let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
        let router = Router::new(shared.clone());
        // A minimum no prompt can reach: the router answers NO_HINT and the stage says why.
        router.policies().set_policy("strict", None, Some(u32::MAX));
        let req = ProbeRequest {
            tenant: Some("strict".into()),
            ..Default::default()
        };
        let r = run(&shared, &router, &req);
        assert!(!r.ok);
        assert_eq!(r.stages.ingest.status, StageStatus::Ok);
        assert_eq!(r.stages.routing.status, StageStatus::Failed);
        assert!(
            r.stages
                .routing
                .message
                .contains("BelowMinimumPrefixTokens"),
            "{r:?}"
        );
        assert_eq!(shared.index.read().replica_count(), 0);
    }

    #[tokio::test]
    async fn the_gate_prober_maps_stages_and_ignores_namespace_policies() {
        use crate::reconcile::cachebackend::probe::{ProbeOutcome, StageResult};
        let shared = Arc::new(Shared::new(LookupPolicy::default()).unwrap());
        // The backend's namespace has a policy no probe prompt can meet: the gate's probe uses
        // its own tenant, so it is unaffected.
        Router::new(shared.clone())
            .policies()
            .set_policy("team-a", None, Some(u32::MAX));
        let prober = in_process_prober(shared.clone(), None);
        let cb: ic_shared::crd::CacheBackend = serde_json::from_value(serde_json::json!({
            "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
            "metadata": {"name": "cb", "namespace": "team-a"},
            "spec": {"runtime": "SGLang"}
        }))
        .unwrap();
        match prober.probe(&cb).await {
            ProbeOutcome::Completed(stages) => {
                assert_eq!(stages.ingest, StageResult::Ok);
                assert_eq!(stages.routing, StageResult::Ok);
                assert_eq!(stages.t2, StageResult::Skipped);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(shared.index.read().replica_count(), 0);
        // A failed stage keeps its diagnostic.
        let router = Router::new(shared.clone());
        let report = run(
            &shared,
            &router,
            &ProbeRequest {
                tenant: Some("team-a".into()),
                ..Default::default()
            },
        );
        match outcome_of(&report) {
            ProbeOutcome::Completed(stages) => match stages.routing {
                StageResult::Failed(m) => assert!(m.contains("BelowMinimumPrefixTokens"), "{m}"),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }
}
