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

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;
use parking_lot::{Condvar, Mutex};

use super::{Check, ChecksConfig};

/// Check name.
pub const NAME: &str = "cuda";

/// The library searched for when no path is configured (cudarc's candidates include it).
pub const DEFAULT_CUDA_LIBRARY: &str = "libcuda.so.1";

/// Reason (`Ok`, subject `host`) on a node whose plan says `gpuNode: false` when there is no
/// libcuda (`cause` `LibraryNotFound`) or no CUDA device (`NoDevice`): what a CPU node looks
/// like (`docs/checks.md`).
pub const CUDA_NOT_EXPECTED: &str = "CudaNotExpected";

/// [`CudaProbe::Unavailable`] causes that on a node planned without GPUs mean "no CUDA here",
/// not "cannot tell".
pub const EXPECTED_ON_CPU_NODES: [&str; 2] = ["LibraryNotFound", "NoDevice"];

/// Entry point of the probe kernel.
pub const KERNEL_NAME: &str = "ic_probe";
/// Elements the probe kernel writes.
pub const PROBE_ELEMENTS: u32 = 256;
/// Threads per block of the probe launch.
const BLOCK: u32 = 128;

/// Symbols the probe calls; a library without one of them is not a usable libcuda (cudarc
/// would panic on first use).
pub const REQUIRED_SYMBOLS: [&str; 18] = [
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuLaunchKernel",
    "cuCtxSynchronize",
    "cuMemcpyDtoH_v2",
];

/// The value the probe kernel writes at index `i`.
pub fn expected_value(i: u32) -> u32 {
    i.wrapping_mul(3).wrapping_add(7)
}

/// PTX ISA version that ships with a CUDA toolkit `major.minor` (NVIDIA's PTX ISA release
/// history); newer toolkits than the table map to its newest entry, older to PTX 6.0.
pub fn ptx_isa_for_cuda(major: u32, minor: u32) -> (u32, u32) {
    const TABLE: [((u32, u32), (u32, u32)); 22] = [
        ((9, 0), (6, 0)),
        ((9, 1), (6, 1)),
        ((9, 2), (6, 2)),
        ((10, 0), (6, 3)),
        ((10, 1), (6, 4)),
        ((10, 2), (6, 5)),
        ((11, 0), (7, 0)),
        ((11, 1), (7, 1)),
        ((11, 2), (7, 2)),
        ((11, 3), (7, 3)),
        ((11, 4), (7, 4)),
        ((11, 5), (7, 5)),
        ((11, 6), (7, 6)),
        ((11, 7), (7, 7)),
        ((11, 8), (7, 8)),
        ((12, 0), (8, 0)),
        ((12, 1), (8, 1)),
        ((12, 2), (8, 2)),
        ((12, 3), (8, 3)),
        ((12, 4), (8, 4)),
        ((12, 5), (8, 5)),
        ((12, 6), (8, 5)),
    ];
    const LATER: [((u32, u32), (u32, u32)); 4] = [
        ((12, 7), (8, 6)),
        ((12, 8), (8, 7)),
        ((12, 9), (8, 8)),
        ((13, 0), (9, 0)),
    ];
    let v = (major, minor);
    let mut best = (6, 0);
    for (cuda, ptx) in TABLE.iter().chain(LATER.iter()) {
        if *cuda <= v {
            best = *ptx;
        }
    }
    best
}

/// `(target sm, minimum PTX ISA version)` for a device of compute capability `cc` (`90` for
/// 9.0): the device's own architecture up to `sm_90`, and `sm_90` for anything newer (PTX is
/// forward compatible, so a Blackwell GPU JIT-compiles it).
pub fn ptx_target(cc: u32) -> (u32, (u32, u32)) {
    let target = cc.clamp(50, 90);
    let min = match target {
        ..=70 => (6, 0),
        71..=72 => (6, 1),
        73..=75 => (6, 3),
        76..=80 => (7, 0),
        81..=86 => (7, 1),
        87 => (7, 4),
        _ => (7, 8),
    };
    (target, min)
}

/// Parses a CUDA version `major.minor` (`12.8`, `12.8.1`); `None` otherwise.
pub fn parse_cuda_version(s: &str) -> Option<(u32, u32)> {
    let mut it = s.trim().split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next().unwrap_or("0").parse().ok()?;
    Some((major, minor))
}

