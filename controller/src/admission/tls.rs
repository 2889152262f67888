//! Webhook serving certificates (rustls, ring provider).
//!
//! Two modes:
//!
//! - **Files, hot-reloaded** (primary; the chart's cert-manager `Certificate` mounts a Secret
//!   with `tls.crt` / `tls.key`). [`spawn_reloader`] polls the files' modification time and size
//!   and, when either changes, builds a new rustls config and swaps it into the running server
//!   (`RustlsConfig::reload_from_config`); new connections get the new certificate, established
//!   ones keep theirs. A half-written pair (cert and key not matching yet) is refused and the old
//!   certificate keeps serving until the next poll. cert-manager's CA injector fills the webhook
//!   configurations' `caBundle`.
//! - **Self-signed** ([`generate_self_signed`]): an in-memory CA (ECDSA P-256, rcgen) signs a
//!   serving certificate for the Service DNS names ([`service_dns_names`]). The CA PEM is
//!   returned (and optionally written next to the pair by [`write_bundle`]) so that the caller can
//!   put it into the MutatingWebhookConfiguration / ValidatingWebhookConfiguration:
//!   [`set_ca_bundle`] sets `webhooks[].clientConfig.caBundle` on a configuration object, ready
//!   to be applied. Writing it into the cluster is the in-cluster controller's job.
//!   [`generate_ca`] and [`issue_serving`] take the issue time and lifetime explicitly (the
//!   rotation of `super::ca_bundle` and its tests inject time), and [`parse_certs`] reads what
//!   the rotation decides on ([`CertInfo`]: validity, key identifiers, public key).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum_server::tls_rustls::RustlsConfig;
use base64::Engine as _;
use k8s_openapi::jiff::{tz::TimeZone, Timestamp};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::Value;

/// File names the self-signed mode writes (the same names a `kubernetes.io/tls` Secret uses,
/// plus the CA).
pub const CERT_FILE: &str = "tls.crt";
/// Private key file name.
pub const KEY_FILE: &str = "tls.key";
/// CA bundle file name.
pub const CA_FILE: &str = "ca.crt";

/// Default poll interval of the certificate-file watcher.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// Certificate errors.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate or key file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Writing the self-signed bundle failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The certificate PEM holds no certificate or does not parse.
    #[error("certificate PEM: {0}")]
    CertPem(String),
    /// The key PEM holds no private key or does not parse.
    #[error("private key PEM: {0}")]
    KeyPem(String),
    /// rustls refused the pair (e.g. the key does not match the certificate).
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// Certificate generation failed.
    #[error("generating the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A certificate's `notBefore` or `notAfter` (Unix seconds) is past what a certificate
    /// can carry (the year 9999, RFC 5280 §4.1.2.5): a lifetime too long.
    #[error("certificate validity: {0}")]
    Validity(String),
}

/// Where the serving certificate comes from.
#[derive(Debug, Clone)]
pub enum TlsSource {
    /// PEM files, watched and hot-reloaded.
    Files {
        /// Certificate chain (`tls.crt`).
        cert: PathBuf,
        /// Private key (`tls.key`).
        key: PathBuf,
        /// Poll interval of the watcher.
        reload_interval: Duration,
    },
    /// A certificate generated at start, signed by a fresh CA.
    SelfSigned(SelfSignedOptions),
    /// A PEM pair held in memory (e.g. a self-signed bundle shared by several replicas through
    /// a Secret, so that every replica serves a certificate of the one CA in `caBundle`).
    Pem {
        /// Certificate chain PEM.
        cert_pem: String,
        /// Private key PEM.
        key_pem: String,
        /// The CA to report in `RunningServer::ca_pem`, if the caller has one.
        ca_pem: Option<String>,
    },
}

/// Options of the self-signed mode.
#[derive(Debug, Clone, Default)]
pub struct SelfSignedOptions {
    /// DNS names (and IP literals) of the serving certificate; see [`service_dns_names`].
    pub subject_alt_names: Vec<String>,
    /// When set, `tls.crt`, `tls.key` and `ca.crt` are written here.
    pub write_dir: Option<PathBuf>,
}

/// A generated CA and serving pair, all PEM.
#[derive(Debug, Clone)]
pub struct SelfSignedBundle {
    /// The CA certificate: the `caBundle` webhook configurations must carry.
    pub ca_pem: String,
    /// The serving certificate, signed by the CA.
    pub cert_pem: String,
    /// The serving certificate's private key (PKCS#8).
    pub key_pem: String,
}

