//! The kvevent-subscriber sidecars the Pod webhook renders (DESIGN.md "Where our structure
//! differs"): one per data-parallel rank the engine publishes, with the block size, hash scheme
//! and offload facts they index by, the projected token they authenticate with, and their
//! removal when the engine no longer publishes a rank.

use std::collections::BTreeMap;

use ic_shared::crd::Runtime;
use k8s_openapi::api::core::v1::{
    Container, EnvVar, EnvVarSource, ObjectFieldSelector, Pod, ProjectedVolumeSource,
    ResourceRequirements, ServiceAccountTokenProjection, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::adapters::converge::converge_rendered;
use crate::adapters::{env_var, hardened_security_context, is_rendered};
use crate::admission::host_ports::Listener;
use crate::admission::kv_topology::{subscriber_topology, OtherListeners};
use crate::engine::command::EngineCommand;
use crate::engine::container::ENV_COMPONENT;
use crate::engine::flags as engine_flags;
use crate::engine::SUBSCRIBER_CONTAINER;

use super::{
    PodWebhookConfig, Unwired, SUBSCRIBER_TOKEN_DIR, SUBSCRIBER_TOKEN_EXPIRATION_SECONDS,
    SUBSCRIBER_TOKEN_VOLUME,
};

/// The block size the kvevent-subscriber chains at: the engine's own
/// ([`engine_flags::engine_block_size`] over its literal arguments — the node plan's rule). The
/// subscriber treats a block shorter than it as partial and does not index it, so a wrong value
/// either drops every block (an SGLang engine at its default page size 1 against the
/// subscriber's default 16) or splits one block into several keys. When the flag's value is a
/// shell expansion the engine's default is used and a warning says so.
fn subscriber_block_size(
    pod: &Pod,
    engine: Option<usize>,
    runtime: Runtime,
    warnings: &mut Vec<String>,
) -> u32 {
    let engine_c = engine.and_then(|i| pod.spec.as_ref().and_then(|s| s.containers.get(i)));
    let Some(cmd) = engine_c.and_then(|c| EngineCommand::parse(c, runtime).ok()) else {
        return engine_flags::engine_block_size(runtime, &[]);
    };
    let flag = engine_flags::block_size_flag(runtime);
    let unknown = engine_flags::unknown_block_size(&cmd, runtime);
    let size = if unknown.is_some() {
        engine_flags::engine_block_size(runtime, &[])
    } else {
        engine_flags::engine_block_size(runtime, &cmd.literal_texts())
    };
    if let Some(raw) = unknown {
        warnings.push(format!(
            "container {:?}: {flag} {raw:?} is not a literal number at admission; the kvevent-subscriber assumes the engine default of {size} tokens per block (events that carry their own block_size are split by it, but blocks shorter than {size} are not indexed): write the value literally",
            cmd.container
        ));
    }
    size
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: path.to_string(),
            }),
            ..Default::default()
        }),
    }
}

/// Env names the kvevent-subscriber rendering owns (others' additions to it are kept).
const SUBSCRIBER_ENV: &[&str] = &[ENV_COMPONENT, "POD_NAME", "POD_NAMESPACE", "NODE_NAME"];

/// Name of the subscriber container of data-parallel rank `rank`: [`SUBSCRIBER_CONTAINER`] for
/// rank 0, `kvevent-subscriber-<rank>` otherwise.
pub fn subscriber_container_name(rank: u32) -> String {
    if rank == 0 {
        SUBSCRIBER_CONTAINER.to_string()
    } else {
        format!("{SUBSCRIBER_CONTAINER}-{rank}")
    }
}

/// Removes the rendered subscriber containers whose names are not in `keep`.
pub(super) fn remove_subscribers(pod: &mut Pod, keep: &[String]) {
    if let Some(spec) = pod.spec.as_mut() {
        spec.containers
            .retain(|c| !is_rendered(c, SUBSCRIBER_CONTAINER) || keep.contains(&c.name));
    }
}

/// What a kvevent-subscriber sidecar of a pod wired for offload (integration mode Offload)
/// is told about the offload tier.
#[derive(Debug, Clone, Copy)]
pub(super) struct Offload {
    /// Tokens per chunk the tier loads whole (LMCache's `chunk_size`), `--offload-chunk-tokens`;
    /// `None` for a tier without chunks.
    pub(super) chunk_tokens: Option<u32>,
}

