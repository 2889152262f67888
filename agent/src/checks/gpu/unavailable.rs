//! NVML that cannot be used: why it could not be loaded or initialised
//! ([`classify_init_error`]), and the one `host` result that says so — `Unknown`, `Warning` on a
//! node planned with GPUs, `Ok` ([`GPU_NOT_EXPECTED`]) on one planned without them.

use ic_shared::check::{CheckResult, CheckStatus};
use nvml_wrapper::error::NvmlError;

use super::super::gpu_monitor::InitFailure;

use super::NAME;

/// Reason (`Ok`, subject `host`) on a node whose plan says `gpuNode: false` when NVML is absent
/// (`cause` `LibraryNotFound`) or its kernel driver is not loaded (`DriverNotLoaded`): what a
/// CPU node looks like, so the node's verdict is not `Unknown` for it (`docs/checks.md`).
pub const GPU_NOT_EXPECTED: &str = "GpuNotExpected";

/// Initialisation causes that on a node planned without GPUs mean "no NVIDIA stack here", not
/// "cannot tell": the library is absent, or present without its kernel driver.
pub const EXPECTED_ON_CPU_NODES: [&str; 2] = ["LibraryNotFound", "DriverNotLoaded"];

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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

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
}
