//! The `ModelCacheBinding` lifecycle reconciler and the uninstall finalizer strip (spec 004
//! "Cache binding": "a binding with zero references past the idle period moves to Retiring,
//! the resources it names are deleted, and the finalizer is dropped. Nothing it does not name
//! is touched. Uninstall strips binding finalizers before deleting the control namespace, and
//! stops if it cannot").

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;

use ic_shared::crd::{annotations, BindingPhase, ModelCache, ModelCacheBinding};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use super::decide::{lifecycle, live_references, ownership, Lifecycle, Ownership};
use super::render::Owner;
use super::{is_not_found, Context, Error};

/// Reconciles one binding's lifecycle: prune references whose request is gone, start or end
/// the idle period, retire after it, release what the binding names, drop the finalizer and
/// delete the binding. A binding being deleted retires the same way.
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
    if binding.phase() == BindingPhase::Active {
        if deleting {
            let mut next = binding.clone();
            next.status.get_or_insert_with(Default::default).phase = Some(BindingPhase::Retiring);
            binding = api
                .replace_status(&name, &PostParams::default(), &next)
                .await?;
        } else {
            let mut found = BTreeMap::new();
            for r in binding.references() {
                let requests: Api<ModelCache> = Api::namespaced(ctx.client.clone(), &r.namespace);
                found.insert(
                    (r.namespace.clone(), r.name.clone()),
                    requests.get_opt(&r.name).await?,
                );
            }
            let live = live_references(binding.references(), &found);
            let now = ctx.clock.now();
            match lifecycle(&binding, &live, now, cfg.idle_period, cfg.steady_requeue) {
                Lifecycle::Unchanged(after) => return Ok(Action::requeue(after.max(one_second()))),
                Lifecycle::Update(status, after) => {
                    let mut next = binding.clone();
                    next.status = Some(*status);
                    api.replace_status(&name, &PostParams::default(), &next)
                        .await?;
                    return Ok(Action::requeue(after.max(one_second())));
                }
                Lifecycle::Retire(status) => {
                    let mut next = binding.clone();
                    next.status = Some(*status);
                    binding = api
                        .replace_status(&name, &PostParams::default(), &next)
                        .await?;
                }
            }
        }
    }
    release(&ctx.client, &binding).await?;
    remove_finalizer(&api, &binding).await?;
    match api.delete(&name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Action::await_change())
}

fn one_second() -> std::time::Duration {
    std::time::Duration::from_secs(1)
}

/// What [`release`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released {
    /// `Kind namespace/name` of every object deleted.
    pub deleted: Vec<String>,
    /// `Kind namespace/name` of named objects left alone because they are not owned.
    pub foreign: Vec<String>,
}

async fn release_one<K>(
    api: Api<K>,
    kind: &str,
    where_: &str,
    name: &str,
    owner: Owner<'_>,
    out: &mut Released,
) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let label = format!("{kind} {where_}{name}");
    let Some(obj) = api.get_opt(name).await? else {
        return Ok(());
    };
    if ownership(obj.meta(), owner.name, owner.uid) == Ownership::Foreign {
        tracing::warn!(object = %label, binding = owner.name, "named object is not owned by the binding; left alone");
        out.foreign.push(label);
        return Ok(());
    }
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => out.deleted.push(label),
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Deletes every object `binding` names (`spec.resources` ∪ `status.additionalResources`) that
/// still carries the binding's label and UID annotation: Jobs, claims, PVs, the Lease, Secrets,
/// StorageClasses, in that order. Missing objects are skipped; foreign ones are left alone and
/// listed. Nothing unnamed is looked at.
pub async fn release(client: &Client, binding: &ModelCacheBinding) -> Result<Released, Error> {
    let owner = Owner::of(binding);
    let all = binding.all_resources();
    let mut out = Released::default();
    for j in &all.jobs {
        let api: Api<Job> = Api::namespaced(client.clone(), &j.namespace);
        release_one(
            api,
            "Job",
            &format!("{}/", j.namespace),
            &j.name,
            owner,
            &mut out,
        )
        .await?;
    }
    for c in &all.persistent_volume_claims {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &c.namespace);
        let ns = format!("{}/", c.namespace);
        release_one(api, "PersistentVolumeClaim", &ns, &c.name, owner, &mut out).await?;
    }
    for pv in &all.persistent_volumes {
        let api: Api<PersistentVolume> = Api::all(client.clone());
        release_one(api, "PersistentVolume", "", pv, owner, &mut out).await?;
    }
    if let Some(l) = &all.lease {
        let api: Api<Lease> = Api::namespaced(client.clone(), &l.namespace);
        release_one(
            api,
            "Lease",
            &format!("{}/", l.namespace),
            &l.name,
            owner,
            &mut out,
        )
        .await?;
    }
    for s in &all.secrets {
        let api: Api<Secret> = Api::namespaced(client.clone(), &s.namespace);
        release_one(
            api,
            "Secret",
            &format!("{}/", s.namespace),
            &s.name,
            owner,
            &mut out,
        )
        .await?;
    }
    for sc in &all.storage_classes {
        let api: Api<StorageClass> = Api::all(client.clone());
        release_one(api, "StorageClass", "", sc, owner, &mut out).await?;
    }
    Ok(out)
}

async fn remove_finalizer(
    api: &Api<ModelCacheBinding>,
    binding: &ModelCacheBinding,
) -> Result<bool, kube::Error> {
    let current = binding.metadata.finalizers.clone().unwrap_or_default();
    if !current.iter().any(|f| f == annotations::BINDING_FINALIZER) {
        return Ok(false);
    }
    let kept: Vec<String> = current
        .into_iter()
        .filter(|f| f != annotations::BINDING_FINALIZER)
        .collect();
    let name = binding.metadata.name.clone().unwrap_or_default();
    match api
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": kept}})),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Uninstall: removes the binding finalizer from every `ModelCacheBinding` in `namespace`
/// (the control namespace) so that deleting the namespace cannot hang Terminating. Owned
/// objects are left as they are (reader and writer PVs use `Retain`: data is never deleted by
/// uninstall). Returns how many finalizers were removed.
///
/// Errors: the first failure stops the strip ([`Error::Kube`] when the list fails,
/// [`Error::StripFinalizer`] naming the binding otherwise); the caller must then **not** delete
/// the namespace, and can retry.
pub async fn strip_binding_finalizers(client: &Client, namespace: &str) -> Result<usize, Error> {
    let api: Api<ModelCacheBinding> = Api::namespaced(client.clone(), namespace);
    let list = api.list(&ListParams::default()).await?;
    let mut stripped = 0;
    for b in &list.items {
        let name = b.metadata.name.clone().unwrap_or_default();
        match remove_finalizer(&api, b).await {
            Ok(true) => stripped += 1,
            Ok(false) => {}
            Err(source) => return Err(Error::StripFinalizer { name, source }),
        }
    }
    Ok(stripped)
}
