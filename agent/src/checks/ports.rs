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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::io;
use std::net::{IpAddr, SocketAddr};

use procfs::net::TcpState;
use std::path::{Path, PathBuf};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, PortExpect, PortExpectation, PortOwner};

use super::{Check, ChecksConfig};

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

/// Whether the socket tables the check reads (`<proc_root>/net/tcp`, the reading process's
/// network namespace) are the host's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetnsVerdict {
    /// The reader's network namespace is the host's.
    Host,
    /// It is another one (an agent without hostNetwork): every listener read is its pod's, so
    /// a host port's verdict would be made up. Inode numbers of the two `tcp` tables (one per
    /// network namespace).
    NotHost {
        /// The reader's (`<proc_root>/self/net/tcp`).
        reader: u64,
        /// The host's (`<host_net>/tcp`).
        host: u64,
    },
    /// One of the two tables could not be examined: the check goes on, saying so.
    Unverified(String),
}

/// Compares the network namespace of `<proc_root>/self` with the one `host_net` (a
/// `/proc/<pid>/net` directory of a process in the host's namespace) shows, by the identity
/// (device, inode) of their `tcp` tables: procfs gives each network namespace its own entries,
/// and a `stat` needs no ptrace access to the other process, which reading its `ns/net` link
/// would (and which container runtimes' AppArmor profiles refuse for the host's init even with
/// `CAP_SYS_PTRACE`).
pub fn host_netns_verdict(proc_root: &Path, host_net: &Path) -> NetnsVerdict {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| (m.dev(), m.ino()))
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    let reader = proc_root.join("self").join("net").join("tcp");
    match (id(&reader), id(&host_net.join("tcp"))) {
        (Ok(r), Ok(h)) if r == h => NetnsVerdict::Host,
        (Ok((_, reader)), Ok((_, host))) => NetnsVerdict::NotHost { reader, host },
        (Err(e), _) | (_, Err(e)) => NetnsVerdict::Unverified(e),
    }
}

/// Which addresses a listener accepts connections on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BindScope {
    /// Loopback only (`127.0.0.0/8`, `::1`, `::ffff:127.x.x.x`).
    Loopback,
    /// One specific non-loopback address.
    Specific,
    /// Every address (`0.0.0.0` or `::`).
    All,
}

impl BindScope {
    /// Scope of a bound address.
    pub fn of(addr: IpAddr) -> Self {
        let addr = match addr {
            IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .map(IpAddr::V4)
                .unwrap_or(IpAddr::V6(v6)),
            v4 => v4,
        };
        if addr.is_unspecified() {
            BindScope::All
        } else if addr.is_loopback() {
            BindScope::Loopback
        } else {
            BindScope::Specific
        }
    }

    /// Lower-case label used in observed values: `all`, `loopback`, `specific`.
    pub fn as_str(self) -> &'static str {
        match self {
            BindScope::Loopback => "loopback",
            BindScope::Specific => "specific",
            BindScope::All => "all",
        }
    }
}

/// One LISTEN socket from `/proc/net/tcp{,6}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// Bound address.
    pub addr: IpAddr,
    /// Bound TCP port.
    pub port: u16,
    /// Socket inode (matches the `socket:[inode]` link of the owner's fd).
    pub inode: u64,
}

/// One socket of `/proc/net/tcp` or `/proc/net/tcp6`, in any TCP state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// Bound local address.
    pub addr: IpAddr,
    /// Bound local TCP port.
    pub port: u16,
    /// Peer address and port (`0.0.0.0:0` or `[::]:0` for a listener).
    pub remote: SocketAddr,
    /// The kernel's TCP state (`st` column).
    pub state: TcpState,
    /// Socket inode (0 for a TIME_WAIT socket, which belongs to no process any more).
    pub inode: u64,
}

impl TcpSocket {
    /// True for a LISTEN socket (state `0A`).
    pub fn is_listening(&self) -> bool {
        self.state == TcpState::Listen
    }
}

