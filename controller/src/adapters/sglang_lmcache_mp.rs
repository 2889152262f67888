//! (SGLang, LMCache): LMCache multiprocess (MP) mode (spec 000 "SGLang engine support", "SGLang
//! LMCache MP mode", "Names the MP wire reserves on the engine pod").
//!
//! SGLang reads LMCache's config only from `--lmcache-config-file` (carrying `mp_host`/`mp_port`)
//! and attaches to a node-local MP worker over ZMQ plus a shared-memory data path. The adapter
//! renders, and converges on:
//!
//! - on the engine container: `--enable-lmcache`, `--lmcache-config-file
//!   /etc/lmcache/lmcache.yaml`, `LMCACHE_USE_EXPERIMENTAL=True`, `INFERENCECACHE_FAIL_OPEN`,
//!   a read-only mount of `lmcache-config` at `/etc/lmcache`, and `/dev/shm`: the engine's own
//!   `/dev/shm` volume is reused whatever its name, else an `lmcache-dshm` memory emptyDir
//!   (sized to the L1 allocation + 1 GiB) is added and mounted;
//! - the `lmcache-mp-worker` native sidecar (an init container with `restartPolicy: Always`): it
//!   writes the config file into the shared `lmcache-config` emptyDir, then execs
//!   `python3 -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port <workerPort>
//!   --chunk-size <chunkSizeTokens> --l1-size-gb <whole GiB of hostMemory.capacity>` plus
//!   `--l2-adapter {"type":"resp","host":…,"port":…}` with a RESP binding; an exec startup probe
//!   on the loopback ZMQ port gates the engine's start; `NVIDIA_VISIBLE_DEVICES=all` lets the
//!   GPU-less worker CUDA-IPC the engine's device; it runs the engine image (or
//!   `spec.lmCache.workerImage`, or the controller's default) with the engine's security context.
//!
//! Rejected before any change (the webhook admits the pod unwired): an init container or
//! container named `lmcache-mp-worker`, a volume `lmcache-config`/`lmcache-dshm`, or an engine
//! mount at `/etc/lmcache` that this adapter did not render (recognised by
//! `INFERENCECACHE_COMPONENT=lmcache-mp-worker` on the worker); a `/dev/shm` mount that is
//! read-only or comes from a configMap/secret/downwardAPI/projected volume; SGLang HiCache flags
//! already on the engine; a duplicate or malformed `--enable-lmcache`/`--lmcache-config-file`.
//!
//! One concept, kept in one file although it passes 1 000 lines with its tests: this one
//! adapter, everything it renders onto the pod and converges on.

use ic_shared::crd::{CacheType, IntegrationRole, Runtime};
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, ExecAction, Pod, Probe, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{
    engine_image_security_context, engine_mut, engine_ref, env_var, is_rendered, parse_quantity,
    upsert_env, BindingKind, InjectContext, InjectError, InjectReport, RuntimeAdapter,
    ENV_FAIL_OPEN,
};
use crate::engine::command::{Edit, EngineCommand};
use crate::engine::container::{normalize_mount_path, shm_mount, ENV_COMPONENT};

/// Name of the MP worker native sidecar.
pub const WORKER_CONTAINER: &str = "lmcache-mp-worker";
/// Volume carrying the config file.
pub const CONFIG_VOLUME: &str = "lmcache-config";
/// Memory volume added for `/dev/shm` when the engine has none.
pub const DSHM_VOLUME: &str = "lmcache-dshm";
/// Mount path of [`CONFIG_VOLUME`].
pub const CONFIG_DIR: &str = "/etc/lmcache";
/// The config file the engine reads.
pub const CONFIG_FILE: &str = "/etc/lmcache/lmcache.yaml";
/// Env var carrying the rendered config (the worker writes it to [`CONFIG_FILE`]).
pub const ENV_MP_CONFIG: &str = "LMCACHE_MP_CONFIG";

const RESERVED_ARGS: &[&str] = &["--enable-lmcache", "--lmcache-config-file"];
/// Env names the worker rendering owns (others' additions to the worker are kept).
const WORKER_ENV: &[&str] = &[ENV_COMPONENT, "NVIDIA_VISIBLE_DEVICES", ENV_MP_CONFIG];
const RESERVED_ENV: &[&str] = &["LMCACHE_USE_EXPERIMENTAL", ENV_FAIL_OPEN];

/// The (SGLang, LMCache) MP adapter.
pub struct SglangLmCacheMp;

