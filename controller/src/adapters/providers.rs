//! Storage providers → the structured binding an engine adapter consumes (spec 000 "Cache
//! hierarchy and ownership", "Mutating Pod webhook" Injection row, "Externally owned remote
//! storage", "Mooncake provider configuration").
//!
//! | provider | binding | accepted endpoint forms |
//! |---|---|---|
//! | `Redis` | [`BindingKind::Resp`] | `host:port` |
//! | `LMCacheServer` | [`BindingKind::Lm`] | `host:port`, `lm://host:port` |
//! | `Mooncake` | [`BindingKind::MooncakeStore`] | `host:port`, `mooncakestore://host:port` |
//!
//! Where the endpoint comes from is decided by ownership alone: `Managed` uses the controller-
//! observed `status.endpoint`; `External` uses the trimmed, provider-validated
//! `spec.remoteStorage.endpoint` with no fallback to a stale status; an omitted `remoteStorage`
//! is host-only (no binding). [`resolve_binding`] implements exactly that; the Pod webhook fails
//! open on each of its errors.

use ic_shared::crd::{CacheBackend, Ownership, RemoteProvider};

use super::BindingKind;

/// A resolved remote binding: protocol plus a validated `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// Protocol the engine wire speaks to the provider.
    pub kind: BindingKind,
    /// Host as written (an IPv6 literal keeps its brackets).
    pub host: String,
    /// TCP port, 1–65535.
    pub port: u16,
}

impl Binding {
    /// `host:port`.
    pub fn authority(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The host without IPv6 brackets (for config files that take host and port apart).
    pub fn bare_host(&self) -> &str {
        self.host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&self.host)
    }

    /// The URL an LMCache client uses: `lm://host:port`, `mooncakestore://host:port`, or the
    /// bare `host:port` for RESP.
    pub fn url(&self) -> String {
        match self.kind {
            BindingKind::Lm => format!("lm://{}", self.authority()),
            BindingKind::MooncakeStore => format!("mooncakestore://{}", self.authority()),
            BindingKind::Resp => self.authority(),
        }
    }
}

impl std::fmt::Display for BindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BindingKind::Lm => "lm",
            BindingKind::Resp => "resp",
            BindingKind::MooncakeStore => "mooncakestore",
        })
    }
}

/// Why an endpoint string is not a valid endpoint for its provider (spec "Externally owned
/// remote storage": numeric port 1–65535, no embedded whitespace, no path/query/fragment,
/// bracketed IPv6, no scheme of another provider).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// Empty or whitespace-only.
    #[error("endpoint is empty")]
    Empty,
    /// Contains whitespace after trimming.
    #[error("endpoint {0:?} contains whitespace")]
    Whitespace(String),
    /// A scheme the provider does not accept.
    #[error("endpoint {endpoint:?}: scheme {scheme:?} is not accepted by provider {provider} (accepted: {accepted})")]
    Scheme {
        /// The endpoint.
        endpoint: String,
        /// The scheme found.
        scheme: String,
        /// Provider wire spelling.
        provider: &'static str,
        /// What the provider accepts.
        accepted: &'static str,
    },
    /// A path, query or fragment after the authority.
    #[error("endpoint {0:?} has a path, query or fragment; only host:port is allowed")]
    PathQueryFragment(String),
    /// An IPv6 literal without brackets, or an unterminated bracket.
    #[error("endpoint {0:?}: an IPv6 address must be bracketed, as [addr]:port")]
    Ipv6(String),
    /// No host.
    #[error("endpoint {0:?} has no host")]
    NoHost(String),
    /// No port, a non-numeric port or one outside 1–65535.
    #[error("endpoint {0:?} needs a numeric port in 1-65535")]
    Port(String),
}

/// One storage provider's endpoint grammar and binding protocol.
pub trait StorageProvider: Send + Sync {
    /// The provider.
    fn provider(&self) -> RemoteProvider;
    /// The binding it emits.
    fn binding_kind(&self) -> BindingKind;
    /// The URL scheme it accepts besides bare `host:port` (`lm`, `mooncakestore`), if any.
    fn scheme(&self) -> Option<&'static str>;
    /// Human list of accepted forms, for messages.
    fn accepted_forms(&self) -> &'static str;
}