/// The kernel's name of a TCP state, as `ss` prints it: `ESTABLISHED`, `TIME_WAIT`, ….
pub fn tcp_state_name(state: &TcpState) -> &'static str {
    match state {
        TcpState::Established => "ESTABLISHED",
        TcpState::SynSent => "SYN_SENT",
        TcpState::SynRecv => "SYN_RECV",
        TcpState::FinWait1 => "FIN_WAIT1",
        TcpState::FinWait2 => "FIN_WAIT2",
        TcpState::TimeWait => "TIME_WAIT",
        TcpState::Close => "CLOSE",
        TcpState::CloseWait => "CLOSE_WAIT",
        TcpState::LastAck => "LAST_ACK",
        TcpState::Listen => "LISTEN",
        TcpState::Closing => "CLOSING",
        TcpState::NewSynRecv => "NEW_SYN_RECV",
    }
}

/// Parses the text of `/proc/net/tcp` or `/proc/net/tcp6` into every socket, whatever its
/// state, with the `procfs` crate's parser (addresses are the kernel's hex dump of 32-bit words
/// in host byte order: `0100007F:1F90` is 127.0.0.1:8080 on little-endian hosts). Parsed line by
/// line, so the header and a malformed line are skipped rather than losing the table.
pub fn parse_proc_net_tcp_sockets(text: &str) -> Vec<TcpSocket> {
    use procfs::FromBufReadSI;
    let si = procfs::current_system_info();
    text.lines()
        .filter_map(|line| {
            // `from_buf_read` skips a first (header) line.
            let one = format!("\n{line}");
            procfs::net::TcpNetEntries::from_buf_read(one.as_bytes(), si)
                .ok()?
                .0
                .into_iter()
                .next()
        })
        .map(|e| TcpSocket {
            addr: e.local_address.ip(),
            port: e.local_address.port(),
            remote: e.remote_address,
            state: e.state,
            inode: e.inode,
        })
        .collect()
}

/// Parses the text of `/proc/net/tcp` or `/proc/net/tcp6` and keeps LISTEN sockets (state
/// `0A`); see [`parse_proc_net_tcp_sockets`].
pub fn parse_proc_net_tcp(text: &str) -> Vec<Listener> {
    parse_proc_net_tcp_sockets(text)
        .into_iter()
        .filter(TcpSocket::is_listening)
        .map(|s| Listener {
            addr: s.addr,
            port: s.port,
            inode: s.inode,
        })
        .collect()
}

/// The Kubernetes pod UID in a `/proc/<pid>/cgroup` text, normalised to lower case with
/// dashes, or `None` when no line has a kubepods path.
///
/// Accepts the cgroupfs driver's `…/kubepods/burstable/pod<uid>/<container>` and the systemd
/// driver's `…/kubepods-burstable-pod<uid_with_underscores>.slice/…`, on cgroup v1 and v2.
pub fn pod_uid_from_cgroup(text: &str) -> Option<String> {
    for path in kubepods_paths(text) {
        for seg in path.split('/') {
            let candidate = if let Some(stem) = seg.strip_suffix(".slice") {
                stem.rfind("-pod").map(|i| &stem[i + 4..])
            } else {
                seg.strip_prefix("pod")
            };
            if let Some(uid) = candidate.and_then(normalise_pod_uid) {
                return Some(uid);
            }
        }
    }
    None
}

/// The cgroup paths of a `/proc/<pid>/cgroup` text (`hierarchy:controllers:path` lines) that
/// lie under `kubepods`.
pub fn kubepods_paths(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .filter(|path| path.contains("kubepods"))
}

/// Lower-cases a pod UID and turns the systemd driver's underscores into dashes; `None` when
/// the result is not hex digits and dashes of a plausible length (a UUID, or a static pod's
/// 32-digit config hash).
pub fn normalise_pod_uid(uid: &str) -> Option<String> {
    let uid = uid.trim().replace('_', "-").to_ascii_lowercase();
    let hexdigits = uid.chars().filter(|c| c.is_ascii_hexdigit()).count();
    if uid.len() >= 8 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-') && hexdigits >= 8 {
        Some(uid)
    } else {
        None
    }
}

