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

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};
use parking_lot::Mutex;

use super::gpu_monitor::{EventSupport, InitFailure, InitState, NvmlMonitor};
use super::gpu_state::{GpuMemory, KnownGpu};
use super::units::bytes_both;
use super::xid::{evaluate_xids, xid_description, XidAction, XidLog, XidPolicy, XidVerdict};
use super::{Check, ChecksConfig};

/// Check name.
pub const NAME: &str = "gpu";

/// The library name loaded when no path is configured.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// Reason (`Ok`, subject `host`) on a node whose plan says `gpuNode: false` when NVML is absent
/// (`cause` `LibraryNotFound`) or its kernel driver is not loaded (`DriverNotLoaded`): what a
/// CPU node looks like, so the node's verdict is not `Unknown` for it (`docs/checks.md`).
pub const GPU_NOT_EXPECTED: &str = "GpuNotExpected";

/// Reason (`Ok`, subject `host`, next to the per-GPU results) when NVML shows GPUs on a node
/// whose plan says `gpuNode: false` (no engine there requests a GPU: an idle GPU node, or a
/// plan that forgot `gpuNode`). The GPUs' own health is still judged per GPU.
pub const GPUS_NOT_PLANNED: &str = "GpusNotPlanned";

/// Initialisation causes that on a node planned without GPUs mean "no NVIDIA stack here", not
/// "cannot tell": the library is absent, or present without its kernel driver.
pub const EXPECTED_ON_CPU_NODES: [&str; 2] = ["LibraryNotFound", "DriverNotLoaded"];

/// NVML clock-throttle reason bits (`nvmlClocksThrottleReason*` in `nvml.h`) and their names.
pub const THROTTLE_REASONS: [(u64, &str); 9] = [
    (0x1, "GpuIdle"),
    (0x2, "ApplicationsClocksSetting"),
    (0x4, "SwPowerCap"),
    (0x8, "HwSlowdown"),
    (0x10, "SyncBoost"),
    (0x20, "SwThermalSlowdown"),
    (0x40, "HwThermalSlowdown"),
    (0x80, "HwPowerBrakeSlowdown"),
    (0x100, "DisplayClockSetting"),
];

/// Throttle bits that mean the GPU is too hot (`SwThermalSlowdown | HwThermalSlowdown`).
pub const THERMAL_THROTTLE_MASK: u64 = 0x20 | 0x40;
/// Throttle bits that mean an external hardware slowdown (`HwSlowdown | HwPowerBrakeSlowdown`).
pub const HW_SLOWDOWN_MASK: u64 = 0x8 | 0x80;

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

/// Why NVML could not be used, from its initialisation error.
pub fn classify_init_error(e: &NvmlError, library: &str) -> InitFailure {
    let (cause, why) = classify_parts(e, library);
    InitFailure {
        cause,
        why,
        error: e.to_string(),
    }
}

fn classify_parts(e: &NvmlError, library: &str) -> (&'static str, String) {
    match e {
        NvmlError::LibloadingError(le) => (
            "LibraryNotFound",
            format!(
                "the NVML library {library} could not be loaded ({le}); the NVIDIA driver's \
                 user-space libraries are not installed or not on the loader path"
            ),
        ),
        NvmlError::FailedToLoadSymbol(s) => (
            "NotNvml",
            format!("{library} loaded but is not a usable NVML library ({s})"),
        ),
        NvmlError::DriverNotLoaded => (
            "DriverNotLoaded",
            format!(
                "the NVML library {library} loaded but the NVIDIA kernel driver is not loaded \
                 (no /dev/nvidiactl)"
            ),
        ),
        NvmlError::NoPermission => (
            "NoPermission",
            format!(
                "the NVML library {library} loaded but has no permission to talk to the driver; \
                 the agent needs access to /dev/nvidia*"
            ),
        ),
        NvmlError::LibraryNotFound => (
            "LibraryNotFound",
            format!("NVML ({library}) could not find a library it depends on"),
        ),
        other => (
            "InitFailed",
            format!("NVML ({library}) failed to initialise: {other}"),
        ),
    }
}

/// The result when NVML cannot be used: `Warning` `NvmlUnavailable` on a planned GPU node;
/// on any other node `Ok` [`GPU_NOT_EXPECTED`] when the cause is one of
/// [`EXPECTED_ON_CPU_NODES`], else `Unknown` `NvmlUnavailable`.
pub fn nvml_unavailable(gpu_node: bool, library: &str, error: &NvmlError) -> CheckResult {
    unavailable(gpu_node, library, &classify_init_error(error, library))
}

/// [`nvml_unavailable`] from an already classified failure. Observed keys: `cause`, `library`,
/// `error`; for [`GPU_NOT_EXPECTED`] also `planGpuNode` (`false`).
pub fn unavailable(gpu_node: bool, library: &str, failure: &InitFailure) -> CheckResult {
    let InitFailure { cause, why, error } = failure;
    if !gpu_node && EXPECTED_ON_CPU_NODES.contains(cause) {
        let what = if *cause == "DriverNotLoaded" {
            "no NVIDIA kernel driver"
        } else {
            "NVML not loaded"
        };
        return CheckResult::new(
            NAME,
            "host",
            CheckStatus::Ok,
            GPU_NOT_EXPECTED,
            format!("not a GPU node (plan gpuNode=false): {what}, as expected ({why})."),
        )
        .with("cause", *cause)
        .with("library", library)
        .with("error", error)
        .with("planGpuNode", false);
    }
    let (status, tail) = if gpu_node {
        (
            CheckStatus::Warning,
            "the plan expects GPUs on this node, so their health is unknown",
        )
    } else {
        (
            CheckStatus::Unknown,
            "GPU health is not checked (the plan does not expect GPUs here)",
        )
    };
    CheckResult::new(
        NAME,
        "host",
        status,
        "NvmlUnavailable",
        format!("{why}; {tail}."),
    )
    .with("cause", *cause)
    .with("library", library)
    .with("error", error)
}

