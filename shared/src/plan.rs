//! The node plan: what an agent must watch on its node (DESIGN.md "Node plans").
//!
//! In cluster the controller derives one plan per node from the engine pods scheduled there and
//! pushes it down the agent's stream ([`crate::proto::NodePlanUpdate`] carries it as JSON). In
//! standalone mode `ic-agent --plan FILE` reads the same document as YAML or JSON.
//!
//! ```yaml
//! gpuNode: false
//! shm: { requiredBytes: 1073741824 }
//! ports:
//!   - { port: 5557, expect: held, owner: { exe: /usr/bin/python3.11 } }
//!   - { port: 8080, expect: free }
//! engines:
//!   - namespace: default
//!     pod: vllm-0
//!     model: meta-llama/Llama-3.1-8B
//!     hashScheme: vllm
//!     blockSize: 16
//!     keepsL2: true
//!     kvEvents:
//!       - { endpoint: "tcp://127.0.0.1:5557", replayEndpoint: "tcp://127.0.0.1:5558", dpRank: 0 }
//!     metricsUrl: http://127.0.0.1:8000/metrics
//! readerMounts:
//!   - namespace: team-a
//!     pod: vllm-0
//!     podUid: 3f1c2a9e-1b2c-4d5e-8f90-0123456789ab
//!     path: /models
//!     samples: [{ file: config.json, sha256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08" }]
//! cuda: { runtimeVersion: "12.8" }
//! ```

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Everything an agent checks and subscribes to on its node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePlan {
    /// Monotonic plan generation (controller-assigned; 0 for a file plan).
    #[serde(default)]
    pub generation: u64,
    /// True when the node is expected to have GPUs: missing NVML then reads Warning, not Unknown.
    #[serde(default)]
    pub gpu_node: bool,
    /// Requirement on the host's `/dev/shm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<ShmRequirement>,
    /// Host TCP ports that must be free or held by an expected owner.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortExpectation>,
    /// Engine pods on this node and their KV-event publishers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<EnginePlan>,
    /// Model-cache volumes mounted by reader pods on this node (spec 004 "Qualification"): each
    /// must be mounted read-only in the pod and its sample files must match the writer's digests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reader_mounts: Vec<ReaderMount>,
    /// What the engines on this node need from the CUDA driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaRequirement>,
}

/// A model-cache volume as one reader pod sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReaderMount {
    /// Reader pod namespace.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Reader pod name (shown in results: subject `<namespace>/<pod>:<path>`).
    pub pod: String,
    /// Reader pod UID: the agent finds the pod's processes by it (their cgroups) and looks at
    /// the volume through their mount namespace. Without it (standalone mode) the path is
    /// looked up in the agent's own mount namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// Absolute mount path inside the pod's containers, e.g. `/models`.
    pub path: String,
    /// True (the default) when the volume must be read-only: the mount must carry `ro` and
    /// every write probe must fail with EROFS.
    #[serde(default = "default_true")]
    pub expect_read_only: bool,
    /// Files whose content must equal what the writer produced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<SampleDigest>,
    /// Model-cache binding (`namespace/name`) that planned the mount, for messages.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub binding: String,
    /// The pod's containers that mount the volume at `path` (main containers and native
    /// sidecars), each with its runtime ID while it runs. The agent looks through those that
    /// run; when none does the result is Unknown, not `ReaderVolumeMissing` from a container
    /// that never mounts it. Empty when unknown (standalone): every container is looked through.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<PlannedContainer>,
}

impl Default for ReaderMount {
    fn default() -> Self {
        ReaderMount {
            namespace: default_namespace(),
            pod: String::new(),
            pod_uid: None,
            path: String::new(),
            expect_read_only: true,
            samples: Vec::new(),
            binding: String::new(),
            containers: Vec::new(),
        }
    }
}

/// A sample file of a model-cache volume and the writer's digest of it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SampleDigest {
    /// Path relative to the mount path, e.g. `config.json` (no `..` components).
    pub file: String,
    /// SHA-256 of the file's content as 64 hex digits (either case).
    pub sha256: String,
}

/// The CUDA driver the node's engines need.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CudaRequirement {
    /// Highest CUDA runtime version among the engine images on this node, `major.minor`
    /// (e.g. `12.8`). The `cuda` check loads its probe kernel at the matching PTX ISA version, so
    /// a driver too old for that runtime fails the check exactly where the engine would fail:
    /// at module load / kernel launch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_version: Option<String>,
}

