//! The kube-fake-client cluster-scope shim, left only for `incluster_run.rs` while it still runs
//! against the in-memory fake (the node-loop and CacheIndex tests run against the bare real
//! apiserver, whose CacheNode and CacheIndex are cluster-scoped). Delete this module with that
//! file's port.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

/// kube-fake-client 0.3.0 registers every custom resource as namespaced, but CacheNode and
/// CacheIndex are cluster-scoped: this shim maps their cluster-scoped URLs of single objects
/// (get, create, status patch) onto one namespace of the in-memory store, so the controller's
/// cluster-scoped calls run unchanged. Lists across the store need no mapping.
#[derive(Clone)]
pub struct ClusterScopeShim(pub kube::Client);

impl tonic::codegen::Service<tonic::codegen::http::Request<kube::client::Body>>
    for ClusterScopeShim
{
    type Response = tonic::codegen::http::Response<kube::client::Body>;
    type Error = kube::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: tonic::codegen::http::Request<kube::client::Body>) -> Self::Future {
        const GROUP: &str = "/apis/inferencecache.io/v1alpha1/";
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_default();
        for plural in ["cachenodes", "cacheindexes"] {
            if let Some(rest) = pq.strip_prefix(GROUP).and_then(|p| p.strip_prefix(plural)) {
                if rest.starts_with('/') || req.method() == tonic::codegen::http::Method::POST {
                    *req.uri_mut() = format!("{GROUP}namespaces/cluster-scope/{plural}{rest}")
                        .parse()
                        .unwrap();
                }
            }
        }
        let client = self.0.clone();
        Box::pin(async move { client.send(req).await })
    }
}

/// A client over the in-memory API with the shim in front.
pub fn cluster_scoped(client: kube::Client) -> kube::Client {
    kube::Client::new(ClusterScopeShim(client), "default")
}
