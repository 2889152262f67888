//! One planned port against what holds it: the port's state (listeners and owners, or the
//! sockets holding it without listening), the verdict for its expectation, and the host summary.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use procfs::net::TcpState;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{PortExpect, PortExpectation, PortOwner};

use super::owners::SocketOwner;
use super::sockets::{tcp_state_name, BindScope, TcpSocket};
use super::{join, NAME};

/// Everything known about one listening port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortState {
    /// Bound addresses (one per LISTEN socket on the port).
    pub addrs: Vec<IpAddr>,
    /// Socket inodes.
    pub inodes: Vec<u64>,
    /// Resolved owners (may be fewer than sockets when some cannot be resolved).
    pub owners: Vec<SocketOwner>,
}

impl PortState {
    /// The widest scope among the port's sockets.
    pub fn scope(&self) -> Option<BindScope> {
        self.addrs.iter().map(|a| BindScope::of(*a)).max()
    }
}

/// The sockets that hold a port nothing listens on: outgoing connections whose (ephemeral)
/// source port it is, or the leftovers of closed ones. Any of them makes a later `bind` of the
/// port fail with `EADDRINUSE` — a connection made by `connect` without `SO_REUSEADDR` blocks
/// it even for a binder that sets `SO_REUSEADDR`, and so does its TIME_WAIT remnant for up to
/// 60 s. (A socket bound but neither listening nor connected is not in the tables.)
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldPort {
    /// The sockets, as read.
    pub sockets: Vec<TcpSocket>,
    /// Their resolved owners (none for TIME_WAIT sockets, which have no inode).
    pub owners: Vec<SocketOwner>,
}

impl HeldPort {
    /// True when every socket is in TIME_WAIT (the hold ends within 60 s by itself).
    pub fn only_time_wait(&self) -> bool {
        self.sockets.iter().all(|s| s.state == TcpState::TimeWait)
    }

    fn describe_sockets(&self, limit: usize) -> String {
        let mut parts: Vec<String> = self
            .sockets
            .iter()
            .take(limit)
            .map(|s| {
                format!(
                    "{} {} -> {}",
                    tcp_state_name(&s.state),
                    SocketAddr::new(s.addr, s.port),
                    s.remote
                )
            })
            .collect();
        if self.sockets.len() > limit {
            parts.push(format!("{} more", self.sockets.len() - limit));
        }
        parts.join(", ")
    }
}

pub(super) fn expect_label(e: PortExpect) -> &'static str {
    match e {
        PortExpect::Free => "free",
        PortExpect::Held => "held",
    }
}

fn describe_owner(want: &PortOwner) -> String {
    let mut parts = Vec::new();
    if let Some(e) = &want.exe {
        parts.push(format!("exe {e}"));
    }
    if let Some(u) = &want.pod_uid {
        parts.push(format!("pod {u}"));
    }
    if parts.is_empty() {
        "any owner".to_string()
    } else {
        parts.join(", ")
    }
}

/// The pure decision for one expectation, given the port's state (`None` = nothing listens).
pub fn evaluate_expectation(exp: &PortExpectation, state: Option<&PortState>) -> CheckResult {
    evaluate_expectation_with(exp, state, &[])
}

/// [`evaluate_expectation`] knowing which processes of the expected owner run (`running`,
/// looked up only when an owned port is not listening): a held port nobody listens on while
/// its owner runs is `PortOwnerNotListening` (verdict `Ghost`) rather than `PortNotListening`.
pub fn evaluate_expectation_with(
    exp: &PortExpectation,
    state: Option<&PortState>,
    running: &[SocketOwner],
) -> CheckResult {
    evaluate_expectation_held(exp, state, None, running)
}

