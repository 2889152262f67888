//! The layer in front of the TokenReview: [`CachingVerifier`] (successes and rejections cached
//! per keyed hash of the token, bounded) and [`SourceLimiter`] (TokenReviews one source address
//! may cause: a burst, then a refill rate — `--token-review-burst-per-source`,
//! `--token-reviews-per-second-per-source`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{TokenIdentity, TokenVerifier, VerifyError};

/// Default lifetime of a cached successful verification.
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(60);
/// Default lifetime of a cached rejection.
pub const DEFAULT_NEGATIVE_CACHE_TTL: Duration = Duration::from_secs(10);
/// Default bound on cached tokens.
pub const DEFAULT_CACHE_ENTRIES: usize = 4096;
/// TokenReviews one source address may cause at once before it is limited (cache hits cost
/// none): agents and subscribers review once per connection and are cached for
/// [`DEFAULT_CACHE_TTL`], so a burst of 16 covers a node's restarting sidecars.
pub const DEFAULT_REVIEW_BURST_PER_SOURCE: u32 = 16;
/// TokenReviews per second one source address earns back after its burst.
pub const DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE: f64 = 2.0;
/// Source addresses the per-source review limiter remembers (full buckets are forgotten
/// first, then the least recently used).
pub const MAX_REVIEW_SOURCES: usize = 4096;

/// The per-source TokenReview limit of the in-cluster controller
/// (`--token-review-burst-per-source`, `--token-reviews-per-second-per-source`; chart
/// `controller.tokenReviewBurstPerSource`, `controller.tokenReviewsPerSecondPerSource`):
/// [`SourceLimiter`]'s two numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReviewSourceLimit {
    /// TokenReviews one source address may cause at once (at least 1 is used).
    pub burst: u32,
    /// TokenReviews per second a source earns back after its burst (0 = none; negative reads
    /// as 0).
    pub per_second: f64,
}

impl Default for ReviewSourceLimit {
    /// [`DEFAULT_REVIEW_BURST_PER_SOURCE`] at once, [`DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE`]
    /// after.
    fn default() -> Self {
        ReviewSourceLimit {
            burst: DEFAULT_REVIEW_BURST_PER_SOURCE,
            per_second: DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE,
        }
    }
}

/// Parses `--token-reviews-per-second-per-source`: a finite number ≥ 0 (reviews per second).
///
/// # Errors
/// Not a number, negative, infinite or NaN: the message says which.
pub fn parse_reviews_per_second(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not a number of TokenReviews per second: {e}"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!(
            "{s:?}: TokenReviews per second must be a finite number of at least 0"
        ));
    }
    Ok(v)
}

/// A token bucket of TokenReviews per source address (issue 38 item 8: every garbage token cost
/// one TokenReview — 4 000 requests, 4 004 reviews). Cache hits never reach it.
#[derive(Debug)]
pub struct SourceLimiter {
    burst: f64,
    per_second: f64,
    buckets: Mutex<HashMap<std::net::IpAddr, (f64, Instant)>>,
}

