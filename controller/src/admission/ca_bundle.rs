//! Self-signed webhook certificates in cluster (docs/admission.md "Certificates"): one CA and
//! serving pair shared by every controller replica through a Secret, and the CA kept in the
//! webhook configurations' `caBundle`.
//!
//! - [`shared_self_signed`]: the replica that finds no Secret generates the bundle
//!   ([`tls::generate_self_signed`]) and creates the Secret (`kubernetes.io/tls` with `ca.crt`);
//!   a replica that loses the create race (409) reads the winner's. So every replica serves a
//!   certificate of the one CA the apiserver trusts.
//! - [`sync_ca_bundles`] / [`spawn_ca_bundle_keeper`]: set `webhooks[*].clientConfig.caBundle`
//!   on the MutatingWebhookConfiguration and the ValidatingWebhookConfiguration of that name,
//!   and keep doing so periodically — a `helm upgrade` re-applies the templates with an empty
//!   `caBundle`, which would otherwise break the fail-closed CacheBackend webhooks until the
//!   next restart. Writes only when a value differs; replaces with the read `resourceVersion`, so
//!   a concurrent edit is retried on the next tick, never overwritten.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::tls::{self, SelfSignedBundle, TlsError};

/// Secret data key of the CA certificate.
pub const CA_KEY: &str = "ca.crt";
/// Secret data key of the serving certificate.
pub const CERT_KEY: &str = "tls.crt";
/// Secret data key of the serving key.
pub const KEY_KEY: &str = "tls.key";

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
    /// The Secret exists but does not hold a usable bundle.
    #[error(
        "Secret {namespace}/{name} exists but {problem}; delete it to have a new CA generated"
    )]
    BadSecret {
        /// Secret namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// What is wrong with it.
        problem: String,
    },
}

fn bundle_of(
    secret: &Secret,
    namespace: &str,
    name: &str,
) -> Result<SelfSignedBundle, CaBundleError> {
    let field = |key: &str| -> Result<String, CaBundleError> {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .ok_or_else(|| CaBundleError::BadSecret {
                namespace: namespace.to_string(),
                name: name.to_string(),
                problem: format!("has no {key}"),
            })?;
        String::from_utf8(bytes.0.clone()).map_err(|_| CaBundleError::BadSecret {
            namespace: namespace.to_string(),
            name: name.to_string(),
            problem: format!("its {key} is not PEM text"),
        })
    };
    let bundle = SelfSignedBundle {
        ca_pem: field(CA_KEY)?,
        cert_pem: field(CERT_KEY)?,
        key_pem: field(KEY_KEY)?,
    };
    tls::server_config_from_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes()).map_err(
        |e| CaBundleError::BadSecret {
            namespace: namespace.to_string(),
            name: name.to_string(),
            problem: format!("its certificate and key do not load ({e})"),
        },
    )?;
    Ok(bundle)
}

/// The self-signed bundle every replica shares: read from Secret `namespace/name`, or
/// generated for `subject_alt_names` and stored there when the Secret does not exist.
///
/// Errors: API failures ([`CaBundleError::Kube`]), a Secret that exists without a loadable
/// bundle ([`CaBundleError::BadSecret`]; it is never overwritten), generation failure.
pub async fn shared_self_signed(
    client: &Client,
    namespace: &str,
    name: &str,
    subject_alt_names: &[String],
) -> Result<SelfSignedBundle, CaBundleError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let kube_err = |what: &str| {
        let what = format!("{what} Secret {namespace}/{name}");
        move |source| CaBundleError::Kube {
            what,
            source: Box::new(source),
        }
    };
    if let Some(s) = api.get_opt(name).await.map_err(kube_err("reading"))? {
        return bundle_of(&s, namespace, name);
    }
    let bundle = tls::generate_self_signed(subject_alt_names)?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_string(),
                "inference-cache-controller".to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(BTreeMap::from([
            (
                CA_KEY.to_string(),
                ByteString(bundle.ca_pem.clone().into_bytes()),
            ),
            (
                CERT_KEY.to_string(),
                ByteString(bundle.cert_pem.clone().into_bytes()),
            ),
            (
                KEY_KEY.to_string(),
                ByteString(bundle.key_pem.clone().into_bytes()),
            ),
        ])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = %format!("{namespace}/{name}"), "generated the self-signed webhook CA and stored it for the other replicas");
            Ok(bundle)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {
            // Another replica created it first: serve its bundle.
            let s = api.get(name).await.map_err(kube_err("reading"))?;
            bundle_of(&s, namespace, name)
        }
        Err(e) => Err(kube_err("creating")(e)),
    }
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