/// [`evaluate_expectation_with`] knowing the non-listening sockets that hold the port when
/// nothing listens on it (`held`): then the port is not free — its owner's `bind` fails with
/// `EADDRINUSE` — and the result is `PortHeldByConnection` (verdict `HeldByConnection`):
/// Critical, or Warning when every such socket is in TIME_WAIT (gone within 60 s).
pub fn evaluate_expectation_held(
    exp: &PortExpectation,
    state: Option<&PortState>,
    held: Option<&HeldPort>,
    running: &[SocketOwner],
) -> CheckResult {
    let port = exp.port;
    let label = if exp.purpose.is_empty() {
        format!("port {port}")
    } else {
        format!("port {port} ({})", exp.purpose)
    };
    let r = |status, reason: &str, message: String| {
        CheckResult::new(NAME, format!("tcp/{port}"), status, reason, message)
            .with("port", port)
            .with("expect", expect_label(exp.expect))
    };
    let held = held.filter(|h| state.is_none() && !h.sockets.is_empty());
    let result = match (state, held) {
        (None, Some(h)) => {
            let by = if h.owners.is_empty() {
                String::new()
            } else {
                format!(
                    " (held by {})",
                    h.owners
                        .iter()
                        .map(SocketOwner::describe)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            let (status, lasts) = if h.only_time_wait() {
                (
                    CheckStatus::Warning,
                    "the TIME_WAIT remnant of a closed connection, which the kernel keeps for \
                         up to 60 s",
                )
            } else {
                (
                    CheckStatus::Critical,
                    "a connection, which lasts until it closes",
                )
            };
            let whose = match exp.expect {
                PortExpect::Free => "its planned owner cannot start while it lasts",
                PortExpect::Held => "this is why the planned owner is not listening",
            };
            r(
                status,
                "PortHeldByConnection",
                format!(
                    "{label}: nothing listens, but the port is held by {} socket{} that {} not \
                         listening: {}{by}. A bind of the port fails with EADDRINUSE while it is \
                         held by {lasts} (an outgoing connection took the port as its ephemeral \
                         source port); {whose}. Reserve the port (sysctl \
                         net.ipv4.ip_local_reserved_ports) so the kernel never picks it as a \
                         source port, or move it out of net.ipv4.ip_local_port_range.",
                    h.sockets.len(),
                    if h.sockets.len() == 1 { "" } else { "s" },
                    if h.sockets.len() == 1 { "is" } else { "are" },
                    h.describe_sockets(5),
                ),
            )
            .with(
                "connectionStates",
                join(h.sockets.iter().map(|s| tcp_state_name(&s.state))),
            )
            .with(
                "connections",
                join(
                    h.sockets
                        .iter()
                        .map(|s| format!("{}->{}", SocketAddr::new(s.addr, s.port), s.remote)),
                ),
            )
            .with("connectionPids", join(h.owners.iter().map(|o| o.pid)))
            .with(
                "connectionExes",
                join(h.owners.iter().map(|o| o.exe.clone().unwrap_or_default())),
            )
        }
        _ => match (exp.expect, state) {
            (PortExpect::Free, None) => r(
                CheckStatus::Ok,
                "PortOk",
                format!("{label} is free, as the plan expects."),
            ),
            (PortExpect::Held, None) if !running.is_empty() => r(
                CheckStatus::Critical,
                "PortOwnerNotListening",
                format!(
                "{label} should be held by {} and {} running, but nothing listens on the port: \
                 the owner has not bound it (still starting, failed to bind, or configured with \
                 another port); check its logs.",
                exp.owner
                    .as_ref()
                    .map(describe_owner)
                    .unwrap_or_else(|| "a listener".to_string()),
                match running {
                    [one] => format!("{} is", one.describe()),
                    many => format!(
                        "{} are",
                        many.iter().map(SocketOwner::describe).collect::<Vec<_>>().join(", ")
                    ),
                }
            ),
            )
            .with("runningPids", join(running.iter().map(|o| o.pid))),
            (PortExpect::Held, None) => r(
                CheckStatus::Critical,
                "PortNotListening",
                format!(
                    "{label} should be held by {} but nothing listens on it; start the owner or \
                 fix its port.",
                    exp.owner
                        .as_ref()
                        .map(describe_owner)
                        .unwrap_or_else(|| "a listener".to_string())
                ),
            ),
            // Kept free for a pod that is starting: its own (sidecar) listeners are no conflict.
            (PortExpect::Free, Some(st))
                if exp.owner.is_some()
                    && !st.owners.is_empty()
                    && st
                        .owners
                        .iter()
                        .all(|o| exp.owner.as_ref().is_some_and(|w| o.matches(w))) =>
            {
                r(
                    CheckStatus::Ok,
                    "PortOk",
                    format!(
                        "{label} is kept free for {}, and only that pod's own process ({}) \
                         listens on it (a sidecar that starts first).",
                        exp.owner.as_ref().map(describe_owner).unwrap_or_default(),
                        st.owners
                            .iter()
                            .map(SocketOwner::describe)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            }
            (PortExpect::Free, Some(st)) => {
                let holders = if st.owners.is_empty() {
                    format!(
                        "an unidentified process (socket inode {}; in another PID namespace or \
                     unreadable)",
                        join(&st.inodes)
                    )
                } else {
                    st.owners
                        .iter()
                        .map(SocketOwner::describe)
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                r(
                    CheckStatus::Critical,
                    "PortConflict",
                    format!(
                    "{label} must be free but is held by {holders}, listening on {}; stop it or \
                     move the port.",
                    join(&st.addrs)
                ),
                )
            }
            (PortExpect::Held, Some(st)) => match &exp.owner {
                None => r(
                    CheckStatus::Ok,
                    "PortOk",
                    format!("{label} is listening, as the plan expects."),
                ),
                Some(want) => {
                    // An owner whose exe cannot be read cannot be compared with an expected exe.
                    let identified: Vec<&SocketOwner> = st
                        .owners
                        .iter()
                        .filter(|o| want.exe.is_none() || o.exe.is_some())
                        .collect();
                    let wrong: Vec<&SocketOwner> = identified
                        .iter()
                        .copied()
                        .filter(|o| !o.matches(want))
                        .collect();
                    if !wrong.is_empty() {
                        r(
                            CheckStatus::Critical,
                            "PortOwnerMismatch",
                            format!(
                                "{label} is held by {} but the plan expects {}.",
                                wrong
                                    .iter()
                                    .map(|o| o.describe())
                                    .collect::<Vec<_>>()
                                    .join(", "),
                                describe_owner(want)
                            ),
                        )
                    } else if identified.is_empty() {
                        r(
                            CheckStatus::Unknown,
                            "PortOwnerUnknown",
                            format!(
                            "{label} is listening but its owner could not be identified (socket \
                             inode {}; in another PID namespace or unreadable), so {} cannot be \
                             confirmed{}.",
                            join(&st.inodes),
                            describe_owner(want),
                            // Other processes' /proc/<pid>/fd need CAP_SYS_PTRACE.
                            crate::privilege::lacking_clause(&[
                                crate::privilege::Capability::CAP_SYS_PTRACE
                            ])
                            .map(|c| format!("; {c}"))
                            .unwrap_or_default()
                        ),
                        )
                    } else {
                        r(
                            CheckStatus::Ok,
                            "PortOk",
                            format!(
                                "{label} is held by {}, as the plan expects.",
                                identified
                                    .iter()
                                    .map(|o| o.describe())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        )
                    }
                }
            },
        },
    };
    let verdict = match (result.reason.as_str(), exp.expect) {
        ("PortOk", PortExpect::Free) if state.is_some() => "HeldByExpected",
        ("PortOk", PortExpect::Free) => "Free",
        ("PortOk", PortExpect::Held) => "HeldByExpected",
        ("PortConflict", _) => "Conflict",
        ("PortOwnerNotListening", _) => "Ghost",
        ("PortNotListening", _) => "NotListening",
        ("PortOwnerMismatch", _) => "OwnerMismatch",
        ("PortHeldByConnection", _) => "HeldByConnection",
        _ => "OwnerUnknown",
    };
    let mut result = result
        .with("listening", state.is_some())
        .with("verdict", verdict);
    if !exp.purpose.is_empty() {
        result = result.with("purpose", &exp.purpose);
    }
    if let Some(want) = &exp.owner {
        if let Some(e) = &want.exe {
            result = result.with("expectedExe", e);
        }
        if let Some(u) = &want.pod_uid {
            result = result.with("expectedPodUid", u);
        }
    }
    if let Some(st) = state {
        result = result
            .with("addresses", join(&st.addrs))
            .with("inodes", join(&st.inodes))
            .with("bindScope", st.scope().map(BindScope::as_str).unwrap_or(""));
        if !st.owners.is_empty() {
            result = result
                .with("pids", join(st.owners.iter().map(|o| o.pid)))
                .with(
                    "exes",
                    join(st.owners.iter().map(|o| o.exe.clone().unwrap_or_default())),
                );
            let uids: BTreeSet<&str> = st
                .owners
                .iter()
                .filter_map(|o| o.pod_uid.as_deref())
                .collect();
            if !uids.is_empty() {
                result = result.with("podUids", join(uids));
            }
        }
    }
    result
}

/// The `host` summary: counts of listening ports by bind scope.
pub fn summarize(ports: &BTreeMap<u16, PortState>, sockets: usize) -> CheckResult {
    let by_scope = |s: BindScope| -> Vec<u16> {
        ports
            .iter()
            .filter(|(_, st)| st.scope() == Some(s))
            .map(|(p, _)| *p)
            .collect()
    };
    let all = by_scope(BindScope::All);
    let specific = by_scope(BindScope::Specific);
    let loopback = by_scope(BindScope::Loopback);
    CheckResult::new(
        NAME,
        "host",
        CheckStatus::Ok,
        "ListeningPorts",
        format!(
            "{} TCP {} on this node: {} on all addresses, {} on specific addresses, {} on \
             loopback only.",
            ports.len(),
            if ports.len() == 1 {
                "port listens"
            } else {
                "ports listen"
            },
            all.len(),
            specific.len(),
            loopback.len()
        ),
    )
    .with("listeningPorts", ports.len())
    .with("listeningSockets", sockets)
    .with("allAddressesCount", all.len())
    .with("specificAddressCount", specific.len())
    .with("loopbackCount", loopback.len())
    .with("allAddressesPorts", join(all))
    .with("specificAddressPorts", join(specific))
    .with("loopbackPorts", join(loopback))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_port_held_by_a_connection_is_not_free() {
        let sock = |state| TcpSocket {
            addr: "127.0.0.1".parse().unwrap(),
            port: 50051,
            remote: "127.0.0.1:7070".parse().unwrap(),
            state,
            inode: 9,
        };
        let exp = |expect| PortExpectation {
            port: 50051,
            expect,
            owner: None,
            purpose: "mooncake master rpc".into(),
        };
        let conn = HeldPort {
            sockets: vec![sock(TcpState::Established)],
            owners: vec![owner(77, "/usr/bin/curl", None)],
        };
        for expect in [PortExpect::Free, PortExpect::Held] {
            let r = evaluate_expectation_held(&exp(expect), None, Some(&conn), &[]);
            assert_eq!(
                (r.status, r.reason.as_str()),
                (CheckStatus::Critical, "PortHeldByConnection"),
                "{r:?}"
            );
            assert_eq!(r.observed["verdict"], "HeldByConnection");
            assert_eq!(r.observed["connectionStates"], "ESTABLISHED");
            assert_eq!(r.observed["connections"], "127.0.0.1:50051->127.0.0.1:7070");
            assert_eq!(r.observed["connectionPids"], "77");
            for needle in ["EADDRINUSE", "pid 77 (/usr/bin/curl)", "ESTABLISHED"] {
                assert!(r.message.contains(needle), "{needle}: {}", r.message);
            }
        }
        let tw = HeldPort {
            sockets: vec![sock(TcpState::TimeWait)],
            owners: vec![],
        };
        let r = evaluate_expectation_held(&exp(PortExpect::Free), None, Some(&tw), &[]);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Warning, "PortHeldByConnection")
        );
        assert!(r.message.contains("60 s"), "{}", r.message);
        // A listener's accepted connections share its port: the listener is judged, as before.
        let st = held("0.0.0.0", vec![]);
        let r = evaluate_expectation_held(&exp(PortExpect::Held), Some(&st), Some(&conn), &[]);
        assert_eq!(r.reason, "PortOk");
    }

    const POD_UID: &str = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";

    fn held(addr: &str, owners: Vec<SocketOwner>) -> PortState {
        PortState {
            addrs: vec![addr.parse().unwrap()],
            inodes: vec![42],
            owners,
        }
    }

    fn owner(pid: u32, exe: &str, uid: Option<&str>) -> SocketOwner {
        SocketOwner {
            pid,
            exe: Some(exe.into()),
            pod_uid: uid.map(str::to_string),
        }
    }

    fn exp(port: u16, expect: PortExpect, exe: Option<&str>, uid: Option<&str>) -> PortExpectation {
        PortExpectation {
            port,
            expect,
            owner: (exe.is_some() || uid.is_some()).then(|| PortOwner {
                exe: exe.map(str::to_string),
                pod_uid: uid.map(str::to_string),
            }),
            purpose: "mooncake master rpc".into(),
        }
    }

    #[test]
    fn expectation_table() {
        use CheckStatus::*;
        let uid = POD_UID;
        let py = owner(1234, "/usr/bin/python3.11", Some(uid));
        let cases: Vec<(PortExpectation, Option<PortState>, CheckStatus, &str)> = vec![
            (exp(50051, PortExpect::Free, None, None), None, Ok, "PortOk"),
            (
                exp(50051, PortExpect::Free, None, None),
                Some(held("0.0.0.0", vec![py.clone()])),
                Critical,
                "PortConflict",
            ),
            (
                exp(50051, PortExpect::Free, None, None),
                Some(held("127.0.0.1", vec![])),
                Critical,
                "PortConflict",
            ),
            // Kept free for a starting pod: its own sidecar's listener is no conflict; another
            // pod's, a mix, or an unidentified one is.
            (
                exp(50051, PortExpect::Free, None, Some(uid)),
                Some(held("0.0.0.0", vec![py.clone()])),
                Ok,
                "PortOk",
            ),
            (
                exp(
                    50051,
                    PortExpect::Free,
                    None,
                    Some("00000000-1b2c-4d5e-8f90-0123456789ab"),
                ),
                Some(held("0.0.0.0", vec![py.clone()])),
                Critical,
                "PortConflict",
            ),
            (
                exp(50051, PortExpect::Free, None, Some(uid)),
                Some(held(
                    "0.0.0.0",
                    vec![py.clone(), owner(99, "/usr/bin/nc", None)],
                )),
                Critical,
                "PortConflict",
            ),
            (
                exp(50051, PortExpect::Free, None, Some(uid)),
                Some(held("0.0.0.0", vec![])),
                Critical,
                "PortConflict",
            ),
            (
                exp(50051, PortExpect::Held, Some("/usr/bin/python3.11"), None),
                None,
                Critical,
                "PortNotListening",
            ),
            (
                exp(50051, PortExpect::Held, None, None),
                Some(held("::", vec![])),
                Ok,
                "PortOk",
            ),
            (
                exp(50051, PortExpect::Held, Some("/usr/bin/python3.11"), None),
                Some(held("::", vec![py.clone()])),
                Ok,
                "PortOk",
            ),
            (
                exp(
                    50051,
                    PortExpect::Held,
                    None,
                    Some("3F1C2A9E_1B2C_4D5E_8F90_0123456789AB"),
                ),
                Some(held("::", vec![py.clone()])),
                Ok,
                "PortOk",
            ),
            (
                exp(50051, PortExpect::Held, Some("/usr/bin/nc"), None),
                Some(held("::", vec![py.clone()])),
                Critical,
                "PortOwnerMismatch",
            ),
            (
                exp(
                    50051,
                    PortExpect::Held,
                    Some("/usr/bin/python3.11"),
                    Some("00000000-1b2c-4d5e-8f90-0123456789ab"),
                ),
                Some(held("::", vec![py.clone()])),
                Critical,
                "PortOwnerMismatch",
            ),
            (
                exp(50051, PortExpect::Held, Some("/usr/bin/python3.11"), None),
                Some(held("::", vec![py.clone(), owner(99, "/usr/bin/nc", None)])),
                Critical,
                "PortOwnerMismatch",
            ),
            (
                exp(50051, PortExpect::Held, Some("/usr/bin/python3.11"), None),
                Some(held("::", vec![])),
                Unknown,
                "PortOwnerUnknown",
            ),
            (
                exp(50051, PortExpect::Held, Some("/usr/bin/python3.11"), None),
                Some(held(
                    "::",
                    vec![SocketOwner {
                        pid: 7,
                        exe: None,
                        pod_uid: None,
                    }],
                )),
                Unknown,
                "PortOwnerUnknown",
            ),
            (
                exp(50051, PortExpect::Held, None, Some(POD_UID)),
                Some(held(
                    "::",
                    vec![SocketOwner {
                        pid: 7,
                        exe: None,
                        pod_uid: Some(POD_UID.into()),
                    }],
                )),
                Ok,
                "PortOk",
            ),
        ];
        for (i, (e, st, status, reason)) in cases.into_iter().enumerate() {
            let r = evaluate_expectation(&e, st.as_ref());
            assert_eq!(
                (r.status, r.reason.as_str()),
                (status, reason),
                "case {i}: {r:?}"
            );
            assert_eq!(r.subject, "tcp/50051");
            assert_eq!(r.name, "ports");
        }
    }

    #[test]
    fn ghost_owner_runs_but_does_not_listen() {
        let e = exp(9003, PortExpect::Held, Some("/opt/mooncake_master"), None);
        let running = [owner(77, "/opt/mooncake_master", Some(POD_UID))];
        let r = evaluate_expectation_with(&e, None, &running);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Critical, "PortOwnerNotListening")
        );
        assert_eq!(r.observed["verdict"], "Ghost");
        assert_eq!(r.observed["runningPids"], "77");
        assert!(
            r.message.contains("pid 77 (/opt/mooncake_master"),
            "{}",
            r.message
        );
        let r = evaluate_expectation(&e, None);
        assert_eq!(r.reason, "PortNotListening");
        assert_eq!(r.observed["verdict"], "NotListening");
        let r = evaluate_expectation(&exp(1, PortExpect::Free, None, None), None);
        assert_eq!(r.observed["verdict"], "Free");
        let r = evaluate_expectation(
            &e,
            Some(&held("::", vec![owner(77, "/opt/mooncake_master", None)])),
        );
        assert_eq!(r.observed["verdict"], "HeldByExpected");
    }

    #[test]
    fn conflict_message_names_port_pid_exe_pod() {
        let uid = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";
        let r = evaluate_expectation(
            &exp(50051, PortExpect::Free, None, None),
            Some(&held(
                "0.0.0.0",
                vec![owner(1234, "/opt/mooncake/mooncake_master", Some(uid))],
            )),
        );
        for needle in [
            "port 50051 (mooncake master rpc)",
            "pid 1234",
            "/opt/mooncake/mooncake_master",
            uid,
            "0.0.0.0",
        ] {
            assert!(r.message.contains(needle), "{needle} not in {}", r.message);
        }
        assert_eq!(r.observed["bindScope"], "all");
        assert_eq!(r.observed["pids"], "1234");
        assert_eq!(r.observed["podUids"], uid);
    }
}
