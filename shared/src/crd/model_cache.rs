//! `ModelCache` (`inferencecache.io/v1alpha1`, namespaced, short name `mc`): a request for a
//! durable, shareable cache of model weights (spec 004 "Storage-Agnostic Model Cache"; issue 8).
//!
//! A request says *what* to cache (a source reference and revision, a size, a writer Job template
//! that fills the volume) and *where readers run* (the workflow). The controller decides how
//! (spec 004 "Runtime flow"): it records the selected mode — `none`, `ephemeral` or `durable` —
//! and, for `durable`, the [`ModelCacheBinding`](super::ModelCacheBinding) it joined, before any
//! storage side effect. Pods ask for the cache with the pod annotation
//! [`annotations::MODEL_CACHE`] and receive the reader claim as a read-only volume `model-data`.
//!
//! ```yaml
//! apiVersion: inferencecache.io/v1alpha1
//! kind: ModelCache
//! metadata: { name: llama-8b, namespace: team-a }
//! spec:
//!   source: { uri: "hf://meta-llama/Llama-3.1-8B-Instruct", revision: 0e9e39f249a16976918f6564b8830bc894c89659 }
//!   size: 40Gi
//!   workflow: regularModelCache          # readers in team-a
//!   writer:
//!     template:                          # a PodTemplateSpec; the volume is added at mountPath
//!       spec:
//!         containers:
//!           - name: fetch
//!             image: ghcr.io/example/hf-fetch:1
//!             args: ["--to", "/model-data"]
//! ```
//!
//! What the API server enforces (CEL, `x-kubernetes-validations`): `spec` is immutable, the
//! writer template included (the real apiserver compares it whole; the controller also records
//! `status.writerTemplateDigest` and refuses a changed template with `SpecChanged`, a second
//! guard where the CRD's rules are not enforced); a recorded
//! `status.mode`, `status.selection`, `status.binding` and `status.writerTemplateDigest` never change (a request is
//! never rebound — recreate it to start over); `helmModelCache` needs `readerNamespaces`,
//! `regularModelCache` takes neither `readerNamespaces` nor `sharingDomain`.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Default `spec.writer.mountPath`: where the writer Job's containers see the cache volume.
pub const DEFAULT_WRITER_MOUNT_PATH: &str = "/model-data";

/// Name of the pod volume that carries a reader claim (spec 004 "What runs today": the webhook
/// injects the reader PVC as a volume named `model-data`).
pub const MODEL_DATA_VOLUME: &str = "model-data";

/// Labels and annotations of the model cache (keys under `inferencecache.io/`).
pub mod annotations {
    /// Pod annotation naming the `ModelCache` a pod reads: `<name>` (same namespace) or
    /// `<namespace>/<name>` (a `helmModelCache` request in another namespace).
    pub const MODEL_CACHE: &str = "inferencecache.io/model-cache";
    /// Pod annotation: where the engine container mounts `model-data` (default
    /// `/model-data`).
    pub const MODEL_CACHE_MOUNT_PATH: &str = "inferencecache.io/model-cache-mount-path";
    /// Pod annotation: the container that mounts `model-data` (default: the first container).
    pub const MODEL_CACHE_CONTAINER: &str = "inferencecache.io/model-cache-container";
    /// Label on every object a binding owns: the binding's name.
    pub const BINDING_LABEL: &str = "inferencecache.io/model-cache-binding";
    /// Annotation on every object a binding owns: the binding's `metadata.uid`. An object whose
    /// label or annotation does not match is foreign and is never adopted or deleted.
    pub const BINDING_UID_ANNOTATION: &str = "inferencecache.io/model-cache-binding-uid";
    /// Label on bindings: the identity digest (first 63 hex characters of SHA-256 over
    /// workflow, sharing-domain digest and cache-handle digest), so get-or-create is one list.
    pub const IDENTITY_LABEL: &str = "inferencecache.io/model-cache-identity";
    /// Finalizer on every `ModelCacheBinding`: protects owned resources until they are released.
    pub const BINDING_FINALIZER: &str = "inferencecache.io/model-cache-binding";
}