/// Redis: RESP, bare `host:port` only.
pub struct Redis;
/// Standalone LMCache server: `lm://`.
pub struct LmCacheServer;
/// Mooncake master: `mooncakestore://`.
pub struct Mooncake;

impl StorageProvider for Redis {
    fn provider(&self) -> RemoteProvider {
        RemoteProvider::Redis
    }
    fn binding_kind(&self) -> BindingKind {
        BindingKind::Resp
    }
    fn scheme(&self) -> Option<&'static str> {
        None
    }
    fn accepted_forms(&self) -> &'static str {
        "host:port"
    }
}

impl StorageProvider for LmCacheServer {
    fn provider(&self) -> RemoteProvider {
        RemoteProvider::LMCacheServer
    }
    fn binding_kind(&self) -> BindingKind {
        BindingKind::Lm
    }
    fn scheme(&self) -> Option<&'static str> {
        Some("lm")
    }
    fn accepted_forms(&self) -> &'static str {
        "host:port or lm://host:port"
    }
}

impl StorageProvider for Mooncake {
    fn provider(&self) -> RemoteProvider {
        RemoteProvider::Mooncake
    }
    fn binding_kind(&self) -> BindingKind {
        BindingKind::MooncakeStore
    }
    fn scheme(&self) -> Option<&'static str> {
        Some("mooncakestore")
    }
    fn accepted_forms(&self) -> &'static str {
        "host:port or mooncakestore://host:port"
    }
}

/// The provider implementation for a `spec.remoteStorage.provider` value.
pub fn provider(p: RemoteProvider) -> &'static dyn StorageProvider {
    match p {
        RemoteProvider::Redis => &Redis,
        RemoteProvider::LMCacheServer => &LmCacheServer,
        RemoteProvider::Mooncake => &Mooncake,
    }
}

/// Validates `raw` (trimmed first) as an endpoint of provider `p` and returns its binding.
///
/// Errors: see [`EndpointError`].
pub fn parse_endpoint(p: RemoteProvider, raw: &str) -> Result<Binding, EndpointError> {
    let prov = provider(p);
    let ep = raw.trim();
    if ep.is_empty() {
        return Err(EndpointError::Empty);
    }
    if ep.chars().any(char::is_whitespace) {
        return Err(EndpointError::Whitespace(ep.to_string()));
    }
    let authority = match ep.split_once("://") {
        Some((scheme, rest)) => {
            if prov.scheme() != Some(scheme) {
                return Err(EndpointError::Scheme {
                    endpoint: ep.to_string(),
                    scheme: scheme.to_string(),
                    provider: p.as_str(),
                    accepted: prov.accepted_forms(),
                });
            }
            rest
        }
        None => ep,
    };
    if authority.contains(['/', '?', '#']) {
        return Err(EndpointError::PathQueryFragment(ep.to_string()));
    }
    let (host, port) = if authority.starts_with('[') {
        let close = authority
            .find(']')
            .ok_or_else(|| EndpointError::Ipv6(ep.to_string()))?;
        let host = &authority[..=close];
        let rest = &authority[close + 1..];
        let port = rest
            .strip_prefix(':')
            .ok_or_else(|| EndpointError::Port(ep.to_string()))?;
        if host.len() <= 2 {
            return Err(EndpointError::NoHost(ep.to_string()));
        }
        (host, port)
    } else {
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| EndpointError::Port(ep.to_string()))?;
        if host.contains(':') {
            return Err(EndpointError::Ipv6(ep.to_string()));
        }
        if host.is_empty() {
            return Err(EndpointError::NoHost(ep.to_string()));
        }
        (host, port)
    };
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) || port.len() > 5 {
        return Err(EndpointError::Port(ep.to_string()));
    }
    let port: u16 = match port.parse::<u32>() {
        Ok(n) if (1..=65535).contains(&n) => n as u16,
        _ => return Err(EndpointError::Port(ep.to_string())),
    };
    Ok(Binding {
        kind: prov.binding_kind(),
        host: host.to_string(),
        port,
    })
}

