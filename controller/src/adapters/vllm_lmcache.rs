//! (VLLM, LMCache): the LMCacheConnectorV1 wire (spec 000 "Reserved declarations", "Mooncake
//! provider configuration", "LMCache client kernels ↔ engine-image CUDA / vLLM alignment").
//!
//! On the engine container it converges on:
//!
//! | what | value | ownership |
//! |---|---|---|
//! | `--kv-transfer-config` | `{"kv_connector":"LMCacheConnectorV1","kv_role":"<role>"}` (ReadOnly→`kv_consumer`, WriteOnly→`kv_producer`, ReadWrite→`kv_both`) | reserved |
//! | `VLLM_USE_V1` | `1` | reserved |
//! | `PYTHONHASHSEED` | `0` | reserved |
//! | `LMCACHE_REMOTE_URL` | `lm://host:port` or `mooncakestore://host:port` (only with a binding) | reserved |
//! | `INFERENCECACHE_FAIL_OPEN` | `true`/`false` from `spec.integration.failOpen` | reserved |
//! | `LMCACHE_CHUNK_SIZE` | `spec.lmCache.chunkSizeTokens` (256) | tunable |
//! | `LMCACHE_LOCAL_CPU` | `True` | tunable |
//! | `LMCACHE_MAX_LOCAL_CPU_SIZE` | `spec.lmCache.hostMemory.capacity` in GiB (4) | tunable |
//! | `LMCACHE_REMOTE_SERDE` | `spec.lmCache.remoteSerde` or `naive` (only with a binding) | tunable |
//!
//! Reserved entries converge on the rendered value (a user value is replaced); tunables keep a
//! value the pod template already sets (with a warning when it differs). An existing
//! `--kv-transfer-config` (any spelling: `--kv_transfer_config`, `--kv-transfer-config=…`) is
//! adopted when it names LMCacheConnectorV1 — only `kv_role` is converged, other keys are kept —
//! and never duplicated; another connector, invalid JSON, a duplicate flag or a shell-expanded
//! value is an error (fail open).
//!
//! The `lmcache-kernel-check` init container follows the CacheBackend annotation
//! [`KERNEL_CHECK_ANNOTATION`]: `auto` (default) injects report-only when the engine requests a
//! GPU, `report-only` and `strict` always inject, `off` never; an unrecognised value (admission
//! rejects it; the object may predate the rule) injects report-only with a warning.
//!
//! One concept, kept in one file although it passes 1 000 lines with its tests: this one
//! adapter, everything it renders onto the pod and converges on.

use std::collections::BTreeMap;

use ic_shared::crd::{CacheType, IntegrationRole, Runtime};
use k8s_openapi::api::core::v1::{Container, Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{
    default_env, engine_image_security_context, engine_mut, engine_ref, env_var, gib_text,
    host_memory_gib, is_rendered, requests_gpu, upsert_env, BindingKind, InjectContext,
    InjectError, InjectReport, RuntimeAdapter, ENV_FAIL_OPEN, KERNEL_CHECK_ANNOTATION,
};
use crate::engine::command::{Edit, EngineCommand};
use crate::engine::container::{shm_mount, ENV_COMPONENT};

/// The connector this adapter wires.
pub const CONNECTOR: &str = "LMCacheConnectorV1";
/// Name of the kernel-check init container.
pub const KERNEL_CHECK_CONTAINER: &str = "lmcache-kernel-check";
/// Env var on the kernel-check container carrying its mode (`report-only` | `strict`); the
/// controller reads each pod's admitted mode from it.
pub const ENV_KERNEL_CHECK_MODE: &str = "INFERENCECACHE_KERNEL_CHECK_MODE";
/// Env var on the kernel-check container naming the file the verdict goes to: the container's
/// own `terminationMessagePath` ([`KERNEL_CHECK_TERMINATION_PATH`]), so the program and the
/// kubelet agree on one path.
pub const ENV_TERMINATION_LOG: &str = "INFERENCECACHE_TERMINATION_LOG";
/// The kernel-check container's `terminationMessagePath` (the Kubernetes default, set explicitly).
pub const KERNEL_CHECK_TERMINATION_PATH: &str = "/dev/termination-log";
/// The strict kernel-check mode: a failed load exits non-zero (and downgrades Ready).
pub const KERNEL_CHECK_STRICT: &str = "strict";
/// The report-only kernel-check mode: the check always exits 0; the verdict is its message.
pub const KERNEL_CHECK_REPORT_ONLY: &str = "report-only";

/// The verdict [`KERNEL_CHECK_PROGRAM`] writes to the termination log (and stdout):
/// `{"kernelsHealthy": bool, "mode": "report-only"|"strict", "detail": "…"}`. The CacheBackend
/// reconciler reads exactly this (EngineKernelsHealthy); the adapter's program and this type are
/// the one definition of the format, and a test runs the program to keep them together.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KernelCheckVerdict {
    /// True when `lmcache.c_ops` loaded.
    pub kernels_healthy: bool,
    /// The mode the check ran in.
    #[serde(default)]
    pub mode: Option<String>,
    /// What was loaded, or why it failed.
    #[serde(default)]
    pub detail: Option<String>,
}

