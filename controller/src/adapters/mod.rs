//! Runtime adapters (engine-pod wiring) and storage-provider adapters behind one registry
//! (spec 000 "Cache hierarchy and ownership", "Reserved declarations and admission hard-reject",
//! "Mutating Pod webhook", "SGLang engine support", "SGLang native HiCache").
//!
//! The registry answers what admission needs to know about a (runtime, type) pair: whether it is
//! supported (SupportedPairs), which engine args and env vars the adapter owns (ReservedArgs,
//! ReservedEnv), and which remote-storage bindings it accepts (SupportsBinding). The Pod webhook
//! asks it to wire an engine pod (InjectEngineConfig).
//!
//! | pair | module | bindings | reserved args | reserved env |
//! |---|---|---|---|---|
//! | (VLLM, LMCache) | [`vllm_lmcache`] | host-only, `lm`, `mooncakestore` | `--kv-transfer-config` | `VLLM_USE_V1`, `LMCACHE_REMOTE_URL`, `INFERENCECACHE_FAIL_OPEN`, `PYTHONHASHSEED` |
//! | (SGLang, LMCache) | [`sglang_lmcache_mp`] | host-only, `resp` | `--enable-lmcache`, `--lmcache-config-file` | `LMCACHE_USE_EXPERIMENTAL`, `INFERENCECACHE_FAIL_OPEN` |
//! | (SGLang, SGLangHiCache) | [`sglang_hicache`] | host-only | `--enable-hierarchical-cache` | — |
//!
//! Storage providers ([`providers`]) turn `spec.remoteStorage` into a [`Binding`]; engine
//! command lines are found and edited by [`command`]; `spec.integration.engineOverrides` is
//! applied by [`overrides`].

pub mod converge;
pub mod engine_release;
pub mod overrides;
pub mod providers;
pub mod sglang_hicache;
pub mod sglang_lmcache_mp;
pub mod vllm_lmcache;

use std::collections::BTreeMap;

use ic_shared::crd::{CacheBackend, CacheType, Runtime};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, Pod, SeccompProfile, SecurityContext,
};

use crate::engine::command::CommandError;
use crate::engine::container::{select_engine_container, SelectError, ENV_COMPONENT};
pub use providers::{resolve_binding, Binding, BindingError, EndpointError};

/// The structured binding a storage-provider adapter emits (spec: `lm`, `resp`, `mooncakestore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingKind {
    /// `lm://host:port` — a standalone LMCache server.
    Lm,
    /// RESP (Redis protocol) `host:port`.
    Resp,
    /// `mooncakestore://host:port` — a Mooncake master.
    MooncakeStore,
}

/// CacheBackend annotation selecting the lmcache-kernel-check mode (spec "LMCache client kernels
/// ↔ engine-image CUDA / vLLM alignment"): `auto` (default), `report-only`, `strict`, `off`.
pub const KERNEL_CHECK_ANNOTATION: &str = "inferencecache.io/lmcache-kernel-check";
/// The values [`KERNEL_CHECK_ANNOTATION`] accepts.
pub const KERNEL_CHECK_VALUES: &[&str] = &["auto", "report-only", "strict", "off"];
/// Env var `INFERENCECACHE_FAIL_OPEN`: mirror of `spec.integration.failOpen` on the engine.
pub const ENV_FAIL_OPEN: &str = "INFERENCECACHE_FAIL_OPEN";

/// What an adapter needs to wire one engine pod.
#[derive(Debug, Clone, Copy)]
pub struct InjectContext<'a> {
    /// The matched CacheBackend.
    pub backend: &'a CacheBackend,
    /// The resolved remote binding (`None` = host-only).
    pub binding: Option<&'a Binding>,
    /// Controller-wide default LMCache MP worker image (`spec.lmCache.workerImage` wins; the
    /// engine image is the fallback).
    pub lmcache_worker_image: Option<&'a str>,
    /// Image of the lmcache-kernel-check init container (`None`: the engine image, which is what
    /// the check is meant to test).
    pub kernel_check_image: Option<&'a str>,
}

