//! `spec.remoteStorage.endpoint` rules (spec "Spec" → `remoteStorage.endpoint`, "Validating":
//! "External remote storage requires an endpoint", "Endpoint ownership is explicit",
//! "Cross-namespace endpoint requires opt-in"; "Externally owned remote storage").
//!
//! Endpoint grammar, per provider:
//!
//! | provider | accepted forms |
//! |---|---|
//! | Redis | bare `host:port` only |
//! | LMCacheServer | `host:port` or `lm://host:port` |
//! | Mooncake | `host:port` or `mooncakestore://host:port` |
//!
//! Every provider requires a numeric port in 1–65535; embedded whitespace and URL
//! path/query/fragment components are rejected; IPv6 must be bracketed (`[fd00::1]:6379`).
//! Surrounding whitespace is trimmed and a whitespace-only value counts as empty.
//!
//! [`parse_endpoint`] is public so the Pod webhook can apply the same validation to the External
//! endpoint it binds (spec: "The pod webhook applies the same validation and admits the engine
//! pod unwired on failure").

use std::net::Ipv6Addr;

use ic_shared::crd::{CacheBackend, Ownership, RemoteProvider};

use super::{Rule, RuleContext, Violation};

const FIELD: &str = "spec.remoteStorage.endpoint";

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![
        Box::new(EndpointOwnershipExplicit),
        Box::new(EndpointSchemeBelongsToProvider),
        Box::new(EndpointShapeValid),
        Box::new(CrossNamespaceEndpointRequiresOptIn),
    ]
}

/// A validated endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `lm` or `mooncakestore` when the endpoint carried a scheme.
    pub scheme: Option<String>,
    /// Host name or IP (IPv6 without brackets).
    pub host: String,
    /// Port, 1–65535.
    pub port: u16,
}

impl Endpoint {
    /// `host:port`, with IPv6 hosts bracketed.
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The Kubernetes Service this endpoint names, as `(service, namespace)`, when the host is a
    /// Service DNS name `<svc>.<ns>.svc[.<cluster-domain>]`. Bare hostnames, IPs, unqualified
    /// names and the ambiguous two-label `<svc>.<ns>` form give `None` (no namespace can be
    /// inferred for certain).
    pub fn service(&self) -> Option<(&str, &str)> {
        let host = self.host.trim_end_matches('.');
        let mut labels = host.split('.');
        let svc = labels.next()?;
        let ns = labels.next()?;
        let marker = labels.next()?;
        (marker.eq_ignore_ascii_case("svc") && !svc.is_empty() && !ns.is_empty())
            .then_some((svc, ns))
    }
}

/// Why an endpoint is rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// Empty or whitespace-only.
    #[error("must not be empty")]
    Empty,
    /// A scheme that belongs to another provider.
    #[error("scheme \"{scheme}://\" belongs to provider {owner}; {provider} accepts {accepted}")]
    ForeignScheme {
        /// The scheme given.
        scheme: String,
        /// The provider it belongs to.
        owner: &'static str,
        /// The selected provider.
        provider: &'static str,
        /// What the selected provider accepts.
        accepted: &'static str,
    },
    /// A scheme no provider accepts.
    #[error("scheme \"{scheme}://\" is not accepted; {provider} accepts {accepted}")]
    UnknownScheme {
        /// The scheme given.
        scheme: String,
        /// The selected provider.
        provider: &'static str,
        /// What the selected provider accepts.
        accepted: &'static str,
    },
    /// Whitespace inside the value.
    #[error("must not contain whitespace")]
    Whitespace,
    /// A `/`, `?` or `#` component.
    #[error("must not contain a URL path, query or fragment; use host:port")]
    PathQueryFragment,
    /// An IPv6 address without brackets.
    #[error("IPv6 addresses must be bracketed, e.g. [fd00::1]:6379")]
    UnbracketedIpv6,
    /// Brackets around something that is not an IPv6 address.
    #[error("brackets must enclose an IPv6 address, e.g. [fd00::1]:6379")]
    BadIpv6,
    /// No `:port`.
    #[error("must include a numeric port (host:port)")]
    MissingPort,
    /// Empty host.
    #[error("must include a host (host:port)")]
    MissingHost,
    /// Characters a host name cannot have.
    #[error("host {0:?} is not a valid host name or IP address")]
    BadHost(String),
    /// Port not all digits.
    #[error("port {0:?} must be numeric")]
    NonNumericPort(String),
    /// Port outside 1–65535.
    #[error("port {0} must be in 1-65535")]
    PortOutOfRange(String),
}