/// Appends (or converges) one kvevent-subscriber sidecar per data-parallel rank the engine
/// publishes ([`subscriber_topology`]): the agent binary in per-pod mode, `--endpoint` and
/// `--replay` of that rank, `--data-parallel-rank` above 0, `--hash-scheme` from the runtime,
/// `--block-size` from the engine's own ([`subscriber_block_size`]),
/// `--ignore-block-removed=true` in Offload mode (and `--offload-chunk-tokens` with LMCache's
/// chunk size, [`crate::adapters::lmcache_chunk_tokens`]), tenant = pod namespace, replica id = pod name
/// (downward API). Each sidecar mounts a projected service-account token (audience
/// `inference-cache`, 1 h) read-only at [`SUBSCRIBER_TOKEN_DIR`], which the controller verifies
/// as the pod's own ([`crate::ingest::auth`], per-pod subscribers); the volume is added unless
/// the pod already has one named [`SUBSCRIBER_TOKEN_VOLUME`]. A re-admission converges only
/// the fields the webhook owns ([`converge_rendered`]).
///
/// When the engine's publishers cannot be followed, an Offload pod is wired without a
/// subscriber (the reason becomes a warning) and an events-only pod is left unwired. Returns
/// the engine listeners the streams depend on (for host-port declarations).
#[allow(clippy::too_many_arguments)]
pub(super) fn add_subscribers(
    pod: &mut Pod,
    engine: Option<usize>,
    runtime: Runtime,
    image: &str,
    model: &str,
    offload: Option<Offload>,
    cfg: &PodWebhookConfig,
    others: &OtherListeners,
    warnings: &mut Vec<String>,
) -> Result<Vec<Listener>, Unwired> {
    let offload_chunk_tokens = offload.and_then(|o| o.chunk_tokens);
    let offload = offload.is_some();
    let topology = match subscriber_topology(pod, engine, runtime, others) {
        Ok(t) => t,
        Err(u) if offload => {
            warnings.push(format!(
                "the kvevent-subscriber is not added: {u}; the pod is wired for offload, its KV events are not followed"
            ));
            remove_subscribers(pod, &[]);
            return Ok(Vec::new());
        }
        Err(u) => return Err(Unwired::loud(u.to_string())),
    };
    warnings.extend(topology.warnings.iter().cloned());
    let scheme = match runtime {
        Runtime::Vllm => "vllm",
        Runtime::SgLang => "sglang",
    };
    let names: Vec<String> = topology
        .streams
        .iter()
        .map(|s| subscriber_container_name(s.rank))
        .collect();
    let Some(spec) = pod.spec.as_mut() else {
        return Err(Unwired::from("the pod has no spec"));
    };
    for name in &names {
        if spec
            .init_containers
            .iter()
            .flatten()
            .any(|c| &c.name == name)
        {
            return Err(Unwired::from(format!(
                "the pod already has a init container named {name:?} that inference-cache did not render; rename it to get the pod wired"
            )));
        }
        if spec
            .containers
            .iter()
            .any(|c| &c.name == name && !is_rendered(c, SUBSCRIBER_CONTAINER))
        {
            return Err(Unwired::from(format!(
                "the pod already has a container named {name:?} that inference-cache did not render; rename it to get the pod wired"
            )));
        }
    }
    let block_size = subscriber_block_size(pod, engine, runtime, warnings);
    remove_subscribers(pod, &names);
    let Some(spec) = pod.spec.as_mut() else {
        return Err(Unwired::from("the pod has no spec"));
    };
    for (stream, name) in topology.streams.iter().zip(&names) {
        let mut args = vec![
            "subscribe".to_string(),
            format!("--endpoint={}", stream.endpoint),
        ];
        if stream.bind {
            args.push("--bind".to_string());
        }
        if let Some(r) = &stream.replay {
            args.push(format!("--replay={r}"));
        }
        if stream.rank > 0 {
            args.push(format!("--data-parallel-rank={}", stream.rank));
        }
        args.extend([
            format!("--hash-scheme={scheme}"),
            format!("--block-size={block_size}"),
            format!("--model-id={model}"),
            "--tenant=$(POD_NAMESPACE)".to_string(),
            "--replica-id=$(POD_NAME)".to_string(),
        ]);
        if offload {
            args.push("--ignore-block-removed=true".to_string());
        }
        if let Some(chunk) = offload_chunk_tokens {
            args.push(format!("--offload-chunk-tokens={chunk}"));
        }
        if let Some(ctl) = cfg.kvevent_subscriber_controller.as_deref() {
            args.push(format!("--controller={ctl}"));
        }
        let sidecar = Container {
            name: name.clone(),
            image: Some(image.to_string()),
            args: Some(args),
            env: Some(vec![
                env_var(ENV_COMPONENT, SUBSCRIBER_CONTAINER),
                field_env("POD_NAME", "metadata.name"),
                field_env("POD_NAMESPACE", "metadata.namespace"),
                field_env("NODE_NAME", "spec.nodeName"),
            ]),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".to_string(), Quantity("10m".to_string())),
                    ("memory".to_string(), Quantity("32Mi".to_string())),
                ])),
                ..Default::default()
            }),
            security_context: Some(hardened_security_context()),
            volume_mounts: Some(vec![VolumeMount {
                name: SUBSCRIBER_TOKEN_VOLUME.to_string(),
                mount_path: SUBSCRIBER_TOKEN_DIR.to_string(),
                read_only: Some(true),
                ..Default::default()
            }]),
            ..Default::default()
        };
        match spec.containers.iter_mut().find(|c| &c.name == name) {
            Some(existing) => *existing = converge_rendered(existing, sidecar, SUBSCRIBER_ENV),
            None => spec.containers.push(sidecar),
        }
    }
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    if !volumes.iter().any(|v| v.name == SUBSCRIBER_TOKEN_VOLUME) {
        volumes.push(subscriber_token_volume());
    }
    Ok(topology.engine_listeners)
}

/// The sidecar's projected token: audience `inference-cache`, file `token`.
fn subscriber_token_volume() -> Volume {
    Volume {
        name: SUBSCRIBER_TOKEN_VOLUME.to_string(),
        projected: Some(ProjectedVolumeSource {
            default_mode: None,
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(crate::ingest::auth::DEFAULT_AUDIENCE.to_string()),
                    expiration_seconds: Some(SUBSCRIBER_TOKEN_EXPIRATION_SECONDS),
                    path: "token".to_string(),
                }),
                ..Default::default()
            }]),
        }),
        ..Default::default()
    }
}
