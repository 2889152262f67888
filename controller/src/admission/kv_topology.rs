//! Where the per-pod kvevent-subscriber finds the engine's KV-event publishers (spec 000
//! "Events-only mode"; `kv-event-wire.md`; `docs/pod-wiring.md` "Outward publishers" and
//! "Data parallelism").
//!
//! [`subscriber_topology`] reads the engine's `--kv-events-config` the way the engine reads it
//! and returns one [`SubscriberStream`] per data-parallel rank, or an [`Unresolved`] reason the
//! Pod webhook turns into a fail-open for the subscriber (never a guessed endpoint):
//!
//! - vLLM's publisher **binds** when the endpoint host is a wildcard (`*`, an address containing
//!   `::`) or the endpoint is `ipc://`/`inproc://`, and **connects** otherwise. A bound TCP
//!   endpoint is followed at `tcp://127.0.0.1:<port>` (the sidecar shares the pod's network
//!   namespace). An endpoint the engine connects to on its own network namespace (loopback,
//!   `localhost`, `0.0.0.0`) is **bound** by the sidecar (`ic-agent subscribe --bind`), so the
//!   engine connects to it; one on another host (llm-d's pattern: the engine pushes to the
//!   scheduler's `tcp://<epp-service>:5557`) is not followed, since the events go there;
//!   `ipc://` needs a volume the sidecar does not share.
//! - Data parallelism: each rank `r` of this pod publishes on `port + r` and serves replay on
//!   `replay_port + r` ([`crate::engine::flags::dp_ranks`]: the same ranks the node
//!   plan uses). The replay (ROUTER) endpoint is always bound; it is passed to each stream.
//! - The port plan is checked: two ranks' publisher or replay ports, or one of them and another
//!   listener of the pod (the engine's HTTP port, the LMCache MP worker, a declared container
//!   port), may not coincide.
//! - Unknowable values fail open: `tcp://…:0` (vLLM binds an ephemeral port and only advertises
//!   it at run time, vllm-project/vllm#55844), shell syntax (`${VAR}` is not expanded by
//!   Kubernetes, only `$(VAR)`; inside `sh -c` the shell expands it at start-up), `$(VAR)` whose
//!   value is not a literal env entry of the engine container.
//!
//! With no `--kv-events-config` (or no engine container) the sidecar follows the default
//! [`ASSUMED_KV_EVENTS_ENDPOINT`] of rank 0 with a
//! warning, as before.

use std::collections::BTreeMap;

use ic_shared::crd::Runtime;
use k8s_openapi::api::core::v1::{Container, Pod};

use super::host_ports::Listener;
use crate::engine::command::{CommandForm, EngineCommand};
use crate::engine::flags::{dp_ranks, kv_events_config_raw, non_literal_dp_flag};
use crate::engine::kv_events::{KvEventsConfig, DEFAULT_KV_EVENTS_ENDPOINT};

/// Engine KV-event endpoint the kvevent-subscriber follows when the engine has no readable
/// `--kv-events-config` (rank 0, inside the pod).
pub const ASSUMED_KV_EVENTS_ENDPOINT: &str = "tcp://127.0.0.1:5557";

/// One stream the subscriber follows: a data-parallel rank's publisher as seen from inside the
/// pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberStream {
    /// Global data-parallel rank (0 without data parallelism).
    pub rank: u32,
    /// PUB endpoint to connect to, e.g. `tcp://127.0.0.1:5558` for rank 1 of `tcp://*:5557`.
    pub endpoint: String,
    /// ROUTER replay endpoint of the same rank, when the engine serves one.
    pub replay: Option<String>,
    /// True when the engine's publisher connects to this endpoint (a loopback one), so the
    /// sidecar binds it (`ic-agent subscribe --bind`).
    pub bind: bool,
}

/// The subscriber's plan for one pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SubscriberTopology {
    /// One stream per rank, by rank.
    pub streams: Vec<SubscriberStream>,
    /// The TCP listeners the engine's publishers and replay sockets bind in the pod's network
    /// namespace (`ic-kv-ev-<rank>`, `ic-kv-rp-<rank>`), for host-port declarations.
    pub engine_listeners: Vec<Listener>,
    /// Notes for the admission warnings.
    pub warnings: Vec<String>,
    /// True when the streams come from the engine's own `--kv-events-config` and that config
    /// publishes ([`KvEventsConfig::active`]); false for the assumed default endpoint, which
    /// the engine binds only if it publishes at all.
    pub from_engine_config: bool,
}

