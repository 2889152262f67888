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

use crate::engine::container::{shm_mount, EnginePod};
use crate::engine::flags::{
    block_size_flag, dp_attention, dp_ranks, engine_block_size, engine_metrics_url,
    kv_events_config_arg, resolved_rank_args, tensor_parallel, unknown_block_size,
};
use crate::engine::kv_events::{
    resolve_pub_endpoint, resolve_replay_endpoint, split_tcp, KvEventsConfig,
    DEFAULT_KV_EVENTS_ENDPOINT,
};
use crate::engine::{has_subscriber_sidecar, host_network, pod_ip, TENSOR_PARALLEL_SHM_BYTES};
use crate::reconcile::annotations::{INJECTED_BY, INJECTED_BY_UID, WIRED_SPEC};
use crate::reconcile::render::mooncake::{METADATA_PORT, METRICS_PORT, RPC_PORT};
use crate::reconcile::render::{ProviderRenderer, LABEL_MANAGED_BY, LABEL_NAME, MANAGED_BY};
use ic_shared::crd::{CacheBackend, CacheType, IntegrationMode, Runtime, WiredSpec};
use ic_shared::plan::{
    EnginePlan, HashScheme, KvEventSource, NodePlan, PlannedContainer, PortExpect, PortExpectation,
    PortOwner, ReaderMount, ShmRequirement,
};
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;

/// The containers whose `/dev/shm` the engine's requirement is for (plan `shmContainers`): the
/// engine container, then every other container or native sidecar that mounts the same volume
/// at `/dev/shm` (SGLang's LMCache MP worker), each with its runtime ID while pod status says it
/// is running.
pub fn shm_containers(pod: &Pod, engine: &Container) -> Vec<PlannedContainer> {
    let shm_volume = shm_mount(engine).map(|m| m.name.as_str());
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
        .filter(|c| shm_volume.is_some() && shm_mount(c).map(|m| m.name.as_str()) == shm_volume);
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
    pub const ENDPOINT_UNREACHABLE: &str = crate::engine::kv_events::ENDPOINT_UNREACHABLE;
    /// The pod has no IP yet (wildcard endpoints cannot be resolved).
    pub const NO_POD_IP: &str = crate::engine::kv_events::NO_POD_IP;
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

fn host_ipc(pod: &Pod) -> bool {
    pod.spec.as_ref().and_then(|s| s.host_ipc).unwrap_or(false)
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
    // The engine pod read once (engine container, parsed command): every flag below is its.
    let engine = match EnginePod::read(pod, runtime) {
        Ok(e) => Some(e),
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
    let args: Vec<&str> = engine
        .as_ref()
        .map(|e| e.command.literal_texts())
        .unwrap_or_default();

    let unknown_size = engine
        .as_ref()
        .and_then(|e| unknown_block_size(&e.command, runtime));
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
    let all_args: Vec<&str> = engine
        .as_ref()
        .map(|e| e.command.texts())
        .unwrap_or_default();
    let mut kv_events = Vec::new();
    if engine.is_some() {
        match model.as_deref() {
            None => note(
                issue::NO_MODEL_ID,
                format!(
                    "CacheBackend {} has no spec.observation.modelID, so its engines' KV events are not subscribed",
                    backend_key(backend)
                ),
            ),
            Some(_) => {
                let ranks = match &engine {
                    Some(e) => {
                        let (rank_args, unknown) =
                            resolved_rank_args(pod, &e.container, &e.command, runtime);
                        let refs: Vec<&str> = rank_args.iter().map(String::as_str).collect();
                        let ranks = dp_ranks(runtime, &refs);
                        // SGLang runs one publisher whatever its ranks without DP attention.
                        let matters = runtime == Runtime::Vllm
                            || dp_attention(&refs);
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
                crate::adapters::lmcache_chunk_tokens(
                    pod,
                    runtime,
                    engine.as_ref().map(|e| &e.container),
                    backend,
                )
            })
            .flatten(),
        backend: backend_key(backend),
        shm_required_bytes: shm,
        shm_containers: engine
            .as_ref()
            .map(|e| shm_containers(pod, &e.container))
            .unwrap_or_default(),
        mp_worker_port,
        metrics_url: (offload && !kv_events.is_empty())
            .then(|| engine_metrics_url(pod, runtime, &all_args))
            .flatten(),
        kv_events,
    };
    (plan, issues)
}

fn kv_sources(
    pod: &Pod,
    runtime: Runtime,
    args: &[&str],
    ranks: Vec<u32>,
    note: &mut impl FnMut(&'static str, String),
) -> Vec<KvEventSource> {
    let Some(raw) = kv_events_config_arg(args) else {
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
    let cfg = match KvEventsConfig::parse(&raw) {
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
}