/// How the engine's `/dev/shm` is provided.
#[derive(Debug, Clone, PartialEq)]
enum Shm {
    /// Reuse the engine's own volume (name, subPath).
    Reuse(String, Option<String>),
    /// Render `lmcache-dshm`.
    Render,
}

/// Worker settings derived from the CacheBackend.
struct Render {
    port: i32,
    chunk: i32,
    l1_gib: u64,
}

fn render_settings(ctx: &InjectContext<'_>) -> Result<Render, InjectError> {
    if ctx.backend.spec.integration_role() != IntegrationRole::ReadWrite {
        return Err(InjectError::InvalidSpec {
            field: "spec.integration.role",
            detail: "SGLang's LMCache integration always stores and retrieves; only ReadWrite is supported".to_string(),
        });
    }
    let lm = ctx.backend.spec.lm_cache.clone().unwrap_or_default();
    let port = lm.effective_worker_port();
    if !(1..=65535).contains(&port) {
        return Err(InjectError::InvalidSpec {
            field: "spec.lmCache.workerPort",
            detail: format!("{port} is outside 1-65535"),
        });
    }
    let chunk = lm.effective_chunk_size_tokens();
    if chunk < 1 {
        return Err(InjectError::InvalidSpec {
            field: "spec.lmCache.chunkSizeTokens",
            detail: format!("{chunk} is below 1"),
        });
    }
    let gib = super::host_memory_gib(ctx.backend)?;
    let l1_gib = (gib.floor() as u64).max(1);
    Ok(Render {
        port,
        chunk,
        l1_gib,
    })
}

/// The worker's startup probe: succeeds only when a process of **this container** holds the
/// LISTEN socket on `port` — the socket's inode from `/proc/net/tcp{,6}` is found among the fds
/// of the processes the container sees (its own PID namespace). On the host network the port
/// is the node's, so merely connecting would also succeed against another pod's worker.
pub fn worker_probe_program(port: i32) -> String {
    format!(
        r#"import os, sys
port = "%04X" % {port}
socks = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        for line in open(table).readlines()[1:]:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[1].rsplit(":", 1)[1] == port:
                socks.add("socket:[%s]" % f[9])
    except OSError:
        pass
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        for fd in os.listdir("/proc/%s/fd" % pid):
            if os.readlink("/proc/%s/fd/%s" % (pid, fd)) in socks:
                sys.exit(0)
    except OSError:
        pass
sys.exit(1)
"#
    )
}

/// The LMCache chunk size, in tokens, that `pod`'s rendered MP worker runs with: the literal
/// value of its `--chunk-size N` / `--chunk-size=N` argument (the last one). `None` when the pod
/// has no worker this adapter rendered, or the value is not a positive whole number. The node
/// plan credits offload-only matches in these chunks (spec 000 "SGLang LMCache MP mode"): a
/// spec edit since the pod was wired does not reach the running worker.
pub fn wired_chunk_size_tokens(pod: &Pod) -> Option<u32> {
    let spec = pod.spec.as_ref()?;
    let worker = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .find(|c| c.name == WORKER_CONTAINER && is_rendered(c, WORKER_CONTAINER))?;
    let args = worker.args.as_deref().unwrap_or_default();
    let mut chunk = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--chunk-size" {
            chunk = it.next().map(String::as_str);
        } else if let Some(v) = a.strip_prefix("--chunk-size=") {
            chunk = Some(v);
        }
    }
    chunk?.parse::<u32>().ok().filter(|&c| c > 0)
}

/// The config file content (`chunk_size`, `mp_host`, `mp_port`).
pub fn config_yaml(chunk: i32, port: i32) -> String {
    format!("chunk_size: {chunk}\nmp_host: \"127.0.0.1\"\nmp_port: {port}\n")
}

fn volume_source_kind(v: &Volume) -> Option<&'static str> {
    if v.config_map.is_some() {
        Some("configMap")
    } else if v.secret.is_some() {
        Some("secret")
    } else if v.downward_api.is_some() {
        Some("downwardAPI")
    } else if v.projected.is_some() {
        Some("projected")
    } else {
        None
    }
}

