//! The certificate keeper every replica runs: reads the shared Secret, publishes its CAs,
//! writes the rotation's due step with the read `resourceVersion` (adopting another replica's
//! write on a 409), serves the Secret's serving certificate and counts what it did.

use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::tls::{self, SelfSignedBundle};

use super::*;

/// The keeper's metrics (registered in the controller's registry).
#[derive(Clone)]
pub struct CertMetrics {
    /// `inferencecache_controller_webhook_cert_secret_problem{problem}`: 1 while the last check
    /// of the Secret found the problem, else 0.
    pub problem: IntGaugeVec,
    /// `inferencecache_controller_webhook_cert_secret_writes_total{action,outcome}`: writes of
    /// the Secret by this replica; `action` create, regenerate, add_ca, issue_leaf, drop_old_cas;
    /// `outcome` written, conflict (another replica wrote first; its Secret is adopted), failed.
    pub writes: IntCounterVec,
}

impl CertMetrics {
    /// Creates and registers the metrics in `registry`. Errors: a name already registered.
    pub fn register(registry: &Registry) -> Result<CertMetrics, prometheus::Error> {
        let problem = IntGaugeVec::new(
            Opts::new(
                "inferencecache_controller_webhook_cert_secret_problem",
                "1 while the last check of the self-signed webhook certificate Secret found this problem (it is repaired where it can be; see the log), else 0.",
            ),
            &["problem"],
        )?;
        let writes = IntCounterVec::new(
            Opts::new(
                "inferencecache_controller_webhook_cert_secret_writes_total",
                "Writes of the self-signed webhook certificate Secret by this replica, by rotation step and outcome.",
            ),
            &["action", "outcome"],
        )?;
        registry.register(Box::new(problem.clone()))?;
        registry.register(Box::new(writes.clone()))?;
        for p in SecretProblem::ALL {
            problem.with_label_values(&[p.label()]).set(0);
        }
        Ok(CertMetrics { problem, writes })
    }
}

/// Where the shared self-signed bundle lives and what it is for.
#[derive(Debug, Clone)]
pub struct SelfSignedSecret {
    /// The Secret's namespace (the controller's).
    pub namespace: String,
    /// The Secret's name (`--webhook-tls-secret`).
    pub name: String,
    /// DNS names of the serving certificate ([`tls::service_dns_names`]).
    pub subject_alt_names: Vec<String>,
    /// The Mutating/ValidatingWebhookConfiguration whose `caBundle` is kept equal to `ca.crt`
    /// (`None`: not kept; the new-CA leaf of a rotation is then issued on the overlap alone).
    pub webhook_config: Option<String>,
    /// Lifetimes and windows.
    pub policy: RotationPolicy,
}

/// What one [`CertKeeper::tick`] did.
#[derive(Debug, Clone, Default)]
pub struct TickReport {
    /// The step written (`create` when the Secret was created), if any; see [`Plan::action`].
    pub action: Option<&'static str>,
    /// The write lost to another replica's (409); the winner's Secret was adopted.
    pub conflict: bool,
    /// Why a due step waits.
    pub waiting: Option<String>,
    /// The running server was given a new serving certificate.
    pub reloaded: bool,
    /// Problems found in the Secret as read (before any repair).
    pub problems: Vec<SecretProblem>,
}

/// One replica's keeper of the shared self-signed bundle (module docs): run [`CertKeeper::tick`]
/// at start, attach the running server ([`CertKeeper::serve_into`]), then tick every resync
/// interval ([`spawn_cert_keeper`]).
pub struct CertKeeper {
    client: Client,
    cfg: SelfSignedSecret,
    metrics: Option<CertMetrics>,
    served: Option<SelfSignedBundle>,
    rustls: Option<RustlsConfig>,
    expiry: Option<prometheus::IntGauge>,
    last_problems: Vec<SecretProblem>,
    last_waiting: Option<String>,
}

impl CertKeeper {
    /// A keeper that serves nothing yet.
    pub fn new(client: Client, cfg: SelfSignedSecret) -> CertKeeper {
        CertKeeper {
            client,
            cfg,
            metrics: None,
            served: None,
            rustls: None,
            expiry: None,
            last_problems: Vec::new(),
            last_waiting: None,
        }
    }

