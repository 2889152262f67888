//! Self-signed webhook certificates in cluster (docs/admission.md "Certificates"): one CA and
//! serving pair shared by every controller replica through a Secret, renewed before they
//! expire, and the CA(s) kept in the webhook configurations' `caBundle`.
//!
//! - The Secret (`kubernetes.io/tls`): `tls.crt`/`tls.key` the serving (leaf) certificate,
//!   `ca.crt` the CAs the webhook configurations must trust (one, or two during a CA rotation:
//!   the signing CA first), `ca.key` the signing CA's key, and the annotation
//!   [`UPDATED_AT_ANNOTATION`] (RFC 3339 time of the last write of the rotation).
//! - [`CertKeeper::tick`], run by every replica at start and every resync interval
//!   ([`spawn_cert_keeper`]): reads the Secret; writes its `ca.crt` into both webhook
//!   configurations ([`sync_ca_bundles`]); decides ([`assess`], [`plan`], pure) whether a step of
//!   the rotation is due; writes it with the read `resourceVersion` (a 409 means another replica
//!   wrote first: the winner's Secret is read and adopted, never overwritten); and swaps the
//!   Secret's serving certificate into the running server when it changed. A replica that finds
//!   no Secret generates the bundle and creates it (409: it adopts the winner's).
//! - The timeline ([`plan`]; policy [`RotationPolicy`], defaults: CA 10 years, leaf 1 year, renewal
//!   when a third of a certificate's validity is left, overlap 10 minutes):
//!   1. the leaf is re-issued by the same CA when a third of its validity is left (`caBundle`
//!      unchanged);
//!   2. when a third of the CA's validity is left (or the Secret has no usable `ca.key`, as one
//!      written before rotation existed), a new CA is generated and put first in `ca.crt`, the
//!      old one kept after it; the leaf of the old CA keeps serving;
//!   3. once the webhook configurations carry both CAs and the overlap has passed since step 2,
//!      a leaf of the new CA is issued;
//!   4. once the overlap has passed since step 3 (every replica re-reads the Secret each resync
//!      interval, so each serves the new leaf by then), the old CA is dropped from `ca.crt`.
//! - A Secret in a bad state ([`SecretProblem`]) is logged, counted in
//!   `inferencecache_controller_webhook_cert_secret_problem{problem}`, and repaired: a bad leaf
//!   is re-issued by the signing CA; an unusable `ca.crt` means a new CA and leaf (every replica
//!   serving the old leaf fails the apiserver's TLS check until it re-reads the Secret, within
//!   one resync interval). Only a Secret labelled as the controller's ([`MANAGED_BY`], set on
//!   the Secret it creates) is ever written: one without the label is the operator's, served
//!   while it holds a usable pair and never renewed or repaired ([`SecretProblem::NotManaged`]
//!   when a step is due; a start on such a Secret without a usable pair fails, naming it).
//! - [`sync_ca_bundles`] / [`spawn_ca_bundle_keeper`]: set `webhooks[*].clientConfig.caBundle`
//!   on the MutatingWebhookConfiguration and the ValidatingWebhookConfiguration of that name,
//!   and keep doing so periodically — a `helm upgrade` re-applies the templates with an empty
//!   `caBundle`, which would otherwise break the fail-closed CacheBackend webhooks until the
//!   next restart. Writes only when a value differs; replaces with the read `resourceVersion`, so
//!   a concurrent edit is retried on the next tick, never overwritten.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use base64::Engine as _;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use k8s_openapi::ByteString;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::tls::{self, CaPair, CertInfo, SelfSignedBundle, TlsError};

