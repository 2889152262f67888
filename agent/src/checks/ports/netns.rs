//! Whether the TCP tables the agent reads are the host's: its network namespace against the
//! host's (`<proc_root>/1/net` for a hostPID agent), compared by the inode of their `tcp` table.

use std::path::Path;

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
