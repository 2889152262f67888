//! Watch-backed sources for the Pod webhook in cluster (spec 000 "Mutating Pod webhook": the
//! CacheBackends are a live list, so a backend that just became Ready is never missed; spec 004:
//! the `ModelCache` a pod names).
//!
//! Each source is a `kube::runtime::reflector` store fed by a watcher over every namespace. The
//! webhook reads the store synchronously (no API call on the admission path); the watcher
//! re-lists after any error, so the store converges to the apiserver's state.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ic_shared::crd::{CacheBackend, ModelCache, ModelCacheStatus};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{BackendSource, ModelCacheSource};

/// CacheBackends from a reflector store.
#[derive(Clone)]
pub struct StoreBackends(pub Store<CacheBackend>);

impl BackendSource for StoreBackends {
    fn list(&self, namespace: &str) -> Vec<Arc<CacheBackend>> {
        let mut all = self.0.state();
        all.retain(|cb| cb.metadata.namespace.as_deref() == Some(namespace));
        all
    }
}

/// ModelCache statuses from a reflector store.
#[derive(Clone)]
pub struct StoreModelCaches(pub Store<ModelCache>);

impl ModelCacheSource for StoreModelCaches {
    fn status(&self, namespace: &str, name: &str) -> Option<ModelCacheStatus> {
        let key = reflector::ObjectRef::<ModelCache>::new(name).within(namespace);
        self.0.get(&key).and_then(|mc| mc.status.clone())
    }
}

/// Starts a watcher over every namespace feeding a store; the task ends when `shutdown` turns
/// true. Watch errors are logged (rate-limited by the watcher's backoff) and the watch restarts
/// with a fresh list.
pub fn spawn_store<K>(
    client: Client,
    what: &'static str,
    mut shutdown: watch::Receiver<bool>,
) -> (Store<K>, JoinHandle<()>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
{
    let (reader, writer) = reflector::store::<K>();
    let api: Api<K> = Api::all(client);
    let stream = watcher(api, watcher::Config::default())
        .backoff(crate::reconcile::backoff::watch_backoff())
        .reflect(writer);
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => break,
                item = stream.next() => match item {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, resource = what, "watch failed; re-listing");
                    }
                    None => break,
                },
            }
        }
    });
    (reader, task)
}

/// Waits until `store` has seen its first complete list, at most `timeout`. Returns whether it
/// did (the caller serves anyway, logging that early pods may be admitted unwired).
pub async fn wait_ready<K>(store: &Store<K>, timeout: Duration) -> bool
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    tokio::time::timeout(timeout, store.wait_until_ready())
        .await
        .is_ok_and(|r| r.is_ok())
}

/// Both stores the Pod webhook reads, as trait objects.
pub fn pod_sources(
    backends: Store<CacheBackend>,
    model_caches: Option<Store<ModelCache>>,
) -> (Arc<dyn BackendSource>, Option<Arc<dyn ModelCacheSource>>) {
    (
        Arc::new(StoreBackends(backends)),
        model_caches.map(|s| Arc::new(StoreModelCaches(s)) as Arc<dyn ModelCacheSource>),
    )
}
