//! Following every object of one kind cluster-wide (a reflector over `watch`): the CachePolicy
//! table and the CacheTenant quotas are both "the whole set, after every change".

use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// Watches every `K` of the cluster and calls `on_change` with the whole stored set after the
/// initial list is complete and after each change, until `shutdown` is true. Watch errors are
/// logged (naming `what`) and the watcher re-lists with back-off.
pub async fn follow_all<K, F, Fut>(
    client: Client,
    what: &str,
    mut shutdown: watch::Receiver<bool>,
    mut on_change: F,
) where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone,
    F: FnMut(Vec<K>) -> Fut,
    Fut: Future<Output = ()>,
{
    let (reader, writer) = reflector::store::<K>();
    let stream = watcher(Api::<K>::all(client), watcher::Config::default())
        .backoff(super::backoff::watch_backoff())
        .reflect(writer);
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => return,
            item = stream.next() => match item {
                // The initial list is applied once it is complete (InitDone).
                Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
                Some(Ok(_)) => {
                    let all: Vec<K> = reader.state().iter().map(|o| (**o).clone()).collect();
                    on_change(all).await;
                }
                Some(Err(e)) => tracing::warn!(error = %e, "{what} watch failed; re-listing"),
                None => return,
            },
        }
    }
}
