//! The External endpoint verdict (spec 000 "Externally owned remote storage").
//!
//! The shape check itself is the one the Pod webhook applies
//! ([`crate::adapters::providers::parse_endpoint`]), so the reconciler's Ready reason and the
//! webhook's wiring decision never disagree: bare `host:port` for every provider,
//! `lm://host:port` for LMCacheServer, `mooncakestore://host:port` for Mooncake, a numeric port
//! in 1–65535, no whitespace or path / query / fragment, bracketed IPv6.

use ic_shared::crd::RemoteProvider;

use crate::adapters::providers::{parse_endpoint, EndpointError};

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
        /// What is wrong with it.
        error: String,
    },
}

/// Checks `endpoint` (as written in the spec, untrimmed) for `provider`.
pub fn check_endpoint(provider: RemoteProvider, endpoint: Option<&str>) -> EndpointCheck {
    let trimmed = endpoint.map(str::trim).unwrap_or_default();
    match parse_endpoint(provider, trimmed) {
        Ok(_) => EndpointCheck::Accepted(trimmed.to_string()),
        Err(EndpointError::Empty) => EndpointCheck::Missing,
        Err(e) => EndpointCheck::Invalid {
            endpoint: trimmed.to_string(),
            error: e.to_string(),
        },
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
        assert!(accepted(Mooncake, "mooncakestore://10.0.0.1:50051"));
        assert!(accepted(Mooncake, "[fd00::1]:50051"));
        assert!(!accepted(Redis, "redis://r:6379"));
        assert!(!accepted(LMCacheServer, "mooncakestore://m:50051"));
        assert!(!accepted(Redis, "r"));
        assert!(!accepted(Redis, "r:0"));
        assert!(!accepted(Redis, "r:65536"));
        assert!(!accepted(Redis, "fd00::1:6379"));
        assert!(!accepted(LMCacheServer, "lm://srv:65432/path"));
    }
}
