//! Host-network engine pods: the listeners the wiring depends on are declared as host ports
//! (`docs/pod-wiring.md` "Host network"; issue 14 item 1).
//!
//! On `hostNetwork: true` every listener of the pod is a listener of the node: a second wired
//! pod on the node cannot bind the LMCache MP worker's port, and its kvevent-subscriber would
//! dial the first pod's publisher at `127.0.0.1:5557`. [`declare_host_ports`] declares each such
//! listener as a `containerPort`/`hostPort` (TCP) on the **engine container**, so the scheduler
//! refuses to put two such pods on one node. The engine container is used, not the native
//! sidecar that owns the socket, because schedulers before kubernetes/kubernetes#132040
//! (1.33.x, 1.34) ignore the host ports of restartable init containers; the port's name says
//! whose it is, and the node agent's `ports` check expects the pod (by UID) to hold it.
//!
//! Names are `ic-…` (an IANA service name, ≤ 15 characters); a declared port of ours that the
//! pod no longer needs (it left the host network, a rank went away) is removed on re-admission.
//! A port another container already declares, or two listeners on one port, cannot be avoided
//! by declaration: [`declare_host_ports`] returns the reason, and the webhook admits the pod
//! unwired with it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ContainerPort, Pod};

/// Container-port name of the injected LMCache MP worker.
pub const MP_WORKER_PORT_NAME: &str = "ic-lmcache-mp";

/// Per-rank container-port name prefixes: the engine's KV-event publisher, its replay endpoint,
/// and the kvevent-subscriber that binds where the engine connects.
const KV_PUBLISHER: &str = "ic-kv-ev-";
const KV_REPLAY: &str = "ic-kv-rp-";
const KV_SUBSCRIBER: &str = "ic-kv-sub-";

/// `ic-kv-ev-<rank>`: the engine's KV-event publisher of data-parallel rank `rank`.
pub fn kv_publisher_port_name(rank: u32) -> String {
    format!("{KV_PUBLISHER}{rank}")
}

/// `ic-kv-rp-<rank>`: the engine's KV-event replay endpoint of rank `rank`.
pub fn kv_replay_port_name(rank: u32) -> String {
    format!("{KV_REPLAY}{rank}")
}

/// `ic-kv-sub-<rank>`: the kvevent-subscriber of rank `rank`, bound where the engine connects.
pub fn kv_subscriber_port_name(rank: u32) -> String {
    format!("{KV_SUBSCRIBER}{rank}")
}

fn ranked(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
}

/// True when `name` is the subscriber's own listener ([`kv_subscriber_port_name`]), not one
/// the engine binds.
pub fn is_subscriber_port_name(name: &str) -> bool {
    ranked(name, KV_SUBSCRIBER)
}

/// True for exactly the names this webhook declares (the forms above); a user's own port that
/// merely starts with `ic-` is not ours and is never removed.
pub fn is_injected_port_name(name: &str) -> bool {
    name == MP_WORKER_PORT_NAME
        || [KV_PUBLISHER, KV_REPLAY, KV_SUBSCRIBER]
            .iter()
            .any(|p| ranked(name, p))
}

/// A listener the wiring depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// TCP port in the pod's (here: the node's) network namespace.
    pub port: u16,
    /// Container-port name (`ic-…`, at most 15 characters).
    pub name: String,
    /// What listens, for messages (`the LMCache MP worker`).
    pub what: String,
    /// True when the engine itself binds it (its KV-event publisher): an engine declaration of
    /// the same port is that listener, not a collision.
    pub engine_owned: bool,
}

fn is_ours(p: &ContainerPort) -> bool {
    p.name.as_deref().is_some_and(is_injected_port_name)
}

fn is_tcp(p: &ContainerPort) -> bool {
    p.protocol.as_deref().unwrap_or("TCP") == "TCP"
}

