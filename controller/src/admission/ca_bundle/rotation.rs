//! The self-signed rotation as a pure machine: the bundle as the Secret stores it
//! ([`StoredBundle`]), what is wrong with it ([`assess`]), the next step of the timeline
//! ([`plan`], under a [`RotationPolicy`]) and the bundle that step writes ([`apply`]). No API
//! calls and no clock: `now` is an argument.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use k8s_openapi::ByteString;
use kube::api::ObjectMeta;

use crate::admission::tls::{self, CaPair, CertInfo, SelfSignedBundle, TlsError};

use super::*;

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
    pub(super) fn write_into(&self, secret: &mut Secret) {
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
