//! Provider workload rendering (spec 000 "Resources", "Template Overrides", "Mooncake provider
//! configuration", "Cache hierarchy and ownership").
//!
//! Pure functions from a `CacheBackend` to the objects the controller owns for it: one
//! Deployment or StatefulSet (per `spec.deploymentKind`), one Service, and an autoscaling/v2
//! HorizontalPodAutoscaler when `spec.autoscaling` is set. Only a Managed `remoteStorage` on
//! an Offload backend renders anything; host-only, External, events-only and SGLang HiCache
//! backends render nothing (and the reconciler sheds what an earlier mode left behind).
//!
//! Each storage provider implements [`ProviderRenderer`] (one file each: [`redis`],
//! [`lmcache_server`], [`mooncake`]); the shared shape (labels, owner reference, template
//! overrides, HPA) lives here.

pub mod lmcache_server;
pub mod mooncake;
pub mod redis;
pub mod resources;

use std::collections::BTreeMap;

use ic_shared::crd::{
    CacheBackend, CacheBackendSpec, DeploymentKind, PodTemplateOverrides, RemoteProvider,
    RemoteStorageSpec,
};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, StatefulSet, StatefulSetSpec,
};
use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, HorizontalPodAutoscaler, HorizontalPodAutoscalerSpec, MetricSpec,
    MetricTarget, ResourceMetricSource,
};
use k8s_openapi::api::core::v1::{
    Container, PodSpec, PodTemplateSpec, ResourceRequirements, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::Resource;
use thiserror::Error;

use super::cachebackend::path::{classify, BackendPath};

/// Label carrying the owning CacheBackend's name (length-limited, see [`label_value`]) on every
/// owned object and managed pod; the reconciler lists owned objects by it.
pub const LABEL_BACKEND: &str = "inferencecache.io/cachebackend";
/// `app.kubernetes.io/name`: the provider slug (`redis`, `lmcache-server`, `mooncake-master`).
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
/// `app.kubernetes.io/instance`: the CacheBackend name.
pub const LABEL_INSTANCE: &str = "app.kubernetes.io/instance";
/// `app.kubernetes.io/component`: always [`COMPONENT_CACHE_SERVER`].
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
/// `app.kubernetes.io/managed-by`: always [`MANAGED_BY`].
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Component label value of managed cache-server pods.
pub const COMPONENT_CACHE_SERVER: &str = "cache-server";
/// Managed-by label value.
pub const MANAGED_BY: &str = "inference-cache";

/// Longest Kubernetes label value and DNS-1035 label (Service name).
const MAX_LABEL: usize = 63;

/// Why a CacheBackend could not be rendered.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RenderError {
    /// The object lacks a metadata field the owned objects need (`name`, `namespace`, `uid`).
    #[error("CacheBackend has no metadata.{0}")]
    MissingMetadata(&'static str),
}

/// What one storage provider contributes to the managed workload.
pub trait ProviderRenderer: Send + Sync {
    /// The provider this renderer serves.
    fn provider(&self) -> RemoteProvider;
    /// Short name used in object names, the `app.kubernetes.io/name` label and as the container
    /// name (`redis`, `lmcache-server`, `mooncake-master`).
    fn slug(&self) -> &'static str;
    /// The provider's typed resources block, if the operator wrote one.
    fn resources_block<'a>(&self, rs: &'a RemoteStorageSpec) -> Option<&'a ResourceRequirements>;
    /// The one cache-server container, given the already-resolved resources.
    fn container(&self, rs: &RemoteStorageSpec, resources: ResourceRequirements) -> Container;
    /// Service ports; the first one is published in `status.endpoint`.
    fn service_ports(&self) -> Vec<ServicePort>;
    /// Whether the pod runs on the host network (Mooncake).
    fn host_network(&self) -> bool {
        false
    }
    /// Whether the Service is headless (`clusterIP: None`; Mooncake).
    fn headless_service(&self) -> bool {
        false
    }
    /// Whether a Deployment uses the `Recreate` strategy (Mooncake: a surge would collide on
    /// host ports).
    fn recreate(&self) -> bool {
        false
    }
}