/// Condition types and reasons of a `ModelCache`.
pub mod model_cache_condition {
    /// The storage selection (mode and, for `durable`, the flow) is recorded.
    pub const SELECTED: &str = "Selected";
    /// The reader claim is ready for pods (`durable`), or nothing is to be done (`none`,
    /// `ephemeral`).
    pub const READY: &str = "Ready";
    /// Advisory (never gates `Ready`): every reader mount of the request's binding that the
    /// node agents' `mounts` check reported on is read-only and holds the writer's data.
    /// Written by the node status loop from the agents' reader-volume checks; absent while no
    /// reader pod of the binding is planned on any node.
    pub const READERS_HEALTHY: &str = "ReadersHealthy";
}

/// Reasons on `ModelCache` conditions (CamelCase, stable).
pub mod model_cache_reason {
    /// Selected: the `CachingSupport` feature flag is off → mode `none`.
    pub const CACHING_SUPPORT_DISABLED: &str = "CachingSupportDisabled";
    /// Selected: a `helmModelCache` request while `HelmModelCaching` is off → mode `none`.
    pub const HELM_MODEL_CACHING_DISABLED: &str = "HelmModelCachingDisabled";
    /// Selected: the request asked for `durability: Ephemeral`.
    pub const EPHEMERAL_REQUESTED: &str = "EphemeralRequested";
    /// Selected: the cache StorageClass does not exist → `ephemeral`.
    pub const STORAGE_CLASS_NOT_FOUND: &str = "StorageClassNotFound";
    /// Selected: the cache StorageClass's reclaim policy is not `Retain` → `ephemeral`.
    pub const RECLAIM_POLICY_NOT_RETAIN: &str = "ReclaimPolicyNotRetain";
    /// Selected: the provisioner has no catalog entry → `ephemeral`.
    pub const PROVISIONER_NOT_IN_CATALOG: &str = "ProvisionerNotInCatalog";
    /// Selected: the catalog entry qualifies no access modes → `ephemeral`.
    pub const NO_QUALIFIED_MODES: &str = "NoQualifiedModes";
    /// Selected: readers in other namespaces need `ReadWriteMany` or a namespace-encoding volume
    /// handle → `ephemeral`.
    pub const CROSS_NAMESPACE_UNSUPPORTED: &str = "CrossNamespaceUnsupported";
    /// Selected: `ModelCacheEncryption` asks for encryption the driver or flow cannot give →
    /// `ephemeral` (never an unencrypted cache instead).
    pub const ENCRYPTION_UNSUPPORTED: &str = "EncryptionUnsupported";
    /// Selected=False: the catalog ConfigMap is missing or invalid; nothing recorded, retried.
    pub const CATALOG_INVALID: &str = "CatalogInvalid";
    /// Selected=True: a durable flow was derived and recorded.
    pub const DURABLE_FLOW_SELECTED: &str = "DurableFlowSelected";
    /// Ready=False: class or catalog changed between the recorded selection and the binding;
    /// nothing was created.
    pub const CONFIGURATION_DRIFTED: &str = "ConfigurationDrifted";
    /// Ready=False: the only binding for this identity is `Retiring`; a new one is being made.
    pub const BINDING_RETIRING: &str = "BindingRetiring";
    /// Ready=False: the recorded binding no longer exists (or has another UID); never rebound.
    pub const BINDING_MISSING: &str = "BindingMissing";
    /// Ready=False: the recorded binding lacks this request's reference; never rebound.
    pub const REFERENCE_MISSING: &str = "ReferenceMissing";
    /// Ready=False: the writer template does not decode as a PodTemplateSpec.
    pub const WRITER_TEMPLATE_INVALID: &str = "WriterTemplateInvalid";
    /// Ready=False: another request holds the writer Lease; waiting for its Job.
    pub const WRITER_ELECTED_ELSEWHERE: &str = "WriterElectedElsewhere";
    /// Ready=False: the writer Job is filling the volume.
    pub const WRITER_RUNNING: &str = "WriterRunning";
    /// Ready=False: the writer Job failed.
    pub const WRITER_FAILED: &str = "WriterFailed";
    /// Ready=False: the writer claim is not bound to a volume yet.
    pub const WRITER_CLAIM_PENDING: &str = "WriterClaimPending";
    /// Ready=False: the StorageClass was replaced after the binding recorded it; the binding
    /// stays authoritative and nothing is provisioned from the new class.
    pub const STORAGE_CLASS_CHANGED: &str = "StorageClassChanged";
    /// Ready=False: an object the binding names exists but belongs to someone else.
    pub const FOREIGN_OBJECT: &str = "ForeignObject";
    /// Ready=False: `spec.writer.template` differs from what the controller first read
    /// (`status.writerTemplateDigest`): an edit the CRD's immutability rule refuses, seen where
    /// that rule is not enforced (e.g. older CRDs installed).
    /// Nothing is provisioned from the changed spec; recreate the ModelCache.
    pub const SPEC_CHANGED: &str = "SpecChanged";
    /// Not ready: an uninstall is in progress (the uninstall marker exists in the control
    /// namespace), so no new binding is created.
    pub const UNINSTALLING: &str = "Uninstalling";
    /// Ready=False: a reader PV cannot be derived from the writer's volume.
    pub const READER_DERIVATION_FAILED: &str = "ReaderDerivationFailed";
    /// Ready=False: a reader claim exists but its phase is not `Bound` (Pending, Lost: e.g.
    /// recreated against a reader PV that still names the deleted claim); pods wired to it
    /// would not start.
    pub const READER_CLAIM_PENDING: &str = "ReaderClaimPending";
    /// Ready=True: reader claims exist in every reader namespace, none known unbound.
    pub const READERS_READY: &str = "ReadersReady";
    /// Ready=True: mode `none` or `ephemeral`; nothing to provision.
    pub const NOTHING_TO_PROVISION: &str = "NothingToProvision";
    /// ReadersHealthy=True: every planned reader mount of the binding was reported read-only
    /// (every write probe refused with `EROFS`, samples matching) by its node's agent.
    pub const READERS_READ_ONLY: &str = "ReadersReadOnly";
    /// ReadersHealthy=False: a reader mount is mounted read-write or accepted a write probe
    /// (the agent's `mounts` reason of the same name).
    pub const READER_VOLUME_WRITABLE: &str = "ReaderVolumeWritable";
    /// ReadersHealthy=False: a reader mount's sample file differs from the writer's digest or
    /// cannot be read (the agent's `mounts` reason of the same name).
    pub const READER_VOLUME_DIGEST_MISMATCH: &str = "ReaderVolumeDigestMismatch";
    /// ReadersHealthy=False: nothing is mounted at a reader pod's planned path (the agent's
    /// `mounts` reason of the same name).
    pub const READER_VOLUME_MISSING: &str = "ReaderVolumeMissing";
    /// ReadersHealthy=False: the `mounts` check failed a reader mount with a reason this
    /// controller does not know (an agent newer than the controller).
    pub const READER_CHECK_FAILING: &str = "ReaderCheckFailing";
    /// ReadersHealthy=Unknown: a reader mount is planned on a node whose agent is not connected,
    /// or whose agent has not reported on it yet.
    pub const AWAITING_REPORTS: &str = "AwaitingReports";
    /// ReadersHealthy=Unknown: the agent found no process of a reader pod on its node (not
    /// started yet, or the agent cannot see the host's `/proc`); the agent's `mounts` reason.
    pub const READER_POD_NOT_FOUND: &str = "PodNotFound";
    /// ReadersHealthy=Unknown: the agent could not judge a reader mount (its `mounts` check
    /// returned Unknown for another reason, e.g. it panicked).
    pub const READER_CHECK_INCONCLUSIVE: &str = "ReaderCheckInconclusive";
    /// ReadersHealthy=Unknown: a reader mount's node agent is connected but its last check
    /// report is older than 3 check intervals + 60 s (a check pass is hung, e.g. on an
    /// unreachable network volume): its earlier verdict is not vouched for.
    pub const READER_REPORT_STALE: &str = "ReaderReportStale";
}

