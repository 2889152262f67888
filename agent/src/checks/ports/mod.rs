//! `ports`: TCP listeners on the node against the plan's port expectations.
//!
//! Listening sockets come from `<proc_root>/net/tcp` and `<proc_root>/net/tcp6` (state `0A`,
//! LISTEN; the network namespace is the agent's, the host's for a hostNetwork DaemonSet). A
//! socket's owner is found by scanning `<proc_root>/<pid>/fd/*` for the link `socket:[<inode>]`,
//! then reading `<proc_root>/<pid>/exe` (the executable, never `comm`, which a wrapper and its
//! child share) and `<proc_root>/<pid>/cgroup` (the Kubernetes pod UID, cgroupfs or systemd
//! driver). Owners in another PID namespace or unreadable without privileges stay unknown.
//!
//! Results: one `host` summary (`ListeningPorts`) and one `tcp/<port>` result per plan
//! expectation (`PortOk`, `PortConflict`, `PortNotListening`, `PortOwnerNotListening`,
//! `PortOwnerMismatch`, `PortOwnerUnknown`; `ProcNetUnavailable` when the socket tables cannot
//! be read; `NotHostNetwork` when they are not the host's: the check first compares the
//! network namespace of `<proc_root>/self` with the host's, `<proc_root>/1/net` for a hostPID
//! agent ([`host_netns_verdict`]), since an agent without hostNetwork would otherwise read its
//! pod's sockets and report every `Free` port Ok and every `Held` one Critical. When either side
//! cannot be examined the verdicts stand and the host summary carries
//! `observed.hostNetworkUnverified` with the cause). Each carries the verdict in
//! `observed.verdict`: `Free`, `HeldByExpected`, `Conflict`, `Ghost` (the expected owner runs but
//! does not listen), `NotListening`, `OwnerMismatch`, `OwnerUnknown`. Command lines are never
//! read (they carry API keys): only executables and pod UIDs.
//!
//! # Files
//!
//! - this file: the check itself ([`PortsCheck`]): reads the tables, resolves owners, and
//!   turns each plan expectation into a result;
//! - [`netns`]: whether the socket tables are the host's ([`netns::host_netns_verdict`]);
//! - [`sockets`]: the kernel's TCP tables (`net/tcp`, `net/tcp6`) parsed into sockets and
//!   listeners;
//! - [`owners`]: who owns a socket — its process, executable and pod UID (from the cgroup);
//! - [`verdict`]: one port's state against its expectation (`Free`, `HeldByExpected`,
//!   `Conflict`, `Ghost`, …) and the host summary;
//! - [`ephemeral`]: the ephemeral port range and the planned ports it puts at risk.

pub mod ephemeral;
pub mod netns;
pub mod owners;
pub mod sockets;
pub mod verdict;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, PortExpect};

use super::{Check, ChecksConfig};

use ephemeral::{evaluate_ephemeral_range, read_ephemeral_range};
use netns::{host_netns_verdict, NetnsVerdict};
use owners::{find_owners, read_owner, socket_pids, SocketOwner};
use sockets::read_sockets;
use verdict::{evaluate_expectation_held, expect_label, summarize, HeldPort, PortState};

/// Check name.
pub const NAME: &str = "ports";

/// Reason of every result when the socket tables are not the host's ([`host_netns_verdict`]).
pub const NOT_HOST_NETWORK: &str = "NotHostNetwork";

/// The `ports` check.
#[derive(Debug, Clone)]
pub struct PortsCheck {
    proc_root: PathBuf,
    host_net: PathBuf,
}

impl PortsCheck {
    /// Reads `cfg.proc_root`; verifies against `cfg.host_netns` (default `<proc_root>/1/net`).
    pub fn new(cfg: &ChecksConfig) -> Self {
        PortsCheck {
            proc_root: cfg.proc_root.clone(),
            host_net: cfg
                .host_netns
                .clone()
                .unwrap_or_else(|| cfg.proc_root.join("1").join("net")),
        }
    }
}

pub(super) fn join<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The host summary and every expectation of `plan`, Unknown for `reason`: the socket tables
/// say nothing about the host's ports.
fn all_unknown(plan: &NodePlan, reason: &str, msg: &str) -> Vec<CheckResult> {
    let mut out = vec![CheckResult::new(
        NAME,
        "host",
        CheckStatus::Unknown,
        reason,
        msg,
    )];
    out.extend(plan.ports.iter().map(|p| {
        CheckResult::new(
            NAME,
            format!("tcp/{}", p.port),
            CheckStatus::Unknown,
            reason,
            msg,
        )
        .with("port", p.port)
        .with("expect", expect_label(p.expect))
    }));
    out
}

