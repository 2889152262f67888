//! Stage C for a managed Mooncake master (`mooncakestore://`): what the controller can prove
//! without the engines' transfer engine.
//!
//! A Mooncake object put is `PutStart` (coro_rpc to the master, which allocates space in a
//! segment some client mounted), a transfer-engine write (RDMA or TCP) into that segment, then
//! `PutEnd`. The controller speaks neither coro_rpc's struct_pack encoding nor the transfer
//! engine, and it mounts no segment, so it cannot put an object. What it does instead, in order,
//! each step within the probe's timeout:
//!
//! 1. **RPC port** — a TCP connect to `status.endpoint` (the master's RPC port, 50051).
//! 2. **Health** — `GET /health` on the master's metrics port (9003) must answer 200 with
//!    `"status":"ok"` and `"service_ready":true` (the master's own readiness, e.g. an HA
//!    follower or a master still restoring a snapshot says otherwise).
//! 3. **Metadata round trip** — `PUT`, `GET` (must return the value) and `DELETE` of a probe key
//!    on the master's HTTP metadata server (8080), the store the engines' transfer engines use to
//!    find each other's segments. Skipped (and said so) when the master runs without it
//!    (`--enable_http_metadata_server` not true).
//! 4. **Capacity** — `/metrics` `master_total_capacity_bytes` must be above 0: with no segment
//!    mounted by any client, every object put fails for want of space. (The gate probes only
//!    once engines publish KV events, so their clients should have mounted by then.)
//!
//! Ports come from the master's command line as rendered (`spec.remoteStorage.mooncake.command`
//! or the default): `--metrics_port`, `--http_metadata_server_port`,
//! `--enable_http_metadata_server`, with Mooncake's defaults (9003, 8080, false) where a flag is
//! absent.

use std::time::Duration;

use hyper::Method;

use super::http::exchange;

/// Where the master listens besides its RPC port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterPorts {
    /// `/health` and `/metrics`.
    pub metrics: u16,
    /// The HTTP metadata server; `None` when the master runs without it.
    pub metadata: Option<u16>,
}

/// Mooncake's own defaults: metrics on 9003, metadata server off (on 8080 when enabled).
const DEFAULT_METRICS_PORT: u16 = 9003;
const DEFAULT_METADATA_PORT: u16 = 8080;

impl MasterPorts {
    /// Reads the ports from a master command line (gflags spellings `--flag=value`,
    /// `-flag=value`, `--flag value`; a shell string such as `sh -c "mooncake_master …"` is
    /// split into words first).
    ///
    /// # Errors
    /// A port flag whose value is not a port number.
    pub fn from_command(command: &[String]) -> Result<MasterPorts, String> {
        let words: Vec<String> = command
            .iter()
            .flat_map(|c| shell_words::split(c).unwrap_or_else(|_| vec![c.clone()]))
            .collect();
        let flag = |name: &str| -> Option<String> {
            let mut found = None;
            for (i, w) in words.iter().enumerate() {
                let bare = w.trim_start_matches('-');
                if bare.len() == w.len() {
                    continue;
                }
                if let Some(v) = bare.strip_prefix(name) {
                    if let Some(v) = v.strip_prefix('=') {
                        found = Some(v.to_string());
                    } else if v.is_empty() {
                        found = Some(words.get(i + 1).cloned().unwrap_or_default());
                    }
                }
            }
            found
        };
        let port = |name: &str, default: u16| -> Result<u16, String> {
            match flag(name) {
                None => Ok(default),
                Some(v) => v
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| format!("the master's --{name}={v} is not a port number")),
            }
        };
        let metrics = port("metrics_port", DEFAULT_METRICS_PORT)?;
        let enabled = matches!(
            flag("enable_http_metadata_server").as_deref(),
            Some("true" | "1" | "yes")
        );
        let metadata = if enabled {
            Some(port("http_metadata_server_port", DEFAULT_METADATA_PORT)?)
        } else {
            None
        };
        Ok(MasterPorts { metrics, metadata })
    }
}