impl EndpointError {
    /// Whether this is a scheme error (rule `endpoint_scheme_belongs_to_provider`) rather than a
    /// shape error (rule `endpoint_shape_valid`).
    pub fn is_scheme_error(&self) -> bool {
        matches!(
            self,
            EndpointError::ForeignScheme { .. } | EndpointError::UnknownScheme { .. }
        )
    }
}

/// What a provider accepts, for messages.
pub fn accepted_forms(provider: RemoteProvider) -> &'static str {
    match provider {
        RemoteProvider::Redis => "only bare host:port",
        RemoteProvider::LMCacheServer => "host:port or lm://host:port",
        RemoteProvider::Mooncake => "host:port or mooncakestore://host:port",
    }
}

/// The scheme a provider may use, if any.
pub fn provider_scheme(provider: RemoteProvider) -> Option<&'static str> {
    match provider {
        RemoteProvider::Redis => None,
        RemoteProvider::LMCacheServer => Some("lm"),
        RemoteProvider::Mooncake => Some("mooncakestore"),
    }
}

/// Splits `scheme://rest`; checks the scheme against the provider. Returns the scheme (if any)
/// and the rest.
pub fn split_scheme(
    provider: RemoteProvider,
    trimmed: &str,
) -> Result<(Option<String>, &str), EndpointError> {
    let Some((scheme, rest)) = trimmed.split_once("://") else {
        return Ok((None, trimmed));
    };
    if Some(scheme) == provider_scheme(provider) {
        return Ok((Some(scheme.to_string()), rest));
    }
    let owner = [RemoteProvider::LMCacheServer, RemoteProvider::Mooncake]
        .into_iter()
        .find(|p| provider_scheme(*p) == Some(scheme));
    Err(match owner {
        Some(owner) => EndpointError::ForeignScheme {
            scheme: scheme.to_string(),
            owner: owner.as_str(),
            provider: provider.as_str(),
            accepted: accepted_forms(provider),
        },
        None => EndpointError::UnknownScheme {
            scheme: scheme.to_string(),
            provider: provider.as_str(),
            accepted: accepted_forms(provider),
        },
    })
}

/// Parses `host:port` (after any scheme).
pub fn parse_host_port(rest: &str) -> Result<(String, u16), EndpointError> {
    if rest.chars().any(char::is_whitespace) {
        return Err(EndpointError::Whitespace);
    }
    if rest.contains(['/', '?', '#']) {
        return Err(EndpointError::PathQueryFragment);
    }
    let (host, port) = if let Some(inner) = rest.strip_prefix('[') {
        let (addr, after) = inner.split_once(']').ok_or(EndpointError::BadIpv6)?;
        if addr.parse::<Ipv6Addr>().is_err() {
            return Err(EndpointError::BadIpv6);
        }
        let port = after.strip_prefix(':').ok_or(EndpointError::MissingPort)?;
        (addr.to_string(), port)
    } else {
        match rest.matches(':').count() {
            0 => {
                if rest.is_empty() {
                    return Err(EndpointError::MissingHost);
                }
                return Err(EndpointError::MissingPort);
            }
            1 => {
                let (h, p) = rest.split_once(':').ok_or(EndpointError::MissingPort)?;
                (h.to_string(), p)
            }
            _ => return Err(EndpointError::UnbracketedIpv6),
        }
    };
    if host.is_empty() {
        return Err(EndpointError::MissingHost);
    }
    if !host.contains(':')
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(EndpointError::BadHost(host));
    }
    if port.is_empty() {
        return Err(EndpointError::MissingPort);
    }
    if !port.chars().all(|c| c.is_ascii_digit()) {
        return Err(EndpointError::NonNumericPort(port.to_string()));
    }
    if port.len() > 5 {
        return Err(EndpointError::PortOutOfRange(port.to_string()));
    }
    let n: u32 = port
        .parse()
        .map_err(|_| EndpointError::PortOutOfRange(port.to_string()))?;
    let n = u16::try_from(n)
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| EndpointError::PortOutOfRange(port.to_string()))?;
    Ok((host, n))
}

/// Validates an endpoint for a provider (trimming it first). The first error wins: scheme, then
/// shape.
pub fn parse_endpoint(provider: RemoteProvider, raw: &str) -> Result<Endpoint, EndpointError> {
    let trimmed = raw.trim();
    if trimmed.is_empty() {
        return Err(EndpointError::Empty);
    }
    if trimmed.chars().any(char::is_whitespace) {
        return Err(EndpointError::Whitespace);
    }
    let (scheme, rest) = split_scheme(provider, trimmed)?;
    let (host, port) = parse_host_port(rest)?;
    Ok(Endpoint { scheme, host, port })
}