/// A process that holds a listening socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketOwner {
    /// Process id in the PID namespace of `proc_root`.
    pub pid: u32,
    /// Target of `/proc/<pid>/exe` (a ` (deleted)` suffix removed); `None` when unreadable.
    pub exe: Option<String>,
    /// Pod UID from `/proc/<pid>/cgroup`; `None` outside Kubernetes pods.
    pub pod_uid: Option<String>,
}

impl SocketOwner {
    fn describe(&self) -> String {
        let mut s = format!("pid {}", self.pid);
        let exe = self.exe.as_deref().unwrap_or("exe unreadable");
        let _ = write!(s, " ({exe}");
        if let Some(uid) = &self.pod_uid {
            let _ = write!(s, ", pod {uid}");
        }
        s.push(')');
        s
    }

    /// True when every field the expected owner gives matches.
    pub fn matches(&self, want: &PortOwner) -> bool {
        let exe_ok = want
            .exe
            .as_deref()
            .is_none_or(|e| self.exe.as_deref() == Some(e));
        let pod_ok = want.pod_uid.as_deref().is_none_or(|u| {
            normalise_pod_uid(u).is_some_and(|u| self.pod_uid.as_deref() == Some(u.as_str()))
        });
        exe_ok && pod_ok
    }
}