impl Check for PortsCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&self, plan: &NodePlan) -> Vec<CheckResult> {
        let netns = host_netns_verdict(&self.proc_root, &self.host_net);
        if let NetnsVerdict::NotHost { reader, host } = netns {
            let msg = format!(
                "the agent is not in the host's network namespace (its TCP table is inode \
                 {reader}, the host's inode {host}): the socket tables it reads are its pod's, so \
                 no host port can be checked; run the agent with hostNetwork (chart \
                 agent.hostNetwork: true)."
            );
            return all_unknown(plan, NOT_HOST_NETWORK, &msg);
        }
        let sockets = match read_sockets(&self.proc_root) {
            Ok(l) => l,
            Err(e) => {
                let tables = self.proc_root.join("net").join("tcp");
                let msg = format!(
                    "cannot read the TCP socket tables ({}, tcp6): {e}; listening ports are \
                     unknown.",
                    tables.display()
                );
                return all_unknown(plan, "ProcNetUnavailable", &msg);
            }
        };

        let mut ports: BTreeMap<u16, PortState> = BTreeMap::new();
        let mut listening_sockets = 0;
        for l in sockets.iter().filter(|s| s.is_listening()) {
            listening_sockets += 1;
            let st = ports.entry(l.port).or_default();
            st.addrs.push(l.addr);
            if !st.inodes.contains(&l.inode) {
                st.inodes.push(l.inode);
            }
        }

        // Resolve owners only for ports the plan names: a full fd scan is the expensive part.
        let planned: HashSet<u16> = plan.ports.iter().map(|p| p.port).collect();
        // A planned port nothing listens on may still be held by other sockets (an outgoing
        // connection's source port): a later bind of it fails.
        let mut held: BTreeMap<u16, HeldPort> = BTreeMap::new();
        for s in sockets.iter().filter(|s| {
            !s.is_listening() && planned.contains(&s.port) && !ports.contains_key(&s.port)
        }) {
            held.entry(s.port).or_default().sockets.push(s.clone());
        }
        let wanted: HashSet<u64> = ports
            .iter()
            .filter(|(p, _)| planned.contains(p))
            .flat_map(|(_, st)| st.inodes.iter().copied())
            .chain(
                held.values()
                    .flat_map(|h| h.sockets.iter().map(|s| s.inode)),
            )
            .filter(|i| *i != 0)
            .collect();
        let pids = socket_pids(&self.proc_root, &wanted);
        let mut owner_cache: HashMap<u32, SocketOwner> = HashMap::new();
        for h in held.values_mut() {
            let mut seen = BTreeSet::new();
            for s in &h.sockets {
                for pid in pids.get(&s.inode).into_iter().flatten() {
                    if seen.insert(*pid) {
                        let owner = owner_cache
                            .entry(*pid)
                            .or_insert_with(|| read_owner(&self.proc_root, *pid))
                            .clone();
                        h.owners.push(owner);
                    }
                }
            }
        }
        for (port, st) in ports.iter_mut() {
            if !planned.contains(port) {
                continue;
            }
            let mut seen = BTreeSet::new();
            for inode in &st.inodes {
                for pid in pids.get(inode).into_iter().flatten() {
                    if seen.insert(*pid) {
                        let owner = owner_cache
                            .entry(*pid)
                            .or_insert_with(|| read_owner(&self.proc_root, *pid))
                            .clone();
                        st.owners.push(owner);
                    }
                }
            }
        }

