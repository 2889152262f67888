//! Rule `cache_hierarchy_consistent` (spec "Validating": "Cache hierarchy must be internally
//! consistent"; "Cache hierarchy and ownership").
//!
//! Rejects: a provider-specific typed block (`remoteStorage.redis|lmCacheServer|mooncake`) that
//! does not match `remoteStorage.provider`, or that configures a workload under `ownership:
//! External` (which provisions none); `lmCache` with a non-LMCache `type`; `hiCache` with a
//! non-SGLangHiCache `type`; host-only configuration (no `remoteStorage`) that requests workload
//! autoscaling. (Events-only autoscaling is left to `events_only_forbids_autoscaling`, so one
//! mistake yields one error.)
//!
//! Warns when `spec.autoscaling` or `spec.template` would sit inert on a backend that provisions
//! no workload of its own (External ownership, host-only, events-only).

use ic_shared::crd::{CacheBackend, CacheType, Ownership, RemoteProvider};

use super::{path, Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![Box::new(CacheHierarchyConsistent)]
}

/// See the module documentation.
pub struct CacheHierarchyConsistent;

/// Whether this backend renders a provider workload of its own (managed remote storage in
/// Offload mode).
pub fn provisions_workload(cb: &CacheBackend) -> bool {
    !cb.spec.is_events_only()
        && cb
            .spec
            .remote_storage
            .as_ref()
            .is_some_and(|r| r.ownership == Ownership::Managed)
}

impl Rule for CacheHierarchyConsistent {
    fn name(&self) -> &'static str {
        "cache_hierarchy_consistent"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let spec = &cb.spec;
        let mut out = Vec::new();
        if let Some(rs) = &spec.remote_storage {
            let blocks = [
                (RemoteProvider::Redis, rs.redis.is_some()),
                (RemoteProvider::LMCacheServer, rs.lm_cache_server.is_some()),
                (RemoteProvider::Mooncake, rs.mooncake.is_some()),
            ];
            for (provider, present) in blocks {
                if !present {
                    continue;
                }
                if provider != rs.provider {
                    out.push(Violation::forbidden(
                        path::provider_block(provider),
                        format!(
                            "may only be set when spec.remoteStorage.provider is {}; provider is {}",
                            provider.as_str(),
                            rs.provider.as_str()
                        ),
                    ));
                } else if rs.ownership == Ownership::External {
                    out.push(Violation::forbidden(
                        path::provider_block(provider),
                        "provider workload settings apply only to ownership Managed; External \
                         ownership provisions no workload",
                    ));
                }
            }
        }
        let cache_type = spec.effective_type();
        if spec.lm_cache.is_some() && cache_type != CacheType::LMCache {
            out.push(Violation::forbidden(
                "spec.lmCache",
                format!(
                    "may only be set with spec.type LMCache; type is {}",
                    cache_type.as_str()
                ),
            ));
        }
        if spec.hi_cache.is_some() && cache_type != CacheType::SGLangHiCache {
            out.push(Violation::forbidden(
                "spec.hiCache",
                format!(
                    "may only be set with spec.type SGLangHiCache; type is {}",
                    cache_type.as_str()
                ),
            ));
        }
        if spec.remote_storage.is_none() && spec.autoscaling.is_some() && !spec.is_events_only() {
            out.push(Violation::forbidden(
                "spec.autoscaling",
                "host-only configuration (no spec.remoteStorage) provisions no workload to \
                 autoscale; remove spec.autoscaling or add managed remote storage",
            ));
        }
        out
    }

    fn warnings(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<String> {
        let spec = &cb.spec;
        let mut out = Vec::new();
        let external = spec
            .remote_storage
            .as_ref()
            .is_some_and(|r| r.ownership == Ownership::External);
        if external && spec.autoscaling.is_some() {
            out.push(
                "spec.autoscaling has no effect: External ownership provisions no workload to \
                 autoscale"
                    .to_string(),
            );
        }
        if spec.template.is_some() && !provisions_workload(cb) {
            out.push(
                "spec.template has no effect: this backend provisions no managed workload"
                    .to_string(),
            );
        }
        out
    }
}
