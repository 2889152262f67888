//! Stage C for a managed Redis tier: `SET <key> <value> PX 60000`, `GET <key>` (must return the
//! value), `DEL <key>` over RESP, each step within the probe's timeout.

use std::time::Duration;

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
