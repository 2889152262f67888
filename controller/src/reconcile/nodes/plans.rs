//! Node plans from engine pods and CacheBackends (DESIGN.md "Node plans"; `docs/plan.md`).
//!
//! [`derive_plans`] is a pure function: give it every pod and every CacheBackend, get one
//! [`NodePlan`] per node that runs something the agent must watch, plus the [`PlanIssue`]s that
//! explain what could not be planned. The plan publisher ([`super::publish_plans_once`]) lists
//! the objects, calls it, and hands the result to the registry, which stamps generations and
//! pushes changed plans down the agents' streams.
//!
//! What becomes of a pod:
//!
//! - **Engine pods** are pods with `spec.nodeName` that the webhook wired: annotation
//!   `inferencecache.io/injected-by: <ns>/<name>` naming a live CacheBackend (and, when present,
//!   `inferencecache.io/injected-by-uid` equal to its UID). Finished pods (`Succeeded`,
//!   `Failed`) are skipped. Each becomes an [`EnginePlan`]: tenant = namespace, replica = pod,
//!   model = `spec.observation.modelID`, backend = `ns/name`, hash scheme from `spec.runtime`,
//!   `keepsL2` for `integration.mode: Offload` (the LMCache host tier or the HiCache host pool
//!   keeps an evicted block), and:
//!   - **KV-event publishers** (only when the backend has a modelID — the spec's subscriber
//!     gate): from the engine's `--kv-events-config` JSON. vLLM publishes when
//!     `enable_kv_cache_events` is true and `publisher` is not `null`; SGLang when `publisher`
//!     is `zmq`. A wildcard endpoint host (`*`, `::`) is the pod IP; any other host means the
//!     engine *connects* instead of binding, which an agent cannot subscribe to. The replay
//!     (ROUTER) endpoint is always bound: wildcard hosts become the pod IP, loopback is kept
//!     only for hostNetwork pods. One source per data-parallel rank, ports offset by the global
//!     rank (vLLM: `--data-parallel-rank`, or `--data-parallel-start-rank` …
//!     `+ --data-parallel-size-local`, default all of `--data-parallel-size`; SGLang: the
//!     attention-DP ranks of this node with `--enable-dp-attention`, else rank 0). A rank flag
//!     given as a variable is resolved from the engine's env like the kubelet would
//!     ([`resolved_rank_args`]); one that cannot be is [`issue::DATA_PARALLEL_RANK_UNKNOWN`].
//!   - **block size**: vLLM `--block-size` (default 16), SGLang `--page-size` (default 1).
//!   - **metrics URL** (Offload backends with KV-event publishers only; events-only has no tier
//!     2): `http://<host>:<port>/metrics` of the engine's HTTP server, whose tier-2 counters the
//!     agent scrapes ([`engine_metrics_url`]).
//!   - **MP-worker port**: SGLang + LMCache in Offload mode runs the LMCache MP worker on
//!     `spec.lmCache.workerPort` (default 5555) in the pod's network namespace.
//!   - **required `/dev/shm`** (bytes, inside the pod): the SGLang MP worker's L1 is
//!     `spec.lmCache.hostMemory.capacity` (default 4Gi) in the pod's `/dev/shm`; tensor
//!     parallelism above 1 needs at least [`TENSOR_PARALLEL_SHM_BYTES`] for NCCL.
//! - **Host ports** (the node-level `ports[]`): hostNetwork engine pods (every declared
//!   container port, their KV-event and replay ports, the MP-worker port) and managed Mooncake
//!   master pods (50051 RPC, 8080 metadata, 9003 metrics). A pod that is scheduled but not yet
//!   started (`Pending`) needs its ports **free**; a Ready pod must **hold** them (owner = its
//!   pod UID); a running but not yet Ready pod is not judged (engines bind late).
//! - **Node-level `/dev/shm`**: only pods with `hostIPC: true` use the host's `/dev/shm`; the
//!   node requirement is the largest of theirs. Other pods' requirements are per engine.
//! - **`gpuNode`**: some engine pod on the node requests a `…/gpu` resource.
//!
//! The CacheBackend fields an engine plan reads (`spec.runtime`, `spec.type`,
//! `spec.integration.mode`, `spec.lmCache.workerPort`, `spec.lmCache.hostMemory.capacity`,
//! `spec.observation.modelID` when a kvevent-subscriber sidecar carries it) come from what the
//! pod was wired under — the Pod webhook's `inferencecache.io/wired-spec` record
//! ([`wired_spec`]) — not from the current spec: an edit reaches a pod only when it is
//! recreated, and until then the plan says so ([`issue::WIRED_UNDER_OLDER_SPEC`]). Without a
//! sidecar the model id is only the index's label for the node agent's streams, taken from the
//! current spec.

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::crd::{
    CacheBackend, CacheType, IntegrationMode, Runtime, WiredSpec, DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS,
};
use ic_shared::plan::{
    EnginePlan, HashScheme, KvEventSource, NodePlan, PlannedContainer, PortExpect, PortExpectation,
    PortOwner, ReaderMount, ShmRequirement,
};
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;
use serde::Deserialize;

use crate::engine::command::{normalize_flag, EngineCommand};
use crate::adapters::select_engine_by_command;
use crate::reconcile::annotations::{INJECTED_BY, INJECTED_BY_UID, WIRED_SPEC};
use crate::reconcile::render::mooncake::{METADATA_PORT, METRICS_PORT, RPC_PORT};
use crate::reconcile::render::{ProviderRenderer, LABEL_MANAGED_BY, LABEL_NAME, MANAGED_BY};

/// Minimum `/dev/shm` for an engine with tensor parallelism above 1 (NCCL's shared-memory
/// transport; the container default of 64 MiB is far too small): 1 GiB.
pub const TENSOR_PARALLEL_SHM_BYTES: u64 = 1 << 30;
/// vLLM's default `--kv-events-config` endpoint.
pub const DEFAULT_KV_EVENTS_ENDPOINT: &str = "tcp://*:5557";
/// vLLM's default `--block-size`.
pub const VLLM_DEFAULT_BLOCK_SIZE: u32 = 16;
/// SGLang's default `--page-size`.
pub const SGLANG_DEFAULT_PAGE_SIZE: u32 = 1;
/// vLLM's default `--port` (its OpenAI server also serves `/metrics`).
pub const VLLM_DEFAULT_PORT: u16 = 8000;
/// SGLang's default `--port`.
pub const SGLANG_DEFAULT_PORT: u16 = 30000;

/// The containers whose `/dev/shm` the engine's requirement is for (plan `shmContainers`): the
/// engine container, then every other container or native sidecar that mounts the same volume
/// at `/dev/shm` (SGLang's LMCache MP worker), each with its runtime ID while pod status says it
/// is running.
pub fn shm_containers(pod: &Pod, engine: &Container) -> Vec<PlannedContainer> {
    let shm_volume = crate::adapters::shm_mount(engine).map(|m| m.name.as_str());
    let spec = pod.spec.as_ref();
    let others = spec
        .into_iter()
        .flat_map(|s| {
            s.init_containers
                .iter()
                .flatten()
                .chain(s.containers.iter())
        })
        .filter(|c| c.name != engine.name)
        .filter(|c| {
            shm_volume.is_some()
                && crate::adapters::shm_mount(c).map(|m| m.name.as_str()) == shm_volume
        });
    std::iter::once(engine)
        .chain(others)
        .map(|c| planned_container(pod, &c.name))
        .collect()
}