/// Row-remapping state (Ampere and newer), from `nvmlDeviceGetRemappedRows`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemappedRows {
    /// Rows remapped for correctable errors.
    pub correctable: u32,
    /// Rows remapped for uncorrectable errors.
    pub uncorrectable: u32,
    /// A remap is pending: the GPU needs a reset.
    pub pending: bool,
    /// A remap failed: the GPU should be replaced.
    pub failure: bool,
}

/// What one device reported. `None` means the query is not supported or failed (failures are
/// listed in `query_errors`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuSnapshot {
    /// NVML index.
    pub index: u32,
    /// Product name, e.g. `NVIDIA H200`.
    pub name: Option<String>,
    /// `GPU-…` UUID.
    pub uuid: Option<String>,
    /// Kernel driver version, e.g. `550.54.15`.
    pub driver_version: Option<String>,
    /// CUDA version the driver supports, e.g. `12.4`.
    pub cuda_driver_version: Option<String>,
    /// Framebuffer memory total, bytes.
    pub memory_total_bytes: Option<u64>,
    /// Framebuffer memory used, bytes.
    pub memory_used_bytes: Option<u64>,
    /// Die temperature, °C.
    pub temperature_celsius: Option<u32>,
    /// Uncorrectable (double-bit) ECC errors since the driver loaded; `None` without ECC.
    pub ecc_dbe_volatile: Option<u64>,
    /// Pages pending retirement (pre-Ampere); `None` when unsupported.
    pub retired_pages_pending: Option<bool>,
    /// Row remapping (Ampere+); `None` when unsupported.
    pub remapped_rows: Option<RemappedRows>,
    /// Raw clock-throttle reason bits ([`THROTTLE_REASONS`]).
    pub throttle_reasons: Option<u64>,
    /// The device fell off the bus (`GpuLost` from any query).
    pub lost: bool,
    /// MIG mode is enabled (`None`: not a MIG-capable GPU).
    pub mig_enabled: Option<bool>,
    /// MIG devices (GPU instances) configured, when MIG is enabled.
    pub mig_devices: Option<u32>,
    /// XID events of this GPU, when the NVML thread watches them.
    pub xid: Option<XidStatus>,
    /// Queries that failed for another reason than "not supported": `"query: error"`.
    pub query_errors: Vec<String>,
    /// A query answered `NVML_ERROR_RESET_REQUIRED`: the GPU needs a reset.
    pub reset_required: bool,
    /// NVML's recovery action for the GPU (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, R550+
    /// drivers; [`RECOVERY_ACTIONS`]); `None` where the driver does not expose it.
    pub recovery_action: Option<u32>,
}

/// NVML field id of the GPU's recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`).
pub const FI_GPU_RECOVERY_ACTION: u32 = 230;

/// `nvmlDeviceGpuRecoveryAction_t` values, their names and the status each gives the GPU
/// (`GpuRecoveryRequired`): a reset or reboot is `Critical` (the GPU cannot serve until then),
/// draining peer-to-peer traffic is `Warning`.
pub const RECOVERY_ACTIONS: [(u32, &str, CheckStatus); 5] = [
    (0, "None", CheckStatus::Ok),
    (1, "GpuReset", CheckStatus::Critical),
    (2, "NodeReboot", CheckStatus::Critical),
    (3, "DrainP2P", CheckStatus::Warning),
    (4, "DrainAndReset", CheckStatus::Critical),
];

/// The name and status of a recovery action value (an unknown value: `Unknown(<n>)`,
/// `Warning`).
pub fn recovery_action_of(v: u32) -> (String, CheckStatus) {
    RECOVERY_ACTIONS
        .iter()
        .find(|(n, _, _)| *n == v)
        .map(|(_, name, st)| (name.to_string(), *st))
        .unwrap_or_else(|| (format!("Unknown({v})"), CheckStatus::Warning))
}

/// Reason (`Critical`, subject = the GPU's UUID) for a GPU of the expected inventory
/// ([`super::gpu_state`]) that NVML no longer enumerates.
pub const GPU_MISSING: &str = "GpuMissing";

/// Reason for a GPU whose NVML recovery action is not `None` ([`RECOVERY_ACTIONS`]).
pub const GPU_RECOVERY_REQUIRED: &str = "GpuRecoveryRequired";

/// The queries whose answers decide the verdict ([`evaluate_device`]); when one fails the GPU's
/// health is not known, and the result says so instead of `GpuOk`.
pub const HEALTH_QUERIES: [&str; 4] = ["ecc", "retiredPages", "remappedRows", "throttle"];

/// The XID side of a GPU: what the NVML thread saw, judged under the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidStatus {
    /// `Ok` when the GPU is registered for XID events, else why not.
    pub monitored: Result<(), String>,
    /// The verdict over the GPU's XID log ([`evaluate_xids`]).
    pub verdict: XidVerdict,
    /// Events received since the agent started.
    pub total: u64,
    /// The policy's quiet period.
    pub quiet_period: Duration,
    /// When the verdict was taken.
    pub now: SystemTime,
}

