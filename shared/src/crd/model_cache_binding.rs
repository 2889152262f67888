//! `ModelCacheBinding` (`inferencecache.io/v1alpha1`, namespaced in the control namespace,
//! short name `mcb`): one per shared model cache (spec 004 "Cache binding").
//!
//! | field | records |
//! |---|---|
//! | `spec.identity` | workflow, sharing-domain digest, cache-handle digest |
//! | `spec.decision` | provider, provisioner, derived flow, required access modes, reader mount options, handle rule, encryption, catalog profile digest |
//! | `spec.storageClass` | name, UID, `Retain`, configuration digest |
//! | `spec.resources` | names of the PVCs, PVs, Jobs, StorageClasses, Secrets and Lease it owns |
//! | `status.requestReferences` | namespace, name and UID of each request using it |
//! | `status.phase` | `Active` or `Retiring` |
//!
//! What the API server enforces (CEL, `x-kubernetes-validations`): `spec` is immutable, a
//! recorded `spec.identity` never changes, `Retiring` never returns to `Active` (a missing
//! phase reads as `Active`), `status.writerVolumeName` is set once (the data identity readers
//! derive from), and `status.additionalResources` never loses a name (a dropped name would
//! never be released). The finalizer [`BINDING_FINALIZER`](super::model_cache::annotations::BINDING_FINALIZER)
//! protects owned resources until they are released.
//!
//! Readers added after creation (a later `helmModelCache` request naming a new namespace) are
//! recorded in `status.additionalResources` *before* they are created, so the binding still names
//! everything it owns; release deletes `spec.resources` ∪ `status.additionalResources`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::model_cache::{AccessMode, Flow, NamespacedName, VolumeHandleNamespace, Workflow};

/// Condition types of a `ModelCacheBinding`.
pub mod binding_condition {
    /// Written by each release pass of a `Retiring` binding: `True` when every object it names
    /// is gone, `False` while one is kept (listed in `status.releaseSkipped`).
    pub const RELEASED: &str = "Released";
}

/// Reasons of the `Released` condition and of `status.releaseSkipped` entries.
pub mod binding_reason {
    /// `Released=True`: every object the binding names was deleted or was already gone.
    pub const RELEASED: &str = "Released";
    /// `Released=False`: at least one named object was kept (see `status.releaseSkipped`).
    pub const OBJECTS_KEPT: &str = "ObjectsKept";
    /// Skipped: the object at a named name lacks the binding's label and UID annotation (never
    /// adopted, never deleted).
    pub const FOREIGN_OBJECT: &str = "ForeignObject";
    /// Skipped: the object changed (UID or resourceVersion) between the ownership read and the
    /// delete, so the delete's precondition failed; it is read again on the next pass.
    pub const CHANGED_SINCE_READ: &str = "ChangedSinceRead";
    /// Skipped: deleting it would delete data — the claim's bound PV, or the PV itself, no
    /// longer has reclaim policy `Retain` ("Configuration drift never authorizes data
    /// deletion"). The finalizer stays.
    pub const VOLUME_NOT_RETAINED: &str = "VolumeNotRetained";
}

/// Most entries a `BindingResources` list holds (bounds the CEL cost of the never-shrinks rule:
/// one reader claim and PV per reader namespace).
pub const MAX_RESOURCE_ITEMS: usize = 256;

/// One named object a release pass kept (`status.releaseSkipped`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseSkip {
    /// `Kind namespace/name` (cluster-scoped: `Kind name`).
    #[schemars(length(max = 400))]
    pub object: String,
    /// [`binding_reason`] `ForeignObject`, `ChangedSinceRead` or `VolumeNotRetained`.
    #[schemars(length(max = 64))]
    pub reason: String,
}

/// `status.phase`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum BindingPhase {
    /// Joinable; owns live resources.
    #[default]
    Active,
    /// Zero references past the idle period, or deleted: never joined again; its resources are
    /// being released.
    Retiring,
}

/// `spec.storageClass.reclaimPolicy`: only `Retain` is ever recorded (spec 004 step 2).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum RecordedReclaimPolicy {
    /// `Retain`.
    #[default]
    Retain,
}

/// `spec.identity`: what makes two requests share one cache.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("a recorded identity never changes"))]
pub struct BindingIdentity {
    /// The requests' workflow.
    pub workflow: Workflow,
    /// SHA-256 (64 lower-case hex) of the sharing domain.
    #[schemars(pattern(r"^[0-9a-f]{64}$"))]
    pub sharing_domain_digest: String,
    /// SHA-256 (64 lower-case hex) of the cache handle (source URI and revision).
    #[schemars(pattern(r"^[0-9a-f]{64}$"))]
    pub cache_handle_digest: String,
}

