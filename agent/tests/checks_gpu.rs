//! `gpu` check: NVML absent on this host (the real loader path), bogus libraries, and a small
//! fake NVML compiled here with `cc` to drive the per-device path without a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use ic_agent::checks::gpu::GpuCheck;
use ic_agent::checks::{Check, Checks, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;

fn gpu_results(cfg: &ChecksConfig, gpu_node: bool) -> Vec<CheckResult> {
    let plan = NodePlan {
        gpu_node,
        ..NodePlan::default()
    };
    GpuCheck::new(cfg).run(&plan)
}

fn with_library(path: &Path) -> ChecksConfig {
    ChecksConfig {
        nvml_library: Some(path.to_path_buf()),
        ..ChecksConfig::default()
    }
}

/// True when this host can load the real NVML (a GPU machine): the "absent" tests then
/// have nothing to test.
fn host_has_nvml() -> bool {
    let r = gpu_results(&ChecksConfig::default(), false);
    !(r.len() == 1 && r[0].reason == "NvmlUnavailable")
}

#[test]
fn default_registry_reports_nvml_unavailable_on_a_host_without_it() {
    if host_has_nvml() {
        eprintln!("skipped: this host loads libnvidia-ml.so.1 (a GPU host)");
        return;
    }
    let results = Checks::new(&ChecksConfig::default()).run_all(&NodePlan::default());
    let gpu: Vec<_> = results.iter().filter(|r| r.name == "gpu").collect();
    assert_eq!(gpu.len(), 1, "{results:#?}");
    let g = gpu[0];
    assert_eq!(g.subject, "host");
    assert_eq!(g.status, CheckStatus::Unknown);
    assert_eq!(g.reason, "NvmlUnavailable");
    assert!(
        g.message.contains("libnvidia-ml.so.1") && g.message.contains("could not be loaded"),
        "{}",
        g.message
    );
    assert_eq!(g.observed["cause"], "LibraryNotFound");
    assert_eq!(g.observed["library"], "libnvidia-ml.so.1");
    // the other checks ran too
    assert!(results.iter().any(|r| r.name == "shm"));
    assert!(results.iter().any(|r| r.name == "ports"));

    let on_gpu_node = Checks::new(&ChecksConfig::default()).run_all(&NodePlan {
        gpu_node: true,
        ..NodePlan::default()
    });
    let g = on_gpu_node
        .iter()
        .find(|r| r.name == "gpu")
        .expect("gpu result");
    assert_eq!(
        (g.status, g.reason.as_str()),
        (CheckStatus::Warning, "NvmlUnavailable")
    );
    assert!(g.message.contains("expects GPUs"), "{}", g.message);
}

#[test]
fn bogus_libraries_give_nvml_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let not_elf = dir.path().join("libnvidia-ml.so.1");
    std::fs::write(&not_elf, "not a library").unwrap();
    for (lib, cause) in [
        (
            PathBuf::from("/nonexistent/libnvidia-ml.so.1"),
            "LibraryNotFound",
        ),
        (not_elf, "LibraryNotFound"),
    ] {
        for gpu_node in [false, true] {
            let r = gpu_results(&with_library(&lib), gpu_node);
            assert_eq!(r.len(), 1, "{r:#?}");
            let want = if gpu_node {
                CheckStatus::Warning
            } else {
                CheckStatus::Unknown
            };
            assert_eq!(
                (r[0].status, r[0].reason.as_str()),
                (want, "NvmlUnavailable")
            );
            assert_eq!(r[0].observed["cause"], cause, "{:?}", r[0]);
            assert!(
                r[0].message.contains(&lib.display().to_string()),
                "{}",
                r[0].message
            );
        }
    }
}

// ---- a fake NVML ---------------------------------------------------------------------------

const FAKE_NVML_C: &str = r#"
#include <stdio.h>
#include <string.h>
#ifndef FAKE_INIT_RC
#define FAKE_INIT_RC 0
#endif
#ifndef FAKE_COUNT
#define FAKE_COUNT 2
#endif
#ifndef FAKE_LOST_INDEX
#define FAKE_LOST_INDEX -1
#endif
#ifndef FAKE_DBE
#define FAKE_DBE 0
#endif
#ifndef FAKE_THROTTLE
#define FAKE_THROTTLE 0x1
#endif
#ifndef FAKE_TEMP
#define FAKE_TEMP 41
#endif
#ifndef FAKE_PAGES_RC
#define FAKE_PAGES_RC 3 /* NVML_ERROR_NOT_SUPPORTED, as on Hopper */
#endif
#ifndef FAKE_PAGES_PENDING
#define FAKE_PAGES_PENDING 0
#endif
#ifndef FAKE_ROW_PENDING
#define FAKE_ROW_PENDING 0
#endif
#ifndef FAKE_ROW_FAILURE
#define FAKE_ROW_FAILURE 0
#endif
typedef int nvmlReturn_t;
struct fake_dev { unsigned idx; };
typedef struct fake_dev *nvmlDevice_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
static struct fake_dev devs[16];

