//! Reconcilers (DESIGN.md "Reconcile"; spec 000 "Status", "Conditions", "Contract Notes").
//!
//! - [`cachebackend`] — the CacheBackend reconciler: provider workloads, status, conditions,
//!   Events, cascade restarts. Entry points [`reconcile`], [`error_policy`], [`Context`],
//!   [`cachebackend::controller`].
//! - [`render`] — pure rendering of provider workloads (Redis, LMCacheServer, Mooncake).
//! - [`engine_pods`] — the engine-pod Events controller (InjectedByCacheBackend,
//!   SkippedByOperator).
//! - [`clock`] — the injected clock.
//! - [`run`] — [`run_controllers`]: both controllers on a real client, for `ic-controller run`.
//! - [`nodes`] — node plans, CacheNode status and the CacheBackend `NodeHealthy` advisory.
//!
//! What `ic-controller run` must watch: CacheBackends plus the Deployments, StatefulSets,
//! Services and HorizontalPodAutoscalers they own (all carry the
//! `inferencecache.io/cachebackend` label) — [`cachebackend::controller`] builds exactly that —
//! and, for [`engine_pods`], Pods ([`engine_pods::controller`]). Engine pods are listed by the
//! CacheBackend reconciler at its requeue cadence, not watched.

pub mod backoff;
pub mod cache_index;
pub mod cachebackend;
pub mod clock;
pub mod engine_pods;
pub mod follow;
pub mod index_aggregate;
pub mod model_cache;
pub mod nodes;
pub mod policy;
pub mod render;
pub mod run;
pub mod tenants;

pub use cachebackend::{error_policy, reconcile, Context, Error};
pub use run::{run_controllers, Controllers};

pub use crate::annotations;
