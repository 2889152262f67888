//! Node checks: one small [`Check`] trait, one module per check, a registry ([`Checks`]).
//!
//! Every check inspects one kernel or driver surface of the node, compares it with the
//! [`NodePlan`] the controller pushed (or a plan file in standalone mode) and returns typed
//! [`CheckResult`]s. Checks never panic and never fail: a surface they cannot read becomes a
//! result with status [`CheckStatus::Unknown`] and a reason saying why. Reasons, statuses and
//! observed keys of every check are documented in `docs/checks.md`.
//!
//! Checks are synchronous and may block on the file system or on NVML; `ic-agent run` runs
//! [`Checks::run_all`] in its checks worker process (`crate::checks_worker`, with the
//! supervisor the only processes of the agent that keep its capabilities).
//!
//! | check | module | subjects |
//! |---|---|---|
//! | `shm` | [`shm`] | `host`, `<namespace>/<pod>` per engine pod |
//! | `mp_worker` | [`mp_worker`] | `<namespace>/<pod>` per engine with an MP-worker port |
//! | `gpu` | [`gpu`] (thread: [`gpu_monitor`], policy: [`xid`]) | `host` (NVML unavailable, no devices), `gpu<N>` |
//! | `cuda` | [`cuda`] | `host` (driver unusable), `cuda<N>` |
//! | `ports` | [`ports`] | `host`, `tcp/<port>` |
//! | `mounts` | [`mounts`] | `<namespace>/<pod>:<path>` per reader mount |
//!
//! Pods are found by UID through [`pods::PodFinder`], shared by the checks of one registry.
//! [`metrics::CheckMetrics`] turns a pass into bounded-label gauges.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use thiserror::Error;

pub mod beneath;
pub mod cuda;
pub mod fake;
pub mod gpu;
pub mod gpu_monitor;
pub mod gpu_state;
pub mod metrics;
pub mod mounts;
pub mod mp_worker;
pub mod pods;
pub mod ports;
pub mod shm;
mod table;
pub mod units;
pub mod xid;

pub use table::{render_table, report_json};
use xid::{XidPolicy, XidPolicyError};

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
    /// Longest wait of the `mp_worker` probe for each of TCP connect, ZMTP greeting and the
    /// no-op's reply (default 2 s).
    pub mp_worker_timeout: Duration,
    /// Which XIDs make a GPU unhealthy, and for how long (default: NVIDIA's published sets,
    /// 10 minutes' quiet period).
    pub xid_policy: XidPolicy,
    /// CUDA driver library to load by path; `None` lets cudarc search `libcuda.so`,
    /// `libcuda.so.1`, … on the loader path.
    pub cuda_library: Option<PathBuf>,
    /// Time between two CUDA probes (each creates a context on every GPU; default 10 minutes).
    pub cuda_interval: Duration,
    /// Longest wait for a CUDA probe that has no earlier result to fall back on (default 60 s).
    pub cuda_timeout: Duration,
    /// First re-probe delay after a CUDA probe that found a problem (default 15 s); it doubles
    /// with each further failed probe, up to `cuda_interval` (`cuda::reprobe_after`).
    pub cuda_failure_retry: Duration,
    /// The host's network namespace, as the `/proc/<pid>/net` directory of a process in it,
    /// that the `ports` check verifies its socket tables belong to (`<proc_root>/net/tcp` is the
    /// reader's own namespace). `None` (the default) means `<proc_root>/1/net`: PID 1 of a
    /// hostPID agent is the host's init. `IC_HOST_NETNS` sets it; tests that run the check in a
    /// namespace of their own point it at that namespace.
    pub host_netns: Option<PathBuf>,
    /// The agent's state directory (`--state-dir`): the `gpu` check keeps its expected-GPU
    /// inventory and latched fatal XIDs there ([`gpu_state`]). `None`: in memory only.
    pub state_dir: Option<PathBuf>,
}

impl Default for ChecksConfig {
    fn default() -> Self {
        ChecksConfig {
            proc_root: PathBuf::from("/proc"),
            shm_path: PathBuf::from("/dev/shm"),
            nvml_library: None,
            shm_nearly_full_percent: 90,
            mp_worker_timeout: Duration::from_secs(2),
            xid_policy: XidPolicy::default(),
            cuda_library: None,
            cuda_interval: Duration::from_secs(600),
            cuda_timeout: Duration::from_secs(60),
            cuda_failure_retry: Duration::from_secs(15),
            host_netns: None,
            state_dir: None,
        }
    }
}

/// A malformed check setting in the environment.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChecksConfigError {
    /// A numeric variable that is not a number in range.
    #[error("{var}={value:?} is not a valid number")]
    BadNumber {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// An XID setting that does not parse.
    #[error("{var}: {source}")]
    Xid {
        /// Variable name.
        var: &'static str,
        /// Why.
        source: XidPolicyError,
    },
}

