//! The engine pod's self-description, read in one place (issue 42 Deliver 1): which container
//! runs the engine ([`container::select_engine_container`], read once into a
//! [`container::EnginePod`]), its command line ([`command::EngineCommand`]), what its flags mean
//! ([`flags`]: block size, tensor- and data-parallel sizes and ranks, the HTTP/metrics port;
//! [`kv_events`]: the `--kv-events-config` publisher and replay endpoints), plus the pod facts
//! they are read with (pod IP, host network, `/dev/shm`, the webhook's own sidecar).
//!
//! This module sits below the Pod webhook ([`crate::admission`]), the runtime adapters
//! ([`crate::adapters`]) and the node plans ([`crate::reconcile::nodes::plans`]); it imports none
//! of them, and none of them reads an engine flag's value itself: admission and the node plan
//! derive the same block size, ranks and endpoints because both ask this module. (The adapters
//! still *write* the flags they inject through [`command::Edit`].)

use k8s_openapi::api::core::v1::Pod;

pub mod command;
pub mod container;
pub mod flags;
pub mod kv_events;

/// Minimum `/dev/shm` for an engine with tensor parallelism above 1 (NCCL's shared-memory
/// transport; the container default of 64 MiB is far too small): 1 GiB.
pub const TENSOR_PARALLEL_SHM_BYTES: u64 = 1 << 30;
/// Name of the kvevent-subscriber sidecar the Pod webhook renders (a regular container: no
/// Kubernetes version floor); rank r > 0's is `kvevent-subscriber-r`.
pub const SUBSCRIBER_CONTAINER: &str = "kvevent-subscriber";

/// True when the webhook rendered a kvevent-subscriber sidecar into `pod` (rank 0's
/// `kvevent-subscriber`, rank r's `kvevent-subscriber-r`).
pub fn has_subscriber_sidecar(pod: &Pod) -> bool {
    let name = SUBSCRIBER_CONTAINER;
    pod.spec.iter().flat_map(|s| &s.containers).any(|c| {
        c.name == name
            || c.name
                .strip_prefix(name)
                .and_then(|r| r.strip_prefix('-'))
                .is_some_and(|r| r.parse::<u32>().is_ok())
    })
}

/// Whether `pod` runs in the node's network namespace (`spec.hostNetwork`).
pub fn host_network(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
}

/// The pod's IP from its status (`None` until it has one).
pub fn pod_ip(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .filter(|ip| !ip.is_empty())
}