/// Container `name` of `pod` with its runtime ID while pod status says it is running
/// (`containerStatuses[]` or, for a native sidecar, `initContainerStatuses[]`; the
/// `<runtime>://` prefix dropped, lower-cased as in cgroup paths).
pub fn planned_container(pod: &Pod, name: &str) -> PlannedContainer {
    let id = pod
        .status
        .as_ref()
        .into_iter()
        .flat_map(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
        })
        .find(|cs| cs.name == name)
        .filter(|cs| cs.state.as_ref().is_some_and(|st| st.running.is_some()))
        .and_then(|cs| cs.container_id.as_deref())
        .map(|id| id.rsplit("://").next().unwrap_or(id).to_ascii_lowercase());
    PlannedContainer {
        name: name.to_string(),
        id,
    }
}

/// Something about a pod that could not be planned (or was planned partially).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanIssue {
    /// `namespace/pod`.
    pub pod: String,
    /// The pod's node, when scheduled.
    pub node: Option<String>,
    /// Stable CamelCase reason (also a metric label).
    pub reason: &'static str,
    /// A sentence a person can act on.
    pub message: String,
}

/// The plan issues open after the last derivation, so that each is logged when it appears and
/// when it clears rather than on every derivation (one runs every `--node-plan-interval-seconds`).
#[derive(Debug, Default)]
pub struct PlanIssueLog {
    open: BTreeSet<(String, &'static str)>,
}

impl PlanIssueLog {
    /// Replaces the open issues with `issues` (one derivation's); returns the ones not open
    /// before, in `issues`' order, and the `(pod, reason)` of those that are no longer raised.
    pub fn update<'a>(
        &mut self,
        issues: &'a [PlanIssue],
    ) -> (Vec<&'a PlanIssue>, Vec<(String, &'static str)>) {
        let now: BTreeSet<(String, &'static str)> =
            issues.iter().map(|i| (i.pod.clone(), i.reason)).collect();
        let appeared = issues
            .iter()
            .filter(|i| !self.open.contains(&(i.pod.clone(), i.reason)))
            .collect();
        let cleared = self.open.difference(&now).cloned().collect();
        self.open = now;
        (appeared, cleared)
    }

    /// Forgets every open issue (leadership lost: the next leader logs them afresh).
    pub fn clear(&mut self) {
        self.open.clear();
    }
}

/// Reasons of [`PlanIssue`].
pub mod issue {
    /// `injected-by` names a CacheBackend that does not exist.
    pub const BACKEND_NOT_FOUND: &str = "BackendNotFound";
    /// `injected-by-uid` does not match the live CacheBackend (it was recreated).
    pub const STALE_INJECTION: &str = "StaleInjection";
    /// No container launches the backend's runtime.
    pub const ENGINE_NOT_FOUND: &str = "EngineNotFound";
    /// The backend has no `observation.modelID`: KV events are not planned.
    pub const NO_MODEL_ID: &str = "NoModelID";
    /// The engine has no (active) `--kv-events-config`.
    pub const KV_EVENTS_DISABLED: &str = "KVEventsDisabled";
    /// `--kv-events-config` is not valid JSON.
    pub const KV_EVENTS_CONFIG_INVALID: &str = "KVEventsConfigInvalid";
    /// The publisher endpoint cannot be reached from the node agent.
    pub const ENDPOINT_UNREACHABLE: &str = "EndpointUnreachable";
    /// The pod has no IP yet (wildcard endpoints cannot be resolved).
    pub const NO_POD_IP: &str = "NoPodIP";
    /// Two pods on one node claim the same host port.
    pub const HOST_PORT_CONFLICT: &str = "HostPortConflict";
    /// A quantity in the CacheBackend could not be parsed.
    pub const INVALID_QUANTITY: &str = "InvalidQuantity";
    /// The engine's block-size flag (vLLM `--block-size`, SGLang `--page-size`) is not a literal
    /// number (a shell expansion such as `$BLOCK`): the plan assumes the engine's default.
    pub const BLOCK_SIZE_UNKNOWN: &str = "BlockSizeUnknown";
    /// The CacheBackend spec changed (in a field the plan reads) since the pod was wired: the
    /// plan follows the pod's recorded wiring (`inferencecache.io/wired-spec`); the pod gets
    /// the new spec when it is recreated.
    pub const WIRED_UNDER_OLDER_SPEC: &str = "WiredUnderOlderSpec";
    /// The pod's `inferencecache.io/wired-spec` annotation does not parse: the plan uses the
    /// current spec, which may not be what the pod runs.
    pub const WIRED_SPEC_UNREADABLE: &str = "WiredSpecUnreadable";
    /// A flag that decides the pod's data-parallel ranks (vLLM `--data-parallel-rank`,
    /// `--data-parallel-start-rank`, `--data-parallel-size[-local]`; SGLang `--node-rank`,
    /// `--nnodes`, `--dp-size`) is an expansion the plan cannot resolve from the pod: the
    /// planned publishers may not be the pod's.
    pub const DATA_PARALLEL_RANK_UNKNOWN: &str = "DataParallelRankUnknown";
}

/// True when the webhook rendered a kvevent-subscriber sidecar into `pod` (rank 0's
/// `kvevent-subscriber`, rank r's `kvevent-subscriber-r`).
fn has_subscriber_sidecar(pod: &Pod) -> bool {
    let name = crate::admission::pod::SUBSCRIBER_CONTAINER;
    pod.spec.iter().flat_map(|s| &s.containers).any(|c| {
        c.name == name
            || c.name
                .strip_prefix(name)
                .and_then(|r| r.strip_prefix('-'))
                .is_some_and(|r| r.parse::<u32>().is_ok())
    })
}