/// Secret data key of the CA certificates (the trust bundle: the signing CA first).
pub const CA_KEY: &str = "ca.crt";
/// Secret data key of the signing CA's private key.
pub const CA_PRIVATE_KEY: &str = "ca.key";
/// Secret data key of the serving certificate.
pub const CERT_KEY: &str = "tls.crt";
/// Secret data key of the serving key.
pub const KEY_KEY: &str = "tls.key";
/// Annotation on the Secret: RFC 3339 time of the rotation's last write (the overlap of a CA
/// rotation is counted from it).
pub const UPDATED_AT_ANNOTATION: &str = "inferencecache.io/webhook-cert-updated-at";
/// The label (key, value) that makes the Secret the controller's to write: it sets it on the
/// Secret it creates. A Secret of that name without it is the operator's: served when usable,
/// never written ([`SecretProblem::NotManaged`] when a step is due).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "inference-cache-controller");

/// Errors of the in-cluster certificate handling.
#[derive(Debug, thiserror::Error)]
pub enum CaBundleError {
    /// Generating the bundle failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// An API call failed.
    #[error("{what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The API error.
        source: Box<kube::Error>,
    },
    /// The Secret holds no usable serving certificate and none could be written.
    #[error("Secret {namespace}/{name} holds no usable serving certificate and none could be stored: {problem}")]
    BadSecret {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// Lifetimes and windows of the self-signed rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotationPolicy {
    /// Validity of a generated CA (default 10 years).
    pub ca_lifetime: Duration,
    /// Validity of a serving certificate (default 365 days; never past its CA's `notAfter`).
    pub leaf_lifetime: Duration,
    /// A certificate is renewed once less than `validity / renew_divisor` of it is left
    /// (default 3: a one-year leaf is renewed about 122 days before it expires).
    pub renew_divisor: u32,
    /// How long each step of a CA rotation waits after the previous write, so that every
    /// replica (re-reading the Secret each resync interval) and the apiserver have caught up
    /// (default 10 minutes; keep it several resync intervals).
    pub overlap: Duration,
}

impl Default for RotationPolicy {
    fn default() -> Self {
        RotationPolicy {
            ca_lifetime: Duration::from_secs(10 * 365 * 86_400),
            leaf_lifetime: Duration::from_secs(365 * 86_400),
            renew_divisor: 3,
            overlap: Duration::from_secs(600),
        }
    }
}

impl RotationPolicy {
    /// Whether `cert` is due for renewal at `now` (Unix seconds): less than
    /// `validity / renew_divisor` left, or expired.
    pub fn due(&self, cert: &CertInfo, now: i64) -> bool {
        let span = (cert.not_after - cert.not_before).max(0);
        now >= cert.not_after - span / i64::from(self.renew_divisor.max(1))
    }

    fn overlap_over(&self, updated_at: Option<i64>, now: i64) -> bool {
        let overlap = i64::try_from(self.overlap.as_secs()).unwrap_or(i64::MAX);
        updated_at.is_none_or(|t| now >= t.saturating_add(overlap))
    }
}

/// What is wrong with the Secret or the access to it: the `problem` label of
/// `inferencecache_controller_webhook_cert_secret_problem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SecretProblem {
    /// `ca.crt` is missing, does not parse, or holds no unexpired CA.
    CaCertInvalid,
    /// `ca.key` does not parse or is the key of no CA in `ca.crt`.
    CaKeyInvalid,
    /// `tls.crt`/`tls.key` missing, not a matching pair, expired, or not issued by a CA of `ca.crt`.
    LeafInvalid,
    /// Reading or writing the Secret failed (API error, RBAC).
    ApiError,
    /// A step is due but the Secret is not labelled as the controller's
    /// ([`MANAGED_BY`]): it is the operator's, served as it is and never written.
    NotManaged,
}

impl SecretProblem {
    /// Every problem, in label order.
    pub const ALL: [SecretProblem; 5] = [
        SecretProblem::CaCertInvalid,
        SecretProblem::CaKeyInvalid,
        SecretProblem::LeafInvalid,
        SecretProblem::ApiError,
        SecretProblem::NotManaged,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            SecretProblem::CaCertInvalid => "CaCertInvalid",
            SecretProblem::CaKeyInvalid => "CaKeyInvalid",
            SecretProblem::LeafInvalid => "LeafInvalid",
            SecretProblem::ApiError => "ApiError",
            SecretProblem::NotManaged => "NotManaged",
        }
    }
}

