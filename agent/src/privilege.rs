//! Linux capabilities of the agent's threads (docs/checks.md "Capabilities", docs/security.md
//! "The agent mounts only what its checks read").
//!
//! The agent is not privileged: the DaemonSet grants `CAP_SYS_PTRACE` (another process's
//! `/proc/<pid>/{root,fd,exe,ns,mountinfo}`), `CAP_SYS_ADMIN` (`setns(2)` into a pod's network
//! namespace) and `CAP_DAC_READ_SEARCH` (reader-volume samples of another uid) and drops every
//! other capability. `ic-agent run` keeps them only in its checks processes
//! ([`crate::checks_worker`]: the supervisor and the worker it starts, children of the agent,
//! started before anything is dropped) and the threads the worker starts, which inherit them.
//! Every thread of the agent's own process — the main thread, and the tokio runtime that decodes
//! engine KV-event frames (ZMQ/msgpack), parses engine `/metrics`, talks to the controller and
//! serves HTTP — clears its effective, permitted, inheritable and ambient sets before it runs
//! anything ([`drop_all`]). A cleared permitted set is not raised again: the Landlock
//! confinement below sets `no_new_privs`, under which even an `execve` as uid 0 gains nothing.
//! The MP-worker probe thread drops them too, right after `setns`, before it reads a byte from
//! the worker. (`--checks-in-process` runs the checks on a thread of the agent's process that
//! keeps them, [`crate::runtime::CheckRunner::spawn`]: debugging only.)
//!
//! The threads without capabilities are also confined with Landlock to the agent's own mount
//! tree ([`confine_to_own_mount_tree`], [`drop_all_and_confine_or_warn`]): as uid 0 without
//! capabilities they could still open `/proc/<pid>/root/…` of a pod that runs as root with every
//! capability dropped (the kernel's ptrace read check passes for the same uid when the target's
//! permitted set, empty, is a subset of the caller's), and with it that pod's projected
//! service-account token and Secrets. A Landlock domain refuses the ptrace check on every
//! process outside it and every file outside its rules: the rule allows everything beneath the
//! agent's own `/`, so the agent's own files, `/host/proc` text, sockets and devices work as
//! before. The checks processes are not confined: their `/proc/<pid>` reads of engine and reader
//! pods are the ptrace check.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::LazyLock;

use caps::CapSet;
pub use caps::Capability;
use landlock::{
    Access, AccessFs, LandlockStatus, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, ABI,
};
use prometheus::IntGauge;

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

/// Lowers the calling thread's effective and permitted sets to `keep` (what it holds of them)
/// and clears its inheritable and ambient sets: the thread then holds what the DaemonSet's
/// `capabilities: {drop: [ALL], add: [...]}` gives the agent. Tests run checks under the
/// chart's securityContext with it.
///
/// # Errors
/// `capget(2)`/`capset(2)` failed.
pub fn keep_only(keep: &[Capability]) -> Result<(), Error> {
    let permitted = caps::read(None, CapSet::Permitted)?;
    let kept: HashSet<Capability> = keep
        .iter()
        .filter(|c| permitted.contains(c))
        .copied()
        .collect();
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::set(None, CapSet::Effective, &kept)?;
    caps::set(None, CapSet::Permitted, &kept)?;
    Ok(())
}

/// [`drop_all`] for a thread that must not run with capabilities at all (a tokio runtime's
/// `on_thread_start`): a failure is logged, as nothing else can be done from there.
pub fn drop_all_or_warn() {
    if let Err(e) = drop_all() {
        tracing::warn!(error = %e, "cannot drop this thread's capabilities");
    }
}

/// The Landlock ABI whose file-system access rights [`confine_to_own_mount_tree`] handles
/// (V5: every right up to `IOCTL_DEV`). All of them are allowed beneath `/`; a kernel with an
/// older ABI enforces the rights it knows ([`Confinement::Partial`]).
pub const LANDLOCK_ABI: ABI = ABI::V5;

/// What Landlock made of a thread's confinement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confinement {
    /// Every access right of [`LANDLOCK_ABI`] is enforced.
    Enforced,
    /// The kernel enforces an older Landlock ABI: opening files outside the rule and the ptrace
    /// check on other processes are refused; some newer rights (truncate, device ioctls) are
    /// not handled.
    Partial,
    /// Not confined, with the reason (a kernel without Landlock, or with Landlock left out of
    /// its `lsm=` list).
    Off(String),
}

impl Confinement {
    /// True when Landlock restricts the thread (fully or partially).
    pub fn is_confined(&self) -> bool {
        !matches!(self, Confinement::Off(_))
    }
}