/// `cuDriverGetVersion`'s integer (`12080`) as `12.8`.
pub fn format_driver_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The probe kernel: `out[i] = 3·i + 7` for `i < n`, at PTX ISA `version`, for `sm_<target>`.
pub fn probe_ptx(version: (u32, u32), target: u32) -> String {
    format!(
        "//\n// inference-cache agent CUDA probe\n//\n\
         .version {}.{}\n.target sm_{target}\n.address_size 64\n\n\
         .visible .entry {KERNEL_NAME}(\n\
         \t.param .u64 {KERNEL_NAME}_param_0,\n\
         \t.param .u32 {KERNEL_NAME}_param_1\n)\n{{\n\
         \t.reg .pred \t%p<2>;\n\
         \t.reg .b32 \t%r<7>;\n\
         \t.reg .b64 \t%rd<5>;\n\n\
         \tld.param.u64 \t%rd1, [{KERNEL_NAME}_param_0];\n\
         \tld.param.u32 \t%r2, [{KERNEL_NAME}_param_1];\n\
         \tmov.u32 \t%r3, %ctaid.x;\n\
         \tmov.u32 \t%r4, %ntid.x;\n\
         \tmov.u32 \t%r5, %tid.x;\n\
         \tmad.lo.s32 \t%r1, %r3, %r4, %r5;\n\
         \tsetp.ge.u32 \t%p1, %r1, %r2;\n\
         \t@%p1 bra \tLBB0_2;\n\n\
         \tcvta.to.global.u64 \t%rd2, %rd1;\n\
         \tmul.wide.u32 \t%rd3, %r1, 4;\n\
         \tadd.s64 \t%rd4, %rd2, %rd3;\n\
         \tmad.lo.s32 \t%r6, %r1, 3, 7;\n\
         \tst.global.u32 \t[%rd4], %r6;\n\n\
         LBB0_2:\n\
         \tret;\n\n}}\n",
        version.0, version.1
    )
}

/// What went wrong for one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFailure {
    /// Stage: `device`, `context`, `module`, `alloc`, `launch`, `sync`, `copy`.
    pub stage: &'static str,
    /// `CUresult` name, e.g. `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`.
    pub error: String,
    /// `CUresult` value.
    pub code: u32,
}

/// One device's probe.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceProbe {
    /// CUDA ordinal.
    pub ordinal: i32,
    /// `cuDeviceGetName`.
    pub name: Option<String>,
    /// `GPU-…` UUID from `cuDeviceGetUuid`.
    pub uuid: Option<String>,
    /// Compute capability `major·10 + minor`.
    pub compute_capability: Option<u32>,
    /// PTX ISA version loaded.
    pub ptx_version: Option<(u32, u32)>,
    /// PTX target loaded (`90` for sm_90).
    pub ptx_target: Option<u32>,
    /// Elements that differed from [`expected_value`] (`None`: the kernel did not run).
    pub mismatches: Option<u32>,
    /// First differing element: `(index, got)`.
    pub first_mismatch: Option<(u32, u32)>,
    /// Failure, if any.
    pub failure: Option<CudaFailure>,
    /// Wall time of the device's probe.
    pub elapsed: Duration,
}

/// The whole probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaProbe {
    /// libcuda cannot be used: `(cause, explanation)`; cause is `LibraryNotFound`,
    /// `NotLibcuda`, `LibraryMismatch`, `Panicked`, `NoDevice`.
    Unavailable(&'static str, String),
    /// `cuInit` or `cuDeviceGetCount` failed.
    InitFailed(CudaFailure),
    /// The driver works; per-device results.
    Devices {
        /// `cuDriverGetVersion` (`12080`).
        driver_version: i32,
        /// One entry per CUDA device.
        devices: Vec<DeviceProbe>,
    },
}

fn failure(stage: &'static str, e: DriverError) -> CudaFailure {
    CudaFailure {
        stage,
        error: format!("{:?}", e.0),
        code: e.0 as u32,
    }
}