/// What an adapter reports besides the mutated pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InjectReport {
    /// Operator-facing notes (returned as admission warnings).
    pub warnings: Vec<String>,
}

/// Why an adapter refused to wire a pod. The Pod webhook turns every variant into a fail-open
/// admit with this message as the reason, and discards any partial change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    /// The engine command could not be found or edited safely.
    #[error(transparent)]
    Command(#[from] CommandError),
    /// No container launches the engine.
    #[error("no engine container found for {runtime}: {detail}")]
    NoEngineContainer {
        /// Runtime wire spelling.
        runtime: &'static str,
        /// Per-container findings.
        detail: String,
    },
    /// Several containers launch the engine and none is named after the runtime.
    #[error("several containers launch {runtime} ({containers}); name the engine container {preferred:?}")]
    AmbiguousEngine {
        /// Runtime wire spelling.
        runtime: &'static str,
        /// Candidate container names, comma-separated.
        containers: String,
        /// The name that disambiguates.
        preferred: &'static str,
    },
    /// SGLang HiCache: a multi-container pod without a container named `sglang`.
    #[error("SGLang HiCache: a multi-container pod must name its engine container \"sglang\" (containers: {containers})")]
    HiCacheEngineName {
        /// Container names, comma-separated.
        containers: String,
    },
    /// The engine already runs a different KV connector.
    #[error("container {container:?} already sets --kv-transfer-config with kv_connector {connector:?}; refusing to replace the operator's connector with LMCacheConnectorV1")]
    ExistingConnector {
        /// Container name.
        container: String,
        /// The connector found.
        connector: String,
    },
    /// An existing `--kv-transfer-config` value is not a JSON object.
    #[error("container {container:?}: existing --kv-transfer-config value is not a JSON object ({detail})")]
    InvalidConnectorJson {
        /// Container name.
        container: String,
        /// Parse error.
        detail: String,
    },
    /// An adapter-managed flag appears more than once.
    #[error("container {container:?} sets {flag} more than once")]
    DuplicateFlag {
        /// Container name.
        container: String,
        /// Flag (long form).
        flag: String,
    },
    /// An adapter-managed flag that takes a value has none.
    #[error("container {container:?}: {flag} has no value")]
    MissingFlagValue {
        /// Container name.
        container: String,
        /// Flag.
        flag: String,
    },
    /// An adapter-managed flag is malformed (a value on a boolean flag, a value the engine
    /// would reject, dotted sub-keys the adapter cannot merge).
    #[error("container {container:?}: malformed {flag} argument {value:?}")]
    MalformedFlag {
        /// Container name.
        container: String,
        /// Flag.
        flag: String,
        /// The argument as written.
        value: String,
    },
    /// A shell variable among the engine's arguments sets an adapter-managed flag.
    #[error("container {container:?}: the engine command expands ${variable}, which sets {flag}; refusing to add a second one")]
    HiddenFlag {
        /// Container name.
        container: String,
        /// The variable.
        variable: String,
        /// The flag it carries.
        flag: String,
    },
    /// An adapter-managed flag's value is a shell expansion the webhook cannot read.
    #[error("container {container:?}: the value of {flag} is a shell expansion ({value}) that cannot be checked")]
    OpaqueFlag {
        /// Container name.
        container: String,
        /// Flag.
        flag: String,
        /// The raw word.
        value: String,
    },
    /// The pod already carries an object under a name the adapter reserves, and the adapter did
    /// not render it.
    #[error("the pod already has a {what} named {name:?} that inference-cache did not render; rename it to get the pod wired")]
    ReservedName {
        /// `init container`, `volume`, `mount path`, `container`.
        what: &'static str,
        /// The reserved name.
        name: String,
    },
    /// The engine mounts `/dev/shm` read-only.
    #[error("container {container:?} mounts /dev/shm (volume {volume:?}) read-only; the LMCache MP data path writes there")]
    ReadOnlyShm {
        /// Container name.
        container: String,
        /// Volume name.
        volume: String,
    },
    /// The engine mounts `/dev/shm` from a read-only volume type.
    #[error("container {container:?} mounts /dev/shm from a {kind} volume ({volume:?}); the LMCache MP data path needs a writable tmpfs")]
    ShmVolumeSource {
        /// Container name.
        container: String,
        /// Volume name.
        volume: String,
        /// `configMap`, `secret`, `downwardAPI`, `projected`.
        kind: &'static str,
    },
    /// SGLang HiCache: an existing argument differs from the CacheBackend.
    #[error("SGLang HiCache: container {container:?} sets {flag} {have}, the CacheBackend asks for {want}")]
    HiCacheConflict {
        /// Container name.
        container: String,
        /// Flag.
        flag: String,
        /// What the pod has.
        have: String,
        /// What the backend renders.
        want: String,
    },
    /// Another cache integration's flags are already on the engine.
    #[error("container {container:?} already sets {flag}: {detail}")]
    ConflictingIntegration {
        /// Container name.
        container: String,
        /// The conflicting flag.
        flag: String,
        /// Why it conflicts.
        detail: &'static str,
    },
    /// A CacheBackend field the adapter needs is missing or invalid (admission normally
    /// rejects it; the object may predate the rule).
    #[error("CacheBackend field {field} is invalid: {detail}")]
    InvalidSpec {
        /// Field path.
        field: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The adapter does not accept this binding.
    #[error("adapter {adapter} does not accept a {binding} binding")]
    UnsupportedBinding {
        /// Adapter name.
        adapter: &'static str,
        /// Binding (`lm`, `resp`, `mooncakestore`, `host-only`).
        binding: String,
    },
    /// The engine's release (image tag or recorded `--version`) predates a flag the adapter
    /// would inject ([`engine_release`] has the table).
    #[error("container {container:?} runs {detail}")]
    UnsupportedRelease {
        /// Container name.
        container: String,
        /// `<engine> <version> (from <where>), which has no <flag> (added in <engine>
        /// <since>): <effect>; upgrade …`.
        detail: String,
    },
    /// The engine container index is out of range (an internal error).
    #[error("internal error: engine container index {0} out of range")]
    BadContainerIndex(usize),
}

impl From<SelectError> for InjectError {
    /// The engine container could not be chosen: the same variant and message as before the
    /// choice moved to [`crate::engine::container`].
    fn from(e: SelectError) -> Self {
        match e {
            SelectError::NoEngineContainer { runtime, detail } => {
                InjectError::NoEngineContainer { runtime, detail }
            }
            SelectError::AmbiguousEngine {
                runtime,
                containers,
                preferred,
            } => InjectError::AmbiguousEngine {
                runtime,
                containers,
                preferred,
            },
        }
    }
}

/// One runtime adapter: how a (runtime, cache type) pair wires an engine pod.
pub trait RuntimeAdapter: Send + Sync {
    /// Display name, e.g. `vllm+lmcache`.
    fn name(&self) -> &'static str;
    /// Runtime this adapter wires.
    fn runtime(&self) -> Runtime;
    /// Cache type this adapter wires.
    fn cache_type(&self) -> CacheType;
    /// Engine flags the adapter owns (long form, e.g. `--kv-transfer-config`); engineOverrides may
    /// not set them.
    fn reserved_args(&self) -> &'static [&'static str];
    /// Engine env vars the adapter owns; engineOverrides may not set them.
    fn reserved_env(&self) -> &'static [&'static str];
    /// Whether the adapter accepts this remote binding (`None` = host-only).
    fn supports_binding(&self, binding: Option<BindingKind>) -> bool;

    /// Engine env vars whose values the adapter derives from the CacheBackend (the binding and
    /// tunables). A pod wired by another backend loses them before this adapter runs, so the
    /// old backend's settings do not survive a re-admission. Default: none.
    fn backend_env(&self) -> &'static [&'static str] {
        &[]
    }

    /// Index of the engine container in `pod.spec.containers`. The default finds the one
    /// container that launches this runtime (see [`select_engine_container`]).
    fn select_engine(&self, pod: &Pod) -> Result<usize, InjectError> {
        Ok(select_engine_container(pod, self.runtime())?)
    }

    /// Wires the engine container `engine` of `pod` (InjectEngineConfig). Must converge: run on
    /// its own output it changes nothing. On error the caller discards `pod`.
    fn inject_engine_config(
        &self,
        ctx: &InjectContext<'_>,
        pod: &mut Pod,
        engine: usize,
    ) -> Result<InjectReport, InjectError>;
}

