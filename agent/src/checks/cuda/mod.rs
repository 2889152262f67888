//! `cuda`: can each GPU actually run a kernel through the CUDA driver API?
//!
//! NVML can report a healthy GPU that CUDA cannot use: a user-space `libcuda` that does not
//! match the kernel module, a fabric manager that is not running, a driver too old for the
//! engines' CUDA runtime (which "loads cleanly and fails only at kernel launch"). This check
//! does what an engine does, per GPU, with `cudarc` 0.19's driver API (`cudarc::driver::result`,
//! dynamic loading):
//!
//! `cuInit` → `cuDriverGetVersion` → per device `cuDeviceGet`, name, UUID, compute capability
//! → `cuDevicePrimaryCtxRetain` + `cuCtxSetCurrent` → `cuModuleLoadData` of a tiny PTX kernel
//! (`out[i] = 3·i + 7`) → `cuModuleGetFunction` → `cuMemAlloc` → `cuLaunchKernel` →
//! `cuCtxSynchronize` → `cuMemcpyDtoH` → compare every element → free, unload, release.
//!
//! The kernel's PTX ISA version is the one of the plan's CUDA runtime (`cuda.runtimeVersion`,
//! e.g. 12.8 → PTX 8.7), and at least what the GPU's architecture needs, so a driver too old for
//! the engines fails here with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` as the engines would.
//!
//! **cudarc panics when it cannot find libcuda** (and on a missing symbol). The library is
//! therefore checked before cudarc touches it: a configured path is `dlopen`ed by path first
//! (and kept loaded; cudarc, which only searches by name, then gets the same object through its
//! SONAME), the default search is tested with `cudarc::driver::sys::is_culib_present`, and every
//! symbol the probe calls is looked up in the library cudarc bound to. Panics are still caught
//! as a last resort. cudarc binds one library per process, for the process's lifetime.
//!
//! A probe creates a context on every GPU (some hundred MiB of GPU memory for a moment), so it
//! runs on its own thread at most once per [`ChecksConfig::cuda_interval`] (and when the plan's
//! CUDA requirement changes); passes in between return the last results. After a probe that
//! found a problem (any result not `Ok`) the next one is due sooner, so that a node whose driver
//! recovered does not read Critical for the rest of the interval: after
//! [`ChecksConfig::cuda_failure_retry`] (15 s), doubling with each further failed probe, never
//! later than the interval ([`reprobe_after`]).
//!
//! Results: `host` when the driver cannot be used at all, else one per CUDA device, subject
//! `cuda<ordinal>` (CUDA's ordinal; `uuid` ties it to NVML's `gpu<N>`). Reasons (see
//! `docs/checks.md`): `CudaOk`, `CudaNotExpected`, `CudaUnavailable`, `CudaInitFailed`,
//! `CudaDeviceBusy`, `CudaLaunchFailed`, `CudaResultMismatch`.
//!
//! # Files
//!
//! - this file: the check itself ([`CudaCheck`]): the probe thread, its schedule
//!   ([`reprobe_after`]) and the cached results between probes;
//! - [`ptx`]: the probe kernel's PTX text and the ISA version a CUDA runtime and an
//!   architecture need;
//! - [`library`]: `libcuda` found and its symbols checked before cudarc may touch it;
//! - [`probe`]: the driver-API probe of every device (init, context, module, launch, compare);
//! - [`verdict`]: a probe's outcome against the plan, one result per device.

pub mod library;
pub mod probe;
pub mod ptx;
pub mod verdict;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use parking_lot::{Condvar, Mutex};

use super::{Check, ChecksConfig};

use probe::probe;
use ptx::{parse_cuda_version, ptx_isa_for_cuda};
use verdict::evaluate;

/// Check name.
pub const NAME: &str = "cuda";

/// The library searched for when no path is configured (cudarc's candidates include it).
pub const DEFAULT_CUDA_LIBRARY: &str = "libcuda.so.1";

#[derive(Debug, Default)]
struct Cache {
    /// `(finished at, plan key, results)`.
    last: Option<(Instant, String, Vec<CheckResult>)>,
    /// A probe thread is running: `(started at, plan key)`.
    running: Option<(Instant, String)>,
    /// Probes in a row whose results were not all `Ok`.
    failures: u32,
}

/// How long the last results stand before the next probe: `interval` after a clean probe;
/// after `failures` (≥ 1) failed probes in a row `retry · 2^(failures-1)`, at most `interval`.
pub fn reprobe_after(interval: Duration, retry: Duration, failures: u32) -> Duration {
    if failures == 0 {
        return interval;
    }
    let factor = 1u32
        .checked_shl(failures.saturating_sub(1).min(20))
        .unwrap_or(u32::MAX);
    retry.saturating_mul(factor).min(interval)
}

#[derive(Debug, Default)]
struct Shared {
    cache: Mutex<Cache>,
    done: Condvar,
}

/// The `cuda` check.
#[derive(Debug)]
pub struct CudaCheck {
    library: Option<PathBuf>,
    interval: Duration,
    retry: Duration,
    timeout: Duration,
    shared: Arc<Shared>,
}

