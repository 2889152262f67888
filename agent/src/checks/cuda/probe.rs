//! The driver-API probe, per device: `cuInit`, version, device identity, primary context, module
//! load of the PTX kernel, launch, synchronise, copy back and compare ([`probe`]). Panics from
//! cudarc are caught as a last resort.

use std::ffi::{c_int, c_uint, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

use super::library::ensure_library;
use super::ptx::{expected_value, probe_ptx, ptx_target, BLOCK, KERNEL_NAME, PROBE_ELEMENTS};

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

pub(super) fn failure(stage: &'static str, e: DriverError) -> CudaFailure {
    CudaFailure {
        stage,
        error: format!("{:?}", e.0),
        code: e.0 as u32,
    }
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