/// The built-in adapters.
pub struct Registry {
    adapters: Vec<Box<dyn RuntimeAdapter>>,
}

impl Registry {
    /// A registry over the given adapters (tests register fakes).
    pub fn new(adapters: Vec<Box<dyn RuntimeAdapter>>) -> Self {
        Registry { adapters }
    }

    /// The shipping adapters: (VLLM, LMCache), (SGLang, LMCache), (SGLang, SGLangHiCache).
    pub fn builtin() -> Self {
        Registry::new(vec![
            Box::new(vllm_lmcache::VllmLmCache),
            Box::new(sglang_lmcache_mp::SglangLmCacheMp),
            Box::new(sglang_hicache::SglangHiCache),
        ])
    }

    /// The adapter for a pair, if supported.
    pub fn lookup(&self, runtime: Runtime, cache_type: CacheType) -> Option<&dyn RuntimeAdapter> {
        self.adapters
            .iter()
            .find(|a| a.runtime() == runtime && a.cache_type() == cache_type)
            .map(|a| a.as_ref())
    }

    /// Every supported pair, in registration order.
    pub fn supported_pairs(&self) -> Vec<(Runtime, CacheType)> {
        self.adapters
            .iter()
            .map(|a| (a.runtime(), a.cache_type()))
            .collect()
    }

