//! `CacheNode` (`inferencecache.io/v1alpha1`, cluster-scoped, short name `cn`): one per node,
//! named after the node, holding what that node's agent reported (DESIGN.md "Status", "Node
//! plans").
//!
//! The agent has no write access to the API; the controller turns its check results and stream
//! state into this status. Conditions: one per agent check (`ShmHealthy`, `PortsHealthy`,
//! `GPUHealthy`, …, see [`node_condition`]) plus the aggregate `Ready`. `kubectl get cachenodes`
//! shows Ready, GPUs, Engines, LastReport, Age.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::conditions::ConditionStatus;
use crate::check::CheckStatus;

/// Condition types on a CacheNode.
pub mod node_condition {
    /// Aggregate: the agent is connected and no check is Critical.
    pub const READY: &str = "Ready";
    /// The agent's stream to the controller is up.
    pub const AGENT_CONNECTED: &str = "AgentConnected";
    /// `/dev/shm` is large enough for the planned engines (check `shm`).
    pub const SHM_HEALTHY: &str = "ShmHealthy";
    /// Planned host ports are free or held by the expected owner (check `ports`).
    pub const PORTS_HEALTHY: &str = "PortsHealthy";
    /// NVML sees healthy GPUs, no fatal XIDs (check `gpu`).
    pub const GPU_HEALTHY: &str = "GPUHealthy";
    /// The CUDA driver API initialises (check `cuda`).
    pub const CUDA_HEALTHY: &str = "CUDAHealthy";
    /// LMCache MP workers answer on their ports (check `mp_worker`).
    pub const MP_WORKER_HEALTHY: &str = "MPWorkerHealthy";
    /// Reader mounts are read-only and present (check `mounts`).
    pub const MOUNTS_HEALTHY: &str = "MountsHealthy";
    /// Every planned KV-event publisher is subscribed (stream state).
    pub const KV_EVENTS_HEALTHY: &str = "KVEventsHealthy";
}

/// The condition type a check named `check` reports under: the known checks map to the
/// constants in [`node_condition`]; any other name becomes `<CamelCase>Healthy`
/// (`foo_bar` → `FooBarHealthy`).
pub fn condition_type_for_check(check: &str) -> String {
    match check {
        "shm" => node_condition::SHM_HEALTHY.to_string(),
        "ports" => node_condition::PORTS_HEALTHY.to_string(),
        "gpu" => node_condition::GPU_HEALTHY.to_string(),
        "cuda" => node_condition::CUDA_HEALTHY.to_string(),
        "mp_worker" => node_condition::MP_WORKER_HEALTHY.to_string(),
        "mounts" => node_condition::MOUNTS_HEALTHY.to_string(),
        "kv_events" => node_condition::KV_EVENTS_HEALTHY.to_string(),
        other => {
            let mut out = String::new();
            for part in other.split(['_', '-', '.']).filter(|p| !p.is_empty()) {
                let mut chars = part.chars();
                if let Some(first) = chars.next() {
                    out.extend(first.to_uppercase());
                    out.push_str(chars.as_str());
                }
            }
            out.push_str("Healthy");
            out
        }
    }
}

/// The `*Healthy` condition status for a check verdict: Ok → True, Warning/Critical → False,
/// Unknown → Unknown. (Only Critical turns the aggregate `Ready` False.)
pub fn check_condition_status(status: CheckStatus) -> ConditionStatus {
    match status {
        CheckStatus::Ok => ConditionStatus::True,
        CheckStatus::Warning | CheckStatus::Critical => ConditionStatus::False,
        CheckStatus::Unknown => ConditionStatus::Unknown,
    }
}

/// Verdict of a node surface as stored in CacheNode status (same values as the agent's
/// check verdicts).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum NodeHealth {
    /// Healthy.
    Ok,
    /// Degraded or suspicious; engines may still run.
    Warning,
    /// Engines on this node will fail.
    Critical,
    /// Could not be determined.
    #[default]
    Unknown,
}

impl From<CheckStatus> for NodeHealth {
    fn from(s: CheckStatus) -> Self {
        match s {
            CheckStatus::Ok => NodeHealth::Ok,
            CheckStatus::Warning => NodeHealth::Warning,
            CheckStatus::Critical => NodeHealth::Critical,
            CheckStatus::Unknown => NodeHealth::Unknown,
        }
    }
}

