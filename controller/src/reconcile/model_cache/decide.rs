//! Pure decisions of the model-cache controller (spec 004 "Runtime flow", "Failure rules",
//! "Cache binding" lifecycle). The kube layer ([`super::request`], [`super::binding`]) reads
//! objects, calls these, and writes what they return.

use std::collections::BTreeMap;
use std::time::Duration;

use ic_shared::crd::{
    annotations, model_cache_reason as reason, BindingDecision, BindingIdentity, BindingPhase,
    BindingRef, BindingResources, BindingStorageClass, CacheMode, Durability, ModelCache,
    ModelCacheBinding, ModelCacheBindingStatus, RecordedReclaimPolicy, RequestReference, Selection,
    Workflow,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::catalog::{sha256_hex, Catalog, FlowRequest};

/// Default name of the `CachingSupport` feature flag (spec 004 step 1).
pub const FLAG_CACHING_SUPPORT: &str = "CachingSupport";
/// Default name of the `HelmModelCaching` feature flag (spec 004 step 1).
pub const FLAG_HELM_MODEL_CACHING: &str = "HelmModelCaching";
/// Default name of the `ModelCacheEncryption` feature flag (spec 004 "Capability catalog").
pub const FLAG_MODEL_CACHE_ENCRYPTION: &str = "ModelCacheEncryption";

/// The three feature flags the model cache reads. Only consulted before a request records its
/// mode: flag changes never alter a recorded mode or a binding (spec 004 step 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureFlags {
    /// `CachingSupport` (default on): off → mode `none` for every new request.
    pub caching_support: bool,
    /// `HelmModelCaching` (default on): off → mode `none` for new `helmModelCache` requests.
    pub helm_model_caching: bool,
    /// `ModelCacheEncryption` (default off): on → new caches are encrypted, or not durable
    /// where the driver cannot encrypt.
    pub model_cache_encryption: bool,
}

impl Default for FeatureFlags {
    fn default() -> Self {
        FeatureFlags {
            caching_support: true,
            helm_model_caching: true,
            model_cache_encryption: false,
        }
    }
}

impl FeatureFlags {
    /// Parses Kubernetes-style feature gates, `Name=true,Other=false`, over the defaults.
    /// Names are [`FLAG_CACHING_SUPPORT`], [`FLAG_HELM_MODEL_CACHING`],
    /// [`FLAG_MODEL_CACHE_ENCRYPTION`] (case-sensitive). Errors name the offending item.
    pub fn parse(gates: &str) -> Result<Self, String> {
        let mut flags = FeatureFlags::default();
        for item in gates.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| format!("feature gate {item:?} is not Name=true|false"))?;
            let value = match value.trim() {
                "true" => true,
                "false" => false,
                other => return Err(format!("feature gate {name}: {other:?} is not true|false")),
            };
            match name.trim() {
                FLAG_CACHING_SUPPORT => flags.caching_support = value,
                FLAG_HELM_MODEL_CACHING => flags.helm_model_caching = value,
                FLAG_MODEL_CACHE_ENCRYPTION => flags.model_cache_encryption = value,
                other => return Err(format!("unknown model-cache feature gate {other:?}")),
            }
        }
        Ok(flags)
    }
}

/// A mode recorded without a binding, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonDurable {
    /// `none` or `ephemeral`.
    pub mode: CacheMode,
    /// CamelCase reason (`ic_shared::crd::model_cache_reason`).
    pub reason: &'static str,
    /// A sentence for the operator.
    pub message: String,
}

