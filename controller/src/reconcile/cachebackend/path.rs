//! Which lifecycle path a CacheBackend is on (spec 000 "Conditions": the published condition
//! set depends on the integration mode and type).

use ic_shared::crd::{CacheBackendSpec, CacheType, Ownership, RemoteProvider, Runtime};

/// The lifecycle path of a CacheBackend; decides what is provisioned and which conditions are
/// published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendPath {
    /// Offload with a Managed `remoteStorage`: a provider workload, Service (and HPA) are
    /// rendered; all seven conditions may be published.
    Managed(RemoteProvider),
    /// Offload, `type: LMCache`, no `remoteStorage`: nothing provisioned; Ready (base reason
    /// HostOnlyActive) / Degraded / Progressing plus the engine-side advisory conditions.
    HostOnly,
    /// `integration.mode: EventsOnly`: nothing provisioned; exactly Ready / Degraded /
    /// Progressing (base reason EventsOnlyActive).
    EventsOnly,
    /// `remoteStorage.ownership: External`: nothing provisioned; Ready + Progressing from the
    /// endpoint's shape check only.
    External(RemoteProvider),
    /// SGLang native HiCache or an unsupported (runtime, type) pair: nothing provisioned and no
    /// readiness conditions published (spec "SGLang native HiCache": no Ready condition); HiCache
    /// gets only the advisory `HiCacheHostTier` ([`super::host_tier`]).
    Inert,
}

/// Coarse path kind, for remembering the previous path across reconciles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathKind {
    /// [`BackendPath::Managed`].
    Managed,
    /// [`BackendPath::HostOnly`].
    HostOnly,
    /// [`BackendPath::EventsOnly`].
    EventsOnly,
    /// [`BackendPath::External`].
    External,
    /// [`BackendPath::Inert`].
    Inert,
}

impl PathKind {
    /// The name persisted in `status.observedPath`.
    pub fn as_str(self) -> &'static str {
        match self {
            PathKind::Managed => "Managed",
            PathKind::HostOnly => "HostOnly",
            PathKind::EventsOnly => "EventsOnly",
            PathKind::External => "External",
            PathKind::Inert => "Inert",
        }
    }

    /// From `status.observedPath`; `None` for anything else.
    pub fn parse(s: &str) -> Option<PathKind> {
        [
            PathKind::Managed,
            PathKind::HostOnly,
            PathKind::EventsOnly,
            PathKind::External,
            PathKind::Inert,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

impl BackendPath {
    /// The coarse kind.
    pub fn kind(self) -> PathKind {
        match self {
            BackendPath::Managed(_) => PathKind::Managed,
            BackendPath::HostOnly => PathKind::HostOnly,
            BackendPath::EventsOnly => PathKind::EventsOnly,
            BackendPath::External(_) => PathKind::External,
            BackendPath::Inert => PathKind::Inert,
        }
    }

    /// Paths the KV-event readiness gate composes with (managed, host-only, events-only).
    pub fn gate_capable(self) -> bool {
        matches!(
            self,
            BackendPath::Managed(_) | BackendPath::HostOnly | BackendPath::EventsOnly
        )
    }

    /// Paths that wire an engine-side KV connector (so the engine-side advisory conditions
    /// EngineKernelsHealthy, T2Degraded and EngineCompatibility apply).
    pub fn wires_connector(self) -> bool {
        matches!(self, BackendPath::Managed(_) | BackendPath::HostOnly)
    }
}

/// The supported (runtime, type) pairs (spec "Validating": VLLM/LMCache, SGLang/LMCache,
/// SGLang/SGLangHiCache).
pub fn supported_pair(runtime: Runtime, cache_type: CacheType) -> bool {
    matches!(
        (runtime, cache_type),
        (Runtime::Vllm, CacheType::LMCache)
            | (Runtime::SgLang, CacheType::LMCache)
            | (Runtime::SgLang, CacheType::SGLangHiCache)
    )
}

/// Classifies a spec. Events-only wins over everything (admission forbids remoteStorage
/// there); then unsupported pairs and HiCache are inert; then remoteStorage ownership decides.
pub fn classify(spec: &CacheBackendSpec) -> BackendPath {
    if spec.is_events_only() {
        return BackendPath::EventsOnly;
    }
    let cache_type = spec.effective_type();
    if !supported_pair(spec.runtime, cache_type) || cache_type == CacheType::SGLangHiCache {
        return BackendPath::Inert;
    }
    match spec.remote_storage.as_ref() {
        None => BackendPath::HostOnly,
        Some(rs) => match rs.ownership {
            Ownership::External => BackendPath::External(rs.provider),
            Ownership::Managed => BackendPath::Managed(rs.provider),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ic_shared::crd::{IntegrationMode, IntegrationSpec, RemoteStorageSpec};

    #[test]
    fn classifies_every_shape() {
        let mut spec = CacheBackendSpec::default();
        assert_eq!(classify(&spec), BackendPath::HostOnly);
        spec.remote_storage = Some(RemoteStorageSpec {
            provider: RemoteProvider::Mooncake,
            ownership: Ownership::Managed,
            ..Default::default()
        });
        assert_eq!(
            classify(&spec),
            BackendPath::Managed(RemoteProvider::Mooncake)
        );
        if let Some(rs) = spec.remote_storage.as_mut() {
            rs.ownership = Ownership::External;
        }
        assert_eq!(
            classify(&spec),
            BackendPath::External(RemoteProvider::Mooncake)
        );
        spec.integration = Some(IntegrationSpec {
            mode: Some(IntegrationMode::EventsOnly),
            ..Default::default()
        });
        assert_eq!(classify(&spec), BackendPath::EventsOnly);
        let hicache = CacheBackendSpec {
            runtime: Runtime::SgLang,
            type_: Some(CacheType::SGLangHiCache),
            ..Default::default()
        };
        assert_eq!(classify(&hicache), BackendPath::Inert);
        let unsupported = CacheBackendSpec {
            runtime: Runtime::Vllm,
            type_: Some(CacheType::SGLangHiCache),
            ..Default::default()
        };
        assert_eq!(classify(&unsupported), BackendPath::Inert);
    }
}