/// `spec.workflow` (spec 004 "Terms").
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum Workflow {
    /// Readers run in the request's namespace.
    #[default]
    #[serde(rename = "regularModelCache")]
    RegularModelCache,
    /// Readers run in other namespaces (`spec.readerNamespaces`).
    #[serde(rename = "helmModelCache")]
    HelmModelCache,
}

impl Workflow {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Workflow::RegularModelCache => "regularModelCache",
            Workflow::HelmModelCache => "helmModelCache",
        }
    }
}

/// How a cache moves from writer to readers, derived from qualified access modes (spec 004
/// "Capability catalog").
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum Flow {
    /// `ReadWriteMany`: one shared volume, readers mount it read-only.
    #[default]
    #[serde(rename = "rwxReadOnly")]
    RwxReadOnly,
    /// `ReadWriteOnce` + `ReadOnlyMany`: the writer takes the claim, each reader namespace gets
    /// a reader PV derived from its volume.
    #[serde(rename = "roxReadOnly")]
    RoxReadOnly,
}

impl Flow {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Flow::RwxReadOnly => "rwxReadOnly",
            Flow::RoxReadOnly => "roxReadOnly",
        }
    }
}

/// A PersistentVolume access mode (Kubernetes spelling).
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
pub enum AccessMode {
    /// `ReadWriteOnce`.
    ReadWriteOnce,
    /// `ReadOnlyMany`.
    ReadOnlyMany,
    /// `ReadWriteMany`.
    ReadWriteMany,
    /// `ReadWriteOncePod`.
    ReadWriteOncePod,
}