    /// `SupportedPairs` as text for messages: `VLLM/LMCache, SGLang/LMCache, …`.
    pub fn supported_pairs_text(&self) -> String {
        self.supported_pairs()
            .iter()
            .map(|(r, t)| format!("{}/{}", r.as_str(), t.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Default for Registry {
    fn default() -> Self {
        Registry::builtin()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.adapters.iter().map(|a| a.name()))
            .finish()
    }
}

/// Tokens per LMCache chunk that `pod` runs with, for `runtime` with `engine` its engine
/// container: the pod's own wiring — vLLM's literal `LMCACHE_CHUNK_SIZE`
/// ([`vllm_lmcache::wired_chunk_size_tokens`]), the SGLang MP worker's `--chunk-size`
/// ([`sglang_lmcache_mp::wired_chunk_size_tokens`]) — else `backend`'s current
/// `spec.lmCache.chunkSizeTokens` (default 256), for a pod whose wiring names no literal value.
/// A spec edit since the pod was wired does not change a running engine's chunks, so the pod's
/// own value wins. The node plan's `offloadChunkTokens` and the kvevent-subscriber sidecar's
/// `--offload-chunk-tokens` both take it from here (docs/kv-events.md "Chunked offload tiers").
pub fn lmcache_chunk_tokens(
    pod: &Pod,
    runtime: Runtime,
    engine: Option<&Container>,
    backend: &CacheBackend,
) -> Option<u32> {
    let wired = match runtime {
        Runtime::Vllm => engine.and_then(vllm_lmcache::wired_chunk_size_tokens),
        Runtime::SgLang => sglang_lmcache_mp::wired_chunk_size_tokens(pod),
    };
    wired.or_else(|| {
        let spec = backend
            .spec
            .lm_cache
            .as_ref()
            .map_or(ic_shared::crd::DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS, |l| {
                l.effective_chunk_size_tokens()
            });
        u32::try_from(spec).ok()
    })
}

/// `host-only` or the binding kind, for messages.
pub fn binding_label(binding: Option<BindingKind>) -> String {
    binding.map_or_else(|| "host-only".to_string(), |k| k.to_string())
}

/// The engine container, mutable.
pub(crate) fn engine_mut(pod: &mut Pod, engine: usize) -> Result<&mut Container, InjectError> {
    pod.spec
        .as_mut()
        .and_then(|s| s.containers.get_mut(engine))
        .ok_or(InjectError::BadContainerIndex(engine))
}

/// The engine container.
pub(crate) fn engine_ref(pod: &Pod, engine: usize) -> Result<&Container, InjectError> {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.get(engine))
        .ok_or(InjectError::BadContainerIndex(engine))
}

/// A plain `name=value` env var.
pub(crate) fn env_var(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        value_from: None,
    }
}

/// Sets `name=value` on `c`, replacing an existing entry (its `valueFrom` too) in place, or
/// appending. Used for reserved env, which converges on the adapter's value.
pub(crate) fn upsert_env(c: &mut Container, name: &str, value: &str) {
    let env = c.env.get_or_insert_with(Vec::new);
    let mut seen = false;
    env.retain_mut(|e| {
        if e.name != name {
            return true;
        }
        if seen {
            return false; // drop duplicates of a reserved name
        }
        seen = true;
        *e = env_var(name, value);
        true
    });
    if !seen {
        env.push(env_var(name, value));
    }
}

/// Appends `name=value` unless the container already defines `name`; a kept value that differs
/// from the rendered one is reported in `warnings`. Used for tunables (chunk size, host memory,
/// serde): the pod template's own value wins.
pub(crate) fn default_env(c: &mut Container, name: &str, value: &str, warnings: &mut Vec<String>) {
    let env = c.env.get_or_insert_with(Vec::new);
    match env.iter().find(|e| e.name == name) {
        Some(existing) => {
            let kept = existing
                .value
                .clone()
                .unwrap_or_else(|| "<valueFrom>".to_string());
            if existing.value.as_deref() != Some(value) {
                warnings.push(format!(
                    "container {:?}: env {name}={kept} from the pod template is kept (the CacheBackend renders {value})",
                    c.name
                ));
            }
        }
        None => env.push(env_var(name, value)),
    }
}

/// Whether container `c` carries `ENV_COMPONENT=component` (rendered by this webhook).
pub(crate) fn is_rendered(c: &Container, component: &str) -> bool {
    c.env
        .iter()
        .flatten()
        .any(|e| e.name == ENV_COMPONENT && e.value.as_deref() == Some(component))
}

/// Whether the container requests a GPU (a non-zero `*/gpu` resource in requests or limits).
pub(crate) fn requests_gpu(c: &Container) -> bool {
    let Some(r) = c.resources.as_ref() else {
        return false;
    };
    let gpu =
        |m: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
            m.iter()
                .flatten()
                .any(|(k, v)| k.ends_with("/gpu") && parse_quantity(&v.0).is_some_and(|q| q > 0.0))
        };
    gpu(&r.requests) || gpu(&r.limits)
}