impl KernelCheckVerdict {
    /// Parses a termination message; `None` when it is not a verdict.
    pub fn parse(message: &str) -> Option<Self> {
        serde_json::from_str(message.trim()).ok()
    }
}

/// The Python program of the kernel check: force-loads `lmcache.c_ops` from disk without importing
/// the `lmcache` package (whose import swaps in a fallback shim on failure), writes a JSON verdict
/// to the termination log and stdout, and exits 0 unless the mode is `strict` and the load failed.
pub const KERNEL_CHECK_PROGRAM: &str = r#"import importlib.machinery, importlib.util, json, os, sys
mode = os.environ.get("INFERENCECACHE_KERNEL_CHECK_MODE", "report-only")
def report(ok, detail):
    msg = json.dumps({"kernelsHealthy": ok, "mode": mode, "detail": detail})
    try:
        with open(os.environ.get("INFERENCECACHE_TERMINATION_LOG", "/dev/termination-log"), "w") as f:
            f.write(msg)
    except OSError:
        pass
    print(msg, flush=True)
    sys.exit(0 if ok or mode != "strict" else 1)
try:
    spec = importlib.util.find_spec("lmcache")
    if spec is None or not spec.submodule_search_locations:
        report(False, "lmcache is not importable in the engine image")
    base = list(spec.submodule_search_locations)[0]
    found = sorted(f for f in os.listdir(base) if f.startswith("c_ops") and f.endswith(".so"))
    if not found:
        report(False, "lmcache has no compiled c_ops extension (CPU or pure-python build)")
    import torch
    path = os.path.join(base, found[0])
    loader = importlib.machinery.ExtensionFileLoader("lmcache.c_ops", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("lmcache.c_ops", path, loader=loader))
    loader.exec_module(module)
    report(True, "lmcache.c_ops loaded from " + path)
except SystemExit:
    raise
except BaseException as e:
    report(False, "%s: %s" % (type(e).__name__, e))
"#;

/// The (VLLM, LMCache) adapter.
pub struct VllmLmCache;

/// Engine env the adapter derives from the CacheBackend (binding and tunables).
const BACKEND_ENV: &[&str] = &[
    "LMCACHE_REMOTE_URL",
    "LMCACHE_REMOTE_SERDE",
    "LMCACHE_CHUNK_SIZE",
    "LMCACHE_LOCAL_CPU",
    "LMCACHE_MAX_LOCAL_CPU_SIZE",
];

/// Env names the kernel-check rendering owns (others' additions to it are kept).
const KERNEL_CHECK_ENV: &[&str] = &[
    ENV_COMPONENT,
    ENV_KERNEL_CHECK_MODE,
    ENV_TERMINATION_LOG,
    "PATH",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
];

const RESERVED_ARGS: &[&str] = &["--kv-transfer-config"];
const RESERVED_ENV: &[&str] = &[
    "VLLM_USE_V1",
    "LMCACHE_REMOTE_URL",
    ENV_FAIL_OPEN,
    "PYTHONHASHSEED",
];

/// `kv_role` for `spec.integration.role`.
pub fn kv_role(role: IntegrationRole) -> &'static str {
    match role {
        IntegrationRole::ReadOnly => "kv_consumer",
        IntegrationRole::WriteOnly => "kv_producer",
        IntegrationRole::ReadWrite => "kv_both",
    }
}

/// The canonical `--kv-transfer-config` value.
pub fn kv_transfer_config(role: IntegrationRole) -> String {
    format!(
        r#"{{"kv_connector":"{CONNECTOR}","kv_role":"{}"}}"#,
        kv_role(role)
    )
}

/// Kernel-check mode resolved from the annotation: `None` = do not inject.
fn kernel_check_mode(
    annotation: Option<&str>,
    engine: &Container,
    warnings: &mut Vec<String>,
) -> Option<&'static str> {
    match annotation {
        None | Some("auto") => requests_gpu(engine).then_some("report-only"),
        Some("report-only") => Some("report-only"),
        Some("strict") => Some("strict"),
        Some("off") => None,
        Some(other) => {
            warnings.push(format!(
                "CacheBackend annotation {KERNEL_CHECK_ANNOTATION}={other:?} is not one of auto, report-only, strict, off; the kernel check runs report-only"
            ));
            Some("report-only")
        }
    }
}

