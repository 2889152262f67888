//! Runtime adapters (engine-pod wiring) and storage-provider adapters behind one registry
//! (spec 000 "Cache hierarchy and ownership", "Runtime adapters").
//!
//! The registry answers what admission needs to know about a (runtime, type) pair: whether it is
//! supported (SupportedPairs), which engine args and env vars the adapter owns (ReservedArgs,
//! ReservedEnv), and which remote-storage bindings it accepts (SupportsBinding). The Pod webhook
//! asks it to wire an engine pod (InjectEngineConfig).

use ic_shared::crd::{CacheType, Runtime};

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
}