impl SourceLimiter {
    /// `burst` reviews at once per source, `per_second` more each second.
    pub fn new(burst: u32, per_second: f64) -> Self {
        SourceLimiter {
            burst: f64::from(burst.max(1)),
            per_second: per_second.max(0.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Reviews one source may cause at once (at least 1).
    pub fn burst(&self) -> u32 {
        self.burst as u32
    }

    /// Reviews per second a source earns back after its burst (at least 0).
    pub fn per_second(&self) -> f64 {
        self.per_second
    }

    /// Takes one review from `source`'s bucket; false when it is empty.
    pub fn try_take(&self, source: std::net::IpAddr, now: Instant) -> bool {
        let mut b = self.buckets.lock();
        if b.len() >= MAX_REVIEW_SOURCES && !b.contains_key(&source) {
            let (burst, rate) = (self.burst, self.per_second);
            b.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * rate < burst
            });
            while b.len() >= MAX_REVIEW_SOURCES {
                let Some(oldest) = b.iter().min_by_key(|(_, (_, at))| *at).map(|(k, _)| *k) else {
                    break;
                };
                b.remove(&oldest);
            }
        }
        let (tokens, at) = b.entry(source).or_insert((self.burst, now));
        *tokens =
            (*tokens + now.duration_since(*at).as_secs_f64() * self.per_second).min(self.burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Default for SourceLimiter {
    fn default() -> Self {
        Self::new(
            DEFAULT_REVIEW_BURST_PER_SOURCE,
            DEFAULT_REVIEWS_PER_SECOND_PER_SOURCE,
        )
    }
}

struct CacheEntry {
    at: Instant,
    ttl: Duration,
    /// The token itself, for a success only: a hit must present the same token (a hash
    /// collision can then never hand out another token's identity). A rejection keeps only
    /// the hash — a flood of garbage tokens (up to the 64 KiB pre-authentication cap each)
    /// costs 16 bytes of key per entry, not the token.
    token: Option<Box<str>>,
    result: Result<TokenIdentity, VerifyError>,
}

/// The cache key of (token, audience): a SipHash with this cache's random keys (std's
/// `RandomState`), so nobody outside can aim garbage at a given slot.
type CacheKey = (u64, String);

/// A monotonic time source (injected so tests control cache expiry).
pub type MonotonicClock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// Caches another verifier's answers per (token, audience): successes for `ttl`, rejections
/// for `negative_ttl`; `Unavailable` is never cached. Holds at most `max_entries` tokens
/// (expired entries are dropped first, then the oldest). Time comes from an injectable
/// monotonic clock ([`CachingVerifier::with_clock`]; default `Instant::now`).
pub struct CachingVerifier<V> {
    inner: V,
    ttl: Duration,
    negative_ttl: Duration,
    max_entries: usize,
    clock: MonotonicClock,
    hasher: std::collections::hash_map::RandomState,
    cache: Mutex<HashMap<CacheKey, CacheEntry>>,
}

impl<V: TokenVerifier> CachingVerifier<V> {
    /// A cache with the defaults (60 s, 10 s, 4096 entries).
    pub fn new(inner: V) -> Self {
        Self::with_ttls(
            inner,
            DEFAULT_CACHE_TTL,
            DEFAULT_NEGATIVE_CACHE_TTL,
            DEFAULT_CACHE_ENTRIES,
        )
    }

    /// A cache with explicit lifetimes and bound.
    pub fn with_ttls(inner: V, ttl: Duration, negative_ttl: Duration, max_entries: usize) -> Self {
        CachingVerifier {
            inner,
            ttl,
            negative_ttl,
            max_entries: max_entries.max(1),
            clock: Arc::new(Instant::now),
            hasher: std::collections::hash_map::RandomState::new(),
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn key(&self, token: &str, audience: &str) -> CacheKey {
        use std::hash::BuildHasher;
        (self.hasher.hash_one(token), audience.to_string())
    }

    /// Replaces the time source (tests).
    pub fn with_clock(mut self, clock: MonotonicClock) -> Self {
        self.clock = clock;
        self
    }

    /// Tokens cached now (at most the bound given at construction).
    pub fn cached_tokens(&self) -> usize {
        self.cache.lock().len()
    }

    fn lookup(
        &self,
        key: &CacheKey,
        token: &str,
        now: Instant,
    ) -> Option<Result<TokenIdentity, VerifyError>> {
        let cache = self.cache.lock();
        let e = cache.get(key)?;
        if let (Ok(_), Some(t)) = (&e.result, &e.token) {
            if &**t != token {
                return None;
            }
        }
        (now.duration_since(e.at) < e.ttl).then(|| e.result.clone())
    }

    fn store(
        &self,
        key: CacheKey,
        token: &str,
        result: Result<TokenIdentity, VerifyError>,
        now: Instant,
    ) {
        let ttl = match &result {
            Ok(_) => self.ttl,
            Err(VerifyError::Rejected(_)) => self.negative_ttl,
            Err(VerifyError::Unavailable(_)) => return,
        };
        let mut cache = self.cache.lock();
        if cache.len() >= self.max_entries {
            cache.retain(|_, e| now.duration_since(e.at) < e.ttl);
        }
        while cache.len() >= self.max_entries {
            let oldest = cache
                .iter()
                .min_by_key(|(_, e)| e.at)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => {
                    cache.remove(&k);
                }
                None => break,
            }
        }
        cache.insert(
            key,
            CacheEntry {
                at: now,
                ttl,
                token: result.is_ok().then(|| token.into()),
                result,
            },
        );
    }
}

#[tonic::async_trait]
impl<V: TokenVerifier> TokenVerifier for CachingVerifier<V> {
    async fn verify(&self, token: &str, audience: &str) -> Result<TokenIdentity, VerifyError> {
        let key = self.key(token, audience);
        if let Some(hit) = self.lookup(&key, token, (self.clock)()) {
            return hit;
        }
        let result = self.inner.verify(token, audience).await;
        self.store(key, token, result.clone(), (self.clock)());
        result
    }

    fn cached(&self, token: &str, audience: &str) -> Option<Result<TokenIdentity, VerifyError>> {
        self.lookup(&self.key(token, audience), token, (self.clock)())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::ingest::auth::FakeTokenVerifier;

    #[test]
    fn reviews_per_second_must_be_a_finite_number_of_at_least_zero() {
        assert_eq!(parse_reviews_per_second("2"), Ok(2.0));
        assert_eq!(parse_reviews_per_second("0.5"), Ok(0.5));
        assert_eq!(parse_reviews_per_second("0"), Ok(0.0));
        for bad in ["-1", "inf", "NaN", "two", ""] {
            assert!(parse_reviews_per_second(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_colliding_hash_never_hands_out_another_tokens_identity() {
        let cache = CachingVerifier::new(FakeTokenVerifier::new());
        let key = cache.key("tok", "aud");
        cache.store(
            key.clone(),
            "tok",
            Ok(TokenIdentity::default()),
            Instant::now(),
        );
        assert!(cache.lookup(&key, "tok", Instant::now()).is_some());
        assert!(
            cache.lookup(&key, "forged", Instant::now()).is_none(),
            "the same key with another token is a miss"
        );
    }
}
