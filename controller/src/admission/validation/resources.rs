//! The seven provider-resource rules (spec "Resources"; "Validating": "Provider resources must be
//! valid" and the six rows after it). They check the selected provider's typed block,
//! `spec.remoteStorage.<provider>.resources`, and report at that path:
//!
//! | rule | spec name | rejects |
//! |---|---|---|
//! | `provider_resource_names_valid` | rejectInvalidResourceNames | a key that is not `cpu`/`memory`/`ephemeral-storage`, `hugepages-<positive size>`, or a vendor-prefixed qualified name outside `kubernetes.io/` |
//! | `provider_resource_quantities_non_negative` | rejectNegativeResourceQuantities | a negative (or unparsable) quantity |
//! | `provider_resource_limits_cover_requests` | rejectResourceLimitsBelowRequests | cpu/memory/ephemeral-storage limit < request; hugepages/extended limit ≠ request |
//! | `provider_resource_requests_only_overcommittable` | rejectRequestsOnlyForNonOvercommittableResources | a hugepages/extended request without a limit |
//! | `provider_resource_claims_unsupported` | rejectResourceClaims | non-empty `resources.claims` (DRA not wired) |
//! | `provider_extended_resources_integral` | rejectFractionalExtendedResources | a fractional extended resource (`nvidia.com/gpu: 500m`) |
//! | `provider_hugepages_aligned` | rejectMisalignedHugepageQuantities | a positive hugepages quantity that is not a multiple of the page size |
//!
//! Each rule looks only at keys the earlier rules accept (a bad name or a bad quantity is
//! reported once, by its own rule).

use std::collections::BTreeMap;

use ic_shared::crd::CacheBackend;
use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

use super::quantity::Quantity;
use super::{path, Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![
        Box::new(ProviderResourceNamesValid),
        Box::new(ProviderResourceQuantitiesNonNegative),
        Box::new(ProviderResourceLimitsCoverRequests),
        Box::new(ProviderResourceRequestsOnlyOvercommittable),
        Box::new(ProviderResourceClaimsUnsupported),
        Box::new(ProviderExtendedResourcesIntegral),
        Box::new(ProviderHugepagesAligned),
    ]
}

/// What kind of container resource a name is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResourceClass {
    /// `cpu`, `memory`, `ephemeral-storage` (overcommittable).
    Standard,
    /// `hugepages-<size>` with its page size.
    Hugepages(Quantity),
    /// A vendor-prefixed extended resource (`nvidia.com/gpu`).
    Extended,
    /// Not a valid container resource name; the reason.
    Invalid(&'static str),
}

impl ResourceClass {
    /// Whether limits may exceed requests for this resource.
    pub fn overcommittable(&self) -> bool {
        matches!(self, ResourceClass::Standard)
    }
}

/// Classifies a resource name as the apiserver's container-resource validation does.
pub fn classify(name: &str) -> ResourceClass {
    match name {
        "cpu" | "memory" | "ephemeral-storage" => return ResourceClass::Standard,
        _ => {}
    }
    if let Some(size) = name.strip_prefix("hugepages-") {
        return match Quantity::parse(size) {
            Ok(q) if q.is_positive() => ResourceClass::Hugepages(q),
            _ => ResourceClass::Invalid(
                "a hugepages resource needs a positive page size, e.g. hugepages-2Mi",
            ),
        };
    }
    if name.contains("kubernetes.io/") {
        return ResourceClass::Invalid(
            "the kubernetes.io/ and requests.kubernetes.io/ prefixes are reserved for native \
             resources",
        );
    }
    if name.contains('/') {
        return if is_qualified_name(name) {
            ResourceClass::Extended
        } else {
            ResourceClass::Invalid(
                "an extended resource must be a qualified name such as nvidia.com/gpu",
            )
        };
    }
    ResourceClass::Invalid(
        "must be cpu, memory, ephemeral-storage, hugepages-<size>, or a vendor-prefixed extended \
         resource such as nvidia.com/gpu",
    )
}