impl SglangLmCacheMp {
    /// Checks reserved names and `/dev/shm` on the original pod; returns how `/dev/shm` is
    /// provided and where an existing worker sits.
    fn preflight(pod: &Pod, engine: &Container) -> Result<(Shm, Option<usize>), InjectError> {
        let spec = pod.spec.as_ref();
        let inits: &[Container] = spec
            .and_then(|s| s.init_containers.as_deref())
            .unwrap_or(&[]);
        let containers: &[Container] = spec.map(|s| s.containers.as_slice()).unwrap_or(&[]);
        let volumes: &[Volume] = spec.and_then(|s| s.volumes.as_deref()).unwrap_or(&[]);

        let worker_at = inits.iter().position(|c| c.name == WORKER_CONTAINER);
        let ours = worker_at
            .and_then(|i| inits.get(i))
            .is_some_and(|c| is_rendered(c, WORKER_CONTAINER));
        if worker_at.is_some() && !ours {
            return Err(InjectError::ReservedName {
                what: "init container",
                name: WORKER_CONTAINER.to_string(),
            });
        }
        if containers.iter().any(|c| c.name == WORKER_CONTAINER) {
            return Err(InjectError::ReservedName {
                what: "container",
                name: WORKER_CONTAINER.to_string(),
            });
        }
        if !ours {
            for name in [CONFIG_VOLUME, DSHM_VOLUME] {
                if volumes.iter().any(|v| v.name == name) {
                    return Err(InjectError::ReservedName {
                        what: "volume",
                        name: name.to_string(),
                    });
                }
            }
        }
        let mounts: &[VolumeMount] = engine.volume_mounts.as_deref().unwrap_or(&[]);
        if !ours {
            if let Some(m) = mounts
                .iter()
                .find(|m| m.name == CONFIG_VOLUME || m.name == DSHM_VOLUME)
            {
                return Err(InjectError::ReservedName {
                    what: "volume",
                    name: m.name.clone(),
                });
            }
        }
        for m in mounts {
            if normalize_mount_path(&m.mount_path) == CONFIG_DIR
                && !(ours && m.name == CONFIG_VOLUME)
            {
                return Err(InjectError::ReservedName {
                    what: "mount path",
                    name: CONFIG_DIR.to_string(),
                });
            }
        }
        let engine_shm = shm_mount(engine);
        let shm = match engine_shm {
            None => Shm::Render,
            Some(m) => {
                if m.read_only == Some(true) {
                    return Err(InjectError::ReadOnlyShm {
                        container: engine.name.clone(),
                        volume: m.name.clone(),
                    });
                }
                if let Some(kind) = volumes
                    .iter()
                    .find(|v| v.name == m.name)
                    .and_then(volume_source_kind)
                {
                    return Err(InjectError::ShmVolumeSource {
                        container: engine.name.clone(),
                        volume: m.name.clone(),
                        kind,
                    });
                }
                if m.name == DSHM_VOLUME && ours {
                    Shm::Render
                } else {
                    Shm::Reuse(m.name.clone(), m.sub_path.clone())
                }
            }
        };
        Ok((shm, worker_at))
    }

    /// Edits that converge `--enable-lmcache` and `--lmcache-config-file`.
    fn flag_edits(cmd: &EngineCommand) -> Result<Vec<Edit>, InjectError> {
        let container = cmd.container.clone();
        for f in cmd.flags() {
            if f.name == "--enable-hierarchical-cache" || f.name.starts_with("--hicache-") {
                return Err(InjectError::ConflictingIntegration {
                    container,
                    flag: f.name,
                    detail: "SGLang native HiCache is already configured on this engine; LMCache MP mode replaces the hierarchical cache",
                });
            }
        }
        let mut edits = Vec::new();
        let mut append = Vec::new();
        match cmd.find("--enable-lmcache").as_slice() {
            [] => append.push("--enable-lmcache".to_string()),
            [occ] => {
                if occ.inline.is_some() {
                    return Err(InjectError::MalformedFlag {
                        container,
                        flag: "--enable-lmcache".to_string(),
                        value: cmd.args[occ.index].text.clone(),
                    });
                }
            }
            _ => {
                return Err(InjectError::DuplicateFlag {
                    container,
                    flag: "--enable-lmcache".to_string(),
                })
            }
        }
        match cmd.find("--lmcache-config-file").as_slice() {
            [] => {
                append.push("--lmcache-config-file".to_string());
                append.push(CONFIG_FILE.to_string());
            }
            [occ] => {
                let (value, value_index) =
                    cmd.value_of(occ)
                        .ok_or_else(|| InjectError::MissingFlagValue {
                            container: container.clone(),
                            flag: "--lmcache-config-file".to_string(),
                        })?;
                let at = value_index.unwrap_or(occ.index);
                if cmd.is_opaque(at) {
                    return Err(InjectError::OpaqueFlag {
                        container,
                        flag: "--lmcache-config-file".to_string(),
                        value,
                    });
                }
                if value != CONFIG_FILE {
                    edits.push(match value_index {
                        Some(i) => Edit::Replace {
                            index: i,
                            tokens: vec![CONFIG_FILE.to_string()],
                        },
                        None => {
                            let written = &cmd.args[occ.index].text;
                            let flag = written.split_once('=').map(|(f, _)| f).unwrap_or(written);
                            Edit::Replace {
                                index: occ.index,
                                tokens: vec![format!("{flag}={CONFIG_FILE}")],
                            }
                        }
                    });
                }
            }
            _ => {
                return Err(InjectError::DuplicateFlag {
                    container,
                    flag: "--lmcache-config-file".to_string(),
                })
            }
        }
        if !append.is_empty() {
            edits.push(Edit::Append(append));
        }
        Ok(edits)
    }

