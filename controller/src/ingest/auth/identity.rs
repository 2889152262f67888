//! Who a stream claims to be, read from what it sends: the agents' service account
//! ([`ServiceAccountRef`], `NAMESPACE:NAME`) and a per-pod subscriber's [`PodScope`] (from
//! `Hello.pod_subscriber`), which holds its streams to its own pod.

use std::str::FromStr;

use super::AuthError;

/// A service account, `NAMESPACE:NAME` on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccountRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl ServiceAccountRef {
    /// The username its tokens authenticate as: `system:serviceaccount:NS:NAME`.
    pub fn username(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }
}

impl FromStr for ServiceAccountRef {
    type Err = String;

    /// Parses `NAMESPACE:NAME` (both non-empty).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some((ns, name))
                if !ns.trim().is_empty() && !name.trim().is_empty() && !name.contains(':') =>
            {
                Ok(ServiceAccountRef {
                    namespace: ns.trim().to_string(),
                    name: name.trim().to_string(),
                })
            }
            _ => Err(format!(
                "expected NAMESPACE:NAME (e.g. inference-cache:inference-cache-agent), got {s:?}"
            )),
        }
    }
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.namespace, self.name)
    }
}

/// The pod a per-pod subscriber stream speaks for (`Hello.pod_subscriber` plus `Hello.node`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodScope {
    /// Node the pod runs on.
    pub node: String,
    /// The pod's namespace: the only tenant the stream may report.
    pub namespace: String,
    /// The pod's name: the only replica (`pod`, `pod#rank`) the stream may report.
    pub pod: String,
}

impl PodScope {
    /// The scope a Hello claims: `None` for a node agent, an error when `pod_subscriber` is
    /// present with an empty or malformed namespace or pod, or without a node.
    pub fn from_hello(hello: &ic_shared::proto::Hello) -> Result<Option<PodScope>, AuthError> {
        let Some(sub) = &hello.pod_subscriber else {
            return Ok(None);
        };
        let valid = |v: &str| !v.is_empty() && v.trim() == v && !v.contains(['/', '#', ':']);
        if !valid(&sub.namespace) || !valid(&sub.pod) {
            return Err(AuthError::InvalidSubscriber(format!(
                "namespace {:?} and pod {:?} must be non-empty Kubernetes names",
                sub.namespace, sub.pod
            )));
        }
        if hello.node.trim().is_empty() || hello.node.contains('/') {
            return Err(AuthError::InvalidSubscriber(format!(
                "Hello.node {:?} must name the pod's node",
                hello.node
            )));
        }
        Ok(Some(PodScope {
            node: hello.node.clone(),
            namespace: sub.namespace.clone(),
            pod: sub.pod.clone(),
        }))
    }

    /// `namespace/pod`.
    pub fn pod_ref(&self) -> String {
        format!("{}/{}", self.namespace, self.pod)
    }

    /// The key the registry and the index file the stream's state under, apart from the node
    /// agent's (whose key is the bare node name, which never contains `/`):
    /// `<node>/<namespace>/<pod>`.
    pub fn reporter_key(&self) -> String {
        format!("{}/{}/{}", self.node, self.namespace, self.pod)
    }

    /// Whether the stream may report `desc`: tenant = the namespace, replica = the pod (rank 0)
    /// or `pod#rank`, stream id = `namespace/pod#rank`.
    pub fn authorize(&self, desc: &ic_shared::proto::StreamDescriptor) -> Result<(), AuthError> {
        let rank = desc.dp_rank;
        let want_replica = if rank == 0 {
            self.pod.clone()
        } else {
            format!("{}#{rank}", self.pod)
        };
        let want_stream = format!("{}/{}#{rank}", self.namespace, self.pod);
        let checks = [
            ("tenant", &desc.tenant, self.namespace.clone()),
            ("replica", &desc.replica, want_replica),
            ("stream id", &desc.stream_id, want_stream),
        ];
        for (field, got, want) in checks {
            if *got != want {
                return Err(AuthError::StreamOutOfScope {
                    pod: self.pod_ref(),
                    stream_id: desc.stream_id.clone(),
                    field,
                    got: got.clone(),
                    want,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::ingest::auth::tests::{agent_hello, subscriber_hello};

    #[test]
    fn service_account_refs_parse() {
        let sa: ServiceAccountRef = "ic:agent".parse().unwrap();
        assert_eq!(sa.username(), "system:serviceaccount:ic:agent");
        assert!("ic".parse::<ServiceAccountRef>().is_err());
        assert!(":agent".parse::<ServiceAccountRef>().is_err());
        assert!("ic:".parse::<ServiceAccountRef>().is_err());
        assert!("a:b:c".parse::<ServiceAccountRef>().is_err());
    }

    #[test]
    fn a_scope_is_read_from_hello_only_when_claimed() {
        assert_eq!(PodScope::from_hello(&agent_hello("n", "t")), Ok(None));
        let scope = PodScope::from_hello(&subscriber_hello("n", "ns", "p", "t"))
            .unwrap()
            .unwrap();
        assert_eq!(scope.pod_ref(), "ns/p");
        assert!(PodScope::from_hello(&subscriber_hello("", "ns", "p", "t")).is_err());
    }
}