/// The renderer of a provider.
pub fn renderer_for(provider: RemoteProvider) -> &'static dyn ProviderRenderer {
    match provider {
        RemoteProvider::Redis => &redis::Redis,
        RemoteProvider::LMCacheServer => &lmcache_server::LmCacheServer,
        RemoteProvider::Mooncake => &mooncake::Mooncake,
    }
}

/// The rendered workload: a Deployment or a StatefulSet.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// `deploymentKind: Deployment`.
    Deployment(Box<Deployment>),
    /// `deploymentKind: StatefulSet`.
    StatefulSet(Box<StatefulSet>),
}

impl Workload {
    /// `metadata.name`.
    pub fn name(&self) -> &str {
        match self {
            Workload::Deployment(d) => d.metadata.name.as_deref().unwrap_or_default(),
            Workload::StatefulSet(s) => s.metadata.name.as_deref().unwrap_or_default(),
        }
    }

    /// `Deployment` or `StatefulSet`.
    pub fn kind(&self) -> DeploymentKind {
        match self {
            Workload::Deployment(_) => DeploymentKind::Deployment,
            Workload::StatefulSet(_) => DeploymentKind::StatefulSet,
        }
    }
}

/// Everything the controller owns for a Managed backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The provider rendered.
    pub provider: RemoteProvider,
    /// Deployment or StatefulSet.
    pub workload: Workload,
    /// The Service clients reach the provider through.
    pub service: Service,
    /// The HPA, when `spec.autoscaling` is set.
    pub hpa: Option<HorizontalPodAutoscaler>,
    /// Names of the cache-server containers on the pod template (the `observedServerInstance`
    /// restart sum counts only these).
    pub container_names: Vec<String>,
    /// Labels selecting the managed pods.
    pub selector: BTreeMap<String, String>,
}

/// Renders the owned objects of `cb`: `Ok(None)` when its mode provisions nothing.
///
/// Errors only when metadata the owned objects need (name, namespace, uid) is missing.
pub fn render(cb: &CacheBackend) -> Result<Option<Rendered>, RenderError> {
    let BackendPath::Managed(provider) = classify(&cb.spec) else {
        return Ok(None);
    };
    let Some(rs) = cb.spec.remote_storage.as_ref() else {
        return Ok(None);
    };
    let name = cb
        .metadata
        .name
        .as_deref()
        .ok_or(RenderError::MissingMetadata("name"))?;
    let namespace = cb
        .metadata
        .namespace
        .as_deref()
        .ok_or(RenderError::MissingMetadata("namespace"))?;
    let owner = owner_reference(cb)?;
    let r = renderer_for(provider);
    let spec = &cb.spec;
    let child = child_name(name, r.slug());
    let selector = selector_labels(name, r.slug());
    let labels = object_labels(name, r.slug());
    let meta = ObjectMeta {
        name: Some(child.clone()),
        namespace: Some(namespace.to_string()),
        labels: Some(labels.clone()),
        owner_references: Some(vec![owner]),
        ..Default::default()
    };

    let resources =
        resources::provider_resources(r.resources_block(rs), spec.autoscaling.is_some());
    let container = r.container(rs, resources);
    let container_names = vec![container.name.clone()];
    let mut pod_spec = PodSpec {
        containers: vec![container],
        ..Default::default()
    };
    if r.host_network() {
        pod_spec.host_network = Some(true);
        pod_spec.dns_policy = Some("ClusterFirstWithHostNet".to_string());
    }
    if let Some(t) = spec.template.as_ref() {
        merge_template_overrides(&mut pod_spec, t);
    }
    let template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels),
            ..Default::default()
        }),
        spec: Some(pod_spec),
    };
    // With autoscaling the HPA owns spec.replicas: leave it out of the applied object.
    let replicas = spec
        .autoscaling
        .is_none()
        .then(|| spec.effective_replicas());
    let label_selector = LabelSelector {
        match_labels: Some(selector.clone()),
        ..Default::default()
    };
    let workload = match spec.effective_deployment_kind() {
        DeploymentKind::Deployment => Workload::Deployment(Box::new(Deployment {
            metadata: meta.clone(),
            spec: Some(DeploymentSpec {
                replicas,
                selector: label_selector,
                template,
                strategy: r.recreate().then(|| DeploymentStrategy {
                    type_: Some("Recreate".to_string()),
                    rolling_update: None,
                }),
                ..Default::default()
            }),
            status: None,
        })),
        DeploymentKind::StatefulSet => Workload::StatefulSet(Box::new(StatefulSet {
            metadata: meta.clone(),
            spec: Some(StatefulSetSpec {
                replicas,
                selector: label_selector,
                service_name: Some(child.clone()),
                template,
                ..Default::default()
            }),
            status: None,
        })),
    };
    let service = Service {
        metadata: meta.clone(),
        spec: Some(ServiceSpec {
            selector: Some(selector.clone()),
            ports: Some(r.service_ports()),
            cluster_ip: r.headless_service().then(|| "None".to_string()),
            ..Default::default()
        }),
        status: None,
    };
    let hpa = spec.autoscaling.as_ref().map(|a| HorizontalPodAutoscaler {
        metadata: meta.clone(),
        spec: Some(HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some("apps/v1".to_string()),
                kind: match workload.kind() {
                    DeploymentKind::Deployment => "Deployment".to_string(),
                    DeploymentKind::StatefulSet => "StatefulSet".to_string(),
                },
                name: child.clone(),
            },
            min_replicas: Some(hpa_min_replicas(spec)),
            max_replicas: a.max_replicas,
            metrics: Some(vec![MetricSpec {
                type_: "Resource".to_string(),
                resource: Some(ResourceMetricSource {
                    name: "cpu".to_string(),
                    target: MetricTarget {
                        type_: "Utilization".to_string(),
                        average_utilization: Some(a.effective_target_cpu_utilization_percent()),
                        ..Default::default()
                    },
                }),
                ..Default::default()
            }]),
            behavior: None,
        }),
        status: None,
    });
    Ok(Some(Rendered {
        provider,
        workload,
        service,
        hpa,
        container_names,
        selector,
    }))
}

