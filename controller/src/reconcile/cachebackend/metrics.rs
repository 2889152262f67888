//! The CacheBackend reconciler's Prometheus gauges.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `inferencecache_backend_t2_hit_rate` | `backend` (`namespace/name`) | `status.indexParticipation.t2HitRate` as a number in [0,1]; no series while the field is unset (tier 2 not exercised) |
//!
//! The spec names this gauge for alerting on `T2Degraded` (CR status is not scraped), e.g.
//! `inferencecache_backend_t2_hit_rate == 0`. Every controller replica computes the same value
//! from its own copy of the index (each agent streams to every replica), followers included, so
//! any replica's `/metrics` can be scraped. The series of a deleted backend is removed.

use prometheus::{GaugeVec, Opts, Registry};

/// Gauges of the CacheBackend reconciler.
#[derive(Clone)]
pub struct BackendMetrics {
    t2_hit_rate: GaugeVec,
}

impl BackendMetrics {
    /// The gauges, not registered anywhere (tests read them with [`Self::t2_hit_rate`]).
    ///
    /// # Errors
    /// Never with the fixed names used here; kept as a `Result` for the prometheus API.
    pub fn unregistered() -> Result<Self, prometheus::Error> {
        Ok(BackendMetrics {
            t2_hit_rate: GaugeVec::new(
                Opts::new(
                    "inferencecache_backend_t2_hit_rate",
                    "Query-weighted tier-2 (external offload, e.g. LMCache) reload hit rate of the \
                     CacheBackend's replicas in [0,1] (status.indexParticipation.t2HitRate); absent \
                     until tier 2 has been exercised.",
                ),
                &["backend"],
            )?,
        })
    }

    /// The gauges, registered in `registry`.
    ///
    /// # Errors
    /// When a gauge of the same name is already registered there.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self::unregistered()?;
        registry.register(Box::new(m.t2_hit_rate.clone()))?;
        Ok(m)
    }

    /// Records backend `key` (`namespace/name`)'s `t2HitRate`: the parsed value, or no series
    /// when unset (or not a number).
    pub fn record(&self, key: &str, t2_hit_rate: Option<&str>) {
        match t2_hit_rate.and_then(|r| r.trim().parse::<f64>().ok()) {
            Some(v) if v.is_finite() => self.t2_hit_rate.with_label_values(&[key]).set(v),
            _ => self.forget(key),
        }
    }

    /// Removes backend `key`'s series (the CacheBackend is gone).
    pub fn forget(&self, key: &str) {
        let _ = self.t2_hit_rate.remove_label_values(&[key]);
    }

    /// The gauge's current value for `key`, `None` when it has no series.
    pub fn t2_hit_rate(&self, key: &str) -> Option<f64> {
        use prometheus::core::Collector;
        self.t2_hit_rate
            .collect()
            .iter()
            .flat_map(|mf| mf.get_metric().iter())
            .find(|m| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == "backend" && l.value() == key)
            })
            .map(|m| m.get_gauge().get_value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_exists_only_while_the_rate_is_set() {
        let reg = Registry::new();
        let m = BackendMetrics::register(&reg).unwrap();
        assert_eq!(m.t2_hit_rate("ml/kv"), None);
        m.record("ml/kv", Some("0.25"));
        assert_eq!(m.t2_hit_rate("ml/kv"), Some(0.25));
        let text = ic_shared::telemetry::encode_metrics(&reg);
        assert!(
            text.contains("inferencecache_backend_t2_hit_rate{backend=\"ml/kv\"} 0.25"),
            "{text}"
        );
        m.record("ml/kv", None);
        assert_eq!(m.t2_hit_rate("ml/kv"), None);
        m.record("ml/kv", Some("0"));
        assert_eq!(m.t2_hit_rate("ml/kv"), Some(0.0));
        m.forget("ml/kv");
        assert_eq!(m.t2_hit_rate("ml/kv"), None);
        assert!(
            BackendMetrics::register(&reg).is_err(),
            "registered once per registry"
        );
    }
}