/// The Secret's values as stored (`None`: key absent or not UTF-8).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredBundle {
    /// `ca.crt`: the trust bundle.
    pub ca_pem: Option<String>,
    /// `ca.key`: the signing CA's key.
    pub ca_key_pem: Option<String>,
    /// `tls.crt`: the serving certificate.
    pub cert_pem: Option<String>,
    /// `tls.key`: its key.
    pub key_pem: Option<String>,
    /// [`UPDATED_AT_ANNOTATION`] as Unix seconds (`None`: absent or not RFC 3339).
    pub updated_at: Option<i64>,
}

impl StoredBundle {
    /// Reads the values of `secret`.
    pub fn from_secret(secret: &Secret) -> StoredBundle {
        let field = |key: &str| {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .and_then(|b| String::from_utf8(b.0.clone()).ok())
        };
        StoredBundle {
            ca_pem: field(CA_KEY),
            ca_key_pem: field(CA_PRIVATE_KEY),
            cert_pem: field(CERT_KEY),
            key_pem: field(KEY_KEY),
            updated_at: secret
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(UPDATED_AT_ANNOTATION))
                .and_then(|t| t.parse::<Timestamp>().ok())
                .map(|t| t.as_second()),
        }
    }

    /// Writes the values into `secret` (data keys and the annotation; other keys kept).
    fn write_into(&self, secret: &mut Secret) {
        let data = secret.data.get_or_insert_with(BTreeMap::new);
        for (key, value) in [
            (CA_KEY, &self.ca_pem),
            (CA_PRIVATE_KEY, &self.ca_key_pem),
            (CERT_KEY, &self.cert_pem),
            (KEY_KEY, &self.key_pem),
        ] {
            match value {
                Some(v) => {
                    data.insert(key.to_string(), ByteString(v.clone().into_bytes()));
                }
                None => {
                    data.remove(key);
                }
            }
        }
        if let Some(t) = self.updated_at.and_then(|t| Timestamp::from_second(t).ok()) {
            secret
                .metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .insert(UPDATED_AT_ANNOTATION.to_string(), t.to_string());
        }
    }

    /// A `kubernetes.io/tls` Secret `namespace/name` holding the values, labelled as the
    /// controller's.
    pub fn to_secret(&self, namespace: &str, name: &str) -> Secret {
        let mut secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some(namespace.to_string()),
                labels: Some(BTreeMap::from([(
                    MANAGED_BY.0.to_string(),
                    MANAGED_BY.1.to_string(),
                )])),
                ..Default::default()
            },
            type_: Some("kubernetes.io/tls".to_string()),
            ..Default::default()
        };
        self.write_into(&mut secret);
        secret
    }
}

/// What [`assess`] found in a [`StoredBundle`].
#[derive(Debug, Clone, Default)]
pub struct Assessment {
    /// The certificates of `ca.crt`, in order (empty when it does not parse).
    pub trust: Vec<CertInfo>,
    /// Index in `trust` of the CA whose key is `ca.key`.
    pub signer: Option<usize>,
    /// The serving certificate, when it is usable (a matching pair, unexpired, issued by a CA of
    /// `trust`), with the index of its issuer in `trust`.
    pub leaf: Option<(CertInfo, usize)>,
    /// Problems found, each with a sentence for the log.
    pub problems: Vec<(SecretProblem, String)>,
}

impl Assessment {
    /// Whether `problem` was found.
    pub fn has(&self, problem: SecretProblem) -> bool {
        self.problems.iter().any(|(p, _)| *p == problem)
    }