/// Why a CacheBackend's binding could not be resolved; the Pod webhook fails open with this as
/// the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingError {
    /// Managed ownership, but the controller has not published `status.endpoint` yet.
    #[error("Managed {provider} backend has not published status.endpoint yet (roll the engine workload once the backend is Ready)")]
    ManagedEndpointNotPublished {
        /// Provider wire spelling.
        provider: &'static str,
    },
    /// Managed ownership with a malformed `status.endpoint`.
    #[error("Managed {provider} backend: status.endpoint is invalid: {source}")]
    ManagedEndpointInvalid {
        /// Provider wire spelling.
        provider: &'static str,
        /// The shape error.
        source: EndpointError,
    },
    /// External ownership without `spec.remoteStorage.endpoint`.
    #[error("External {provider} backend has no spec.remoteStorage.endpoint")]
    ExternalEndpointMissing {
        /// Provider wire spelling.
        provider: &'static str,
    },
    /// External ownership with a malformed endpoint.
    #[error("External {provider} backend: spec.remoteStorage.endpoint is invalid: {source}")]
    ExternalEndpointInvalid {
        /// Provider wire spelling.
        provider: &'static str,
        /// The shape error.
        source: EndpointError,
    },
}

/// Resolves the binding of `cb` (spec "Mutating Pod webhook", Injection row): `Ok(None)` for a
/// host-only backend (no `spec.remoteStorage`); Managed → `status.endpoint`; External → the
/// trimmed, validated `spec.remoteStorage.endpoint`, never falling back to status.
pub fn resolve_binding(cb: &CacheBackend) -> Result<Option<Binding>, BindingError> {
    let Some(rs) = cb.spec.remote_storage.as_ref() else {
        return Ok(None);
    };
    let name = rs.provider.as_str();
    match rs.ownership {
        Ownership::Managed => {
            let ep = cb
                .status
                .as_ref()
                .and_then(|s| s.endpoint.as_deref())
                .map(str::trim)
                .unwrap_or("");
            if ep.is_empty() {
                return Err(BindingError::ManagedEndpointNotPublished { provider: name });
            }
            parse_endpoint(rs.provider, ep).map(Some).map_err(|source| {
                BindingError::ManagedEndpointInvalid {
                    provider: name,
                    source,
                }
            })
        }
        Ownership::External => {
            let ep = rs.endpoint.as_deref().map(str::trim).unwrap_or("");
            if ep.is_empty() {
                return Err(BindingError::ExternalEndpointMissing { provider: name });
            }
            parse_endpoint(rs.provider, ep).map(Some).map_err(|source| {
                BindingError::ExternalEndpointInvalid {
                    provider: name,
                    source,
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ic_shared::crd::{CacheBackendSpec, CacheBackendStatus, RemoteStorageSpec};

    #[test]
    fn endpoint_shapes() {
        let ok = |p, s: &str| parse_endpoint(p, s).unwrap();
        assert_eq!(
            ok(RemoteProvider::Redis, " redis:6379 ").url(),
            "redis:6379"
        );
        assert_eq!(
            ok(RemoteProvider::LMCacheServer, "lm://srv.ns.svc:8100").url(),
            "lm://srv.ns.svc:8100"
        );
        assert_eq!(
            ok(RemoteProvider::LMCacheServer, "srv:8100").url(),
            "lm://srv:8100"
        );
        assert_eq!(
            ok(RemoteProvider::Mooncake, "mooncakestore://m:50051").url(),
            "mooncakestore://m:50051"
        );
        let v6 = ok(RemoteProvider::Redis, "[fd00::1]:6379");
        assert_eq!(v6.bare_host(), "fd00::1");
        assert_eq!(v6.authority(), "[fd00::1]:6379");

        use EndpointError as E;
        let err = |p, s: &str| parse_endpoint(p, s).unwrap_err();
        assert_eq!(err(RemoteProvider::Redis, "  "), E::Empty);
        assert!(matches!(
            err(RemoteProvider::Redis, "a b:1"),
            E::Whitespace(_)
        ));
        assert!(matches!(
            err(RemoteProvider::Redis, "lm://a:1"),
            E::Scheme { .. }
        ));
        assert!(matches!(
            err(RemoteProvider::Redis, "redis://a:1"),
            E::Scheme { .. }
        ));
        assert!(matches!(
            err(RemoteProvider::LMCacheServer, "mooncakestore://a:1"),
            E::Scheme { .. }
        ));
        assert!(matches!(
            err(RemoteProvider::Mooncake, "a:1/x"),
            E::PathQueryFragment(_)
        ));
        assert!(matches!(
            err(RemoteProvider::Mooncake, "a:1?x"),
            E::PathQueryFragment(_)
        ));
        assert!(matches!(
            err(RemoteProvider::Redis, "fd00::1:6379"),
            E::Ipv6(_)
        ));
        assert!(matches!(
            err(RemoteProvider::Redis, "[fd00::1:6379"),
            E::Ipv6(_)
        ));
        assert!(matches!(err(RemoteProvider::Redis, "a"), E::Port(_)));
        assert!(matches!(err(RemoteProvider::Redis, "a:0"), E::Port(_)));
        assert!(matches!(err(RemoteProvider::Redis, "a:65536"), E::Port(_)));
        assert!(matches!(err(RemoteProvider::Redis, "a:http"), E::Port(_)));
        assert!(matches!(err(RemoteProvider::Redis, ":1"), E::NoHost(_)));
    }

    fn cb(rs: Option<RemoteStorageSpec>, status_ep: Option<&str>) -> CacheBackend {
        let mut cb = CacheBackend::new(
            "cb",
            CacheBackendSpec {
                remote_storage: rs,
                ..Default::default()
            },
        );
        cb.status = status_ep.map(|e| CacheBackendStatus {
            endpoint: Some(e.to_string()),
            ..Default::default()
        });
        cb
    }

    #[test]
    fn binding_resolution_by_ownership() {
        assert_eq!(resolve_binding(&cb(None, Some("x:1"))), Ok(None));
        let managed = RemoteStorageSpec {
            provider: RemoteProvider::Redis,
            ownership: Ownership::Managed,
            ..Default::default()
        };
        assert_eq!(
            resolve_binding(&cb(Some(managed.clone()), None)),
            Err(BindingError::ManagedEndpointNotPublished { provider: "Redis" })
        );
        assert_eq!(
            resolve_binding(&cb(Some(managed.clone()), Some("  "))),
            Err(BindingError::ManagedEndpointNotPublished { provider: "Redis" })
        );
        let b = resolve_binding(&cb(Some(managed), Some("redis.ns.svc:6379")))
            .unwrap()
            .unwrap();
        assert_eq!(
            (b.kind, b.authority().as_str()),
            (BindingKind::Resp, "redis.ns.svc:6379")
        );

        let external = RemoteStorageSpec {
            provider: RemoteProvider::LMCacheServer,
            ownership: Ownership::External,
            endpoint: Some(" lm://ext:8100 ".into()),
            ..Default::default()
        };
        // External never falls back to status.
        let b = resolve_binding(&cb(Some(external.clone()), Some("stale:1")))
            .unwrap()
            .unwrap();
        assert_eq!(b.url(), "lm://ext:8100");
        let mut missing = external.clone();
        missing.endpoint = None;
        assert_eq!(
            resolve_binding(&cb(Some(missing), Some("stale:1"))),
            Err(BindingError::ExternalEndpointMissing {
                provider: "LMCacheServer"
            })
        );
        let mut bad = external;
        bad.endpoint = Some("redis://x:1".into());
        assert!(matches!(
            resolve_binding(&cb(Some(bad), None)),
            Err(BindingError::ExternalEndpointInvalid { .. })
        ));
    }
}