impl AccessMode {
    /// The Kubernetes spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::ReadWriteOnce => "ReadWriteOnce",
            AccessMode::ReadOnlyMany => "ReadOnlyMany",
            AccessMode::ReadWriteMany => "ReadWriteMany",
            AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
        }
    }
}

/// `status.mode`: what the controller selected for a request (spec 004 "Runtime flow" 1–2).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum CacheMode {
    /// No caching (a feature flag is off): pods fetch weights themselves.
    #[serde(rename = "none")]
    None,
    /// No shared volume: each pod keeps its own copy (no durable flow, or asked for).
    #[serde(rename = "ephemeral")]
    Ephemeral,
    /// A durable cache recorded by a `ModelCacheBinding`.
    #[serde(rename = "durable")]
    Durable,
}

impl CacheMode {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::None => "none",
            CacheMode::Ephemeral => "ephemeral",
            CacheMode::Durable => "durable",
        }
    }
}

/// `spec.durability`: what the request asks for.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum Durability {
    /// A durable shared cache when the storage allows one (default).
    #[default]
    Durable,
    /// Never a shared volume: mode `ephemeral`.
    Ephemeral,
}

/// A namespaced object name.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedName {
    /// Namespace.
    #[schemars(length(max = 63))]
    pub namespace: String,
    /// Name.
    #[schemars(length(max = 253))]
    pub name: String,
}

impl NamespacedName {
    /// `namespace/name`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        NamespacedName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The catalog's rule for drivers whose CSI volume handle encodes the consuming namespace
/// (spec 004: NVMesh "rewrites the namespace segment"). The handle is split on `separator`;
/// segment `segment` (0-based) holds the namespace and is replaced by the reader's namespace.
/// A handle whose segment does not equal the writer's namespace is not rewritten (the reader
/// fails instead of guessing).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeHandleNamespace {
    /// Separator between handle segments (non-empty), e.g. `/`.
    #[schemars(length(min = 1))]
    pub separator: String,
    /// 0-based index of the namespace segment.
    // `format: int32`: schemars writes `uint32` for a u32, which Kubernetes does not know (the
    // apiserver warns `unrecognized format "uint32"` on every CRD apply).
    #[schemars(range(min = 0), extend("format" = "int32"))]
    pub segment: u32,
}

fn preserve_unknown_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": "A PodTemplateSpec (core/v1). The controller adds the cache volume and its mounts; the API server keeps the object as given.",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// `spec.source`: what to cache.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// Source reference, e.g. `hf://meta-llama/Llama-3.1-8B-Instruct` or `s3://bucket/prefix`.
    #[schemars(length(min = 1))]
    pub uri: String,
    /// Exact revision (a commit, tag or version id). Part of the cache handle: another revision
    /// is another cache.
    #[schemars(length(min = 1))]
    pub revision: String,
}

