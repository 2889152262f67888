//! A probe's outcome against the plan: one result per CUDA device (`CudaOk`, `CudaInitFailed`,
//! `CudaDeviceBusy`, `CudaLaunchFailed`, `CudaResultMismatch`), or one `host` result when the
//! driver cannot be used — `CudaNotExpected` on a node planned without GPUs.

use ic_shared::check::{CheckResult, CheckStatus};

use super::probe::{CudaProbe, DeviceProbe};
use super::ptx::{expected_value, PROBE_ELEMENTS};
use super::NAME;

/// Reason (`Ok`, subject `host`) on a node whose plan says `gpuNode: false` when there is no
/// libcuda (`cause` `LibraryNotFound`) or no CUDA device (`NoDevice`): what a CPU node looks
/// like (`docs/checks.md`).
pub const CUDA_NOT_EXPECTED: &str = "CudaNotExpected";

/// [`CudaProbe::Unavailable`] causes that on a node planned without GPUs mean "no CUDA here",
/// not "cannot tell".
pub const EXPECTED_ON_CPU_NODES: [&str; 2] = ["LibraryNotFound", "NoDevice"];

/// `cuDriverGetVersion`'s integer (`12080`) as `12.8`.
pub fn format_driver_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The pure decision from a probe. `required` is the plan's runtime version as written.
///
/// `Unavailable` reads `Warning` `CudaUnavailable` on a planned GPU node; elsewhere `Ok`
/// [`CUDA_NOT_EXPECTED`] for the causes in [`EXPECTED_ON_CPU_NODES`], else `Unknown`
/// `CudaUnavailable`.
pub fn evaluate(
    probe: &CudaProbe,
    gpu_node: bool,
    library: &str,
    required: Option<&str>,
) -> Vec<CheckResult> {
    let degraded = if gpu_node {
        CheckStatus::Warning
    } else {
        CheckStatus::Unknown
    };
    let host = |status, reason: &str, message: String| {
        let mut r =
            CheckResult::new(NAME, "host", status, reason, message).with("library", library);
        if let Some(req) = required {
            r = r.with("requiredRuntimeVersion", req);
        }
        r
    };
    match probe {
        CudaProbe::Unavailable(cause, why)
            if !gpu_node && EXPECTED_ON_CPU_NODES.contains(cause) =>
        {
            let what = if *cause == "NoDevice" {
                "no CUDA device"
            } else {
                "no CUDA driver library"
            };
            vec![host(
                CheckStatus::Ok,
                CUDA_NOT_EXPECTED,
                format!("not a GPU node (plan gpuNode=false): {what}, as expected ({why})."),
            )
            .with("cause", *cause)
            .with("planGpuNode", false)]
        }
        CudaProbe::Unavailable(cause, why) => {
            let tail = if gpu_node {
                "the plan expects GPUs on this node, so whether they can run kernels is unknown"
            } else {
                "CUDA is not checked (the plan does not expect GPUs here)"
            };
            vec![host(degraded, "CudaUnavailable", format!("{why}; {tail}.")).with("cause", *cause)]
        }
        CudaProbe::InitFailed(f) => vec![host(
            CheckStatus::Critical,
            "CudaInitFailed",
            format!(
                "the CUDA driver failed to initialise ({}: {}); no engine on this node can use \
                 a GPU. Check that the user-space driver matches the kernel module (nvidia-smi) \
                 and, on NVSwitch systems, that nvidia-fabricmanager runs.",
                f.stage, f.error
            ),
        )
        .with("cudaError", &f.error)
        .with("cudaErrorCode", f.code)
        .with("stage", f.stage)],
        CudaProbe::Devices {
            driver_version,
            devices,
        } => {
            let driver = format_driver_version(*driver_version);
            devices
                .iter()
                .map(|d| evaluate_device(d, &driver, *driver_version, library, required))
                .collect()
        }
    }
}

