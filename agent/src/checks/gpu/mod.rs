//! `gpu`: NVIDIA GPUs through NVML (`nvml-wrapper`).
//!
//! NVML is loaded once, on a dedicated long-lived thread ([`super::gpu_monitor`]), from
//! [`ChecksConfig::nvml_library`] or `libnvidia-ml.so.1` on the loader path; that thread keeps it
//! open and waits on an event set for XID events. When NVML cannot be loaded or initialised the
//! check returns one `host` result, `NvmlUnavailable`, `Unknown` — or `Warning` when the plan
//! says the node should have GPUs — and never panics (the thread retries every minute). On a
//! node whose plan says `gpuNode: false`, a missing library or kernel driver is what a CPU node
//! looks like: `GpuNotExpected`, `Ok` ([`unavailable`]).
//! Otherwise one result per device (`gpu<N>`) judged by [`evaluate_device`] from a
//! [`GpuSnapshot`]: XID events under the [`XidPolicy`] (fatal XIDs, other XIDs, a quiet period
//! after which the GPU recovers; MIG instance of each event), ECC double-bit (uncorrectable)
//! volatile errors, row-remap failures, pending row remaps or page retirements, and clock
//! throttling for heat or hardware slowdown.
//!
//! # Files
//!
//! - this file: the check itself ([`GpuCheck`]): NVML through the monitor thread, one result per
//!   device, the inventory and plan results beside them;
//! - [`unavailable`]: NVML that cannot be loaded or initialised — the cause, and what it means
//!   on a node planned with or without GPUs;
//! - [`nvml_read`]: one device read through NVML into a [`health::GpuSnapshot`];
//! - [`health`]: a device's verdict from its snapshot ([`health::evaluate_device`]), pure;
//! - [`inventory`]: GPUs against the expected inventory and the plan (`GpuMissing`,
//!   `GpusNotPlanned`).

pub mod health;
pub mod inventory;
pub mod nvml_read;
pub mod unavailable;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use parking_lot::Mutex;

use super::gpu_monitor::{EventSupport, InitFailure, InitState, NvmlMonitor};
use super::gpu_state::GpuMemory;
use super::xid::{XidAction, XidLog, XidPolicy};
use super::{Check, ChecksConfig};

use health::{evaluate_device, format_cuda_version, GpuSnapshot, XidStatus};
use inventory::{gpu_missing, gpus_not_planned};
use nvml_read::snapshot;
use unavailable::{classify_init_error, unavailable};

/// Check name.
pub const NAME: &str = "gpu";

/// The library name loaded when no path is configured.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// How long a run waits for the NVML thread's first initialisation attempt.
pub const INIT_WAIT: Duration = Duration::from_secs(10);

/// The `gpu` check. Owns the NVML thread (started on the first run, stopped on drop) and the
/// node's GPU memory ([`GpuMemory`]: expected-GPU inventory and latched fatal XIDs, kept in the
/// state directory when there is one).
pub struct GpuCheck {
    nvml_library: Option<PathBuf>,
    policy: XidPolicy,
    monitor: Mutex<Option<NvmlMonitor>>,
    memory: Mutex<GpuMemory>,
}

impl std::fmt::Debug for GpuCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCheck")
            .field("nvml_library", &self.nvml_library)
            .field("policy", &self.policy)
            .field("started", &self.monitor.lock().is_some())
            .finish()
    }
}

impl GpuCheck {
    /// Reads `cfg.nvml_library`, `cfg.xid_policy` and `cfg.state_dir` (loads
    /// [`GPU_STATE_FILE`] from it; the boot id from `<cfg.proc_root>/sys/kernel/random/boot_id`).
    pub fn new(cfg: &ChecksConfig) -> Self {
        GpuCheck {
            nvml_library: cfg.nvml_library.clone(),
            policy: cfg.xid_policy.clone(),
            monitor: Mutex::new(None),
            memory: Mutex::new(GpuMemory::load(
                cfg.state_dir.as_deref(),
                &cfg.proc_root.join("sys/kernel/random/boot_id"),
            )),
        }
    }

    fn library_label(&self) -> String {
        self.nvml_library
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| DEFAULT_NVML_LIBRARY.to_string())
    }

    /// The NVML state, starting the thread on first use; with the XID logs and event support.
    fn observe(&self) -> Result<(InitState, HashMapXids), String> {
        let mut guard = self.monitor.lock();
        if guard.is_none() {
            let m = NvmlMonitor::start(
                self.nvml_library.clone(),
                DEFAULT_NVML_LIBRARY,
                classify_init_error,
            )
            .map_err(|e| format!("cannot start the NVML thread: {e}"))?;
            *guard = Some(m);
        }
        let Some(m) = guard.as_ref() else {
            return Err("the NVML thread is not running".into());
        };
        let init = m.init_state(INIT_WAIT);
        let xids = m.with_state(|st| {
            let mut out: HashMapXids = std::collections::HashMap::new();
            for (i, support) in &st.events {
                out.insert(
                    *i,
                    (
                        st.xids.get(i).cloned().unwrap_or_default(),
                        support.clone(),
                        st.uuids.get(i).cloned(),
                    ),
                );
            }
            out
        });
        Ok((init, xids))
    }

    /// A one-off NVML handle on the calling thread (no events): what `run` did before the NVML
    /// thread existed; kept for callers that need a snapshot without the thread.
    pub fn init_once(&self) -> Result<Nvml, NvmlError> {
        match &self.nvml_library {
            Some(path) => Nvml::builder().lib_path(OsStr::new(path)).init(),
            None => Nvml::builder()
                .lib_path(OsStr::new(DEFAULT_NVML_LIBRARY))
                .init(),
        }
    }
}