    fn worker(
        ctx: &InjectContext<'_>,
        engine: &Container,
        python: Option<&str>,
        r: &Render,
        shm: &Shm,
    ) -> Container {
        let lm = ctx.backend.spec.lm_cache.clone().unwrap_or_default();
        let image = lm
            .worker_image
            .clone()
            .filter(|s| !s.trim().is_empty())
            .or_else(|| ctx.lmcache_worker_image.map(str::to_string))
            .or_else(|| engine.image.clone());
        let same_image = image == engine.image;
        let python = if same_image {
            python.unwrap_or("python3")
        } else {
            "python3"
        };
        let mut args = vec![
            python.to_string(),
            "-m".to_string(),
            "lmcache.v1.multiprocess.server".to_string(),
            "--host".to_string(),
            "127.0.0.1".to_string(),
            "--port".to_string(),
            r.port.to_string(),
            "--chunk-size".to_string(),
            r.chunk.to_string(),
            "--l1-size-gb".to_string(),
            r.l1_gib.to_string(),
        ];
        if let Some(b) = ctx.binding.filter(|b| b.kind == BindingKind::Resp) {
            args.push("--l2-adapter".to_string());
            args.push(
                serde_json::json!({"type": "resp", "host": b.bare_host(), "port": b.port})
                    .to_string(),
            );
        }
        let (shm_volume, shm_sub_path) = match shm {
            Shm::Reuse(name, sub) => (name.clone(), sub.clone()),
            Shm::Render => (DSHM_VOLUME.to_string(), None),
        };
        Container {
            name: WORKER_CONTAINER.to_string(),
            image,
            image_pull_policy: if same_image {
                engine.image_pull_policy.clone()
            } else {
                None
            },
            restart_policy: Some("Always".to_string()),
            command: Some(vec![
                "/bin/sh".to_string(),
                "-c".to_string(),
                format!("printf '%s' \"${ENV_MP_CONFIG}\" > {CONFIG_FILE} && exec \"$@\""),
                WORKER_CONTAINER.to_string(),
            ]),
            args: Some(args),
            env: Some(vec![
                env_var(ENV_COMPONENT, WORKER_CONTAINER),
                env_var("NVIDIA_VISIBLE_DEVICES", "all"),
                env_var(ENV_MP_CONFIG, &config_yaml(r.chunk, r.port)),
            ]),
            startup_probe: Some(Probe {
                exec: Some(ExecAction {
                    command: Some(vec![
                        python.to_string(),
                        "-c".to_string(),
                        worker_probe_program(r.port),
                    ]),
                }),
                period_seconds: Some(2),
                timeout_seconds: Some(2),
                failure_threshold: Some(150),
                ..Default::default()
            }),
            volume_mounts: Some(vec![
                VolumeMount {
                    name: CONFIG_VOLUME.to_string(),
                    mount_path: CONFIG_DIR.to_string(),
                    ..Default::default()
                },
                VolumeMount {
                    name: shm_volume,
                    mount_path: "/dev/shm".to_string(),
                    sub_path: shm_sub_path,
                    ..Default::default()
                },
            ]),
            security_context: engine_image_security_context(engine),
            ..Default::default()
        }
    }
}

/// Replaces the volume named like `v` or appends it.
fn upsert_volume(volumes: &mut Vec<Volume>, v: Volume) {
    match volumes.iter_mut().find(|x| x.name == v.name) {
        Some(slot) => *slot = v,
        None => volumes.push(v),
    }
}