/// Renders the kernel-check init container for `engine`.
fn kernel_check_container(
    engine: &Container,
    python: &str,
    mode: &str,
    image: Option<&str>,
) -> Container {
    let mut env = vec![
        env_var(ENV_COMPONENT, KERNEL_CHECK_CONTAINER),
        env_var(ENV_KERNEL_CHECK_MODE, mode),
        env_var(ENV_TERMINATION_LOG, KERNEL_CHECK_TERMINATION_PATH),
    ];
    // The interpreter must find the same packages the engine does.
    for name in ["PATH", "PYTHONPATH", "LD_LIBRARY_PATH"] {
        if let Some(e) = engine
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name && e.value.is_some() && e.value_from.is_none())
        {
            env.push(e.clone());
        }
    }
    let image = image.map(str::to_string).or_else(|| engine.image.clone());
    let same_image = image == engine.image;
    Container {
        name: KERNEL_CHECK_CONTAINER.to_string(),
        image,
        image_pull_policy: if same_image {
            engine.image_pull_policy.clone()
        } else {
            None
        },
        command: Some(vec![
            python.to_string(),
            "-c".to_string(),
            KERNEL_CHECK_PROGRAM.to_string(),
        ]),
        env: Some(env),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("100m".to_string())),
                ("memory".to_string(), Quantity("256Mi".to_string())),
            ])),
            ..Default::default()
        }),
        termination_message_path: Some(KERNEL_CHECK_TERMINATION_PATH.to_string()),
        termination_message_policy: Some("FallbackToLogsOnError".to_string()),
        security_context: engine_image_security_context(engine),
        ..Default::default()
    }
}

/// The LMCache chunk size, in tokens, that the vLLM engine container `engine` runs with: its
/// literal `LMCACHE_CHUNK_SIZE` (the adapter only defaults it, so a user's own value stands;
/// the last entry wins, as in the kubelet), or LMCache's default
/// ([`ic_shared::crd::DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS`]) when the container sets none. `None`
/// when the value comes from `valueFrom` (or may come from `envFrom`) or is not a positive
/// whole number. The node plan
/// credits offload-only matches in these chunks (spec 000 "LMCache on vLLM").
pub fn wired_chunk_size_tokens(engine: &Container) -> Option<u32> {
    let Some(entry) = engine
        .env
        .iter()
        .flatten()
        .rev()
        .find(|e| e.name == "LMCACHE_CHUNK_SIZE")
    else {
        // An `envFrom` source may set it: not readable from the pod.
        if engine.env_from.as_ref().is_some_and(|f| !f.is_empty()) {
            return None;
        }
        return u32::try_from(ic_shared::crd::DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS).ok();
    };
    entry
        .value
        .as_deref()
        .filter(|_| entry.value_from.is_none())?
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|&c| c > 0)
}

/// `PYTHONHASHSEED` on the engine: LMCache hashes chunk keys with Python's `hash()`, so a
/// random seed makes every TP rank (and every restart) compute different keys and never hit its
/// own cache; llm-d's precise-prefix scorer must also use the engine's seed. Any fixed value
/// works, so a fixed seed the template sets (an integer in 0–4294967295, or a `valueFrom` the
/// webhook cannot read) is kept, with a warning that every engine must share it; an absent,
/// empty or `random` value is set to `0`, and a value Python rejects is replaced by `0` with a
/// warning.
pub const HASH_SEED_ENV: &str = "PYTHONHASHSEED";

fn converge_hash_seed(c: &mut Container, warnings: &mut Vec<String>) {
    let existing = c
        .env
        .iter()
        .flatten()
        .rev()
        .find(|e| e.name == HASH_SEED_ENV)
        .cloned();
    let why = "LMCache's chunk keys (and llm-d's precise-prefix scorer) depend on it, so every engine pod of this backend must use the same fixed value";
    match existing {
        Some(e) if e.value_from.is_some() => {
            warnings.push(format!(
                "container {:?}: {HASH_SEED_ENV} from valueFrom is kept; it must resolve to a fixed integer: {why}",
                c.name
            ));
        }
        Some(e) => {
            let v = e.value.clone().unwrap_or_default();
            let t = v.trim();
            if t.parse::<u32>().is_ok() {
                if t != "0" {
                    warnings.push(format!(
                        "container {:?}: {HASH_SEED_ENV}={t} from the pod template is kept (the webhook sets 0 only when it is absent or random): {why}",
                        c.name
                    ));
                }
                // A duplicate entry is dropped; the kept value is the one Kubernetes uses.
                upsert_env(c, HASH_SEED_ENV, &v);
            } else {
                if !t.is_empty() && t != "random" {
                    warnings.push(format!(
                        "container {:?}: {HASH_SEED_ENV}={v:?} is neither random nor an integer in 0-4294967295 (Python refuses to start with it); set to 0",
                        c.name
                    ));
                } else if t == "random" {
                    warnings.push(format!(
                        "container {:?}: {HASH_SEED_ENV}=random replaced by 0: {why}",
                        c.name
                    ));
                }
                upsert_env(c, HASH_SEED_ENV, "0");
            }
        }
        None => upsert_env(c, HASH_SEED_ENV, "0"),
    }
}