/// Maps each socket inode in `wanted` to the pids whose fd table holds it, by scanning
/// `<proc_root>/<pid>/fd`. Processes that vanish or cannot be read are skipped.
pub fn socket_pids(proc_root: &Path, wanted: &HashSet<u64>) -> HashMap<u64, Vec<u32>> {
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    if wanted.is_empty() {
        return out;
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return out;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            if wanted.contains(&inode) {
                let pids = out.entry(inode).or_default();
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
    }
    for pids in out.values_mut() {
        pids.sort_unstable();
    }
    out
}

/// Reads a process's executable and pod UID under `proc_root`.
pub fn read_owner(proc_root: &Path, pid: u32) -> SocketOwner {
    let dir = proc_root.join(pid.to_string());
    let exe = std::fs::read_link(dir.join("exe")).ok().map(|p| {
        let s = p.to_string_lossy().into_owned();
        s.strip_suffix(" (deleted)")
            .map(str::to_string)
            .unwrap_or(s)
    });
    let pod_uid = std::fs::read_to_string(dir.join("cgroup"))
        .ok()
        .and_then(|t| pod_uid_from_cgroup(&t));
    SocketOwner { pid, exe, pod_uid }
}

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

/// Reads every socket of `<proc_root>/net/tcp` and `tcp6`, any state. A missing `tcp6` (IPv6
/// disabled) is fine; the error is returned only when neither table can be read.
pub fn read_sockets(proc_root: &Path) -> io::Result<Vec<TcpSocket>> {
    let mut out = Vec::new();
    let mut first_err = None;
    let mut any = false;
    for table in ["tcp", "tcp6"] {
        match std::fs::read_to_string(proc_root.join("net").join(table)) {
            Ok(text) => {
                any = true;
                out.extend(parse_proc_net_tcp_sockets(&text));
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match (any, first_err) {
        (false, Some(e)) => Err(e),
        _ => Ok(out),
    }
}

/// Reads the LISTEN sockets of `<proc_root>/net/tcp` and `tcp6` ([`read_sockets`]).
pub fn read_listeners(proc_root: &Path) -> io::Result<Vec<Listener>> {
    Ok(read_sockets(proc_root)?
        .into_iter()
        .filter(TcpSocket::is_listening)
        .map(|s| Listener {
            addr: s.addr,
            port: s.port,
            inode: s.inode,
        })
        .collect())
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

/// The node's ephemeral port range (`net.ipv4.ip_local_port_range`, which IPv6 uses too) and
/// the ports excluded from it (`net.ipv4.ip_local_reserved_ports`): the source ports the kernel
/// picks for outgoing connections. A fixed port inside the range and not reserved can be taken
/// by any outgoing connection, and its owner's `bind` then fails with `EADDRINUSE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EphemeralRange {
    /// Lowest port of the range (inclusive).
    pub low: u16,
    /// Highest port of the range (inclusive).
    pub high: u16,
    /// Reserved ranges, inclusive (a single port is `(p, p)`).
    pub reserved: Vec<(u16, u16)>,
}

impl EphemeralRange {
    /// True when `port` lies in `low..=high`.
    pub fn contains(&self, port: u16) -> bool {
        (self.low..=self.high).contains(&port)
    }

    /// True when `port` is in `ip_local_reserved_ports`.
    pub fn is_reserved(&self, port: u16) -> bool {
        self.reserved.iter().any(|(a, b)| (*a..=*b).contains(&port))
    }

    /// True when an outgoing connection can take `port` as its source port.
    pub fn at_risk(&self, port: u16) -> bool {
        self.contains(port) && !self.is_reserved(port)
    }

    /// `low-high`, e.g. `32768-60999`.
    pub fn range_text(&self) -> String {
        format!("{}-{}", self.low, self.high)
    }
}

/// Parses `ip_local_port_range` (`"32768\t60999\n"`). `None` unless two ports, low ≤ high.
pub fn parse_port_range(text: &str) -> Option<(u16, u16)> {
    let mut it = text.split_whitespace().map(|w| w.parse::<u16>());
    match (it.next(), it.next(), it.next()) {
        (Some(Ok(low)), Some(Ok(high)), None) if low <= high => Some((low, high)),
        _ => None,
    }
}

/// Parses `ip_local_reserved_ports` (`"8000-8010,50051\n"`, empty when none). `None` on an
/// entry that is not a port or an ascending `a-b` range.
pub fn parse_reserved_ports(text: &str) -> Option<Vec<(u16, u16)>> {
    let text = text.trim();
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',')
        .map(|entry| {
            let entry = entry.trim();
            match entry.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                    (a <= b).then_some((a, b))
                }
                None => entry.parse().ok().map(|p| (p, p)),
            }
        })
        .collect()
}

/// Reads `<proc_root>/sys/net/ipv4/ip_local_port_range` and `ip_local_reserved_ports` (both
/// per network namespace: the reading process's, the host's for a hostNetwork agent). Errors:
/// the file and cause, when either cannot be read or parsed.
pub fn read_ephemeral_range(proc_root: &Path) -> Result<EphemeralRange, String> {
    let dir = proc_root.join("sys").join("net").join("ipv4");
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
    };
    let range = read("ip_local_port_range")?;
    let (low, high) = parse_port_range(&range).ok_or_else(|| {
        format!(
            "{}: unreadable value {:?}",
            dir.join("ip_local_port_range").display(),
            range.trim()
        )
    })?;
    let reserved = read("ip_local_reserved_ports")?;
    let reserved = parse_reserved_ports(&reserved).ok_or_else(|| {
        format!(
            "{}: unreadable value {:?}",
            dir.join("ip_local_reserved_ports").display(),
            reserved.trim()
        )
    })?;
    Ok(EphemeralRange {
        low,
        high,
        reserved,
    })
}

/// Subject of the [`evaluate_ephemeral_range`] result.
pub const EPHEMERAL_SUBJECT: &str = "ephemeral-range";

