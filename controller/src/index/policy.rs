//! Per-namespace lookup policy (spec 000: `CachePolicy.spec.lookupTimeoutMs` and
//! `CachePolicy.spec.minimumPrefixTokens`, "the surfaces actually wired into the server's
//! ResolvedPolicy and the LookupRoute path").
//!
//! The table is filled from CachePolicy objects (one per namespace) by whoever watches them, and
//! read by the router on every lookup: [`PolicyTable::resolve`] gives the policy of the request's
//! tenant, falling back field by field to the controller's defaults.
//!
//! ```
//! use ic_controller::index::PolicyTable;
//! use std::time::Duration;
//!
//! let t = PolicyTable::new();
//! t.set_defaults(None, 0);
//! t.set_policy("team-a", Some(5), Some(64));
//! let p = t.resolve("team-a");
//! assert_eq!(p.lookup_timeout, Some(Duration::from_millis(5)));
//! assert_eq!(p.minimum_prefix_tokens, 64);
//! assert_eq!(t.resolve("team-b").minimum_prefix_tokens, 0);
//! ```

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::RwLock;
use serde::Serialize;

/// One namespace's CachePolicy values; `None` = unset (the controller's default applies).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacePolicy {
    /// `spec.lookupTimeoutMs`: the lookup latency budget in milliseconds; 0 = no budget.
    pub lookup_timeout_ms: Option<u32>,
    /// `spec.minimumPrefixTokens`: requests (and matches) shorter than this answer NO_HINT.
    pub minimum_prefix_tokens: Option<u32>,
}

/// The policy a lookup runs under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResolvedPolicy {
    /// Budget for the whole lookup (waiting for the index included); `None` = unbounded. A
    /// lookup over budget answers NO_HINT with reason `LookupTimeout` (fail open).
    pub lookup_timeout: Option<Duration>,
    /// A request carrying fewer tokens, or a best match shorter than this, answers NO_HINT
    /// (`BelowMinimumPrefixTokens`).
    pub minimum_prefix_tokens: u32,
}

#[derive(Debug, Default)]
struct Inner {
    defaults: NamespacePolicy,
    by_namespace: HashMap<String, NamespacePolicy>,
}

/// Lookup policies by namespace (tenant), with controller-wide defaults. Thread-safe; cheap to
/// read on every lookup.
#[derive(Debug, Default)]
pub struct PolicyTable {
    inner: RwLock<Inner>,
}

impl PolicyTable {
    /// An empty table: no budget, no minimum.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the defaults used where a namespace has no CachePolicy, or leaves a field unset
    /// (the controller's flags). `lookup_timeout_ms` `None` or 0 = no budget.
    pub fn set_defaults(&self, lookup_timeout_ms: Option<u32>, minimum_prefix_tokens: u32) {
        self.inner.write().defaults = NamespacePolicy {
            lookup_timeout_ms,
            minimum_prefix_tokens: Some(minimum_prefix_tokens),
        };
    }

    /// Records `namespace`'s CachePolicy values (replacing earlier ones).
    pub fn set_policy(
        &self,
        namespace: &str,
        lookup_timeout_ms: Option<u32>,
        minimum_prefix_tokens: Option<u32>,
    ) {
        self.inner.write().by_namespace.insert(
            namespace.to_string(),
            NamespacePolicy {
                lookup_timeout_ms,
                minimum_prefix_tokens,
            },
        );
    }

    /// Replaces every namespace's values at once (the CachePolicy watcher): namespaces not in
    /// `all` fall back to the defaults.
    pub fn replace_all(&self, all: std::collections::BTreeMap<String, NamespacePolicy>) {
        self.inner.write().by_namespace = all.into_iter().collect();
    }

    /// Forgets `namespace`'s CachePolicy (it was deleted): the defaults apply again.
    pub fn remove_policy(&self, namespace: &str) {
        self.inner.write().by_namespace.remove(namespace);
    }

    /// Every namespace's recorded values, sorted by namespace.
    pub fn list(&self) -> Vec<(String, NamespacePolicy)> {
        let g = self.inner.read();
        let mut v: Vec<_> = g
            .by_namespace
            .iter()
            .map(|(k, p)| (k.clone(), *p))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The policy for a lookup in `namespace` (an empty namespace — a lookup across tenants —
    /// gets the defaults). Fields no CachePolicy and no default set are 0 / unbounded.
    pub fn resolve(&self, namespace: &str) -> ResolvedPolicy {
        self.resolve_or(namespace, ResolvedPolicy::default())
    }

    /// Like [`resolve`](Self::resolve), with `fallback` for fields neither the namespace's
    /// CachePolicy nor [`set_defaults`](Self::set_defaults) set (the router passes the
    /// controller's flags).
    pub fn resolve_or(&self, namespace: &str, fallback: ResolvedPolicy) -> ResolvedPolicy {
        let g = self.inner.read();
        let ns = if namespace.is_empty() {
            None
        } else {
            g.by_namespace.get(namespace)
        };
        let timeout = match ns
            .and_then(|p| p.lookup_timeout_ms)
            .or(g.defaults.lookup_timeout_ms)
        {
            Some(0) => None,
            Some(ms) => Some(Duration::from_millis(u64::from(ms))),
            None => fallback.lookup_timeout,
        };
        let minimum = ns
            .and_then(|p| p.minimum_prefix_tokens)
            .or(g.defaults.minimum_prefix_tokens)
            .unwrap_or(fallback.minimum_prefix_tokens);
        ResolvedPolicy {
            lookup_timeout: timeout,
            minimum_prefix_tokens: minimum,
        }
    }
}