impl CudaCheck {
    /// Reads `cfg.cuda_library`, `cfg.cuda_interval`, `cfg.cuda_failure_retry` and
    /// `cfg.cuda_timeout`.
    pub fn new(cfg: &ChecksConfig) -> Self {
        CudaCheck {
            library: cfg.cuda_library.clone(),
            interval: cfg.cuda_interval,
            retry: cfg.cuda_failure_retry,
            timeout: cfg.cuda_timeout,
            shared: Arc::new(Shared::default()),
        }
    }

    fn library_label(&self) -> String {
        self.library
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| DEFAULT_CUDA_LIBRARY.to_string())
    }

    fn spawn(&self, key: String, gpu_node: bool, required: Option<String>) -> bool {
        let shared = self.shared.clone();
        let library = self.library.clone();
        let label = self.library_label();
        let ptx = required
            .as_deref()
            .and_then(parse_cuda_version)
            .map(|(a, b)| ptx_isa_for_cuda(a, b));
        std::thread::Builder::new()
            .name("ic-cuda-probe".into())
            .spawn(move || {
                let p = probe(library.as_deref(), ptx);
                let results = evaluate(&p, gpu_node, &label, required.as_deref());
                let mut c = shared.cache.lock();
                if results.iter().all(|r| r.status == CheckStatus::Ok) {
                    c.failures = 0;
                } else {
                    c.failures = c.failures.saturating_add(1);
                }
                c.last = Some((Instant::now(), key, results));
                c.running = None;
                shared.done.notify_all();
            })
            .is_ok()
    }
}

impl Check for CudaCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&self, plan: &NodePlan) -> Vec<CheckResult> {
        let required = plan
            .cuda
            .as_ref()
            .and_then(|c| c.runtime_version.clone())
            .filter(|s| !s.trim().is_empty());
        let key = format!("{}|{}", plan.gpu_node, required.as_deref().unwrap_or(""));
        let mut c = self.shared.cache.lock();
        let due = reprobe_after(self.interval, self.retry, c.failures);
        let fresh = matches!(&c.last, Some((at, k, _)) if *k == key && at.elapsed() < due);
        if fresh {
            if let Some((at, _, r)) = &c.last {
                return with_age(r, at.elapsed());
            }
        }
        let unavailable = || {
            vec![CheckResult::new(
                NAME,
                "host",
                CheckStatus::Unknown,
                "CudaUnavailable",
                "cannot start the CUDA probe thread; CUDA was not checked.".to_string(),
            )
            .with("cause", "ThreadFailed")]
        };
        if c.running.is_none() {
            if !self.spawn(key.clone(), plan.gpu_node, required.clone()) {
                return unavailable();
            }
            c.running = Some((Instant::now(), key.clone()));
        }
        // Stale results for the same plan: return them while the refresh runs — but not once
        // the refresh is past its timeout: a re-probe stuck in the driver is the wedged driver
        // this check exists for, whatever the last probe said.
        let overdue = c
            .running
            .as_ref()
            .is_some_and(|(started, _)| started.elapsed() >= self.timeout);
        if !overdue {
            if let Some((at, k, r)) = &c.last {
                if *k == key {
                    return with_age(r, at.elapsed());
                }
            }
        }
        // No result for this plan yet: wait for one, but never longer than the running probe's
        // timeout (a wedged driver must not hold every pass for the full timeout).
        if !overdue {
            loop {
                if let Some((at, k, r)) = &c.last {
                    if *k == key {
                        return with_age(r, at.elapsed());
                    }
                }
                let started = match &c.running {
                    Some((started, _)) => *started,
                    None => {
                        // a probe for another plan finished: probe this one
                        if !self.spawn(key.clone(), plan.gpu_node, required.clone()) {
                            return unavailable();
                        }
                        let now = Instant::now();
                        c.running = Some((now, key.clone()));
                        now
                    }
                };
                let deadline = started + self.timeout;
                if Instant::now() >= deadline
                    || self.shared.done.wait_until(&mut c, deadline).timed_out()
                {
                    break;
                }
            }
        }
        let status = if plan.gpu_node {
            CheckStatus::Critical
        } else {
            CheckStatus::Unknown
        };
        vec![CheckResult::new(
            NAME,
            "host",
            status,
            "CudaInitFailed",
            format!(
                "the CUDA probe did not finish within {} s; the driver may be wedged (engines \
                 starting now would hang too). Check dmesg for XIDs.",
                self.timeout.as_secs()
            ),
        )
        .with("library", self.library_label())
        .with("stage", "timeout")]
    }
}

fn with_age(results: &[CheckResult], age: Duration) -> Vec<CheckResult> {
    results
        .iter()
        .cloned()
        .map(|r| r.with("probeAgeSeconds", age.as_secs()))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_probe_is_repeated_sooner_with_back_off() {
        let (i, r) = (Duration::from_secs(600), Duration::from_secs(15));
        let after: Vec<u64> = (0..8).map(|f| reprobe_after(i, r, f).as_secs()).collect();
        assert_eq!(after, vec![600, 15, 30, 60, 120, 240, 480, 600]);
        assert_eq!(reprobe_after(i, r, u32::MAX), i);
        // a retry longer than the interval never delays the regular re-probe
        assert_eq!(reprobe_after(Duration::from_secs(5), r, 1).as_secs(), 5);
    }
}