/// Required `/dev/shm` capacity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShmRequirement {
    /// Minimum size of the tmpfs in bytes.
    pub required_bytes: u64,
}

/// What a host port must look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub enum PortExpect {
    /// Nothing may listen on it (a hostNetwork engine or Mooncake master needs it).
    #[default]
    Free,
    /// Something must listen on it, and if `owner` is given it must be that owner.
    Held,
}

/// A host port expectation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortExpectation {
    /// TCP port, 1–65535.
    pub port: u16,
    /// Free or held.
    #[serde(default)]
    pub expect: PortExpect,
    /// Expected owner when held. With `free`: the pod the port is kept free for (a pod not
    /// started yet), whose own processes may already hold it — a native sidecar binds its port
    /// before the main containers start — so a listener of that pod is no conflict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<PortOwner>,
    /// Why the plan cares (shown in messages), e.g. "mooncake master rpc".
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub purpose: String,
}

/// Identity of an expected listener. Every given field must match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortOwner {
    /// Absolute path of the owner's executable (`/proc/<pid>/exe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    /// Kubernetes pod UID the owner runs in (from its cgroup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
}

/// Engine hash scheme: which engine family's events a stream carries (spec "kvevent-subscriber"
/// `--hash-scheme`). Lookups chunk raw tokens at the block size registered per scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HashScheme {
    /// vLLM (any release 0.9–0.33).
    #[default]
    Vllm,
    /// SGLang (0.4.9–0.5.23).
    Sglang,
}

impl HashScheme {
    /// Lower-case wire name (`vllm`, `sglang`).
    pub fn as_str(self) -> &'static str {
        match self {
            HashScheme::Vllm => "vllm",
            HashScheme::Sglang => "sglang",
        }
    }

    /// Parses the wire name; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "vllm" => Some(HashScheme::Vllm),
            "sglang" => Some(HashScheme::Sglang),
            _ => None,
        }
    }
}

/// One engine pod on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnginePlan {
    /// Pod namespace; also the tenant in the index.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Pod name; the replica id in routing answers.
    pub pod: String,
    /// Pod UID (finds its processes through their cgroups); optional in standalone mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The containers whose `/dev/shm` `shmRequiredBytes` is for: the engine container first,
    /// then any container that mounts the same volume at `/dev/shm` (SGLang's LMCache MP
    /// worker). The `shm` check inspects the first of them that runs; empty when unknown
    /// (standalone plans, no engine container found), and the check then takes the largest
    /// `/dev/shm` among the pod's containers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shm_containers: Vec<PlannedContainer>,
    /// Model id (the CacheBackend's `observation.modelID`).
    #[serde(default)]
    pub model: String,
    /// Engine family.
    #[serde(default)]
    pub hash_scheme: HashScheme,
    /// Engine block size in tokens (used when an event carries none, and registered for lookups).
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// True when the pod's CacheBackend keeps an L2 (integration.mode Offload): BlockRemoved then
    /// demotes a block to T2 instead of evicting it.
    #[serde(default)]
    pub keeps_l2: bool,
    /// Tokens per chunk of the pod's offload tier when it loads only whole chunks (LMCache's
    /// `chunk_size`: the CacheBackend's `spec.lmCache.chunkSizeTokens` with integration mode
    /// Offload); `None` when the pod has no such tier. Reported on each stream's descriptor
    /// (`offload_chunk_tokens`) so the index credits an offload-only match in whole chunks
    /// (docs/kv-events.md, "Chunked offload tiers").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_chunk_tokens: Option<u32>,
    /// CacheBackend `namespace/name` that wired the pod, if any.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backend: String,
    /// Required `/dev/shm` inside the pod, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_required_bytes: Option<u64>,
    /// LMCache MP-worker port inside the pod's network namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mp_worker_port: Option<u16>,
    /// KV-event publishers, one per data-parallel rank.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_events: Vec<KvEventSource>,
    /// The engine's Prometheus endpoint, e.g. `http://10.0.0.5:8000/metrics` (planned for
    /// Offload backends only: events-only has no tier 2). The agent scrapes it for the tier-2
    /// counters (`vllm:external_prefix_cache_{hits,queries}_total`) of every KV stream above;
    /// one HTTP server serves all of the pod's data-parallel ranks, so each stream reads the
    /// series whose `engine` label is its rank (all series when no label matches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_url: Option<String>,
}