/// A security context for a container the webhook adds that runs the engine image: the engine
/// container's own (so a pod that passes a restricted Pod Security profile still does, and the
/// container runs as the same user).
pub(crate) fn engine_image_security_context(engine: &Container) -> Option<SecurityContext> {
    engine.security_context.clone()
}

/// A hardened security context for a container the webhook adds from its own image (the
/// kvevent-subscriber): passes the `restricted` Pod Security profile on its own.
pub(crate) fn hardened_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            add: None,
        }),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_string(),
            localhost_profile: None,
        }),
        ..Default::default()
    }
}

pub use crate::quantity::parse_quantity;

/// `spec.lmCache.hostMemory.capacity` (default `4Gi`) in GiB. Errors when it is not a positive
/// quantity.
pub(crate) fn host_memory_gib(cb: &CacheBackend) -> Result<f64, InjectError> {
    let q = cb
        .spec
        .lm_cache
        .clone()
        .unwrap_or_default()
        .effective_host_memory_capacity();
    match parse_quantity(&q.0) {
        Some(bytes) if bytes > 0.0 => Ok(bytes / 1024f64.powi(3)),
        _ => Err(InjectError::InvalidSpec {
            field: "spec.lmCache.hostMemory.capacity",
            detail: format!("{:?} is not a positive quantity", q.0),
        }),
    }
}

