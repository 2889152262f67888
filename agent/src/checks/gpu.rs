//! `gpu`: NVIDIA GPUs through NVML (`nvml-wrapper`).
//!
//! NVML is loaded on every run, on the calling thread (the async caller uses `spawn_blocking`),
//! from [`ChecksConfig::nvml_library`] or `libnvidia-ml.so.1` on the loader path. When it cannot
//! be loaded or initialised the check returns one `host` result, `NvmlUnavailable`, `Unknown` —
//! or `Warning` when the plan says the node should have GPUs — and never panics. Otherwise one
//! result per device (`gpu<N>`) judged by [`evaluate_device`] from a [`GpuSnapshot`]: ECC
//! double-bit (uncorrectable) volatile errors, row-remap failures, pending row remaps or page
//! retirements, and clock throttling for heat or hardware slowdown.

use std::ffi::OsStr;
use std::path::PathBuf;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::{nvml_sym, nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};

use super::units::bytes_both;
use super::{Check, ChecksConfig};

/// Check name.
pub const NAME: &str = "gpu";

/// The library name loaded when no path is configured.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";

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

/// The `gpu` check.
#[derive(Debug, Clone)]
pub struct GpuCheck {
    nvml_library: Option<PathBuf>,
}

impl GpuCheck {
    /// Reads `cfg.nvml_library`.
    pub fn new(cfg: &ChecksConfig) -> Self {
        GpuCheck {
            nvml_library: cfg.nvml_library.clone(),
        }
    }

    fn library_label(&self) -> String {
        self.nvml_library
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| DEFAULT_NVML_LIBRARY.to_string())
    }

    fn init(&self) -> Result<Nvml, NvmlError> {
        match &self.nvml_library {
            Some(path) => Nvml::builder().lib_path(OsStr::new(path)).init(),
            None => Nvml::builder()
                .lib_path(OsStr::new(DEFAULT_NVML_LIBRARY))
                .init(),
        }
    }
}

/// Why NVML could not be used: `(cause label, explanation)`.
fn classify_init_error(e: &NvmlError, library: &str) -> (&'static str, String) {
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

/// The result when NVML cannot be used: `Warning` on a planned GPU node, else `Unknown`.
pub fn nvml_unavailable(gpu_node: bool, library: &str, error: &NvmlError) -> CheckResult {
    let (cause, why) = classify_init_error(error, library);
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
    .with("cause", cause)
    .with("library", library)
    .with("error", error.to_string())
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
    /// Queries that failed for another reason than "not supported": `"query: error"`.
    pub query_errors: Vec<String>,
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
/// `GpuThermalThrottle`, `GpuHwSlowdown`. Otherwise Ok `GpuOk`. Several findings combine into
/// one result: worst status, the first worst finding's reason, every finding's sentence.
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
        Ok(()) | Err(NvmlError::NotSupported) => {}
        Err(NvmlError::GpuLost) => s.lost = true,
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
    s.name = name;
    s.uuid = uuid;
    s.memory_total_bytes = mem.as_ref().map(|m| m.total);
    s.memory_used_bytes = mem.as_ref().map(|m| m.used);
    s.temperature_celsius = temp;
    s.ecc_dbe_volatile = dbe;
    s.retired_pages_pending = pending;
    s.remapped_rows = rows;
    s.throttle_reasons = throttle;
    Ok(s)
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
        let nvml = match self.init() {
            Ok(n) => n,
            Err(e) => return vec![nvml_unavailable(plan.gpu_node, &library, &e)],
        };
        let driver = nvml.sys_driver_version().ok();
        let cuda = nvml.sys_cuda_driver_version().ok().map(format_cuda_version);
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                let status = if plan.gpu_node {
                    CheckStatus::Warning
                } else {
                    CheckStatus::Unknown
                };
                return vec![CheckResult::new(
                    NAME,
                    "host",
                    status,
                    "NvmlQueryFailed",
                    format!("NVML ({library}) loaded but cannot count GPUs: {e}."),
                )
                .with("library", library)
                .with("error", e.to_string())];
            }
        };
        if count == 0 {
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
        (0..count)
            .map(|i| match snapshot(&nvml, i, driver.clone(), cuda.clone()) {
                Ok(s) => evaluate_device(&s),
                Err(NvmlError::GpuLost) => evaluate_device(&GpuSnapshot {
                    index: i,
                    lost: true,
                    driver_version: driver.clone(),
                    cuda_driver_version: cuda.clone(),
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
            .collect()
    }
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
            query_errors: vec![],
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
        let r = nvml_unavailable(false, "libnvidia-ml.so.1", &NvmlError::DriverNotLoaded);
        assert_eq!(r.status, CheckStatus::Unknown);
        assert_eq!(r.reason, "NvmlUnavailable");
        assert!(r.message.contains("driver is not loaded"), "{}", r.message);
        assert_eq!(r.observed["cause"], "DriverNotLoaded");
        let r = nvml_unavailable(true, "x.so", &NvmlError::NoPermission);
        assert_eq!(r.status, CheckStatus::Warning);
        assert_eq!(r.observed["cause"], "NoPermission");
    }
}