/// The `ephemeral-range` result for the plan's expectations (one per distinct port):
/// `PortsInEphemeralRange` (Warning) naming each planned port an outgoing connection can take
/// and the range, `EphemeralRangeClear` (Ok) when none (reserved ones named), or
/// `EphemeralRangeUnknown` (Unknown) with the cause when the range cannot be read.
pub fn evaluate_ephemeral_range(
    ports: &[PortExpectation],
    range: Result<&EphemeralRange, &str>,
) -> CheckResult {
    let mut planned: BTreeMap<u16, Vec<&str>> = BTreeMap::new();
    for p in ports {
        let purposes = planned.entry(p.port).or_default();
        if !p.purpose.is_empty() && !purposes.contains(&p.purpose.as_str()) {
            purposes.push(&p.purpose);
        }
    }
    let range = match range {
        Ok(r) => r,
        Err(e) => {
            return CheckResult::new(
                NAME,
                EPHEMERAL_SUBJECT,
                CheckStatus::Unknown,
                "EphemeralRangeUnknown",
                format!(
                    "cannot read the node's ephemeral port range ({e}); whether an outgoing \
                     connection can take a planned port is unknown."
                ),
            )
        }
    };
    let label = |port: &u16| {
        let purposes = &planned[port];
        if purposes.is_empty() {
            port.to_string()
        } else {
            format!("{port} ({})", purposes.join(", "))
        }
    };
    let at_risk: Vec<u16> = planned
        .keys()
        .copied()
        .filter(|p| range.at_risk(*p))
        .collect();
    let reserved: Vec<u16> = planned
        .keys()
        .copied()
        .filter(|p| range.contains(*p) && range.is_reserved(*p))
        .collect();
    let text = range.range_text();
    let result = if at_risk.is_empty() {
        CheckResult::new(
            NAME,
            EPHEMERAL_SUBJECT,
            CheckStatus::Ok,
            "EphemeralRangeClear",
            format!(
                "no planned port can be taken as an outgoing connection's source port: none lies \
                 in the ephemeral range {text} (net.ipv4.ip_local_port_range){}.",
                if reserved.is_empty() {
                    String::new()
                } else {
                    format!(
                        " unreserved; {} reserved in net.ipv4.ip_local_reserved_ports",
                        reserved.iter().map(label).collect::<Vec<_>>().join(", ")
                    )
                }
            ),
        )
    } else {
        CheckResult::new(
            NAME,
            EPHEMERAL_SUBJECT,
            CheckStatus::Warning,
            "PortsInEphemeralRange",
            format!(
                "planned port{} {} lie{} in the node's ephemeral port range {text} \
                 (net.ipv4.ip_local_port_range): any outgoing connection may take {} as its \
                 source port, and the owner's bind then fails with EADDRINUSE until that \
                 connection closes. Reserve {} (sysctl net.ipv4.ip_local_reserved_ports={}) or \
                 move {} out of the range.",
                if at_risk.len() == 1 { "" } else { "s" },
                at_risk.iter().map(label).collect::<Vec<_>>().join(", "),
                if at_risk.len() == 1 { "s" } else { "" },
                if at_risk.len() == 1 { "it" } else { "one" },
                if at_risk.len() == 1 { "it" } else { "them" },
                join(&at_risk),
                if at_risk.len() == 1 { "it" } else { "them" },
            ),
        )
        .with("atRiskPorts", join(&at_risk))
    };
    let mut result = result.with("ephemeralRange", text);
    if !reserved.is_empty() {
        result = result.with("reservedPorts", join(&reserved));
    }
    result
}

fn join<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn expect_label(e: PortExpect) -> &'static str {
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

