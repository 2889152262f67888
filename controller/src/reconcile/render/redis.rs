//! The Redis provider (RESP binding): `redis-server` with `--maxmemory` at about 80 % of the
//! container's memory limit and `allkeys-lru` eviction (spec 000 "Resources": "redis-l2").

use ic_shared::crd::{RemoteProvider, RemoteStorageSpec};
use k8s_openapi::api::core::v1::{Container, ContainerPort, ResourceRequirements, ServicePort};

use super::resources::memory_limit_bytes;
use super::{service_port, tcp_probe, ProviderRenderer};

/// Default Redis image (pinned, fully qualified).
pub const DEFAULT_IMAGE: &str = "docker.io/library/redis:7.4-alpine";
/// Redis port.
pub const PORT: i32 = 6379;
/// Share of the memory limit given to the keyspace (`--maxmemory`).
pub const MAXMEMORY_FRACTION: f64 = 0.8;

/// The Redis renderer.
#[derive(Debug, Clone, Copy)]
pub struct Redis;

/// `--maxmemory` in bytes for a memory limit: `floor(limit × 0.8)`; `None` without a limit.
pub fn maxmemory_bytes(resources: &ResourceRequirements) -> Option<u64> {
    memory_limit_bytes(resources)
        .filter(|b| *b > 0.0)
        .map(|b| (b * MAXMEMORY_FRACTION).floor() as u64)
}

impl ProviderRenderer for Redis {
    fn provider(&self) -> RemoteProvider {
        RemoteProvider::Redis
    }

    fn slug(&self) -> &'static str {
        "redis"
    }

    fn resources_block<'a>(&self, rs: &'a RemoteStorageSpec) -> Option<&'a ResourceRequirements> {
        rs.redis.as_ref().and_then(|r| r.resources.as_ref())
    }

    fn container(&self, rs: &RemoteStorageSpec, resources: ResourceRequirements) -> Container {
        let image = rs
            .redis
            .as_ref()
            .and_then(|r| r.image.clone())
            .filter(|i| !i.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_IMAGE.to_string());
        let mut args: Vec<String> = [
            "--port",
            "6379",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(bytes) = maxmemory_bytes(&resources) {
            args.push("--maxmemory".to_string());
            args.push(bytes.to_string());
        }
        args.push("--maxmemory-policy".to_string());
        args.push("allkeys-lru".to_string());
        Container {
            name: self.slug().to_string(),
            image: Some(image),
            command: Some(vec!["redis-server".to_string()]),
            args: Some(args),
            ports: Some(vec![ContainerPort {
                name: Some("redis".to_string()),
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
        vec![service_port("redis", PORT)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use std::collections::BTreeMap;

    #[test]
    fn maxmemory_is_eighty_percent_of_the_limit() {
        let r = ResourceRequirements {
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity("8Gi".to_string()),
            )])),
            ..Default::default()
        };
        assert_eq!(maxmemory_bytes(&r), Some(6_871_947_673));
        assert_eq!(maxmemory_bytes(&ResourceRequirements::default()), None);
    }
}
