//! The engine's `--kv-events-config` ([`KvEventsConfig`]) and where its publishers are reached
//! from the node agent: the PUB endpoint ([`resolve_pub_endpoint`]) and the replay (ROUTER)
//! endpoint ([`resolve_replay_endpoint`]) of each data-parallel rank, ports offset by the rank.

use ic_shared::crd::Runtime;
use serde::Deserialize;

/// The engine flag that configures its KV-event publisher.
pub const KV_EVENTS_CONFIG_FLAG: &str = "--kv-events-config";
/// vLLM's default `--kv-events-config` endpoint.
pub const DEFAULT_KV_EVENTS_ENDPOINT: &str = "tcp://*:5557";
/// Reason: the publisher endpoint cannot be reached from the node agent (a plan issue reason).
pub const ENDPOINT_UNREACHABLE: &str = "EndpointUnreachable";
/// Reason: the pod has no IP yet, so wildcard endpoints cannot be resolved (a plan issue reason).
pub const NO_POD_IP: &str = "NoPodIP";

/// `--kv-events-config`, as both engines read it (unknown keys ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct KvEventsConfig {
    /// vLLM: events are produced only when true.
    #[serde(default)]
    pub enable_kv_cache_events: Option<bool>,
    /// `zmq` or `null`.
    #[serde(default)]
    pub publisher: Option<String>,
    /// PUB endpoint (default `tcp://*:5557`).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// ROUTER replay endpoint (off when absent).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Topic (default empty).
    #[serde(default)]
    pub topic: Option<String>,
}

impl KvEventsConfig {
    /// Parses the JSON value of `--kv-events-config` (unknown keys ignored). Errors: not JSON,
    /// or a known key of the wrong type.
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Whether the engine of `runtime` publishes with this config.
    pub fn active(&self, runtime: Runtime) -> bool {
        let publisher = self.publisher.as_deref().map(str::to_ascii_lowercase);
        match runtime {
            Runtime::Vllm => {
                self.enable_kv_cache_events == Some(true) && publisher.as_deref() != Some("null")
            }
            Runtime::SgLang => match publisher.as_deref() {
                Some(p) => p == "zmq",
                None => self.enable_kv_cache_events == Some(true),
            },
        }
    }
}

/// Splits `tcp://HOST:PORT` into (host, port); `None` for other transports or malformed text.
pub fn split_tcp(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

/// Whether `host` is a wildcard bind address (`*`, `[*]`, or an IPv6 one other than loopback).
pub fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "[*]") || host.contains("::") && !is_loopback(host)
}

/// Whether `host` is a loopback address (`localhost`, `127.*`, `::1`).
pub fn is_loopback(host: &str) -> bool {
    matches!(host, "localhost" | "::1" | "[::1]") || host.starts_with("127.")
}

/// `ip` as the host part of a URL or endpoint (IPv6 in brackets).
pub fn host_for(ip: &str) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    }
}

/// `port + rank` (a data-parallel rank's port); `None` past 65535.
pub fn offset(port: u16, rank: u32) -> Option<u16> {
    u16::try_from(u32::from(port) + rank).ok()
}

/// Resolves the PUB endpoint of data-parallel rank `rank`: a wildcard host becomes `pod_ip`.
pub fn resolve_pub_endpoint(
    endpoint: &str,
    pod_ip: Option<&str>,
    rank: u32,
) -> Result<String, (&'static str, String)> {
    let (host, port) = split_tcp(endpoint).ok_or_else(|| {
        (
            ENDPOINT_UNREACHABLE,
            format!("KV-event endpoint {endpoint:?} is not tcp://HOST:PORT; the node agent can only subscribe over TCP"),
        )
    })?;
    if !is_wildcard(host) {
        return Err((
            ENDPOINT_UNREACHABLE,
            format!("KV-event endpoint {endpoint:?} names a host, so the engine connects to it instead of binding; use tcp://*:{port} so the node agent can subscribe"),
        ));
    }
    let ip = pod_ip.ok_or_else(|| {
        (
            NO_POD_IP,
            "the pod has no IP yet; its KV-event publisher is planned once it has one".to_string(),
        )
    })?;
    let port = offset(port, rank).ok_or_else(|| {
        (
            ENDPOINT_UNREACHABLE,
            format!("port {port} + data-parallel rank {rank} exceeds 65535"),
        )
    })?;
    Ok(format!("tcp://{}:{port}", host_for(ip)))
}

/// Resolves the replay (ROUTER, always bound) endpoint of rank `rank`.
pub fn resolve_replay_endpoint(
    endpoint: &str,
    pod_ip: Option<&str>,
    host_network: bool,
    rank: u32,
) -> Result<String, (&'static str, String)> {
    let (host, port) = split_tcp(endpoint).ok_or_else(|| {
        (
            ENDPOINT_UNREACHABLE,
            format!("replay endpoint {endpoint:?} is not tcp://HOST:PORT"),
        )
    })?;
    let port = offset(port, rank).ok_or_else(|| {
        (
            ENDPOINT_UNREACHABLE,
            format!("replay port {port} + data-parallel rank {rank} exceeds 65535"),
        )
    })?;
    let host = if is_wildcard(host) || host == "0.0.0.0" {
        host_for(pod_ip.ok_or_else(|| (NO_POD_IP, "the pod has no IP yet".to_string()))?)
    } else if is_loopback(host) {
        if !host_network {
            return Err((
                ENDPOINT_UNREACHABLE,
                format!("replay endpoint {endpoint:?} is bound to the pod's loopback, which the node agent cannot reach; bind tcp://*:{port}"),
            ));
        }
        host.to_string()
    } else {
        host.to_string()
    };
    Ok(format!("tcp://{host}:{port}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_resolve_to_the_pod_ip_with_rank_offsets() {
        assert_eq!(
            resolve_pub_endpoint("tcp://*:5557", Some("10.0.0.5"), 2).unwrap(),
            "tcp://10.0.0.5:5559"
        );
        assert_eq!(
            resolve_pub_endpoint("tcp://*:5557", Some("fd00::5"), 0).unwrap(),
            "tcp://[fd00::5]:5557"
        );
        assert_eq!(
            resolve_pub_endpoint("tcp://collector:5557", Some("10.0.0.5"), 0)
                .unwrap_err()
                .0,
            ENDPOINT_UNREACHABLE
        );
        assert_eq!(
            resolve_pub_endpoint("tcp://*:5557", None, 0).unwrap_err().0,
            NO_POD_IP
        );
        assert_eq!(
            resolve_replay_endpoint("tcp://127.0.0.1:5558", Some("10.0.0.5"), true, 1).unwrap(),
            "tcp://127.0.0.1:5559"
        );
        assert!(
            resolve_replay_endpoint("tcp://127.0.0.1:5558", Some("10.0.0.5"), false, 0).is_err()
        );
    }
}
