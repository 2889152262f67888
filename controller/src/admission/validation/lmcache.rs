//! Rule `lmcache_host_memory_positive` (spec "SGLang LMCache MP mode": `lmCache.hostMemory.capacity`
//! is a positive quantity).

use ic_shared::crd::CacheBackend;

use super::quantity::Quantity;
use super::{Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![Box::new(LmCacheHostMemoryPositive)]
}

/// `spec.lmCache.hostMemory.capacity` must parse as a quantity greater than zero.
pub struct LmCacheHostMemoryPositive;

impl Rule for LmCacheHostMemoryPositive {
    fn name(&self) -> &'static str {
        "lmcache_host_memory_positive"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some(cap) = cb
            .spec
            .lm_cache
            .as_ref()
            .and_then(|l| l.host_memory.as_ref())
            .and_then(|h| h.capacity.as_ref())
        else {
            return Vec::new();
        };
        let field = "spec.lmCache.hostMemory.capacity";
        match Quantity::parse(&cap.0) {
            Ok(q) if q.is_positive() => Vec::new(),
            Ok(_) => vec![Violation::invalid(
                field,
                &cap.0,
                "must be a positive quantity, e.g. 32Gi",
            )],
            Err(e) => vec![Violation::invalid(field, &cap.0, e.to_string())],
        }
    }
}