/// A container of an engine pod, as pod status names it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlannedContainer {
    /// Container name (`spec.containers[].name`, or an init container's for a native sidecar).
    pub name: String,
    /// Runtime ID while pod status says it is running (`containerStatuses[].containerID` after
    /// `<runtime>://`, lower-case hex, as in the container's cgroup path); `None` while it is not
    /// running (waiting, crash-loop back-off, terminated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// One engine publisher (one data-parallel rank).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KvEventSource {
    /// ZMQ PUB endpoint to connect a SUB to, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// ZMQ ROUTER replay endpoint, if the engine has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    /// Topic filter (prefix); empty = everything.
    #[serde(default)]
    pub topic: String,
    /// Global data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
}

fn default_namespace() -> String {
    "default".to_string()
}

fn default_true() -> bool {
    true
}

fn default_block_size() -> u32 {
    16
}

impl EnginePlan {
    /// Stream id of one of this pod's publishers: `"<namespace>/<pod>#<dp_rank>"`.
    pub fn stream_id(&self, dp_rank: u32) -> String {
        format!("{}/{}#{}", self.namespace, self.pod, dp_rank)
    }

    /// The inverse of [`Self::stream_id`] and [`Self::replica_id`]: the namespace and replica
    /// id of a stream id `<namespace>/<pod>#<rank>`; `None` when `stream_id` is not of that
    /// form (a stream id some agent reported that no plan made).
    pub fn replica_of_stream_id(stream_id: &str) -> Option<(&str, String)> {
        let (namespace, rest) = stream_id.split_once('/')?;
        let (pod, rank) = rest.rsplit_once('#')?;
        let rank: u32 = rank.parse().ok()?;
        if namespace.is_empty() || pod.is_empty() {
            return None;
        }
        Some((namespace, replica_id_of(pod, rank)))
    }

    /// Replica id used in routing answers: the pod name, plus `#rank` for ranks above 0.
    pub fn replica_id(&self, dp_rank: u32) -> String {
        replica_id_of(&self.pod, dp_rank)
    }

    /// The descriptor the node agent reports this pod's stream at `dp_rank` with (`node`
    /// empty: the controller fills it from the agent's Hello). The controller keys the
    /// index's planned streams by the same definition.
    pub fn descriptor(&self, dp_rank: u32) -> crate::proto::StreamDescriptor {
        crate::proto::StreamDescriptor {
            stream_id: self.stream_id(dp_rank),
            replica: self.replica_id(dp_rank),
            dp_rank,
            tenant: self.namespace.clone(),
            model: self.model.clone(),
            hash_scheme: self.hash_scheme.as_str().to_string(),
            backend: self.backend.clone(),
            node: String::new(),
            offload_chunk_tokens: self.offload_chunk_tokens.unwrap_or(0),
        }
    }
}

/// Replica id of `pod`'s stream at `dp_rank`: the pod name, plus `#rank` above rank 0
/// ([`EnginePlan::replica_id`], [`EnginePlan::replica_of_stream_id`]).
fn replica_id_of(pod: &str, dp_rank: u32) -> String {
    if dp_rank == 0 {
        pod.to_string()
    } else {
        format!("{pod}#{dp_rank}")
    }
}

/// Errors reading a plan document.
#[derive(Debug, Error)]
pub enum PlanError {
    /// The file could not be read. The I/O error is the `source()` (printed after the message
    /// by `{:#}` / anyhow's chain), not repeated in the message.
    #[error("cannot read plan file {path}")]
    Read {
        /// File path.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// The document is not a valid plan.
    #[error("invalid plan {origin}: {message}")]
    Parse {
        /// File path or "stream".
        origin: String,
        /// Parser message with location.
        message: String,
    },
}

impl NodePlan {
    /// Parses a plan from YAML or JSON text (JSON is YAML), strictly: a field this build does not
    /// know is an error naming its path (`engines.0.blokSize`), so a typo in a hand-written
    /// plan file cannot pass as a default. A document with no content (empty, or only comments)
    /// is an error, not an empty plan: a truncated or wrong file must not pass as "nothing to
    /// check" (an empty plan is written `{}`); text nested deeper than
    /// [`MAX_DOCUMENT_DEPTH`](crate::limits::MAX_DOCUMENT_DEPTH) is refused before parsing.
    pub fn parse(text: &str, origin: &str) -> Result<Self, PlanError> {
        let (plan, ignored) = Self::parse_pushed(text, origin)?;
        match ignored.as_slice() {
            [] => Ok(plan),
            fields => Err(PlanError::Parse {
                origin: origin.to_string(),
                message: format!("unknown field(s): {}", fields.join(", ")),
            }),
        }
    }