/// Per NVML index at registration: the GPU's XID log, its event support and its UUID then.
type HashMapXids = std::collections::HashMap<u32, (XidLog, EventSupport, Option<String>)>;

impl Check for GpuCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&self, plan: &NodePlan) -> Vec<CheckResult> {
        let library = self.library_label();
        let degraded = if plan.gpu_node {
            CheckStatus::Warning
        } else {
            CheckStatus::Unknown
        };
        let (init, xids) = match self.observe() {
            Ok(v) => v,
            Err(e) => {
                return vec![CheckResult::new(
                    NAME,
                    "host",
                    degraded,
                    "NvmlUnavailable",
                    format!("{e}; GPU health is unknown."),
                )
                .with("cause", "InitFailed")
                .with("library", library)]
            }
        };
        let nvml = match init {
            InitState::Ready(n) => n,
            InitState::Failed(f) => return vec![unavailable(plan.gpu_node, &library, &f)],
            InitState::Pending => {
                return vec![unavailable(
                    plan.gpu_node,
                    &library,
                    &InitFailure {
                        cause: "InitFailed",
                        why: format!(
                            "NVML ({library}) did not finish initialising within {} s; the \
                             driver may be wedged",
                            INIT_WAIT.as_secs()
                        ),
                        error: "initialisation timed out".into(),
                    },
                )]
            }
        };
        let driver = nvml.sys_driver_version().ok();
        let cuda = nvml.sys_cuda_driver_version().ok().map(format_cuda_version);
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                return vec![CheckResult::new(
                    NAME,
                    "host",
                    degraded,
                    "NvmlQueryFailed",
                    format!("NVML ({library}) loaded but cannot count GPUs: {e}."),
                )
                .with("library", library)
                .with("error", e.to_string())];
            }
        };
        if count == 0 {
            // Every GPU of the inventory gone is not "no GPUs": each one is missing.
            let mut memory = self.memory.lock();
            let missing = memory.enumerate(&[], false);
            if !missing.is_empty() {
                let persisted = memory.path.is_some();
                let expected = missing.len();
                return missing
                    .iter()
                    .map(|(uuid, known)| gpu_missing(uuid, known, 0, expected, persisted))
                    .collect();
            }
            drop(memory);
            let (status, tail) = if plan.gpu_node {
                (
                    CheckStatus::Warning,
                    "but the plan expects GPUs on this node",
                )
            } else {
                (CheckStatus::Ok, "and the plan expects none")
            };
            let mut r = CheckResult::new(
                NAME,
                "host",
                status,
                "NoGpus",
                format!("NVML reports no GPUs on this node, {tail}."),
            )
            .with("deviceCount", 0)
            .with("library", library);
            if let Some(d) = driver {
                r = r.with("driverVersion", d);
            }
            return vec![r];
        }
        let now = SystemTime::now();
        let xid_status = |i: u32| {
            xids.get(&i)
                .map(|(log, support, _)| XidStatus::judge(log, support, &self.policy, now))
        };
        // The NVML thread's log of a GPU: by UUID (indexes shift when a GPU drops out of
        // enumeration), by index when the thread did not learn the UUID.
        let log_of = |i: u32, uuid: &str| {
            xids.values()
                .find(|(_, _, u)| u.as_deref() == Some(uuid))
                .or_else(|| xids.get(&i).filter(|(_, _, u)| u.is_none()))
        };
        let snaps: Vec<(u32, Result<GpuSnapshot, NvmlError>)> = (0..count)
            .map(|i| (i, snapshot(&nvml, i, driver.clone(), cuda.clone())))
            .collect();
        let seen: Vec<(u32, String, Option<String>)> = snaps
            .iter()
            .filter_map(|(i, s)| {
                let s = s.as_ref().ok()?;
                Some((*i, s.uuid.clone()?, s.name.clone()))
            })
            .collect();
        let healthy = seen.len() == snaps.len();
        let mut memory = self.memory.lock();
        let missing = memory.enumerate(&seen, healthy);
        let persisted = memory.path.is_some();
        let mut results: Vec<CheckResult> = snaps
            .into_iter()
            .map(|(i, snap)| match snap {
                Ok(mut s) => {
                    if let Some(uuid) = s.uuid.clone() {
                        memory.recovery_action(&uuid, s.recovery_action, now);
                        s.xid = log_of(i, &uuid).map(|(log, support, _)| {
                            let events = memory.latch(&uuid, &log.events, |e| {
                                let action = match e.xid {
                                    Some(x) => self.policy.action(x),
                                    None => self.policy.unlisted,
                                };
                                action == XidAction::Critical
                            });
                            let merged = XidLog {
                                events,
                                total: log.total,
                                dropped: log.dropped.clone(),
                            };
                            XidStatus::judge(&merged, support, &self.policy, now)
                        });
                    } else {
                        s.xid = xid_status(i);
                    }
                    evaluate_device(&s)
                }
                Err(NvmlError::GpuLost) => evaluate_device(&GpuSnapshot {
                    index: i,
                    lost: true,
                    driver_version: driver.clone(),
                    cuda_driver_version: cuda.clone(),
                    xid: xid_status(i),
                    ..GpuSnapshot::default()
                }),
                Err(e) => CheckResult::new(
                    NAME,
                    format!("gpu{i}"),
                    CheckStatus::Unknown,
                    "GpuQueryFailed",
                    format!("NVML cannot open gpu{i}: {e}; its health is unknown."),
                )
                .with("index", i)
                .with("error", e.to_string()),
            })
            .collect();
        let expected = count as usize + missing.len();
        for (uuid, known) in &missing {
            results.push(gpu_missing(uuid, known, count, expected, persisted));
        }
        memory.save();
        drop(memory);
        if !plan.gpu_node {
            results.push(gpus_not_planned(&results, &library, driver.as_deref()));
        }
        results
    }
}
