//! The webhook configurations' `caBundle`: set on every webhook of the Mutating- and
//! ValidatingWebhookConfiguration of one name, and kept there periodically (a `helm upgrade`
//! re-applies them with an empty `caBundle`). Writes only a differing value, with the read
//! `resourceVersion`.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::api::PostParams;
use kube::{Api, Client};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::tls;

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
