//! Node checks: one small [`Check`] trait, one module per check, a registry ([`Checks`]).
//!
//! Every check inspects one kernel or driver surface of the node, compares it with the
//! [`NodePlan`] the controller pushed (or a plan file in standalone mode) and returns typed
//! [`CheckResult`]s. Checks never panic and never fail: a surface they cannot read becomes a
//! result with status [`CheckStatus::Unknown`] and a reason saying why. Reasons, statuses and
//! observed keys of every check are documented in `docs/checks.md`.
//!
//! Checks are synchronous and may block on the file system or on NVML; the async caller runs
//! [`Checks::run_all`] on a blocking thread (`tokio::task::spawn_blocking`).
//!
//! | check | module | subjects |
//! |---|---|---|
//! | `shm` | [`shm`] | `host` |
//! | `ports` | [`ports`] | `host`, `tcp/<port>` |
//! | `gpu` | [`gpu`] | `host` (NVML unavailable, no devices), `gpu<N>` |

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;

pub mod fake;
pub mod gpu;
pub mod ports;
pub mod shm;
mod table;
pub mod units;

pub use table::{render_table, report_json};

/// One node check. Implementations are cheap to construct and hold only configuration.
///
/// `run` inspects the node now and returns at least one result, each with `name` equal to
/// [`Check::name`]. It must not panic: every error becomes a result (usually
/// [`CheckStatus::Unknown`]). It may block (file system, NVML), so call it off the async runtime.
pub trait Check: Send + Sync {
    /// Stable check name (`shm`, `ports`, `gpu`); the `name` of every result it returns.
    fn name(&self) -> &'static str;
    /// Runs the check against the plan and returns its results.
    fn run(&self, plan: &NodePlan) -> Vec<CheckResult>;
}

/// Where the checks look. `Default` is the real host as seen by the agent process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChecksConfig {
    /// procfs root (default `/proc`). Read: `self/mountinfo`, `net/tcp`, `net/tcp6`,
    /// `<pid>/fd`, `<pid>/exe`, `<pid>/cgroup`. Tests point it at a fixture tree.
    pub proc_root: PathBuf,
    /// The shared-memory file system to measure (default `/dev/shm`; `/host/dev/shm` when the
    /// host's is mounted into the agent's container).
    pub shm_path: PathBuf,
    /// NVML library to load; `None` loads `libnvidia-ml.so.1` from the dynamic loader's path.
    pub nvml_library: Option<PathBuf>,
    /// `/dev/shm` use, in percent of its size, above which `shm` reports `ShmNearlyFull`
    /// (default 90).
    pub shm_nearly_full_percent: u8,
}

impl Default for ChecksConfig {
    fn default() -> Self {
        ChecksConfig {
            proc_root: PathBuf::from("/proc"),
            shm_path: PathBuf::from("/dev/shm"),
            nvml_library: None,
            shm_nearly_full_percent: 90,
        }
    }
}

/// The registry: an ordered set of checks run together.
pub struct Checks {
    checks: Vec<Box<dyn Check>>,
}

impl std::fmt::Debug for Checks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checks")
            .field("checks", &self.names())
            .finish()
    }
}

impl Checks {
    /// Every check of the agent, configured from `cfg`, in report order: `shm`, `ports`, `gpu`.
    pub fn new(cfg: &ChecksConfig) -> Self {
        Checks::with(vec![
            Box::new(shm::ShmCheck::new(cfg)),
            Box::new(ports::PortsCheck::new(cfg)),
            Box::new(gpu::GpuCheck::new(cfg)),
        ])
    }

    /// A registry of exactly these checks (tests, or a subset selected by flags).
    pub fn with(checks: Vec<Box<dyn Check>>) -> Self {
        Checks { checks }
    }

    /// Names of the registered checks, in run order.
    pub fn names(&self) -> Vec<&'static str> {
        self.checks.iter().map(|c| c.name()).collect()
    }

    /// Runs every check in order and concatenates their results.
    ///
    /// Failures are isolated: a check that panics anyway (a bug) yields one result
    /// `{name, subject "host", Unknown, CheckPanicked}` and the others still run; a check that
    /// returns nothing yields `{name, "host", Unknown, NoResult}`. Results whose `name` is empty
    /// get the check's name.
    pub fn run_all(&self, plan: &NodePlan) -> Vec<CheckResult> {
        let mut out = Vec::new();
        for check in &self.checks {
            let name = check.name();
            match catch_unwind(AssertUnwindSafe(|| check.run(plan))) {
                Ok(results) if results.is_empty() => out.push(CheckResult::new(
                    name,
                    "host",
                    CheckStatus::Unknown,
                    "NoResult",
                    format!("check {name} returned no result; this is a bug in the agent"),
                )),
                Ok(results) => out.extend(results.into_iter().map(|mut r| {
                    if r.name.is_empty() {
                        r.name = name.to_string();
                    }
                    r
                })),
                Err(payload) => {
                    let why = payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic payload".to_string());
                    out.push(
                        CheckResult::new(
                            name,
                            "host",
                            CheckStatus::Unknown,
                            "CheckPanicked",
                            format!(
                                "check {name} panicked and could not finish; this is a bug in \
                                 the agent: {why}"
                            ),
                        )
                        .with("panic", why),
                    );
                }
            }
        }
        out
    }
}
