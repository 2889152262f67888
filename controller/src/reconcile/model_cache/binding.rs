//! The `ModelCacheBinding` lifecycle reconciler and the uninstall finalizer strip (spec 004
//! "Cache binding": "a binding with zero references past the idle period moves to Retiring,
//! the resources it names are deleted, and the finalizer is dropped. Nothing it does not name
//! is touched. Uninstall strips binding finalizers before deleting the control namespace, and
//! stops if it cannot"; "Object has foreign or missing ownership → never adopt or delete it";
//! "Configuration drift never authorizes data deletion").

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;

use ic_shared::crd::{
    annotations, binding_condition, binding_reason as reason, new_condition, set_condition,
    ConditionStatus, ModelCache, ModelCacheBinding, ReleaseSkip,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use super::decide::{lifecycle, live_references, ownership, Lifecycle, Ownership};
use super::render::Owner;
use super::{is_conflict, is_not_found, Context, Error};

/// Reconciles one binding's lifecycle: prune references whose request is gone, start or end
/// the idle period, retire after it, release what the binding names, write `Released`, drop
/// the finalizer and delete the binding. A binding being deleted is marked `Retiring` at once
/// (never joined again) but released only like any other: zero live references past the idle
/// period — a delete never releases what live requests use.
///
/// A release pass that keeps a named object (foreign, changed since read, or a volume that no
/// longer `Retain`s) writes `Released=False` with `status.releaseSkipped` and leaves the
/// binding in place for the operator (the finalizer goes only when every kept object is
/// foreign: an owned object still protected stays protected); the pass is retried.
///
/// Errors: any API error ([`Error::Kube`]) returns before further writes; deletions already
/// done stay done and the rest is retried (every step is idempotent).
pub async fn reconcile_binding(
    obj: Arc<ModelCacheBinding>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let cfg = &ctx.config;
    if !ctx.can_write() {
        return Ok(Action::requeue(cfg.steady_requeue));
    }
    let ns = obj
        .metadata
        .namespace
        .clone()
        .ok_or(Error::MissingMeta("namespace"))?;
    let name = obj
        .metadata
        .name
        .clone()
        .ok_or(Error::MissingMeta("name"))?;
    let api: Api<ModelCacheBinding> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(mut binding) = api.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    let deleting = binding.metadata.deletion_timestamp.is_some();
    let mut found = BTreeMap::new();
    for r in binding.references() {
        let requests: Api<ModelCache> = Api::namespaced(ctx.client.clone(), &r.namespace);
        found.insert(
            (r.namespace.clone(), r.name.clone()),
            requests.get_opt(&r.name).await?,
        );
    }
    let live = live_references(
        binding.references(),
        &found,
        binding.metadata.uid.as_deref().unwrap_or_default(),
    );
    let now = ctx.clock.now();
    match lifecycle(
        &binding,
        &live,
        now,
        cfg.idle_period,
        cfg.steady_requeue,
        deleting,
    ) {
        Lifecycle::Unchanged(after) => return Ok(Action::requeue(after.max(one_second()))),
        Lifecycle::Update(status, after) => {
            let mut next = binding.clone();
            next.status = Some(*status);
            api.replace_status(&name, &PostParams::default(), &next)
                .await?;
            return Ok(Action::requeue(after.max(one_second())));
        }
        Lifecycle::Retire(status) => {
            if binding.status.as_ref() != Some(&*status) {
                let mut next = binding.clone();
                next.status = Some(*status);
                binding = api
                    .replace_status(&name, &PostParams::default(), &next)
                    .await?;
            }
        }
    }
    let released = release(&ctx.client, &binding).await?;
    binding = record_release(&api, &ctx, binding, &released).await?;
    if !released.kept.is_empty() {
        let blocking = released
            .kept
            .iter()
            .any(|k| k.reason != reason::FOREIGN_OBJECT);
        if !blocking {
            // Only foreign objects are left: nothing owned needs protecting any more. The
            // binding stays (Retiring, never joined) with the list until they are gone.
            remove_finalizer(&api, &binding).await?;
        }
        // An object that changed between the ownership read and its delete (the PV binder
        // moving a reader PV from Bound to Released races every release on a real cluster) is
        // read again soon; anything else waits for the steady pass.
        if released
            .kept
            .iter()
            .all(|k| k.reason == reason::CHANGED_SINCE_READ)
        {
            tracing::info!(binding = %name, kept = ?released.kept, "release: objects changed since read; re-reading");
            return Ok(Action::requeue(cfg.pending_requeue));
        }
        tracing::warn!(binding = %name, kept = ?released.kept, "release kept named objects; retrying later");
        return Ok(Action::requeue(cfg.steady_requeue));
    }
    remove_finalizer(&api, &binding).await?;
    let uid = binding.metadata.uid.clone();
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&name, &dp).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) || is_conflict(&e) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Action::await_change())
}

