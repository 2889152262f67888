//! The functional probe's tier-2 stage (spec 000 "Functional-probe gate", Stage C): a synthetic
//! put / get / delete through the backend's real remote tier.
//!
//! | provider (managed) | what the stage does |
//! |---|---|
//! | Redis | over RESP to `status.endpoint` (the rendered Service, `<name>.<ns>.svc:<port>`): `SET <key> <value> PX 60000`, `GET <key>` (must return the value), `DEL <key>`; every step within [`T2ProbeConfig::timeout`] |
//! | LMCacheServer (`lm://`) | skipped, with the reason: no client for LMCache's own server protocol here |
//! | Mooncake (`mooncakestore://`) | skipped, with the reason: the store's data path is the engines' transfer engine (RDMA/TCP), which the controller does not speak |
//!
//! A failure carries the tier's own error (connection refused, `OOM command not allowed`,
//! `NOAUTH`, a timeout, a value that did not come back), which the gate publishes as
//! `FunctionalProbeOK=False/ProbeT2Failed` and `Ready=False/ProbeT2Failed`. The probe's keys are
//! `inferencecache:probe:<namespace>/<name>:<nonce>` with a 60 s expiry, so a probe interrupted
//! between put and delete leaves nothing behind for long.

use std::time::Duration;

use futures::future::BoxFuture;
use ic_shared::crd::{CacheBackend, RemoteProvider};

use crate::reconcile::cachebackend::path::{classify, BackendPath};

/// A stage outcome: `Ok(message)`, `Err(Failed(message))` or `Err(Skipped(reason))`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum T2Outcome {
    /// The round trip worked.
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

/// The key and value one probe writes.
fn probe_key(cb: &CacheBackend, nonce: u64) -> (String, String) {
    let ns = cb.metadata.namespace.as_deref().unwrap_or_default();
    let name = cb.metadata.name.as_deref().unwrap_or_default();
    (
        format!("inferencecache:probe:{ns}/{name}:{nonce}"),
        format!("inferencecache-probe-{nonce:016x}"),
    )
}

async fn step<T>(
    what: &str,
    endpoint: &str,
    timeout: Duration,
    fut: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!(
            "the Redis tier at {endpoint} failed the {what}: {e}"
        )),
        Err(_) => Err(format!(
            "the Redis tier at {endpoint} did not answer the {what} within {} ms",
            timeout.as_millis()
        )),
    }
}

/// SET / GET / DEL of one probe key on the Redis at `endpoint` (`host:port`).
///
/// # Errors
/// What failed, with Redis's own error text.
pub async fn redis_round_trip(
    endpoint: &str,
    key: &str,
    value: &str,
    timeout: Duration,
) -> Result<(), String> {
    let client = redis::Client::open(format!("redis://{endpoint}/"))
        .map_err(|e| format!("the Redis endpoint {endpoint:?} is not usable: {e}"))?;
    // The library's own connection and response timeouts (1 s / 500 ms by default) would
    // otherwise cut a step shorter than `timeout`.
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    let mut conn = step(
        "connection",
        endpoint,
        timeout,
        client.get_multiplexed_async_connection_with_config(&config),
    )
    .await?;
    let _: () = step(
        "put (SET)",
        endpoint,
        timeout,
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn),
    )
    .await?;
    let got: Option<String> = step(
        "get (GET)",
        endpoint,
        timeout,
        redis::cmd("GET").arg(key).query_async(&mut conn),
    )
    .await?;
    let _: i64 = step(
        "delete (DEL)",
        endpoint,
        timeout,
        redis::cmd("DEL").arg(key).query_async(&mut conn),
    )
    .await?;
    match got {
        Some(v) if v == value => Ok(()),
        Some(_) => Err(format!(
            "the Redis tier at {endpoint} returned a different value for the probe key \
             (another writer, or a proxy that rewrites values)"
        )),
        None => Err(format!(
            "the Redis tier at {endpoint} accepted the put but returned nothing on the get \
             (evicted at once: maxmemory too small for any entry, or a proxy that drops writes)"
        )),
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
            match provider {
                RemoteProvider::Redis => {
                    let Some(endpoint) = cb
                        .status
                        .as_ref()
                        .and_then(|s| s.endpoint.as_deref())
                        .filter(|e| !e.trim().is_empty())
                    else {
                        return T2Outcome::Skipped(
                            "status.endpoint is not set yet: the Redis Service was not observed"
                                .to_string(),
                        );
                    };
                    let (key, value) = probe_key(cb, nonce);
                    match redis_round_trip(endpoint, &key, &value, self.cfg.timeout).await {
                        Ok(()) => T2Outcome::Ok(format!(
                            "put, get and delete of a probe key round-tripped through the Redis tier at {endpoint}"
                        )),
                        Err(e) => T2Outcome::Failed(e),
                    }
                }
                RemoteProvider::LMCacheServer => T2Outcome::Skipped(
                    "no tier-2 prober for the LMCache server's lm:// protocol in this controller"
                        .to_string(),
                ),
                RemoteProvider::Mooncake => T2Outcome::Skipped(
                    "no tier-2 prober for Mooncake: its data path is the engines' transfer engine"
                        .to_string(),
                ),
            }
        })
    }
}
