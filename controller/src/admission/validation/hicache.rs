//! Rule `hicache_config_valid` (spec "SGLang native HiCache").
//!
//! `type: SGLangHiCache` requires `spec.hiCache`; exactly one of `ratio` (a string holding a
//! finite number > 0) and `sizeGB` (an integer ≥ 1) is set. The optional `writePolicy`,
//! `ioBackend` and `memoryLayout` values are closed enums; an unknown spelling is rejected by the
//! schema stage as `Unsupported value` with the supported values listed
//! (`spec.hiCache.writePolicy: Unsupported value: "write_thru": supported values: …`).

use ic_shared::crd::{CacheBackend, CacheType};

use super::{Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![Box::new(HiCacheConfigValid)]
}

/// See the module documentation.
pub struct HiCacheConfigValid;

impl Rule for HiCacheConfigValid {
    fn name(&self) -> &'static str {
        "hicache_config_valid"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let spec = &cb.spec;
        let Some(hc) = &spec.hi_cache else {
            if spec.effective_type() == CacheType::SGLangHiCache {
                return vec![Violation::required(
                    "spec.hiCache",
                    "required for type SGLangHiCache: set exactly one of ratio and sizeGB",
                )];
            }
            return Vec::new();
        };
        let mut out = Vec::new();
        match (&hc.ratio, hc.size_gb) {
            (None, None) => out.push(Violation::required(
                "spec.hiCache",
                "exactly one of ratio and sizeGB must be set",
            )),
            (Some(_), Some(_)) => out.push(Violation::forbidden(
                "spec.hiCache.sizeGB",
                "ratio and sizeGB are mutually exclusive: set exactly one",
            )),
            _ => {}
        }
        if let Some(ratio) = &hc.ratio {
            let ok = !ratio.chars().any(char::is_whitespace)
                && ratio.parse::<f64>().is_ok_and(|r| r.is_finite() && r > 0.0);
            if !ok {
                out.push(Violation::invalid(
                    "spec.hiCache.ratio",
                    ratio,
                    "must be a finite number greater than zero, e.g. \"2.0\"",
                ));
            }
        }
        if let Some(size) = hc.size_gb.filter(|s| *s < 1) {
            out.push(Violation::invalid_num(
                "spec.hiCache.sizeGB",
                i64::from(size),
                "must be a positive integer (decimal gigabytes)",
            ));
        }
        out
    }
}