impl SelfSignedBundle {
    /// The CA as a `caBundle` value (base64 of the PEM).
    pub fn ca_bundle_base64(&self) -> String {
        ca_bundle_base64(&self.ca_pem)
    }
}

/// The names a webhook Service is reached by: `svc`, `svc.ns`, `svc.ns.svc`,
/// `svc.ns.svc.cluster.local` (the apiserver dials `svc.ns.svc`).
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Common name prefix of the CAs this module generates (the issue time in Unix seconds follows,
/// so two CAs of one installation, old and new during a rotation, tell apart in `openssl x509`).
pub const CA_COMMON_NAME: &str = "inference-cache webhook CA";

/// How far back `notBefore` is set from the issue time (clock skew between the controller and
/// the apiserver that verifies the certificate).
pub const BACKDATE: Duration = Duration::from_secs(3600);

/// A CA certificate and its private key, PEM (PKCS#8 key).
#[derive(Debug, Clone)]
pub struct CaPair {
    /// The CA certificate.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

/// A serving (leaf) certificate and its private key, PEM (PKCS#8 key).
#[derive(Debug, Clone)]
pub struct LeafPair {
    /// The serving certificate, signed by a [`CaPair`].
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// Sets `params`' validity to [`BACKDATE`] before `now_unix` until `not_after_unix` (whole
/// Unix seconds; negative values clamp to the epoch). The UTC calendar date and time of day of
/// each instant come from jiff.
///
/// Errors: [`TlsError::Validity`] for an instant past jiff's range (the year 9999, beyond
/// which X.509 has no date either).
fn set_validity(
    params: &mut rcgen::CertificateParams,
    now_unix: i64,
    not_after_unix: i64,
) -> Result<(), TlsError> {
    let at = |unix: i64| {
        let t = Timestamp::from_second(unix.max(0))
            .map_err(|e| TlsError::Validity(format!("{unix} Unix seconds: {e}")))?;
        let dt = TimeZone::UTC.to_datetime(t);
        let day = rcgen::date_time_ymd(
            i32::from(dt.year()),
            dt.month().unsigned_abs(),
            dt.day().unsigned_abs(),
        );
        let time_of_day =
            i64::from(dt.hour()) * 3600 + i64::from(dt.minute()) * 60 + i64::from(dt.second());
        Ok::<_, TlsError>(day + Duration::from_secs(time_of_day.unsigned_abs()))
    };
    params.not_before = at(now_unix.saturating_sub(secs(BACKDATE)))?;
    params.not_after = at(not_after_unix)?;
    Ok(())
}

fn ca_params(common_name: &str) -> Result<rcgen::CertificateParams, TlsError> {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok(ca_params)
}

/// Generates a CA (ECDSA P-256) valid from `now_unix` − [`BACKDATE`] to `now_unix + lifetime`
/// (Unix seconds), common name `inference-cache webhook CA <now_unix>`.
/// Errors: [`TlsError::Generate`], [`TlsError::Validity`] (a lifetime past the year 9999).
pub fn generate_ca(now_unix: i64, lifetime: Duration) -> Result<CaPair, TlsError> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = ca_params(&format!("{CA_COMMON_NAME} {now_unix}"))?;
    set_validity(
        &mut params,
        now_unix,
        now_unix.saturating_add(secs(lifetime)),
    )?;
    let cert = params.self_signed(&key)?;
    Ok(CaPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Issues a serving certificate for `subject_alt_names` (DNS names or IP literals; the first is
/// the common name), signed by `ca`, valid from `now_unix` − [`BACKDATE`] to `now_unix +
/// lifetime` but never past the CA's own `notAfter` (Unix seconds). It carries an authority key
/// identifier, which [`CertInfo::issued_by`] matches against the CA's subject key identifier.
///
/// Errors: [`TlsError::CertPem`] (the CA certificate does not parse), [`TlsError::KeyPem`] (the
/// CA key does not parse or is not the certificate's), [`TlsError::Generate`],
/// [`TlsError::Validity`] (a lifetime past the year 9999).
pub fn issue_serving(
    ca: &CaPair,
    subject_alt_names: &[String],
    now_unix: i64,
    lifetime: Duration,
) -> Result<LeafPair, TlsError> {
    let ca_info = parse_certs(ca.cert_pem.as_bytes())?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::CertPem("no CA certificate found".to_string()))?;
    let ca_key =
        rcgen::KeyPair::from_pem(&ca.key_pem).map_err(|e| TlsError::KeyPem(e.to_string()))?;
    if !ca_info.has_public_key(&ca_key) {
        return Err(TlsError::KeyPem(
            "the CA key is not the CA certificate's key".to_string(),
        ));
    }
    let issuer = rcgen::Issuer::new(ca_params(&ca_info.common_name)?, ca_key);

    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(subject_alt_names.to_vec())?;
    let cn = subject_alt_names
        .first()
        .cloned()
        .unwrap_or_else(|| "inference-cache-webhook".to_string());
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    params.is_ca = rcgen::IsCa::ExplicitNoCa;
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    set_validity(
        &mut params,
        now_unix,
        now_unix
            .saturating_add(secs(lifetime))
            .min(ca_info.not_after),
    )?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(LeafPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Generates a CA and a serving certificate for `subject_alt_names` (DNS names or IP literals),
/// both valid from an hour ago for ten years: the single-replica mode without a Secret, which
/// generates anew on every start and never rotates. Errors: [`TlsError::Generate`].
pub fn generate_self_signed(subject_alt_names: &[String]) -> Result<SelfSignedBundle, TlsError> {
    let now = Timestamp::now().as_second();
    let ten_years = Duration::from_secs(10 * 365 * 86_400);
    let ca = generate_ca(now, ten_years)?;
    let leaf = issue_serving(&ca, subject_alt_names, now, ten_years)?;
    Ok(SelfSignedBundle {
        ca_pem: ca.cert_pem,
        cert_pem: leaf.cert_pem,
        key_pem: leaf.key_pem,
    })
}

/// What the rotation needs to know of one certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// `notBefore`, Unix seconds.
    pub not_before: i64,
    /// `notAfter`, Unix seconds.
    pub not_after: i64,
    /// The subject's first common name (empty when none).
    pub common_name: String,
    /// basicConstraints CA flag.
    pub is_ca: bool,
    /// The SubjectPublicKeyInfo, DER.
    pub public_key_der: Vec<u8>,
    /// The subjectKeyIdentifier extension, when present.
    pub subject_key_id: Option<Vec<u8>>,
    /// The authorityKeyIdentifier's key identifier, when present.
    pub authority_key_id: Option<Vec<u8>>,
}

impl CertInfo {
    /// Whether `key` is this certificate's key (same SubjectPublicKeyInfo).
    pub fn has_public_key(&self, key: &rcgen::KeyPair) -> bool {
        use rcgen::PublicKeyData as _;
        key.subject_public_key_info() == self.public_key_der
    }

    /// Whether `ca` issued this certificate (its authority key identifier is the CA's subject
    /// key identifier; the signature itself is not verified: whoever can write the Secret can
    /// write any certificate into it).
    pub fn issued_by(&self, ca: &CertInfo) -> bool {
        matches!((&self.authority_key_id, &ca.subject_key_id), (Some(a), Some(s)) if a == s)
    }
}

/// Every certificate of a PEM text, in order.
///
/// Errors: [`TlsError::CertPem`] when the text holds no certificate, or a PEM block or its DER
/// does not parse.
pub fn parse_certs(pem: &[u8]) -> Result<Vec<CertInfo>, TlsError> {
    use x509_parser::extensions::ParsedExtension;
    let mut out = Vec::new();
    for der in CertificateDer::pem_slice_iter(pem) {
        let der = der.map_err(|e| TlsError::CertPem(e.to_string()))?;
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| TlsError::CertPem(format!("certificate {}: {e}", out.len() + 1)))?;
        let mut info = CertInfo {
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
            common_name: cert
                .subject()
                .iter_common_name()
                .next()
                .and_then(|cn| cn.as_str().ok())
                .unwrap_or_default()
                .to_string(),
            is_ca: cert.is_ca(),
            public_key_der: cert.public_key().raw.to_vec(),
            subject_key_id: None,
            authority_key_id: None,
        };
        for ext in cert.extensions() {
            match ext.parsed_extension() {
                ParsedExtension::SubjectKeyIdentifier(k) => {
                    info.subject_key_id = Some(k.0.to_vec())
                }
                ParsedExtension::AuthorityKeyIdentifier(a) => {
                    info.authority_key_id = a.key_identifier.as_ref().map(|k| k.0.to_vec())
                }
                _ => {}
            }
        }
        out.push(info);
    }
    if out.is_empty() {
        return Err(TlsError::CertPem("no certificate found".to_string()));
    }
    Ok(out)
}

/// Paths of a written bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenBundle {
    /// `dir/tls.crt`.
    pub cert: PathBuf,
    /// `dir/tls.key` (mode 0600 on Unix).
    pub key: PathBuf,
    /// `dir/ca.crt`.
    pub ca: PathBuf,
}

/// Writes `tls.crt`, `tls.key` and `ca.crt` into `dir` (created if missing). Each file is
/// written to a temporary name and renamed, so a watcher never reads half a file.
pub fn write_bundle(dir: &Path, bundle: &SelfSignedBundle) -> Result<WrittenBundle, TlsError> {
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let out = WrittenBundle {
        cert: dir.join(CERT_FILE),
        key: dir.join(KEY_FILE),
        ca: dir.join(CA_FILE),
    };
    write_atomic(&out.ca, bundle.ca_pem.as_bytes(), false)?;
    write_atomic(&out.key, bundle.key_pem.as_bytes(), true)?;
    write_atomic(&out.cert, bundle.cert_pem.as_bytes(), false)?;
    Ok(out)
}

fn write_atomic(path: &Path, bytes: &[u8], private: bool) -> Result<(), TlsError> {
    let tmp = path.with_extension("tmp");
    let err = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(err)?;
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    #[cfg(not(unix))]
    let _ = private;
    std::fs::rename(&tmp, path).map_err(err)
}

/// A `caBundle` value: base64 of the CA PEM.
pub fn ca_bundle_base64(ca_pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes())
}

/// Sets `webhooks[*].clientConfig.caBundle` of a MutatingWebhookConfiguration or
/// ValidatingWebhookConfiguration (as JSON) to `ca_pem`, creating `clientConfig` where missing.
/// Returns how many webhooks were updated. The caller applies the object (in-cluster mode).
pub fn set_ca_bundle(webhook_configuration: &mut Value, ca_pem: &str) -> usize {
    let bundle = Value::String(ca_bundle_base64(ca_pem));
    let Some(hooks) = webhook_configuration
        .get_mut("webhooks")
        .and_then(Value::as_array_mut)
    else {
        return 0;
    };
    let mut n = 0;
    for hook in hooks.iter_mut().filter_map(Value::as_object_mut) {
        let cc = hook
            .entry("clientConfig")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(cc) = cc.as_object_mut() {
            cc.insert("caBundle".to_string(), bundle.clone());
            n += 1;
        }
    }
    n
}

/// A rustls server config (ring provider; ALPN h2 and http/1.1) from PEM bytes.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<rustls::ServerConfig, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::CertPem(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::CertPem("no certificate found".to_string()));
    }
    let key =
        PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::KeyPem(e.to_string()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// The leaf (first) certificate's `notAfter` in a PEM chain, as Unix seconds.
///
/// Errors: [`TlsError::CertPem`] when the PEM holds no certificate or its DER does not parse.
pub fn leaf_not_after_unix(cert_pem: &[u8]) -> Result<i64, TlsError> {
    let leaf = CertificateDer::pem_slice_iter(cert_pem)
        .next()
        .ok_or_else(|| TlsError::CertPem("no certificate found".to_string()))?
        .map_err(|e| TlsError::CertPem(e.to_string()))?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|e| TlsError::CertPem(format!("leaf certificate: {e}")))?;
    Ok(cert.validity().not_after.timestamp())
}

/// Sets `gauge` to the leaf certificate's `notAfter` (Unix seconds); logs and leaves it when the
/// certificate does not parse (the pair loaded, so rustls accepted it: this is only the metric).
pub fn record_not_after(gauge: Option<&prometheus::IntGauge>, cert_pem: &[u8]) {
    let Some(g) = gauge else { return };
    match leaf_not_after_unix(cert_pem) {
        Ok(t) => g.set(t),
        Err(e) => {
            tracing::warn!(error = %e, "webhook certificate expiry not readable for the metric")
        }
    }
}

/// Reads a cert/key pair from files into a rustls config.
pub fn server_config_from_files(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, TlsError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| TlsError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    server_config_from_pem(&read(cert)?, &read(key)?)
}

/// The (mtime, size) pair of both files; `None` entries for files that cannot be read.
type Stamp = [Option<(SystemTime, u64)>; 2];

fn stamp(cert: &Path, key: &Path) -> Stamp {
    let one = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())))
    };
    [one(cert), one(key)]
}