/// Declares `listeners` as host ports on container `engine` of a `hostNetwork` pod (module
/// docs), or removes the declarations of ours when the pod is not on the host network.
///
/// Errors with the fail-open reason when a listener's port is already declared by another
/// container (or, for a listener the engine does not own, by the engine), or when two listeners
/// share a port.
pub fn declare_host_ports(
    pod: &mut Pod,
    engine: usize,
    listeners: &[Listener],
) -> Result<(), String> {
    let Some(spec) = pod.spec.as_mut() else {
        return Ok(());
    };
    let host_network = spec.host_network == Some(true);
    let wanted: &[Listener] = if host_network { listeners } else { &[] };

    let mut seen: BTreeMap<u16, &Listener> = BTreeMap::new();
    for l in wanted {
        if let Some(other) = seen.insert(l.port, l) {
            return Err(format!(
                "host-network pod: {} and {} would both listen on the node's port {}",
                other.what, l.what, l.port
            ));
        }
    }
    let engine_name = spec
        .containers
        .get(engine)
        .map(|c| c.name.clone())
        .unwrap_or_default();
    let declared_elsewhere = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter(|c| c.name != engine_name);
    for c in declared_elsewhere {
        for p in c
            .ports
            .iter()
            .flatten()
            .filter(|p| is_tcp(p) && !is_ours(p))
        {
            let port = p.host_port.unwrap_or(p.container_port);
            if let Some(l) = wanted.iter().find(|l| i32::from(l.port) == port) {
                return Err(format!(
                    "host-network pod: container {:?} declares port {port}, where {} must listen; two listeners cannot share the node's port",
                    c.name, l.what
                ));
            }
        }
    }
    let Some(c) = spec.containers.get_mut(engine) else {
        return Ok(());
    };
    let own: Vec<i32> = c
        .ports
        .iter()
        .flatten()
        .filter(|p| is_tcp(p) && !is_ours(p))
        .map(|p| p.host_port.unwrap_or(p.container_port))
        .collect();
    let mut add = Vec::new();
    for l in wanted {
        if own.contains(&i32::from(l.port)) {
            if l.engine_owned {
                continue; // the engine already declares its own publisher
            }
            return Err(format!(
                "host-network pod: container {:?} declares port {}, where {} must listen; two listeners cannot share the node's port",
                c.name, l.port, l.what
            ));
        }
        add.push(ContainerPort {
            container_port: i32::from(l.port),
            host_port: Some(i32::from(l.port)),
            name: Some(l.name.clone()),
            protocol: Some("TCP".to_string()),
            host_ip: None,
        });
    }
    let ports = c.ports.get_or_insert_with(Vec::new);
    ports.retain(|p| !is_ours(p) || add.iter().any(|a| a.name == p.name));
    for a in add {
        match ports.iter_mut().find(|p| p.name == a.name) {
            Some(slot) => *slot = a,
            None => ports.push(a),
        }
    }
    if ports.is_empty() {
        c.ports = None;
    }
    Ok(())
}