    /// Counts into `metrics`.
    pub fn with_metrics(mut self, metrics: CertMetrics) -> CertKeeper {
        self.metrics = Some(metrics);
        self
    }

    /// From now on a changed serving certificate is swapped into `rustls` (new connections get
    /// it) and its `notAfter` set on `expiry`.
    pub fn serve_into(&mut self, rustls: RustlsConfig, expiry: Option<prometheus::IntGauge>) {
        self.rustls = Some(rustls);
        self.expiry = expiry;
    }

    /// The bundle this replica serves (the Secret's, as last adopted); `ca_pem` is the trust
    /// bundle (one or two CAs).
    pub fn served(&self) -> Option<&SelfSignedBundle> {
        self.served.as_ref()
    }

    fn kube_err(&self, what: &str) -> impl FnOnce(kube::Error) -> CaBundleError {
        let what = format!("{what} Secret {}/{}", self.cfg.namespace, self.cfg.name);
        move |source| CaBundleError::Kube {
            what,
            source: Box::new(source),
        }
    }

    fn count_write(&self, action: &str, outcome: &str) {
        if let Some(m) = &self.metrics {
            m.writes.with_label_values(&[action, outcome]).inc();
        }
    }

    fn set_problems(&mut self, problems: &[(SecretProblem, String)]) {
        if let Some(m) = &self.metrics {
            for p in SecretProblem::ALL {
                let on = problems.iter().any(|(q, _)| *q == p);
                m.problem.with_label_values(&[p.label()]).set(i64::from(on));
            }
        }
        let now: Vec<SecretProblem> = problems.iter().map(|(p, _)| *p).collect();
        if now != self.last_problems {
            if !problems.is_empty() {
                let text = problems
                    .iter()
                    .map(|(_, m)| m.as_str())
                    .collect::<Vec<_>>()
                    .join("; ");
                tracing::warn!(secret = %format!("{}/{}", self.cfg.namespace, self.cfg.name), problems = %text,
                    "the self-signed webhook certificate Secret is not in a good state; repairing what can be repaired");
            } else if !self.last_problems.is_empty() {
                tracing::info!(secret = %format!("{}/{}", self.cfg.namespace, self.cfg.name),
                    "the self-signed webhook certificate Secret is in a good state again");
            }
            self.last_problems = now;
        }
    }

    /// Keeps `caBundle` of the webhook configurations equal to `ca_pem`; whether both carry
    /// it now (`true` when no configuration is kept).
    async fn publish(&self, ca_pem: &str) -> bool {
        let Some(name) = &self.cfg.webhook_config else {
            return true;
        };
        match sync_ca_bundles(&self.client, name, ca_pem).await {
            Ok(s) => {
                if s.mutating == Some(true) || s.validating == Some(true) {
                    tracing::info!(configuration = %name, mutating = ?s.mutating, validating = ?s.validating,
                        "webhook caBundle set to the self-signed CA bundle");
                }
                s.mutating.is_some() && s.validating.is_some()
            }
            Err(e) => {
                tracing::warn!(configuration = %name, error = %e, "cannot set the webhook caBundle; retrying");
                false
            }
        }
    }

