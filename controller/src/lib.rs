//! `ic-controller` library: everything the binary wires together (DESIGN.md "Layout").
//!
//! - [`access`] — who may read the data plane (TokenReview + SubjectAccessReview).
//! - [`adapters`] — runtime and storage-provider adapters behind a registry.
//! - [`admission`] — the AdmissionReview server and its logic.
//! - [`catalog`] — the storage capability catalog of the model cache.
//! - [`crdgen`] — CRD manifests for `chart/crds`.
//! - [`engine`] — what an engine pod says about itself: its engine container, parsed command and
//!   flag meanings (below [`admission`], [`adapters`] and the node plans).
//! - [`index`] — the KV-prefix index and lookups.
//! - [`ingest`] — the agents' gRPC stream.
//! - [`router`] — `RouterService.LookupRoute`.
//! - [`tokenize`] — per-model tokenizers for LookupRoute `prompt_text`.
//! - [`http`] — health, metrics, snapshot and node endpoints.
//! - [`standalone`] — the one-machine stack.
//! - [`incluster`] — `ic-controller run`, the in-cluster controller.
//! - [`leader`] — Lease-based leader election.

pub mod access;
pub mod adapters;
pub mod annotations;

/// This build's version and commit (`inferencecache_build_info` on `/metrics`).
pub const BUILD_INFO: ic_shared::telemetry::BuildInfo = ic_shared::build_info!();
pub mod admission;
pub mod catalog;
pub mod crddoc;
pub mod crdgen;
pub mod crdupgrade;
pub mod engine;
pub mod http;
pub mod incluster;
pub mod index;
pub mod ingest;
pub mod leader;
pub mod metrics;
pub mod probe;
pub mod quantity;
pub mod reconcile;
pub mod router;
pub mod standalone;
pub mod state;
pub mod t2probe;
pub mod tokenize;