/// What the plan of `pod` wired by `backend` follows: the pod's recorded
/// [`WiredSpec`] (annotation [`WIRED_SPEC`]) when it has one — a spec edit since does not
/// reach a running pod, so each changed field is noted as [`issue::WIRED_UNDER_OLDER_SPEC`] —
/// else the current spec (a pod wired before the record existed; an unreadable record is
/// [`issue::WIRED_SPEC_UNREADABLE`]).
pub fn wired_spec(
    pod: &Pod,
    backend: &CacheBackend,
    note: &mut impl FnMut(&'static str, String),
) -> WiredSpec {
    let now = WiredSpec::of(backend);
    let Some(raw) = pod.annotations().get(WIRED_SPEC) else {
        return now;
    };
    match WiredSpec::from_annotation(raw) {
        Ok(mut wired) => {
            // The model id reaches the pod only through a rendered kvevent-subscriber sidecar
            // (its arguments); otherwise it is the index's label for the node agent's streams,
            // and an edit applies at the next derivation.
            if !has_subscriber_sidecar(pod) {
                wired.model_id.clone_from(&now.model_id);
            }
            // Only the SGLang LMCache MP worker runs by workerPort and hostMemory in the plan;
            // quantities compare by value ("4Gi" = "4096Mi").
            let mp = wired.runtime == Runtime::SgLang
                && wired.cache_type == CacheType::LMCache
                && wired.integration_mode == IntegrationMode::Offload;
            let changed: Vec<&str> = wired
                .changed_fields(&now)
                .into_iter()
                .filter(|f| match *f {
                    "spec.lmCache.workerPort" => mp,
                    "spec.lmCache.hostMemory.capacity" => {
                        mp && bytes_of(&wired.host_memory_capacity)
                            != bytes_of(&now.host_memory_capacity)
                    }
                    _ => true,
                })
                .collect();
            if !changed.is_empty() {
                note(
                    issue::WIRED_UNDER_OLDER_SPEC,
                    format!(
                        "CacheBackend {} changed {} since this pod was wired{}; the node plan follows the pod's wiring until the pod is recreated",
                        backend_key(backend),
                        changed.join(", "),
                        match wired.generation {
                            Some(g) => format!(" (at generation {g})"),
                            None => String::new(),
                        }
                    ),
                );
            }
            wired
        }
        Err(e) => {
            note(
                issue::WIRED_SPEC_UNREADABLE,
                format!(
                    "annotation {WIRED_SPEC} does not parse ({e}); the node plan follows CacheBackend {}'s current spec, which may not be what the pod was wired with",
                    backend_key(backend)
                ),
            );
            now
        }
    }
}

/// Plans per node plus what could not be planned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DerivedPlans {
    /// Node name → plan (generation 0; the registry assigns generations).
    pub plans: BTreeMap<String, NodePlan>,
    /// Issues, in pod order.
    pub issues: Vec<PlanIssue>,
}

impl DerivedPlans {
    /// Node → the CacheBackends (`ns/name`) whose engine pods run there.
    pub fn backends_by_node(&self) -> BTreeMap<String, BTreeSet<String>> {
        backends_by_node(&self.plans)
    }
}

/// Node → the CacheBackends (`ns/name`) of the engines in its plan.
pub fn backends_by_node(plans: &BTreeMap<String, NodePlan>) -> BTreeMap<String, BTreeSet<String>> {
    plans
        .iter()
        .map(|(n, p)| {
            (
                n.clone(),
                p.engines
                    .iter()
                    .filter(|e| !e.backend.is_empty())
                    .map(|e| e.backend.clone())
                    .collect(),
            )
        })
        .filter(|(_, b): &(String, BTreeSet<String>)| !b.is_empty())
        .collect()
}

/// Lifecycle of a scheduled pod as far as its host ports are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PortPhase {
    /// Not started: its host ports must be free.
    NotStarted,
    /// Ready: it must hold its host ports.
    Ready,
    /// Starting (running, not Ready): not judged.
    Starting,
}

fn port_phase(pod: &Pod) -> PortPhase {
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    match (phase, ready) {
        ("Pending", _) => PortPhase::NotStarted,
        (_, true) => PortPhase::Ready,
        _ => PortPhase::Starting,
    }
}

fn pod_key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .filter(|n| !n.is_empty())
}

fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded") | Some("Failed")
    )
}

fn host_network(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
}

fn host_ipc(pod: &Pod) -> bool {
    pod.spec.as_ref().and_then(|s| s.host_ipc).unwrap_or(false)
}

fn pod_ip(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .filter(|ip| !ip.is_empty())
}

fn requests_gpu(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    spec.containers.iter().any(|c| {
        let r = c.resources.as_ref();
        [
            r.and_then(|r| r.limits.as_ref()),
            r.and_then(|r| r.requests.as_ref()),
        ]
        .into_iter()
        .flatten()
        .flat_map(|m| m.iter())
        .any(|(k, v)| k.ends_with("/gpu") && v.0.trim() != "0")
    })
}

/// The engine container and its parsed command line for `runtime`, chosen by the rule the Pod
/// webhook wired it by ([`select_engine_by_command`]: a container whose command visibly launches
/// the engine, else an args-only one whose name or image names the runtime, our own sidecars
/// left out), so the plan never reads another container's args (an `istio-proxy` listed
/// first). The error says why no container was chosen.
pub fn engine_command(pod: &Pod, runtime: Runtime) -> Result<(Container, EngineCommand), String> {
    let i = select_engine_by_command(pod, runtime).map_err(|e| e.to_string())?;
    let c = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.get(i))
        .ok_or_else(|| "the engine container is gone".to_string())?;
    let cmd = EngineCommand::parse(c, runtime).map_err(|e| e.to_string())?;
    Ok((c.clone(), cmd))
}

/// The value of the last occurrence of any of `names` (long flags in any `_`/`-` spelling,
/// `--flag value` or `--flag=value`; short aliases such as `-tp` verbatim).
pub fn flag_value(args: &[&str], names: &[&str]) -> Option<String> {
    let wanted: Vec<String> = names.iter().map(|n| normalize_flag(n)).collect();
    let mut found = None;
    let mut i = 0;
    while i < args.len() {
        let a = args[i];
        if a.starts_with('-') {
            let (name, inline) = match a.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (a, None),
            };
            if wanted.contains(&normalize_flag(name)) {
                match inline {
                    Some(v) => found = Some(v.to_string()),
                    None => {
                        if let Some(next) = args.get(i + 1) {
                            if !next.starts_with("--") {
                                found = Some((*next).to_string());
                                i += 1;
                            }
                        }
                    }
                }
            }
        }
        i += 1;
    }
    found
}

/// True when any of `names` occurs as a boolean flag (`--flag`, `--flag=true`).
pub fn flag_set(args: &[&str], names: &[&str]) -> bool {
    let wanted: Vec<String> = names.iter().map(|n| normalize_flag(n)).collect();
    args.iter().any(|a| {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (*a, None),
        };
        wanted.contains(&normalize_flag(name))
            && inline
                .is_none_or(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
    })
}

fn flag_u32(args: &[&str], names: &[&str]) -> Option<u32> {
    flag_value(args, names).and_then(|v| v.trim().parse().ok())
}

/// `--kv-events-config`, as both engines read it (unknown keys ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct KvEventsConfig {
    /// vLLM: events are produced only when true.
    #[serde(default)]
    pub enable_kv_cache_events: Option<bool>,
    /// `zmq` or `null`.
    #[serde(default)]
    pub publisher: Option<String>,
    /// PUB endpoint (default `tcp://*:5557`).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// ROUTER replay endpoint (off when absent).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Topic (default empty).
    #[serde(default)]
    pub topic: Option<String>,
}

impl KvEventsConfig {
    /// Whether the engine of `runtime` publishes with this config.
    pub fn active(&self, runtime: Runtime) -> bool {
        let publisher = self.publisher.as_deref().map(str::to_ascii_lowercase);
        match runtime {
            Runtime::Vllm => {
                self.enable_kv_cache_events == Some(true) && publisher.as_deref() != Some("null")
            }
            Runtime::SgLang => match publisher.as_deref() {
                Some(p) => p == "zmq",
                None => self.enable_kv_cache_events == Some(true),
            },
        }
    }
}

/// Splits `tcp://HOST:PORT` into (host, port); `None` for other transports or malformed text.
fn split_tcp(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "[*]") || host.contains("::") && !is_loopback(host)
}

fn is_loopback(host: &str) -> bool {
    matches!(host, "localhost" | "::1" | "[::1]") || host.starts_with("127.")
}

fn host_for(ip: &str) -> String {
    if ip.contains(':') && !ip.starts_with('[') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    }
}