/// Processes matching every field of `want` (exe, pod UID), by a scan of
/// `<proc_root>/<pid>/exe` and `cgroup`; at most `limit`, ascending by pid. An owner with no
/// field matches nothing (every process would).
pub fn find_owners(proc_root: &Path, want: &PortOwner, limit: usize) -> Vec<SocketOwner> {
    if want.exe.is_none() && want.pod_uid.is_none() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    pids.sort_unstable();
    let mut out = Vec::new();
    for pid in pids {
        let owner = read_owner(proc_root, pid);
        if want.exe.is_some() && owner.exe.is_none() {
            continue;
        }
        if owner.matches(want) {
            out.push(owner);
            if out.len() >= limit {
                break;
            }
        }
    }
    out
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

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 00000000:15B5 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1002 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F90 0100007F:D4C2 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
   3: 0502000A:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 100 0 0 10 0
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1F92 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2002 1 0000000000000000 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:1F93 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2003 1 0000000000000000 100 0 0 10 0
";

    /// Lines as the kernel writes them (captured in a private network namespace): an outgoing
    /// connection from 127.0.0.1:50051, then its TIME_WAIT remnant (inode 0, short line), and a
    /// malformed line.
    #[test]
    #[cfg(target_endian = "little")]
    fn parses_sockets_of_every_state() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1B9E 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1180817 1 00000000f162ac4e 100 0 0 10 0
   1: 0100007F:C383 0100007F:1B9E 01 00000000:00000000 00:00000000 00000000     0        0 1180818 2 000000000ed02435 20 0 0 10 -1
   2: 0100007F:C383 0100007F:1B9E 06 00000000:00000000 03:0000175C 00000000     0        0 0 3 000000009a6d2810
   3: garbage
";
        let all = parse_proc_net_tcp_sockets(text);
        let got: Vec<(u16, &str, String, u64)> = all
            .iter()
            .map(|s| {
                (
                    s.port,
                    tcp_state_name(&s.state),
                    s.remote.to_string(),
                    s.inode,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (7070, "LISTEN", "0.0.0.0:0".to_string(), 1180817),
                (50051, "ESTABLISHED", "127.0.0.1:7070".to_string(), 1180818),
                (50051, "TIME_WAIT", "127.0.0.1:7070".to_string(), 0),
            ]
        );
        assert_eq!(parse_proc_net_tcp(text).len(), 1);
    }

    #[test]
    fn ephemeral_range_and_reserved_ports() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_port_range("50051 50051"), Some((50051, 50051)));
        assert_eq!(parse_port_range("60999 32768"), None);
        assert_eq!(parse_port_range("1 2 3"), None);
        assert_eq!(parse_reserved_ports("\n"), Some(vec![]));
        assert_eq!(
            parse_reserved_ports("8000-8010,50051\n"),
            Some(vec![(8000, 8010), (50051, 50051)])
        );
        assert_eq!(parse_reserved_ports("9-1"), None);
        assert_eq!(parse_reserved_ports("x"), None);

        let range = EphemeralRange {
            low: 32768,
            high: 60999,
            reserved: vec![(50051, 50051)],
        };
        let exp = |port, purpose: &str| PortExpectation {
            port,
            expect: PortExpect::Free,
            owner: None,
            purpose: purpose.into(),
        };
        // 50051 is reserved: clear, and says so.
        let r = evaluate_ephemeral_range(&[exp(50051, "rpc"), exp(8080, "http")], Ok(&range));
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Ok, "EphemeralRangeClear")
        );
        assert_eq!(r.observed["reservedPorts"], "50051");
        // Unreserved: a Warning naming the port, its purpose and the range.
        let open = EphemeralRange {
            reserved: vec![],
            ..range.clone()
        };
        let r = evaluate_ephemeral_range(
            &[exp(50051, "rpc"), exp(50051, "rpc"), exp(8080, "http")],
            Ok(&open),
        );
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Warning, "PortsInEphemeralRange")
        );
        assert!(r.message.contains("50051 (rpc)"), "{}", r.message);
        assert!(r.message.contains("32768-60999"), "{}", r.message);
        assert!(!r.message.contains("8080"), "{}", r.message);
        assert_eq!(r.observed["atRiskPorts"], "50051");
        let r = evaluate_ephemeral_range(&[exp(1, "")], Err("no file"));
        assert_eq!(r.reason, "EphemeralRangeUnknown");
    }

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

    #[test]
    #[cfg(target_endian = "little")]
    fn parses_listen_sockets_v4_and_v6() {
        let v4 = parse_proc_net_tcp(TCP);
        assert_eq!(v4.len(), 3, "established socket skipped");
        assert_eq!(v4[0].addr, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(v4[0].port, 8080);
        assert_eq!(v4[0].inode, 1001);
        assert_eq!(v4[1].addr, "0.0.0.0".parse::<IpAddr>().unwrap());
        assert_eq!(v4[1].port, 5557);
        assert_eq!(v4[2].addr, "10.0.2.5".parse::<IpAddr>().unwrap());
        let v6 = parse_proc_net_tcp(TCP6);
        assert_eq!(v6.len(), 3);
        assert_eq!(v6[0].addr, "::".parse::<IpAddr>().unwrap());
        assert_eq!(v6[1].addr, "::1".parse::<IpAddr>().unwrap());
        assert_eq!(v6[2].addr, "::ffff:127.0.0.1".parse::<IpAddr>().unwrap());
        let scopes: Vec<_> = v6.iter().map(|l| BindScope::of(l.addr)).collect();
        assert_eq!(
            scopes,
            [BindScope::All, BindScope::Loopback, BindScope::Loopback]
        );
        assert_eq!(BindScope::of(v4[2].addr), BindScope::Specific);
    }

    #[test]
    fn pod_uid_from_both_cgroup_drivers() {
        let cgroupfs =
            "12:pids:/kubepods/burstable/pod3f1c2a9e-1b2c-4d5e-8f90-0123456789ab/9a8b7c\n0::/\n";
        assert_eq!(
            pod_uid_from_cgroup(cgroupfs).as_deref(),
            Some("3f1c2a9e-1b2c-4d5e-8f90-0123456789ab")
        );
        let guaranteed = "0::/kubepods/pod3F1C2A9E-1B2C-4D5E-8F90-0123456789AB/abc\n";
        assert_eq!(
            pod_uid_from_cgroup(guaranteed).as_deref(),
            Some("3f1c2a9e-1b2c-4d5e-8f90-0123456789ab")
        );
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3f1c2a9e_1b2c_4d5e_8f90_0123456789ab.slice/cri-containerd-0123.scope\n";
        assert_eq!(
            pod_uid_from_cgroup(systemd).as_deref(),
            Some("3f1c2a9e-1b2c-4d5e-8f90-0123456789ab")
        );
        let besteffort_v1 = "4:memory:/kubepods.slice/kubepods-pod0123456789abcdef0123456789abcdef.slice/docker-1.scope\n";
        assert_eq!(
            pod_uid_from_cgroup(besteffort_v1).as_deref(),
            Some("0123456789abcdef0123456789abcdef")
        );
        assert_eq!(
            pod_uid_from_cgroup("0::/system.slice/sshd.service\n1:name=systemd:/user.slice\n"),
            None
        );
        assert_eq!(
            pod_uid_from_cgroup("0::/kubepods.slice/kubepods-burstable.slice\n"),
            None
        );
        assert_eq!(pod_uid_from_cgroup("0::/podman/podzzz/x\n"), None);
    }

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

    const POD_UID: &str = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";

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
    fn find_owners_in_a_fixture_tree() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, exe) in [
            (5, "/usr/bin/python3"),
            (9, "/opt/mooncake_master"),
            (12, "/opt/mooncake_master"),
        ] {
            let d = dir.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
            std::fs::write(d.join("cgroup"), "0::/\n").unwrap();
        }
        let want = PortOwner {
            exe: Some("/opt/mooncake_master".into()),
            pod_uid: None,
        };
        let found = find_owners(dir.path(), &want, 8);
        assert_eq!(found.iter().map(|o| o.pid).collect::<Vec<_>>(), vec![9, 12]);
        assert_eq!(find_owners(dir.path(), &want, 1).len(), 1);
        assert!(find_owners(dir.path(), &PortOwner::default(), 8).is_empty());
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