/// Replaces the mount of the same volume name or appends it.
fn upsert_mount(c: &mut Container, m: VolumeMount) {
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    match mounts.iter_mut().find(|x| x.name == m.name) {
        Some(slot) => *slot = m,
        None => mounts.push(m),
    }
}

impl RuntimeAdapter for SglangLmCacheMp {
    fn name(&self) -> &'static str {
        "sglang+lmcache-mp"
    }

    fn runtime(&self) -> Runtime {
        Runtime::SgLang
    }

    fn cache_type(&self) -> CacheType {
        CacheType::LMCache
    }

    fn reserved_args(&self) -> &'static [&'static str] {
        RESERVED_ARGS
    }

    fn reserved_env(&self) -> &'static [&'static str] {
        RESERVED_ENV
    }

    fn supports_binding(&self, binding: Option<BindingKind>) -> bool {
        matches!(binding, None | Some(BindingKind::Resp))
    }

    fn inject_engine_config(
        &self,
        ctx: &InjectContext<'_>,
        pod: &mut Pod,
        engine: usize,
    ) -> Result<InjectReport, InjectError> {
        let binding_kind = ctx.binding.map(|b| b.kind);
        if !self.supports_binding(binding_kind) {
            return Err(InjectError::UnsupportedBinding {
                adapter: self.name(),
                binding: super::binding_label(binding_kind),
            });
        }
        let mut report = InjectReport::default();
        let original = engine_ref(pod, engine)?.clone();
        // A release without --lmcache-config-file exits on it: left unwired with the reason.
        if let Some(w) = super::engine_release::sglang_lmcache_gate(pod, &original)? {
            report.warnings.push(w);
        }
        let (shm, worker_at) = Self::preflight(pod, &original)?;
        let cmd = EngineCommand::parse(&original, Runtime::SgLang)?;
        if let Some((variable, flag)) = cmd.hidden_flag(
            &original,
            &[
                "--enable-lmcache",
                "--lmcache-config-file",
                "--enable-hierarchical-cache",
                "--hicache-",
            ],
        ) {
            return Err(InjectError::HiddenFlag {
                container: original.name.clone(),
                variable,
                flag,
            });
        }
        report.warnings.extend(cmd.warnings.iter().cloned());
        let edits = Self::flag_edits(&cmd)?;
        let r = render_settings(ctx)?;

        if let Shm::Reuse(name, _) = &shm {
            let volume = pod
                .spec
                .as_ref()
                .and_then(|s| s.volumes.as_ref())
                .and_then(|v| v.iter().find(|v| &v.name == name));
            if let Some(v) =
                volume.filter(|v| v.persistent_volume_claim.is_some() || v.ephemeral.is_some())
            {
                let claim = v
                    .persistent_volume_claim
                    .as_ref()
                    .map(|c| format!("PersistentVolumeClaim {:?}", c.claim_name))
                    .unwrap_or_else(|| "an ephemeral PersistentVolumeClaim".to_string());
                report.warnings.push(format!(
                    "container {:?} mounts /dev/shm from {claim} (volume {name:?}); it is reused for the LMCache MP data path, but a disk-backed volume turns every shared-memory transfer into storage I/O — mount an emptyDir with medium: Memory at /dev/shm",
                    original.name
                ));
            }
            let limit = volume
                .and_then(|v| v.empty_dir.as_ref())
                .and_then(|e| e.size_limit.as_ref())
                .and_then(|q| parse_quantity(&q.0));
            if let Some(bytes) = limit {
                let l1 = r.l1_gib as f64 * 1024f64.powi(3);
                if bytes < l1 {
                    report.warnings.push(format!(
                        "/dev/shm volume {name:?} has sizeLimit {:.1}GiB, below the LMCache L1 allocation of {}GiB",
                        bytes / 1024f64.powi(3),
                        r.l1_gib
                    ));
                }
            }
        }

        let mut c = cmd.apply(&original, &edits)?;
        upsert_env(&mut c, "LMCACHE_USE_EXPERIMENTAL", "True");
        upsert_env(
            &mut c,
            ENV_FAIL_OPEN,
            if ctx.backend.spec.fail_open() {
                "true"
            } else {
                "false"
            },
        );
        upsert_mount(
            &mut c,
            VolumeMount {
                name: CONFIG_VOLUME.to_string(),
                mount_path: CONFIG_DIR.to_string(),
                read_only: Some(true),
                ..Default::default()
            },
        );
        if shm == Shm::Render {
            upsert_mount(
                &mut c,
                VolumeMount {
                    name: DSHM_VOLUME.to_string(),
                    mount_path: "/dev/shm".to_string(),
                    ..Default::default()
                },
            );
        }
        let worker = Self::worker(ctx, &original, cmd.python.as_deref(), &r, &shm);

        *engine_mut(pod, engine)? = c;
        let Some(spec) = pod.spec.as_mut() else {
            return Err(InjectError::BadContainerIndex(engine));
        };
        let volumes = spec.volumes.get_or_insert_with(Vec::new);
        upsert_volume(
            volumes,
            Volume {
                name: CONFIG_VOLUME.to_string(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            },
        );
        if shm == Shm::Render {
            upsert_volume(
                volumes,
                Volume {
                    name: DSHM_VOLUME.to_string(),
                    empty_dir: Some(EmptyDirVolumeSource {
                        medium: Some("Memory".to_string()),
                        size_limit: Some(Quantity(format!("{}Gi", r.l1_gib + 1))),
                    }),
                    ..Default::default()
                },
            );
        } else {
            volumes.retain(|v| v.name != DSHM_VOLUME);
        }
        let inits = spec.init_containers.get_or_insert_with(Vec::new);
        match worker_at.and_then(|i| inits.get_mut(i)) {
            Some(slot) => *slot = super::converge::converge_rendered(slot, worker, WORKER_ENV),
            None => inits.push(worker),
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::providers::Binding;
    use ic_shared::crd::{CacheBackend, CacheBackendSpec, LmCacheSpec};
    use k8s_openapi::api::core::v1::{ConfigMapVolumeSource, PodSpec};

    fn pod() -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "sglang".into(),
                    image: Some("lmsysorg/sglang:v0.5.16".into()),
                    command: Some(vec![
                        "python3".into(),
                        "-m".into(),
                        "sglang.launch_server".into(),
                    ]),
                    args: Some(vec!["--model-path".into(), "Q".into()]),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn cb() -> CacheBackend {
        CacheBackend::new(
            "cb",
            CacheBackendSpec {
                runtime: Runtime::SgLang,
                ..Default::default()
            },
        )
    }

    fn inject(
        p: &mut Pod,
        cb: &CacheBackend,
        binding: Option<&Binding>,
    ) -> Result<InjectReport, InjectError> {
        SglangLmCacheMp.inject_engine_config(
            &InjectContext {
                backend: cb,
                binding,
                lmcache_worker_image: None,
                kernel_check_image: None,
            },
            p,
            0,
        )
    }

    fn worker(p: &Pod) -> &Container {
        p.spec
            .as_ref()
            .unwrap()
            .init_containers
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.name == WORKER_CONTAINER)
            .unwrap()
    }

    #[test]
    fn host_only_render_and_convergence() {
        let mut p = pod();
        inject(&mut p, &cb(), None).unwrap();
        let spec = p.spec.as_ref().unwrap();
        let e = &spec.containers[0];
        assert_eq!(
            e.args.as_ref().unwrap(),
            &vec![
                "--model-path",
                "Q",
                "--enable-lmcache",
                "--lmcache-config-file",
                CONFIG_FILE
            ]
        );
        let env: Vec<_> = e
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.as_str(), e.value.as_deref().unwrap()))
            .collect();
        assert_eq!(
            env,
            vec![
                ("LMCACHE_USE_EXPERIMENTAL", "True"),
                (ENV_FAIL_OPEN, "true")
            ]
        );
        // No VLLM_USE_V1 / PYTHONHASHSEED / LMCACHE_REMOTE_URL for SGLang.
        let w = worker(&p);
        assert_eq!(w.restart_policy.as_deref(), Some("Always"));
        assert!(!w
            .args
            .as_ref()
            .unwrap()
            .contains(&"--l2-adapter".to_string()));
        assert!(w
            .args
            .as_ref()
            .unwrap()
            .windows(2)
            .any(|x| x == ["--l1-size-gb", "4"]));
        assert!(w.startup_probe.as_ref().unwrap().exec.is_some());
        assert!(w
            .env
            .iter()
            .flatten()
            .any(|e| e.name == "NVIDIA_VISIBLE_DEVICES" && e.value.as_deref() == Some("all")));
        let vols: Vec<_> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(vols, vec![CONFIG_VOLUME, DSHM_VOLUME]);
        assert_eq!(
            spec.volumes.as_ref().unwrap()[1]
                .empty_dir
                .as_ref()
                .unwrap()
                .size_limit,
            Some(Quantity("5Gi".into()))
        );
        let once = p.clone();
        inject(&mut p, &cb(), None).unwrap();
        assert_eq!(p, once);
    }

    /// The probe program, run against a real listener: succeeds when a process it can see
    /// holds the port, fails when none does.
    #[test]
    fn worker_probe_proves_a_visible_process_holds_the_port() {
        let Ok(out) = std::process::Command::new("python3").arg("-V").output() else {
            panic!("python3 is needed to run the worker probe program");
        };
        assert!(out.status.success());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let run = |p: u16| {
            std::process::Command::new("python3")
                .arg("-c")
                .arg(worker_probe_program(i32::from(p)))
                .status()
                .unwrap()
                .success()
        };
        assert!(run(port), "this test process holds {port}");
        drop(listener);
        assert!(!run(port), "nobody holds {port} any more");
    }

    #[test]
    fn resp_binding_adds_l2_adapter() {
        let mut p = pod();
        let b = Binding {
            kind: BindingKind::Resp,
            host: "redis.ns.svc".into(),
            port: 6379,
        };
        inject(&mut p, &cb(), Some(&b)).unwrap();
        let args = worker(&p).args.clone().unwrap();
        let i = args.iter().position(|a| a == "--l2-adapter").unwrap();
        assert_eq!(
            args[i + 1],
            r#"{"host":"redis.ns.svc","port":6379,"type":"resp"}"#
        );
        let lm = Binding {
            kind: BindingKind::Lm,
            host: "x".into(),
            port: 1,
        };
        assert!(matches!(
            inject(&mut pod(), &cb(), Some(&lm)),
            Err(InjectError::UnsupportedBinding { .. })
        ));
    }

    #[test]
    fn worker_image_and_port_follow_spec() {
        let mut b = cb();
        b.spec.lm_cache = Some(LmCacheSpec {
            worker_image: Some("lmcache/worker:1".into()),
            worker_port: Some(6000),
            chunk_size_tokens: Some(64),
            ..Default::default()
        });
        let mut p = pod();
        inject(&mut p, &b, None).unwrap();
        let w = worker(&p);
        assert_eq!(w.image.as_deref(), Some("lmcache/worker:1"));
        let cfg = w
            .env
            .iter()
            .flatten()
            .find(|e| e.name == ENV_MP_CONFIG)
            .unwrap();
        assert_eq!(
            cfg.value.as_deref(),
            Some("chunk_size: 64\nmp_host: \"127.0.0.1\"\nmp_port: 6000\n")
        );
    }

    #[test]
    fn reuses_the_engine_shm_under_any_name() {
        let mut p = pod();
        let s = p.spec.as_mut().unwrap();
        s.volumes = Some(vec![Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(Quantity("2Gi".into())),
            }),
            ..Default::default()
        }]);
        s.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev/shm".into(),
            ..Default::default()
        }]);
        let r = inject(&mut p, &cb(), None).unwrap();
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        let spec = p.spec.as_ref().unwrap();
        assert!(spec.volumes.iter().flatten().all(|v| v.name != DSHM_VOLUME));
        assert!(worker(&p)
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "dshm" && m.mount_path == "/dev/shm"));
        let once = p.clone();
        inject(&mut p, &cb(), None).unwrap();
        assert_eq!(p, once);
    }

    #[test]
    fn shm_spelled_twice_is_one_mount_and_a_pvc_is_reused_with_a_warning() {
        // `/dev//shm` is /dev/shm: reused, no second mount added.
        let mut p = pod();
        let s = p.spec.as_mut().unwrap();
        s.volumes = Some(vec![Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: None,
            }),
            ..Default::default()
        }]);
        s.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "dshm".into(),
            mount_path: "/dev//shm".into(),
            ..Default::default()
        }]);
        inject(&mut p, &cb(), None).unwrap();
        let e = &p.spec.as_ref().unwrap().containers[0];
        let shm: Vec<_> = e
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| crate::engine::container::normalize_mount_path(&m.mount_path) == "/dev/shm")
            .collect();
        assert_eq!(shm.len(), 1, "{:?}", e.volume_mounts);
        assert!(p
            .spec
            .as_ref()
            .unwrap()
            .volumes
            .iter()
            .flatten()
            .all(|v| v.name != DSHM_VOLUME));

        // A PVC at /dev/shm: reused, with a warning naming the claim.
        let mut p = pod();
        let s = p.spec.as_mut().unwrap();
        s.volumes = Some(vec![Volume {
            name: "shm".into(),
            persistent_volume_claim: Some(
                k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource {
                    claim_name: "fast-disk".into(),
                    read_only: None,
                },
            ),
            ..Default::default()
        }]);
        s.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "shm".into(),
            mount_path: "/dev/shm".into(),
            ..Default::default()
        }]);
        let r = inject(&mut p, &cb(), None).unwrap();
        assert!(
            r.warnings
                .iter()
                .any(|w| w.contains("PersistentVolumeClaim \"fast-disk\"")),
            "{:?}",
            r.warnings
        );
        assert!(worker(&p)
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "shm" && m.mount_path == "/dev/shm"));
    }

    #[test]
    fn rejections() {
        // Read-only /dev/shm.
        let mut p = pod();
        p.spec.as_mut().unwrap().containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "s".into(),
            mount_path: "/dev/shm".into(),
            read_only: Some(true),
            ..Default::default()
        }]);
        assert!(matches!(
            inject(&mut p, &cb(), None),
            Err(InjectError::ReadOnlyShm { .. })
        ));
        // configMap /dev/shm.
        let mut p = pod();
        let s = p.spec.as_mut().unwrap();
        s.volumes = Some(vec![Volume {
            name: "s".into(),
            config_map: Some(ConfigMapVolumeSource::default()),
            ..Default::default()
        }]);
        s.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "s".into(),
            mount_path: "/dev/shm".into(),
            ..Default::default()
        }]);
        assert!(matches!(
            inject(&mut p, &cb(), None),
            Err(InjectError::ShmVolumeSource {
                kind: "configMap",
                ..
            })
        ));
        // Squatted names.
        let mut p = pod();
        p.spec.as_mut().unwrap().init_containers = Some(vec![Container {
            name: WORKER_CONTAINER.into(),
            ..Default::default()
        }]);
        assert_eq!(
            inject(&mut p, &cb(), None).unwrap_err().to_string(),
            "the pod already has a init container named \"lmcache-mp-worker\" that inference-cache did not render; rename it to get the pod wired"
        );
        let mut p = pod();
        p.spec.as_mut().unwrap().volumes = Some(vec![Volume {
            name: CONFIG_VOLUME.into(),
            ..Default::default()
        }]);
        assert!(matches!(
            inject(&mut p, &cb(), None),
            Err(InjectError::ReservedName { what: "volume", .. })
        ));
        let mut p = pod();
        p.spec.as_mut().unwrap().containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "mine".into(),
            mount_path: "/etc/lmcache".into(),
            ..Default::default()
        }]);
        assert!(matches!(
            inject(&mut p, &cb(), None),
            Err(InjectError::ReservedName {
                what: "mount path",
                ..
            })
        ));
        // HiCache flags already present.
        let mut p = pod();
        p.spec.as_mut().unwrap().containers[0]
            .args
            .as_mut()
            .unwrap()
            .push("--enable-hierarchical-cache".into());
        assert!(matches!(
            inject(&mut p, &cb(), None),
            Err(InjectError::ConflictingIntegration { .. })
        ));
        // A role SGLang cannot honour (admission rejects it; the object may predate the rule).
        let mut b = cb();
        b.spec.integration = Some(ic_shared::crd::IntegrationSpec {
            role: Some(IntegrationRole::ReadOnly),
            ..Default::default()
        });
        assert!(matches!(
            inject(&mut pod(), &b, None),
            Err(InjectError::InvalidSpec {
                field: "spec.integration.role",
                ..
            })
        ));
        // Malformed boolean.
        let mut p = pod();
        p.spec.as_mut().unwrap().containers[0]
            .args
            .as_mut()
            .unwrap()
            .push("--enable-lmcache=true".into());
        assert!(matches!(
            inject(&mut p, &cb(), None),
            Err(InjectError::MalformedFlag { .. })
        ));
    }

    #[test]
    fn existing_flags_are_adopted() {
        let mut p = pod();
        p.spec.as_mut().unwrap().containers[0].args = Some(vec![
            "--enable-lmcache".into(),
            "--lmcache-config-file=/tmp/x.yaml".into(),
        ]);
        inject(&mut p, &cb(), None).unwrap();
        assert_eq!(
            p.spec.as_ref().unwrap().containers[0]
                .args
                .as_ref()
                .unwrap(),
            &vec![
                "--enable-lmcache".to_string(),
                format!("--lmcache-config-file={CONFIG_FILE}")
            ]
        );
    }
}