/// Step 1: the gates. `Some` when the request gets no binding: `none` when `CachingSupport` is
/// off or a `helmModelCache` request meets `HelmModelCaching` off; `ephemeral` when the request
/// asks for it. `None`: go on to step 2.
pub fn gate(flags: &FeatureFlags, mc: &ModelCache) -> Option<NonDurable> {
    if !flags.caching_support {
        return Some(NonDurable {
            mode: CacheMode::None,
            reason: reason::CACHING_SUPPORT_DISABLED,
            message: format!("the {FLAG_CACHING_SUPPORT} feature flag is off"),
        });
    }
    if mc.spec.workflow == Workflow::HelmModelCache && !flags.helm_model_caching {
        return Some(NonDurable {
            mode: CacheMode::None,
            reason: reason::HELM_MODEL_CACHING_DISABLED,
            message: format!(
                "the {FLAG_HELM_MODEL_CACHING} feature flag is off for helmModelCache requests"
            ),
        });
    }
    if mc.spec.effective_durability() == Durability::Ephemeral {
        return Some(NonDurable {
            mode: CacheMode::Ephemeral,
            reason: reason::EPHEMERAL_REQUESTED,
            message: "the request asks for durability Ephemeral".to_string(),
        });
    }
    None
}

/// What step 2 needs of the cache StorageClass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassView {
    /// Name.
    pub name: String,
    /// `metadata.uid`.
    pub uid: String,
    /// Exact provisioner.
    pub provisioner: String,
    /// `reclaimPolicy` (the API server defaults an unset one to `Delete`).
    pub reclaim_policy: String,
    /// SHA-256 (hex) of provisioner, parameters, mount options, reclaim policy, volume binding
    /// mode and expansion flag.
    pub configuration_digest: String,
}

/// Reads a StorageClass into a [`ClassView`].
pub fn class_view(sc: &StorageClass) -> ClassView {
    let reclaim = sc
        .reclaim_policy
        .clone()
        .unwrap_or_else(|| "Delete".to_string());
    let config = serde_json::json!({
        "provisioner": sc.provisioner,
        "parameters": sc.parameters.clone().unwrap_or_default(),
        "mountOptions": sc.mount_options.clone().unwrap_or_default(),
        "reclaimPolicy": reclaim,
        "volumeBindingMode": sc.volume_binding_mode.clone().unwrap_or_else(|| "Immediate".to_string()),
        "allowVolumeExpansion": sc.allow_volume_expansion.unwrap_or(false),
    });
    ClassView {
        name: sc.metadata.name.clone().unwrap_or_default(),
        uid: sc.metadata.uid.clone().unwrap_or_default(),
        provisioner: sc.provisioner.clone(),
        reclaim_policy: reclaim,
        configuration_digest: sha256_hex(config.to_string().as_bytes()),
    }
}

/// A durable selection: what a new binding records, and what the request records first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable {
    /// `spec.decision` of a new binding.
    pub decision: BindingDecision,
    /// `spec.storageClass` of a new binding.
    pub class: BindingStorageClass,
    /// `status.selection` of the request.
    pub selection: Selection,
}

/// Step 2's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selected {
    /// A durable flow.
    Durable(Box<Durable>),
    /// No derivable flow: mode `ephemeral`, with why.
    NoFlow(NonDurable),
}

/// SHA-256 (hex) over a decision and a class record: what drift detection compares. The
/// decision's `provider` is left out: it is a diagnostics label that "gates nothing" (spec 004),
/// so editing it is not drift.
pub fn decision_digest(decision: &BindingDecision, class: &BindingStorageClass) -> String {
    let gating = BindingDecision {
        provider: String::new(),
        ..decision.clone()
    };
    let v = serde_json::json!({"decision": gating, "storageClass": class});
    sha256_hex(v.to_string().as_bytes())
}

fn no_flow(reason: &'static str, message: String) -> Selected {
    Selected::NoFlow(NonDurable {
        mode: CacheMode::Ephemeral,
        reason,
        message,
    })
}