/// The probe against the master at `host` (a Service name or address; an IPv6 literal in
/// brackets) whose RPC port is `rpc_port`. `key` and `value` are the metadata probe entry.
/// Returns what was proven, as a sentence.
///
/// # Errors
/// The first step that failed, with the master's own answer (status, body, metric).
pub async fn mooncake_probe(
    host: &str,
    rpc_port: u16,
    ports: &MasterPorts,
    key: &str,
    value: &str,
    timeout: Duration,
) -> Result<String, String> {
    let rpc = format!("{host}:{rpc_port}");
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&rpc)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return Err(format!(
                "the Mooncake master's RPC port {rpc} refused the connection: {e}"
            ))
        }
        Err(_) => {
            return Err(format!(
                "the Mooncake master's RPC port {rpc} did not accept a connection within {} ms",
                timeout.as_millis()
            ))
        }
    }

    let admin = format!("{host}:{}", ports.metrics);
    let health = exchange(Method::GET, &admin, "/health", Vec::new(), timeout)
        .await
        .map_err(|e| format!("the Mooncake master's health check failed: {e}"))?;
    let ready = serde_json::from_str::<serde_json::Value>(&health.body)
        .ok()
        .map(|v| v["status"] == "ok" && v["service_ready"] == true)
        .unwrap_or(false);
    if health.status != 200 || !ready {
        return Err(format!(
            "the Mooncake master at {admin} is not ready: /health answered {} {}",
            health.status,
            health.body.trim()
        ));
    }

    let metadata = match ports.metadata {
        None => "metadata round trip skipped (the master runs without its HTTP metadata server)"
            .to_string(),
        Some(port) => {
            let md = format!("{host}:{port}");
            let path = format!("/metadata?key={key}");
            let step = |what: &'static str, r: Result<super::http::Response, String>, want: u16| {
                match r {
                    Ok(resp) if resp.status == want => Ok(resp.body),
                    Ok(resp) => Err(format!(
                        "the Mooncake master's metadata server at {md} answered the {what} with {} {}",
                        resp.status,
                        resp.body.trim()
                    )),
                    Err(e) => Err(format!(
                        "the Mooncake master's metadata server failed the {what}: {e}"
                    )),
                }
            };
            step(
                "put (PUT)",
                exchange(Method::PUT, &md, &path, value.as_bytes().to_vec(), timeout).await,
                200,
            )?;
            let got = step(
                "get (GET)",
                exchange(Method::GET, &md, &path, Vec::new(), timeout).await,
                200,
            )?;
            step(
                "delete (DELETE)",
                exchange(Method::DELETE, &md, &path, Vec::new(), timeout).await,
                200,
            )?;
            if got != value {
                return Err(format!(
                    "the Mooncake master's metadata server at {md} returned a different value \
                     for the probe key"
                ));
            }
            format!("metadata put, get and delete round-tripped on {md}")
        }
    };

    let metrics = exchange(Method::GET, &admin, "/metrics", Vec::new(), timeout)
        .await
        .map_err(|e| format!("reading the Mooncake master's /metrics failed: {e}"))?;
    let gauge = |name: &str| {
        metrics.body.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?;
            rest.strip_prefix(' ')?.trim().parse::<f64>().ok()
        })
    };
    let Some(capacity) = gauge("master_total_capacity_bytes") else {
        return Err(format!(
            "the Mooncake master at {admin} serves no master_total_capacity_bytes in /metrics \
             (HTTP {}): cannot tell whether any segment is mounted",
            metrics.status
        ));
    };
    let clients = gauge("master_active_clients").unwrap_or(0.0);
    if capacity <= 0.0 {
        return Err(format!(
            "the Mooncake master at {admin} has no storage: master_total_capacity_bytes 0 with \
             {clients} active clients — no client mounted a segment, so every object put fails"
        ));
    }
    Ok(format!(
        "the Mooncake master at {rpc} accepts RPC connections and reports itself ready; \
         {metadata}; {capacity} bytes mounted by {clients} clients (object put/get is not \
         probed: it needs the engines' transfer engine)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn ports_from_the_rendered_and_overridden_commands() {
        let default = crate::reconcile::render::mooncake::default_command();
        assert_eq!(
            MasterPorts::from_command(&default).unwrap(),
            MasterPorts {
                metrics: 9003,
                metadata: Some(8080)
            }
        );
        assert_eq!(
            MasterPorts::from_command(&cmd(&["mooncake_master"])).unwrap(),
            MasterPorts {
                metrics: 9003,
                metadata: None
            }
        );
        assert_eq!(
            MasterPorts::from_command(&cmd(&[
                "sh",
                "-c",
                "exec mooncake_master -metrics_port 9100 --enable_http_metadata_server=true --http_metadata_server_port=8181"
            ]))
            .unwrap(),
            MasterPorts {
                metrics: 9100,
                metadata: Some(8181)
            }
        );
        assert!(MasterPorts::from_command(&cmd(&["mooncake_master", "--metrics_port=x"])).is_err());
    }
}