        let mut summary = summarize(&ports, listening_sockets);
        if let NetnsVerdict::Unverified(why) = &netns {
            // Not proof of a wrong namespace, so the verdicts stand; the reader sees why they
            // could not be vouched for.
            summary = summary.with("hostNetworkUnverified", why);
        }
        let mut out = vec![summary];
        let range = read_ephemeral_range(&self.proc_root);
        out.extend(plan.ports.iter().map(|exp| {
            let state = ports.get(&exp.port);
            // A held port nobody listens on: is its owner running at all (a ghost)?
            let held = held.get(&exp.port);
            let running = match (exp.expect, state, &exp.owner, held) {
                (PortExpect::Held, None, Some(want), None) => find_owners(&self.proc_root, want, 8),
                _ => Vec::new(),
            };
            let mut result = evaluate_expectation_held(exp, state, held, &running);
            if let Ok(range) = &range {
                if range.at_risk(exp.port) {
                    result = result.with("ephemeralRange", range.range_text());
                }
            }
            result
        }));
        if !plan.ports.is_empty() {
            out.push(evaluate_ephemeral_range(
                &plan.ports,
                range.as_ref().map_err(String::as_str),
            ));
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::plan::PortExpectation;

    /// `<root>/self/net/tcp` and `<root>/1/net/tcp` with `TCP`: one file seen twice (a hard
    /// link, as procfs shows one namespace's table under every process in it), two files (two
    /// namespaces), or either absent.
    fn netns_tree(reader: bool, host: bool, same: bool) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for pid in ["self", "1"] {
            std::fs::create_dir_all(root.path().join(pid).join("net")).unwrap();
        }
        let r = root.path().join("self/net/tcp");
        let h = root.path().join("1/net/tcp");
        if reader {
            std::fs::write(&r, TCP).unwrap();
        }
        if host {
            if same && reader {
                std::fs::hard_link(&r, &h).unwrap();
            } else {
                std::fs::write(&h, TCP).unwrap();
            }
        }
        // The check reads `<proc_root>/net/tcp`: the reader's table.
        std::fs::create_dir_all(root.path().join("net")).unwrap();
        std::fs::write(root.path().join("net/tcp"), TCP).unwrap();
        root
    }

    #[test]
    fn the_socket_tables_are_vouched_for_only_in_the_hosts_network_namespace() {
        let check = |reader, host, same| {
            let root = netns_tree(reader, host, same);
            host_netns_verdict(root.path(), &root.path().join("1/net"))
        };
        assert_eq!(check(true, true, true), NetnsVerdict::Host);
        assert!(
            matches!(check(true, true, false), NetnsVerdict::NotHost { reader, host } if reader != host)
        );
        assert!(
            matches!(check(true, false, false), NetnsVerdict::Unverified(e) if e.contains("1/net/tcp"))
        );
        assert!(
            matches!(check(false, true, false), NetnsVerdict::Unverified(e) if e.contains("self/net/tcp"))
        );

        // Outside the host's namespace every verdict is Unknown: nothing read there says
        // anything about the host's ports.
        let plan = NodePlan {
            ports: vec![
                PortExpectation {
                    port: 8080,
                    expect: PortExpect::Free,
                    purpose: "x".into(),
                    owner: None,
                },
                PortExpectation {
                    port: 9999,
                    expect: PortExpect::Held,
                    purpose: "y".into(),
                    owner: None,
                },
            ],
            ..NodePlan::default()
        };
        let run_in = |root: &tempfile::TempDir| {
            let cfg = ChecksConfig {
                proc_root: root.path().to_path_buf(),
                ..ChecksConfig::default()
            };
            PortsCheck::new(&cfg).run(&plan)
        };
        let r = run_in(&netns_tree(true, true, false));
        let got: Vec<_> = r
            .iter()
            .map(|x| (x.subject.as_str(), x.status, x.reason.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("host", CheckStatus::Unknown, NOT_HOST_NETWORK),
                ("tcp/8080", CheckStatus::Unknown, NOT_HOST_NETWORK),
                ("tcp/9999", CheckStatus::Unknown, NOT_HOST_NETWORK),
            ]
        );
        assert!(r[0].message.contains("hostNetwork"), "{}", r[0].message);

        // The same table: the verdicts as the tables say.
        let r = run_in(&netns_tree(true, true, true));
        assert_eq!(r[0].reason, "ListeningPorts");
        assert!(
            !r[0].observed.contains_key("hostNetworkUnverified"),
            "{:?}",
            r[0]
        );
        assert_eq!(r[1].reason, "PortConflict", "{:?}", r[1]);

        // Unverifiable: the verdicts stand and the summary says why they are not vouched for.
        let r = run_in(&netns_tree(true, false, false));
        assert_eq!(r[0].reason, "ListeningPorts");
        assert!(
            r[0].observed["hostNetworkUnverified"].contains("1/net/tcp"),
            "{:?}",
            r[0]
        );
        assert_eq!(r[1].reason, "PortConflict", "{:?}", r[1]);
    }

    pub(super) const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 00000000:15B5 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1002 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F90 0100007F:D4C2 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
   3: 0502000A:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 100 0 0 10 0
";
}