fn evaluate_device(
    d: &DeviceProbe,
    driver: &str,
    driver_raw: i32,
    library: &str,
    required: Option<&str>,
) -> CheckResult {
    let subject = format!("cuda{}", d.ordinal);
    let label = match &d.name {
        Some(n) => format!("{subject} ({n})"),
        None => subject.clone(),
    };
    let ptx = d
        .ptx_version
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_default();
    let target = d.ptx_target.map(|t| format!("sm_{t}")).unwrap_or_default();
    let (status, reason, message) = match (&d.failure, d.mismatches) {
        (None, Some(0)) => (
            CheckStatus::Ok,
            "CudaOk",
            format!(
                "{label} ran a test kernel (PTX {ptx}, {target}) and all {PROBE_ELEMENTS} results \
                 are correct, in {:.0} ms; the driver supports CUDA {driver}.",
                d.elapsed.as_secs_f64() * 1000.0
            ),
        ),
        (None, Some(n)) => (
            CheckStatus::Critical,
            "CudaResultMismatch",
            format!(
                "{label} ran a test kernel but {n} of {PROBE_ELEMENTS} results are wrong{}; the \
                 GPU computes incorrectly: drain the node and run NVIDIA's field diagnostics.",
                d.first_mismatch
                    .map(|(i, v)| format!(" (element {i} is {v}, expected {})", expected_value(i)))
                    .unwrap_or_default()
            ),
        ),
        (None, None) => (
            CheckStatus::Unknown,
            "CudaUnavailable",
            format!("{label} was not probed."),
        ),
        (Some(f), _) => match (f.stage, f.error.as_str()) {
            ("context" | "alloc", "CUDA_ERROR_DEVICE_UNAVAILABLE" | "CUDA_ERROR_OUT_OF_MEMORY") => {
                (
                    CheckStatus::Unknown,
                    "CudaDeviceBusy",
                    format!(
                    "{label} is in use and cannot take the probe's context ({}); an engine may \
                     hold it in exclusive-process mode or fill its memory. Not a fault.",
                    f.error
                ),
                )
            }
            ("device" | "context", _) => (
                CheckStatus::Critical,
                "CudaInitFailed",
                format!(
                    "{label} cannot be opened by CUDA ({} at {}); engines on it will fail to \
                     start. Check the driver (nvidia-smi, dmesg for XIDs).",
                    f.error, f.stage
                ),
            ),
            (_, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION") => (
                CheckStatus::Critical,
                "CudaLaunchFailed",
                format!(
                    "{label} cannot load PTX {ptx}: the driver supports CUDA {driver}{}. Engines \
                     built with a newer CUDA fail at kernel launch; upgrade the driver or use an \
                     image built for CUDA {driver} or older.",
                    required
                        .map(|r| format!(" but the plan's engines use the CUDA {r} runtime"))
                        .unwrap_or_default()
                ),
            ),
            _ => (
                CheckStatus::Critical,
                "CudaLaunchFailed",
                format!(
                    "{label} failed to run a test kernel ({} at {}); engines on it will fail at \
                     kernel launch.",
                    f.error, f.stage
                ),
            ),
        },
    };
    let mut r = CheckResult::new(NAME, subject, status, reason, message)
        .with("ordinal", d.ordinal)
        .with("driverCudaVersion", driver)
        .with("driverVersionRaw", driver_raw)
        .with("library", library)
        .with("elapsedMillis", d.elapsed.as_millis());
    let opt = |r: CheckResult, k: &str, v: Option<String>| match v {
        Some(v) => r.with(k, v),
        None => r,
    };
    r = opt(r, "name", d.name.clone());
    r = opt(r, "uuid", d.uuid.clone());
    r = opt(
        r,
        "computeCapability",
        d.compute_capability
            .map(|c| format!("{}.{}", c / 10, c % 10)),
    );
    r = opt(
        r,
        "ptxVersion",
        d.ptx_version.map(|(a, b)| format!("{a}.{b}")),
    );
    r = opt(r, "ptxTarget", d.ptx_target.map(|t| format!("sm_{t}")));
    r = opt(r, "requiredRuntimeVersion", required.map(str::to_string));
    r = opt(r, "mismatches", d.mismatches.map(|m| m.to_string()));
    if let Some(f) = &d.failure {
        r = r
            .with("cudaError", &f.error)
            .with("cudaErrorCode", f.code)
            .with("stage", f.stage);
    }
    r
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::probe::CudaFailure;
    use super::*;
    use std::time::Duration;

    fn dev(failure: Option<(&'static str, &str)>, mismatches: Option<u32>) -> DeviceProbe {
        DeviceProbe {
            ordinal: 1,
            name: Some("NVIDIA H200".into()),
            uuid: Some("GPU-1".into()),
            compute_capability: Some(90),
            ptx_version: Some((8, 7)),
            ptx_target: Some(90),
            mismatches,
            first_mismatch: mismatches.filter(|m| *m > 0).map(|_| (3, 0)),
            failure: failure.map(|(stage, error)| CudaFailure {
                stage,
                error: error.into(),
                code: 222,
            }),
            elapsed: Duration::from_millis(12),
        }
    }

    #[test]
    fn verdict_table() {
        use CheckStatus::*;
        let devices = |d: DeviceProbe| CudaProbe::Devices {
            driver_version: 12040,
            devices: vec![d],
        };
        let cases: Vec<(CudaProbe, bool, CheckStatus, &str)> = vec![
            (devices(dev(None, Some(0))), true, Ok, "CudaOk"),
            (
                devices(dev(None, Some(5))),
                true,
                Critical,
                "CudaResultMismatch",
            ),
            (
                devices(dev(
                    Some(("module", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")),
                    None,
                )),
                true,
                Critical,
                "CudaLaunchFailed",
            ),
            (
                devices(dev(Some(("launch", "CUDA_ERROR_LAUNCH_FAILED")), None)),
                true,
                Critical,
                "CudaLaunchFailed",
            ),
            (
                devices(dev(
                    Some(("context", "CUDA_ERROR_DEVICE_UNAVAILABLE")),
                    None,
                )),
                true,
                Unknown,
                "CudaDeviceBusy",
            ),
            (
                devices(dev(Some(("context", "CUDA_ERROR_SYSTEM_NOT_READY")), None)),
                true,
                Critical,
                "CudaInitFailed",
            ),
            (
                CudaProbe::Unavailable("LibraryNotFound", "no lib".into()),
                false,
                Ok,
                "CudaNotExpected",
            ),
            (
                CudaProbe::Unavailable("NoDevice", "no device".into()),
                false,
                Ok,
                "CudaNotExpected",
            ),
            (
                CudaProbe::Unavailable("NoDevice", "no device".into()),
                true,
                Warning,
                "CudaUnavailable",
            ),
            (
                CudaProbe::Unavailable("NotLibcuda", "missing cuLaunchKernel".into()),
                false,
                Unknown,
                "CudaUnavailable",
            ),
            (
                CudaProbe::Unavailable("Panicked", "boom".into()),
                false,
                Unknown,
                "CudaUnavailable",
            ),
            (
                CudaProbe::Unavailable("LibraryNotFound", "no lib".into()),
                true,
                Warning,
                "CudaUnavailable",
            ),
            (
                CudaProbe::InitFailed(CudaFailure {
                    stage: "init",
                    error: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH".into(),
                    code: 803,
                }),
                false,
                Critical,
                "CudaInitFailed",
            ),
        ];
        for (i, (p, gpu_node, status, reason)) in cases.into_iter().enumerate() {
            let r = evaluate(&p, gpu_node, "libcuda.so.1", Some("12.8"));
            assert_eq!(r.len(), 1);
            assert_eq!(
                (r[0].status, r[0].reason.as_str()),
                (status, reason),
                "case {i}: {:?}",
                r[0]
            );
        }
        let r = evaluate(
            &devices(dev(
                Some(("module", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")),
                None,
            )),
            true,
            "l",
            Some("12.8"),
        );
        assert!(
            r[0].message.contains("supports CUDA 12.4"),
            "{}",
            r[0].message
        );
        assert!(
            r[0].message.contains("CUDA 12.8 runtime"),
            "{}",
            r[0].message
        );
        assert_eq!(r[0].subject, "cuda1");
        assert_eq!(r[0].observed["driverCudaVersion"], "12.4");
        assert_eq!(r[0].observed["ptxVersion"], "8.7");
        assert_eq!(
            r[0].observed["cudaError"],
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
        );
        let ok = evaluate(&devices(dev(None, Some(0))), true, "l", None);
        assert_eq!(ok[0].observed["computeCapability"], "9.0");
        assert_eq!(ok[0].observed["uuid"], "GPU-1");
    }

    #[test]
    fn a_cpu_node_without_cuda_says_so() {
        let r = evaluate(
            &CudaProbe::Unavailable("LibraryNotFound", "no libcuda.so.1 here".into()),
            false,
            "libcuda.so.1",
            None,
        );
        assert_eq!(
            r[0].message,
            "not a GPU node (plan gpuNode=false): no CUDA driver library, as expected (no \
             libcuda.so.1 here)."
        );
        assert_eq!(r[0].observed["cause"], "LibraryNotFound");
        assert_eq!(r[0].observed["planGpuNode"], "false");
        assert_eq!(r[0].observed["library"], "libcuda.so.1");
    }
}
