//! `libcuda` checked before cudarc touches it (cudarc panics when it cannot find the library or a
//! symbol): a configured path `dlopen`ed and kept loaded, the default search tested, and every
//! symbol the probe calls looked up.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::DEFAULT_CUDA_LIBRARY;

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
pub(super) fn ensure_library(library: Option<&Path>) -> Result<(), (&'static str, String)> {
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::probe::probe;
    use super::super::probe::CudaProbe;
    use super::*;

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