nvmlReturn_t nvmlInit_v2(void) { return FAKE_INIT_RC; }
nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return FAKE_INIT_RC; }
nvmlReturn_t nvmlShutdown(void) { return 0; }
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned n) { snprintf(v, n, "550.54.15"); return 0; }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 12040; return 0; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *c) { *c = FAKE_COUNT; return 0; }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d) {
    if (i >= FAKE_COUNT || i >= 16) return 2;
    if ((int)i == FAKE_LOST_INDEX) return 15;
    devs[i].idx = i; *d = &devs[i]; return 0;
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *n, unsigned len) { (void)d; snprintf(n, len, "NVIDIA H200"); return 0; }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *u, unsigned len) {
    snprintf(u, len, "GPU-00000000-0000-0000-0000-00000000000%u", d->idx); return 0;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    (void)d; m->total = 143771ULL << 20; m->reserved = 0; m->used = 1ULL << 20; m->free = m->total - m->used; return 0;
}
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *t) { (void)d; (void)sensor; *t = FAKE_TEMP; return 0; }
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *c) {
    /* type 1 = uncorrected, counter 0 = volatile; only gpu0 has errors */
    *c = (type == 1 && counter == 0 && d->idx == 0) ? FAKE_DBE : 0; return 0;
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, int *s) {
    (void)d; if (FAKE_PAGES_RC) return FAKE_PAGES_RC; *s = FAKE_PAGES_PENDING; return 0;
}
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned *c, unsigned *u, unsigned *p, unsigned *f) {
    (void)d; *c = 3; *u = FAKE_ROW_FAILURE ? 1 : 0; *p = FAKE_ROW_PENDING; *f = FAKE_ROW_FAILURE; return 0;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    (void)d; *r = FAKE_THROTTLE; return 0;
}
"#;

/// Compiles the fake with `-D` overrides into its own directory; `None` (test skipped with a
/// printed reason) when no C compiler is installed.
fn fake_nvml(dir: &Path, name: &str, defines: &[&str]) -> Option<PathBuf> {
    let src = dir.join("fake_nvml.c");
    std::fs::write(&src, FAKE_NVML_C).unwrap();
    let out_dir = dir.join(name);
    std::fs::create_dir_all(&out_dir).unwrap();
    let lib = out_dir.join("libnvidia-ml.so.1");
    let mut cmd = Command::new("cc");
    cmd.args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    match cmd.status() {
        Ok(s) if s.success() => Some(lib),
        Ok(s) => panic!("cc failed ({s}) for the fake NVML"),
        Err(e) => {
            eprintln!("skipped: no C compiler to build the fake NVML ({e})");
            None
        }
    }
}

#[test]
fn fake_nvml_healthy_devices() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_nvml(dir.path(), "healthy", &[]) else {
        return;
    };
    let r = gpu_results(&with_library(&lib), true);
    assert_eq!(r.len(), 2, "{r:#?}");
    for (i, g) in r.iter().enumerate() {
        assert_eq!(g.name, "gpu");
        assert_eq!(g.subject, format!("gpu{i}"));
        assert_eq!(
            (g.status, g.reason.as_str()),
            (CheckStatus::Ok, "GpuOk"),
            "{g:?}"
        );
        assert_eq!(g.observed["name"], "NVIDIA H200");
        assert_eq!(
            g.observed["uuid"],
            format!("GPU-00000000-0000-0000-0000-00000000000{i}")
        );
        assert_eq!(g.observed["driverVersion"], "550.54.15");
        assert_eq!(g.observed["cudaDriverVersion"], "12.4");
        assert_eq!(
            g.observed["memoryTotalBytes"],
            (143771u64 << 20).to_string()
        );
        assert_eq!(g.observed["memoryUsedBytes"], (1u64 << 20).to_string());
        assert_eq!(g.observed["temperatureCelsius"], "41");
        assert_eq!(g.observed["eccDoubleBitVolatile"], "0");
        assert_eq!(g.observed["throttleReasons"], "GpuIdle");
        assert_eq!(g.observed["remappedRowsCorrectable"], "3");
        assert_eq!(g.observed["remappedRowsPending"], "false");
        // pending page retirement is unsupported on this (Hopper-like) fake: not reported
        assert!(!g.observed.contains_key("retiredPagesPending"), "{g:?}");
        assert!(!g.observed.contains_key("queryErrors"), "{g:?}");
    }
}