    /// The problems as one sentence.
    pub fn describe(&self) -> String {
        self.problems
            .iter()
            .map(|(_, m)| m.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The bundle to serve (the trust bundle as `ca_pem`) when the leaf is usable.
    pub fn servable(&self, stored: &StoredBundle) -> Option<SelfSignedBundle> {
        self.leaf.as_ref()?;
        Some(SelfSignedBundle {
            ca_pem: stored.ca_pem.clone()?,
            cert_pem: stored.cert_pem.clone()?,
            key_pem: stored.key_pem.clone()?,
        })
    }
}

/// Checks the stored values at `now` (Unix seconds). Pure: parses, never writes.
pub fn assess(stored: &StoredBundle, now: i64) -> Assessment {
    let mut a = Assessment::default();
    match stored
        .ca_pem
        .as_deref()
        .map(|p| tls::parse_certs(p.as_bytes()))
    {
        None => a
            .problems
            .push((SecretProblem::CaCertInvalid, format!("it has no {CA_KEY}"))),
        Some(Err(e)) => a.problems.push((
            SecretProblem::CaCertInvalid,
            format!("{CA_KEY} does not parse ({e})"),
        )),
        Some(Ok(certs)) => {
            if !certs.iter().any(|c| c.is_ca && c.not_after > now) {
                a.problems.push((
                    SecretProblem::CaCertInvalid,
                    format!("{CA_KEY} holds no unexpired CA certificate"),
                ));
            }
            a.trust = certs;
        }
    }
    if let Some(key) = stored.ca_key_pem.as_deref() {
        match rcgen::KeyPair::from_pem(key) {
            Err(e) => a.problems.push((
                SecretProblem::CaKeyInvalid,
                format!("{CA_PRIVATE_KEY} does not parse ({e})"),
            )),
            Ok(k) => {
                a.signer = a
                    .trust
                    .iter()
                    .position(|c| c.is_ca && c.not_after > now && c.has_public_key(&k));
                if a.signer.is_none() && !a.trust.is_empty() {
                    a.problems.push((
                        SecretProblem::CaKeyInvalid,
                        format!("{CA_PRIVATE_KEY} is the key of no unexpired CA in {CA_KEY}"),
                    ));
                }
            }
        }
    }
    let leaf = match (stored.cert_pem.as_deref(), stored.key_pem.as_deref()) {
        (Some(cert), Some(key)) => tls::server_config_from_pem(cert.as_bytes(), key.as_bytes())
            .map_err(|e| format!("{CERT_KEY} and {KEY_KEY} do not load ({e})"))
            .and_then(|_| {
                tls::parse_certs(cert.as_bytes())
                    .map_err(|e| format!("{CERT_KEY} does not parse ({e})"))
            })
            .and_then(|certs| {
                let leaf = certs.into_iter().next().ok_or("no certificate")?;
                if leaf.not_after <= now {
                    return Err(format!("{CERT_KEY} has expired"));
                }
                let issuer = a
                    .trust
                    .iter()
                    .position(|ca| leaf.issued_by(ca) && ca.not_after > now)
                    .ok_or_else(|| {
                        format!("{CERT_KEY} was not issued by an unexpired CA of {CA_KEY}")
                    })?;
                Ok((leaf, issuer))
            }),
        _ => Err(format!("{CERT_KEY} or {KEY_KEY} is missing")),
    };
    match leaf {
        Ok(l) => a.leaf = Some(l),
        Err(e) => a.problems.push((SecretProblem::LeafInvalid, e)),
    }
    a
}

/// Why a new CA is added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaReason {
    /// The Secret has no `ca.key` (written before rotation existed).
    NoCaKey,
    /// `ca.key` is unusable ([`SecretProblem::CaKeyInvalid`]).
    CaKeyInvalid,
    /// The signing CA is due ([`RotationPolicy::due`]).
    Expiring,
}

/// Why a new serving certificate is issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafReason {
    /// The stored one is unusable ([`SecretProblem::LeafInvalid`]).
    Invalid,
    /// It is due ([`RotationPolicy::due`]).
    Expiring,
    /// It was issued by the old CA of a CA rotation (step 3).
    NewCa,
}

/// One step of the rotation ([`plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Nothing to do.
    Keep,
    /// A step is due but must wait (the sentence says for what).
    Wait(String),
    /// New CA and leaf; still-valid CAs of `ca.crt` are kept after the new one.
    Regenerate(SecretProblem),
    /// A new CA put first in `ca.crt` (the others kept), its key in `ca.key`; leaf unchanged.
    AddCa(CaReason),
    /// A new leaf from the signing CA.
    IssueLeaf(LeafReason),
    /// `ca.crt` reduced to the signing CA.
    DropOldCas,
}