    /// Parses a plan the controller pushed (`NodePlanUpdate.plan_json`), tolerating fields this
    /// build does not know: a newer controller's plan reaches an older agent during a rolling
    /// upgrade, and refusing the whole plan would leave the agent on its previous one. Returns
    /// the plan and the paths of the fields it ignored (empty when it knows them all), for the
    /// caller to report. Every other error is [`NodePlan::parse`]'s.
    pub fn parse_pushed(text: &str, origin: &str) -> Result<(Self, Vec<String>), PlanError> {
        let blank = text.lines().all(|l| {
            let t = l.trim();
            t.is_empty() || t.starts_with('#') || t == "---"
        });
        if blank {
            return Err(PlanError::Parse {
                origin: origin.to_string(),
                message: "the document is empty (an empty plan is written `{}`)".to_string(),
            });
        }

        crate::limits::check_depth(text, crate::limits::MAX_DOCUMENT_DEPTH).map_err(|message| {
            PlanError::Parse {
                origin: origin.to_string(),
                message,
            }
        })?;
        let mut ignored = Vec::new();
        let plan = serde_ignored::deserialize(serde_yaml::Deserializer::from_str(text), |path| {
            // serde_ignored writes an optional field's value as a `?` segment
            // (`shm.?.requiredByte`); the plan's own path is `shm.requiredByte`.
            ignored.push(path.to_string().replace(".?.", ".").replace("?.", ""))
        })
        .map_err(|e| PlanError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        Ok((plan, ignored))
    }

    /// The plan as an agent without [`crate::link::PLAN_ADDITIVE`] can parse it: without the
    /// fields added after its release (`engines[].shmContainers`, `readerMounts[].containers`),
    /// which its strict parser would refuse the whole plan for. Its checks then judge as they
    /// did (the largest `/dev/shm`, every container's view of a reader volume).
    pub fn for_strict_agent(&self) -> NodePlan {
        let mut p = self.clone();
        for e in &mut p.engines {
            e.shm_containers.clear();
        }
        for m in &mut p.reader_mounts {
            m.containers.clear();
        }
        p
    }

    /// Reads and parses a plan file of at most
    /// [`MAX_PLAN_BYTES`](crate::limits::MAX_PLAN_BYTES) (a longer one is a `Read` error naming
    /// the cap; reading stops there).
    pub fn load(path: &std::path::Path) -> Result<Self, PlanError> {
        let text = std::fs::File::open(path)
            .and_then(|f| crate::limits::read_bounded(f, crate::limits::MAX_PLAN_BYTES))
            .map_err(|source| PlanError::Read {
                path: path.display().to_string(),
                source,
            })?;
        Self::parse(&text, &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::panic)]
    fn plan_files_are_read_up_to_a_cap_and_deep_plans_are_refused() {
        if std::path::Path::new("/dev/zero").exists() {
            match NodePlan::load(std::path::Path::new("/dev/zero")) {
                Err(PlanError::Read { source, .. }) => {
                    assert!(
                        source.to_string().contains("cap of 4194304 bytes"),
                        "{source}"
                    )
                }
                other => panic!("{other:?}"),
            }
        }
        let deep = format!("engines: {}{}", "[".repeat(100_000), "]".repeat(100_000));
        match NodePlan::parse(&deep, "deep") {
            Err(PlanError::Parse { message, .. }) => {
                assert!(message.contains("nesting deeper"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    #[allow(clippy::panic)]
    fn a_file_plan_refuses_unknown_fields_and_a_pushed_plan_reports_them() {
        let text = "engines:\n  - pod: vllm-0\n    blokSize: 32\n    engineFuture: {a: 1}\n";
        match NodePlan::parse(text, "file") {
            Err(PlanError::Parse { message, .. }) => {
                assert!(message.contains("engines.0.blokSize"), "{message}");
                assert!(message.contains("engines.0.engineFuture"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let (plan, ignored) = NodePlan::parse_pushed(text, "controller plan").unwrap();
        assert_eq!(plan.engines[0].pod, "vllm-0");
        assert_eq!(plan.engines[0].block_size, default_block_size());
        assert_eq!(
            ignored,
            vec!["engines.0.blokSize", "engines.0.engineFuture"]
        );
        let (_, none) = NodePlan::parse_pushed("engines: [{pod: p}]", "c").unwrap();
        assert!(none.is_empty());
        // A misspelt field of an optional section is named by its path, without serde's `?`.
        match NodePlan::parse("shm:\n  requiredBytes: 1\n  requiredByte: 1\n", "file") {
            Err(PlanError::Parse { message, .. }) => {
                assert!(
                    message.contains("unknown field(s): shm.requiredByte"),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_the_documented_example() {
        let text = r#"
gpuNode: false
shm: { requiredBytes: 1073741824 }
ports:
  - { port: 5557, expect: held, owner: { exe: /usr/bin/python3.11 } }
  - { port: 8080, expect: free }
engines:
  - namespace: default
    pod: vllm-0
    model: m
    hashScheme: sglang
    blockSize: 32
    keepsL2: true
    kvEvents:
      - { endpoint: "tcp://127.0.0.1:5557", replayEndpoint: "tcp://127.0.0.1:5558", dpRank: 1 }
    metricsUrl: http://127.0.0.1:8000/metrics
"#;
        let p = NodePlan::parse(text, "test").unwrap();
        assert_eq!(p.shm.as_ref().unwrap().required_bytes, 1 << 30);
        assert_eq!(p.ports[0].expect, PortExpect::Held);
        assert_eq!(p.ports[1].expect, PortExpect::Free);
        let e = &p.engines[0];
        assert_eq!(e.hash_scheme, HashScheme::Sglang);
        assert_eq!(e.block_size, 32);
        assert_eq!(e.stream_id(1), "default/vllm-0#1");
        assert_eq!(e.replica_id(1), "vllm-0#1");
        assert_eq!(e.replica_id(0), "vllm-0");
        for rank in [0, 1, 7] {
            assert_eq!(
                EnginePlan::replica_of_stream_id(&e.stream_id(rank)),
                Some(("default", e.replica_id(rank))),
                "the inverse of stream_id at rank {rank}"
            );
        }
        for foreign in [
            "vllm-0",
            "default/vllm-0",
            "default/vllm-0#x",
            "/p#0",
            "ns/#0",
        ] {
            assert_eq!(EnginePlan::replica_of_stream_id(foreign), None, "{foreign}");
        }
        assert_eq!(
            e.metrics_url.as_deref(),
            Some("http://127.0.0.1:8000/metrics")
        );
        let back: NodePlan = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn reader_mounts_and_cuda_parse_with_defaults() {
        let text = r#"
readerMounts:
  - pod: reader-0
    path: /models
    samples: [{ file: config.json, sha256: "AB" }]
  - { namespace: t, pod: r, podUid: u, path: /m, expectReadOnly: false, binding: t/b }
cuda: { runtimeVersion: "12.8" }
"#;
        let p = NodePlan::parse(text, "test").unwrap();
        let m = &p.reader_mounts[0];
        assert_eq!(m.namespace, "default");
        assert!(m.expect_read_only);
        assert_eq!(m.samples[0].file, "config.json");
        assert!(!p.reader_mounts[1].expect_read_only);
        assert_eq!(p.reader_mounts[1].pod_uid.as_deref(), Some("u"));
        assert!(ReaderMount::default().expect_read_only);
        assert_eq!(
            p.cuda.as_ref().unwrap().runtime_version.as_deref(),
            Some("12.8")
        );
        let back: NodePlan = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        // an empty plan serializes without the new keys
        assert_eq!(
            serde_json::to_string(&NodePlan::default()).unwrap(),
            r#"{"generation":0,"gpuNode":false}"#
        );
    }

    #[test]
    fn an_empty_document_is_an_error_and_an_empty_plan_is_braces() {
        for empty in ["", "\n", "# a comment only\n---\n"] {
            let err = NodePlan::parse(empty, "f.yaml").unwrap_err().to_string();
            assert!(err.contains("f.yaml") && err.contains("empty"), "{err}");
        }
        assert_eq!(
            NodePlan::parse("{}", "f.yaml").unwrap(),
            NodePlan::default()
        );
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_name() {
        let err = NodePlan::parse("gpuNodes: true", "f.yaml").unwrap_err();
        assert!(err.to_string().contains("gpuNodes"), "{err}");
    }
}