fn offset(port: u16, rank: u32) -> Option<u16> {
    u16::try_from(u32::from(port) + rank).ok()
}

/// Resolves the PUB endpoint of data-parallel rank `rank`: a wildcard host becomes `pod_ip`.
pub fn resolve_pub_endpoint(
    endpoint: &str,
    pod_ip: Option<&str>,
    rank: u32,
) -> Result<String, (&'static str, String)> {
    let (host, port) = split_tcp(endpoint).ok_or_else(|| {
        (
            issue::ENDPOINT_UNREACHABLE,
            format!("KV-event endpoint {endpoint:?} is not tcp://HOST:PORT; the node agent can only subscribe over TCP"),
        )
    })?;
    if !is_wildcard(host) {
        return Err((
            issue::ENDPOINT_UNREACHABLE,
            format!("KV-event endpoint {endpoint:?} names a host, so the engine connects to it instead of binding; use tcp://*:{port} so the node agent can subscribe"),
        ));
    }
    let ip = pod_ip.ok_or_else(|| {
        (
            issue::NO_POD_IP,
            "the pod has no IP yet; its KV-event publisher is planned once it has one".to_string(),
        )
    })?;
    let port = offset(port, rank).ok_or_else(|| {
        (
            issue::ENDPOINT_UNREACHABLE,
            format!("port {port} + data-parallel rank {rank} exceeds 65535"),
        )
    })?;
    Ok(format!("tcp://{}:{port}", host_for(ip)))
}

/// Resolves the replay (ROUTER, always bound) endpoint of rank `rank`.
pub fn resolve_replay_endpoint(
    endpoint: &str,
    pod_ip: Option<&str>,
    host_network: bool,
    rank: u32,
) -> Result<String, (&'static str, String)> {
    let (host, port) = split_tcp(endpoint).ok_or_else(|| {
        (
            issue::ENDPOINT_UNREACHABLE,
            format!("replay endpoint {endpoint:?} is not tcp://HOST:PORT"),
        )
    })?;
    let port = offset(port, rank).ok_or_else(|| {
        (
            issue::ENDPOINT_UNREACHABLE,
            format!("replay port {port} + data-parallel rank {rank} exceeds 65535"),
        )
    })?;
    let host = if is_wildcard(host) || host == "0.0.0.0" {
        host_for(pod_ip.ok_or_else(|| (issue::NO_POD_IP, "the pod has no IP yet".to_string()))?)
    } else if is_loopback(host) {
        if !host_network {
            return Err((
                issue::ENDPOINT_UNREACHABLE,
                format!("replay endpoint {endpoint:?} is bound to the pod's loopback, which the node agent cannot reach; bind tcp://*:{port}"),
            ));
        }
        host.to_string()
    } else {
        host.to_string()
    };
    Ok(format!("tcp://{host}:{port}"))
}

/// The flags [`dp_ranks`] reads for `runtime`.
fn rank_flags(runtime: Runtime) -> &'static [&'static str] {
    match runtime {
        Runtime::Vllm => &[
            "--data-parallel-rank",
            "-dpn",
            "--data-parallel-start-rank",
            "-dpr",
            "--data-parallel-size-local",
            "-dpl",
            "--data-parallel-size",
            "-dp",
        ],
        Runtime::SgLang => &[
            "--node-rank",
            "--nnodes",
            "--data-parallel-size",
            "--dp-size",
            "--dp",
        ],
    }
}

/// The engine arguments [`dp_ranks`] should read: every argument of `cmd` (shell expansions
/// included), with the value of each rank flag ([`rank_flags`]) that is a variable resolved
/// from the engine container's env the way the pod resolves it — a literal `value`, or a
/// `fieldRef` to the pod's own `metadata.name`, `metadata.namespace`,
/// `metadata.labels['…']` or `metadata.annotations['…']` (a StatefulSet's
/// `apps.kubernetes.io/pod-index`, a LeaderWorkerSet's worker index). `$(VAR)` is the
/// kubelet's (any command form); `$VAR` and `${VAR}` only a shell's. The second element lists
/// the `flag value` pairs that stay unknown; those flags are left out of the returned
/// arguments (so [`dp_ranks`] falls back to its defaults for them).
pub fn resolved_rank_args(
    pod: &Pod,
    c: &Container,
    cmd: &EngineCommand,
    runtime: Runtime,
) -> (Vec<String>, Vec<String>) {
    let texts = cmd.texts();
    let flags: Vec<String> = rank_flags(runtime)
        .iter()
        .map(|f| normalize_flag(f))
        .collect();
    let shell = cmd.form == crate::engine::command::CommandForm::Shell;
    let mut out = Vec::with_capacity(texts.len());
    let mut unknown = Vec::new();
    let mut i = 0;
    while i < texts.len() {
        let a = texts[i];
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (a, None),
        };
        let is_rank_flag = a.starts_with('-') && flags.contains(&normalize_flag(name));
        if !is_rank_flag {
            out.push(a.to_string());
            i += 1;
            continue;
        }
        let (value, consumed) = match inline {
            Some(v) => (Some(v), 1),
            None => match texts.get(i + 1) {
                Some(v) if !v.starts_with("--") => (Some(*v), 2),
                _ => (None, 1),
            },
        };
        match value {
            Some(v) if v.trim().parse::<u32>().is_err() => {
                match resolve_env_ref(pod, c, v.trim(), shell) {
                    Some(r) if r.trim().parse::<u32>().is_ok() => {
                        out.push(name.to_string());
                        out.push(r.trim().to_string());
                    }
                    _ => unknown.push(format!("{name} {v}")),
                }
            }
            Some(v) => {
                out.push(name.to_string());
                out.push(v.to_string());
            }
            None => out.push(a.to_string()),
        }
        i += consumed;
    }
    (out, unknown)
}

/// The value of `text` when it is exactly one variable reference (`$(VAR)`; with `shell` also
/// `$VAR`, `${VAR}`, optionally double-quoted) to an env entry of `c` the plan can evaluate
/// ([`resolved_rank_args`]).
fn resolve_env_ref(pod: &Pod, c: &Container, text: &str, shell: bool) -> Option<String> {
    let text = text.trim_matches('"');
    let var = if let Some(v) = text.strip_prefix("$(").and_then(|t| t.strip_suffix(')')) {
        v
    } else if !shell {
        return None;
    } else if let Some(v) = text.strip_prefix("${").and_then(|t| t.strip_suffix('}')) {
        v
    } else {
        text.strip_prefix('$')?
    };
    if var.is_empty()
        || !var
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
    {
        return None;
    }
    // The last entry of a name is the one the container gets.
    let e = c.env.iter().flatten().rev().find(|e| e.name == var)?;
    if let Some(from) = &e.value_from {
        let path = from.field_ref.as_ref()?.field_path.as_str();
        return pod_field(pod, path);
    }
    e.value.clone()
}