/// Kubernetes `IsQualifiedName`: `<dns-subdomain>/<name>` with a 1–63 character name of
/// alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
pub fn is_qualified_name(s: &str) -> bool {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix {
        if !is_dns1123_subdomain(p) {
            return false;
        }
    }
    let bytes = name.as_bytes();
    !name.is_empty()
        && name.len() <= 63
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !label.is_empty()
                && b.first()
                    .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                && b.last()
                    .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

/// The selected provider's resource block and its field path
/// (`spec.remoteStorage.<provider>.resources`).
pub fn selected_resources(cb: &CacheBackend) -> Option<(String, &ResourceRequirements)> {
    let rs = cb.spec.remote_storage.as_ref()?;
    let res = match rs.provider {
        ic_shared::crd::RemoteProvider::Redis => rs.redis.as_ref()?.resources.as_ref()?,
        ic_shared::crd::RemoteProvider::LMCacheServer => {
            rs.lm_cache_server.as_ref()?.resources.as_ref()?
        }
        ic_shared::crd::RemoteProvider::Mooncake => rs.mooncake.as_ref()?.resources.as_ref()?,
    };
    Some((
        format!("{}.resources", path::provider_block(rs.provider)),
        res,
    ))
}

/// One well-formed entry: valid name, parsable non-negative quantity.
struct Entry<'a> {
    name: &'a str,
    raw: &'a str,
    class: ResourceClass,
    q: Quantity,
}

fn entries(map: Option<&BTreeMap<String, K8sQuantity>>) -> Vec<Entry<'_>> {
    map.into_iter()
        .flatten()
        .filter_map(|(name, raw)| {
            let class = classify(name);
            if matches!(class, ResourceClass::Invalid(_)) {
                return None;
            }
            let q = Quantity::parse(&raw.0).ok().filter(|q| !q.is_negative())?;
            Some(Entry {
                name,
                raw: &raw.0,
                class,
                q,
            })
        })
        .collect()
}

fn both_maps(
    res: &ResourceRequirements,
) -> [(&'static str, Option<&BTreeMap<String, K8sQuantity>>); 2] {
    [
        ("requests", res.requests.as_ref()),
        ("limits", res.limits.as_ref()),
    ]
}

/// Rule `provider_resource_names_valid` (rejectInvalidResourceNames).
pub struct ProviderResourceNamesValid;

impl Rule for ProviderResourceNamesValid {
    fn name(&self) -> &'static str {
        "provider_resource_names_valid"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (which, map) in both_maps(res) {
            for name in map.into_iter().flat_map(|m| m.keys()) {
                if let ResourceClass::Invalid(why) = classify(name) {
                    out.push(Violation::invalid(
                        path::key(&format!("{base}.{which}"), name),
                        name,
                        why,
                    ));
                }
            }
        }
        out
    }
}

/// Rule `provider_resource_quantities_non_negative` (rejectNegativeResourceQuantities; also
/// reports quantities that do not parse).
pub struct ProviderResourceQuantitiesNonNegative;

impl Rule for ProviderResourceQuantitiesNonNegative {
    fn name(&self) -> &'static str {
        "provider_resource_quantities_non_negative"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (which, map) in both_maps(res) {
            for (name, raw) in map.into_iter().flatten() {
                let field = path::key(&format!("{base}.{which}"), name);
                match Quantity::parse(&raw.0) {
                    Err(e) => out.push(Violation::invalid(field, &raw.0, e.to_string())),
                    Ok(q) if q.is_negative() => out.push(Violation::invalid(
                        field,
                        &raw.0,
                        "must be greater than or equal to 0",
                    )),
                    Ok(_) => {}
                }
            }
        }
        out
    }
}

/// Rule `provider_resource_limits_cover_requests` (rejectResourceLimitsBelowRequests):
/// overcommittable resources need limit ≥ request; hugepages and extended resources need
/// limit = request, when both are set.
pub struct ProviderResourceLimitsCoverRequests;

impl Rule for ProviderResourceLimitsCoverRequests {
    fn name(&self) -> &'static str {
        "provider_resource_limits_cover_requests"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        let limits = entries(res.limits.as_ref());
        let mut out = Vec::new();
        for req in entries(res.requests.as_ref()) {
            let Some(lim) = limits.iter().find(|l| l.name == req.name) else {
                continue;
            };
            let field = path::key(&format!("{base}.requests"), req.name);
            if req.class.overcommittable() {
                if req.q > lim.q {
                    out.push(Violation::invalid(
                        field,
                        req.raw,
                        format!(
                            "must be less than or equal to {} limit of {}",
                            req.name, lim.raw
                        ),
                    ));
                }
            } else if req.q != lim.q {
                out.push(Violation::invalid(
                    field,
                    req.raw,
                    format!(
                        "must be equal to {} limit of {} (hugepages and extended resources cannot \
                         be overcommitted)",
                        req.name, lim.raw
                    ),
                ));
            }
        }
        out
    }
}

