//! `ic-shared`: what `ic-controller` and `ic-agent` agree on.
//!
//! - [`crd`] — the `inferencecache.io/v1alpha1` custom resources (spec 000 "Spec"/"Status").
//! - [`proto`] — the gRPC contracts (`AgentService`, `RouterService`), generated from
//!   `shared/proto/inferencecache.proto`.
//! - [`plan`] — the node plan the controller pushes to an agent (or an agent reads from a file).
//! - [`check`] — the typed result of a node check.
//! - [`kv`] — engine KV-event wire decoding, our content keys, replica coverage.
//! - [`link`] — what an agent sends first on `AgentService.Connect` (Hello, then its resync).
//! - [`resync`] — resyncs split into chunks below gRPC's message limit, and put back together.
//! - [`telemetry`] — logging set-up for both binaries.
//! - [`serve`] — connection limits of every listener (HTTP/1.1 and gRPC).
//! - [`limits`] — input bounds (block sizes, lookup lengths) both binaries agree on.
//! - [`timing`] — per-stage timestamps of the KV delta path, for benchmarks and tests.

pub mod check;
pub mod crd;
pub mod kv;
pub mod limits;
pub mod link;
pub mod plan;
pub mod resync;
pub mod serve;
pub mod telemetry;
pub mod timing;

/// Generated gRPC code for package `inferencecache.v1alpha1`.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("inferencecache.v1alpha1");
}

/// Unix time in milliseconds (0 if the clock is before 1970).
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
