//! Provider-specific shape check of an External `spec.remoteStorage.endpoint` (spec 000
//! "Externally owned remote storage").
//!
//! Bare `host:port` is accepted for every provider; LMCacheServer also accepts `lm://host:port`
//! and Mooncake `mooncakestore://host:port`; Redis accepts only the bare form. A numeric port in
//! 1–65535 is always required; whitespace, user info and URL path / query / fragment components
//! are rejected; IPv6 must be bracketed.

use ic_shared::crd::RemoteProvider;

/// The verdict on an External endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointCheck {
    /// Non-empty and valid for the provider; carries the trimmed value.
    Accepted(String),
    /// Empty or whitespace-only.
    Missing,
    /// Non-empty but fails the shape check; carries the trimmed value and the shape error.
    Invalid {
        /// The trimmed endpoint.
        endpoint: String,
        /// What is wrong with it, as a sentence fragment.
        error: String,
    },
}

/// The URL scheme a provider accepts besides bare `host:port`.
pub fn provider_scheme(provider: RemoteProvider) -> Option<&'static str> {
    match provider {
        RemoteProvider::Redis => None,
        RemoteProvider::LMCacheServer => Some("lm"),
        RemoteProvider::Mooncake => Some("mooncakestore"),
    }
}

/// Checks `endpoint` (as written in the spec, untrimmed) for `provider`.
pub fn check_endpoint(provider: RemoteProvider, endpoint: Option<&str>) -> EndpointCheck {
    let trimmed = endpoint.map(str::trim).unwrap_or_default();
    if trimmed.is_empty() {
        return EndpointCheck::Missing;
    }
    match shape_error(provider, trimmed) {
        None => EndpointCheck::Accepted(trimmed.to_string()),
        Some(error) => EndpointCheck::Invalid {
            endpoint: trimmed.to_string(),
            error,
        },
    }
}

fn shape_error(provider: RemoteProvider, ep: &str) -> Option<String> {
    if ep.chars().any(char::is_whitespace) {
        return Some("must not contain whitespace".to_string());
    }
    let hostport = match ep.split_once("://") {
        Some((scheme, rest)) => {
            match provider_scheme(provider) {
                Some(s) if s == scheme => {}
                Some(s) => {
                    return Some(format!(
                        "scheme {scheme}:// is not accepted for provider {}; use host:port or {s}://host:port",
                        provider.as_str()
                    ))
                }
                None => {
                    return Some(format!(
                        "scheme {scheme}:// is not accepted for provider {}; use bare host:port",
                        provider.as_str()
                    ))
                }
            }
            rest
        }
        None => ep,
    };
    if hostport.contains(['/', '?', '#']) {
        return Some("must not carry a URL path, query or fragment".to_string());
    }
    if hostport.contains('@') {
        return Some("must not carry user info".to_string());
    }
    let port = if let Some(rest) = hostport.strip_prefix('[') {
        let Some((h, after)) = rest.split_once(']') else {
            return Some("has an unterminated IPv6 bracket".to_string());
        };
        let Some(port) = after.strip_prefix(':') else {
            return Some("must be host:port with a numeric port".to_string());
        };
        if h.is_empty() || !h.chars().all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.') {
            return Some(format!("has an invalid IPv6 address [{h}]"));
        }
        port
    } else {
        let Some((h, port)) = hostport.rsplit_once(':') else {
            return Some("must be host:port with a numeric port".to_string());
        };
        if h.contains(':') {
            return Some("IPv6 addresses must be bracketed ([addr]:port)".to_string());
        }
        if h.is_empty()
            || !h
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        {
            return Some(format!("has an invalid host {h:?}"));
        }
        port
    };
    match port.parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) && !port.starts_with('+') => None,
        _ => Some(format!("port {port:?} must be a number in 1-65535")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(p: RemoteProvider, e: &str) -> bool {
        matches!(check_endpoint(p, Some(e)), EndpointCheck::Accepted(_))
    }

    #[test]
    fn table() {
        use RemoteProvider::*;
        assert_eq!(check_endpoint(Redis, None), EndpointCheck::Missing);
        assert_eq!(check_endpoint(Redis, Some("   ")), EndpointCheck::Missing);
        assert_eq!(
            check_endpoint(Redis, Some(" redis.ns.svc:6379 ")),
            EndpointCheck::Accepted("redis.ns.svc:6379".to_string())
        );
        assert!(accepted(LMCacheServer, "lm://srv:65432"));
        assert!(accepted(LMCacheServer, "srv:65432"));
        assert!(accepted(Mooncake, "mooncakestore://10.0.0.1:50051"));
        assert!(accepted(Mooncake, "[fd00::1]:50051"));
        assert!(!accepted(Redis, "redis://r:6379"));
        assert!(!accepted(LMCacheServer, "mooncakestore://m:50051"));
        assert!(!accepted(Redis, "r"));
        assert!(!accepted(Redis, "r:0"));
        assert!(!accepted(Redis, "r:65536"));
        assert!(!accepted(Redis, "r:port"));
        assert!(!accepted(Redis, "fd00::1:6379"));
        assert!(!accepted(LMCacheServer, "lm://srv:65432/path"));
        assert!(!accepted(Redis, "a b:1"));
        assert!(!accepted(Redis, "user@r:1"));
    }
}