/// Renders a GiB amount as LMCache expects it: `4`, `1.5`, `9.313`.
pub(crate) fn gib_text(gib: f64) -> String {
    if (gib - gib.round()).abs() < 1e-9 {
        format!("{}", gib.round() as i64)
    } else {
        let s = format!("{gib:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_registry_pairs_and_reservations() {
        let r = Registry::builtin();
        assert_eq!(
            r.supported_pairs(),
            vec![
                (Runtime::Vllm, CacheType::LMCache),
                (Runtime::SgLang, CacheType::LMCache),
                (Runtime::SgLang, CacheType::SGLangHiCache),
            ]
        );
        assert_eq!(
            r.supported_pairs_text(),
            "VLLM/LMCache, SGLang/LMCache, SGLang/SGLangHiCache"
        );
        assert!(r.lookup(Runtime::Vllm, CacheType::SGLangHiCache).is_none());
        let v = r.lookup(Runtime::Vllm, CacheType::LMCache).unwrap();
        assert_eq!(v.reserved_args(), &["--kv-transfer-config"]);
        assert_eq!(
            v.reserved_env(),
            &[
                "VLLM_USE_V1",
                "LMCACHE_REMOTE_URL",
                "INFERENCECACHE_FAIL_OPEN",
                "PYTHONHASHSEED"
            ]
        );
        assert!(v.supports_binding(None));
        assert!(v.supports_binding(Some(BindingKind::Lm)));
        assert!(v.supports_binding(Some(BindingKind::MooncakeStore)));
        assert!(!v.supports_binding(Some(BindingKind::Resp)));
        let s = r.lookup(Runtime::SgLang, CacheType::LMCache).unwrap();
        assert_eq!(
            s.reserved_args(),
            &["--enable-lmcache", "--lmcache-config-file"]
        );
        assert_eq!(
            s.reserved_env(),
            &["LMCACHE_USE_EXPERIMENTAL", "INFERENCECACHE_FAIL_OPEN"]
        );
        assert!(s.supports_binding(None));
        assert!(s.supports_binding(Some(BindingKind::Resp)));
        assert!(!s.supports_binding(Some(BindingKind::Lm)));
        assert!(!s.supports_binding(Some(BindingKind::MooncakeStore)));
        let h = r.lookup(Runtime::SgLang, CacheType::SGLangHiCache).unwrap();
        assert!(h.supports_binding(None));
        assert!(!h.supports_binding(Some(BindingKind::Resp)));
        assert!(h.reserved_env().is_empty());
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("4Gi"), Some(4.0 * 1024f64.powi(3)));
        assert_eq!(
            parse_quantity("1536Mi").map(|b| b / 1024f64.powi(3)),
            Some(1.5)
        );
        assert_eq!(parse_quantity("1e3"), Some(1000.0));
        assert_eq!(parse_quantity("250m"), Some(0.25));
        assert_eq!(parse_quantity("2"), Some(2.0));
        assert_eq!(parse_quantity("x"), None);
        assert_eq!(parse_quantity("4Gb"), None);
        assert_eq!(gib_text(4.0), "4");
        assert_eq!(gib_text(1.5), "1.5");
        assert_eq!(gib_text(10e9 / 1024f64.powi(3)), "9.313");
    }

    #[test]
    fn env_helpers() {
        let mut c = Container {
            name: "e".into(),
            env: Some(vec![
                env_var("A", "1"),
                EnvVar {
                    name: "B".into(),
                    value: None,
                    value_from: Some(Default::default()),
                },
                env_var("B", "dup"),
            ]),
            ..Default::default()
        };
        upsert_env(&mut c, "B", "2");
        upsert_env(&mut c, "C", "3");
        let mut w = Vec::new();
        default_env(&mut c, "A", "9", &mut w);
        default_env(&mut c, "D", "4", &mut w);
        let got: Vec<(String, Option<String>)> = c
            .env
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.value))
            .collect();
        assert_eq!(
            got,
            vec![
                ("A".into(), Some("1".into())),
                ("B".into(), Some("2".into())),
                ("C".into(), Some("3".into())),
                ("D".into(), Some("4".into())),
            ]
        );
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("A=1"));
    }
}