/// A `fieldRef` path of the pod's metadata (`metadata.name`, `metadata.namespace`,
/// `metadata.labels['k']`, `metadata.annotations['k']`).
fn pod_field(pod: &Pod, path: &str) -> Option<String> {
    let keyed = |prefix: &str| {
        path.strip_prefix(prefix)?
            .strip_prefix("['")?
            .strip_suffix("']")
            .map(str::to_string)
    };
    match path {
        "metadata.name" => pod.metadata.name.clone(),
        "metadata.namespace" => pod.metadata.namespace.clone(),
        _ => {
            if let Some(k) = keyed("metadata.labels") {
                pod.labels().get(&k).cloned()
            } else if let Some(k) = keyed("metadata.annotations") {
                pod.annotations().get(&k).cloned()
            } else {
                None
            }
        }
    }
}

/// The global data-parallel ranks whose publishers run in this pod.
pub fn dp_ranks(runtime: Runtime, args: &[&str]) -> Vec<u32> {
    match runtime {
        Runtime::Vllm => {
            if let Some(r) = flag_u32(args, &["--data-parallel-rank", "-dpn"]) {
                return vec![r];
            }
            let size = flag_u32(args, &["--data-parallel-size", "-dp"])
                .unwrap_or(1)
                .max(1);
            let local = flag_u32(args, &["--data-parallel-size-local", "-dpl"])
                .unwrap_or(size)
                .max(1);
            let start = flag_u32(args, &["--data-parallel-start-rank", "-dpr"]).unwrap_or(0);
            (start..start.saturating_add(local)).collect()
        }
        Runtime::SgLang => {
            if !flag_set(args, &["--enable-dp-attention"]) {
                return vec![0];
            }
            let size = flag_u32(args, &["--data-parallel-size", "--dp-size", "--dp"])
                .unwrap_or(1)
                .max(1);
            let nnodes = flag_u32(args, &["--nnodes"]).unwrap_or(1).max(1);
            let node_rank = flag_u32(args, &["--node-rank"]).unwrap_or(0);
            let per_node = (size / nnodes).max(1);
            let start = node_rank.saturating_mul(per_node);
            (start..start.saturating_add(per_node)).collect()
        }
    }
}

/// The flag that sets the engine's KV block size in tokens: vLLM `--block-size`, SGLang
/// `--page-size`.
pub fn block_size_flag(runtime: Runtime) -> &'static str {
    match runtime {
        Runtime::Vllm => "--block-size",
        Runtime::SgLang => "--page-size",
    }
}

/// The engine's KV block size in tokens from its (literal) arguments: [`block_size_flag`]'s
/// value, else the engine's default ([`VLLM_DEFAULT_BLOCK_SIZE`], [`SGLANG_DEFAULT_PAGE_SIZE`]);
/// at least 1. The node plan and the Pod webhook's kvevent-subscriber both chain at it.
pub fn engine_block_size(runtime: Runtime, args: &[&str]) -> u32 {
    let default = match runtime {
        Runtime::Vllm => VLLM_DEFAULT_BLOCK_SIZE,
        Runtime::SgLang => SGLANG_DEFAULT_PAGE_SIZE,
    };
    flag_u32(args, &[block_size_flag(runtime)])
        .unwrap_or(default)
        .max(1)
}

/// The raw value of the engine's block-size flag ([`block_size_flag`], its last occurrence) when
/// it is given but is not a literal number: a shell expansion (`$BLOCK`, `$(BLOCK)`), or text no
/// integer parses from. Neither admission nor the node plan can know the size then; both assume
/// the engine's bare default (`engine_block_size(runtime, &[])`: an earlier literal value does
/// not win over a later expansion) and say so — the Pod webhook as an admission warning, the
/// plan (when it plans KV events) as [`issue::BLOCK_SIZE_UNKNOWN`]. `None` when the flag is
/// absent (the engine's default is then the truth) or literal.
pub fn unknown_block_size(cmd: &EngineCommand, runtime: Runtime) -> Option<String> {
    cmd.find(block_size_flag(runtime)).last().and_then(|occ| {
        let (raw, index) = cmd.value_of(occ)?;
        let opaque = index.is_some_and(|i| cmd.is_opaque(i)) || raw.contains('$');
        (opaque || raw.trim().parse::<u32>().is_err()).then_some(raw)
    })
}

/// Tensor-parallel size from the engine args (default 1).
pub fn tensor_parallel(runtime: Runtime, args: &[&str]) -> u32 {
    let names: &[&str] = match runtime {
        Runtime::Vllm => &["--tensor-parallel-size", "-tp"],
        Runtime::SgLang => &["--tensor-parallel-size", "--tp-size", "--tp"],
    };
    flag_u32(args, names).unwrap_or(1).max(1)
}

fn bytes_of(q: &str) -> Option<u64> {
    let v = crate::adapters::parse_quantity(q)?;
    (v > 0.0).then(|| v.ceil() as u64)
}