/// Step 2: the class must exist with reclaim policy `Retain`; its provisioner's catalog entry
/// must derive a flow that fits the workflow (readers in other namespaces for
/// `helmModelCache`) and the encryption flag.
pub fn select(
    class: Option<&ClassView>,
    class_name: &str,
    catalog: &Catalog,
    workflow: Workflow,
    flags: &FeatureFlags,
) -> Selected {
    let Some(class) = class else {
        return no_flow(
            reason::STORAGE_CLASS_NOT_FOUND,
            format!("StorageClass {class_name} does not exist"),
        );
    };
    if class.reclaim_policy != "Retain" {
        return no_flow(
            reason::RECLAIM_POLICY_NOT_RETAIN,
            format!(
                "StorageClass {} has reclaimPolicy {}; a cache class must Retain",
                class.name, class.reclaim_policy
            ),
        );
    }
    let req = FlowRequest {
        provisioner: &class.provisioner,
        cross_namespace: workflow == Workflow::HelmModelCache,
        encryption_requested: flags.model_cache_encryption,
    };
    match catalog.decide(&req) {
        Err(e) => no_flow(e.reason(), e.to_string()),
        Ok(decision) => {
            let class_rec = BindingStorageClass {
                name: class.name.clone(),
                uid: class.uid.clone(),
                reclaim_policy: RecordedReclaimPolicy::Retain,
                configuration_digest: class.configuration_digest.clone(),
            };
            let selection = Selection {
                provisioner: decision.provisioner.clone(),
                flow: decision.flow,
                storage_class_name: class.name.clone(),
                storage_class_uid: class.uid.clone(),
                decision_digest: decision_digest(&decision, &class_rec),
            };
            Selected::Durable(Box::new(Durable {
                decision,
                class: class_rec,
                selection,
            }))
        }
    }
}

/// "Class or catalog drifts before the binding exists → fail before any side effect": a
/// request that recorded `recorded` and has no binding yet may only go on when step 2 derives
/// the very same selection now. `Err` carries the message.
pub fn check_drift(recorded: &Selection, now: &Selected) -> Result<(), String> {
    match now {
        Selected::Durable(d) if d.selection == *recorded => Ok(()),
        Selected::Durable(d) => Err(format!(
            "the storage selection changed after it was recorded (recorded {} {} on class {} uid {}, now {} {} on class {} uid {}); nothing was created — recreate the ModelCache to select again",
            recorded.provisioner,
            recorded.flow.as_str(),
            recorded.storage_class_name,
            recorded.storage_class_uid,
            d.selection.provisioner,
            d.selection.flow.as_str(),
            d.selection.storage_class_name,
            d.selection.storage_class_uid,
        )),
        Selected::NoFlow(n) => Err(format!(
            "the storage selection was recorded, but no durable flow is derivable now ({}); nothing was created — recreate the ModelCache to select again",
            n.message
        )),
    }
}

/// Step 3: which binding a request joins.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// The `Active` binding with this identity (authoritative, whatever the catalog says now).
    Join(Box<ModelCacheBinding>),
    /// None is `Active` (none exists, or all are `Retiring`): create generation `generation`.
    Create {
        /// Generation of the new binding.
        generation: u32,
    },
}

/// Step 3: the `Active` binding with `identity` among `candidates` (oldest generation first),
/// or a new generation. A `Retiring` binding, or one being deleted, is never joined.
pub fn choose_binding(candidates: &[ModelCacheBinding], identity: &BindingIdentity) -> Choice {
    let mut active: Vec<&ModelCacheBinding> = candidates
        .iter()
        .filter(|b| &b.spec.identity == identity)
        .filter(|b| b.phase() == BindingPhase::Active && b.metadata.deletion_timestamp.is_none())
        .collect();
    active.sort_by_key(|b| {
        b.metadata
            .name
            .as_deref()
            .and_then(super::names::generation_of)
            .unwrap_or(u32::MAX)
    });
    match active.first() {
        Some(b) => Choice::Join(Box::new((*b).clone())),
        None => Choice::Create {
            generation: super::names::next_generation(candidates, identity),
        },
    }
}

