//! Pure naming: digests, the binding identity, and the deterministic names of every object a
//! binding owns (spec 004 "Cache binding", "Terms").
//!
//! | object | namespace | name |
//! |---|---|---|
//! | binding | control | `mcb-<identity 16 hex>-<generation>` |
//! | writer claim | writer (request ns for `regularModelCache`, control for `helmModelCache`) | `<binding>-writer` |
//! | writer Job | writer | `<binding>-writer` |
//! | writer Lease | control | `<binding>-writer` |
//! | reader claim | each reader namespace | `<binding>-reader` |
//! | reader PV | cluster | `<binding>-r-<first 10 hex of SHA-256(namespace)>` |
//! | key Secret (encrypted) | control | `<binding>-key` |
//! | derived StorageClass (encrypted) | cluster | `<binding>-enc` |
//!
//! Names are at most 53 characters for bindings up to generation 999 999.

use ic_shared::crd::{
    BindingIdentity, BindingResources, ModelCache, ModelCacheBinding, ModelSource, NamespacedName,
    Workflow,
};

use crate::catalog::sha256_hex;

/// SHA-256 (hex) of the cache handle: the canonical JSON `{"revision":…,"uri":…}` of the
/// source. Another revision is another cache.
pub fn cache_handle_digest(source: &ModelSource) -> String {
    let canonical = serde_json::json!({"revision": source.revision, "uri": source.uri});
    sha256_hex(canonical.to_string().as_bytes())
}

/// SHA-256 (hex) of a sharing domain.
pub fn sharing_domain_digest(domain: &str) -> String {
    sha256_hex(domain.as_bytes())
}

/// The binding identity of a request: workflow, sharing-domain digest, cache-handle digest.
pub fn identity_for(mc: &ModelCache) -> BindingIdentity {
    BindingIdentity {
        workflow: mc.spec.workflow,
        sharing_domain_digest: sharing_domain_digest(&mc.sharing_domain()),
        cache_handle_digest: cache_handle_digest(&mc.spec.source),
    }
}

/// The identity label value: the first 32 hex characters of SHA-256 over
/// `workflow \n sharing-domain digest \n cache-handle digest` (a label value holds at most 63).
pub fn identity_label(identity: &BindingIdentity) -> String {
    let text = format!(
        "{}\n{}\n{}",
        identity.workflow.as_str(),
        identity.sharing_domain_digest,
        identity.cache_handle_digest
    );
    sha256_hex(text.as_bytes())[..32].to_string()
}

/// Name of generation `generation` (1, 2, …) of the binding for `identity`:
/// `mcb-<first 16 hex of the identity label>-<generation>`. A new generation is made only when
/// every earlier one is `Retiring` (never joined again).
pub fn binding_name(identity: &BindingIdentity, generation: u32) -> String {
    format!("mcb-{}-{generation}", &identity_label(identity)[..16])
}

/// The generation of a binding name made by [`binding_name`] (`None` for another shape).
pub fn generation_of(name: &str) -> Option<u32> {
    name.rsplit_once('-').and_then(|(_, g)| g.parse().ok())
}

/// The generation a new binding for `identity` takes: one above the highest among `existing`
/// bindings with that identity (1 when there are none).
pub fn next_generation(existing: &[ModelCacheBinding], identity: &BindingIdentity) -> u32 {
    existing
        .iter()
        .filter(|b| &b.spec.identity == identity)
        .filter_map(|b| b.metadata.name.as_deref().and_then(generation_of))
        .max()
        .unwrap_or(0)
        .saturating_add(1)
}

/// Where the writer claim and Job live: the request namespace for `regularModelCache` (readers
/// share it), the control namespace for `helmModelCache`.
pub fn writer_namespace(workflow: Workflow, request_namespace: &str, control: &str) -> String {
    match workflow {
        Workflow::RegularModelCache => request_namespace.to_string(),
        Workflow::HelmModelCache => control.to_string(),
    }
}

/// `<binding>-writer`: writer claim, Job and Lease.
pub fn writer_name(binding: &str) -> String {
    format!("{binding}-writer")
}

/// `<binding>-reader`: the reader claim in every reader namespace.
pub fn reader_claim(binding: &str) -> String {
    format!("{binding}-reader")
}

/// `<binding>-r-<10 hex>`: the reader PV for `namespace`.
pub fn reader_pv(binding: &str, namespace: &str) -> String {
    format!("{binding}-r-{}", &sha256_hex(namespace.as_bytes())[..10])
}

