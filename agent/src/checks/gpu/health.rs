//! A GPU's health from one [`GpuSnapshot`] of its NVML answers: XID events under the
//! [`XidPolicy`], ECC double-bit errors, row remaps and page retirements, clock throttling and
//! the recovery action ([`evaluate_device`]). Pure: no NVML here.

use std::time::{Duration, SystemTime};

use ic_shared::check::{CheckResult, CheckStatus};

use super::super::gpu_monitor::EventSupport;
use super::super::units::bytes_both;
use super::super::xid::{evaluate_xids, xid_description, XidAction, XidLog, XidPolicy, XidVerdict};

use super::NAME;

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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(super) mod tests {
    use super::*;

    pub(crate) fn healthy() -> GpuSnapshot {
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
        use super::super::super::xid::XidEvent;
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
}
