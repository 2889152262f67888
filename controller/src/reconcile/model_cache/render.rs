//! Pure rendering of the objects a binding owns (spec 004 "Readers", "Runtime flow" 5).
//!
//! Every rendered object carries the binding's name label and UID annotation
//! ([`ic_shared::crd::annotations`]); release deletes only objects that still carry both.

use std::collections::BTreeMap;

use ic_shared::crd::{
    annotations, AccessMode, BindingDecision, BindingIdentity, BindingResources,
    BindingStorageClass, ModelCache, ModelCacheBinding, ModelCacheBindingSpec, MODEL_DATA_VOLUME,
};
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    EnvVar, ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, PodTemplateSpec, Secret, Volume,
    VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use k8s_openapi::ByteString;
use thiserror::Error;

/// `app.kubernetes.io/managed-by` value on every owned object.
pub const MANAGED_BY: &str = "inference-cache";

/// The binding an object belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner<'a> {
    /// Binding name.
    pub name: &'a str,
    /// Binding `metadata.uid`.
    pub uid: &'a str,
}

impl<'a> Owner<'a> {
    /// The owner of objects named by `binding` (empty strings when unset).
    pub fn of(binding: &'a ModelCacheBinding) -> Self {
        Owner {
            name: binding.metadata.name.as_deref().unwrap_or_default(),
            uid: binding.metadata.uid.as_deref().unwrap_or_default(),
        }
    }
}

/// Metadata of an owned object: name, namespace, the binding label and UID annotation.
pub fn owned_meta(name: &str, namespace: Option<&str>, owner: Owner<'_>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(str::to_string),
        labels: Some(BTreeMap::from([
            (
                annotations::BINDING_LABEL.to_string(),
                owner.name.to_string(),
            ),
            (
                "app.kubernetes.io/managed-by".to_string(),
                MANAGED_BY.to_string(),
            ),
        ])),
        annotations: Some(BTreeMap::from([(
            annotations::BINDING_UID_ANNOTATION.to_string(),
            owner.uid.to_string(),
        )])),
        ..Default::default()
    }
}

/// A new binding object (step 3): finalizer, identity label, immutable spec.
pub fn new_binding(
    name: &str,
    control_ns: &str,
    identity: BindingIdentity,
    decision: BindingDecision,
    storage_class: BindingStorageClass,
    resources: BindingResources,
) -> ModelCacheBinding {
    let label = super::names::identity_label(&identity);
    ModelCacheBinding {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(control_ns.to_string()),
            labels: Some(BTreeMap::from([
                (annotations::IDENTITY_LABEL.to_string(), label),
                (
                    "app.kubernetes.io/managed-by".to_string(),
                    MANAGED_BY.to_string(),
                ),
            ])),
            finalizers: Some(vec![annotations::BINDING_FINALIZER.to_string()]),
            ..Default::default()
        },
        spec: ModelCacheBindingSpec {
            identity,
            decision,
            storage_class,
            resources,
        },
        status: None,
    }
}

fn storage_request(size: Quantity) -> VolumeResourceRequirements {
    VolumeResourceRequirements {
        requests: Some(BTreeMap::from([("storage".to_string(), size)])),
        ..Default::default()
    }
}

/// The writer claim: the flow's writer mode (`ReadWriteMany` or `ReadWriteOnce`), `size`,
/// provisioned from `class_name`.
pub fn writer_claim(
    name: &str,
    namespace: &str,
    owner: Owner<'_>,
    decision: &BindingDecision,
    size: Quantity,
    class_name: &str,
) -> PersistentVolumeClaim {
    let mode = decision
        .access_modes
        .first()
        .copied()
        .unwrap_or(AccessMode::ReadWriteOnce);
    PersistentVolumeClaim {
        metadata: owned_meta(name, Some(namespace), owner),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![mode.as_str().to_string()]),
            storage_class_name: Some(class_name.to_string()),
            resources: Some(storage_request(size)),
            ..Default::default()
        }),
        status: None,
    }
}

/// Why the writer Job cannot be rendered.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WriterError {
    /// `spec.writer.template` does not decode as a PodTemplateSpec.
    #[error("spec.writer.template is not a PodTemplateSpec: {0}")]
    Template(String),
    /// The template has no containers.
    #[error("spec.writer.template has no containers")]
    NoContainers,
    /// The template already has a volume named `model-data`.
    #[error("spec.writer.template already has a volume named model-data")]
    VolumeTaken,
}