/// Step 4: the binding status with `reference` added and `extra` (reader objects of new
/// namespaces) recorded; `idleSince` cleared and `phase` made explicit. `None` when nothing
/// changes (already referenced, nothing new to name). Never called on a `Retiring` binding.
pub fn add_reference(
    status: Option<&ModelCacheBindingStatus>,
    reference: &RequestReference,
    extra: &BindingResources,
) -> Option<ModelCacheBindingStatus> {
    let mut s = status.cloned().unwrap_or_default();
    let before = s.clone();
    s.phase = Some(BindingPhase::Active);
    if !s.request_references.contains(reference) {
        s.request_references.push(reference.clone());
    }
    s.idle_since = None;
    if !extra.is_empty() {
        s.additional_resources
            .get_or_insert_with(BindingResources::default)
            .extend(extra);
    }
    (s != before).then_some(s)
}

/// Why a request's recorded binding cannot be used (spec 004 "Failure rules": "Binding is
/// Retiring, missing, or lacks this request's reference → Fail; never rebind").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundCheck {
    /// Usable.
    Ok,
    /// Gone, or another object under the same name (UID differs).
    Missing,
    /// `Retiring` (or being deleted).
    Retiring,
    /// This request's UID is not among the references.
    ReferenceMissing,
}

impl BoundCheck {
    /// The condition reason of a failed check (`None` for [`BoundCheck::Ok`]).
    pub fn reason(self) -> Option<&'static str> {
        match self {
            BoundCheck::Ok => None,
            BoundCheck::Missing => Some(reason::BINDING_MISSING),
            BoundCheck::Retiring => Some(reason::BINDING_RETIRING),
            BoundCheck::ReferenceMissing => Some(reason::REFERENCE_MISSING),
        }
    }
}

/// Checks the recorded binding of a request with UID `request_uid`.
pub fn check_bound(
    binding: Option<&ModelCacheBinding>,
    recorded: &BindingRef,
    request_uid: &str,
) -> BoundCheck {
    let Some(b) = binding else {
        return BoundCheck::Missing;
    };
    if b.metadata.uid.as_deref() != Some(recorded.uid.as_str()) {
        return BoundCheck::Missing;
    }
    if b.phase() == BindingPhase::Retiring || b.metadata.deletion_timestamp.is_some() {
        return BoundCheck::Retiring;
    }
    if !b.references().iter().any(|r| r.uid == request_uid) {
        return BoundCheck::ReferenceMissing;
    }
    BoundCheck::Ok
}

/// Whether an object belongs to a binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// Carries the binding's name label and UID annotation.
    Owned,
    /// Anything else: missing or other marks. Never adopted, never deleted.
    Foreign,
}

/// Ownership of an object by binding `name` / `uid`: both the
/// [`annotations::BINDING_LABEL`] label and the [`annotations::BINDING_UID_ANNOTATION`]
/// annotation must match.
pub fn ownership(meta: &ObjectMeta, name: &str, uid: &str) -> Ownership {
    let label = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(annotations::BINDING_LABEL));
    let ann = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotations::BINDING_UID_ANNOTATION));
    if label.map(String::as_str) == Some(name) && ann.map(String::as_str) == Some(uid) {
        Ownership::Owned
    } else {
        Ownership::Foreign
    }
}

/// The binding lifecycle step (spec 004: "a binding with zero references past the idle period
/// moves to Retiring").
#[derive(Debug, Clone, PartialEq)]
pub enum Lifecycle {
    /// Nothing to write; look again after the given time.
    Unchanged(Duration),
    /// Write this status (references pruned, `idleSince` set or cleared); look again after the
    /// given time.
    Update(Box<ModelCacheBindingStatus>, Duration),
    /// Write this status (phase `Retiring`) and release the named objects.
    Retire(Box<ModelCacheBindingStatus>),
}

fn since(now: Timestamp, then: &Time) -> Duration {
    now.duration_since(then.0)
        .try_into()
        .unwrap_or(Duration::ZERO)
}