impl VllmLmCache {
    /// Edits that converge `--kv-transfer-config`.
    fn connector_edits(
        cmd: &EngineCommand,
        role: IntegrationRole,
    ) -> Result<Vec<Edit>, InjectError> {
        let container = cmd.container.clone();
        if let Some(dotted) = cmd
            .flags()
            .into_iter()
            .find(|f| f.name.starts_with("--kv-transfer-config."))
        {
            return Err(InjectError::MalformedFlag {
                container,
                flag: "--kv-transfer-config".to_string(),
                value: cmd.args[dotted.index].text.clone(),
            });
        }
        let occs = cmd.find("--kv-transfer-config");
        let desired = kv_transfer_config(role);
        match occs.as_slice() {
            [] => Ok(vec![Edit::Append(vec![
                "--kv-transfer-config".to_string(),
                desired,
            ])]),
            [occ] => {
                let (value, value_index) =
                    cmd.value_of(occ)
                        .ok_or_else(|| InjectError::MissingFlagValue {
                            container: container.clone(),
                            flag: "--kv-transfer-config".to_string(),
                        })?;
                let opaque = match value_index {
                    Some(i) => cmd.is_opaque(i),
                    None => cmd.is_opaque(occ.index),
                };
                if opaque {
                    return Err(InjectError::OpaqueFlag {
                        container,
                        flag: "--kv-transfer-config".to_string(),
                        value,
                    });
                }
                let mut obj: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&value).map_err(|e| {
                        InjectError::InvalidConnectorJson {
                            container: container.clone(),
                            detail: e.to_string(),
                        }
                    })?;
                let connector = obj
                    .get("kv_connector")
                    .and_then(|v| v.as_str())
                    .unwrap_or("")
                    .to_string();
                if connector != CONNECTOR {
                    return Err(InjectError::ExistingConnector {
                        container,
                        connector,
                    });
                }
                let want = kv_role(role);
                if obj.get("kv_role").and_then(|v| v.as_str()) == Some(want) {
                    return Ok(Vec::new()); // adopted as written, byte for byte
                }
                obj.insert(
                    "kv_role".to_string(),
                    serde_json::Value::String(want.to_string()),
                );
                let new_value = serde_json::Value::Object(obj).to_string();
                Ok(vec![match value_index {
                    Some(i) => Edit::Replace {
                        index: i,
                        tokens: vec![new_value],
                    },
                    None => {
                        let written = &cmd.args[occ.index].text;
                        let flag = written.split_once('=').map(|(f, _)| f).unwrap_or(written);
                        Edit::Replace {
                            index: occ.index,
                            tokens: vec![format!("{flag}={new_value}")],
                        }
                    }
                }])
            }
            _ => Err(InjectError::DuplicateFlag {
                container,
                flag: "--kv-transfer-config".to_string(),
            }),
        }
    }
}