/// Environment variables [`ChecksConfig::from_env`] reads (name, meaning).
pub const ENV_VARS: [(&str, &str); 14] = [
    ("IC_PROC_ROOT", "procfs root (default /proc)"),
    (
        "IC_HOST_NETNS",
        "/proc/<pid>/net of a process in the host's network namespace, which the ports check compares its own with (default <proc root>/1/net)",
    ),
    ("IC_SHM_PATH", "host /dev/shm path (default /dev/shm)"),
    (
        "IC_NVML_LIBRARY",
        "libnvidia-ml path (default libnvidia-ml.so.1 on the loader path)",
    ),
    (
        "IC_SHM_NEARLY_FULL_PERCENT",
        "ShmNearlyFull threshold in percent (default 90)",
    ),
    (
        "IC_MP_WORKER_TIMEOUT_MS",
        "MP-worker probe timeout per step, milliseconds (default 2000)",
    ),
    (
        "IC_XID_ENABLE",
        "XIDs always Critical, comma-separated (beats IC_XID_DISABLE)",
    ),
    (
        "IC_XID_DISABLE",
        "XIDs ignored, comma-separated, or \"all\"",
    ),
    (
        "IC_XID_UNLISTED",
        "action for XIDs in no list: ignore, warning (default) or critical",
    ),
    (
        "IC_XID_QUIET_SECONDS",
        "seconds without XIDs after which a GPU recovers (default 600)",
    ),
    (
        "IC_CUDA_LIBRARY",
        "libcuda path (default: cudarc's search of the loader path)",
    ),
    (
        "IC_CUDA_INTERVAL_SECONDS",
        "seconds between CUDA probes (default 600)",
    ),
    (
        "IC_CUDA_TIMEOUT_SECONDS",
        "longest wait for a first CUDA probe, seconds (default 60)",
    ),
    (
        "IC_CUDA_RETRY_SECONDS",
        "first re-probe delay after a failed CUDA probe, doubling up to the interval (default 15)",
    ),
];

impl ChecksConfig {
    /// The default configuration with every variable of [`ENV_VARS`] that is set (and not
    /// empty) applied. Errors name the variable.
    pub fn from_env() -> Result<Self, ChecksConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`ChecksConfig::from_env`] with any variable source (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ChecksConfigError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let num = |var: &'static str| -> Result<Option<u64>, ChecksConfigError> {
            get(var)
                .map(|v| {
                    v.trim()
                        .parse::<u64>()
                        .map_err(|_| ChecksConfigError::BadNumber { var, value: v })
                })
                .transpose()
        };
        let mut c = ChecksConfig::default();
        if let Some(v) = get("IC_PROC_ROOT") {
            c.proc_root = PathBuf::from(v);
        }
        if let Some(v) = get("IC_HOST_NETNS") {
            c.host_netns = Some(PathBuf::from(v));
        }
        if let Some(v) = get("IC_SHM_PATH") {
            c.shm_path = PathBuf::from(v);
        }
        if let Some(v) = get("IC_NVML_LIBRARY") {
            c.nvml_library = Some(PathBuf::from(v));
        }
        if let Some(v) = num("IC_SHM_NEARLY_FULL_PERCENT")? {
            c.shm_nearly_full_percent =
                u8::try_from(v)
                    .ok()
                    .filter(|p| *p <= 100)
                    .ok_or(ChecksConfigError::BadNumber {
                        var: "IC_SHM_NEARLY_FULL_PERCENT",
                        value: v.to_string(),
                    })?;
        }
        if let Some(v) = num("IC_MP_WORKER_TIMEOUT_MS")? {
            c.mp_worker_timeout = Duration::from_millis(v.max(1));
        }
        let quiet = num("IC_XID_QUIET_SECONDS")?.map(Duration::from_secs);
        let enable = get("IC_XID_ENABLE");
        let disable = get("IC_XID_DISABLE");
        let unlisted = get("IC_XID_UNLISTED");
        let xid_err = |var| move |source| ChecksConfigError::Xid { var, source };
        // each setting alone first, so that an error names its variable
        XidPolicy::configured(enable.as_deref(), None, None, None)
            .map_err(xid_err("IC_XID_ENABLE"))?;
        XidPolicy::configured(None, disable.as_deref(), None, None)
            .map_err(xid_err("IC_XID_DISABLE"))?;
        c.xid_policy = XidPolicy::configured(
            enable.as_deref(),
            disable.as_deref(),
            unlisted.as_deref(),
            quiet,
        )
        .map_err(xid_err("IC_XID_UNLISTED"))?;
        if let Some(v) = get("IC_CUDA_LIBRARY") {
            c.cuda_library = Some(PathBuf::from(v));
        }
        if let Some(v) = num("IC_CUDA_INTERVAL_SECONDS")? {
            c.cuda_interval = Duration::from_secs(v);
        }
        if let Some(v) = num("IC_CUDA_TIMEOUT_SECONDS")? {
            c.cuda_timeout = Duration::from_secs(v.max(1));
        }
        if let Some(v) = num("IC_CUDA_RETRY_SECONDS")? {
            c.cuda_failure_retry = Duration::from_secs(v.max(1));
        }
        Ok(c)
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
    /// Every check of the agent, configured from `cfg`, in report order: `shm`, `mp_worker`,
    /// `gpu`, `cuda`, `ports`, `mounts`. The pod-aware checks share one [`pods::PodFinder`].
    pub fn new(cfg: &ChecksConfig) -> Self {
        let pods = Arc::new(pods::PodFinder::new(&cfg.proc_root));
        Checks::with(vec![
            Box::new(shm::ShmCheck::with_finder(cfg, pods.clone())),
            Box::new(mp_worker::MpWorkerCheck::with_finder(cfg, pods.clone())),
            Box::new(gpu::GpuCheck::new(cfg)),
            Box::new(cuda::CudaCheck::new(cfg)),
            Box::new(ports::PortsCheck::new(cfg)),
            Box::new(mounts::MountsCheck::with_finder(cfg, pods)),
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
