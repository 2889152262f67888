//! Rule `lmcache_kernel_check_annotation_valid` (spec "LMCache client kernels ↔ engine-image
//! CUDA / vLLM alignment"): the `inferencecache.io/lmcache-kernel-check` annotation is one of
//! `auto`, `report-only`, `strict`, `off`, so that a typo (`strcit`) cannot silently relax strict
//! enforcement back to report-only. The value rule is engine-agnostic.

use ic_shared::crd::CacheBackend;

use super::{path, Rule, RuleContext, Violation};

pub use crate::adapters::{KERNEL_CHECK_ANNOTATION, KERNEL_CHECK_VALUES};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![Box::new(LmcacheKernelCheckAnnotationValid)]
}

/// See the module documentation.
pub struct LmcacheKernelCheckAnnotationValid;

impl Rule for LmcacheKernelCheckAnnotationValid {
    fn name(&self) -> &'static str {
        "lmcache_kernel_check_annotation_valid"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some(value) = cb
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(KERNEL_CHECK_ANNOTATION))
        else {
            return Vec::new();
        };
        if KERNEL_CHECK_VALUES.contains(&value.as_str()) {
            return Vec::new();
        }
        vec![Violation::not_supported(
            path::key("metadata.annotations", KERNEL_CHECK_ANNOTATION),
            value,
            KERNEL_CHECK_VALUES,
        )]
    }
}
