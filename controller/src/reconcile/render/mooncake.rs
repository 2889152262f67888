//! The Mooncake master provider (`mooncakestore://` binding; spec 000 "Mooncake provider
//! configuration"): host-network singleton behind a headless Service that exposes the RPC
//! port (50051) first and the HTTP metadata port (8080); a `Recreate` Deployment so a surge
//! never collides on the host ports.

use ic_shared::crd::{RemoteProvider, RemoteStorageSpec};
use k8s_openapi::api::core::v1::{Container, ContainerPort, ResourceRequirements, ServicePort};

use super::{service_port, tcp_probe, ProviderRenderer};

/// Default master image (pinned, fully qualified for CRI-O short-name policies).
pub const DEFAULT_IMAGE: &str = "docker.io/kvcacheai/mooncake:0.3.11.post1";
/// Master RPC port (published in `status.endpoint`).
pub const RPC_PORT: i32 = 50051;
/// Embedded HTTP metadata server port.
pub const METADATA_PORT: i32 = 8080;
/// Prometheus metrics port.
pub const METRICS_PORT: i32 = 9003;

/// Default master command line.
pub fn default_command() -> Vec<String> {
    [
        "mooncake_master",
        "--rpc_port=50051",
        "--metrics_port=9003",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=0.0.0.0",
        "--http_metadata_server_port=8080",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The Mooncake renderer.
#[derive(Debug, Clone, Copy)]
pub struct Mooncake;

fn container_port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_string()),
        container_port: port,
        protocol: Some("TCP".to_string()),
        ..Default::default()
    }
}

impl ProviderRenderer for Mooncake {
    fn provider(&self) -> RemoteProvider {
        RemoteProvider::Mooncake
    }

    fn slug(&self) -> &'static str {
        "mooncake-master"
    }

    fn resources_block<'a>(&self, rs: &'a RemoteStorageSpec) -> Option<&'a ResourceRequirements> {
        rs.mooncake.as_ref().and_then(|r| r.resources.as_ref())
    }

    fn container(&self, rs: &RemoteStorageSpec, resources: ResourceRequirements) -> Container {
        let spec = rs.mooncake.as_ref();
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
            ports: Some(vec![
                container_port("rpc", RPC_PORT),
                container_port("http-metadata", METADATA_PORT),
                container_port("metrics", METRICS_PORT),
            ]),
            resources: Some(resources),
            readiness_probe: Some(tcp_probe(RPC_PORT)),
            ..Default::default()
        }
    }

    fn service_ports(&self) -> Vec<ServicePort> {
        vec![
            service_port("rpc", RPC_PORT),
            service_port("http-metadata", METADATA_PORT),
        ]
    }

    fn host_network(&self) -> bool {
        true
    }

    fn headless_service(&self) -> bool {
        true
    }

    fn recreate(&self) -> bool {
        true
    }
}