/// `spec.decision`: the storage decision, copied from the catalog when the binding was made and
/// never re-read (spec 004 "Runtime flow" 6).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BindingDecision {
    /// Catalog `provider` label (diagnostics only).
    #[serde(default)]
    pub provider: String,
    /// Exact CSI provisioner.
    pub provisioner: String,
    /// Derived flow.
    pub flow: Flow,
    /// Access modes the flow requires of the driver (writer mode first).
    pub access_modes: Vec<AccessMode>,
    /// Mount options of every reader PV (the catalog's `readerMountOptions`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reader_mount_options: Vec<String>,
    /// Rewrite of the namespace segment of reader volume handles, when the driver's handle
    /// encodes the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_handle_namespace: Option<VolumeHandleNamespace>,
    /// The cache is encrypted (flag asked, driver qualified).
    #[serde(default)]
    pub encrypted: bool,
    /// SHA-256 (hex) of the catalog entry the decision came from.
    pub catalog_profile_digest: String,
}

/// `spec.storageClass`: the class the writer claim is provisioned from.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BindingStorageClass {
    /// Class name.
    pub name: String,
    /// Class `metadata.uid`.
    pub uid: String,
    /// Always `Retain`.
    pub reclaim_policy: RecordedReclaimPolicy,
    /// SHA-256 (hex) of the class's provisioner, parameters, mount options, reclaim policy,
    /// volume binding mode and expansion flag.
    pub configuration_digest: String,
}

/// `spec.resources` / `status.additionalResources`: names of owned objects. Nothing else is
/// ever deleted on release.
///
/// CEL (transition rules, so only where an old object exists): no recorded name is ever
/// dropped and a recorded Lease never changes — a name that left the list would never be
/// released (spec 004 "a recorded data identity never changes"). Lists hold at most
/// [`MAX_RESOURCE_ITEMS`] names, which bounds the rules' cost.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(oldSelf.persistentVolumeClaims) || (has(self.persistentVolumeClaims) && oldSelf.persistentVolumeClaims.all(x, x in self.persistentVolumeClaims))").message("a named persistentVolumeClaims entry is never dropped: a dropped object would never be released"),
    validation = Rule::new("!has(oldSelf.persistentVolumes) || (has(self.persistentVolumes) && oldSelf.persistentVolumes.all(x, x in self.persistentVolumes))").message("a named persistentVolumes entry is never dropped: a dropped object would never be released"),
    validation = Rule::new("!has(oldSelf.jobs) || (has(self.jobs) && oldSelf.jobs.all(x, x in self.jobs))").message("a named jobs entry is never dropped: a dropped object would never be released"),
    validation = Rule::new("!has(oldSelf.storageClasses) || (has(self.storageClasses) && oldSelf.storageClasses.all(x, x in self.storageClasses))").message("a named storageClasses entry is never dropped: a dropped object would never be released"),
    validation = Rule::new("!has(oldSelf.secrets) || (has(self.secrets) && oldSelf.secrets.all(x, x in self.secrets))").message("a named secrets entry is never dropped: a dropped object would never be released"),
    validation = Rule::new("!has(oldSelf.lease) || (has(self.lease) && self.lease == oldSelf.lease)").message("a named lease never changes")
)]
pub struct BindingResources {
    /// PersistentVolumeClaims (writer claim, reader claims).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub persistent_volume_claims: Vec<NamespacedName>,
    /// PersistentVolumes (derived reader PVs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(max = 253)))]
    pub persistent_volumes: Vec<String>,
    /// Jobs (the writer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub jobs: Vec<NamespacedName>,
    /// StorageClasses (an encrypted cache's derived class).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(max = 253)))]
    pub storage_classes: Vec<String>,
    /// Secrets (an encrypted cache's key).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub secrets: Vec<NamespacedName>,
    /// The writer-election Lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<NamespacedName>,
}

impl BindingResources {
    /// True when no object is named.
    pub fn is_empty(&self) -> bool {
        self.persistent_volume_claims.is_empty()
            && self.persistent_volumes.is_empty()
            && self.jobs.is_empty()
            && self.storage_classes.is_empty()
            && self.secrets.is_empty()
            && self.lease.is_none()
    }

    /// Adds every name of `other` not already present (order kept).
    pub fn extend(&mut self, other: &BindingResources) {
        fn add<T: PartialEq + Clone>(to: &mut Vec<T>, from: &[T]) {
            for x in from {
                if !to.contains(x) {
                    to.push(x.clone());
                }
            }
        }
        add(
            &mut self.persistent_volume_claims,
            &other.persistent_volume_claims,
        );
        add(&mut self.persistent_volumes, &other.persistent_volumes);
        add(&mut self.jobs, &other.jobs);
        add(&mut self.storage_classes, &other.storage_classes);
        add(&mut self.secrets, &other.secrets);
        if self.lease.is_none() {
            self.lease.clone_from(&other.lease);
        }
    }
}

