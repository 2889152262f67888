//! `RouterService.LookupRoute`: the gateways' question "which replica holds the longest cached
//! prefix of this request?" — a thin gRPC layer over [`PrefixIndex::lookup`].
//!
//! [`PrefixIndex::lookup`]: crate::index::PrefixIndex::lookup

use std::sync::Arc;
use std::time::Instant;

use ic_shared::proto::{self, router_service_server::RouterService};
use tonic::{Request, Response, Status};

use crate::index::{LookupQuery, LookupResult};
use crate::state::Shared;

/// The gRPC service.
#[derive(Clone)]
pub struct Router {
    shared: Arc<Shared>,
}

impl Router {
    /// A router over the shared index.
    pub fn new(shared: Arc<Shared>) -> Self {
        Router { shared }
    }

    /// Answers one request (the same path the gRPC method and the functional probe use).
    pub fn lookup(&self, req: &proto::LookupRouteRequest) -> proto::LookupRouteResponse {
        let started = Instant::now();
        let q = LookupQuery {
            tenant: req.tenant.clone(),
            model: req.model.clone(),
            hash_scheme: req.hash_scheme.clone(),
            adapter: req.adapter.clone(),
            token_ids: req.token_ids.clone(),
            content_keys: req.content_keys.clone(),
            block_size: (req.block_size > 0).then_some(req.block_size),
            minimum_prefix_tokens: self.shared.policy.minimum_prefix_tokens,
        };
        let result = self.shared.index.read().lookup(&q);
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
        to_proto(result)
    }
}

fn to_proto(r: LookupResult) -> proto::LookupRouteResponse {
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
                replica: m.replica,
                stream_id: m.stream_id,
                node: m.node,
                dp_rank: m.dp_rank,
                matched_blocks: m.matched_blocks,
                matched_tokens: m.matched_tokens,
                tier: m.tier.to_proto() as i32,
                backend: m.backend,
            })
            .collect(),
        block_size: r.block_size,
        request_blocks: r.request_blocks,
        reason: r.reason,
    }
}

#[tonic::async_trait]
impl RouterService for Router {
    async fn lookup_route(
        &self,
        request: Request<proto::LookupRouteRequest>,
    ) -> Result<Response<proto::LookupRouteResponse>, Status> {
        let req = request.into_inner();
        if req.token_ids.is_empty() && req.content_keys.is_empty() {
            return Err(Status::invalid_argument(
                "LookupRouteRequest needs token_ids or content_keys",
            ));
        }
        Ok(Response::new(self.lookup(&req)))
    }
}