impl RuntimeAdapter for VllmLmCache {
    fn name(&self) -> &'static str {
        "vllm+lmcache"
    }

    fn runtime(&self) -> Runtime {
        Runtime::Vllm
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
        matches!(
            binding,
            None | Some(BindingKind::Lm) | Some(BindingKind::MooncakeStore)
        )
    }

    fn backend_env(&self) -> &'static [&'static str] {
        BACKEND_ENV
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
        let spec = &ctx.backend.spec;
        let lm = spec.lm_cache.clone().unwrap_or_default();
        let mut report = InjectReport::default();

        // Validate everything before the first mutation.
        let original = engine_ref(pod, engine)?.clone();
        // A config file next to the injected env: LMCache's releases disagree on which wins (its
        // older docs: "the environment variable configurations will be ignored if the
        // configuration file is present"; newer config loaders apply LMCACHE_* env over the
        // file), so the wiring is not vouched for — said loudly, left to the operator.
        if let Some(file) = original
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "LMCACHE_CONFIG_FILE")
        {
            report.warnings.push(format!(
                "container {:?} sets LMCACHE_CONFIG_FILE={:?}: LMCache releases that read only \
                 that file ignore the LMCACHE_* settings this CacheBackend injects (remote URL, \
                 chunk size, CPU cache), newer ones let them override the file; make the file's \
                 remote_url and sizes agree with the CacheBackend, or remove the variable",
                original.name,
                file.value.as_deref().unwrap_or_default()
            ));
        }
        report
            .warnings
            .extend(super::engine_release::vllm_sliding_window_warning(
                &original,
            ));
        let cmd = EngineCommand::parse(&original, Runtime::Vllm)?;
        if let Some((variable, flag)) = cmd.hidden_flag(&original, &["--kv-transfer-config"]) {
            return Err(InjectError::HiddenFlag {
                container: original.name.clone(),
                variable,
                flag,
            });
        }
        report.warnings.extend(cmd.warnings.iter().cloned());
        let tp = crate::engine::flags::tensor_parallel(Runtime::Vllm, &cmd.texts());
        let host_ipc = pod.spec.as_ref().and_then(|s| s.host_ipc) == Some(true);
        if tp > 1 && !host_ipc && shm_mount(&original).is_none() {
            report.warnings.push(format!(
                "container {:?} runs tensor-parallel size {tp} without a /dev/shm mount: the container runtime's default /dev/shm is 64 MiB, which NCCL exhausts (SIGBUS; vllm-project/production-stack#276) — mount an emptyDir with medium: Memory at /dev/shm",
                original.name
            ));
        }
        let edits = Self::connector_edits(&cmd, spec.integration_role())?;
        let gib = host_memory_gib(ctx.backend)?;
        let chunk = lm.effective_chunk_size_tokens();
        if chunk < 1 {
            return Err(InjectError::InvalidSpec {
                field: "spec.lmCache.chunkSizeTokens",
                detail: format!("{chunk} is below 1"),
            });
        }
        let annotation = ctx
            .backend
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(KERNEL_CHECK_ANNOTATION))
            .map(String::as_str);
        let mode = kernel_check_mode(annotation, &original, &mut report.warnings);
        let init_containers = pod.spec.as_ref().and_then(|s| s.init_containers.as_ref());
        let existing_check = init_containers
            .into_iter()
            .flatten()
            .position(|c| c.name == KERNEL_CHECK_CONTAINER);
        if let Some(i) = existing_check {
            let ours = init_containers
                .and_then(|v| v.get(i))
                .is_some_and(|c| is_rendered(c, KERNEL_CHECK_CONTAINER));
            if !ours {
                return Err(InjectError::ReservedName {
                    what: "init container",
                    name: KERNEL_CHECK_CONTAINER.to_string(),
                });
            }
        }
        if pod.spec.as_ref().is_some_and(|s| {
            s.containers
                .iter()
                .any(|c| c.name == KERNEL_CHECK_CONTAINER)
        }) {
            return Err(InjectError::ReservedName {
                what: "container",
                name: KERNEL_CHECK_CONTAINER.to_string(),
            });
        }

        // Args.
        let mut c = cmd.apply(&original, &edits)?;
        // Env: reserved converge, tunables default.
        upsert_env(&mut c, "VLLM_USE_V1", "1");
        converge_hash_seed(&mut c, &mut report.warnings);
        default_env(
            &mut c,
            "LMCACHE_CHUNK_SIZE",
            &chunk.to_string(),
            &mut report.warnings,
        );
        default_env(&mut c, "LMCACHE_LOCAL_CPU", "True", &mut report.warnings);
        default_env(
            &mut c,
            "LMCACHE_MAX_LOCAL_CPU_SIZE",
            &gib_text(gib),
            &mut report.warnings,
        );
        if let Some(b) = ctx.binding {
            upsert_env(&mut c, "LMCACHE_REMOTE_URL", &b.url());
            default_env(
                &mut c,
                "LMCACHE_REMOTE_SERDE",
                lm.remote_serde.as_deref().unwrap_or("naive"),
                &mut report.warnings,
            );
        } else if c
            .env
            .iter()
            .flatten()
            .any(|e| e.name == "LMCACHE_REMOTE_URL")
        {
            report.warnings.push(format!(
                "container {:?} sets LMCACHE_REMOTE_URL although the CacheBackend is host-only; it is left as is",
                c.name
            ));
        }
        upsert_env(
            &mut c,
            ENV_FAIL_OPEN,
            if spec.fail_open() { "true" } else { "false" },
        );

        // Kernel check (computed from the original engine container).
        let python = cmd.python.clone().unwrap_or_else(|| "python3".to_string());
        let check =
            mode.map(|m| kernel_check_container(&original, &python, m, ctx.kernel_check_image));

        *engine_mut(pod, engine)? = c;
        let Some(pod_spec) = pod.spec.as_mut() else {
            return Err(InjectError::BadContainerIndex(engine));
        };
        match (check, existing_check) {
            (Some(check), Some(i)) => {
                if let Some(slot) = pod_spec.init_containers.as_mut().and_then(|v| v.get_mut(i)) {
                    *slot = super::converge::converge_rendered(slot, check, KERNEL_CHECK_ENV);
                }
            }
            (Some(check), None) => pod_spec
                .init_containers
                .get_or_insert_with(Vec::new)
                .push(check),
            (None, Some(i)) => {
                if let Some(v) = pod_spec.init_containers.as_mut() {
                    v.remove(i);
                    if v.is_empty() {
                        pod_spec.init_containers = None;
                    }
                }
            }
            (None, None) => {}
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::providers::Binding;
    use ic_shared::crd::{CacheBackend, CacheBackendSpec, IntegrationSpec, LmCacheSpec};
    use k8s_openapi::api::core::v1::PodSpec;

    fn pod(command: &[&str], args: &[&str]) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "vllm".into(),
                    image: Some("vllm/vllm-openai:v0.9.0".into()),
                    command: Some(command.iter().map(|s| s.to_string()).collect()),
                    args: (!args.is_empty()).then(|| args.iter().map(|s| s.to_string()).collect()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn cb(role: IntegrationRole) -> CacheBackend {
        CacheBackend::new(
            "cb",
            CacheBackendSpec {
                integration: Some(IntegrationSpec {
                    role: Some(role),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    }

    fn inject(
        p: &mut Pod,
        cb: &CacheBackend,
        binding: Option<&Binding>,
    ) -> Result<InjectReport, InjectError> {
        let ctx = InjectContext {
            backend: cb,
            binding,
            lmcache_worker_image: None,
            kernel_check_image: None,
        };
        VllmLmCache.inject_engine_config(&ctx, p, 0)
    }

    fn env(p: &Pod) -> Vec<(String, String)> {
        p.spec.as_ref().unwrap().containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn roles_map_to_kv_roles() {
        for (role, want) in [
            (IntegrationRole::ReadOnly, "kv_consumer"),
            (IntegrationRole::WriteOnly, "kv_producer"),
            (IntegrationRole::ReadWrite, "kv_both"),
        ] {
            let mut p = pod(&["vllm", "serve", "m"], &[]);
            inject(&mut p, &cb(role), None).unwrap();
            let c = &p.spec.as_ref().unwrap().containers[0];
            assert_eq!(
                c.args.as_ref().unwrap(),
                &vec![
                    "--kv-transfer-config".to_string(),
                    format!(r#"{{"kv_connector":"LMCacheConnectorV1","kv_role":"{want}"}}"#)
                ]
            );
        }
    }

    #[test]
    fn host_only_env_and_idempotency() {
        let mut p = pod(&["vllm", "serve", "m"], &[]);
        let b = cb(IntegrationRole::ReadWrite);
        inject(&mut p, &b, None).unwrap();
        assert_eq!(
            env(&p),
            vec![
                ("VLLM_USE_V1".into(), "1".into()),
                ("PYTHONHASHSEED".into(), "0".into()),
                ("LMCACHE_CHUNK_SIZE".into(), "256".into()),
                ("LMCACHE_LOCAL_CPU".into(), "True".into()),
                ("LMCACHE_MAX_LOCAL_CPU_SIZE".into(), "4".into()),
                ("INFERENCECACHE_FAIL_OPEN".into(), "true".into()),
            ]
        );
        // No GPU request: auto mode injects no kernel check.
        assert!(p.spec.as_ref().unwrap().init_containers.is_none());
        let once = p.clone();
        inject(&mut p, &b, None).unwrap();
        assert_eq!(p, once);
    }

    #[test]
    fn bindings_set_remote_url() {
        for (kind, url) in [
            (BindingKind::Lm, "lm://srv:8100"),
            (BindingKind::MooncakeStore, "mooncakestore://srv:8100"),
        ] {
            let mut p = pod(&["vllm", "serve", "m"], &[]);
            let binding = Binding {
                kind,
                host: "srv".into(),
                port: 8100,
            };
            inject(&mut p, &cb(IntegrationRole::ReadWrite), Some(&binding)).unwrap();
            let e = env(&p);
            assert!(e.contains(&("LMCACHE_REMOTE_URL".into(), url.into())));
            assert!(e.contains(&("LMCACHE_REMOTE_SERDE".into(), "naive".into())));
        }
        let mut p = pod(&["vllm", "serve", "m"], &[]);
        let resp = Binding {
            kind: BindingKind::Resp,
            host: "r".into(),
            port: 6379,
        };
        assert!(matches!(
            inject(&mut p, &cb(IntegrationRole::ReadWrite), Some(&resp)),
            Err(InjectError::UnsupportedBinding { .. })
        ));
    }

    #[test]
    fn lmcache_spec_drives_tunables() {
        let mut b = cb(IntegrationRole::ReadWrite);
        b.spec.lm_cache = Some(LmCacheSpec {
            chunk_size_tokens: Some(512),
            host_memory: Some(ic_shared::crd::LmCacheHostMemorySpec {
                capacity: Some(Quantity("1536Mi".into())),
            }),
            remote_serde: Some("cachegen".into()),
            ..Default::default()
        });
        let mut p = pod(&["vllm", "serve", "m"], &[]);
        let binding = Binding {
            kind: BindingKind::Lm,
            host: "s".into(),
            port: 1,
        };
        inject(&mut p, &b, Some(&binding)).unwrap();
        let e = env(&p);
        assert!(e.contains(&("LMCACHE_CHUNK_SIZE".into(), "512".into())));
        assert!(e.contains(&("LMCACHE_MAX_LOCAL_CPU_SIZE".into(), "1.5".into())));
        assert!(e.contains(&("LMCACHE_REMOTE_SERDE".into(), "cachegen".into())));
    }

    #[test]
    fn existing_connector_is_adopted_or_refused() {
        // Same connector, same role: untouched, never duplicated (underscore spelling).
        let json = r#"{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": {}}"#;
        let mut p = pod(&["vllm", "serve", "m", "--kv_transfer_config", json], &[]);
        inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
        let c = &p.spec.as_ref().unwrap().containers[0];
        assert_eq!(c.command.as_ref().unwrap()[4], json);
        assert!(c.args.is_none());

        // Same connector, other role: kv_role converged, other keys kept, `=` form kept.
        let mut p = pod(
            &[
                "vllm",
                "serve",
                "m",
                &format!("--kv-transfer-config={json}"),
            ],
            &[],
        );
        inject(&mut p, &cb(IntegrationRole::ReadOnly), None).unwrap();
        let c = &p.spec.as_ref().unwrap().containers[0];
        assert_eq!(
            c.command.as_ref().unwrap()[3],
            r#"--kv-transfer-config={"kv_connector":"LMCacheConnectorV1","kv_connector_extra_config":{},"kv_role":"kv_consumer"}"#
        );

        // A different connector fails.
        let mut p = pod(
            &[
                "vllm",
                "serve",
                "m",
                "--kv-transfer-config",
                r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#,
            ],
            &[],
        );
        let err = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "container \"vllm\" already sets --kv-transfer-config with kv_connector \"NixlConnector\"; refusing to replace the operator's connector with LMCacheConnectorV1"
        );
        // Invalid JSON, duplicates, missing values, expansions.
        for (args, want) in [
            (vec!["--kv-transfer-config", "nope"], "not a JSON object"),
            (
                vec!["--kv-transfer-config", "{}", "--kv_transfer_config={}"],
                "more than once",
            ),
            (vec!["--kv-transfer-config"], "has no value"),
            (vec!["--kv-transfer-config.kv_role=kv_both"], "malformed"),
        ] {
            let mut cmd = vec!["vllm", "serve", "m"];
            cmd.extend(args);
            let mut p = pod(&cmd, &[]);
            let err = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
        }
        let mut p = pod(
            &["sh", "-c", "vllm serve m --kv-transfer-config \"$KV\""],
            &[],
        );
        assert!(matches!(
            inject(&mut p, &cb(IntegrationRole::ReadWrite), None),
            Err(InjectError::OpaqueFlag { .. })
        ));
    }

    #[test]
    fn reserved_env_converges_and_tunables_are_kept() {
        let mut p = pod(&["vllm", "serve", "m"], &[]);
        p.spec.as_mut().unwrap().containers[0].env = Some(vec![
            env_var("PYTHONHASHSEED", "123"),
            env_var("LMCACHE_MAX_LOCAL_CPU_SIZE", "20"),
        ]);
        let r = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
        let e = env(&p);
        // A fixed seed is the operator's (llm-d's scorer must match it), kept with a warning.
        assert_eq!(e[0], ("PYTHONHASHSEED".into(), "123".into()));
        assert_eq!(e[1], ("LMCACHE_MAX_LOCAL_CPU_SIZE".into(), "20".into()));
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r
            .warnings
            .iter()
            .any(|w| w.contains("PYTHONHASHSEED=123") && w.contains("same fixed value")));
    }

    #[test]
    fn hash_seed_set_only_when_absent_or_random() {
        for (given, want, warns) in [
            (None, "0", 0),
            (Some("random"), "0", 1),
            (Some(""), "0", 0),
            (Some("0"), "0", 0),
            (Some("42"), "42", 1),
            (Some("4294967296"), "0", 1),
            (Some("abc"), "0", 1),
        ] {
            let mut p = pod(&["vllm", "serve", "m"], &[]);
            if let Some(v) = given {
                p.spec.as_mut().unwrap().containers[0].env =
                    Some(vec![env_var("PYTHONHASHSEED", v)]);
            }
            let r = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
            let e = env(&p);
            assert!(
                e.contains(&("PYTHONHASHSEED".into(), want.into())),
                "{given:?}: {e:?}"
            );
            assert_eq!(
                r.warnings
                    .iter()
                    .filter(|w| w.contains("PYTHONHASHSEED"))
                    .count(),
                warns,
                "{given:?}: {:?}",
                r.warnings
            );
            let once = p.clone();
            inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
            assert_eq!(p, once, "{given:?} converges");
        }
    }

    #[test]
    fn tensor_parallel_without_shm_warns() {
        let mut p = pod(&["vllm", "serve", "m", "--tensor-parallel-size", "2"], &[]);
        let r = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
        assert!(
            r.warnings
                .iter()
                .any(|w| w.contains("tensor-parallel size 2 without a /dev/shm")),
            "{:?}",
            r.warnings
        );
        // Mounted under any spelling: no warning.
        let mut p = pod(&["vllm", "serve", "m", "-tp", "2"], &[]);
        p.spec.as_mut().unwrap().containers[0].volume_mounts =
            Some(vec![k8s_openapi::api::core::v1::VolumeMount {
                name: "dshm".into(),
                mount_path: "/dev//shm/".into(),
                ..Default::default()
            }]);
        let r = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
        assert!(
            r.warnings.iter().all(|w| !w.contains("/dev/shm")),
            "{:?}",
            r.warnings
        );
        // TP 1: no warning.
        let mut p = pod(&["vllm", "serve", "m"], &[]);
        let r = inject(&mut p, &cb(IntegrationRole::ReadWrite), None).unwrap();
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }

    #[test]
    fn fail_open_false_is_mirrored() {
        let mut b = cb(IntegrationRole::ReadWrite);
        b.spec.integration.as_mut().unwrap().fail_open = Some(false);
        let mut p = pod(&["vllm", "serve", "m"], &[]);
        inject(&mut p, &b, None).unwrap();
        assert!(env(&p).contains(&(ENV_FAIL_OPEN.into(), "false".into())));
    }

    fn gpu_pod() -> Pod {
        let mut p = pod(&["/opt/venv/bin/vllm", "serve", "m"], &[]);
        p.spec.as_mut().unwrap().containers[0].resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([(
                "nvidia.com/gpu".to_string(),
                Quantity("1".into()),
            )])),
            ..Default::default()
        });
        p
    }

    fn check_mode(p: &Pod) -> Option<String> {
        p.spec
            .as_ref()
            .unwrap()
            .init_containers
            .iter()
            .flatten()
            .find(|c| c.name == KERNEL_CHECK_CONTAINER)
            .map(|c| {
                c.env
                    .iter()
                    .flatten()
                    .find(|e| e.name == ENV_KERNEL_CHECK_MODE)
                    .and_then(|e| e.value.clone())
                    .unwrap()
            })
    }

    #[test]
    fn kernel_check_modes() {
        for (annotation, gpu, want) in [
            (None, true, Some("report-only")),
            (None, false, None),
            (Some("auto"), true, Some("report-only")),
            (Some("auto"), false, None),
            (Some("report-only"), false, Some("report-only")),
            (Some("strict"), false, Some("strict")),
            (Some("strict"), true, Some("strict")),
            (Some("off"), true, None),
            (Some("strcit"), true, Some("report-only")),
        ] {
            let mut b = cb(IntegrationRole::ReadWrite);
            if let Some(a) = annotation {
                b.metadata.annotations = Some(BTreeMap::from([(
                    KERNEL_CHECK_ANNOTATION.to_string(),
                    a.to_string(),
                )]));
            }
            let mut p = if gpu {
                gpu_pod()
            } else {
                pod(&["vllm", "serve", "m"], &[])
            };
            inject(&mut p, &b, None).unwrap();
            assert_eq!(check_mode(&p).as_deref(), want, "{annotation:?} gpu={gpu}");
            if want.is_some() {
                let check = &p.spec.as_ref().unwrap().init_containers.as_ref().unwrap()[0];
                let py = &check.command.as_ref().unwrap()[0];
                assert_eq!(
                    py,
                    if gpu {
                        "/opt/venv/bin/python3"
                    } else {
                        "python3"
                    }
                );
                assert!(check.resources.as_ref().unwrap().limits.is_none());
            }
            // Converges.
            let once = p.clone();
            inject(&mut p, &b, None).unwrap();
            assert_eq!(p, once);
        }
    }

    #[test]
    fn foreign_kernel_check_name_is_refused() {
        let mut p = gpu_pod();
        p.spec.as_mut().unwrap().init_containers = Some(vec![Container {
            name: KERNEL_CHECK_CONTAINER.into(),
            ..Default::default()
        }]);
        assert!(matches!(
            inject(&mut p, &cb(IntegrationRole::ReadWrite), None),
            Err(InjectError::ReservedName { .. })
        ));
    }
}