/// `spec.writer`: the Job that fills the volume (one writer per cache, elected by a Lease).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WriterSpec {
    /// Pod template of the writer Job (core/v1 PodTemplateSpec). The controller adds volume
    /// `model-data` (the writer claim), mounts it at `mountPath` in every container and sets
    /// `MODEL_CACHE_PATH`, `MODEL_SOURCE_URI`, `MODEL_SOURCE_REVISION`; `restartPolicy` becomes
    /// `Never` unless `OnFailure`.
    #[schemars(schema_with = "preserve_unknown_object")]
    pub template: serde_json::Value,
    /// Where the writer's containers see the volume (default `/model-data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "/model-data"))]
    pub mount_path: Option<String>,
    /// Job `backoffLimit` (default: the Job default, 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub backoff_limit: Option<i32>,
    /// Job `activeDeadlineSeconds`, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<i64>,
}

impl WriterSpec {
    /// `mountPath`, or `/model-data`.
    pub fn effective_mount_path(&self) -> &str {
        self.mount_path
            .as_deref()
            .filter(|p| !p.is_empty())
            .unwrap_or(DEFAULT_WRITER_MOUNT_PATH)
    }
}

/// Desired state of a `ModelCache`: what to cache and where its readers run. Immutable.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "ModelCache",
    plural = "modelcaches",
    singular = "modelcache",
    shortname = "mc",
    namespaced,
    status = "ModelCacheStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "ModelCache requests a durable, shareable cache of model weights: one writer fills a volume, readers mount it read-only (spec 004).",
    printcolumn = r#"{"name": "Mode", "type": "string", "jsonPath": ".status.mode"}"#,
    printcolumn = r#"{"name": "Binding", "type": "string", "jsonPath": ".status.binding.name"}"#,
    printcolumn = r#"{"name": "Claim", "type": "string", "jsonPath": ".status.readerClaim"}"#,
    printcolumn = r#"{"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#,
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.mode) || (has(self.status) && has(self.status.mode) && self.status.mode == oldSelf.status.mode)").message("status.mode is final once recorded"),
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.selection) || (has(self.status) && has(self.status.selection) && self.status.selection == oldSelf.status.selection)").message("status.selection is final once recorded"),
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.binding) || (has(self.status) && has(self.status.binding) && self.status.binding == oldSelf.status.binding)").message("status.binding never changes once recorded: a request is never rebound"),
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.writerTemplateDigest) || (has(self.status) && has(self.status.writerTemplateDigest) && self.status.writerTemplateDigest == oldSelf.status.writerTemplateDigest)").message("status.writerTemplateDigest is final once recorded")
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = super::shorten_quantity_descriptions)]
#[x_kube(
    validation = Rule::new("self == oldSelf").message("spec is immutable; create a new ModelCache"),
    validation = Rule::new("self.workflow == 'helmModelCache' ? (has(self.readerNamespaces) && size(self.readerNamespaces) > 0) : (!has(self.readerNamespaces) || size(self.readerNamespaces) == 0) && !has(self.sharingDomain)").message("helmModelCache needs readerNamespaces; regularModelCache takes neither readerNamespaces nor sharingDomain")
)]
pub struct ModelCacheSpec {
    /// What to cache: source reference and revision.
    pub source: ModelSource,
    /// Size of the cache volume (the writer claim's storage request), e.g. `40Gi`.
    pub size: Quantity,
    /// `regularModelCache` (readers in this namespace) or `helmModelCache` (readers in
    /// `readerNamespaces`).
    pub workflow: Workflow,
    /// Namespaces whose pods read the cache (`helmModelCache` only; at least one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub reader_namespaces: Vec<String>,
    /// Requests with the same workflow, sharing domain and source share one cache
    /// (`helmModelCache` only; default: this request's namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub sharing_domain: Option<String>,
    /// `Durable` (default): a shared volume when the storage allows one; `Ephemeral`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "Durable"))]
    pub durability: Option<Durability>,
    /// The writer Job that fills the volume.
    pub writer: WriterSpec,
}

impl ModelCacheSpec {
    /// `durability`, or `Durable`.
    pub fn effective_durability(&self) -> Durability {
        self.durability.unwrap_or_default()
    }
}

/// `status.selection`: the storage decision recorded on the request before any binding exists
/// (spec 004 "Runtime flow" 2; "Failure rules": drift before the binding exists fails).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Selection {
    /// Exact provisioner of the cache StorageClass.
    pub provisioner: String,
    /// Derived flow.
    pub flow: Flow,
    /// Cache StorageClass name.
    pub storage_class_name: String,
    /// Cache StorageClass `metadata.uid`.
    pub storage_class_uid: String,
    /// SHA-256 (hex) of the decision (provider, provisioner, flow, modes, reader mount options,
    /// handle rule, encryption, catalog profile) and the class configuration.
    pub decision_digest: String,
}