/// Every TCP port a container of `pod` declares (host port, else container port) → `container
/// <name> port <name or number>`, leaving out our own declarations.
pub fn declared_ports(pod: &Pod) -> BTreeMap<u16, String> {
    let mut out = BTreeMap::new();
    let Some(spec) = pod.spec.as_ref() else {
        return out;
    };
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        for p in c
            .ports
            .iter()
            .flatten()
            .filter(|p| is_tcp(p) && !is_ours(p))
        {
            if let Ok(port) = u16::try_from(p.host_port.unwrap_or(p.container_port)) {
                let label = p.name.clone().unwrap_or_else(|| port.to_string());
                out.entry(port)
                    .or_insert_with(|| format!("container {:?} port {label}", c.name));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec};

    fn pod(host_network: bool) -> Pod {
        Pod {
            spec: Some(PodSpec {
                host_network: Some(host_network),
                containers: vec![
                    Container {
                        name: "engine".into(),
                        ports: Some(vec![ContainerPort {
                            container_port: 5557,
                            ..Default::default()
                        }]),
                        ..Default::default()
                    },
                    Container {
                        name: "proxy".into(),
                        ports: Some(vec![ContainerPort {
                            container_port: 8000,
                            ..Default::default()
                        }]),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn l(port: u16, name: &str, engine_owned: bool) -> Listener {
        Listener {
            port,
            name: name.into(),
            what: format!("listener {name}"),
            engine_owned,
        }
    }

    /// A user's own port whose name merely starts with `ic-` survives re-admission; only the
    /// exact names the webhook declares are ours.
    #[test]
    fn only_the_webhooks_own_port_names_are_converged() {
        for ours in ["ic-lmcache-mp", "ic-kv-ev-0", "ic-kv-rp-3", "ic-kv-sub-12"] {
            assert!(is_injected_port_name(ours), "{ours}");
        }
        for theirs in [
            "ic-metrics",
            "ic-kv-ev-",
            "ic-kv-ev-x",
            "ic-lmcache-mp2",
            "http",
        ] {
            assert!(!is_injected_port_name(theirs), "{theirs}");
        }
        assert!(is_subscriber_port_name(&kv_subscriber_port_name(2)));
        assert!(!is_subscriber_port_name(&kv_publisher_port_name(2)));
        let mut p = pod(true);
        p.spec.as_mut().unwrap().containers[0]
            .ports
            .as_mut()
            .unwrap()
            .push(ContainerPort {
                container_port: 9400,
                name: Some("ic-metrics".into()),
                ..Default::default()
            });
        declare_host_ports(&mut p, 0, &[l(5555, MP_WORKER_PORT_NAME, false)]).unwrap();
        let names: Vec<Option<String>> = p.spec.as_ref().unwrap().containers[0]
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| p.name.clone())
            .collect();
        assert!(names.contains(&Some("ic-metrics".into())), "{names:?}");
        assert!(
            names.contains(&Some(MP_WORKER_PORT_NAME.into())),
            "{names:?}"
        );
    }

    #[test]
    fn declares_converges_and_refuses_collisions() {
        let mut p = pod(true);
        let ls = [l(5555, "ic-lmcache-mp", false), l(5557, "ic-kv-ev-0", true)];
        declare_host_ports(&mut p, 0, &ls).unwrap();
        let ports = p.spec.as_ref().unwrap().containers[0]
            .ports
            .clone()
            .unwrap();
        // 5557 is the engine's own declaration; only 5555 is added.
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[1].host_port, Some(5555));
        assert_eq!(ports[1].name.as_deref(), Some("ic-lmcache-mp"));
        let once = p.clone();
        declare_host_ports(&mut p, 0, &ls).unwrap();
        assert_eq!(p, once);
        // Off the host network, our declarations go.
        p.spec.as_mut().unwrap().host_network = None;
        declare_host_ports(&mut p, 0, &ls).unwrap();
        assert_eq!(
            p.spec.as_ref().unwrap().containers[0]
                .ports
                .as_ref()
                .unwrap()
                .len(),
            1
        );

        let err = declare_host_ports(&mut pod(true), 0, &[l(8000, "ic-x", false)]).unwrap_err();
        assert!(
            err.contains("container \"proxy\" declares port 8000"),
            "{err}"
        );
        let err = declare_host_ports(&mut pod(true), 0, &[l(5557, "ic-x", false)]).unwrap_err();
        assert!(
            err.contains("container \"engine\" declares port 5557"),
            "{err}"
        );
        let err = declare_host_ports(
            &mut pod(true),
            0,
            &[l(6000, "ic-a", false), l(6000, "ic-b", true)],
        )
        .unwrap_err();
        assert!(err.contains("would both listen"), "{err}");
        // Not host network: nothing declared, nothing refused.
        let mut q = pod(false);
        declare_host_ports(&mut q, 0, &[l(8000, "ic-x", false)]).unwrap();
        assert_eq!(q, pod(false));
    }
}