/// HPA lower bound: `autoscaling.minReplicas`, else `spec.replicas` (at least 1 — the schema's
/// minimum; admission rejects `replicas: 0` with autoscaling and no minReplicas).
pub fn hpa_min_replicas(spec: &CacheBackendSpec) -> i32 {
    spec.autoscaling
        .as_ref()
        .and_then(|a| a.min_replicas)
        .unwrap_or_else(|| spec.effective_replicas().max(1))
}

/// The controller owner reference to `cb` (controller and blockOwnerDeletion set).
pub fn owner_reference(cb: &CacheBackend) -> Result<OwnerReference, RenderError> {
    Ok(OwnerReference {
        api_version: CacheBackend::api_version(&()).to_string(),
        kind: CacheBackend::kind(&()).to_string(),
        name: cb
            .metadata
            .name
            .clone()
            .ok_or(RenderError::MissingMetadata("name"))?,
        uid: cb
            .metadata
            .uid
            .clone()
            .ok_or(RenderError::MissingMetadata("uid"))?,
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
}

/// Labels that select the managed pods of backend `cb_name` for provider `slug`.
pub fn selector_labels(cb_name: &str, slug: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_BACKEND.to_string(), label_value(cb_name)),
        (
            LABEL_COMPONENT.to_string(),
            COMPONENT_CACHE_SERVER.to_string(),
        ),
        (LABEL_NAME.to_string(), slug.to_string()),
    ])
}

/// Every label on owned objects and their pods: the selector plus instance and managed-by.
pub fn object_labels(cb_name: &str, slug: &str) -> BTreeMap<String, String> {
    let mut l = selector_labels(cb_name, slug);
    l.insert(LABEL_INSTANCE.to_string(), label_value(cb_name));
    l.insert(LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string());
    l
}

/// `s` if it fits a label value (63 characters), else a 54-character prefix plus `-` and 8 hex
/// digits of its hash (stable, distinct for distinct long names).
pub fn label_value(s: &str) -> String {
    if s.len() <= MAX_LABEL {
        return s.to_string();
    }
    shorten(s, MAX_LABEL)
}