/// Why a thread could not be confined.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// `/` could not be opened for the rule.
    #[error("cannot open / for the Landlock rule: {0}")]
    Root(#[from] landlock::PathFdError),
    /// A Landlock call failed (other than for missing kernel support, which is
    /// [`Confinement::Off`]).
    #[error("Landlock: {0}")]
    Ruleset(#[from] landlock::RulesetError),
}

impl ConfineError {
    /// True when `landlock_restrict_self(2)` refused another layer (`E2BIG`: 16 nested
    /// domains): the thread is then confined by the domains it inherited.
    pub fn is_layer_limit(&self) -> bool {
        matches!(
            self,
            ConfineError::Ruleset(landlock::RulesetError::RestrictSelf(
                landlock::RestrictSelfError::RestrictSelfCall { source, .. }
            )) if source.raw_os_error() == Some(libc::E2BIG)
        )
    }
}

/// Confines the calling thread, and the threads it starts afterwards, with Landlock to files
/// beneath its own root `/` (every access right of [`LANDLOCK_ABI`] there). Files reached
/// through `/proc/<pid>/root` of a process in another mount namespace (a pod) are beneath no
/// rule, and a confined thread fails the ptrace access check on every process outside its
/// domain: both are refused with `EACCES`. The calling thread's own `/proc/self`, sockets,
/// pipes and `/host/proc` text are unaffected. Sets the thread's `no_new_privs` (`ic-agent run`
/// executes its checks processes before any thread is confined). Cannot be undone.
///
/// # Errors
/// `/` could not be opened, or a Landlock call failed; a kernel without Landlock is
/// `Ok(`[`Confinement::Off`]`)`.
pub fn confine_to_own_mount_tree() -> Result<Confinement, ConfineError> {
    let access = AccessFs::from_all(LANDLOCK_ABI);
    let status = Ruleset::default()
        .handle_access(access)?
        .create()?
        .add_rule(PathBeneath::new(PathFd::new("/")?, access))?
        .restrict_self()?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Confinement::Enforced,
        RulesetStatus::PartiallyEnforced => Confinement::Partial,
        RulesetStatus::NotEnforced => Confinement::Off(match status.landlock {
            LandlockStatus::NotEnabled => {
                "Landlock is built into the kernel but not enabled (the lsm= boot parameter)"
                    .to_string()
            }
            LandlockStatus::NotImplemented => {
                "the kernel has no Landlock (Linux 5.13 or later with CONFIG_SECURITY_LANDLOCK)"
                    .to_string()
            }
            _ => "the kernel did not enforce the ruleset".to_string(),
        }),
    })
}

/// `inferencecache_agent_threads_confined`: 1 once a thread without capabilities has been
/// confined by Landlock, 0 when one could not be (the log says why). One process-wide handle;
/// [`register_metrics`] adds it to a registry.
static THREADS_CONFINED: LazyLock<Option<IntGauge>> = LazyLock::new(|| {
    IntGauge::new(
        "inferencecache_agent_threads_confined",
        "1 when the agent's threads without capabilities run under Landlock (no file of another \
         pod's mount tree can be opened from them), 0 when the kernel has no Landlock.",
    )
    .ok()
});

/// What the threads' confinement came to: 0 not tried yet, 1 confined, 2 not confined.
static CONFINED_STATE: AtomicU8 = AtomicU8::new(0);

/// Registers `inferencecache_agent_threads_confined` in `registry` (a registry that holds it
/// already is left as it is).
pub fn register_metrics(registry: &prometheus::Registry) {
    if let Some(g) = THREADS_CONFINED.as_ref() {
        match registry.register(Box::new(g.clone())) {
            Ok(()) | Err(prometheus::Error::AlreadyReg) => {}
            Err(e) => tracing::warn!(error = %e, "cannot register the confinement gauge"),
        }
    }
}

/// [`drop_all`], then [`confine_to_own_mount_tree`], for a thread that must not run with
/// capabilities nor reach other pods' files (a tokio runtime's `on_thread_start`, the main
/// thread once the agent is up). Failures are logged (the first one at WARN, saying the
/// agent runs unconfined) and set `inferencecache_agent_threads_confined` to 0; the agent
/// keeps running.
pub fn drop_all_and_confine_or_warn() {
    drop_all_or_warn();
    let outcome = confine_to_own_mount_tree();
    // A thread started by a confined one inherits its domain; the layer limit is no failure.
    let confined = match &outcome {
        Ok(c) => c.is_confined(),
        Err(e) => e.is_layer_limit(),
    };
    let before = CONFINED_STATE.swap(if confined { 1 } else { 2 }, Ordering::Relaxed);
    if let Some(g) = THREADS_CONFINED.as_ref() {
        g.set(i64::from(confined));
    }
    if confined {
        if before == 0 {
            tracing::info!(
                "threads without capabilities confined with Landlock to the agent's own mount \
                 tree"
            );
        }
        return;
    }
    let why = match outcome {
        Ok(Confinement::Off(why)) => why,
        Ok(c) => format!("{c:?}"),
        Err(e) => e.to_string(),
    };
    if before != 2 {
        tracing::warn!(
            reason = %why,
            "running without the Landlock confinement: threads without capabilities can open \
             files of pods that run as root with no capability (inferencecache_agent_threads_confined 0)"
        );
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