impl Plan {
    /// The `action` label of `inferencecache_controller_webhook_cert_secret_writes_total`;
    /// `None` when the plan writes nothing.
    pub fn action(&self) -> Option<&'static str> {
        match self {
            Plan::Keep | Plan::Wait(_) => None,
            Plan::Regenerate(_) => Some("regenerate"),
            Plan::AddCa(_) => Some("add_ca"),
            Plan::IssueLeaf(_) => Some("issue_leaf"),
            Plan::DropOldCas => Some("drop_old_cas"),
        }
    }
}

/// The next step of the rotation for assessment `a` of a Secret last written at `updated_at`,
/// at `now` (Unix seconds). `trust_published`: both webhook configurations carry exactly the
/// Secret's `ca.crt` (or there are none to keep). Pure. The order is the module's timeline.
pub fn plan(
    a: &Assessment,
    updated_at: Option<i64>,
    now: i64,
    policy: &RotationPolicy,
    trust_published: bool,
) -> Plan {
    if a.has(SecretProblem::CaCertInvalid) {
        return Plan::Regenerate(SecretProblem::CaCertInvalid);
    }
    let Some((leaf, issuer)) = &a.leaf else {
        return match a.signer {
            Some(_) => Plan::IssueLeaf(LeafReason::Invalid),
            None => Plan::Regenerate(SecretProblem::LeafInvalid),
        };
    };
    let Some(signer) = a.signer else {
        return Plan::AddCa(if a.has(SecretProblem::CaKeyInvalid) {
            CaReason::CaKeyInvalid
        } else {
            CaReason::NoCaKey
        });
    };
    if policy.due(&a.trust[signer], now) {
        return Plan::AddCa(CaReason::Expiring);
    }
    if *issuer != signer {
        if !trust_published {
            return Plan::Wait(
                "the webhook configurations do not carry the new CA yet".to_string(),
            );
        }
        if !policy.overlap_over(updated_at, now) {
            return Plan::Wait("the overlap since the new CA was added has not passed".to_string());
        }
        return Plan::IssueLeaf(LeafReason::NewCa);
    }
    if policy.due(leaf, now) {
        return Plan::IssueLeaf(LeafReason::Expiring);
    }
    if a.trust.len() > 1 {
        if !policy.overlap_over(updated_at, now) {
            return Plan::Wait(
                "the overlap since the new CA's leaf was issued has not passed".to_string(),
            );
        }
        return Plan::DropOldCas;
    }
    Plan::Keep
}

/// A certificate's PEM from its DER.
fn pem_of(der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// The PEM of each certificate of `pem` (unparseable blocks left out).
fn split_pem(pem: &str) -> Vec<String> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .map(|d| pem_of(d.as_ref()))
        .collect()
}