/// Rule `provider_resource_requests_only_overcommittable`
/// (rejectRequestsOnlyForNonOvercommittableResources): a hugepages or extended resource in
/// `requests` needs the matching `limits` entry.
pub struct ProviderResourceRequestsOnlyOvercommittable;

impl Rule for ProviderResourceRequestsOnlyOvercommittable {
    fn name(&self) -> &'static str {
        "provider_resource_requests_only_overcommittable"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        let limits = res.limits.as_ref();
        let mut out = Vec::new();
        for name in res.requests.iter().flat_map(|m| m.keys()) {
            let class = classify(name);
            if class.overcommittable() || matches!(class, ResourceClass::Invalid(_)) {
                continue;
            }
            if limits.is_none_or(|l| !l.contains_key(name)) {
                out.push(Violation::required(
                    path::key(&format!("{base}.limits"), name),
                    format!(
                        "Limit must be set for non overcommitable resources: {name} is requested \
                         without a matching limit"
                    ),
                ));
            }
        }
        out
    }
}

/// Rule `provider_resource_claims_unsupported` (rejectResourceClaims): the renderer does not
/// create pod-level `spec.resourceClaims`, so container claims cannot resolve.
pub struct ProviderResourceClaimsUnsupported;

impl Rule for ProviderResourceClaimsUnsupported {
    fn name(&self) -> &'static str {
        "provider_resource_claims_unsupported"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        match &res.claims {
            Some(claims) if !claims.is_empty() => {
                let names: Vec<&str> = claims.iter().map(|c| c.name.as_str()).collect();
                vec![Violation::forbidden(
                    format!("{base}.claims"),
                    format!(
                        "Dynamic Resource Allocation claims are not supported on managed provider \
                         workloads (no pod-level resourceClaims are rendered): {}",
                        names.join(", ")
                    ),
                )]
            }
            _ => Vec::new(),
        }
    }
}

/// Rule `provider_extended_resources_integral` (rejectFractionalExtendedResources).
pub struct ProviderExtendedResourcesIntegral;

impl Rule for ProviderExtendedResourcesIntegral {
    fn name(&self) -> &'static str {
        "provider_extended_resources_integral"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (which, map) in both_maps(res) {
            for e in entries(map) {
                if e.class == ResourceClass::Extended && !e.q.is_integer() {
                    out.push(Violation::invalid(
                        path::key(&format!("{base}.{which}"), e.name),
                        e.raw,
                        "must be an integer (extended resources are allocated in whole units)",
                    ));
                }
            }
        }
        out
    }
}

/// Rule `provider_hugepages_aligned` (rejectMisalignedHugepageQuantities).
pub struct ProviderHugepagesAligned;

impl Rule for ProviderHugepagesAligned {
    fn name(&self) -> &'static str {
        "provider_hugepages_aligned"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let Some((base, res)) = selected_resources(cb) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (which, map) in both_maps(res) {
            for e in entries(map) {
                if let ResourceClass::Hugepages(page) = e.class {
                    if e.q.is_positive() && !e.q.is_multiple_of(page) {
                        let size = e.name.trim_start_matches("hugepages-");
                        out.push(Violation::invalid(
                            path::key(&format!("{base}.{which}"), e.name),
                            e.raw,
                            format!("must be a whole multiple of the {size} page size"),
                        ));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_names() {
        assert_eq!(classify("memory"), ResourceClass::Standard);
        assert!(matches!(
            classify("hugepages-2Mi"),
            ResourceClass::Hugepages(_)
        ));
        assert!(matches!(classify("hugepages-"), ResourceClass::Invalid(_)));
        assert!(matches!(
            classify("hugepages-nope"),
            ResourceClass::Invalid(_)
        ));
        assert_eq!(classify("nvidia.com/gpu"), ResourceClass::Extended);
        assert!(matches!(classify("foo"), ResourceClass::Invalid(_)));
        assert!(matches!(classify(""), ResourceClass::Invalid(_)));
        assert!(matches!(
            classify("kubernetes.io/foo"),
            ResourceClass::Invalid(_)
        ));
        assert!(matches!(
            classify("requests.kubernetes.io/foo"),
            ResourceClass::Invalid(_)
        ));
        assert!(matches!(
            classify("Nvidia.com/gpu"),
            ResourceClass::Invalid(_)
        ));
        assert!(matches!(
            classify("nvidia.com/-gpu"),
            ResourceClass::Invalid(_)
        ));
    }
}