/// Libraries loaded by path, kept for the life of the process (cudarc may have bound to them).
fn preloaded() -> &'static Mutex<HashMap<PathBuf, libloading::Library>> {
    static LIBS: OnceLock<Mutex<HashMap<PathBuf, libloading::Library>>> = OnceLock::new();
    LIBS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn symbol_addr(lib: &libloading::Library, name: &str) -> Option<usize> {
    // SAFETY: the symbol is only looked up (its address read), never called through this type.
    unsafe { lib.get::<*const c_void>(name) }
        .ok()
        .map(|s| *s as usize)
}

/// Makes sure cudarc can bind a usable libcuda without panicking: `library` (a path) is
/// loaded by path first and must be what cudarc then binds; without a path cudarc's own search
/// must succeed. Every [`REQUIRED_SYMBOLS`] must resolve.
fn ensure_library(library: Option<&Path>) -> Result<(), (&'static str, String)> {
    let ours = match library {
        Some(path) => {
            let mut libs = preloaded().lock();
            if !libs.contains_key(path) {
                // SAFETY: loading a shared library runs its initialisers; the configured path
                // is the operator's (or the test's) choice of libcuda.
                let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
                    (
                        "LibraryNotFound",
                        format!(
                            "the CUDA driver library {} could not be loaded ({e})",
                            path.display()
                        ),
                    )
                })?;
                libs.insert(path.to_path_buf(), lib);
            }
            libs.get(path).and_then(|l| symbol_addr(l, "cuInit"))
        }
        None => None,
    };
    // SAFETY: `is_culib_present` only dlopens cudarc's candidate names (and closes them).
    if !unsafe { sys::is_culib_present() } {
        let why = match library {
            Some(path) => format!(
                "{} loaded, but cudarc finds no libcuda by name (its SONAME is not one of \
                 libcuda.so, libcuda.so.1, …)",
                path.display()
            ),
            None => format!(
                "the CUDA driver library ({DEFAULT_CUDA_LIBRARY}) is not on the loader path; \
                 the NVIDIA driver's user-space libraries are not installed or not mounted into \
                 the agent"
            ),
        };
        return Err(("LibraryNotFound", why));
    }
    // SAFETY: a candidate is present (checked just above), so `culib` loads it instead of
    // panicking; the library is cudarc's process-wide one.
    let bound = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        .filter(|s| symbol_addr(bound, s).is_none())
        .collect();
    if !missing.is_empty() {
        return Err((
            "NotLibcuda",
            format!(
                "the library cudarc loaded is not a usable CUDA driver (missing {})",
                missing.join(", ")
            ),
        ));
    }
    if let (Some(path), Some(ours)) = (library, ours) {
        if symbol_addr(bound, "cuInit") != Some(ours) {
            return Err((
                "LibraryMismatch",
                format!(
                    "cudarc bound another libcuda than the configured {} (one found earlier on \
                     the loader path); remove it or point the agent at that one",
                    path.display()
                ),
            ));
        }
    }
    Ok(())
}