/// The values after step `plan` (generating keys where it says so), written at `now` (Unix
/// seconds). `None` for [`Plan::Keep`] and [`Plan::Wait`].
///
/// Errors: [`TlsError`] from generation or a signing CA that does not load.
pub fn apply(
    plan: &Plan,
    stored: &StoredBundle,
    a: &Assessment,
    now: i64,
    subject_alt_names: &[String],
    policy: &RotationPolicy,
) -> Result<Option<StoredBundle>, TlsError> {
    let old_trust = stored.ca_pem.as_deref().map(split_pem).unwrap_or_default();
    // CAs still worth trusting after a new one: unexpired CAs of the current bundle.
    let kept: Vec<&String> = old_trust
        .iter()
        .zip(&a.trust)
        .filter(|(_, c)| c.is_ca && c.not_after > now)
        .map(|(p, _)| p)
        .collect();
    let with_new_ca = |ca: &CaPair| {
        let mut pem = ca.cert_pem.clone();
        for p in &kept {
            pem.push_str(p);
        }
        pem
    };
    let mut next = stored.clone();
    next.updated_at = Some(now);
    match plan {
        Plan::Keep | Plan::Wait(_) => return Ok(None),
        Plan::Regenerate(_) => {
            let ca = tls::generate_ca(now, policy.ca_lifetime)?;
            let leaf = tls::issue_serving(&ca, subject_alt_names, now, policy.leaf_lifetime)?;
            next.ca_pem = Some(with_new_ca(&ca));
            next.ca_key_pem = Some(ca.key_pem);
            next.cert_pem = Some(leaf.cert_pem);
            next.key_pem = Some(leaf.key_pem);
        }
        Plan::AddCa(_) => {
            let ca = tls::generate_ca(now, policy.ca_lifetime)?;
            next.ca_pem = Some(with_new_ca(&ca));
            next.ca_key_pem = Some(ca.key_pem);
        }
        Plan::IssueLeaf(_) => {
            let signer = a
                .signer
                .and_then(|i| old_trust.get(i))
                .ok_or_else(|| TlsError::CertPem("no signing CA".to_string()))?;
            let ca = CaPair {
                cert_pem: signer.clone(),
                key_pem: stored.ca_key_pem.clone().unwrap_or_default(),
            };
            let leaf = tls::issue_serving(&ca, subject_alt_names, now, policy.leaf_lifetime)?;
            next.cert_pem = Some(leaf.cert_pem);
            next.key_pem = Some(leaf.key_pem);
        }
        Plan::DropOldCas => {
            let signer = a
                .signer
                .and_then(|i| old_trust.get(i))
                .ok_or_else(|| TlsError::CertPem("no signing CA".to_string()))?;
            next.ca_pem = Some(signer.clone());
        }
    }
    Ok(Some(next))
}

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

/// Sets `caBundle` (base64 of `ca_pem`) on every webhook of the configuration `name` of kind
/// `K`. `Ok(None)` when it does not exist; `Ok(Some(changed))` otherwise.
async fn sync_one<K>(client: &Client, name: &str, ca_pem: &str) -> Result<Option<bool>, kube::Error>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    let api: Api<K> = Api::all(client.clone());
    let Some(current) = api.get_opt(name).await? else {
        return Ok(None);
    };
    let mut value = serde_json::to_value(&current).map_err(kube::Error::SerdeError)?;
    let before = value.clone();
    tls::set_ca_bundle(&mut value, ca_pem);
    if value == before {
        return Ok(Some(false));
    }
    let updated: K = serde_json::from_value(value).map_err(kube::Error::SerdeError)?;
    api.replace(name, &PostParams::default(), &updated).await?;
    Ok(Some(true))
}

/// What [`sync_ca_bundles`] did per kind: `None` = not found, `Some(true)` = written,
/// `Some(false)` = already carried the CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaBundleSync {
    /// The MutatingWebhookConfiguration.
    pub mutating: Option<bool>,
    /// The ValidatingWebhookConfiguration.
    pub validating: Option<bool>,
}

/// Puts `ca_pem` into the Mutating- and ValidatingWebhookConfiguration named `name`.
pub async fn sync_ca_bundles(
    client: &Client,
    name: &str,
    ca_pem: &str,
) -> Result<CaBundleSync, kube::Error> {
    Ok(CaBundleSync {
        mutating: sync_one::<MutatingWebhookConfiguration>(client, name, ca_pem).await?,
        validating: sync_one::<ValidatingWebhookConfiguration>(client, name, ca_pem).await?,
    })
}