/// The engine plan of one wired pod, and what could not be planned. `pod` must be scheduled.
pub fn engine_plan(pod: &Pod, backend: &CacheBackend) -> (EnginePlan, Vec<PlanIssue>) {
    let key = pod_key(pod);
    let node = node_of(pod);
    let mut issues = Vec::new();
    let mut note = |reason: &'static str, message: String| {
        issues.push(PlanIssue {
            pod: key.clone(),
            node: node.clone(),
            reason,
            message,
        })
    };
    let spec = wired_spec(pod, backend, &mut note);
    let runtime = spec.runtime;
    let hash_scheme = match runtime {
        Runtime::Vllm => HashScheme::Vllm,
        Runtime::SgLang => HashScheme::Sglang,
    };
    let command = match engine_command(pod, runtime) {
        Ok(c) => Some(c),
        Err(why) => {
            note(
                issue::ENGINE_NOT_FOUND,
                format!(
                    "no engine container of the pod is known to launch {} ({why}): its KV events and parallelism are not planned",
                    runtime.as_str()
                ),
            );
            None
        }
    };
    let args: Vec<&str> = command
        .as_ref()
        .map(|(_, c)| c.literal_texts())
        .unwrap_or_default();

    let unknown_size = command
        .as_ref()
        .and_then(|(_, cmd)| unknown_block_size(cmd, runtime));
    let block_size = match unknown_size {
        Some(_) => engine_block_size(runtime, &[]),
        None => engine_block_size(runtime, &args),
    };

    let offload = spec.integration_mode == IntegrationMode::Offload;
    let mp_worker = runtime == Runtime::SgLang && spec.cache_type == CacheType::LMCache && offload;
    let mp_worker_port = if mp_worker {
        u16::try_from(spec.worker_port).ok().filter(|p| *p > 0)
    } else {
        None
    };
    let mut shm: Option<u64> = None;
    if mp_worker {
        let q = &spec.host_memory_capacity;
        match bytes_of(q) {
            Some(b) => shm = Some(b),
            None => note(
                issue::INVALID_QUANTITY,
                format!("spec.lmCache.hostMemory.capacity {q:?} is not a positive quantity; the MP worker's /dev/shm need is not planned"),
            ),
        }
    }
    if tensor_parallel(runtime, &args) > 1 {
        shm = Some(shm.unwrap_or(0).max(TENSOR_PARALLEL_SHM_BYTES));
    }

    let model = spec.model_id.clone();
    let all_args: Vec<&str> = command.as_ref().map(|(_, c)| c.texts()).unwrap_or_default();
    let mut kv_events = Vec::new();
    if command.is_some() {
        match model.as_deref() {
            None => note(
                issue::NO_MODEL_ID,
                format!(
                    "CacheBackend {} has no spec.observation.modelID, so its engines' KV events are not subscribed",
                    backend_key(backend)
                ),
            ),
            Some(_) => {
                let ranks = match &command {
                    Some((c, cmd)) => {
                        let (rank_args, unknown) = resolved_rank_args(pod, c, cmd, runtime);
                        let refs: Vec<&str> = rank_args.iter().map(String::as_str).collect();
                        let ranks = dp_ranks(runtime, &refs);
                        // SGLang runs one publisher whatever its ranks without DP attention.
                        let matters = runtime == Runtime::Vllm
                            || flag_set(&refs, &["--enable-dp-attention"]);
                        if !unknown.is_empty() && matters {
                            note(
                                issue::DATA_PARALLEL_RANK_UNKNOWN,
                                format!(
                                    "{} cannot be resolved from the pod (not a literal, an env value or a fieldRef to the pod's name, namespace, labels or annotations); the plan subscribes data-parallel rank(s) {ranks:?}, which may not be the pod's: a rank planned but not run reads Disconnected, a rank run but not planned is not indexed. Write the value literally or take it from an env entry",
                                    unknown.join(", ")
                                ),
                            );
                        }
                        ranks
                    }
                    None => dp_ranks(runtime, &args),
                };
                // Every argument: the engine takes the last occurrence, an expansion too.
                kv_events = kv_sources(pod, runtime, &all_args, ranks, &mut note)
            }
        }
    }
    // The block size matters to the KV-event subscription only.
    if let Some(raw) = unknown_size.filter(|_| !kv_events.is_empty()) {
        note(
            issue::BLOCK_SIZE_UNKNOWN,
            format!(
                "{} {raw:?} is not a literal number; the node plan assumes the engine default of {block_size} tokens per block, so the agent skips blocks shorter than that and chains longer ones at their own size: write the value literally",
                block_size_flag(runtime)
            ),
        );
    }

    let plan = EnginePlan {
        namespace: pod.namespace().unwrap_or_default(),
        pod: pod.name_any(),
        pod_uid: pod.metadata.uid.clone(),
        model: model.unwrap_or_default(),
        hash_scheme,
        block_size,
        keeps_l2: offload,
        // LMCache loads whole chunks only: the index credits an offload-only match in them.
        offload_chunk_tokens: (offload && spec.cache_type == CacheType::LMCache)
            .then(|| {
                backend
                    .spec
                    .lm_cache
                    .as_ref()
                    .map_or(DEFAULT_LMCACHE_CHUNK_SIZE_TOKENS, |l| {
                        l.effective_chunk_size_tokens()
                    })
            })
            .and_then(|c| u32::try_from(c).ok()),
        backend: backend_key(backend),
        shm_required_bytes: shm,
        shm_containers: command
            .as_ref()
            .map(|(c, _)| shm_containers(pod, c))
            .unwrap_or_default(),
        mp_worker_port,
        metrics_url: (offload && !kv_events.is_empty())
            .then(|| engine_metrics_url(pod, runtime, &all_args))
            .flatten(),
        kv_events,
    };
    (plan, issues)
}

/// The engine's Prometheus endpoint, `http://<host>:<port>/metrics`, as the node agent can
/// reach it; `args` are every engine argument (shell expansions included, so an unknown
/// `--port $PORT` plans nothing rather than a wrong port).
///
/// Port: `--port` (vLLM default [`VLLM_DEFAULT_PORT`], SGLang [`SGLANG_DEFAULT_PORT`]). Host:
/// the pod IP when the server binds every interface (vLLM's default; `0.0.0.0`, `::`) or an
/// address from an expansion (`$(POD_IP)`); the loopback address only for hostNetwork pods
/// (none otherwise: the agent cannot reach a pod's loopback); another literal host as given.
/// SGLang binds `127.0.0.1` by default and serves `/metrics` only with `--enable-metrics`.
pub fn engine_metrics_url(pod: &Pod, runtime: Runtime, args: &[&str]) -> Option<String> {
    if runtime == Runtime::SgLang && !flag_set(args, &["--enable-metrics"]) {
        return None;
    }
    let port = match flag_value(args, &["--port"]) {
        Some(v) => v.trim().parse::<u16>().ok().filter(|p| *p > 0)?,
        None => match runtime {
            Runtime::Vllm => VLLM_DEFAULT_PORT,
            Runtime::SgLang => SGLANG_DEFAULT_PORT,
        },
    };
    let host = flag_value(args, &["--host"]).map(|h| h.trim().to_string());
    let host = match host.as_deref() {
        None if runtime == Runtime::SgLang => Some("127.0.0.1"),
        h => h,
    };
    let host = match host {
        Some(h) if is_loopback(h) => {
            if !host_network(pod) {
                return None;
            }
            host_for(h.trim_start_matches('[').trim_end_matches(']'))
        }
        Some(h) if !h.is_empty() && !is_wildcard(h) && h != "0.0.0.0" && !h.contains('$') => {
            host_for(h.trim_start_matches('[').trim_end_matches(']'))
        }
        _ => host_for(&pod_ip(pod)?),
    };
    Some(format!("http://{host}:{port}/metrics"))
}

