//! `ic-agent` library: everything the binary wires together (DESIGN.md "Layout").
//!
//! - [`checks`] — node checks behind one trait; [`checks_worker`] — the processes `ic-agent run`
//!   runs them in (the only ones that keep capabilities).
//! - [`engine_metrics`] — tier-2 counters scraped from the engines' Prometheus endpoints.
//! - [`kv`] — engine KV-event subscribers and their aggregation into index deltas.
//! - [`link`] — the gRPC stream to the controller.
//! - [`http`] — troubleshooting endpoints and `/metrics`.
//! - [`qualify`] — `ic-agent qualify`, the model-cache storage qualification run.
//! - [`privilege`] — the Linux capabilities of each thread (dropped where input is parsed).
//! - [`runtime`] — `ic-agent run` wiring; [`state`] — what the loops share.
//! - [`subscribe`] — `ic-agent subscribe`, the per-pod kvevent-subscriber sidecar.

pub mod checks;
pub mod checks_worker;

/// This build's version and commit (`inferencecache_build_info` on `/metrics`).
pub const BUILD_INFO: ic_shared::telemetry::BuildInfo = ic_shared::build_info!();
pub mod engine_metrics;
pub mod http;
pub mod kv;
pub mod link;
pub mod privilege;
pub mod qualify;
pub mod runtime;
pub mod state;
pub mod subscribe;

/// Writes a command's output to stdout. A closed pipe (`ic-agent check --json | head`) ends the
/// output quietly instead of panicking like `println!`; other write errors are returned.
pub fn write_stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}
