//! Linux capabilities of the agent's threads (docs/checks.md "Capabilities", docs/security.md
//! "The agent holds capabilities only where a check needs them").
//!
//! The agent is not privileged: the DaemonSet grants `CAP_SYS_PTRACE` (another process's
//! `/proc/<pid>/{root,fd,exe,ns,mountinfo}`), `CAP_SYS_ADMIN` (`setns(2)` into a pod's network
//! namespace) and `CAP_DAC_READ_SEARCH` (reader-volume samples of another uid) and drops every
//! other capability. Capabilities are per thread, so `ic-agent run`
//! keeps them only on the checks thread ([`crate::runtime::CheckRunner`]) and the threads it
//! starts, which inherit them. Every other thread — the tokio runtime that decodes engine
//! KV-event frames (ZMQ/msgpack), parses engine `/metrics`, talks to the controller and serves
//! HTTP — clears its effective, permitted, inheritable and ambient sets before it runs anything
//! ([`drop_all`]). A cleared permitted set cannot be raised again without `execve` of a file
//! with capabilities, which the agent never does. The MP-worker probe thread drops them too,
//! right after `setns`, before it reads a byte from the worker.

use std::collections::HashSet;

use caps::CapSet;
pub use caps::Capability;

/// The capabilities the agent's checks use, each with what needs it (the table in
/// docs/checks.md "Capabilities").
pub const NEEDED: &[(Capability, &str)] = &[
    (
        Capability::CAP_SYS_PTRACE,
        "reading other processes' /proc/<pid>/root, fd, exe, ns and mountinfo (shm, mp_worker, \
         ports and mounts of engine pods)",
    ),
    (
        Capability::CAP_SYS_ADMIN,
        "setns(2) into an engine pod's network namespace (mp_worker)",
    ),
    (
        Capability::CAP_DAC_READ_SEARCH,
        "reading reader-volume sample files and directories another uid may read alone (mounts)",
    ),
];

/// Why the calling thread's capabilities could not be changed or read.
pub type Error = caps::errors::CapsError;

/// Drops every capability of the calling thread for good: the effective, permitted,
/// inheritable and ambient sets become empty. Other threads keep theirs; threads the caller
/// starts afterwards inherit the empty sets.
///
/// # Errors
/// `capset(2)` failed (it does not for a thread that only lowers its own sets).
pub fn drop_all() -> Result<(), Error> {
    // Ambient ⊆ permitted ∩ inheritable and effective ⊆ permitted: lower them first.
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Effective)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::clear(None, CapSet::Permitted)?;
    Ok(())
}

/// [`drop_all`] for a thread that must not run with capabilities at all (a tokio runtime's
/// `on_thread_start`): a failure is logged, as nothing else can be done from there.
pub fn drop_all_or_warn() {
    if let Err(e) = drop_all() {
        tracing::warn!(error = %e, "cannot drop this thread's capabilities");
    }
}

/// The calling thread's effective capabilities.
///
/// # Errors
/// `capget(2)` failed.
pub fn effective() -> Result<HashSet<Capability>, Error> {
    caps::read(None, CapSet::Effective)
}

/// Which of `needed` the calling thread lacks in its effective set, in the order given. Empty
/// when it holds all of them, or when its set cannot be read (nothing is then claimed).
pub fn missing(needed: &[Capability]) -> Vec<Capability> {
    match effective() {
        Ok(have) => needed
            .iter()
            .filter(|c| !have.contains(c))
            .copied()
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// A clause for a check's message when an operation that needs `needed` was refused: `"; the
/// agent lacks CAP_SYS_ADMIN (…)"` naming what the calling thread lacks, or `None` when it
/// holds all of them (the refusal then has another cause).
pub fn lacking_clause(needed: &[Capability]) -> Option<String> {
    let lacking = missing(needed);
    if lacking.is_empty() {
        return None;
    }
    let names: Vec<String> = lacking.iter().map(|c| c.to_string()).collect();
    let why: Vec<&str> = lacking
        .iter()
        .filter_map(|c| NEEDED.iter().find(|(n, _)| n == c).map(|(_, w)| *w))
        .collect();
    Some(format!(
        "the agent lacks {} ({}): grant it in agent.securityContext.capabilities.add",
        names.join(" and "),
        why.join("; ")
    ))
}

/// The comma-separated names of `caps` (`CAP_SYS_ADMIN,CAP_SYS_PTRACE`), for `observed` values.
pub fn names(caps: &[Capability]) -> String {
    caps.iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The `CapEff` line of `/proc/thread-self/status`: the calling thread's effective set as the
/// kernel prints it (16 hex digits), or `None` when it cannot be read.
pub fn thread_cap_eff() -> Option<String> {
    let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| v.trim().to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// The kernel's view, from /proc/self/task/<tid>/status, of the thread that calls it.
    fn status_line(key: &str) -> String {
        let tid = nix::unistd::gettid();
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn drop_all_clears_this_thread_only() {
        let before = status_line("CapEff:");
        let parent_prm = status_line("CapPrm:");
        assert_ne!(
            before, "0000000000000000",
            "run the agent tests as root (CI does): this test needs capabilities to drop"
        );
        let child = std::thread::spawn(|| {
            drop_all().unwrap();
            // A thread the dropped thread starts inherits nothing.
            let grandchild =
                std::thread::spawn(|| (status_line("CapEff:"), status_line("CapPrm:")))
                    .join()
                    .unwrap();
            (
                status_line("CapEff:"),
                status_line("CapPrm:"),
                status_line("CapInh:"),
                thread_cap_eff(),
                grandchild,
                missing(&[Capability::CAP_SYS_ADMIN]),
            )
        })
        .join()
        .unwrap();
        let zero = "0000000000000000".to_string();
        assert_eq!(child.0, zero);
        assert_eq!(child.1, zero);
        assert_eq!(child.2, zero);
        assert_eq!(child.3, Some(zero.clone()));
        assert_eq!(child.4, (zero.clone(), zero));
        assert_eq!(child.5, vec![Capability::CAP_SYS_ADMIN]);
        // The calling thread keeps what it had.
        assert_eq!(status_line("CapEff:"), before);
        assert_eq!(status_line("CapPrm:"), parent_prm);
    }

    #[test]
    fn lacking_clause_names_the_capability_and_why() {
        let clause = std::thread::spawn(|| {
            drop_all().unwrap();
            lacking_clause(&[Capability::CAP_SYS_ADMIN])
        })
        .join()
        .unwrap()
        .unwrap();
        assert!(clause.contains("CAP_SYS_ADMIN"), "{clause}");
        assert!(clause.contains("setns(2)"), "{clause}");
        assert!(!clause.contains("CAP_SYS_PTRACE"), "{clause}");
    }
}