/// Lifecycle of a binding whose references were checked: `live` are those whose request still
/// exists with the recorded UID. Zero live references starts (or continues) the idle period; at
/// its end the binding retires and is released — the only release path (spec 004 "Cache
/// binding"). A binding being deleted (`deleting`) or already `Retiring` is never joined again
/// (phase `Retiring`), but while a live request still references it nothing is released: it
/// waits, like any binding, for zero references past the idle period. `steady` is the
/// look-again cadence otherwise.
pub fn lifecycle(
    binding: &ModelCacheBinding,
    live: &[RequestReference],
    now: Timestamp,
    idle_period: Duration,
    steady: Duration,
    deleting: bool,
) -> Lifecycle {
    let current = binding.status.clone().unwrap_or_default();
    let mut next = current.clone();
    next.phase = Some(if deleting || binding.phase() == BindingPhase::Retiring {
        BindingPhase::Retiring
    } else {
        BindingPhase::Active
    });
    next.request_references = live.to_vec();
    if live.is_empty() {
        let idle_since = current
            .idle_since
            .clone()
            .unwrap_or_else(|| Time(Timestamp::from_second(now.as_second()).unwrap_or(now)));
        let idle_for = since(now, &idle_since);
        next.idle_since = Some(idle_since);
        if idle_for >= idle_period {
            next.phase = Some(BindingPhase::Retiring);
            return Lifecycle::Retire(Box::new(next));
        }
        let left = idle_period.saturating_sub(idle_for).min(steady);
        if next == current {
            Lifecycle::Unchanged(left)
        } else {
            Lifecycle::Update(Box::new(next), left)
        }
    } else {
        next.idle_since = None;
        if next == current {
            Lifecycle::Unchanged(steady)
        } else {
            Lifecycle::Update(Box::new(next), steady)
        }
    }
}

/// The writer election (spec 004 step 5: "Lease elects one writer").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseStep {
    /// No Lease: create it with this request as holder.
    Create,
    /// This request holds it: go on to the writer claim and Job.
    Hold,
    /// Another request held it, it expired and no writer Job exists: take it over.
    TakeOver,
    /// Another request holds it (or its Job exists): wait.
    Wait {
        /// The holder's identity.
        holder: String,
    },
}

/// Decides the writer election for the request whose identity is `me` (its UID).
pub fn lease_step(lease: Option<&Lease>, me: &str, job_exists: bool, now: Timestamp) -> LeaseStep {
    let Some(lease) = lease else {
        return LeaseStep::Create;
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder == me {
        return LeaseStep::Hold;
    }
    if job_exists {
        return LeaseStep::Wait { holder };
    }
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(0)));
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0);
    let expired = match renewed {
        Some(t) => t
            .checked_add(duration)
            .map(|end| end < now)
            .unwrap_or(false),
        None => true,
    };
    if expired || holder.is_empty() {
        LeaseStep::TakeOver
    } else {
        LeaseStep::Wait { holder }
    }
}

