//! GPUs against what the node should have: a GPU of the expected inventory that NVML no longer
//! lists ([`GPU_MISSING`]), and GPUs on a node planned without them ([`GPUS_NOT_PLANNED`]).

use ic_shared::check::{CheckResult, CheckStatus};

use super::super::gpu_state::KnownGpu;

use super::NAME;

/// Reason (`Ok`, subject `host`, next to the per-GPU results) when NVML shows GPUs on a node
/// whose plan says `gpuNode: false` (no engine there requests a GPU: an idle GPU node, or a
/// plan that forgot `gpuNode`). The GPUs' own health is still judged per GPU.
pub const GPUS_NOT_PLANNED: &str = "GpusNotPlanned";

/// Reason (`Critical`, subject = the GPU's UUID) for a GPU of the expected inventory
/// ([`super::gpu_state`]) that NVML no longer enumerates.
pub const GPU_MISSING: &str = "GpuMissing";

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
    use super::super::health::evaluate_device;
    use super::super::health::tests::healthy;
    use super::*;

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
