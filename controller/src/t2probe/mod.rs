//! The functional probe's tier-2 stage (spec 000 "Functional-probe gate", Stage C): a synthetic
//! put / get through the backend's real remote tier, each step within
//! [`T2ProbeConfig::timeout`].
//!
//! | provider (managed) | what the stage does | what `ok` proves |
//! |---|---|---|
//! | Redis | RESP to `status.endpoint`: `SET <key> <value> PX 60000`, `GET` (must return the value), `DEL` ([`redis`]) | the tier stores and serves a value |
//! | LMCacheServer (`lm://`) | LMCache's own server protocol to `status.endpoint`: HEALTH, PUT of a probe chunk, GET (must return it) ([`lmcache`]) | the server stores and serves a chunk under the protocol the engines' `lm://` connector speaks |
//! | Mooncake (`mooncakestore://`) | RPC port connect, `/health`, HTTP metadata PUT/GET/DELETE, mounted capacity > 0 ([`mooncake`]) | the master is up, ready by its own account, its metadata store round-trips, and some client mounted storage; **not** an object put/get (that needs the engines' transfer engine) |
//!
//! A failure carries the tier's own error (connection refused, `OOM command not allowed`,
//! `NOAUTH`, an LMCache reply code, a master's `/health` body, a timeout, a value that did not
//! come back), which the gate publishes as `FunctionalProbeOK=False/ProbeT2Failed` and
//! `Ready=False/ProbeT2Failed`. Probe keys: Redis `inferencecache:probe:<namespace>/<name>:<nonce>`
//! with a 60 s expiry (a probe interrupted between put and delete leaves nothing behind for
//! long); Mooncake metadata `inferencecache-probe.<namespace>.<name>.<nonce>`, deleted again; LMCache
//! one fixed chunk per backend ([`lmcache::probe_chunk_key`]), overwritten by each probe (its
//! protocol has no delete).

pub mod http;
pub mod lmcache;
pub mod mooncake;
pub mod redis;

use std::time::Duration;

use futures::future::BoxFuture;
use ic_shared::crd::{CacheBackend, RemoteProvider};

use crate::adapters::providers::parse_endpoint;
use crate::reconcile::cachebackend::path::{classify, BackendPath};

pub use self::lmcache::lmcache_round_trip;
pub use self::mooncake::{mooncake_probe, MasterPorts};
pub use self::redis::redis_round_trip;

/// A stage outcome: `Ok(message)`, `Err(Failed(message))` or `Err(Skipped(reason))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum T2Outcome {
    /// The round trip worked; the message says what it proved.
    Ok(String),
    /// The tier is broken; the message says how.
    Failed(String),
    /// Not probed; the message says why.
    Skipped(String),
}

/// Runs the tier-2 stage for one backend.
pub trait T2Prober: Send + Sync {
    /// Probes `cb`'s remote tier with a key unique to `nonce`. Never panics; every problem is an
    /// outcome.
    fn probe<'a>(&'a self, cb: &'a CacheBackend, nonce: u64) -> BoxFuture<'a, T2Outcome>;
}

/// Settings of [`ProviderT2Prober`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct T2ProbeConfig {
    /// Deadline of each step (connect, put, get, delete).
    pub timeout: Duration,
}

impl Default for T2ProbeConfig {
    fn default() -> Self {
        T2ProbeConfig {
            timeout: Duration::from_secs(2),
        }
    }
}

/// The tier-2 prober for the managed providers (module table).
#[derive(Debug, Clone, Default)]
pub struct ProviderT2Prober {
    cfg: T2ProbeConfig,
}

impl ProviderT2Prober {
    /// A prober with `cfg`.
    pub fn new(cfg: T2ProbeConfig) -> Self {
        ProviderT2Prober { cfg }
    }
}

fn ns_name(cb: &CacheBackend) -> (&str, &str) {
    (
        cb.metadata.namespace.as_deref().unwrap_or_default(),
        cb.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// The Redis key and value one probe writes.
fn probe_key(cb: &CacheBackend, nonce: u64) -> (String, String) {
    let (ns, name) = ns_name(cb);
    (
        format!("inferencecache:probe:{ns}/{name}:{nonce}"),
        probe_value(nonce),
    )
}

fn probe_value(nonce: u64) -> String {
    format!("inferencecache-probe-{nonce:016x}")
}

impl ProviderT2Prober {
    async fn probe_provider(
        &self,
        cb: &CacheBackend,
        provider: RemoteProvider,
        endpoint: &str,
        nonce: u64,
    ) -> T2Outcome {
        let timeout = self.cfg.timeout;
        let binding = match parse_endpoint(provider, endpoint) {
            Ok(b) => b,
            Err(e) => {
                return T2Outcome::Failed(format!(
                    "status.endpoint {endpoint:?} is not a {} endpoint: {e}",
                    provider.as_str()
                ))
            }
        };
        let authority = binding.authority();
        match provider {
            RemoteProvider::Redis => {
                let (key, value) = probe_key(cb, nonce);
                match redis_round_trip(&authority, &key, &value, timeout).await {
                    Ok(()) => T2Outcome::Ok(format!(
                        "put, get and delete of a probe key round-tripped through the Redis tier at {authority}"
                    )),
                    Err(e) => T2Outcome::Failed(e),
                }
            }
            RemoteProvider::LMCacheServer => {
                let (ns, name) = ns_name(cb);
                let key = lmcache::probe_chunk_key(ns, name);
                match lmcache_round_trip(&authority, &key, probe_value(nonce).as_bytes(), timeout).await {
                    Ok(()) => T2Outcome::Ok(format!(
                        "health check, put and get of a probe chunk round-tripped through the LMCache server at lm://{authority}"
                    )),
                    Err(e) => T2Outcome::Failed(e),
                }
            }
            RemoteProvider::Mooncake => {
                let command = cb
                    .spec
                    .remote_storage
                    .as_ref()
                    .and_then(|rs| rs.mooncake.as_ref())
                    .and_then(|m| m.command.clone())
                    .filter(|c| !c.is_empty())
                    .unwrap_or_else(crate::reconcile::render::mooncake::default_command);
                let ports = match MasterPorts::from_command(&command) {
                    Ok(p) => p,
                    Err(e) => return T2Outcome::Failed(e),
                };
                let (ns, name) = ns_name(cb);
                let key = format!("inferencecache-probe.{ns}.{name}.{nonce}");
                match mooncake_probe(
                    &binding.host,
                    binding.port,
                    &ports,
                    &key,
                    &probe_value(nonce),
                    timeout,
                )
                .await
                {
                    Ok(m) => T2Outcome::Ok(m),
                    Err(e) => T2Outcome::Failed(e),
                }
            }
        }
    }
}

impl T2Prober for ProviderT2Prober {
    fn probe<'a>(&'a self, cb: &'a CacheBackend, nonce: u64) -> BoxFuture<'a, T2Outcome> {
        Box::pin(async move {
            let provider = match classify(&cb.spec) {
                BackendPath::Managed(p) => p,
                _ => {
                    return T2Outcome::Skipped(
                        "no managed remote tier: nothing to put and get".to_string(),
                    )
                }
            };
            let Some(endpoint) = cb
                .status
                .as_ref()
                .and_then(|s| s.endpoint.as_deref())
                .filter(|e| !e.trim().is_empty())
            else {
                return T2Outcome::Skipped(format!(
                    "status.endpoint is not set yet: the {} Service was not observed",
                    provider.as_str()
                ));
            };
            self.probe_provider(cb, provider, endpoint, nonce).await
        })
    }
}