#[test]
fn fake_nvml_unhealthy_devices() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str, CheckStatus, &str)] = &[
        (
            "dbe",
            &["FAKE_DBE=2"],
            "gpu0",
            CheckStatus::Critical,
            "GpuEccErrors",
        ),
        (
            "thermal",
            &["FAKE_THROTTLE=0x40", "FAKE_TEMP=93"],
            "gpu1",
            CheckStatus::Warning,
            "GpuThermalThrottle",
        ),
        (
            "brake",
            &["FAKE_THROTTLE=0x80"],
            "gpu0",
            CheckStatus::Warning,
            "GpuHwSlowdown",
        ),
        (
            "pages",
            &["FAKE_PAGES_RC=0", "FAKE_PAGES_PENDING=1"],
            "gpu1",
            CheckStatus::Warning,
            "GpuRetiredPagesPending",
        ),
        (
            "rowpending",
            &["FAKE_ROW_PENDING=1"],
            "gpu0",
            CheckStatus::Warning,
            "GpuRowRemapPending",
        ),
        (
            "rowfail",
            &["FAKE_ROW_FAILURE=1"],
            "gpu0",
            CheckStatus::Critical,
            "GpuRowRemapFailure",
        ),
        (
            "lost",
            &["FAKE_LOST_INDEX=1"],
            "gpu1",
            CheckStatus::Critical,
            "GpuLost",
        ),
    ];
    for (name, defines, subject, status, reason) in cases {
        let Some(lib) = fake_nvml(dir.path(), name, defines) else {
            return;
        };
        let r = gpu_results(&with_library(&lib), true);
        assert_eq!(r.len(), 2, "{name}: {r:#?}");
        let g = r.iter().find(|g| g.subject == *subject).unwrap();
        assert_eq!(
            (g.status, g.reason.as_str()),
            (*status, *reason),
            "{name}: {g:?}"
        );
        if *name == "thermal" {
            assert!(g.message.contains("93 °C"), "{}", g.message);
        }
        if *name == "dbe" {
            assert_eq!(g.observed["eccDoubleBitVolatile"], "2");
            // only gpu0 has errors in the fake
            let other = r.iter().find(|g| g.subject == "gpu1").unwrap();
            assert_eq!(other.reason, "GpuOk");
        }
    }
}

#[test]
fn fake_nvml_init_errors_and_no_devices() {
    let dir = tempfile::tempdir().unwrap();
    // NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_NO_PERMISSION = 4
    for (name, rc, cause, needle) in [
        ("nodriver", 9, "DriverNotLoaded", "driver is not loaded"),
        ("noperm", 4, "NoPermission", "no permission"),
    ] {
        let Some(lib) = fake_nvml(dir.path(), name, &[&format!("FAKE_INIT_RC={rc}")]) else {
            return;
        };
        for gpu_node in [false, true] {
            let r = gpu_results(&with_library(&lib), gpu_node);
            assert_eq!(r.len(), 1);
            let want = if gpu_node {
                CheckStatus::Warning
            } else {
                CheckStatus::Unknown
            };
            assert_eq!(
                (r[0].status, r[0].reason.as_str()),
                (want, "NvmlUnavailable")
            );
            assert_eq!(r[0].observed["cause"], cause);
            assert!(r[0].message.contains(needle), "{}", r[0].message);
        }
    }
    let Some(lib) = fake_nvml(dir.path(), "zero", &["FAKE_COUNT=0"]) else {
        return;
    };
    let r = gpu_results(&with_library(&lib), false);
    assert_eq!(
        (r[0].subject.as_str(), r[0].status, r[0].reason.as_str()),
        ("host", CheckStatus::Ok, "NoGpus")
    );
    let r = gpu_results(&with_library(&lib), true);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Warning, "NoGpus")
    );
}

#[test]
fn a_real_library_that_is_not_nvml() {
    // libc exists on every host and has no nvmlInit_v2
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
        "/usr/lib/aarch64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.exists());
    let Some(libc) = libc else {
        eprintln!("skipped: no libc.so.6 at a known path");
        return;
    };
    let r = gpu_results(&with_library(&libc), false);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Unknown, "NvmlUnavailable")
    );
    assert_eq!(r[0].observed["cause"], "NotNvml", "{:?}", r[0]);
}