fn one_second() -> std::time::Duration {
    std::time::Duration::from_secs(1)
}

/// Writes the `Released` condition and `status.releaseSkipped` (only when they change).
async fn record_release(
    api: &Api<ModelCacheBinding>,
    ctx: &Context,
    binding: ModelCacheBinding,
    released: &Released,
) -> Result<ModelCacheBinding, Error> {
    let mut next = binding.clone();
    let status = next.status.get_or_insert_with(Default::default);
    status.release_skipped.clone_from(&released.kept);
    let now = ctx.clock.now();
    let at = Time(Timestamp::from_second(now.as_second()).unwrap_or(now));
    let c = if released.kept.is_empty() {
        new_condition(
            binding_condition::RELEASED,
            ConditionStatus::True,
            reason::RELEASED,
            format!(
                "every object the binding names is deleted or was already gone ({} deletes \
                 accepted by this pass; claims and volumes may read Terminating until their \
                 protection finalizers clear)",
                released.deleted.len()
            ),
            binding.metadata.generation,
            at,
        )
    } else {
        let list: Vec<String> = released
            .kept
            .iter()
            .map(|k| format!("{} ({})", k.object, k.reason))
            .collect();
        new_condition(
            binding_condition::RELEASED,
            ConditionStatus::False,
            reason::OBJECTS_KEPT,
            format!(
                "kept {} named object(s): {}; a foreign object is never deleted (remove or rename it), a volume that no longer Retains is never deleted through its claim (set Retain), a changed object is read again",
                list.len(),
                list.join(", ")
            ),
            binding.metadata.generation,
            at,
        )
    };
    set_condition(&mut status.conditions, c);
    if next.status == binding.status {
        return Ok(binding);
    }
    let name = binding.metadata.name.clone().unwrap_or_default();
    Ok(api
        .replace_status(&name, &PostParams::default(), &next)
        .await?)
}

/// What [`release`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released {
    /// `Kind namespace/name` of every object deleted.
    pub deleted: Vec<String>,
    /// Named objects left alone, with why ([`ic_shared::crd::binding_reason`]).
    pub kept: Vec<ReleaseSkip>,
}

impl Released {
    fn keep(&mut self, object: &str, why: &str) {
        self.kept.push(ReleaseSkip {
            object: object.to_string(),
            reason: why.to_string(),
        });
    }
}