/// `(provider, raw endpoint)` when ownership is External and the endpoint is non-empty after
/// trimming.
fn external_endpoint(cb: &CacheBackend) -> Option<(RemoteProvider, &str)> {
    let rs = cb.spec.remote_storage.as_ref()?;
    if rs.ownership != Ownership::External {
        return None;
    }
    let raw = rs.endpoint.as_deref()?;
    (!raw.trim().is_empty()).then_some((rs.provider, raw))
}

/// Rule `endpoint_ownership_explicit`: `endpoint` is required for External ownership and
/// forbidden for Managed (the managed endpoint comes from the live Service, in
/// `status.endpoint`). Whitespace-only counts as empty.
pub struct EndpointOwnershipExplicit;

impl Rule for EndpointOwnershipExplicit {
    fn name(&self) -> &'static str {
        "endpoint_ownership_explicit"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some(rs) = &cb.spec.remote_storage else {
            return Vec::new();
        };
        let set = rs.endpoint.as_deref().is_some_and(|e| !e.trim().is_empty());
        match (rs.ownership, set) {
            (Ownership::External, false) => vec![Violation::required(
                FIELD,
                format!(
                    "required for ownership External: the {} endpoint the engines dial ({})",
                    rs.provider.as_str(),
                    accepted_forms(rs.provider)
                ),
            )],
            (Ownership::Managed, true) => vec![Violation::forbidden(
                FIELD,
                "must not be set for ownership Managed: the controller publishes the managed \
                 Service's endpoint in status.endpoint",
            )],
            _ => Vec::new(),
        }
    }
}

/// Rule `endpoint_scheme_belongs_to_provider`: `lm://` only for LMCacheServer,
/// `mooncakestore://` only for Mooncake, Redis bare `host:port` only, no other scheme.
pub struct EndpointSchemeBelongsToProvider;

impl Rule for EndpointSchemeBelongsToProvider {
    fn name(&self) -> &'static str {
        "endpoint_scheme_belongs_to_provider"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((provider, raw)) = external_endpoint(cb) else {
            return Vec::new();
        };
        match split_scheme(provider, raw.trim()) {
            Err(e) => vec![Violation::invalid(FIELD, raw, e.to_string())],
            Ok(_) => Vec::new(),
        }
    }
}

/// Rule `endpoint_shape_valid`: numeric port in 1–65535, no embedded whitespace, no URL
/// path/query/fragment, bracketed IPv6, a plausible host.
pub struct EndpointShapeValid;

impl Rule for EndpointShapeValid {
    fn name(&self) -> &'static str {
        "endpoint_shape_valid"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((provider, raw)) = external_endpoint(cb) else {
            return Vec::new();
        };
        let trimmed = raw.trim();
        let rest = trimmed.split_once("://").map_or(trimmed, |(_, r)| r);
        if let Err(e) = parse_host_port(rest) {
            return vec![Violation::invalid(FIELD, raw, e.to_string())];
        }
        // Whatever admission accepts, the Pod webhook's binding resolution must accept too
        // (spec: "The pod webhook applies the same validation").
        if split_scheme(provider, trimmed).is_ok() {
            if let Err(e) = crate::adapters::providers::parse_endpoint(provider, raw) {
                return vec![Violation::invalid(FIELD, raw, e.to_string())];
            }
        }
        Vec::new()
    }
}

/// Rule `cross_namespace_endpoint_requires_opt_in`: an External endpoint naming a Service in
/// another namespace (`<svc>.<ns>.svc[.…]`) needs `spec.allowCrossNamespace: true`.
pub struct CrossNamespaceEndpointRequiresOptIn;

