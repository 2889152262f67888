//! Node-plan entries for model-cache readers (issue 8 deliverable 6; DESIGN.md "Node plans").
//!
//! Every running pod that reads a bound cache — it names a `durable` `ModelCache` in the
//! [`annotations::MODEL_CACHE`] annotation and mounts that request's reader claim through the
//! `model-data` volume — becomes one [`ReaderMount`] per distinct mount path in the plan of the
//! node it runs on. The agent's `mounts` check then proves on that node that the volume is
//! mounted read-only (every write probe refused with `EROFS`), so a writable or mismatched
//! reader shows up on the CacheNode.

use std::collections::BTreeMap;

use ic_shared::crd::{annotations, CacheMode, ModelCache, MODEL_DATA_VOLUME};
use ic_shared::plan::{PlannedContainer, ReaderMount};
use k8s_openapi::api::core::v1::Pod;

use crate::reconcile::nodes::plans::planned_container;

/// Resolves a pod's [`annotations::MODEL_CACHE`] value to `(namespace, name)`: `<name>` is in
/// the pod's namespace, `<namespace>/<name>` names another. `None` without the annotation or
/// for an empty or malformed value.
pub fn requested_cache(pod: &Pod) -> Option<(String, String)> {
    let value = pod
        .metadata
        .annotations
        .as_ref()?
        .get(annotations::MODEL_CACHE)?
        .trim();
    let pod_ns = pod.metadata.namespace.clone().unwrap_or_default();
    match value.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Some((ns.to_string(), name.to_string()))
        }
        None if !value.is_empty() => Some((pod_ns, value.to_string())),
        _ => None,
    }
}

/// Maps bound caches and pods to reader mounts, keyed by node name (sorted; entries in pod
/// order). `control_namespace` qualifies the binding name in [`ReaderMount::binding`].
///
/// A pod counts when it is scheduled (`spec.nodeName`), not finished (`Succeeded`/`Failed`),
/// names a cache found in `caches` whose `status.mode` is `durable` with a binding and a reader
/// claim, runs in one of that cache's `status.readerNamespaces`, and has a `model-data` volume
/// on that claim. Each distinct `mountPath` of `model-data` among its containers (init
/// containers included) is one entry; `expectReadOnly` is always true.
pub fn reader_mounts(
    caches: &[ModelCache],
    pods: &[Pod],
    control_namespace: &str,
) -> BTreeMap<String, Vec<ReaderMount>> {
    let by_name: BTreeMap<(String, String), &ModelCache> = caches
        .iter()
        .map(|c| {
            (
                (
                    c.metadata.namespace.clone().unwrap_or_default(),
                    c.metadata.name.clone().unwrap_or_default(),
                ),
                c,
            )
        })
        .collect();
    let mut out: BTreeMap<String, Vec<ReaderMount>> = BTreeMap::new();
    for pod in pods {
        let Some(spec) = pod.spec.as_ref() else {
            continue;
        };
        let Some(node) = spec.node_name.clone().filter(|n| !n.is_empty()) else {
            continue;
        };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let Some(key) = requested_cache(pod) else {
            continue;
        };
        let Some(cache) = by_name.get(&key) else {
            continue;
        };
        let Some(status) = cache.status.as_ref() else {
            continue;
        };
        let (Some(CacheMode::Durable), Some(binding), Some(claim)) = (
            status.mode,
            status.binding.as_ref(),
            status.reader_claim.as_ref(),
        ) else {
            continue;
        };
        let pod_ns = pod.metadata.namespace.clone().unwrap_or_default();
        if !status.reader_namespaces.contains(&pod_ns) {
            continue;
        }
        let on_claim = spec.volumes.as_ref().is_some_and(|vs| {
            vs.iter().any(|v| {
                v.name == MODEL_DATA_VOLUME
                    && v.persistent_volume_claim
                        .as_ref()
                        .is_some_and(|p| &p.claim_name == claim)
            })
        });
        if !on_claim {
            continue;
        }
        // Main containers and native sidecars (init containers with restartPolicy Always): a
        // plain init container has exited once the pod runs, so its paths are never mounted.
        let mut paths: BTreeMap<String, Vec<PlannedContainer>> = BTreeMap::new();
        let running = spec.containers.iter().chain(
            spec.init_containers
                .iter()
                .flatten()
                .filter(|c| c.restart_policy.as_deref() == Some("Always")),
        );
        for c in running {
            for m in c.volume_mounts.iter().flatten() {
                if m.name == MODEL_DATA_VOLUME {
                    paths
                        .entry(m.mount_path.clone())
                        .or_default()
                        .push(planned_container(pod, &c.name));
                }
            }
        }
        for (path, containers) in paths {
            out.entry(node.clone()).or_default().push(ReaderMount {
                namespace: pod_ns.clone(),
                pod: pod.metadata.name.clone().unwrap_or_default(),
                pod_uid: pod.metadata.uid.clone(),
                path,
                expect_read_only: true,
                samples: Vec::new(),
                binding: format!("{control_namespace}/{}", binding.name),
                containers,
            });
        }
    }
    out
}