/// Selects, from a namespace → request map, the references of binding `binding_uid` that are
/// live: the request exists with the recorded UID, is not being deleted, and has not recorded
/// something else as final — a mode other than `durable` (`none`, `ephemeral`) or another
/// binding's UID in `status.binding`. Those last two are references a pass added before its
/// `status.binding` write failed and a later pass decided otherwise: the request will never
/// use this binding, so the reference must not keep it from idling.
pub fn live_references(
    references: &[RequestReference],
    found: &BTreeMap<(String, String), Option<ModelCache>>,
    binding_uid: &str,
) -> Vec<RequestReference> {
    references
        .iter()
        .filter(|r| {
            found
                .get(&(r.namespace.clone(), r.name.clone()))
                .and_then(|m| m.as_ref())
                .is_some_and(|m| {
                    let status = m.status.as_ref();
                    let decided_otherwise = status.is_some_and(|s| {
                        matches!(s.mode, Some(CacheMode::None) | Some(CacheMode::Ephemeral))
                            || s.binding.as_ref().is_some_and(|b| b.uid != binding_uid)
                    });
                    m.metadata.uid.as_deref() == Some(r.uid.as_str())
                        && m.metadata.deletion_timestamp.is_none()
                        && !decided_otherwise
                })
        })
        .cloned()
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn feature_gates_parse() {
        let f = FeatureFlags::parse("CachingSupport=false, ModelCacheEncryption=true").unwrap();
        assert!(!f.caching_support && f.helm_model_caching && f.model_cache_encryption);
        assert!(FeatureFlags::parse("Nope=true").is_err());
        assert!(FeatureFlags::parse("CachingSupport").is_err());
        assert!(FeatureFlags::parse("CachingSupport=yes").is_err());
        assert_eq!(FeatureFlags::parse("").unwrap(), FeatureFlags::default());
    }

    #[test]
    fn lease_table() {
        let lease = |holder: &str, renew: i64, dur: i32| Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                renew_time: Some(MicroTime(t(renew))),
                lease_duration_seconds: Some(dur),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(lease_step(None, "me", false, t(100)), LeaseStep::Create);
        assert_eq!(
            lease_step(Some(&lease("me", 0, 1)), "me", false, t(100)),
            LeaseStep::Hold
        );
        assert_eq!(
            lease_step(Some(&lease("x", 90, 60)), "me", false, t(100)),
            LeaseStep::Wait { holder: "x".into() }
        );
        assert_eq!(
            lease_step(Some(&lease("x", 0, 60)), "me", false, t(100)),
            LeaseStep::TakeOver
        );
        assert_eq!(
            lease_step(Some(&lease("x", 0, 60)), "me", true, t(100)),
            LeaseStep::Wait { holder: "x".into() }
        );
    }

    #[test]
    fn idle_then_retire() {
        let b = ModelCacheBinding::default();
        let idle = Duration::from_secs(600);
        let steady = Duration::from_secs(300);
        let Lifecycle::Update(s, left) = lifecycle(&b, &[], t(1000), idle, steady, false) else {
            panic!()
        };
        assert_eq!(s.idle_since, Some(Time(t(1000))));
        assert_eq!(left, steady);
        let mut b2 = b.clone();
        b2.status = Some(*s);
        assert!(matches!(
            lifecycle(&b2, &[], t(1500), idle, steady, false),
            Lifecycle::Unchanged(d) if d == Duration::from_secs(100)
        ));
        let Lifecycle::Retire(s) = lifecycle(&b2, &[], t(1600), idle, steady, false) else {
            panic!()
        };
        assert_eq!(s.phase, Some(BindingPhase::Retiring));
        // A reference back clears idleSince.
        let r = RequestReference {
            namespace: "a".into(),
            name: "b".into(),
            uid: "u".into(),
        };
        let Lifecycle::Update(s, _) =
            lifecycle(&b2, std::slice::from_ref(&r), t(1500), idle, steady, false)
        else {
            panic!()
        };
        assert_eq!(s.idle_since, None);
        assert_eq!(s.request_references, vec![r.clone()]);
        // Deleted while referenced: Retiring (never joined again), nothing released.
        let Lifecycle::Update(s, _) =
            lifecycle(&b2, std::slice::from_ref(&r), t(99_999), idle, steady, true)
        else {
            panic!()
        };
        assert_eq!(s.phase, Some(BindingPhase::Retiring));
        // Deleted and unreferenced: released only past the idle period.
        let Lifecycle::Update(s, _) = lifecycle(&b, &[], t(1000), idle, steady, true) else {
            panic!()
        };
        assert_eq!(s.phase, Some(BindingPhase::Retiring));
        let mut b3 = b.clone();
        b3.status = Some(*s);
        assert!(matches!(
            lifecycle(&b3, &[], t(1599), idle, steady, true),
            Lifecycle::Unchanged(_)
        ));
        assert!(matches!(
            lifecycle(&b3, &[], t(1600), idle, steady, true),
            Lifecycle::Retire(_)
        ));
    }
}
