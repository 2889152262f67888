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
//!
//! Split by concept: `rotation.rs` is the pure rotation machine over the stored bundle
//! ([`StoredBundle`], [`assess`], [`plan`], [`apply`]); `keeper.rs` runs it against the Secret
//! ([`CertKeeper`], [`spawn_cert_keeper`], the metrics); `webhook_config.rs` keeps the webhook
//! configurations' `caBundle` ([`sync_ca_bundles`], [`spawn_ca_bundle_keeper`]). The Secret's
//! keys and the shared error type live here.

use super::tls::TlsError;

mod keeper;
mod rotation;
mod webhook_config;

pub use keeper::{
    spawn_cert_keeper, unix_now, CertKeeper, CertMetrics, SelfSignedSecret, TickReport,
};
pub use rotation::{
    apply, assess, plan, Assessment, CaReason, LeafReason, Plan, RotationPolicy, SecretProblem,
    StoredBundle,
};
pub use webhook_config::{spawn_ca_bundle_keeper, sync_ca_bundles, CaBundleSync};

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
