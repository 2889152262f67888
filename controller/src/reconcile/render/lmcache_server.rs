//! The standalone LMCache server provider (`lm://` binding; spec 000 "LMCache server / client
//! version alignment"). The default image is pinned, never floating.

use ic_shared::crd::{RemoteProvider, RemoteStorageSpec};
use k8s_openapi::api::core::v1::{Container, ContainerPort, ResourceRequirements, ServicePort};

use super::{service_port, tcp_probe, ProviderRenderer};

/// Default standalone server image (pinned; must be wire-compatible with the engine's client).
pub const DEFAULT_IMAGE: &str = "lmcache/standalone:v0.4.7";
/// Port the server listens on.
pub const PORT: i32 = 65432;

/// Default command line: `lmcache_server <host> <port> <storage>`.
pub fn default_command() -> Vec<String> {
    ["lmcache_server", "0.0.0.0", "65432", "cpu"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// The LMCacheServer renderer.
#[derive(Debug, Clone, Copy)]
pub struct LmCacheServer;

impl ProviderRenderer for LmCacheServer {
    fn provider(&self) -> RemoteProvider {
        RemoteProvider::LMCacheServer
    }

    fn slug(&self) -> &'static str {
        "lmcache-server"
    }

    fn resources_block<'a>(&self, rs: &'a RemoteStorageSpec) -> Option<&'a ResourceRequirements> {
        rs.lm_cache_server
            .as_ref()
            .and_then(|r| r.resources.as_ref())
    }

    fn container(&self, rs: &RemoteStorageSpec, resources: ResourceRequirements) -> Container {
        let spec = rs.lm_cache_server.as_ref();
        let image = spec
            .and_then(|s| s.image.clone())
            .filter(|i| !i.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_IMAGE.to_string());
        let command = spec
            .and_then(|s| s.command.clone())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(default_command);
        Container {
            name: self.slug().to_string(),
            image: Some(image),
            command: Some(command),
            ports: Some(vec![ContainerPort {
                name: Some("lm".to_string()),
                container_port: PORT,
                protocol: Some("TCP".to_string()),
                ..Default::default()
            }]),
            resources: Some(resources),
            readiness_probe: Some(tcp_probe(PORT)),
            ..Default::default()
        }
    }

    fn service_ports(&self) -> Vec<ServicePort> {
        vec![service_port("lm", PORT)]
    }
}