/// Deletes `obj` (read just before) with its UID and resourceVersion as preconditions, so a
/// replaced or re-labelled object is never deleted: the API server answers 409 and the object
/// is kept as [`binding_reason::CHANGED_SINCE_READ`] (read again on the next pass).
async fn delete_as_read<K>(
    api: &Api<K>,
    obj: &K,
    label: &str,
    out: &mut Released,
) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let meta = obj.meta();
    let name = meta.name.clone().unwrap_or_default();
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: meta.uid.clone(),
            resource_version: meta.resource_version.clone(),
        }),
        ..DeleteParams::background()
    };
    match api.delete(&name, &dp).await {
        Ok(_) => out.deleted.push(label.to_string()),
        Err(e) if is_not_found(&e) => {}
        Err(e) if is_conflict(&e) => {
            tracing::warn!(object = %label, "named object changed between the ownership read and the delete; kept");
            out.keep(label, reason::CHANGED_SINCE_READ);
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Reads a named object; `Some` only when it exists and is owned (a foreign one is recorded).
async fn read_owned<K>(
    api: &Api<K>,
    name: &str,
    label: &str,
    owner: Owner<'_>,
    out: &mut Released,
) -> Result<Option<K>, Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let Some(obj) = api.get_opt(name).await? else {
        return Ok(None);
    };
    if ownership(obj.meta(), owner.name, owner.uid) == Ownership::Foreign {
        tracing::warn!(object = %label, binding = owner.name, "named object is not owned by the binding; left alone");
        out.keep(label, reason::FOREIGN_OBJECT);
        return Ok(None);
    }
    Ok(Some(obj))
}

fn retains(pv: &PersistentVolume) -> bool {
    pv.spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
        == Some("Retain")
}

/// Deletes every object `binding` names (`spec.resources` ∪ `status.additionalResources`) that
/// still carries the binding's label and UID annotation: Jobs, claims, PVs, the Lease, Secrets,
/// StorageClasses, in that order. Each delete carries the UID and resourceVersion that were
/// read as preconditions. A claim is deleted only while its bound PV still has reclaim policy
/// `Retain` (re-read now), a PV only while it has; otherwise deleting would delete data.
/// Missing objects are skipped; kept ones are listed with why. Nothing unnamed is looked at.
pub async fn release(client: &Client, binding: &ModelCacheBinding) -> Result<Released, Error> {
    let owner = Owner::of(binding);
    let all = binding.all_resources();
    let mut out = Released::default();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    for j in &all.jobs {
        let api: Api<Job> = Api::namespaced(client.clone(), &j.namespace);
        let label = format!("Job {j}");
        if let Some(obj) = read_owned(&api, &j.name, &label, owner, &mut out).await? {
            delete_as_read(&api, &obj, &label, &mut out).await?;
        }
    }
    for c in &all.persistent_volume_claims {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &c.namespace);
        let label = format!("PersistentVolumeClaim {c}");
        let Some(claim) = read_owned(&api, &c.name, &label, owner, &mut out).await? else {
            continue;
        };
        let volume = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|v| !v.is_empty());
        if let Some(v) = volume {
            if let Some(pv) = pvs.get_opt(&v).await? {
                if !retains(&pv) {
                    tracing::warn!(object = %label, volume = %v, "the claim's volume no longer has reclaim policy Retain; the claim is kept so its data is not deleted");
                    out.keep(&label, reason::VOLUME_NOT_RETAINED);
                    continue;
                }
            }
        }
        delete_as_read(&api, &claim, &label, &mut out).await?;
    }
    for pv in &all.persistent_volumes {
        let label = format!("PersistentVolume {pv}");
        let Some(obj) = read_owned(&pvs, pv, &label, owner, &mut out).await? else {
            continue;
        };
        if !retains(&obj) {
            out.keep(&label, reason::VOLUME_NOT_RETAINED);
            continue;
        }
        delete_as_read(&pvs, &obj, &label, &mut out).await?;
    }
    if let Some(l) = &all.lease {
        let api: Api<Lease> = Api::namespaced(client.clone(), &l.namespace);
        let label = format!("Lease {l}");
        if let Some(obj) = read_owned(&api, &l.name, &label, owner, &mut out).await? {
            delete_as_read(&api, &obj, &label, &mut out).await?;
        }
    }
    for s in &all.secrets {
        let api: Api<Secret> = Api::namespaced(client.clone(), &s.namespace);
        let label = format!("Secret {s}");
        if let Some(obj) = read_owned(&api, &s.name, &label, owner, &mut out).await? {
            delete_as_read(&api, &obj, &label, &mut out).await?;
        }
    }
    for sc in &all.storage_classes {
        let api: Api<StorageClass> = Api::all(client.clone());
        let label = format!("StorageClass {sc}");
        if let Some(obj) = read_owned(&api, sc, &label, owner, &mut out).await? {
            delete_as_read(&api, &obj, &label, &mut out).await?;
        }
    }
    Ok(out)
}

/// How often a finalizer removal is retried after a 409 (the binding changed since read).
const FINALIZER_ATTEMPTS: usize = 5;