    /// Generates a CA and serving certificate and creates the Secret with them; on a 409
    /// (another replica created it first) returns that replica's bundle instead.
    ///
    /// Errors: generation fails; the create fails otherwise; the winner's Secret cannot be read.
    async fn create_secret(
        &mut self,
        api: &Api<Secret>,
        name: &str,
        now: i64,
        report: &mut TickReport,
    ) -> Result<StoredBundle, CaBundleError> {
        let ca = tls::generate_ca(now, self.cfg.policy.ca_lifetime)?;
        let leaf = tls::issue_serving(
            &ca,
            &self.cfg.subject_alt_names,
            now,
            self.cfg.policy.leaf_lifetime,
        )?;
        let fresh = StoredBundle {
            ca_pem: Some(ca.cert_pem),
            ca_key_pem: Some(ca.key_pem),
            cert_pem: Some(leaf.cert_pem),
            key_pem: Some(leaf.key_pem),
            updated_at: Some(now),
        };
        match api
            .create(
                &PostParams::default(),
                &fresh.to_secret(&self.cfg.namespace, name),
            )
            .await
        {
            Ok(_) => {
                self.count_write("create", "written");
                report.action = Some("create");
                tracing::info!(secret = %format!("{}/{name}", self.cfg.namespace),
                    "generated the self-signed webhook CA and serving certificate and stored them for the other replicas");
                Ok(fresh)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Another replica created it first: serve its bundle.
                self.count_write("create", "conflict");
                report.conflict = true;
                let s = api.get(name).await.map_err(self.kube_err("reading"))?;
                Ok(StoredBundle::from_secret(&s))
            }
            Err(e) => {
                self.count_write("create", "failed");
                self.set_problems(&[(SecretProblem::ApiError, format!("creating it failed: {e}"))]);
                Err(self.kube_err("creating")(e))
            }
        }
    }