/// Name of an owned object: `<cb>-<slug>`, made a valid DNS-1035 label of at most 63
/// characters (dots become dashes, a leading digit gets a `cb-` prefix, long names are
/// shortened with a hash suffix).
pub fn child_name(cb_name: &str, slug: &str) -> String {
    let mut base = cb_name.replace('.', "-");
    if base.starts_with(|c: char| c.is_ascii_digit()) {
        base = format!("cb-{base}");
    }
    let full = format!("{base}-{slug}");
    if full.len() <= MAX_LABEL {
        return full;
    }
    let head = shorten(&base, MAX_LABEL - slug.len() - 1);
    format!("{head}-{slug}")
}

fn shorten(s: &str, max: usize) -> String {
    let hash = xxhash_rust::xxh3::xxh3_64(s.as_bytes());
    let suffix = format!("{:08x}", hash & 0xffff_ffff);
    let keep = max.saturating_sub(suffix.len() + 1);
    let mut head: String = s.chars().take(keep).collect();
    while head.ends_with(['-', '.', '_']) {
        head.pop();
    }
    format!("{head}-{suffix}")
}

/// `<service>.<namespace>.svc:<first port>` — the in-cluster address of a rendered Service, as
/// `status.endpoint` publishes it. `None` when the Service has no name, namespace or port.
pub fn service_endpoint(svc: &Service) -> Option<String> {
    let name = svc.metadata.name.as_deref()?;
    let ns = svc.metadata.namespace.as_deref()?;
    let port = svc.spec.as_ref()?.ports.as_ref()?.first()?.port;
    Some(format!("{name}.{ns}.svc:{port}"))
}

/// Merges `spec.template` into a rendered pod spec: every field the operator set replaces the
/// rendered value; unset fields leave it alone. Containers are never touched.
pub fn merge_template_overrides(spec: &mut PodSpec, t: &PodTemplateOverrides) {
    if !t.node_selector.is_empty() {
        spec.node_selector = Some(t.node_selector.clone());
    }
    if let Some(a) = &t.affinity {
        spec.affinity = Some(a.clone());
    }
    if !t.tolerations.is_empty() {
        spec.tolerations = Some(t.tolerations.clone());
    }
    if !t.topology_spread_constraints.is_empty() {
        spec.topology_spread_constraints = Some(t.topology_spread_constraints.clone());
    }
    if !t.image_pull_secrets.is_empty() {
        spec.image_pull_secrets = Some(t.image_pull_secrets.clone());
    }
    if let Some(v) = &t.service_account_name {
        spec.service_account_name = Some(v.clone());
    }
    if let Some(v) = &t.security_context {
        spec.security_context = Some(v.clone());
    }
    if let Some(v) = &t.priority_class_name {
        spec.priority_class_name = Some(v.clone());
    }
    if let Some(v) = &t.scheduler_name {
        spec.scheduler_name = Some(v.clone());
    }
    if let Some(v) = &t.runtime_class_name {
        spec.runtime_class_name = Some(v.clone());
    }
    if let Some(v) = t.termination_grace_period_seconds {
        spec.termination_grace_period_seconds = Some(v);
    }
}

/// A TCP readiness probe on `port`.
pub(crate) fn tcp_probe(port: i32) -> k8s_openapi::api::core::v1::Probe {
    use k8s_openapi::api::core::v1::{Probe, TCPSocketAction};
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::Int(port),
            host: None,
        }),
        period_seconds: Some(10),
        ..Default::default()
    }
}

/// A named TCP Service port.
pub(crate) fn service_port(name: &str, port: i32) -> ServicePort {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    ServicePort {
        name: Some(name.to_string()),
        port,
        target_port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".to_string()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_dns_labels() {
        assert_eq!(child_name("kv", "redis"), "kv-redis");
        assert_eq!(child_name("a.b", "redis"), "a-b-redis");
        assert_eq!(child_name("1x", "redis"), "cb-1x-redis");
        let long = "x".repeat(100);
        let n = child_name(&long, "lmcache-server");
        assert!(n.len() <= 63, "{n}");
        assert!(n.ends_with("-lmcache-server"));
        assert_ne!(n, child_name(&"y".repeat(100), "lmcache-server"));
        assert_eq!(label_value("short"), "short");
        assert_eq!(label_value(&long).len(), 63);
    }
}