/// Desired state of a `ModelCacheBinding`: identity, decision, class and owned resources.
/// Immutable.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    kind = "ModelCacheBinding",
    plural = "modelcachebindings",
    singular = "modelcachebinding",
    shortname = "mcb",
    namespaced,
    status = "ModelCacheBindingStatus",
    derive = "Default",
    derive = "PartialEq",
    doc = "ModelCacheBinding records one shared model cache: its identity, storage decision, owned resources, the requests using it, and its phase (spec 004).",
    printcolumn = r#"{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}"#,
    printcolumn = r#"{"name": "Flow", "type": "string", "jsonPath": ".spec.decision.flow"}"#,
    printcolumn = r#"{"name": "Provisioner", "type": "string", "jsonPath": ".spec.decision.provisioner"}"#,
    printcolumn = r#"{"name": "Workflow", "type": "string", "jsonPath": ".spec.identity.workflow"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#,
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase != 'Retiring' || (has(self.status) && has(self.status.phase) && self.status.phase == 'Retiring')").message("Retiring never returns to Active"),
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.writerVolumeName) || (has(self.status) && has(self.status.writerVolumeName) && self.status.writerVolumeName == oldSelf.status.writerVolumeName)").message("status.writerVolumeName is set once: readers derive from it"),
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.additionalResources) || (has(self.status) && has(self.status.additionalResources))").message("status.additionalResources is never removed: its objects would never be released")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable"))]
pub struct ModelCacheBindingSpec {
    /// Workflow, sharing-domain digest, cache-handle digest.
    pub identity: BindingIdentity,
    /// Provider, provisioner, flow, required access modes, reader options, catalog digest.
    pub decision: BindingDecision,
    /// The StorageClass the writer claim uses.
    pub storage_class: BindingStorageClass,
    /// Names of every object the binding owns at creation.
    pub resources: BindingResources,
}

/// One request using the cache.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestReference {
    /// Request namespace.
    pub namespace: String,
    /// Request name.
    pub name: String,
    /// Request `metadata.uid`: a request recreated under the same name is another referrer.
    pub uid: String,
}

/// Observed state of a `ModelCacheBinding`.
///
/// CEL: `writerVolumeName` is set once (what every reader PV derives from: the cache's data
/// identity); `additionalResources`, once recorded, is never removed (its lists never shrink,
/// see [`BindingResources`]).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelCacheBindingStatus {
    /// `Active` (also when absent) or `Retiring`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<BindingPhase>,
    /// Requests using the cache; zero references is the idle condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_references: Vec<RequestReference>,
    /// Owned objects added after creation (reader claims and PVs of later reader namespaces),
    /// recorded before they are created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_resources: Option<BindingResources>,
    /// When the reference count last became zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since: Option<Time>,
    /// The writer claim's dynamically provisioned PV (not owned: under `Retain` it stays
    /// `Released` for the storage administrator after release).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub writer_volume_name: Option<String>,
    /// Named objects the last release pass kept, with why (foreign, changed since read, or a
    /// volume that no longer `Retain`s). Empty before release and once everything is gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024))]
    pub release_skipped: Vec<ReleaseSkip>,
    /// Conditions keyed by type (`Released`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl ModelCacheBinding {
    /// `status.phase`, `Active` when absent.
    pub fn phase(&self) -> BindingPhase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or_default()
    }

    /// The request references (empty without status).
    pub fn references(&self) -> &[RequestReference] {
        self.status
            .as_ref()
            .map(|s| s.request_references.as_slice())
            .unwrap_or(&[])
    }

    /// Every object the binding names: `spec.resources` ∪ `status.additionalResources`.
    pub fn all_resources(&self) -> BindingResources {
        let mut all = self.spec.resources.clone();
        if let Some(extra) = self
            .status
            .as_ref()
            .and_then(|s| s.additional_resources.as_ref())
        {
            all.extend(extra);
        }
        all
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn resources_union_keeps_order_and_dedups() {
        let mut a = BindingResources {
            persistent_volumes: vec!["pv-a".into()],
            ..Default::default()
        };
        let b = BindingResources {
            persistent_volumes: vec!["pv-a".into(), "pv-b".into()],
            lease: Some(NamespacedName::new("c", "l")),
            ..Default::default()
        };
        a.extend(&b);
        assert_eq!(a.persistent_volumes, vec!["pv-a", "pv-b"]);
        assert_eq!(a.lease, Some(NamespacedName::new("c", "l")));
        assert!(!a.is_empty());
        assert!(BindingResources::default().is_empty());
    }

    #[test]
    fn phase_defaults_to_active() {
        let b = ModelCacheBinding::default();
        assert_eq!(b.phase(), BindingPhase::Active);
        assert!(b.references().is_empty());
    }
}