/// `<binding>-key`: the key Secret of an encrypted cache.
pub fn key_secret(binding: &str) -> String {
    format!("{binding}-key")
}

/// `<binding>-enc`: the derived StorageClass of an encrypted cache.
pub fn encrypted_class(binding: &str) -> String {
    format!("{binding}-enc")
}

/// The reader objects (claim and PV) of `namespaces`.
pub fn reader_resources(binding: &str, namespaces: &[String]) -> BindingResources {
    BindingResources {
        persistent_volume_claims: namespaces
            .iter()
            .map(|ns| NamespacedName::new(ns.clone(), reader_claim(binding)))
            .collect(),
        persistent_volumes: namespaces.iter().map(|ns| reader_pv(binding, ns)).collect(),
        ..Default::default()
    }
}

/// Every object a new binding owns: reader objects of `reader_namespaces` first (released
/// first), the writer claim, Job and Lease, and for an encrypted cache the key Secret and
/// derived StorageClass.
pub fn initial_resources(
    binding: &str,
    writer_ns: &str,
    control_ns: &str,
    reader_namespaces: &[String],
    encrypted: bool,
) -> BindingResources {
    let mut r = reader_resources(binding, reader_namespaces);
    r.persistent_volume_claims
        .push(NamespacedName::new(writer_ns, writer_name(binding)));
    r.jobs = vec![NamespacedName::new(writer_ns, writer_name(binding))];
    r.lease = Some(NamespacedName::new(control_ns, writer_name(binding)));
    if encrypted {
        r.secrets = vec![NamespacedName::new(control_ns, key_secret(binding))];
        r.storage_classes = vec![encrypted_class(binding)];
    }
    r
}

/// The reader objects of `namespaces` that `binding` does not name yet (a later
/// `helmModelCache` request with new reader namespaces); empty when all are named.
pub fn missing_reader_resources(
    binding: &ModelCacheBinding,
    namespaces: &[String],
) -> BindingResources {
    let name = binding.metadata.name.clone().unwrap_or_default();
    let all = binding.all_resources();
    let missing: Vec<String> = namespaces
        .iter()
        .filter(|ns| {
            !all.persistent_volumes.contains(&reader_pv(&name, ns))
                || !all
                    .persistent_volume_claims
                    .contains(&NamespacedName::new(ns.as_str(), reader_claim(&name)))
        })
        .cloned()
        .collect();
    reader_resources(&name, &missing)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn id() -> BindingIdentity {
        BindingIdentity {
            workflow: Workflow::HelmModelCache,
            sharing_domain_digest: sharing_domain_digest("org"),
            cache_handle_digest: cache_handle_digest(&ModelSource {
                uri: "hf://a/b".into(),
                revision: "r1".into(),
            }),
        }
    }

    #[test]
    fn names_are_deterministic_and_bounded() {
        let n = binding_name(&id(), 1);
        assert!(n.starts_with("mcb-") && n.ends_with("-1"), "{n}");
        assert_eq!(n, binding_name(&id(), 1));
        assert_eq!(generation_of(&n), Some(1));
        let long = binding_name(&id(), 999_999);
        assert!(reader_pv(&long, "a-very-long-namespace-name").len() <= 63);
        assert_eq!(identity_label(&id()).len(), 32);
    }

    #[test]
    fn revision_and_domain_change_the_identity() {
        let mut other = id();
        other.cache_handle_digest = cache_handle_digest(&ModelSource {
            uri: "hf://a/b".into(),
            revision: "r2".into(),
        });
        assert_ne!(binding_name(&id(), 1), binding_name(&other, 1));
        let mut other = id();
        other.sharing_domain_digest = sharing_domain_digest("other");
        assert_ne!(identity_label(&id()), identity_label(&other));
    }

    #[test]
    fn initial_resources_name_everything() {
        let r = initial_resources("b", "ctl", "ctl", &["x".into(), "y".into()], true);
        assert_eq!(r.persistent_volume_claims.len(), 3);
        assert_eq!(r.persistent_volumes.len(), 2);
        assert_eq!(r.jobs, vec![NamespacedName::new("ctl", "b-writer")]);
        assert_eq!(r.secrets, vec![NamespacedName::new("ctl", "b-key")]);
        assert_eq!(r.storage_classes, vec!["b-enc".to_string()]);
    }
}