/// The writer Job: the request's pod template with volume `model-data` (the writer claim)
/// mounted read-write at `spec.writer.mountPath` in every container, `MODEL_CACHE_PATH`,
/// `MODEL_SOURCE_URI`, `MODEL_SOURCE_REVISION` set, `restartPolicy` `Never` unless `OnFailure`.
/// `service_account`, when given (a writer in the control namespace), replaces the template's
/// and turns off token automount.
pub fn writer_job(
    name: &str,
    namespace: &str,
    owner: Owner<'_>,
    mc: &ModelCache,
    claim: &str,
    service_account: Option<&str>,
) -> Result<Job, WriterError> {
    let mut template: PodTemplateSpec = serde_json::from_value(mc.spec.writer.template.clone())
        .map_err(|e| WriterError::Template(e.to_string()))?;
    let mut pod = template.spec.take().unwrap_or_default();
    if pod.containers.is_empty() {
        return Err(WriterError::NoContainers);
    }
    let volumes = pod.volumes.get_or_insert_with(Vec::new);
    if volumes.iter().any(|v| v.name == MODEL_DATA_VOLUME) {
        return Err(WriterError::VolumeTaken);
    }
    volumes.push(Volume {
        name: MODEL_DATA_VOLUME.to_string(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim.to_string(),
            read_only: Some(false),
        }),
        ..Default::default()
    });
    let path = mc.spec.writer.effective_mount_path().to_string();
    let env = [
        ("MODEL_CACHE_PATH", path.clone()),
        ("MODEL_SOURCE_URI", mc.spec.source.uri.clone()),
        ("MODEL_SOURCE_REVISION", mc.spec.source.revision.clone()),
    ];
    for c in pod.containers.iter_mut() {
        c.volume_mounts
            .get_or_insert_with(Vec::new)
            .push(VolumeMount {
                name: MODEL_DATA_VOLUME.to_string(),
                mount_path: path.clone(),
                ..Default::default()
            });
        let list = c.env.get_or_insert_with(Vec::new);
        for (k, v) in &env {
            list.retain(|e| e.name != *k);
            list.push(EnvVar {
                name: k.to_string(),
                value: Some(v.clone()),
                ..Default::default()
            });
        }
    }
    if pod.restart_policy.as_deref() != Some("OnFailure") {
        pod.restart_policy = Some("Never".to_string());
    }
    if let Some(sa) = service_account {
        pod.service_account_name = Some(sa.to_string());
        pod.automount_service_account_token = Some(false);
    }
    let meta = template.metadata.get_or_insert_with(ObjectMeta::default);
    meta.labels.get_or_insert_with(BTreeMap::new).insert(
        annotations::BINDING_LABEL.to_string(),
        owner.name.to_string(),
    );
    template.spec = Some(pod);
    Ok(Job {
        metadata: owned_meta(name, Some(namespace), owner),
        spec: Some(JobSpec {
            template,
            backoff_limit: mc.spec.writer.backoff_limit,
            active_deadline_seconds: mc.spec.writer.active_deadline_seconds,
            ..Default::default()
        }),
        status: None,
    })
}

/// The writer-election Lease held by `holder` (a request UID) from `now`.
pub fn writer_lease(
    name: &str,
    namespace: &str,
    owner: Owner<'_>,
    holder: &str,
    duration_seconds: i32,
    now: Timestamp,
) -> Lease {
    Lease {
        metadata: owned_meta(name, Some(namespace), owner),
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.to_string()),
            lease_duration_seconds: Some(duration_seconds),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            ..Default::default()
        }),
    }
}

/// Why a reader PV cannot be derived from the writer's volume.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeriveError {
    /// The writer PV is not a CSI volume.
    #[error("writer volume {0} is not a CSI volume")]
    NotCsi(String),
    /// The writer PV's driver is not the binding's provisioner.
    #[error("writer volume {pv} uses driver {driver}, the binding recorded {recorded}")]
    DriverMismatch {
        /// Writer PV.
        pv: String,
        /// Its driver.
        driver: String,
        /// The binding's provisioner.
        recorded: String,
    },
    /// The catalog says the handle encodes the namespace, but it does not hold the writer's.
    #[error("volume handle {handle:?} has no namespace segment {segment} equal to {namespace:?} (separator {separator:?})")]
    HandleWithoutNamespace {
        /// The writer's handle.
        handle: String,
        /// The expected segment.
        segment: u32,
        /// The separator.
        separator: String,
        /// The writer namespace.
        namespace: String,
    },
}