/// `status.binding`: the bound `ModelCacheBinding`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BindingRef {
    /// Binding name (in the control namespace).
    pub name: String,
    /// Binding `metadata.uid`.
    pub uid: String,
}

/// Observed state of a `ModelCache`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelCacheStatus {
    /// `none`, `ephemeral` or `durable`; final once recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<CacheMode>,
    /// The durable selection recorded before any binding (final once recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<Selection>,
    /// The bound binding's name and UID, persisted before any storage side effect (final).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<BindingRef>,
    /// Name of the reader PersistentVolumeClaim, the same in every reader namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader_claim: Option<String>,
    /// Namespaces where the reader claim exists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reader_namespaces: Vec<String>,
    /// `.metadata.generation` last reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// SHA-256 (64 lower-case hex) of `spec.writer.template` (JSON) as the controller first
    /// read it, recorded before any side effect; final. `spec` (the template included) is
    /// immutable by CEL; the controller also compares every pass and refuses a changed template
    /// (`Ready=False SpecChanged`), a second guard where the CRD's rules are not enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^[0-9a-f]{64}$"))]
    pub writer_template_digest: Option<String>,
    /// Conditions keyed by type: `Selected`, `Ready`, and the advisory `ReadersHealthy` (from
    /// the node agents' reader-volume checks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl ModelCache {
    /// The namespaces whose pods read this cache: the request namespace for
    /// `regularModelCache`, `spec.readerNamespaces` (sorted, deduplicated) for `helmModelCache`.
    pub fn reader_namespaces(&self) -> Vec<String> {
        match self.spec.workflow {
            Workflow::RegularModelCache => {
                vec![self.metadata.namespace.clone().unwrap_or_default()]
            }
            Workflow::HelmModelCache => {
                let mut v = self.spec.reader_namespaces.clone();
                v.sort();
                v.dedup();
                v
            }
        }
    }

    /// The sharing domain: the request namespace for `regularModelCache`; `spec.sharingDomain`
    /// or the request namespace for `helmModelCache`.
    pub fn sharing_domain(&self) -> String {
        let ns = self.metadata.namespace.clone().unwrap_or_default();
        match self.spec.workflow {
            Workflow::RegularModelCache => ns,
            Workflow::HelmModelCache => self
                .spec
                .sharing_domain
                .clone()
                .filter(|d| !d.is_empty())
                .unwrap_or(ns),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    fn mc(spec: serde_json::Value) -> ModelCache {
        serde_json::from_value(json!({
            "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "m", "namespace": "team-a"},
            "spec": spec
        }))
        .unwrap()
    }

    #[test]
    fn spellings_and_defaults() {
        let m = mc(json!({
            "source": {"uri": "hf://x/y", "revision": "r1"}, "size": "1Gi",
            "workflow": "regularModelCache", "writer": {"template": {}}
        }));
        assert_eq!(m.reader_namespaces(), vec!["team-a".to_string()]);
        assert_eq!(m.sharing_domain(), "team-a");
        assert_eq!(m.spec.effective_durability(), Durability::Durable);
        assert_eq!(m.spec.writer.effective_mount_path(), "/model-data");
        assert_eq!(
            serde_json::to_value(CacheMode::None).unwrap(),
            json!("none")
        );
        assert_eq!(
            serde_json::to_value(Flow::RoxReadOnly).unwrap(),
            json!("roxReadOnly")
        );
        assert_eq!(Workflow::HelmModelCache.as_str(), "helmModelCache");
    }

    #[test]
    fn helm_readers_and_domain() {
        let m = mc(json!({
            "source": {"uri": "hf://x/y", "revision": "r1"}, "size": "1Gi",
            "workflow": "helmModelCache", "readerNamespaces": ["b", "a", "b"],
            "sharingDomain": "org", "writer": {"template": {}}
        }));
        assert_eq!(
            m.reader_namespaces(),
            vec!["a".to_string(), "b".to_string()]
        );
        assert_eq!(m.sharing_domain(), "org");
    }
}
