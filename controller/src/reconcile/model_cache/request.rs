//! The `ModelCache` reconciler: the spec's runtime flow steps 1–6 for one request (see the
//! module docs of [`super`]). Reads, calls [`super::decide`] / [`super::render`], writes. Every
//! API error returns at once (the runtime requeues): a pass never writes a decision it did not
//! finish reading for.

use std::sync::Arc;

use ic_shared::crd::{
    annotations, model_cache_condition as ctype, model_cache_reason as reason, new_condition,
    set_condition, BindingRef, CacheMode, ConditionStatus, ModelCache, ModelCacheBinding,
    ModelCacheStatus, RequestReference,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::Resource;
use serde_json::json;

use super::decide::{
    add_reference, check_bound, check_drift, choose_binding, class_view, gate, lease_step,
    ownership, select, Choice, LeaseStep, NonDurable, Ownership, Selected,
};
use super::names::{
    binding_name, identity_for, identity_label, initial_resources, missing_reader_resources,
    reader_claim, reader_pv, writer_name, writer_namespace,
};
use super::render::{self, Owner};
use super::{is_conflict, Context, Error};
use crate::catalog::Catalog;

/// Reconciles one `ModelCache` (spec 004 "Runtime flow"). Re-reads the request, then:
/// recorded `none`/`ephemeral` → nothing; recorded binding → check it and run the flow;
/// otherwise steps 1–4 and then the flow. Returns when to look again.
///
/// Errors: any API error other than the expected 404s ([`Error::Kube`]); state is unchanged
/// past the last successful write, and every write is idempotent on the next pass.
pub async fn reconcile_request(obj: Arc<ModelCache>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !ctx.can_write() {
        return Ok(Action::requeue(ctx.config.steady_requeue));
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
    let api: Api<ModelCache> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(mc) = api.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    if mc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let status = mc.status.clone().unwrap_or_default();
    let mut pass = Pass {
        ctx: &ctx,
        api,
        written: status.clone(),
        status,
        mc,
        ns,
        name,
    };
    pass.run().await
}

/// SHA-256 (hex) of a request's `spec.writer.template` as compact JSON
/// (`status.writerTemplateDigest`; object keys in the order `serde_json::Value` keeps them, the
/// same for every read of one stored object).
pub fn writer_template_digest(mc: &ModelCache) -> String {
    crate::catalog::sha256_hex(mc.spec.writer.template.to_string().as_bytes())
}

/// Why the flow cannot go on this pass.
struct Hold {
    reason: &'static str,
    message: String,
    requeue: std::time::Duration,
}

enum Writer {
    Done(String),
    Hold(Hold),
}

struct Pass<'a> {
    ctx: &'a Context,
    api: Api<ModelCache>,
    mc: ModelCache,
    status: ModelCacheStatus,
    written: ModelCacheStatus,
    ns: String,
    name: String,
}

impl Pass<'_> {
    fn now(&self) -> Timestamp {
        self.ctx.clock.now()
    }

    fn now_time(&self) -> Time {
        let now = self.now();
        Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
    }

    fn uid(&self) -> String {
        self.mc.metadata.uid.clone().unwrap_or_default()
    }

    fn set(
        &mut self,
        type_: &str,
        status: ConditionStatus,
        reason: &str,
        message: impl Into<String>,
    ) {
        let c = new_condition(
            type_,
            status,
            reason,
            message,
            self.mc.metadata.generation,
            self.now_time(),
        );
        set_condition(&mut self.status.conditions, c);
    }

    async fn flush(&mut self) -> Result<(), Error> {
        self.status.observed_generation = self.mc.metadata.generation;
        if self.status == self.written {
            return Ok(());
        }
        self.api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": self.status })),
            )
            .await?;
        self.written = self.status.clone();
        Ok(())
    }

    async fn hold(&mut self, h: Hold) -> Result<Action, Error> {
        self.set(ctype::READY, ConditionStatus::False, h.reason, h.message);
        self.flush().await?;
        Ok(Action::requeue(h.requeue))
    }

    fn bindings(&self) -> Api<ModelCacheBinding> {
        Api::namespaced(self.ctx.client.clone(), &self.ctx.config.control_namespace)
    }

    async fn run(&mut self) -> Result<Action, Error> {
        // The API server cannot enforce immutability inside spec.writer.template: the template
        // as first read is recorded before any side effect and compared on every pass.
        let digest = writer_template_digest(&self.mc);
        match self.status.writer_template_digest.clone() {
            None => {
                self.status.writer_template_digest = Some(digest);
                // A new request writes it with its first status write (before any side
                // effect); one recorded before the digest existed writes it now.
                if self.status.mode.is_some() || self.status.binding.is_some() {
                    self.flush().await?;
                }
            }
            Some(recorded) if recorded != digest => {
                self.set(
                    ctype::READY,
                    ConditionStatus::False,
                    reason::SPEC_CHANGED,
                    format!(
                        "spec.writer.template changed after it was recorded (sha256 {recorded}, now {digest}); spec is immutable; nothing is provisioned from the changed spec — recreate the ModelCache"
                    ),
                );
                self.flush().await?;
                return Ok(Action::await_change());
            }
            Some(_) => {}
        }
        match self.status.mode {
            Some(CacheMode::None) | Some(CacheMode::Ephemeral) => {
                let mode = self.status.mode.map(|m| m.as_str()).unwrap_or_default();
                self.set(
                    ctype::READY,
                    ConditionStatus::True,
                    reason::NOTHING_TO_PROVISION,
                    format!("mode {mode}: no shared volume is provisioned"),
                );
                self.flush().await?;
                return Ok(Action::await_change());
            }
            Some(CacheMode::Durable) => return self.bound().await,
            None if self.status.binding.is_some() => return self.bound().await,
            None => {}
        }
        // Step 4 added this request's reference to a binding, and the status write that
        // records it here failed: that binding is this request's whatever the gates, the class
        // or the catalog say now (step 6), so the pass finishes step 4 with it rather than
        // deciding again (a fresh decision would end `none` or ConfigurationDrifted while the
        // binding kept the reference and never idled).
        if let Some(held) = self.held_binding().await? {
            let bindings = self.bindings();
            let binding = self.ensure_reference(&bindings, held).await?;
            return self.record_binding(binding).await;
        }
        let ctx = self.ctx;
        let cfg = &ctx.config;
        // Step 1: gates.
        if let Some(nd) = gate(&cfg.flags, &self.mc) {
            return self.record_non_durable(nd).await;
        }
        // Step 2: class, catalog, flow.
        let classes: Api<StorageClass> = Api::all(self.ctx.client.clone());
        let class = classes.get_opt(&cfg.storage_class).await?;
        let catalog = match self.load_catalog().await? {
            Ok(c) => c,
            Err(message) => {
                self.set(
                    ctype::SELECTED,
                    ConditionStatus::False,
                    reason::CATALOG_INVALID,
                    message.clone(),
                );
                let requeue = cfg.pending_requeue * 4;
                return self
                    .hold(Hold {
                        reason: reason::CATALOG_INVALID,
                        message,
                        requeue,
                    })
                    .await;
            }
        };
        let view = class.as_ref().map(class_view);
        let selected = select(
            view.as_ref(),
            &cfg.storage_class,
            &catalog,
            self.mc.spec.workflow,
            &cfg.flags,
        );
        if let Some(recorded) = self.status.selection.clone() {
            if let Err(message) = check_drift(&recorded, &selected) {
                let requeue = cfg.pending_requeue * 4;
                return self
                    .hold(Hold {
                        reason: reason::CONFIGURATION_DRIFTED,
                        message,
                        requeue,
                    })
                    .await;
            }
        }
        let durable = match selected {
            Selected::NoFlow(nd) => return self.record_non_durable(nd).await,
            Selected::Durable(d) => *d,
        };
        if self.status.selection.is_none() {
            self.status.selection = Some(durable.selection.clone());
            self.set(
                ctype::SELECTED,
                ConditionStatus::True,
                reason::DURABLE_FLOW_SELECTED,
                format!(
                    "provisioner {} on StorageClass {}: flow {}",
                    durable.decision.provisioner,
                    durable.class.name,
                    durable.decision.flow.as_str()
                ),
            );
            self.flush().await?;
        }
        // Step 3: get or create the binding.
        let bindings = self.bindings();
        let identity = identity_for(&self.mc);
        let lp = ListParams::default().labels(&format!(
            "{}={}",
            annotations::IDENTITY_LABEL,
            identity_label(&identity)
        ));
        let existing = bindings.list(&lp).await?.items;
        let binding = match choose_binding(&existing, &identity) {
            Choice::Join(b) => *b,
            Choice::Create { generation } => {
                // Uninstall strips finalizers: never add one after it began.
                if let Some(h) = self.uninstall_hold().await? {
                    return self.hold(h).await;
                }
                let bname = binding_name(&identity, generation);
                let writer_ns =
                    writer_namespace(self.mc.spec.workflow, &self.ns, &cfg.control_namespace);
                let resources = initial_resources(
                    &bname,
                    &writer_ns,
                    &cfg.control_namespace,
                    &self.mc.reader_namespaces(),
                    durable.decision.encrypted,
                );
                let obj = render::new_binding(
                    &bname,
                    &cfg.control_namespace,
                    identity,
                    durable.decision,
                    durable.class,
                    resources,
                );
                let created = bindings.create(&PostParams::default(), &obj).await?;
                // The marker may have appeared after the check above, and the uninstall's
                // last list may predate this create: then the marker is visible now, and the
                // finalizer this create added is removed here.
                if let Some(h) = self.uninstall_hold().await? {
                    super::binding::remove_finalizer(&bindings, &created).await?;
                    return self.hold(h).await;
                }
                created
            }
        };
        // Step 4: reference on the binding, then binding name + UID on the request.
        let binding = self.ensure_reference(&bindings, binding).await?;
        self.record_binding(binding).await
    }

    /// The `Active` binding of this request's identity that already holds its reference
    /// (request UID): left by a pass whose `status.binding` write failed after step 4. `None`
    /// when there is none (a binding being deleted or `Retiring` is never joined; the
    /// reference it holds is released once the request records another binding, see
    /// [`super::decide::live_references`]).
    async fn held_binding(&self) -> Result<Option<ModelCacheBinding>, Error> {
        let uid = self.uid();
        let identity = identity_for(&self.mc);
        let lp = ListParams::default().labels(&format!(
            "{}={}",
            annotations::IDENTITY_LABEL,
            identity_label(&identity)
        ));
        let existing = self.bindings().list(&lp).await?.items;
        Ok(existing.into_iter().find(|b| {
            b.spec.identity == identity
                && b.phase() == ic_shared::crd::BindingPhase::Active
                && b.metadata.deletion_timestamp.is_none()
                && b.references().iter().any(|r| r.uid == uid)
        }))
    }

    /// Step 4's second half: records `binding` (which holds this request's reference) on the
    /// request (`status.binding`, mode `durable`, reader claim), then runs the flow.
    async fn record_binding(&mut self, binding: ModelCacheBinding) -> Result<Action, Error> {
        let bname = binding
            .metadata
            .name
            .clone()
            .ok_or(Error::MissingMeta("binding name"))?;
        let buid = binding
            .metadata
            .uid
            .clone()
            .ok_or(Error::MissingMeta("binding uid"))?;
        self.status.binding = Some(BindingRef {
            name: bname.clone(),
            uid: buid,
        });
        self.status.mode = Some(CacheMode::Durable);
        self.status.reader_claim = Some(reader_claim(&bname));
        self.set(
            ctype::SELECTED,
            ConditionStatus::True,
            reason::DURABLE_FLOW_SELECTED,
            format!(
                "bound to ModelCacheBinding {}/{bname} (flow {}, provisioner {})",
                self.ctx.config.control_namespace,
                binding.spec.decision.flow.as_str(),
                binding.spec.decision.provisioner
            ),
        );
        self.flush().await?;
        // Steps 5-6 read only the binding.
        self.flow(binding).await
    }

    async fn record_non_durable(&mut self, nd: NonDurable) -> Result<Action, Error> {
        self.status.mode = Some(nd.mode);
        self.set(
            ctype::SELECTED,
            ConditionStatus::True,
            nd.reason,
            nd.message,
        );
        self.set(
            ctype::READY,
            ConditionStatus::True,
            reason::NOTHING_TO_PROVISION,
            format!("mode {}: no shared volume is provisioned", nd.mode.as_str()),
        );
        self.flush().await?;
        Ok(Action::await_change())
    }

    /// `Some` while an uninstall is in progress ([`super::UNINSTALL_MARKER`] exists).
    async fn uninstall_hold(&self) -> Result<Option<Hold>, Error> {
        let cfg = &self.ctx.config;
        if !super::uninstalling(&self.ctx.client, &cfg.control_namespace).await? {
            return Ok(None);
        }
        Ok(Some(Hold {
            reason: reason::UNINSTALLING,
            message: format!(
                "an uninstall is in progress (ConfigMap {}/{} exists): no new ModelCacheBinding is created",
                cfg.control_namespace,
                super::UNINSTALL_MARKER
            ),
            requeue: cfg.steady_requeue,
        }))
    }

    /// `Ok(Err(message))` when the ConfigMap is missing or the catalog invalid.
    async fn load_catalog(&self) -> Result<Result<Catalog, String>, Error> {
        let ctx = self.ctx;
        let cfg = &ctx.config;
        let cms: Api<ConfigMap> = Api::namespaced(self.ctx.client.clone(), &cfg.catalog_namespace);
        Ok(match cms.get_opt(&cfg.catalog_config_map).await? {
            None => Err(format!(
                "catalog ConfigMap {}/{} does not exist",
                cfg.catalog_namespace, cfg.catalog_config_map
            )),
            Some(cm) => Catalog::from_config_map(&cm, &cfg.catalog_key).map_err(|e| e.to_string()),
        })
    }

    /// Adds this request's reference (and the names of reader objects of its namespaces) to an
    /// `Active` binding, with the binding's resourceVersion: a concurrent change (e.g. the
    /// binding retiring) fails with 409 and the pass is retried.
    async fn ensure_reference(
        &self,
        bindings: &Api<ModelCacheBinding>,
        binding: ModelCacheBinding,
    ) -> Result<ModelCacheBinding, Error> {
        let reference = RequestReference {
            namespace: self.ns.clone(),
            name: self.name.clone(),
            uid: self.uid(),
        };
        let extra = missing_reader_resources(&binding, &self.mc.reader_namespaces());
        match add_reference(binding.status.as_ref(), &reference, &extra) {
            None => Ok(binding),
            Some(status) => {
                let bname = binding
                    .metadata
                    .name
                    .clone()
                    .ok_or(Error::MissingMeta("binding name"))?;
                let mut next = binding;
                next.status = Some(status);
                let out = bindings
                    .replace_status(&bname, &PostParams::default(), &next)
                    .await?;
                Ok(out)
            }
        }
    }

    /// A request with a recorded binding: check it (never rebind), then run the flow.
    async fn bound(&mut self) -> Result<Action, Error> {
        let Some(recorded) = self.status.binding.clone() else {
            return Ok(Action::await_change());
        };
        let bindings = self.bindings();
        let binding = bindings.get_opt(&recorded.name).await?;
        let check = check_bound(binding.as_ref(), &recorded, &self.uid());
        if let Some(why) = check.reason() {
            let message = format!(
                "ModelCacheBinding {}/{} (uid {}): {why}; a request is never rebound — recreate the ModelCache",
                self.ctx.config.control_namespace, recorded.name, recorded.uid
            );
            self.set(ctype::READY, ConditionStatus::False, why, message);
            self.flush().await?;
            return Ok(Action::await_change());
        }
        let Some(binding) = binding else {
            return Ok(Action::await_change());
        };
        let binding = self.ensure_reference(&bindings, binding).await?;
        self.flow(binding).await
    }

    /// Step 5 from the binding's recorded decision only.
    async fn flow(&mut self, binding: ModelCacheBinding) -> Result<Action, Error> {
        let binding = if binding
            .status
            .as_ref()
            .and_then(|s| s.writer_volume_name.as_ref())
            .is_none()
        {
            match self.writer(&binding).await? {
                Writer::Hold(h) => return self.hold(h).await,
                Writer::Done(volume) => {
                    let bname = binding
                        .metadata
                        .name
                        .clone()
                        .ok_or(Error::MissingMeta("binding name"))?;
                    let mut next = binding;
                    next.status
                        .get_or_insert_with(Default::default)
                        .writer_volume_name = Some(volume);
                    self.bindings()
                        .replace_status(&bname, &PostParams::default(), &next)
                        .await?
                }
            }
        } else {
            binding
        };
        match self.readers(&binding).await? {
            Some(h) => self.hold(h).await,
            None => {
                let bname = binding.metadata.name.clone().unwrap_or_default();
                self.status.reader_claim = Some(reader_claim(&bname));
                self.status.reader_namespaces = self.mc.reader_namespaces();
                let message = format!(
                    "reader claim {} is bound read-only in {}",
                    reader_claim(&bname),
                    self.status.reader_namespaces.join(", ")
                );
                self.set(
                    ctype::READY,
                    ConditionStatus::True,
                    reason::READERS_READY,
                    message,
                );
                self.flush().await?;
                Ok(Action::requeue(self.ctx.config.steady_requeue))
            }
        }
    }

    fn foreign(&self, what: &str) -> Hold {
        Hold {
            reason: reason::FOREIGN_OBJECT,
            message: format!(
                "{what} exists but is not owned by this cache's binding; it is never adopted — remove or rename it"
            ),
            requeue: self.ctx.config.pending_requeue * 4,
        }
    }

    fn class_changed(
        &self,
        binding: &ModelCacheBinding,
        now: Option<&StorageClass>,
    ) -> Option<Hold> {
        let rec = &binding.spec.storage_class;
        let uid = now.and_then(|c| c.metadata.uid.clone());
        if uid.as_deref() == Some(rec.uid.as_str()) {
            return None;
        }
        Some(Hold {
            reason: reason::STORAGE_CLASS_CHANGED,
            message: format!(
                "StorageClass {} (uid {}) recorded by the binding is {}; the binding stays authoritative and nothing is provisioned from another class",
                rec.name,
                rec.uid,
                match uid {
                    Some(u) => format!("now uid {u}"),
                    None => "gone".to_string(),
                }
            ),
            requeue: self.ctx.config.pending_requeue * 4,
        })
    }

    /// The writer: election, (encryption objects,) claim and Job; done when the Job succeeded
    /// and the claim is bound.
    async fn writer(&mut self, binding: &ModelCacheBinding) -> Result<Writer, Error> {
        let ctx = self.ctx;
        let cfg = &ctx.config;
        let client = self.ctx.client.clone();
        let owner = Owner::of(binding);
        let bname = owner.name.to_string();
        let wname = writer_name(&bname);
        let writer_ns = binding
            .spec
            .resources
            .jobs
            .first()
            .map(|j| j.namespace.clone())
            .unwrap_or_else(|| {
                writer_namespace(self.mc.spec.workflow, &self.ns, &cfg.control_namespace)
            });
        let jobs: Api<Job> = Api::namespaced(client.clone(), &writer_ns);
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &writer_ns);
        let mut job = jobs.get_opt(&wname).await?;
        if let Some(j) = &job {
            if ownership(&j.metadata, owner.name, owner.uid) == Ownership::Foreign {
                return Ok(Writer::Hold(
                    self.foreign(&format!("Job {writer_ns}/{wname}")),
                ));
            }
        }
        if job.is_none() {
            let lease_ref = binding.spec.resources.lease.clone().unwrap_or_else(|| {
                ic_shared::crd::NamespacedName::new(cfg.control_namespace.clone(), wname.clone())
            });
            let leases: Api<Lease> = Api::namespaced(client.clone(), &lease_ref.namespace);
            let lease = leases.get_opt(&lease_ref.name).await?;
            if let Some(l) = &lease {
                if ownership(&l.metadata, owner.name, owner.uid) == Ownership::Foreign {
                    return Ok(Writer::Hold(self.foreign(&format!(
                        "Lease {}/{}",
                        lease_ref.namespace, lease_ref.name
                    ))));
                }
            }
            let me = self.uid();
            let secs = i32::try_from(cfg.writer_lease_duration.as_secs()).unwrap_or(i32::MAX);
            match lease_step(lease.as_ref(), &me, false, self.now()) {
                LeaseStep::Hold => {}
                LeaseStep::Create => {
                    let l = render::writer_lease(
                        &lease_ref.name,
                        &lease_ref.namespace,
                        owner,
                        &me,
                        secs,
                        self.now(),
                    );
                    leases.create(&PostParams::default(), &l).await?;
                }
                LeaseStep::TakeOver => {
                    let mut l = render::writer_lease(
                        &lease_ref.name,
                        &lease_ref.namespace,
                        owner,
                        &me,
                        secs,
                        self.now(),
                    );
                    let old = lease.as_ref().map(|o| o.meta().clone()).unwrap_or_default();
                    l.metadata.resource_version = old.resource_version;
                    if let Some(spec) = l.spec.as_mut() {
                        let prior = lease
                            .as_ref()
                            .and_then(|o| o.spec.as_ref())
                            .and_then(|s| s.lease_transitions)
                            .unwrap_or(0);
                        spec.lease_transitions = Some(prior.saturating_add(1));
                    }
                    leases
                        .replace(&lease_ref.name, &PostParams::default(), &l)
                        .await?;
                }
                LeaseStep::Wait { holder } => {
                    return Ok(Writer::Hold(Hold {
                        reason: reason::WRITER_ELECTED_ELSEWHERE,
                        message: format!(
                            "the writer Lease {}/{} is held by request uid {holder}; waiting for its writer Job",
                            lease_ref.namespace, lease_ref.name
                        ),
                        requeue: cfg.pending_requeue,
                    }))
                }
            }
            // This request is the elected writer.
            let class_name = if binding.spec.decision.encrypted {
                match self.ensure_encryption(binding).await? {
                    Ok(name) => name,
                    Err(h) => return Ok(Writer::Hold(h)),
                }
            } else {
                binding.spec.storage_class.name.clone()
            };
            match claims.get_opt(&wname).await? {
                Some(c) => {
                    if ownership(&c.metadata, owner.name, owner.uid) == Ownership::Foreign {
                        return Ok(Writer::Hold(
                            self.foreign(&format!("PersistentVolumeClaim {writer_ns}/{wname}")),
                        ));
                    }
                }
                None => {
                    let classes: Api<StorageClass> = Api::all(client.clone());
                    let base = classes.get_opt(&binding.spec.storage_class.name).await?;
                    if let Some(h) = self.class_changed(binding, base.as_ref()) {
                        return Ok(Writer::Hold(h));
                    }
                    let claim = render::writer_claim(
                        &wname,
                        &writer_ns,
                        owner,
                        &binding.spec.decision,
                        self.mc.spec.size.clone(),
                        &class_name,
                    );
                    claims.create(&PostParams::default(), &claim).await?;
                }
            }
            let sa =
                (writer_ns == cfg.control_namespace).then_some(cfg.writer_service_account.as_str());
            let rendered = match render::writer_job(&wname, &writer_ns, owner, &self.mc, &wname, sa)
            {
                Ok(j) => j,
                Err(e) => {
                    return Ok(Writer::Hold(Hold {
                        reason: reason::WRITER_TEMPLATE_INVALID,
                        message: e.to_string(),
                        requeue: cfg.steady_requeue,
                    }))
                }
            };
            job = Some(jobs.create(&PostParams::default(), &rendered).await?);
        }
        let Some(job) = job else {
            return Ok(Writer::Hold(Hold {
                reason: reason::WRITER_RUNNING,
                message: "waiting for the writer Job".to_string(),
                requeue: cfg.pending_requeue,
            }));
        };
        let js = job.status.clone().unwrap_or_default();
        let cond = |t: &str| {
            js.conditions
                .as_ref()
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == t && c.status == "True"))
        };
        if cond("Failed") {
            return Ok(Writer::Hold(Hold {
                reason: reason::WRITER_FAILED,
                message: format!(
                    "writer Job {writer_ns}/{wname} failed; fix the writer template and recreate the ModelCache, or delete the Job to retry"
                ),
                requeue: cfg.steady_requeue,
            }));
        }
        if !(cond("Complete") || js.succeeded.unwrap_or(0) >= 1) {
            return Ok(Writer::Hold(Hold {
                reason: reason::WRITER_RUNNING,
                message: format!("writer Job {writer_ns}/{wname} is filling the volume"),
                requeue: cfg.pending_requeue,
            }));
        }
        let claim = claims.get_opt(&wname).await?;
        let volume = match &claim {
            Some(c) if ownership(&c.metadata, owner.name, owner.uid) == Ownership::Foreign => {
                return Ok(Writer::Hold(
                    self.foreign(&format!("PersistentVolumeClaim {writer_ns}/{wname}")),
                ))
            }
            Some(c) => c.spec.as_ref().and_then(|s| s.volume_name.clone()),
            None => None,
        };
        match volume.filter(|v| !v.is_empty()) {
            Some(v) => Ok(Writer::Done(v)),
            None => Ok(Writer::Hold(Hold {
                reason: reason::WRITER_CLAIM_PENDING,
                message: format!("writer claim {writer_ns}/{wname} is not bound to a volume"),
                requeue: cfg.pending_requeue,
            })),
        }
    }

    /// The key Secret and derived class of an encrypted cache. `Ok(Ok(class name))`.
    async fn ensure_encryption(
        &self,
        binding: &ModelCacheBinding,
    ) -> Result<Result<String, Hold>, Error> {
        let ctx = self.ctx;
        let cfg = &ctx.config;
        let client = self.ctx.client.clone();
        let owner = Owner::of(binding);
        let secret_ref = binding
            .spec
            .resources
            .secrets
            .first()
            .cloned()
            .unwrap_or_else(|| {
                ic_shared::crd::NamespacedName::new(
                    cfg.control_namespace.clone(),
                    super::names::key_secret(owner.name),
                )
            });
        let class_name = binding
            .spec
            .resources
            .storage_classes
            .first()
            .cloned()
            .unwrap_or_else(|| super::names::encrypted_class(owner.name));
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &secret_ref.namespace);
        match secrets.get_opt(&secret_ref.name).await? {
            Some(s) if ownership(&s.metadata, owner.name, owner.uid) == Ownership::Foreign => {
                return Ok(Err(self.foreign(&format!("Secret {secret_ref}"))))
            }
            Some(_) => {}
            None => {
                let mut key = [0u8; 32];
                ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
                    .map_err(|_| Error::Random)?;
                let s = render::key_secret(
                    &secret_ref.name,
                    &secret_ref.namespace,
                    owner,
                    &hex::encode(key),
                );
                secrets.create(&PostParams::default(), &s).await?;
            }
        }
        let classes: Api<StorageClass> = Api::all(client);
        match classes.get_opt(&class_name).await? {
            Some(c) if ownership(&c.metadata, owner.name, owner.uid) == Ownership::Foreign => {
                return Ok(Err(self.foreign(&format!("StorageClass {class_name}"))))
            }
            Some(_) => {}
            None => {
                let base = classes.get_opt(&binding.spec.storage_class.name).await?;
                if let Some(h) = self.class_changed(binding, base.as_ref()) {
                    return Ok(Err(h));
                }
                let Some(base) = base else {
                    return Ok(Err(Hold {
                        reason: reason::STORAGE_CLASS_CHANGED,
                        message: "the recorded StorageClass is gone".to_string(),
                        requeue: cfg.pending_requeue * 4,
                    }));
                };
                let derived = render::encrypted_class(
                    &base,
                    &class_name,
                    owner,
                    &secret_ref.name,
                    &secret_ref.namespace,
                );
                classes.create(&PostParams::default(), &derived).await?;
            }
        }
        Ok(Ok(class_name))
    }

    /// Reader PV and claim in every reader namespace of this request, derived from the
    /// writer's bound PV. `Some(hold)` when one cannot be made.
    async fn readers(&self, binding: &ModelCacheBinding) -> Result<Option<Hold>, Error> {
        let ctx = self.ctx;
        let cfg = &ctx.config;
        let client = self.ctx.client.clone();
        let owner = Owner::of(binding);
        let bname = owner.name.to_string();
        let writer_volume = binding
            .status
            .as_ref()
            .and_then(|s| s.writer_volume_name.clone())
            .unwrap_or_default();
        let writer_ns = binding
            .spec
            .resources
            .jobs
            .first()
            .map(|j| j.namespace.clone())
            .unwrap_or_else(|| {
                writer_namespace(self.mc.spec.workflow, &self.ns, &cfg.control_namespace)
            });
        let pvs: Api<PersistentVolume> = Api::all(client.clone());
        let Some(writer_pv) = pvs.get_opt(&writer_volume).await? else {
            return Ok(Some(Hold {
                reason: reason::READER_DERIVATION_FAILED,
                message: format!("the writer's volume {writer_volume} no longer exists"),
                requeue: cfg.steady_requeue,
            }));
        };
        let claim_name = reader_claim(&bname);
        for ns in self.mc.reader_namespaces() {
            let pv_name = reader_pv(&bname, &ns);
            let pv = match pvs.get_opt(&pv_name).await? {
                Some(pv)
                    if ownership(&pv.metadata, owner.name, owner.uid) == Ownership::Foreign =>
                {
                    return Ok(Some(self.foreign(&format!("PersistentVolume {pv_name}"))))
                }
                Some(pv) => pv,
                None => {
                    let derived = match render::reader_pv(
                        &writer_pv,
                        &binding.spec.decision,
                        &writer_ns,
                        &ns,
                        &pv_name,
                        &claim_name,
                        owner,
                    ) {
                        Ok(pv) => pv,
                        Err(e) => {
                            return Ok(Some(Hold {
                                reason: reason::READER_DERIVATION_FAILED,
                                message: e.to_string(),
                                requeue: cfg.steady_requeue,
                            }))
                        }
                    };
                    pvs.create(&PostParams::default(), &derived).await?
                }
            };
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
            match claims.get_opt(&claim_name).await? {
                Some(c) if ownership(&c.metadata, owner.name, owner.uid) == Ownership::Foreign => {
                    return Ok(Some(
                        self.foreign(&format!("PersistentVolumeClaim {ns}/{claim_name}")),
                    ))
                }
                Some(c) => {
                    if let Some(h) = unbound_reader_claim(&c, &ns, &pv_name, cfg.pending_requeue) {
                        return Ok(Some(h));
                    }
                }
                None => {
                    let c = render::reader_claim(&pv, &claim_name, &ns, owner);
                    match claims.create(&PostParams::default(), &c).await {
                        // The API server answers a new claim as Pending until the PV binder
                        // binds it (pre-bound by name: within seconds).
                        Ok(created) => {
                            if let Some(h) =
                                unbound_reader_claim(&created, &ns, &pv_name, cfg.pending_requeue)
                            {
                                return Ok(Some(h));
                            }
                        }
                        // Created by someone else between our read and our create: it is
                        // ours only if it carries the binding's label and UID annotation.
                        Err(e) if is_conflict(&e) => match claims.get_opt(&claim_name).await? {
                            Some(c)
                                if ownership(&c.metadata, owner.name, owner.uid)
                                    == Ownership::Owned => {}
                            Some(_) => {
                                return Ok(Some(self.foreign(&format!(
                                    "PersistentVolumeClaim {ns}/{claim_name}"
                                ))))
                            }
                            // Gone again: the next pass creates it.
                            None => {
                                return Ok(Some(Hold {
                                    reason: reason::READER_DERIVATION_FAILED,
                                    message: format!(
                                        "reader claim {ns}/{claim_name} was created and deleted by someone else while it was being created; retrying"
                                    ),
                                    requeue: cfg.pending_requeue,
                                }))
                            }
                        },
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        Ok(None)
    }
}

/// A hold while reader claim `c` (in `ns`, pre-bound to reader volume `pv_name`) is not
/// `Bound`: pods wired to it would not start. `None` when bound, or when the phase is not
/// reported at all.
fn unbound_reader_claim(
    c: &PersistentVolumeClaim,
    ns: &str,
    pv_name: &str,
    requeue: std::time::Duration,
) -> Option<Hold> {
    let phase = c.status.as_ref().and_then(|s| s.phase.as_deref())?;
    (phase != "Bound").then(|| Hold {
        reason: reason::READER_CLAIM_PENDING,
        message: format!(
            "reader claim {ns}/{} is {phase}, not bound to reader volume {pv_name}; engine pods are not wired to it until it is (a claim recreated while the volume still names the deleted one stays Pending: clear the volume's spec.claimRef.uid)",
            c.metadata.name.as_deref().unwrap_or_default()
        ),
        requeue,
    })
}