/// The reader access mode of a flow: the last required mode (`ReadWriteMany` for
/// `rwxReadOnly`, `ReadOnlyMany` for `roxReadOnly`).
pub fn reader_mode(decision: &BindingDecision) -> AccessMode {
    decision
        .access_modes
        .last()
        .copied()
        .unwrap_or(AccessMode::ReadOnlyMany)
}

/// The writer's volume handle as a reader in `reader_ns` needs it: rewritten only where the
/// binding's decision has a `volumeHandleNamespace` rule and the namespaces differ.
pub fn reader_handle(
    handle: &str,
    decision: &BindingDecision,
    writer_ns: &str,
    reader_ns: &str,
) -> Result<String, DeriveError> {
    let Some(rule) = &decision.volume_handle_namespace else {
        return Ok(handle.to_string());
    };
    if writer_ns == reader_ns {
        return Ok(handle.to_string());
    }
    let mut parts: Vec<&str> = handle.split(rule.separator.as_str()).collect();
    let idx = rule.segment as usize;
    match parts.get(idx) {
        Some(seg) if *seg == writer_ns && !rule.separator.is_empty() => {
            parts[idx] = reader_ns;
            Ok(parts.join(&rule.separator))
        }
        _ => Err(DeriveError::HandleWithoutNamespace {
            handle: handle.to_string(),
            segment: rule.segment,
            separator: rule.separator.clone(),
            namespace: writer_ns.to_string(),
        }),
    }
}