    /// One round at `now` (Unix seconds): read the Secret (create it when absent), publish its
    /// CAs, write the rotation's next step if due, and serve the Secret's serving certificate.
    ///
    /// Errors: the Secret cannot be read ([`CaBundleError::Kube`]); it cannot be created;
    /// generation fails; or, before anything is served, the Secret holds no usable certificate
    /// and the repair could not be written ([`CaBundleError::BadSecret`]). A failed write of a
    /// Secret that still holds a usable certificate is logged and counted, not an error.
    pub async fn tick(&mut self, now: i64) -> Result<TickReport, CaBundleError> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let name = self.cfg.name.clone();
        let mut report = TickReport::default();
        let read = match api.get_opt(&name).await {
            Ok(r) => r,
            Err(e) => {
                self.set_problems(&[(SecretProblem::ApiError, format!("reading it failed: {e}"))]);
                return Err(self.kube_err("reading")(e));
            }
        };
        let mut problems = Vec::new();
        let stored = match read {
            None => {
                let created = self.create_secret(&api, &name, now, &mut report).await?;
                // Publish at once: the CacheBackend webhook fails closed, so until caBundle
                // carries this CA every CacheBackend write is refused (and engine pods go
                // unwired) — a fresh install must not wait for the next check.
                if let Some(ca) = &created.ca_pem {
                    self.publish(ca).await;
                }
                created
            }
            Some(secret) => {
                let stored = StoredBundle::from_secret(&secret);
                let a = assess(&stored, now);
                report.problems = a.problems.iter().map(|(p, _)| *p).collect();
                problems = a.problems.clone();
                let published = match &stored.ca_pem {
                    Some(ca) if a.trust.iter().any(|c| c.is_ca) => self.publish(ca).await,
                    _ => false,
                };
                let mut step = plan(&a, stored.updated_at, now, &self.cfg.policy, published);
                let ours = secret
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(MANAGED_BY.0))
                    .is_some_and(|v| v == MANAGED_BY.1);
                if !ours && step.action().is_some() {
                    let why = format!(
                        "it is not labelled {}={}, so the controller does not write it ({step:?} is due): fix or delete it",
                        MANAGED_BY.0, MANAGED_BY.1
                    );
                    problems.push((SecretProblem::NotManaged, why.clone()));
                    step = Plan::Wait(why);
                }
                if let Plan::Wait(why) = &step {
                    report.waiting = Some(why.clone());
                }
                if report.waiting != self.last_waiting {
                    if let Some(why) = &report.waiting {
                        tracing::info!(secret = %format!("{}/{name}", self.cfg.namespace), waiting = %why,
                            "a step of the self-signed webhook certificate rotation is due and waits");
                    }
                    self.last_waiting = report.waiting.clone();
                }
                match apply(
                    &step,
                    &stored,
                    &a,
                    now,
                    &self.cfg.subject_alt_names,
                    &self.cfg.policy,
                )? {
                    None => stored,
                    Some(next) => {
                        let action = step.action().unwrap_or("write");
                        let mut updated = secret.clone();
                        next.write_into(&mut updated);
                        // `replace` sends the read resourceVersion: a concurrent writer's
                        // update makes this a 409, never a lost write.
                        match api.replace(&name, &PostParams::default(), &updated).await {
                            Ok(_) => {
                                self.count_write(action, "written");
                                report.action = Some(action);
                                tracing::info!(secret = %format!("{}/{name}", self.cfg.namespace), step = ?step,
                                    "self-signed webhook certificate Secret updated");
                                if let Some(ca) = &next.ca_pem {
                                    if next.ca_pem != stored.ca_pem {
                                        self.publish(ca).await;
                                    }
                                }
                                next
                            }
                            Err(kube::Error::Api(s)) if s.code == 409 => {
                                self.count_write(action, "conflict");
                                report.conflict = true;
                                tracing::info!(secret = %format!("{}/{name}", self.cfg.namespace), step = ?step,
                                    "another replica updated the webhook certificate Secret first; adopting its bundle");
                                let s = api.get(&name).await.map_err(self.kube_err("reading"))?;
                                StoredBundle::from_secret(&s)
                            }
                            Err(e) => {
                                self.count_write(action, "failed");
                                tracing::warn!(secret = %format!("{}/{name}", self.cfg.namespace), step = ?step, error = %e,
                                    "cannot update the self-signed webhook certificate Secret; retrying on the next check");
                                problems.push((
                                    SecretProblem::ApiError,
                                    format!("updating it failed: {e}"),
                                ));
                                stored
                            }
                        }
                    }
                }
            }
        };
        self.set_problems(&problems);
        let after = assess(&stored, now);
        match after.servable(&stored) {
            Some(bundle) => {
                report.reloaded = self.serve(bundle)?;
                Ok(report)
            }
            None if self.served.is_some() => Ok(report),
            None => Err(CaBundleError::BadSecret {
                namespace: self.cfg.namespace.clone(),
                name,
                problem: after
                    .problems
                    .iter()
                    .chain(problems.iter().filter(|(p, _)| {
                        matches!(p, SecretProblem::ApiError | SecretProblem::NotManaged)
                    }))
                    .map(|(_, m)| m.as_str())
                    .collect::<Vec<_>>()
                    .join("; "),
            }),
        }
    }

    /// Serves `bundle` when its certificate differs from the one served; whether it did.
    fn serve(&mut self, bundle: SelfSignedBundle) -> Result<bool, CaBundleError> {
        let changed = self
            .served
            .as_ref()
            .is_none_or(|s| s.cert_pem != bundle.cert_pem || s.key_pem != bundle.key_pem);
        let mut reloaded = false;
        if changed {
            if let Some(rustls) = &self.rustls {
                let sc = tls::server_config_from_pem(
                    bundle.cert_pem.as_bytes(),
                    bundle.key_pem.as_bytes(),
                )?;
                rustls.reload_from_config(Arc::new(sc));
                tls::record_not_after(self.expiry.as_ref(), bundle.cert_pem.as_bytes());
                tracing::info!(secret = %format!("{}/{}", self.cfg.namespace, self.cfg.name),
                    "webhook serving certificate reloaded from the Secret");
                reloaded = true;
            }
        }
        self.served = Some(bundle);
        Ok(reloaded)
    }
}

/// The current time in Unix seconds (jiff's clock; before the epoch it is negative).
pub fn unix_now() -> i64 {
    Timestamp::now().as_second()
}

/// Runs [`CertKeeper::tick`] every `interval` (first after one interval: the caller ran the
/// first at start) until `shutdown` turns true. Errors are logged (once per change of message)
/// and retried on the next tick, never fatal: the served certificate stays.
pub fn spawn_cert_keeper(
    mut keeper: CertKeeper,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut last_error: Option<String> = None;
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => break,
                _ = tokio::time::sleep(interval) => {}
            }
            match keeper.tick(unix_now()).await {
                Ok(_) => last_error = None,
                Err(e) => {
                    let e = e.to_string();
                    if last_error.as_deref() != Some(e.as_str()) {
                        tracing::warn!(error = %e, "checking the self-signed webhook certificate Secret failed; the served certificate stays; retrying");
                        last_error = Some(e);
                    }
                }
            }
        }
    })
}