/// Runs [`sync_ca_bundles`] now and every `interval` until `shutdown` turns true. Failures
/// and missing configurations are logged once per change of state, never fatal.
pub fn spawn_ca_bundle_keeper(
    client: Client,
    name: String,
    ca_pem: String,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut last: Option<String> = None;
        loop {
            let state = match sync_ca_bundles(&client, &name, &ca_pem).await {
                Ok(s) => {
                    if s.mutating == Some(true) || s.validating == Some(true) {
                        tracing::info!(configuration = %name, mutating = ?s.mutating, validating = ?s.validating, "webhook caBundle set to the self-signed CA");
                    }
                    match (s.mutating, s.validating) {
                        (Some(_), Some(_)) => "ok".to_string(),
                        _ => format!(
                            "webhook configuration {name} not found (mutating: {}, validating: {})",
                            s.mutating.is_some(),
                            s.validating.is_some()
                        ),
                    }
                }
                Err(e) => format!("cannot set the webhook caBundle on {name}: {e}"),
            };
            if last.as_deref() != Some(state.as_str()) {
                if state != "ok" {
                    tracing::warn!(state = %state, "webhook caBundle not in place; retrying");
                }
                last = Some(state);
            }
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;
    const T0: i64 = 1_800_000_000;

    fn sans() -> Vec<String> {
        tls::service_dns_names("ic-webhook", "ic-system")
    }

    /// A bundle written at `at` with a CA of `ca_days` and a leaf of `leaf_days`.
    fn bundle(at: i64, ca_days: u64, leaf_days: u64) -> StoredBundle {
        let ca = tls::generate_ca(at, Duration::from_secs(ca_days * 86_400)).unwrap();
        let leaf =
            tls::issue_serving(&ca, &sans(), at, Duration::from_secs(leaf_days * 86_400)).unwrap();
        StoredBundle {
            ca_pem: Some(ca.cert_pem),
            ca_key_pem: Some(ca.key_pem),
            cert_pem: Some(leaf.cert_pem),
            key_pem: Some(leaf.key_pem),
            updated_at: Some(at),
        }
    }

    fn step(s: &StoredBundle, now: i64, published: bool) -> (Plan, Option<StoredBundle>) {
        let policy = RotationPolicy::default();
        let a = assess(s, now);
        let p = plan(&a, s.updated_at, now, &policy, published);
        let next = apply(&p, s, &a, now, &sans(), &policy).unwrap();
        (p, next)
    }

    fn cas(s: &StoredBundle) -> usize {
        tls::parse_certs(s.ca_pem.as_ref().unwrap().as_bytes())
            .unwrap()
            .len()
    }

    #[test]
    fn a_fresh_bundle_is_kept_and_a_leaf_near_expiry_is_reissued_by_the_same_ca() {
        let s = bundle(T0, 3650, 365);
        assert_eq!(step(&s, T0 + DAY, true).0, Plan::Keep);
        // 2/3 of the year gone: renewed, same CA and key.
        let (p, next) = step(&s, T0 + 250 * DAY, true);
        assert_eq!(p, Plan::IssueLeaf(LeafReason::Expiring));
        let next = next.unwrap();
        assert_eq!(next.ca_pem, s.ca_pem);
        assert_eq!(next.ca_key_pem, s.ca_key_pem);
        assert_ne!(next.cert_pem, s.cert_pem);
        let leaf = &tls::parse_certs(next.cert_pem.as_ref().unwrap().as_bytes()).unwrap()[0];
        assert_eq!(leaf.not_after, T0 + 250 * DAY + 365 * DAY);
        assert_eq!(step(&next, T0 + 250 * DAY, true).0, Plan::Keep);
    }

    #[test]
    fn a_ca_rotation_overlaps_both_cas_until_the_new_leaf_has_served_for_the_overlap() {
        let overlap = RotationPolicy::default().overlap.as_secs() as i64;
        let s = bundle(T0, 30, 30);
        // Day 25 of a 30-day CA: a new CA first in ca.crt, the old leaf kept.
        let t1 = T0 + 25 * DAY;
        let (p, s1) = step(&s, t1, true);
        assert_eq!(p, Plan::AddCa(CaReason::Expiring));
        let s1 = s1.unwrap();
        assert_eq!(cas(&s1), 2);
        assert_eq!(s1.cert_pem, s.cert_pem);
        assert!(s1
            .ca_pem
            .as_ref()
            .unwrap()
            .ends_with(s.ca_pem.as_ref().unwrap().as_str()));
        // The new CA is not in caBundle yet, then the overlap has not passed.
        assert!(matches!(step(&s1, t1 + overlap, false).0, Plan::Wait(_)));
        assert!(matches!(step(&s1, t1 + overlap - 1, true).0, Plan::Wait(_)));
        let t2 = t1 + overlap;
        let (p, s2) = step(&s1, t2, true);
        assert_eq!(p, Plan::IssueLeaf(LeafReason::NewCa));
        let s2 = s2.unwrap();
        assert_eq!(s2.ca_pem, s1.ca_pem);
        let a2 = assess(&s2, t2);
        assert_eq!(a2.leaf.as_ref().unwrap().1, 0, "the leaf is the new CA's");
        assert!(matches!(step(&s2, t2 + overlap - 1, true).0, Plan::Wait(_)));
        let (p, s3) = step(&s2, t2 + overlap, true);
        assert_eq!(p, Plan::DropOldCas);
        let s3 = s3.unwrap();
        assert_eq!(cas(&s3), 1);
        assert!(s1
            .ca_pem
            .as_ref()
            .unwrap()
            .starts_with(s3.ca_pem.as_ref().unwrap().as_str()));
        assert_eq!(step(&s3, t2 + overlap, true).0, Plan::Keep);
    }

    #[test]
    fn a_secret_without_ca_key_rotates_its_ca_with_the_overlap() {
        let mut s = bundle(T0, 3650, 3650);
        s.ca_key_pem = None;
        s.updated_at = None;
        let a = assess(&s, T0 + DAY);
        assert!(a.problems.is_empty(), "{:?}", a.problems);
        let (p, next) = step(&s, T0 + DAY, true);
        assert_eq!(p, Plan::AddCa(CaReason::NoCaKey));
        assert_eq!(cas(&next.unwrap()), 2);
    }

    #[test]
    fn bad_secrets_are_named_and_repaired() {
        let s = bundle(T0, 3650, 365);
        let mut bad_key = s.clone();
        bad_key.key_pem = Some("junk".into());
        let a = assess(&bad_key, T0);
        assert!(a.has(SecretProblem::LeafInvalid), "{:?}", a.problems);
        let (p, next) = step(&bad_key, T0, true);
        assert_eq!(p, Plan::IssueLeaf(LeafReason::Invalid));
        assert_eq!(next.unwrap().ca_pem, s.ca_pem);

        let mut bad_ca = s.clone();
        bad_ca.ca_pem =
            Some("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into());
        let a = assess(&bad_ca, T0);
        assert!(a.has(SecretProblem::CaCertInvalid), "{}", a.describe());
        let (p, next) = step(&bad_ca, T0, true);
        assert_eq!(p, Plan::Regenerate(SecretProblem::CaCertInvalid));
        let next = next.unwrap();
        assert!(assess(&next, T0).problems.is_empty());
        assert_eq!(cas(&next), 1);

        let mut foreign_key = s.clone();
        foreign_key.ca_key_pem = bundle(T0, 10, 10).ca_key_pem;
        let a = assess(&foreign_key, T0);
        assert!(a.has(SecretProblem::CaKeyInvalid), "{}", a.describe());
        assert_eq!(
            step(&foreign_key, T0, true).0,
            Plan::AddCa(CaReason::CaKeyInvalid)
        );

        let expired = bundle(T0, 3650, 10);
        let a = assess(&expired, T0 + 11 * DAY);
        assert!(a.describe().contains("expired"), "{}", a.describe());
        assert_eq!(
            step(&expired, T0 + 11 * DAY, true).0,
            Plan::IssueLeaf(LeafReason::Invalid)
        );
    }

    #[test]
    fn the_leaf_never_outlives_its_ca() {
        let s = bundle(T0, 100, 365);
        let a = assess(&s, T0);
        assert_eq!(a.leaf.unwrap().0.not_after, a.trust[0].not_after);
    }

    #[test]
    fn the_stored_values_round_trip_through_a_secret() {
        let s = bundle(T0, 3650, 365);
        let secret = s.to_secret("ns", "name");
        assert_eq!(StoredBundle::from_secret(&secret), s);
    }
}
