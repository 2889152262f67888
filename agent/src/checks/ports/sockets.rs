//! The kernel's TCP tables (`<proc_root>/net/tcp` and `tcp6`): every socket with its state,
//! address, remote and inode, and the LISTEN ones with their bind scope.

use std::io;
use std::net::{IpAddr, SocketAddr};

use procfs::net::TcpState;
use std::path::Path;

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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::tests::TCP;
    use super::*;

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
}