/// Watches `cert`/`key` every `interval` and reloads `config` when their modification time or
/// size changes (cert-manager rotation, a Secret update). A pair that fails to load is logged
/// and retried on the next change or poll; the running certificate stays until a good pair
/// loads; `expiry` (when given) follows the certificate that serves. The task ends when the
/// returned handle is aborted.
pub fn spawn_reloader(
    config: RustlsConfig,
    cert: PathBuf,
    key: PathBuf,
    interval: Duration,
    expiry: Option<prometheus::IntGauge>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut loaded = stamp(&cert, &key);
        let mut failed: Option<Stamp> = None;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let now = stamp(&cert, &key);
            if now == loaded {
                continue;
            }
            match server_config_from_files(&cert, &key) {
                Ok(sc) => {
                    if let Ok(pem) = std::fs::read(&cert) {
                        record_not_after(expiry.as_ref(), &pem);
                    }
                    config.reload_from_config(Arc::new(sc));
                    loaded = now;
                    failed = None;
                    tracing::info!(cert = %cert.display(), "webhook serving certificate reloaded");
                }
                Err(e) => {
                    if failed != Some(now) {
                        tracing::warn!(error = %e, cert = %cert.display(),
                            "webhook certificate files changed but do not load; keeping the current certificate");
                        failed = Some(now);
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The validity written is the instants asked for, to the second (the calendar date and
    /// time of day from jiff): `notBefore` an hour back, `notAfter` the lifetime on, across a
    /// leap day; a lifetime past the year 9999 is an error, not a panic.
    #[test]
    fn validity_is_written_to_the_second_and_a_lifetime_past_year_9999_is_an_error() {
        // 2028-02-28T23:59:30Z: the lifetime runs over 2028-02-29.
        let now = 1_835_395_170;
        let lifetime = Duration::from_secs(2 * 86_400 + 45);
        let ca = generate_ca(now, lifetime).unwrap();
        let info = &parse_certs(ca.cert_pem.as_bytes()).unwrap()[0];
        assert_eq!(info.not_before, now - secs(BACKDATE));
        assert_eq!(info.not_after, now + 2 * 86_400 + 45);
        let leaf = issue_serving(&ca, &["localhost".to_string()], now, lifetime).unwrap();
        let leaf_info = &parse_certs(leaf.cert_pem.as_bytes()).unwrap()[0];
        assert_eq!(
            leaf_info.not_after, info.not_after,
            "capped at the CA's notAfter"
        );
        // Before the epoch: clamped to it, as before.
        let early = generate_ca(-10 * 86_400, lifetime).unwrap();
        assert_eq!(
            parse_certs(early.cert_pem.as_bytes()).unwrap()[0].not_before,
            0
        );
        match generate_ca(now, Duration::MAX) {
            Err(TlsError::Validity(msg)) => assert!(msg.contains("Unix seconds"), "{msg}"),
            other => panic!("want a Validity error, got {other:?}"),
        }
    }

    #[test]
    fn leaf_expiry_is_read_from_the_first_certificate_and_junk_is_an_error() {
        let b = generate_self_signed(&["localhost".to_string()]).unwrap();
        let leaf = leaf_not_after_unix(b.cert_pem.as_bytes()).unwrap();
        // The chain order matters: the leaf, not the CA that follows it.
        let chain = format!("{}{}", b.cert_pem, b.ca_pem);
        assert_eq!(leaf_not_after_unix(chain.as_bytes()).unwrap(), leaf);
        assert!(matches!(
            leaf_not_after_unix(b"junk"),
            Err(TlsError::CertPem(_))
        ));
    }

    #[test]
    fn self_signed_pair_loads() {
        let b = generate_self_signed(&service_dns_names("ic-webhook", "ic-system")).unwrap();
        assert!(b.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        server_config_from_pem(b.cert_pem.as_bytes(), b.key_pem.as_bytes()).unwrap();
        let other = generate_self_signed(&["x".to_string()]).unwrap();
        assert!(server_config_from_pem(b.cert_pem.as_bytes(), other.key_pem.as_bytes()).is_err());
    }

    #[test]
    fn ca_bundle_is_set_on_every_webhook() {
        let mut cfg = json!({"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "webhooks": [{"name": "a", "clientConfig": {"service": {"name": "s"}}}, {"name": "b"}]});
        assert_eq!(set_ca_bundle(&mut cfg, "PEM"), 2);
        assert_eq!(cfg["webhooks"][0]["clientConfig"]["caBundle"], "UEVN");
        assert_eq!(cfg["webhooks"][0]["clientConfig"]["service"]["name"], "s");
        assert_eq!(cfg["webhooks"][1]["clientConfig"]["caBundle"], "UEVN");
    }
}