/// CacheNode spec: which node this object describes. The object's name is the node name;
/// `nodeName` repeats it for selectors and tooling.
///
/// Printer columns: Ready, GPUs (`status.gpuCount`), Engines (`status.engineCount`),
/// LastReport (`status.lastReportTime`), Age.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "CacheNode",
    plural = "cachenodes",
    singular = "cachenode",
    shortname = "cn",
    status = "CacheNodeStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "CacheNode reports one node's agent checks, GPUs and KV-event streams (docs/crds.md \"CacheNode\").",
    printcolumn = r#"{"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name": "GPUs", "type": "integer", "jsonPath": ".status.gpuCount"}"#,
    printcolumn = r#"{"name": "Engines", "type": "integer", "jsonPath": ".status.engineCount"}"#,
    printcolumn = r#"{"name": "LastReport", "type": "date", "jsonPath": ".status.lastReportTime"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct CacheNodeSpec {
    /// The Kubernetes node this object describes (equal to `metadata.name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
}

/// What the node's agent last reported.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheNodeStatus {
    /// One condition per agent check plus the aggregate `Ready` (see [`node_condition`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,

    /// When the agent last sent check results or stream state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_report_time: Option<Time>,

    /// Agent version from its hello.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,

    /// Node boot id from the agent's hello (changes on reboot).
    #[serde(rename = "bootID", default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,

    /// Node-plan generation the agent last acknowledged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_plan_generation: Option<i64>,

    /// Number of GPUs the agent sees (the length of `gpus`).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub gpu_count: i32,

    /// Number of planned engine pods on this node (the length of `engines`).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub engine_count: i32,

    /// Per-GPU detail, keyed by `index`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["index"]))]
    pub gpus: Vec<GpuStatus>,

    /// Per-engine-pod KV-event stream detail.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<EngineStreamsStatus>,
}

/// `status.gpus[]`: one GPU as NVML sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// NVML device index.
    #[schemars(range(min = 0))]
    pub index: i32,

    /// Device UUID (`GPU-…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,

    /// Product name (`NVIDIA H200`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,

    /// Verdict for this device.
    #[serde(default)]
    pub status: NodeHealth,

    /// CamelCase reason (e.g. `XidFatal`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,

    /// Sentence a person can act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `status.engines[]`: one planned engine pod and its KV-event streams.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EngineStreamsStatus {
    /// Pod namespace (the tenant).
    pub namespace: String,

    /// Pod name (the replica id).
    pub pod: String,

    /// Model id the events are attributed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,

    /// One entry per publisher (pod × data-parallel rank).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub streams: Vec<KvStreamStatus>,
}

/// `status.engines[].streams[]`: one KV-event subscription.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KvStreamStatus {
    /// Publisher endpoint (`tcp://10.0.0.5:5557`).
    pub endpoint: String,

    /// Data-parallel rank of the publisher.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub dp_rank: Option<i32>,

    /// Whether the subscription is currently connected.
    #[serde(default)]
    pub connected: bool,

    /// Time of the last event received on this stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_at: Option<Time>,

    /// Distinct prefixes this stream currently holds in the index.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub prefix_count: i64,

    /// How far the stream's index entries can be trusted: `Exact`, `Healing`, `Partial`,
    /// `Stale`, `Disconnected`, `EngineDown`, `Unknown` (`docs/kv-events.md` "Coverage").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<String>,

    /// Why the stream is not Exact (`BootstrapIncomplete`, `ReplayTruncated`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage_reason: Option<String>,

    /// Last error or gap notice, when any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_map_to_condition_types() {
        assert_eq!(condition_type_for_check("shm"), "ShmHealthy");
        assert_eq!(condition_type_for_check("gpu"), "GPUHealthy");
        assert_eq!(condition_type_for_check("mp_worker"), "MPWorkerHealthy");
        assert_eq!(condition_type_for_check("disk_space"), "DiskSpaceHealthy");
    }

    #[test]
    fn verdicts_map_to_condition_status() {
        assert_eq!(
            check_condition_status(CheckStatus::Ok),
            ConditionStatus::True
        );
        assert_eq!(
            check_condition_status(CheckStatus::Critical),
            ConditionStatus::False
        );
        assert_eq!(
            check_condition_status(CheckStatus::Unknown),
            ConditionStatus::Unknown
        );
        assert_eq!(NodeHealth::from(CheckStatus::Warning), NodeHealth::Warning);
    }
}