fn kv_sources(
    pod: &Pod,
    runtime: Runtime,
    args: &[&str],
    ranks: Vec<u32>,
    note: &mut impl FnMut(&'static str, String),
) -> Vec<KvEventSource> {
    let Some(raw) = flag_value(args, &["--kv-events-config"]) else {
        note(
            issue::KV_EVENTS_DISABLED,
            format!(
                "the engine has no --kv-events-config; launch it with --kv-events-config '{}' to publish KV events",
                match runtime {
                    Runtime::Vllm => r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#,
                    Runtime::SgLang => r#"{"publisher":"zmq","endpoint":"tcp://*:5557"}"#,
                }
            ),
        );
        return Vec::new();
    };
    let cfg: KvEventsConfig = match serde_json::from_str(&raw) {
        Ok(c) => c,
        Err(_) if raw.contains('$') => {
            note(
                issue::KV_EVENTS_CONFIG_INVALID,
                format!("--kv-events-config is an expansion ({raw}) whose value is known only when the engine starts, so its publishers are not planned: write the JSON literally"),
            );
            return Vec::new();
        }
        Err(e) => {
            note(
                issue::KV_EVENTS_CONFIG_INVALID,
                format!("--kv-events-config is not valid JSON ({e}): {raw}"),
            );
            return Vec::new();
        }
    };
    if !cfg.active(runtime) {
        note(
            issue::KV_EVENTS_DISABLED,
            match runtime {
                Runtime::Vllm => "--kv-events-config does not enable events (needs \"enable_kv_cache_events\": true and a zmq publisher)".to_string(),
                Runtime::SgLang => "--kv-events-config does not select the zmq publisher (\"publisher\": \"zmq\")".to_string(),
            },
        );
        return Vec::new();
    }
    let endpoint = cfg
        .endpoint
        .clone()
        .filter(|e| !e.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_KV_EVENTS_ENDPOINT.to_string());
    let ip = pod_ip(pod);
    let hostnet = host_network(pod);
    let mut out = Vec::new();
    for rank in ranks {
        let pub_ep = match resolve_pub_endpoint(&endpoint, ip.as_deref(), rank) {
            Ok(e) => e,
            Err((reason, message)) => {
                note(reason, message);
                return Vec::new();
            }
        };
        let replay = match cfg
            .replay_endpoint
            .as_deref()
            .filter(|e| !e.trim().is_empty())
        {
            None => None,
            Some(r) => match resolve_replay_endpoint(r, ip.as_deref(), hostnet, rank) {
                Ok(e) => Some(e),
                Err((reason, message)) => {
                    note(reason, message);
                    None
                }
            },
        };
        out.push(KvEventSource {
            endpoint: pub_ep,
            replay_endpoint: replay,
            topic: cfg.topic.clone().unwrap_or_default(),
            dp_rank: rank,
        });
    }
    out
}

/// `namespace/name` of a CacheBackend.
pub fn backend_key(cb: &CacheBackend) -> String {
    format!("{}/{}", cb.namespace().unwrap_or_default(), cb.name_any())
}

fn tcp_port(endpoint: &str) -> Option<u16> {
    split_tcp(endpoint).map(|(_, p)| p)
}

/// Host ports a hostNetwork engine pod uses: declared container ports (containers and native
/// sidecars), KV-event and replay ports, the MP-worker port. (port, purpose), sorted, unique.
fn engine_host_ports(pod: &Pod, plan: &EnginePlan) -> Vec<(u16, String)> {
    let mut ports: BTreeMap<u16, String> = BTreeMap::new();
    let key = pod_key(pod);
    if let Some(spec) = &pod.spec {
        let sidecars = spec
            .init_containers
            .iter()
            .flatten()
            .filter(|c| c.restart_policy.as_deref() == Some("Always"));
        for c in spec.containers.iter().chain(sidecars) {
            for p in c.ports.iter().flatten() {
                if p.protocol.as_deref().unwrap_or("TCP") != "TCP" {
                    continue;
                }
                if let Ok(port) = u16::try_from(p.container_port) {
                    let what = p.name.clone().unwrap_or_else(|| port.to_string());
                    ports.entry(port).or_insert_with(|| {
                        format!("engine {key} container {} port {what}", c.name)
                    });
                }
            }
        }
    }
    for s in &plan.kv_events {
        if let Some(p) = tcp_port(&s.endpoint) {
            ports
                .entry(p)
                .or_insert_with(|| format!("engine {key} KV events (rank {})", s.dp_rank));
        }
        if let Some(p) = s.replay_endpoint.as_deref().and_then(tcp_port) {
            ports
                .entry(p)
                .or_insert_with(|| format!("engine {key} KV-event replay (rank {})", s.dp_rank));
        }
    }
    if let Some(p) = plan.mp_worker_port {
        ports
            .entry(p)
            .or_insert_with(|| format!("engine {key} LMCache MP worker"));
    }
    ports.into_iter().collect()
}

fn is_mooncake_master(pod: &Pod) -> bool {
    let labels = pod.labels();
    host_network(pod)
        && labels.get(LABEL_NAME).map(String::as_str)
            == Some(crate::reconcile::render::mooncake::Mooncake.slug())
        && labels.get(LABEL_MANAGED_BY).map(String::as_str) == Some(MANAGED_BY)
}

fn expectation(pod: &Pod, port: u16, purpose: String) -> Option<PortExpectation> {
    match port_phase(pod) {
        // Free for this pod: its native sidecars (the LMCache MP worker) bind before the main
        // containers start, and are no conflict.
        PortPhase::NotStarted => Some(PortExpectation {
            port,
            expect: PortExpect::Free,
            owner: pod.metadata.uid.clone().map(|uid| PortOwner {
                exe: None,
                pod_uid: Some(uid),
            }),
            purpose,
        }),
        PortPhase::Ready => Some(PortExpectation {
            port,
            expect: PortExpect::Held,
            owner: pod.metadata.uid.clone().map(|uid| PortOwner {
                exe: None,
                pod_uid: Some(uid),
            }),
            purpose,
        }),
        PortPhase::Starting => None,
    }
}

#[derive(Default)]
struct NodeAcc {
    plan: NodePlan,
    port_owner: BTreeMap<u16, String>,
}

impl NodeAcc {
    fn claim(&mut self, pod: &Pod, port: u16, purpose: String, issues: &mut Vec<PlanIssue>) {
        let key = pod_key(pod);
        if let Some(other) = self.port_owner.get(&port) {
            if *other != key {
                issues.push(PlanIssue {
                    pod: key,
                    node: node_of(pod),
                    reason: issue::HOST_PORT_CONFLICT,
                    message: format!(
                        "host port {port} ({purpose}) is also claimed by {other} on this node"
                    ),
                });
            }
            return;
        }
        self.port_owner.insert(port, key);
        if let Some(e) = expectation(pod, port, purpose) {
            self.plan.ports.push(e);
        }
    }
}

/// Derives every node's plan from all pods and all CacheBackends (module docs for the rules).
/// Pure and deterministic: engines sorted by (namespace, pod), ports by number.
pub fn derive_plans(pods: &[Pod], backends: &[CacheBackend]) -> DerivedPlans {
    let by_key: BTreeMap<String, &CacheBackend> =
        backends.iter().map(|b| (backend_key(b), b)).collect();
    let mut nodes: BTreeMap<String, NodeAcc> = BTreeMap::new();
    let mut issues = Vec::new();
    let mut sorted: Vec<&Pod> = pods.iter().filter(|p| !finished(p)).collect();
    sorted.sort_by_key(|p| pod_key(p));
    for pod in sorted {
        let Some(node) = node_of(pod) else {
            continue;
        };
        if is_mooncake_master(pod) {
            let acc = nodes.entry(node.clone()).or_default();
            let key = pod_key(pod);
            for (port, what) in [
                (RPC_PORT, "RPC"),
                (METADATA_PORT, "HTTP metadata"),
                (METRICS_PORT, "metrics"),
            ] {
                if let Ok(port) = u16::try_from(port) {
                    acc.claim(
                        pod,
                        port,
                        format!("mooncake master {key} {what}"),
                        &mut issues,
                    );
                }
            }
            continue;
        }
        let Some(injected_by) = pod.annotations().get(INJECTED_BY).filter(|v| !v.is_empty()) else {
            continue;
        };
        let Some(backend) = by_key.get(injected_by.as_str()) else {
            issues.push(PlanIssue {
                pod: pod_key(pod),
                node: Some(node.clone()),
                reason: issue::BACKEND_NOT_FOUND,
                message: format!(
                    "the pod was wired by CacheBackend {injected_by}, which no longer exists"
                ),
            });
            continue;
        };
        if let Some(uid) = pod
            .annotations()
            .get(INJECTED_BY_UID)
            .filter(|v| !v.is_empty())
        {
            if backend
                .metadata
                .uid
                .as_deref()
                .is_some_and(|live| live != uid)
            {
                issues.push(PlanIssue {
                    pod: pod_key(pod),
                    node: Some(node.clone()),
                    reason: issue::STALE_INJECTION,
                    message: format!("the pod was wired by an earlier CacheBackend {injected_by} (uid {uid}); roll it to wire it to the current one"),
                });
                continue;
            }
        }
        let (engine, mut pod_issues) = engine_plan(pod, backend);
        issues.append(&mut pod_issues);
        let acc = nodes.entry(node.clone()).or_default();
        if requests_gpu(pod) {
            acc.plan.gpu_node = true;
        }
        if host_ipc(pod) {
            if let Some(b) = engine.shm_required_bytes {
                let cur = acc.plan.shm.as_ref().map_or(0, |s| s.required_bytes);
                acc.plan.shm = Some(ShmRequirement {
                    required_bytes: cur.max(b),
                });
            }
        }
        if host_network(pod) {
            for (port, purpose) in engine_host_ports(pod, &engine) {
                acc.claim(pod, port, purpose, &mut issues);
            }
        }
        acc.plan.engines.push(engine);
    }
    let plans = nodes
        .into_iter()
        .map(|(node, mut acc)| {
            acc.plan.ports.sort_by_key(|p| p.port);
            acc.plan
                .engines
                .sort_by(|a, b| (&a.namespace, &a.pod).cmp(&(&b.namespace, &b.pod)));
            (node, acc.plan)
        })
        .collect();
    DerivedPlans { plans, issues }
}

/// Adds model-cache reader mounts (node → mounts, as
/// [`crate::reconcile::model_cache::plan::reader_mounts`] computes them) to the plans; a node
/// with readers only gets a plan of its own. Mounts are sorted by (namespace, pod, path).
pub fn add_reader_mounts(
    plans: &mut BTreeMap<String, NodePlan>,
    mounts: BTreeMap<String, Vec<ReaderMount>>,
) {
    for (node, mut list) in mounts {
        if list.is_empty() {
            continue;
        }
        list.sort_by(|a, b| (&a.namespace, &a.pod, &a.path).cmp(&(&b.namespace, &b.pod, &b.path)));
        plans.entry(node).or_default().reader_mounts = list;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn plan_issues_are_reported_when_they_appear_and_when_they_clear() {
        let issue = |pod: &str, reason: &'static str| PlanIssue {
            pod: pod.into(),
            node: Some("gpu-1".into()),
            reason,
            message: format!("{pod}: {reason}"),
        };
        let mut log = PlanIssueLog::default();
        let first = [
            issue("ml/a", issue::NO_MODEL_ID),
            issue("ml/b", issue::ENGINE_NOT_FOUND),
        ];
        let (appeared, cleared) = log.update(&first);
        assert_eq!(appeared, first.iter().collect::<Vec<_>>());
        assert!(cleared.is_empty());
        // The same issues on the next derivation: nothing new, nothing cleared.
        let (appeared, cleared) = log.update(&first);
        assert!(appeared.is_empty() && cleared.is_empty());
        // `a` gets a second reason, `b` is fixed.
        let second = [
            issue("ml/a", issue::NO_MODEL_ID),
            issue("ml/a", issue::BLOCK_SIZE_UNKNOWN),
        ];
        let (appeared, cleared) = log.update(&second);
        assert_eq!(appeared, vec![&second[1]]);
        assert_eq!(cleared, vec![("ml/b".to_string(), issue::ENGINE_NOT_FOUND)]);
        // After leadership moves, the issues are new again.
        log.clear();
        let (appeared, _) = log.update(&second);
        assert_eq!(appeared.len(), 2);
    }

    #[test]
    fn flags_in_every_spelling() {
        let args = [
            "--tp",
            "2",
            "--kv_events_config={}",
            "-dp",
            "4",
            "--block-size=32",
        ];
        assert_eq!(
            flag_value(&args, &["--tp-size", "--tp"]).as_deref(),
            Some("2")
        );
        assert_eq!(
            flag_value(&args, &["--kv-events-config"]).as_deref(),
            Some("{}")
        );
        assert_eq!(flag_u32(&args, &["--data-parallel-size", "-dp"]), Some(4));
        assert_eq!(flag_u32(&args, &["--block-size"]), Some(32));
        assert!(flag_set(
            &["--enable-dp-attention"],
            &["--enable-dp-attention"]
        ));
        assert!(!flag_set(
            &["--enable-dp-attention=false"],
            &["--enable-dp-attention"]
        ));
    }

    #[test]
    fn endpoints_resolve_to_the_pod_ip_with_rank_offsets() {
        assert_eq!(
            resolve_pub_endpoint("tcp://*:5557", Some("10.0.0.5"), 2).unwrap(),
            "tcp://10.0.0.5:5559"
        );
        assert_eq!(
            resolve_pub_endpoint("tcp://*:5557", Some("fd00::5"), 0).unwrap(),
            "tcp://[fd00::5]:5557"
        );
        assert_eq!(
            resolve_pub_endpoint("tcp://collector:5557", Some("10.0.0.5"), 0)
                .unwrap_err()
                .0,
            issue::ENDPOINT_UNREACHABLE
        );
        assert_eq!(
            resolve_pub_endpoint("tcp://*:5557", None, 0).unwrap_err().0,
            issue::NO_POD_IP
        );
        assert_eq!(
            resolve_replay_endpoint("tcp://127.0.0.1:5558", Some("10.0.0.5"), true, 1).unwrap(),
            "tcp://127.0.0.1:5559"
        );
        assert!(
            resolve_replay_endpoint("tcp://127.0.0.1:5558", Some("10.0.0.5"), false, 0).is_err()
        );
    }

    #[test]
    fn reader_mounts_join_or_create_node_plans() {
        let mut plans = BTreeMap::from([(
            "n1".to_string(),
            NodePlan {
                gpu_node: true,
                ..Default::default()
            },
        )]);
        let m = |pod: &str, path: &str| ReaderMount {
            pod: pod.into(),
            path: path.into(),
            ..Default::default()
        };
        add_reader_mounts(
            &mut plans,
            BTreeMap::from([
                ("n1".to_string(), vec![m("b", "/models"), m("a", "/models")]),
                ("n2".to_string(), vec![m("c", "/m")]),
                ("n3".to_string(), vec![]),
            ]),
        );
        assert!(plans["n1"].gpu_node);
        assert_eq!(plans["n1"].reader_mounts[0].pod, "a");
        assert_eq!(plans["n2"].reader_mounts.len(), 1);
        assert!(!plans.contains_key("n3"));
    }

    #[test]
    fn dp_ranks_per_engine() {
        assert_eq!(dp_ranks(Runtime::Vllm, &[]), vec![0]);
        assert_eq!(dp_ranks(Runtime::Vllm, &["-dp", "4"]), vec![0, 1, 2, 3]);
        assert_eq!(
            dp_ranks(
                Runtime::Vllm,
                &[
                    "--data-parallel-size",
                    "4",
                    "--data-parallel-size-local",
                    "2",
                    "--data-parallel-start-rank",
                    "2"
                ]
            ),
            vec![2, 3]
        );
        assert_eq!(
            dp_ranks(
                Runtime::Vllm,
                &["--data-parallel-size", "4", "--data-parallel-rank", "3"]
            ),
            vec![3]
        );
        assert_eq!(dp_ranks(Runtime::SgLang, &["--dp-size", "4"]), vec![0]);
        assert_eq!(
            dp_ranks(
                Runtime::SgLang,
                &["--dp-size", "4", "--enable-dp-attention"]
            ),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            dp_ranks(
                Runtime::SgLang,
                &[
                    "--dp-size",
                    "4",
                    "--enable-dp-attention",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "1"
                ]
            ),
            vec![2, 3]
        );
    }
}