impl Rule for CrossNamespaceEndpointRequiresOptIn {
    fn name(&self) -> &'static str {
        "cross_namespace_endpoint_requires_opt_in"
    }

    fn check(&self, cb: &CacheBackend, ctx: &RuleContext) -> Vec<Violation> {
        if cb.spec.allow_cross_namespace {
            return Vec::new();
        }
        let Some((_, raw)) = external_endpoint(cb) else {
            return Vec::new();
        };
        let trimmed = raw.trim();
        let rest = trimmed.split_once("://").map_or(trimmed, |(_, r)| r);
        let Ok((host, port)) = parse_host_port(rest) else {
            return Vec::new();
        };
        let ep = Endpoint {
            scheme: None,
            host,
            port,
        };
        match ep.service() {
            Some((svc, ns)) if !ns.eq_ignore_ascii_case(ctx.namespace) => {
                vec![Violation::forbidden(
                    FIELD,
                    format!(
                        "{raw:?} resolves to Service {svc:?} in namespace {ns:?}, not this \
                         CacheBackend's namespace {:?}; set spec.allowCrossNamespace: true to \
                         cross the namespace boundary",
                        ctx.namespace
                    ),
                )]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_provider_form() {
        let ok = [
            (RemoteProvider::Redis, "redis:6379", "redis", 6379),
            (
                RemoteProvider::Redis,
                " redis.ns.svc:6379 ",
                "redis.ns.svc",
                6379,
            ),
            (
                RemoteProvider::LMCacheServer,
                "lm://lmc:65432",
                "lmc",
                65432,
            ),
            (RemoteProvider::LMCacheServer, "lmc:1", "lmc", 1),
            (
                RemoteProvider::Mooncake,
                "mooncakestore://mc:50051",
                "mc",
                50051,
            ),
            (RemoteProvider::Redis, "[fd00::1]:6379", "fd00::1", 6379),
            (RemoteProvider::Redis, "10.0.0.1:65535", "10.0.0.1", 65535),
        ];
        for (p, raw, host, port) in ok {
            let e = parse_endpoint(p, raw).unwrap();
            assert_eq!((e.host.as_str(), e.port), (host, port), "{raw}");
        }
        assert_eq!(
            parse_endpoint(RemoteProvider::Redis, "[fd00::1]:6379")
                .unwrap()
                .host_port(),
            "[fd00::1]:6379"
        );
    }

    #[test]
    fn rejects_bad_forms() {
        use EndpointError as E;
        type Case = (RemoteProvider, &'static str, fn(&E) -> bool);
        let cases: [Case; 14] = [
            (RemoteProvider::Redis, "  ", |e| *e == E::Empty),
            (RemoteProvider::Redis, "lm://x:1", |e| {
                matches!(e, E::ForeignScheme { .. })
            }),
            (RemoteProvider::Redis, "redis://x:1", |e| {
                matches!(e, E::UnknownScheme { .. })
            }),
            (RemoteProvider::Mooncake, "lm://x:1", |e| {
                matches!(e, E::ForeignScheme { .. })
            }),
            (RemoteProvider::LMCacheServer, "mooncakestore://x:1", |e| {
                matches!(e, E::ForeignScheme { .. })
            }),
            (RemoteProvider::Redis, "x :1", |e| *e == E::Whitespace),
            (RemoteProvider::Redis, "x:1/db", |e| {
                *e == E::PathQueryFragment
            }),
            (RemoteProvider::Redis, "x:1?a", |e| {
                *e == E::PathQueryFragment
            }),
            (RemoteProvider::Redis, "x:1#f", |e| {
                *e == E::PathQueryFragment
            }),
            (RemoteProvider::Redis, "fd00::1:6379", |e| {
                *e == E::UnbracketedIpv6
            }),
            (RemoteProvider::Redis, "x", |e| *e == E::MissingPort),
            (RemoteProvider::Redis, "x:0", |e| {
                matches!(e, E::PortOutOfRange(_))
            }),
            (RemoteProvider::Redis, "x:65536", |e| {
                matches!(e, E::PortOutOfRange(_))
            }),
            (RemoteProvider::Redis, "x:http", |e| {
                matches!(e, E::NonNumericPort(_))
            }),
        ];
        for (p, raw, pred) in cases {
            let e = parse_endpoint(p, raw).unwrap_err();
            assert!(pred(&e), "{raw}: {e:?}");
        }
    }

    #[test]
    fn service_dns_names() {
        let ep = |h: &str| Endpoint {
            scheme: None,
            host: h.to_string(),
            port: 1,
        };
        assert_eq!(ep("redis.cache.svc").service(), Some(("redis", "cache")));
        assert_eq!(
            ep("redis.cache.svc.cluster.local.").service(),
            Some(("redis", "cache"))
        );
        assert_eq!(ep("redis.cache").service(), None);
        assert_eq!(ep("redis").service(), None);
        assert_eq!(ep("redis.example.com").service(), None);
        assert_eq!(ep("10.0.0.1").service(), None);
    }
}