/// A reader PV derived from the writer's bound PV (spec 004 "Readers"): a static copy with
/// `storageClassName` cleared, `csi.readOnly: true`, `mountOptions` = the decision's reader
/// mount options, the volume handle rewritten only where the decision says so, reclaim policy
/// `Retain` (deleting a reader never deletes data), the reader access mode, and a `claimRef`
/// pre-binding it to `claim` in `reader_ns` by name. Provisioner annotations, status, UID and
/// the writer's claimRef are dropped.
pub fn reader_pv(
    writer: &PersistentVolume,
    decision: &BindingDecision,
    writer_ns: &str,
    reader_ns: &str,
    name: &str,
    claim: &str,
    owner: Owner<'_>,
) -> Result<PersistentVolume, DeriveError> {
    let writer_name = writer.metadata.name.clone().unwrap_or_default();
    let spec = writer.spec.clone().unwrap_or_default();
    let mut csi = spec
        .csi
        .clone()
        .ok_or_else(|| DeriveError::NotCsi(writer_name.clone()))?;
    if csi.driver != decision.provisioner {
        return Err(DeriveError::DriverMismatch {
            pv: writer_name,
            driver: csi.driver,
            recorded: decision.provisioner.clone(),
        });
    }
    csi.volume_handle = reader_handle(&csi.volume_handle, decision, writer_ns, reader_ns)?;
    csi.read_only = Some(true);
    Ok(PersistentVolume {
        metadata: owned_meta(name, None, owner),
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(vec![reader_mode(decision).as_str().to_string()]),
            capacity: spec.capacity.clone(),
            csi: Some(csi),
            mount_options: (!decision.reader_mount_options.is_empty())
                .then(|| decision.reader_mount_options.clone()),
            node_affinity: spec.node_affinity.clone(),
            persistent_volume_reclaim_policy: Some("Retain".to_string()),
            storage_class_name: None,
            volume_mode: spec.volume_mode.clone(),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".to_string()),
                kind: Some("PersistentVolumeClaim".to_string()),
                namespace: Some(reader_ns.to_string()),
                name: Some(claim.to_string()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

/// The reader claim pre-bound to `pv` by name: `storageClassName: ""` (so no default class is
/// assigned — a pre-bound pair whose classes differ never binds), the PV's access mode, volume
/// mode and capacity.
pub fn reader_claim(
    pv: &PersistentVolume,
    name: &str,
    namespace: &str,
    owner: Owner<'_>,
) -> PersistentVolumeClaim {
    let spec = pv.spec.clone().unwrap_or_default();
    let size = spec
        .capacity
        .as_ref()
        .and_then(|c| c.get("storage").cloned())
        .unwrap_or_else(|| Quantity("1".to_string()));
    PersistentVolumeClaim {
        metadata: owned_meta(name, Some(namespace), owner),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: spec.access_modes.clone(),
            storage_class_name: Some(String::new()),
            volume_name: pv.metadata.name.clone(),
            volume_mode: spec.volume_mode.clone(),
            resources: Some(storage_request(size)),
            ..Default::default()
        }),
        status: None,
    }
}

/// CSI parameter keys through which the derived class hands the key Secret to the driver.
pub const CSI_SECRET_PARAMETERS: [(&str, &str); 2] = [
    (
        "csi.storage.k8s.io/provisioner-secret-name",
        "csi.storage.k8s.io/provisioner-secret-namespace",
    ),
    (
        "csi.storage.k8s.io/node-stage-secret-name",
        "csi.storage.k8s.io/node-stage-secret-namespace",
    ),
];

/// The key Secret of an encrypted cache (`data.key`: 32 random bytes, hex).
pub fn key_secret(name: &str, namespace: &str, owner: Owner<'_>, key_hex: &str) -> Secret {
    Secret {
        metadata: owned_meta(name, Some(namespace), owner),
        data: Some(BTreeMap::from([(
            "key".to_string(),
            ByteString(key_hex.as_bytes().to_vec()),
        )])),
        type_: Some("Opaque".to_string()),
        ..Default::default()
    }
}

/// The derived StorageClass of an encrypted cache: the base class with the key Secret passed
/// through the standard CSI provisioner and node-stage secret parameters and
/// `encrypted: "true"`; reclaim policy `Retain`.
pub fn encrypted_class(
    base: &StorageClass,
    name: &str,
    owner: Owner<'_>,
    secret: &str,
    secret_ns: &str,
) -> StorageClass {
    let mut params = base.parameters.clone().unwrap_or_default();
    for (n, ns) in CSI_SECRET_PARAMETERS {
        params.insert(n.to_string(), secret.to_string());
        params.insert(ns.to_string(), secret_ns.to_string());
    }
    params.insert("encrypted".to_string(), "true".to_string());
    StorageClass {
        metadata: owned_meta(name, None, owner),
        provisioner: base.provisioner.clone(),
        parameters: Some(params),
        mount_options: base.mount_options.clone(),
        reclaim_policy: Some("Retain".to_string()),
        volume_binding_mode: base.volume_binding_mode.clone(),
        allow_volume_expansion: base.allow_volume_expansion,
        allowed_topologies: base.allowed_topologies.clone(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::crd::{Flow, VolumeHandleNamespace};

    fn decision(rule: Option<VolumeHandleNamespace>) -> BindingDecision {
        BindingDecision {
            provider: "nvmesh".into(),
            provisioner: "nvmesh-csi.excelero.com".into(),
            flow: Flow::RoxReadOnly,
            access_modes: vec![AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany],
            reader_mount_options: vec!["ro".into(), "nouuid".into()],
            volume_handle_namespace: rule,
            encrypted: false,
            catalog_profile_digest: "d".into(),
        }
    }

    #[test]
    fn handle_rewrite_only_where_the_rule_says() {
        let d = decision(None);
        assert_eq!(
            reader_handle("a/ns1/v", &d, "ns1", "ns2").unwrap(),
            "a/ns1/v"
        );
        let d = decision(Some(VolumeHandleNamespace {
            separator: "/".into(),
            segment: 1,
        }));
        assert_eq!(
            reader_handle("a/ns1/v", &d, "ns1", "ns2").unwrap(),
            "a/ns2/v"
        );
        assert_eq!(
            reader_handle("a/ns1/v", &d, "ns1", "ns1").unwrap(),
            "a/ns1/v"
        );
        assert!(matches!(
            reader_handle("a/other/v", &d, "ns1", "ns2"),
            Err(DeriveError::HandleWithoutNamespace { .. })
        ));
        assert!(reader_handle("a", &d, "ns1", "ns2").is_err());
    }
}