fn uuid_string(u: &sys::CUuuid) -> String {
    let b: Vec<u8> = u.bytes.iter().map(|c| *c as u8).collect();
    let h = hex::encode(b);
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Probes one device; the context is released whatever happens.
fn probe_device(ordinal: i32, required_ptx: Option<(u32, u32)>) -> DeviceProbe {
    let started = Instant::now();
    let mut p = DeviceProbe {
        ordinal,
        ..DeviceProbe::default()
    };
    let dev = match cu::device::get(ordinal) {
        Ok(d) => d,
        Err(e) => {
            p.failure = Some(failure("device", e));
            p.elapsed = started.elapsed();
            return p;
        }
    };
    p.name = cu::device::get_name(dev).ok();
    p.uuid = cu::device::get_uuid(dev).ok().map(|u| uuid_string(&u));
    let attr = |a| {
        // SAFETY: `dev` came from `cuDeviceGet`; the attribute is a plain integer query.
        unsafe { cu::device::get_attribute(dev, a) }.ok()
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    let cc = match (major, minor) {
        (Some(ma), Some(mi)) => u32::try_from(ma * 10 + mi).ok(),
        _ => None,
    };
    p.compute_capability = cc;
    let (target, min) = ptx_target(cc.unwrap_or(50));
    let version = required_ptx.map_or(min, |r| r.max(min));
    p.ptx_target = Some(target);
    p.ptx_version = Some(version);

    // SAFETY: `dev` came from `cuDeviceGet`.
    let ctx = match unsafe { cu::primary_ctx::retain(dev) } {
        Ok(c) => c,
        Err(e) => {
            p.failure = Some(failure("context", e));
            p.elapsed = started.elapsed();
            return p;
        }
    };
    // SAFETY: `ctx` is the device's primary context, retained just above.
    let r = match unsafe { cu::ctx::set_current(ctx) } {
        Ok(()) => run_kernel(&mut p, version, target),
        Err(e) => Err(failure("context", e)),
    };
    if let Err(f) = r {
        p.failure = Some(f);
    }
    // SAFETY: unbinding (null) then releasing the primary context retained above, once.
    unsafe {
        let _ = cu::ctx::set_current(std::ptr::null_mut());
        let _ = cu::primary_ctx::release(dev);
    }
    p.elapsed = started.elapsed();
    p
}

/// Loads, launches and checks the kernel in the current context.
fn run_kernel(p: &mut DeviceProbe, version: (u32, u32), target: u32) -> Result<(), CudaFailure> {
    let ptx = CString::new(probe_ptx(version, target)).map_err(|_| CudaFailure {
        stage: "module",
        error: "PTX contains a NUL byte".into(),
        code: 0,
    })?;
    // SAFETY: `ptx` is a NUL-terminated PTX image that outlives the call.
    let module =
        unsafe { cu::module::load_data(ptx.as_ptr().cast()) }.map_err(|e| failure("module", e))?;
    let result = (|| {
        let name = CString::new(KERNEL_NAME).map_err(|_| CudaFailure {
            stage: "module",
            error: "kernel name contains a NUL byte".into(),
            code: 0,
        })?;
        // SAFETY: `module` was loaded above and is unloaded only after this closure.
        let func =
            unsafe { cu::module::get_function(module, name) }.map_err(|e| failure("module", e))?;
        let bytes = PROBE_ELEMENTS as usize * std::mem::size_of::<u32>();
        // SAFETY: a plain device allocation in the current context, freed below.
        let dptr = unsafe { cu::malloc_sync(bytes) }.map_err(|e| failure("alloc", e))?;
        let run = (|| {
            let mut out_arg: sys::CUdeviceptr = dptr;
            let mut n_arg: c_uint = PROBE_ELEMENTS;
            let mut params: [*mut c_void; 2] = [
                (&mut out_arg as *mut sys::CUdeviceptr).cast(),
                (&mut n_arg as *mut c_uint).cast(),
            ];
            let grid = PROBE_ELEMENTS.div_ceil(BLOCK);
            // SAFETY: `func` takes (u64 out, u32 n) as the PTX declares; `params` points at
            // locals of those types that live until the synchronize below; the output buffer
            // holds PROBE_ELEMENTS u32.
            unsafe {
                cu::launch_kernel(
                    func,
                    (grid, 1, 1),
                    (BLOCK, 1, 1),
                    0,
                    std::ptr::null_mut(),
                    &mut params,
                )
            }
            .map_err(|e| failure("launch", e))?;
            cu::ctx::synchronize().map_err(|e| failure("sync", e))?;
            let mut host = vec![0u32; PROBE_ELEMENTS as usize];
            // SAFETY: `dptr` holds PROBE_ELEMENTS u32 written by the finished kernel.
            unsafe { cu::memcpy_dtoh_sync(&mut host, dptr) }.map_err(|e| failure("copy", e))?;
            let bad: Vec<(u32, u32)> = host
                .iter()
                .enumerate()
                .filter_map(|(i, v)| {
                    let i = u32::try_from(i).unwrap_or(u32::MAX);
                    (*v != expected_value(i)).then_some((i, *v))
                })
                .collect();
            p.mismatches = Some(u32::try_from(bad.len()).unwrap_or(u32::MAX));
            p.first_mismatch = bad.first().copied();
            Ok(())
        })();
        // SAFETY: `dptr` was allocated above and is freed once, after the kernel finished (or
        // failed to launch).
        let _ = unsafe { cu::free_sync(dptr) };
        run
    })();
    // SAFETY: `module` was loaded above and nothing of it is used afterwards.
    let _ = unsafe { cu::module::unload(module) };
    result
}

/// Runs the whole probe on the calling thread (see the module docs). Never panics: a panic
/// inside cudarc becomes `Unavailable("Panicked", …)`.
pub fn probe(library: Option<&Path>, required_ptx: Option<(u32, u32)>) -> CudaProbe {
    match catch_unwind(AssertUnwindSafe(|| probe_inner(library, required_ptx))) {
        Ok(p) => p,
        Err(payload) => {
            let why = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            CudaProbe::Unavailable("Panicked", format!("the CUDA bindings panicked: {why}"))
        }
    }
}

fn probe_inner(library: Option<&Path>, required_ptx: Option<(u32, u32)>) -> CudaProbe {
    if let Err((cause, why)) = ensure_library(library) {
        return CudaProbe::Unavailable(cause, why);
    }
    if let Err(e) = cu::init() {
        if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            return CudaProbe::Unavailable(
                "NoDevice",
                "cuInit reports no CUDA device (CUDA_ERROR_NO_DEVICE)".into(),
            );
        }
        return CudaProbe::InitFailed(failure("init", e));
    }
    let mut driver_version: c_int = 0;
    // SAFETY: a valid out-pointer to a local.
    if let Err(e) = unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result() {
        return CudaProbe::InitFailed(failure("init", e));
    }
    let count = match cu::device::get_count() {
        Ok(c) => c,
        Err(e) => return CudaProbe::InitFailed(failure("init", e)),
    };
    if count == 0 {
        return CudaProbe::Unavailable("NoDevice", "cuDeviceGetCount reports 0 devices".into());
    }
    CudaProbe::Devices {
        driver_version,
        devices: (0..count).map(|o| probe_device(o, required_ptx)).collect(),
    }
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

    #[test]
    fn ptx_versions() {
        assert_eq!(ptx_isa_for_cuda(12, 8), (8, 7));
        assert_eq!(ptx_isa_for_cuda(12, 4), (8, 4));
        assert_eq!(ptx_isa_for_cuda(12, 6), (8, 5));
        assert_eq!(ptx_isa_for_cuda(11, 8), (7, 8));
        assert_eq!(ptx_isa_for_cuda(13, 0), (9, 0));
        assert_eq!(
            ptx_isa_for_cuda(14, 2),
            (9, 0),
            "newer than the table: its newest"
        );
        assert_eq!(ptx_isa_for_cuda(8, 0), (6, 0));
        assert_eq!(ptx_target(90), (90, (7, 8)));
        assert_eq!(ptx_target(100), (90, (7, 8)));
        assert_eq!(ptx_target(80), (80, (7, 0)));
        assert_eq!(ptx_target(86), (86, (7, 1)));
        assert_eq!(ptx_target(70), (70, (6, 0)));
        assert_eq!(ptx_target(35), (50, (6, 0)));
        assert_eq!(parse_cuda_version("12.8"), Some((12, 8)));
        assert_eq!(parse_cuda_version("12.8.1"), Some((12, 8)));
        assert_eq!(parse_cuda_version("13"), Some((13, 0)));
        assert_eq!(parse_cuda_version("x"), None);
        assert_eq!(format_driver_version(12080), "12.8");
        assert_eq!(format_driver_version(13000), "13.0");
    }

    #[test]
    fn ptx_text() {
        let p = probe_ptx((8, 7), 90);
        assert!(
            p.contains(".version 8.7\n.target sm_90\n.address_size 64\n"),
            "{p}"
        );
        assert!(p.contains(".visible .entry ic_probe("));
        assert!(p.contains("mad.lo.s32 \t%r6, %r1, 3, 7;"));
        assert_eq!(expected_value(0), 7);
        assert_eq!(expected_value(255), 772);
    }

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

    #[test]
    fn missing_library_by_path_never_reaches_cudarc() {
        let p = probe(Some(Path::new("/nonexistent/libcuda.so.1")), None);
        match p {
            CudaProbe::Unavailable(cause, why) => {
                assert_eq!(cause, "LibraryNotFound");
                assert!(why.contains("/nonexistent/libcuda.so.1"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }
}