impl XidStatus {
    /// Judges a GPU's log under `policy` at `now`.
    pub fn judge(
        log: &XidLog,
        support: &EventSupport,
        policy: &XidPolicy,
        now: SystemTime,
    ) -> Self {
        XidStatus {
            monitored: match support {
                EventSupport::Monitored => Ok(()),
                EventSupport::Unavailable(e) => Err(e.clone()),
            },
            verdict: evaluate_xids(log, policy, now),
            total: log.total,
            quiet_period: policy.quiet_period,
            now,
        }
    }
}

fn unix_ms(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// Names of the set throttle bits, `+`-joined (`SwThermalSlowdown+HwSlowdown`), or `None`.
pub fn throttle_names(bits: u64) -> String {
    let names: Vec<&str> = THROTTLE_REASONS
        .iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "None".to_string()
    } else {
        names.join("+")
    }
}

/// The pure decision for one device (policy table in `docs/checks.md`).
///
/// Critical: `GpuLost`, `GpuEccErrors` (uncorrectable volatile ECC errors > 0),
/// `GpuRowRemapFailure`. Warning: `GpuRowRemapPending`, `GpuRetiredPagesPending`,
/// `GpuThermalThrottle`, `GpuHwSlowdown`, `GpuResetRequired` (a query answered
/// `NVML_ERROR_RESET_REQUIRED`). Unknown: `GpuHealthUnknown` (one of [`HEALTH_QUERIES`] failed
/// otherwise than "not supported"). Otherwise Ok `GpuOk`. Several findings combine into one
/// result: worst status, the first worst finding's reason, every finding's sentence.
pub fn evaluate_device(s: &GpuSnapshot) -> CheckResult {
    let subject = format!("gpu{}", s.index);
    let label = match &s.name {
        Some(n) => format!("{subject} ({n})"),
        None => subject.clone(),
    };
    let mut findings: Vec<(CheckStatus, &str, String)> = Vec::new();
    if s.lost {
        findings.push((
            CheckStatus::Critical,
            "GpuLost",
            format!("{label} has fallen off the bus; drain the node and reset or reboot."),
        ));
    }
    if let Some(n) = s.ecc_dbe_volatile.filter(|n| *n > 0) {
        findings.push((
            CheckStatus::Critical,
            "GpuEccErrors",
            format!(
                "{label} reports {n} uncorrectable (double-bit) ECC errors since the driver \
                 loaded; engines on it may crash or return corrupt results."
            ),
        ));
    }
    if let Some(rr) = s.remapped_rows {
        if rr.failure {
            findings.push((
                CheckStatus::Critical,
                "GpuRowRemapFailure",
                format!("{label} failed to remap a memory row; the GPU needs replacement."),
            ));
        }
    }
    let xid_finding = s.xid.as_ref().and_then(|x| {
        let culprit = x.verdict.culprit.as_ref()?;
        let xid = culprit
            .xid
            .map(|n| format!("XID {n} ({})", xid_description(n)))
            .unwrap_or_else(|| "an XID of unknown value".to_string());
        let age = x
            .now
            .duration_since(culprit.at)
            .unwrap_or(Duration::ZERO)
            .as_secs();
        let others = if x.verdict.active.len() > 1 {
            format!(
                " (XIDs in the last {} s: {})",
                x.quiet_period.as_secs(),
                x.verdict
                    .active
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            String::new()
        };
        let rule = x.verdict.rule.map(|r| r.as_str()).unwrap_or("policy");
        let until = if x.verdict.action == XidAction::Critical {
            "it stays critical until the GPU is reset or the node reboots (kept across agent \
             restarts in the state directory)"
                .to_string()
        } else {
            format!(
                "it reads healthy again after {} s without such XIDs",
                x.quiet_period.as_secs()
            )
        };
        Some((
            x.verdict.action,
            format!(
                "{label} reported {xid}{} {age} s ago{others}, which the XID policy ({rule}) \
             treats as {}; {until}.",
                culprit.mig_label(),
                x.verdict.action.as_str(),
            ),
        ))
    });
    if let Some((XidAction::Critical, m)) = &xid_finding {
        findings.push((CheckStatus::Critical, "GpuXidFatal", m.clone()));
    }
    if let Some(a) = s.recovery_action.filter(|a| *a != 0) {
        let (name, status) = recovery_action_of(a);
        let last = s
            .xid
            .as_ref()
            .and_then(|x| x.verdict.last.as_ref())
            .and_then(|e| e.xid)
            .map(|x| format!(" after XID {x} ({})", xid_description(x)))
            .unwrap_or_default();
        findings.push((
            status,
            GPU_RECOVERY_REQUIRED,
            format!(
                "{label}'s driver asks for recovery action {name}{last} (NVML \
                 NVML_FI_DEV_GET_GPU_RECOVERY_ACTION); it reads healthy once the driver \
                 reports None."
            ),
        ));
    }
    if let Some(rr) = s.remapped_rows {
        if rr.pending {
            findings.push((
                CheckStatus::Warning,
                "GpuRowRemapPending",
                format!("{label} has a memory row remap pending; reset the GPU to apply it."),
            ));
        }
    }
    if s.retired_pages_pending == Some(true) {
        findings.push((
            CheckStatus::Warning,
            "GpuRetiredPagesPending",
            format!("{label} has memory pages pending retirement; reset the GPU or reboot."),
        ));
    }
    if let Some((XidAction::Warning, m)) = &xid_finding {
        findings.push((CheckStatus::Warning, "GpuXidError", m.clone()));
    }
    if s.reset_required {
        findings.push((
            CheckStatus::Warning,
            "GpuResetRequired",
            format!(
                "{label} answered NVML_ERROR_RESET_REQUIRED: drain the node and reset the GPU \
                 (nvidia-smi -r) or reboot."
            ),
        ));
    }
    if let Some(bits) = s.throttle_reasons {
        if bits & THERMAL_THROTTLE_MASK != 0 {
            let temp = s
                .temperature_celsius
                .map(|t| format!(" at {t} °C"))
                .unwrap_or_default();
            findings.push((
                CheckStatus::Warning,
                "GpuThermalThrottle",
                format!(
                    "{label} is throttling its clocks for heat{temp} ({}); check cooling.",
                    throttle_names(bits & THERMAL_THROTTLE_MASK)
                ),
            ));
        }
        if bits & HW_SLOWDOWN_MASK != 0 {
            findings.push((
                CheckStatus::Warning,
                "GpuHwSlowdown",
                format!(
                    "{label} is slowed down by hardware ({}); check power supply and cooling.",
                    throttle_names(bits & HW_SLOWDOWN_MASK)
                ),
            ));
        }
    }

    let failed: Vec<&str> = s
        .query_errors
        .iter()
        .map(String::as_str)
        .filter(|e| {
            HEALTH_QUERIES
                .iter()
                .any(|q| e.strip_prefix(q).is_some_and(|r| r.starts_with(':')))
        })
        .collect();
    if !failed.is_empty() {
        findings.push((
            CheckStatus::Unknown,
            "GpuHealthUnknown",
            format!(
                "{label}'s health queries failed ({}), so its ECC, row-remap, page-retirement or \
                 throttle state is not known; it is not reported healthy.",
                failed.join("; ")
            ),
        ));
    }

    let (status, reason, message) = if findings.is_empty() {
        let mem = s
            .memory_total_bytes
            .map(|t| format!(", {} memory", bytes_both(t)))
            .unwrap_or_default();
        (
            CheckStatus::Ok,
            "GpuOk",
            format!("{label} is healthy{mem}."),
        )
    } else {
        let status = CheckStatus::worst(findings.iter().map(|f| f.0));
        let reason = findings
            .iter()
            .find(|f| f.0 == status)
            .map(|f| f.1)
            .unwrap_or("GpuOk");
        let message = findings
            .iter()
            .map(|f| f.2.as_str())
            .collect::<Vec<_>>()
            .join(" ");
        (status, reason, message)
    };

    let mut r = CheckResult::new(NAME, subject, status, reason, message).with("index", s.index);
    let opt = |r: CheckResult, k: &str, v: Option<String>| match v {
        Some(v) => r.with(k, v),
        None => r,
    };
    r = opt(r, "name", s.name.clone());
    r = opt(r, "uuid", s.uuid.clone());
    r = opt(r, "driverVersion", s.driver_version.clone());
    r = opt(r, "cudaDriverVersion", s.cuda_driver_version.clone());
    r = opt(
        r,
        "memoryTotalBytes",
        s.memory_total_bytes.map(|v| v.to_string()),
    );
    r = opt(
        r,
        "memoryUsedBytes",
        s.memory_used_bytes.map(|v| v.to_string()),
    );
    r = opt(
        r,
        "temperatureCelsius",
        s.temperature_celsius.map(|v| v.to_string()),
    );
    r = opt(
        r,
        "eccDoubleBitVolatile",
        s.ecc_dbe_volatile.map(|v| v.to_string()),
    );
    r = opt(
        r,
        "retiredPagesPending",
        s.retired_pages_pending.map(|v| v.to_string()),
    );
    if let Some(rr) = s.remapped_rows {
        r = r
            .with("remappedRowsCorrectable", rr.correctable)
            .with("remappedRowsUncorrectable", rr.uncorrectable)
            .with("remappedRowsPending", rr.pending)
            .with("remappedRowsFailure", rr.failure);
    }
    if let Some(bits) = s.throttle_reasons {
        r = r
            .with("throttleReasons", throttle_names(bits))
            .with("throttleReasonsMask", format!("0x{bits:x}"));
    }
    if let Some(m) = s.mig_enabled {
        r = r.with("migMode", if m { "enabled" } else { "disabled" });
    }
    r = opt(r, "migDevices", s.mig_devices.map(|v| v.to_string()));
    r = opt(
        r,
        "recoveryAction",
        s.recovery_action.map(|a| recovery_action_of(a).0),
    );
    if let Some(x) = &s.xid {
        r = r
            .with(
                "xidEvents",
                match &x.monitored {
                    Ok(()) => "monitored".to_string(),
                    Err(e) => format!("unavailable: {e}"),
                },
            )
            .with("xidEventsTotal", x.total)
            .with("xidIgnored", x.verdict.ignored)
            .with("xidQuietPeriodSeconds", x.quiet_period.as_secs());
        if !x.verdict.active.is_empty() {
            r = r.with(
                "activeXids",
                x.verdict
                    .active
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        if x.verdict.recovered {
            r = r.with("xidRecovered", true);
        }
        if let Some(last) = &x.verdict.last {
            r = r
                .with(
                    "lastXid",
                    last.xid
                        .map(|v| v.to_string())
                        .unwrap_or_else(|| "unknown".into()),
                )
                .with("lastXidUnixMs", unix_ms(last.at))
                .with(
                    "lastXidAgeSeconds",
                    x.now
                        .duration_since(last.at)
                        .unwrap_or(Duration::ZERO)
                        .as_secs(),
                );
            r = opt(
                r,
                "lastXidGpuInstance",
                last.gpu_instance.map(|v| v.to_string()),
            );
            r = opt(
                r,
                "lastXidComputeInstance",
                last.compute_instance.map(|v| v.to_string()),
            );
            r = opt(r, "lastXidMigUuid", last.mig_uuid.clone());
        }
    }
    if !s.query_errors.is_empty() {
        r = r.with("queryErrors", s.query_errors.join("; "));
    }
    r
}

/// Formats `nvmlSystemGetCudaDriverVersion_v2` (`12040`) as `12.4`.
pub fn format_cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Reads one device into a snapshot. Unsupported queries leave `None`; `GpuLost` sets `lost`.
fn snapshot(
    nvml: &Nvml,
    index: u32,
    driver: Option<String>,
    cuda: Option<String>,
) -> Result<GpuSnapshot, NvmlError> {
    let device = nvml.device_by_index(index)?;
    let mut s = GpuSnapshot {
        index,
        driver_version: driver,
        cuda_driver_version: cuda,
        ..GpuSnapshot::default()
    };
    let mut keep = |what: &str, r: Result<(), NvmlError>| match r {
        // an older library without the function is the same as an unsupported query
        Ok(()) | Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => {}
        Err(NvmlError::GpuLost) => s.lost = true,
        Err(NvmlError::ResetRequired) => {
            s.reset_required = true;
            s.query_errors
                .push(format!("{what}: {}", NvmlError::ResetRequired));
        }
        Err(e) => s.query_errors.push(format!("{what}: {e}")),
    };
    let mut name = None;
    keep("name", device.name().map(|v| name = Some(v)));
    let mut uuid = None;
    keep("uuid", device.uuid().map(|v| uuid = Some(v)));
    let mut mem = None;
    keep("memory", device.memory_info().map(|v| mem = Some(v)));
    let mut temp = None;
    keep(
        "temperature",
        device
            .temperature(TemperatureSensor::Gpu)
            .map(|v| temp = Some(v)),
    );
    let mut dbe = None;
    keep(
        "ecc",
        device
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .map(|v| dbe = Some(v)),
    );
    let mut pending = None;
    keep(
        "retiredPages",
        device
            .are_pages_pending_retired()
            .map(|v| pending = Some(v)),
    );
    let mut rows = None;
    keep(
        "remappedRows",
        remapped_rows(nvml, &device).map(|v| rows = Some(v)),
    );
    let mut throttle = None;
    keep(
        "throttle",
        device
            .current_throttle_reasons()
            .map(|v| throttle = Some(v.bits())),
    );
    let mut mig = None;
    keep(
        "migMode",
        device.mig_mode().map(|m| mig = Some(m.current == 1)),
    );
    let mut mig_count = None;
    if mig == Some(true) {
        let mut n = 0u32;
        let max = device.mig_device_count().unwrap_or(0);
        for i in 0..max {
            if device.mig_device_by_index(i).is_ok() {
                n += 1;
            }
        }
        mig_count = Some(n);
    }
    s.name = name;
    s.uuid = uuid;
    s.memory_total_bytes = mem.as_ref().map(|m| m.total);
    s.memory_used_bytes = mem.as_ref().map(|m| m.used);
    s.temperature_celsius = temp;
    s.ecc_dbe_volatile = dbe;
    s.retired_pages_pending = pending;
    s.remapped_rows = rows;
    s.throttle_reasons = throttle;
    s.mig_enabled = mig;
    s.mig_devices = mig_count;
    s.recovery_action = recovery_action(&device);
    Ok(s)
}

/// The GPU's recovery action through `nvmlDeviceGetFieldValues`
/// ([`FI_GPU_RECOVERY_ACTION`]); `None` when the library lacks the function or the driver
/// does not support the field (before R550) or answers with an error.
fn recovery_action(device: &Device<'_>) -> Option<u32> {
    let values = device
        .field_values_for(&[FieldId(FI_GPU_RECOVERY_ACTION)])
        .ok()?;
    let sample = values.into_iter().next()?.ok()?;
    match sample.value.ok()? {
        SampleValue::U32(v) => Some(v),
        SampleValue::U64(v) => u32::try_from(v).ok(),
        SampleValue::I64(v) => u32::try_from(v).ok(),
        SampleValue::F64(_) => None,
    }
}

/// `nvmlDeviceGetRemappedRows`, which `nvml-wrapper` 0.13 does not wrap.
fn remapped_rows(nvml: &Nvml, device: &Device<'_>) -> Result<RemappedRows, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corr, mut unc, mut pending, mut failure) = (0, 0, 0, 0);
    // SAFETY: `sym` was resolved from the loaded NVML library and has the C signature
    // `nvmlReturn_t (nvmlDevice_t, unsigned*, unsigned*, unsigned*, unsigned*)`; the handle
    // comes from a live `Device` of the same `Nvml`, and the four out-pointers are valid
    // locals for the duration of the call.
    let rc = unsafe {
        sym(
            device.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failure,
        )
    };
    nvml_try(rc)?;
    Ok(RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failure: failure != 0,
    })
}

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

/// The result [`GPU_MISSING`] (`Critical`, subject = `uuid`) for a GPU of the expected inventory
/// that NVML no longer enumerates. Observed keys: `uuid`, `name` (when known), `lastIndex`,
/// `deviceCount` (GPUs NVML lists now), `expectedCount`, `inventory` (`stateDir` or
/// `memory`), `fatalXids` (latched fatal XIDs of that GPU, comma-separated, when any).
pub fn gpu_missing(
    uuid: &str,
    known: &KnownGpu,
    count: u32,
    expected: usize,
    persisted: bool,
) -> CheckResult {
    let name = known
        .name
        .as_ref()
        .map(|n| format!(" ({n})"))
        .unwrap_or_default();
    let fatal: Vec<String> = known
        .fatal_xids
        .iter()
        .map(|l| {
            l.xid
                .map(|x| x.to_string())
                .unwrap_or_else(|| "unknown".into())
        })
        .collect();
    let after = if fatal.is_empty() {
        String::new()
    } else {
        format!(
            " It reported fatal XID(s) {} before it vanished.",
            fatal.join(", ")
        )
    };
    let mut r = CheckResult::new(
        NAME,
        uuid,
        CheckStatus::Critical,
        GPU_MISSING,
        format!(
            "GPU {uuid}{name}, gpu{} when last seen, is no longer enumerated by NVML: {count} \
             of {expected} expected GPU(s) are listed. It has fallen off the bus or its driver \
             lost it; drain the node and check dmesg for XID 79, then reset the GPU or reboot.{after}",
            known.index
        ),
    )
    .with("uuid", uuid)
    .with("lastIndex", known.index)
    .with("deviceCount", count)
    .with("expectedCount", expected)
    .with("inventory", if persisted { "stateDir" } else { "memory" });
    if let Some(n) = &known.name {
        r = r.with("name", n);
    }
    if !fatal.is_empty() {
        r = r.with("fatalXids", fatal.join(","));
    }
    r
}

/// The `host` result [`GPUS_NOT_PLANNED`] (`Ok`) that goes with the per-GPU `results` on a node
/// whose plan says `gpuNode: false`. Observed keys: `deviceCount`, `models` (the distinct NVML
/// device names, `, `-joined, when known), `library`, `driverVersion`, `planGpuNode`.
pub fn gpus_not_planned(
    results: &[CheckResult],
    library: &str,
    driver: Option<&str>,
) -> CheckResult {
    let mut models: Vec<&str> = results
        .iter()
        .filter_map(|r| r.observed.get("name").map(String::as_str))
        .collect();
    models.sort_unstable();
    models.dedup();
    let n = results.len();
    let what = if models.is_empty() {
        format!("{n} GPU(s)")
    } else {
        format!("{n} GPU(s) ({})", models.join(", "))
    };
    let mut r = CheckResult::new(
        NAME,
        "host",
        CheckStatus::Ok,
        GPUS_NOT_PLANNED,
        format!(
            "NVML shows {what} on this node, but its plan expects none (gpuNode=false: no engine \
             here requests a GPU); each GPU's health is reported on its own. If GPU engines \
             should run here, check that their pods request nvidia.com/gpu."
        ),
    )
    .with("deviceCount", n)
    .with("library", library)
    .with("planGpuNode", false);
    if !models.is_empty() {
        r = r.with("models", models.join(", "));
    }
    if let Some(d) = driver {
        r = r.with("driverVersion", d);
    }
    r
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn healthy() -> GpuSnapshot {
        GpuSnapshot {
            index: 0,
            name: Some("NVIDIA H200".into()),
            uuid: Some("GPU-1234".into()),
            driver_version: Some("550.54.15".into()),
            cuda_driver_version: Some("12.4".into()),
            memory_total_bytes: Some(141 << 30),
            memory_used_bytes: Some(1 << 20),
            temperature_celsius: Some(40),
            ecc_dbe_volatile: Some(0),
            retired_pages_pending: None,
            remapped_rows: Some(RemappedRows::default()),
            throttle_reasons: Some(0x1),
            lost: false,
            mig_enabled: None,
            mig_devices: None,
            xid: None,
            query_errors: vec![],
            reset_required: false,
            recovery_action: None,
        }
    }

    #[test]
    fn device_policy_table() {
        use CheckStatus::*;
        type Case = (Box<dyn Fn(&mut GpuSnapshot)>, CheckStatus, &'static str);
        let cases: Vec<Case> = vec![
            (Box::new(|_| {}), Ok, "GpuOk"),
            (
                Box::new(|s| s.ecc_dbe_volatile = Some(2)),
                Critical,
                "GpuEccErrors",
            ),
            (Box::new(|s| s.ecc_dbe_volatile = None), Ok, "GpuOk"),
            // A failed health query is not "healthy"; an informational one does not matter.
            (
                Box::new(|s| {
                    s.ecc_dbe_volatile = None;
                    s.query_errors = vec!["ecc: an unknown error occurred".into()];
                }),
                Unknown,
                "GpuHealthUnknown",
            ),
            (
                Box::new(|s| s.query_errors = vec!["temperature: timeout".into()]),
                Ok,
                "GpuOk",
            ),
            (
                Box::new(|s| {
                    s.reset_required = true;
                    s.query_errors = vec!["remappedRows: reset required".into()];
                }),
                Warning,
                "GpuResetRequired",
            ),
            (
                Box::new(|s| {
                    s.ecc_dbe_volatile = Some(1);
                    s.query_errors = vec!["throttle: timeout".into()];
                }),
                Critical,
                "GpuEccErrors",
            ),
            (
                Box::new(|s| s.retired_pages_pending = Some(true)),
                Warning,
                "GpuRetiredPagesPending",
            ),
            (
                Box::new(|s| s.retired_pages_pending = Some(false)),
                Ok,
                "GpuOk",
            ),
            (
                Box::new(|s| s.throttle_reasons = Some(0x40)),
                Warning,
                "GpuThermalThrottle",
            ),
            (
                Box::new(|s| s.throttle_reasons = Some(0x20 | 0x4)),
                Warning,
                "GpuThermalThrottle",
            ),
            (Box::new(|s| s.throttle_reasons = Some(0x4)), Ok, "GpuOk"),
            (
                Box::new(|s| s.throttle_reasons = Some(0x80)),
                Warning,
                "GpuHwSlowdown",
            ),
            (
                Box::new(|s| {
                    s.remapped_rows = Some(RemappedRows {
                        pending: true,
                        ..RemappedRows::default()
                    })
                }),
                Warning,
                "GpuRowRemapPending",
            ),
            (
                Box::new(|s| {
                    s.remapped_rows = Some(RemappedRows {
                        failure: true,
                        ..RemappedRows::default()
                    })
                }),
                Critical,
                "GpuRowRemapFailure",
            ),
            (Box::new(|s| s.lost = true), Critical, "GpuLost"),
            (
                Box::new(|s| {
                    s.throttle_reasons = Some(0x40);
                    s.ecc_dbe_volatile = Some(1);
                }),
                Critical,
                "GpuEccErrors",
            ),
        ];
        for (i, (mutate, status, reason)) in cases.into_iter().enumerate() {
            let mut s = healthy();
            mutate(&mut s);
            let r = evaluate_device(&s);
            assert_eq!(
                (r.status, r.reason.as_str()),
                (status, reason),
                "case {i}: {r:?}"
            );
            assert_eq!(r.subject, "gpu0");
        }
    }

    fn xid_status(xid: u64, age_s: u64, gi: Option<u32>) -> XidStatus {
        use super::super::xid::XidEvent;
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let mut log = XidLog::default();
        log.push(XidEvent {
            xid: Some(xid),
            at: now - Duration::from_secs(age_s),
            gpu_instance: gi,
            compute_instance: gi.map(|_| 0),
            mig_uuid: gi.map(|g| format!("MIG-{g}")),
        });
        let policy = XidPolicy {
            quiet_period: Duration::from_secs(300),
            ..XidPolicy::default()
        };
        XidStatus::judge(&log, &EventSupport::Monitored, &policy, now)
    }

    #[test]
    fn xid_findings() {
        use CheckStatus::*;
        let cases: Vec<(XidStatus, CheckStatus, &str)> = vec![
            (xid_status(79, 10, None), Critical, "GpuXidFatal"),
            (xid_status(48, 299, None), Critical, "GpuXidFatal"),
            // fatal XIDs do not expire with the quiet period (a reset or reboot clears them)
            (xid_status(48, 300, None), Critical, "GpuXidFatal"),
            (xid_status(92, 300, None), Ok, "GpuOk"),
            (xid_status(92, 1, None), Warning, "GpuXidError"),
            (xid_status(13, 1, None), Ok, "GpuOk"),
            (xid_status(43, 1, Some(2)), Ok, "GpuOk"),
        ];
        for (i, (x, status, reason)) in cases.into_iter().enumerate() {
            let mut s = healthy();
            s.xid = Some(x);
            let r = evaluate_device(&s);
            assert_eq!(
                (r.status, r.reason.as_str()),
                (status, reason),
                "case {i}: {r:?}"
            );
            assert_eq!(r.observed["xidEvents"], "monitored");
        }
        let mut s = healthy();
        s.xid = Some(xid_status(79, 10, None));
        let r = evaluate_device(&s);
        assert!(
            r.message
                .contains("XID 79 (GPU has fallen off the bus) 10 s ago"),
            "{}",
            r.message
        );
        assert!(
            r.message
                .contains("until the GPU is reset or the node reboots"),
            "{}",
            r.message
        );
        assert_eq!(r.observed["lastXid"], "79");
        assert_eq!(r.observed["activeXids"], "79");
        assert_eq!(r.observed["lastXidAgeSeconds"], "10");
        // a warning past the quiet period: healthy, with the history shown
        s.xid = Some(xid_status(92, 400, None));
        let r = evaluate_device(&s);
        assert_eq!(r.reason, "GpuOk");
        assert_eq!(r.observed["xidRecovered"], "true");
        assert_eq!(r.observed["lastXid"], "92");
        s.xid = Some(xid_status(92, 10, None));
        assert!(evaluate_device(&s).message.contains("after 300 s"));
        // the driver's recovery action: a reset is Critical, draining P2P a Warning
        s.xid = Some(xid_status(149, 10, None));
        s.recovery_action = Some(1);
        let r = evaluate_device(&s);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (Critical, GPU_RECOVERY_REQUIRED)
        );
        assert_eq!(r.observed["recoveryAction"], "GpuReset");
        s.recovery_action = Some(3);
        assert_eq!(evaluate_device(&s).status, Warning);
        s.recovery_action = Some(0);
        assert_eq!(evaluate_device(&s).reason, "GpuXidError");
        s.recovery_action = None;
        // MIG attribution in the message and observed values
        s.xid = Some(xid_status(94, 5, Some(3)));
        let r = evaluate_device(&s);
        assert_eq!(r.reason, "GpuXidFatal");
        assert!(
            r.message.contains("on MIG instance GI 3/CI 0 (MIG-3)"),
            "{}",
            r.message
        );
        assert_eq!(r.observed["lastXidGpuInstance"], "3");
        assert_eq!(r.observed["lastXidMigUuid"], "MIG-3");
        // an ECC error outranks the XID that reported it
        s.ecc_dbe_volatile = Some(1);
        s.xid = Some(xid_status(48, 5, None));
        assert_eq!(evaluate_device(&s).reason, "GpuEccErrors");
    }

    #[test]
    fn observed_keys_and_messages() {
        let mut s = healthy();
        s.throttle_reasons = Some(0x40 | 0x1);
        s.temperature_celsius = Some(91);
        let r = evaluate_device(&s);
        assert!(r.message.contains("91 °C"), "{}", r.message);
        assert_eq!(r.observed["throttleReasons"], "GpuIdle+HwThermalSlowdown");
        assert_eq!(r.observed["throttleReasonsMask"], "0x41");
        assert_eq!(r.observed["name"], "NVIDIA H200");
        assert_eq!(r.observed["uuid"], "GPU-1234");
        assert_eq!(r.observed["cudaDriverVersion"], "12.4");
        assert_eq!(r.observed["eccDoubleBitVolatile"], "0");
        assert_eq!(r.observed["memoryTotalBytes"], (141u64 << 30).to_string());
        assert_eq!(format_cuda_version(12040), "12.4");
        assert_eq!(format_cuda_version(11080), "11.8");
        assert_eq!(throttle_names(0), "None");
    }

    #[test]
    fn unavailable_is_unknown_or_warning() {
        let r = nvml_unavailable(false, "libnvidia-ml.so.1", &NvmlError::NoPermission);
        assert_eq!(r.status, CheckStatus::Unknown);
        assert_eq!(r.reason, "NvmlUnavailable");
        assert!(r.message.contains("no permission"), "{}", r.message);
        assert_eq!(r.observed["cause"], "NoPermission");
        let r = nvml_unavailable(true, "x.so", &NvmlError::NoPermission);
        assert_eq!(r.status, CheckStatus::Warning);
        assert_eq!(r.observed["cause"], "NoPermission");
        let r = nvml_unavailable(true, "x.so", &NvmlError::DriverNotLoaded);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Warning, "NvmlUnavailable")
        );
    }

    /// A CPU node (plan gpuNode=false) without NVML, or with NVML but no kernel driver, is
    /// healthy as planned; what cannot be told apart from a hidden GPU stays Unknown.
    #[test]
    fn a_cpu_node_without_nvml_is_ok_as_expected() {
        let r = nvml_unavailable(false, "libnvidia-ml.so.1", &NvmlError::DriverNotLoaded);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Ok, GPU_NOT_EXPECTED)
        );
        assert!(
            r.message
                .starts_with("not a GPU node (plan gpuNode=false): no NVIDIA kernel driver"),
            "{}",
            r.message
        );
        assert_eq!(r.observed["cause"], "DriverNotLoaded");
        assert_eq!(r.observed["planGpuNode"], "false");
        let absent = InitFailure {
            cause: "LibraryNotFound",
            why: "the NVML library libnvidia-ml.so.1 could not be loaded (gone)".into(),
            error: "gone".into(),
        };
        let r = unavailable(false, "libnvidia-ml.so.1", &absent);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Ok, GPU_NOT_EXPECTED)
        );
        assert!(
            r.message
                .starts_with("not a GPU node (plan gpuNode=false): NVML not loaded, as expected"),
            "{}",
            r.message
        );
        assert_eq!(unavailable(true, "l", &absent).status, CheckStatus::Warning);
        for cause in ["NotNvml", "NoPermission", "InitFailed"] {
            let f = InitFailure {
                cause,
                why: "w".into(),
                error: "e".into(),
            };
            assert_eq!(
                (unavailable(false, "l", &f).status, cause),
                (CheckStatus::Unknown, cause)
            );
        }
    }

    #[test]
    fn gpus_on_a_node_planned_without_them_are_said() {
        let gpus = vec![evaluate_device(&healthy()), {
            let mut s = healthy();
            s.index = 1;
            s.name = Some("NVIDIA H100 80GB HBM3".into());
            evaluate_device(&s)
        }];
        let r = gpus_not_planned(&gpus, "libnvidia-ml.so.1", Some("550.54.15"));
        assert_eq!(
            (r.subject.as_str(), r.status, r.reason.as_str()),
            ("host", CheckStatus::Ok, GPUS_NOT_PLANNED)
        );
        assert_eq!(r.observed["deviceCount"], "2");
        assert_eq!(r.observed["models"], "NVIDIA H100 80GB HBM3, NVIDIA H200");
        assert!(
            r.message.starts_with(
                "NVML shows 2 GPU(s) (NVIDIA H100 80GB HBM3, NVIDIA H200) on this node"
            ),
            "{}",
            r.message
        );
    }
}