/// Why the subscriber cannot follow the engine: the precise reason, used as the fail-open
/// reason (events-only) or in the admission warning (offload).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved(pub String);

impl std::fmt::Display for Unresolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Other TCP listeners of the pod the publisher plan must not collide with: port → what.
pub type OtherListeners = BTreeMap<u16, String>;

/// The default endpoint, rank 0, no replay.
fn default_topology(warning: String) -> SubscriberTopology {
    SubscriberTopology {
        streams: vec![SubscriberStream {
            rank: 0,
            endpoint: ASSUMED_KV_EVENTS_ENDPOINT.to_string(),
            replay: None,
            bind: false,
        }],
        // The port the sidecar dials: on the host network it must be this pod's.
        engine_listeners: vec![Listener {
            port: DEFAULT_PORT,
            name: "ic-kv-ev-0".to_string(),
            what: "the KV-event publisher of data-parallel rank 0".to_string(),
            engine_owned: true,
        }],
        warnings: vec![warning],
        from_engine_config: false,
    }
}

/// Port of [`ASSUMED_KV_EVENTS_ENDPOINT`].
const DEFAULT_PORT: u16 = 5557;

/// Resolves Kubernetes `$(VAR)` references from the container's literal env, as the kubelet
/// does for `command`/`args` (`$$` escapes a dollar). Errors on a reference whose value is not a
/// literal entry (a `valueFrom` or absent variable is expanded, or left as is, at run time).
fn expand_kubernetes_refs(text: &str, c: &Container) -> Result<String, String> {
    let env: BTreeMap<&str, Option<&str>> = c
        .env
        .iter()
        .flatten()
        .map(|e| {
            (
                e.name.as_str(),
                e.value.as_deref().filter(|_| e.value_from.is_none()),
            )
        })
        .collect();
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(body) = tail.strip_prefix("$(") {
            let Some(end) = body.find(')') else {
                out.push_str(tail);
                rest = "";
                break;
            };
            let name = &body[..end];
            match env.get(name) {
                Some(Some(v)) => out.push_str(v),
                Some(None) => {
                    return Err(format!(
                        "$({name}) comes from a valueFrom source, known only when the pod runs"
                    ))
                }
                None => {
                    return Err(format!(
                        "$({name}) names no env entry of container {:?}",
                        c.name
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// What the engine does with one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    /// Binds `tcp://<host>:<port>`; `host` is what a sidecar in the pod dials.
    BindTcp { host: String, port: u16 },
    /// Connects to `tcp://<host>:<port>`.
    ConnectTcp { host: String, port: u16 },
    /// Binds an `ipc://` or `inproc://` endpoint.
    BindLocal(String),
}

/// vLLM's rule (kv-event-wire.md): bind when the endpoint contains `*` or `::` or is
/// `ipc://`/`inproc://`, connect otherwise.
fn classify(endpoint: &str) -> Result<Endpoint, String> {
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        return Ok(Endpoint::BindLocal(endpoint.to_string()));
    }
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("endpoint {endpoint:?} is not tcp://, ipc:// or inproc://"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("endpoint {endpoint:?} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("endpoint {endpoint:?} has no valid port"))?;
    let binds = endpoint.contains('*') || endpoint.contains("::");
    let host = host.to_string();
    Ok(if binds {
        Endpoint::BindTcp {
            host: "127.0.0.1".to_string(),
            port,
        }
    } else {
        Endpoint::ConnectTcp { host, port }
    })
}

/// A host that resolves to the pod's own network namespace (`0.0.0.0` connects there too).
fn is_local(host: &str) -> bool {
    matches!(host, "localhost" | "0.0.0.0" | "[::1]" | "::1") || host.starts_with("127.")
}

fn offset(port: u16, rank: u32, what: &str) -> Result<u16, Unresolved> {
    u16::try_from(u32::from(port) + rank).map_err(|_| {
        Unresolved(format!(
            "{what} port {port} + data-parallel rank {rank} exceeds 65535"
        ))
    })
}

/// Reads `--kv-events-config` of the engine container `engine` and plans the subscriber's
/// streams (module docs for the rules). `others` are the pod's other TCP listeners (port →
/// what); a publisher or replay port among them, or shared by two ranks, is a collision.
///
/// Errors: [`Unresolved`] with the precise reason when the engine's publishers cannot be
/// followed from inside the pod.
pub fn subscriber_topology(
    pod: &Pod,
    engine: Option<usize>,
    runtime: Runtime,
    others: &OtherListeners,
) -> Result<SubscriberTopology, Unresolved> {
    let default = ASSUMED_KV_EVENTS_ENDPOINT;
    let checked = |t: SubscriberTopology| -> Result<SubscriberTopology, Unresolved> {
        match others.get(&DEFAULT_PORT) {
            Some(other) => Err(Unresolved(format!(
                "port {DEFAULT_PORT} would be both {other} and the KV-event publisher of data-parallel rank 0 (the default endpoint {default} the kvevent-subscriber follows)"
            ))),
            None => Ok(t),
        }
    };
    let Some(c) = engine.and_then(|i| pod.spec.as_ref().and_then(|s| s.containers.get(i))) else {
        return checked(default_topology(format!(
            "no engine container found; the kvevent-subscriber listens on {default}"
        )));
    };
    let no_config = || {
        checked(default_topology(format!(
            "container {:?} has no readable --kv-events-config endpoint; the kvevent-subscriber listens on {default} (the engine must publish KV events for routing to work)",
            c.name
        )))
    };
    let Ok(cmd) = EngineCommand::parse(c, runtime) else {
        return no_config();
    };
    // The last occurrence: the engine's argparse keeps the last value of a repeated flag, and
    // so does the node plan (`engine::flags::flag_value`).
    let Some((raw, opaque)) = kv_events_config_raw(&cmd) else {
        return no_config();
    };
    let shell = cmd.form == CommandForm::Shell;
    // `$(VAR)` is the kubelet's, for exec-form commands; the shell sees the result too.
    let text = if raw.contains("$(") {
        expand_kubernetes_refs(&raw, c).map_err(|e| {
            Unresolved(format!(
                "container {:?}: --kv-events-config cannot be resolved at admission: {e}",
                c.name
            ))
        })?
    } else {
        raw.clone()
    };
    let config = match KvEventsConfig::parse(&text) {
        Ok(v) => v,
        Err(_) if opaque || text.contains('$') => {
            return Err(Unresolved(format!(
                "container {:?}: --kv-events-config is a shell expansion ({raw}) whose value is known only when the engine starts",
                c.name
            )))
        }
        Err(_) => return no_config(),
    };
    let endpoint = config
        .endpoint
        .clone()
        .unwrap_or_else(|| DEFAULT_KV_EVENTS_ENDPOINT.into());
    let unknown_text = |field: &str, value: &str| -> Option<Unresolved> {
        let var = value.contains("${") || value.contains('$');
        var.then(|| {
            Unresolved(if shell {
                format!(
                    "container {:?}: the KV-event {field} {value:?} is expanded by the engine's shell at start-up; its value is unknown at admission (write it literally)",
                    c.name
                )
            } else {
                format!(
                    "container {:?}: the KV-event {field} {value:?} uses shell syntax, which Kubernetes does not expand in an exec-form command (only $(VAR)); the engine receives it literally",
                    c.name
                )
            })
        })
    };
    if let Some(u) = unknown_text("endpoint", &endpoint) {
        return Err(u);
    }
    let ranks = {
        let args = cmd.texts();
        let ranks = dp_ranks(runtime, &args);
        if let Some(v) = non_literal_dp_flag(&args) {
            return Err(Unresolved(format!(
                "container {:?}: the data-parallel size or rank {v:?} is known only when the engine starts, so the publishers' ports (port + rank) are unknown at admission",
                c.name
            )));
        }
        ranks
    };
    let pub_ep = classify(&endpoint)
        .map_err(|e| Unresolved(format!("container {:?}: KV-event {e}", c.name)))?;
    let (host, port, bind) = match pub_ep {
        Endpoint::BindTcp { host, port } => (host, port, false),
        // vLLM connects; a loopback endpoint is in the pod's own network namespace, where the
        // sidecar binds it.
        Endpoint::ConnectTcp { host, port } if is_local(&host) => {
            ("127.0.0.1".to_string(), port, true)
        }
        Endpoint::ConnectTcp { host, port } => {
            return Err(Unresolved(format!(
                "container {:?}: the engine connects its KV-event publisher to {endpoint:?} (vLLM binds only a wildcard or ipc endpoint) and so sends its events to {host}:{port}, another host, not to a subscriber in the pod (publish on tcp://*:{port}, or connect to tcp://127.0.0.1:{port}, to have the pod's events followed)",
                c.name
            )))
        }
        Endpoint::BindLocal(ep) => {
            return Err(Unresolved(format!(
                "container {:?}: the engine binds its KV-event publisher at {ep:?}, which the kvevent-subscriber sidecar cannot reach (it shares no volume with the engine); publish on tcp://*:5557",
                c.name
            )))
        }
    };
    if port == 0 {
        return Err(Unresolved(format!(
            "container {:?}: KV-event endpoint {endpoint:?} asks for an ephemeral port, which vLLM picks and advertises only at run time (vllm-project/vllm#55844); give a fixed port",
            c.name
        )));
    }
    let mut warnings = Vec::new();
    let replay = match config.replay_endpoint.as_deref() {
        None => None,
        Some(r) => {
            if let Some(u) = unknown_text("replay_endpoint", r) {
                warnings.push(format!(
                    "{u}; the kvevent-subscriber runs without replay, so a gap clears the replica until new events arrive"
                ));
                None
            } else {
                match classify(r) {
                    Ok(
                        Endpoint::BindTcp { port: 0, .. } | Endpoint::ConnectTcp { port: 0, .. },
                    ) => {
                        warnings.push(format!(
                            "container {:?}: replay endpoint {r:?} asks for an ephemeral port, unknown at admission; the kvevent-subscriber runs without replay",
                            c.name
                        ));
                        None
                    }
                    // The ROUTER always binds, whatever the host.
                    Ok(Endpoint::BindTcp { host, port }) => Some((host, port)),
                    Ok(Endpoint::ConnectTcp { host, port }) => {
                        let host = if host == "0.0.0.0" {
                            "127.0.0.1".into()
                        } else {
                            host
                        };
                        Some((host, port))
                    }
                    Ok(Endpoint::BindLocal(_)) | Err(_) => {
                        warnings.push(format!(
                            "container {:?}: replay endpoint {r:?} is not a TCP endpoint the sidecar can reach; the kvevent-subscriber runs without replay",
                            c.name
                        ));
                        None
                    }
                }
            }
        }
    };

    // Port plan: every rank's publisher and replay port, checked against each other and the
    // pod's other listeners.
    let mut plan: BTreeMap<u16, Listener> = BTreeMap::new();
    let mut streams = Vec::new();
    let mut claim = |port: u16, name: String, what: String| -> Result<(), Unresolved> {
        if let Some(other) = plan
            .get(&port)
            .map(|l| l.what.as_str())
            .or_else(|| others.get(&port).map(String::as_str))
        {
            return Err(Unresolved(format!(
                "container {:?}: port {port} would be both {other} and {what}; the engine cannot bind both, so the subscriber's port plan is refused",
                c.name
            )));
        }
        plan.insert(
            port,
            Listener {
                port,
                name,
                what,
                engine_owned: true,
            },
        );
        Ok(())
    };
    for &rank in &ranks {
        let p = offset(port, rank, "KV-event")?;
        if bind {
            claim(
                p,
                super::host_ports::kv_subscriber_port_name(rank),
                format!("the kvevent-subscriber of data-parallel rank {rank} (the engine connects to it)"),
            )?;
        } else {
            claim(
                p,
                super::host_ports::kv_publisher_port_name(rank),
                format!("the KV-event publisher of data-parallel rank {rank}"),
            )?;
        }
        let replay_ep = match &replay {
            Some((h, rp)) => {
                let q = offset(*rp, rank, "replay")?;
                claim(
                    q,
                    super::host_ports::kv_replay_port_name(rank),
                    format!("the KV-event replay endpoint of data-parallel rank {rank}"),
                )?;
                Some(format!("tcp://{h}:{q}"))
            }
            None => None,
        };
        streams.push(SubscriberStream {
            rank,
            endpoint: format!("tcp://{host}:{p}"),
            replay: replay_ep,
            bind,
        });
    }
    let engine_listeners = plan
        .into_values()
        .map(|mut l| {
            // The subscriber's own listener is not the engine's.
            l.engine_owned = !super::host_ports::is_subscriber_port_name(&l.name);
            l
        })
        .collect();
    Ok(SubscriberTopology {
        streams,
        engine_listeners,
        warnings,
        from_engine_config: config.active(runtime),
    })
}

/// The TCP ports the engine container `engine` itself binds for KV events, read from its
/// literal, publishing `--kv-events-config` (spec 000 "Events-only mode"; `kv-event-wire.md`):
/// each data-parallel rank's PUB port when the endpoint is a wildcard, and each rank's ROUTER
/// replay port. The Pod webhook checks the LMCache MP worker's port against them whether or not
/// a kvevent-subscriber is added: the engine binds them either way, so a worker on one of them
/// keeps one of the two from starting.
///
/// Empty when the engine has no readable, publishing config, or when its ports are unknowable
/// at admission (shell expansion, ephemeral port; [`subscriber_topology`]'s reasons).
pub fn engine_kv_listeners(pod: &Pod, engine: usize, runtime: Runtime) -> Vec<Listener> {
    match subscriber_topology(pod, Some(engine), runtime, &OtherListeners::new()) {
        Ok(t) if t.from_engine_config => t
            .engine_listeners
            .into_iter()
            .filter(|l| l.engine_owned)
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{EnvVar, PodSpec};

    fn pod(args: &[&str], env: &[(&str, &str)]) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "vllm".into(),
                    command: Some(vec!["vllm".into(), "serve".into(), "m".into()]),
                    args: Some(args.iter().map(|s| s.to_string()).collect()),
                    env: Some(
                        env.iter()
                            .map(|(n, v)| EnvVar {
                                name: n.to_string(),
                                value: Some(v.to_string()),
                                value_from: None,
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn topo(args: &[&str]) -> Result<SubscriberTopology, Unresolved> {
        subscriber_topology(
            &pod(args, &[]),
            Some(0),
            Runtime::Vllm,
            &OtherListeners::new(),
        )
    }

    #[test]
    fn kubernetes_refs_expand_from_literal_env_only() {
        let p = pod(&[], &[("PORT", "6000")]);
        let c = &p.spec.as_ref().unwrap().containers[0];
        assert_eq!(
            expand_kubernetes_refs("tcp://*:$(PORT) $$x", c).unwrap(),
            "tcp://*:6000 $x"
        );
        assert!(expand_kubernetes_refs("$(NOPE)", c)
            .unwrap_err()
            .contains("names no env entry"));
    }

    #[test]
    fn bind_connect_and_ranks() {
        let t = topo(&[
            "--data-parallel-size",
            "2",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5600"}"#,
        ])
        .unwrap();
        assert_eq!(
            t.streams,
            vec![
                SubscriberStream {
                    rank: 0,
                    endpoint: "tcp://127.0.0.1:5557".into(),
                    replay: Some("tcp://127.0.0.1:5600".into()),
                    bind: false,
                },
                SubscriberStream {
                    rank: 1,
                    endpoint: "tcp://127.0.0.1:5558".into(),
                    replay: Some("tcp://127.0.0.1:5601".into()),
                    bind: false,
                },
            ]
        );
        let e = topo(&[
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://epp.ns.svc:5557"}"#,
        ])
        .unwrap_err();
        assert!(e.0.contains("connects its KV-event publisher"), "{e}");
        // 0.0.0.0 and loopback have neither `*` nor `::`: vLLM connects to them, in the pod's
        // own network namespace, so the sidecar binds there.
        for ep in [
            "tcp://0.0.0.0:5557",
            "tcp://127.0.0.1:5557",
            "tcp://localhost:5557",
        ] {
            let t = topo(&["--kv-events-config", &format!(r#"{{"endpoint":"{ep}"}}"#)]).unwrap();
            assert_eq!(t.streams.len(), 1);
            assert!(t.streams[0].bind, "{ep}");
            assert_eq!(t.streams[0].endpoint, "tcp://127.0.0.1:5557");
            assert_eq!(t.engine_listeners[0].name, "ic-kv-sub-0");
            assert!(!t.engine_listeners[0].engine_owned);
        }
        let e = topo(&["--kv-events-config", r#"{"endpoint":"tcp://*:0"}"#]).unwrap_err();
        assert!(e.0.contains("ephemeral port"), "{e}");
        let e = topo(&["--kv-events-config", r#"{"endpoint":"tcp://${EPP}:5557"}"#]).unwrap_err();
        assert!(e.0.contains("Kubernetes does not expand"), "{e}");
        let e = topo(&[
            "--data-parallel-size",
            "2",
            "--kv-events-config",
            r#"{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#,
        ])
        .unwrap_err();
        assert!(e.0.contains("port 5558 would be both"), "{e}");
    }

    #[test]
    fn a_repeated_kv_events_config_is_read_last_as_the_engine_and_the_plan_read_it() {
        let first =
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}"#;
        let last = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:6100"}"#;
        let args = ["--kv-events-config", first, "--kv-events-config", last];
        let t = topo(&args).unwrap();
        assert_eq!(t.streams.len(), 1);
        assert_eq!(t.streams[0].endpoint, "tcp://127.0.0.1:6100");
        let planned = crate::engine::flags::kv_events_config_arg(&args);
        assert_eq!(planned.as_deref(), Some(last));
    }
}