/// Removes [`annotations::BINDING_FINALIZER`] from the binding, keeping every other finalizer.
/// The merge patch carries the read `resourceVersion`, so a concurrent change (another
/// finalizer added, the binding replaced) fails with 409 instead of being overwritten; the
/// binding is then read again and the removal retried. `Ok(true)` when this call removed it.
pub(crate) async fn remove_finalizer(
    api: &Api<ModelCacheBinding>,
    binding: &ModelCacheBinding,
) -> Result<bool, kube::Error> {
    let name = binding.metadata.name.clone().unwrap_or_default();
    let mut current = binding.clone();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let finalizers = current.metadata.finalizers.clone().unwrap_or_default();
        if !finalizers
            .iter()
            .any(|f| f == annotations::BINDING_FINALIZER)
        {
            return Ok(false);
        }
        let kept: Vec<String> = finalizers
            .into_iter()
            .filter(|f| f != annotations::BINDING_FINALIZER)
            .collect();
        let patch = json!({"metadata": {
            "finalizers": kept,
            "resourceVersion": current.metadata.resource_version,
        }});
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(e) if is_not_found(&e) => return Ok(false),
            Err(e) if is_conflict(&e) && attempt < FINALIZER_ATTEMPTS => {
                match api.get_opt(&name).await? {
                    Some(b) if b.metadata.uid == binding.metadata.uid => current = b,
                    // Gone, or another binding under the name: not ours to touch.
                    _ => return Ok(false),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Name of the ConfigMap, in the control namespace, that marks an uninstall in progress: while
/// it exists the controller creates no binding (and strips the finalizer of one it created
/// concurrently), so no finalizer appears after the uninstall hook stripped them.
pub const UNINSTALL_MARKER: &str = "inference-cache-model-cache-uninstalling";

/// True when the uninstall marker exists in `namespace`.
///
/// Errors: any API error other than 404.
pub async fn uninstalling(client: &Client, namespace: &str) -> Result<bool, kube::Error> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    Ok(cms.get_opt(UNINSTALL_MARKER).await?.is_some())
}

/// How many list-and-strip rounds uninstall makes before it gives up on a controller that keeps
/// creating bindings.
const STRIP_ROUNDS: usize = 5;

/// Uninstall: stops new bindings, then removes the binding finalizer from every
/// `ModelCacheBinding` in `namespace` (the control namespace) so that deleting the namespace
/// cannot hang Terminating. Steps: (1) create the [`UNINSTALL_MARKER`] ConfigMap (the
/// controller creates no binding while it exists); (2) list and strip, each removal carrying
/// the read resourceVersion (409 → read again, retry); (3) list again until a round strips
/// nothing, which catches a binding created by a reconcile that read "no marker" just before
/// step 1. A missing CRD or namespace (404) means there is nothing to strip. Owned objects are
/// left as they are (volumes use `Retain`: uninstall never deletes data). Returns how many
/// finalizers were removed.
///
/// Errors: the first failure stops the strip ([`Error::Kube`] when the marker or list fails,
/// [`Error::StripFinalizer`] naming the binding otherwise, also when bindings still appear after
/// the last round); the caller must then **not** delete the namespace, and can retry.
pub async fn strip_binding_finalizers(client: &Client, namespace: &str) -> Result<usize, Error> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let marker: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": UNINSTALL_MARKER, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": super::render::MANAGED_BY}},
        "data": {"reason": "helm uninstall: no new ModelCacheBinding is created while this exists"}
    }))?;
    match cms.create(&PostParams::default(), &marker).await {
        Ok(_) => {}
        Err(e) if is_conflict(&e) => {}
        // No control namespace: no binding can exist.
        Err(e) if is_not_found(&e) => return Ok(0),
        Err(e) => return Err(e.into()),
    }
    let api: Api<ModelCacheBinding> = Api::namespaced(client.clone(), namespace);
    let mut stripped = 0;
    for _ in 0..STRIP_ROUNDS {
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            // The CRD is gone (or was never installed): nothing to strip.
            Err(e) if is_not_found(&e) => return Ok(stripped),
            Err(e) => return Err(e.into()),
        };
        let mut this_round = 0;
        for b in &list.items {
            let name = b.metadata.name.clone().unwrap_or_default();
            match remove_finalizer(&api, b).await {
                Ok(true) => this_round += 1,
                Ok(false) => {}
                Err(source) => return Err(Error::StripFinalizer { name, source }),
            }
        }
        stripped += this_round;
        if this_round == 0 {
            return Ok(stripped);
        }
    }
    Err(Error::StillCreating {
        rounds: STRIP_ROUNDS,
    })
}
