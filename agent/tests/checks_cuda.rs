//! `cuda` check against a fake `libcuda.so` written in C and compiled here with `cc`.
//!
//! cudarc binds one libcuda per process, found by name, for the process's lifetime. Each case
//! therefore runs in a child process (this test binary again, running `cuda_child`), which
//! loads its fake by path: the fake's SONAME is `libcuda.so`, cudarc's first candidate name, so
//! cudarc's own lookup returns the already loaded fake. The fake "executes" the probe kernel on
//! the host, parses the PTX `.version` to refuse PTX newer than its driver, and logs every call
//! so that the test can see contexts, memory and modules released.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ic_agent::checks::cuda::CudaCheck;
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{CudaRequirement, NodePlan};

const CHILD_LIB: &str = "IC_TEST_CUDA_LIB";
const CHILD_PLAN: &str = "IC_TEST_CUDA_PLAN";
const CHILD_RUNS: &str = "IC_TEST_CUDA_RUNS";
const CHILD_TIMEOUT: &str = "IC_TEST_CUDA_TIMEOUT_S";
const CHILD_PAUSE: &str = "IC_TEST_CUDA_PAUSE_MS";
/// Re-probe interval of the child's check, ms (default 3 600 000).
const CHILD_INTERVAL: &str = "IC_TEST_CUDA_INTERVAL_MS";
/// A file the child creates after its first pass (the fake's `FAKE_INIT_SLEEP_FILE`).
const CHILD_WEDGE: &str = "IC_TEST_CUDA_WEDGE_AFTER_FIRST";
/// A file the child removes after its first pass (the fake's `FAKE_FAIL_FILE`).
const CHILD_HEAL: &str = "IC_TEST_CUDA_HEAL_AFTER_FIRST";
/// First re-probe delay after a failed probe, ms (default: the config's).
const CHILD_RETRY: &str = "IC_TEST_CUDA_RETRY_MS";

const FAKE_CUDA_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifndef FAKE_INIT_RC
#define FAKE_INIT_RC 0
#endif
#ifndef FAKE_COUNT
#define FAKE_COUNT 2
#endif
#ifndef FAKE_DRIVER
#define FAKE_DRIVER 12040
#endif
#ifndef FAKE_MAX_PTX
#define FAKE_MAX_PTX 84 /* PTX ISA 8.4: what a CUDA 12.4 driver JIT-compiles */
#endif
#ifndef FAKE_CTX_RC_DEV1
#define FAKE_CTX_RC_DEV1 0
#endif
#ifndef FAKE_LAUNCH_RC
#define FAKE_LAUNCH_RC 0
#endif
#ifndef FAKE_CORRUPT
#define FAKE_CORRUPT 0
#endif
#ifndef FAKE_LOG
#define FAKE_LOG ""
#endif
#ifndef FAKE_INIT_SLEEP_US
#define FAKE_INIT_SLEEP_US 0 /* a wedged driver: cuInit takes this long */
#endif
#ifndef FAKE_INIT_SLEEP_FILE
#define FAKE_INIT_SLEEP_FILE "" /* when set: cuInit sleeps only while this file exists */
#endif
#ifndef FAKE_FAIL_FILE
#define FAKE_FAIL_FILE "" /* when set: cuInit fails (CUDA_ERROR_UNKNOWN) while this file exists */
#endif
#include <unistd.h>
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;
static int ctx_token, module_token, function_token;

static void fake_log(const char *what) {
    FILE *f;
    if (!FAKE_LOG[0]) return;
    f = fopen(FAKE_LOG, "a");
    if (f) { fprintf(f, "%s\n", what); fclose(f); }
}

CUresult cuInit(unsigned flags) {
    (void)flags; fake_log("cuInit");
    if (FAKE_INIT_SLEEP_US && (!FAKE_INIT_SLEEP_FILE[0] || access(FAKE_INIT_SLEEP_FILE, F_OK) == 0))
        usleep(FAKE_INIT_SLEEP_US);
    if (FAKE_FAIL_FILE[0] && access(FAKE_FAIL_FILE, F_OK) == 0) return 999;
    return FAKE_INIT_RC;
}
CUresult cuDriverGetVersion(int *v) { *v = FAKE_DRIVER; return 0; }
CUresult cuDeviceGetCount(int *c) { *c = FAKE_COUNT; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= FAKE_COUNT) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *d = ordinal; return 0;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { snprintf(name, len, "NVIDIA H200 (fake %d)", d); return 0; }
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    int i; for (i = 0; i < 16; i++) u->bytes[i] = (char)(i == 15 ? d : 0xab); return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    (void)d;
    if (attr == 75) { *v = 9; return 0; } /* COMPUTE_CAPABILITY_MAJOR */
    if (attr == 76) { *v = 0; return 0; } /* COMPUTE_CAPABILITY_MINOR */
    return 1;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (d == 1 && FAKE_CTX_RC_DEV1) return FAKE_CTX_RC_DEV1;
    fake_log("retain"); *c = &ctx_token; return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; fake_log("release"); return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    const char *ptx = (const char *)image, *v = strstr(ptx, ".version ");
    int major = 0, minor = 0;
    if (!v || sscanf(v, ".version %d.%d", &major, &minor) != 2) return 218; /* INVALID_PTX */
    if (major * 10 + minor > FAKE_MAX_PTX) return 222;   /* UNSUPPORTED_PTX_VERSION */
    if (!strstr(ptx, ".entry ic_probe(") || !strstr(ptx, ".target sm_")) return 218;
    fake_log("load"); *m = &module_token; return 0;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    (void)m;
    if (strcmp(name, "ic_probe") != 0) return 500; /* NOT_FOUND */
    *f = &function_token; return 0;
}
CUresult cuModuleUnload(CUmodule m) { (void)m; fake_log("unload"); return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { void *m = malloc(n); if (!m) return 2; fake_log("alloc"); *p = (CUdeviceptr)(size_t)m; return 0; }
CUresult cuMemFree_v2(CUdeviceptr p) { free((void *)(size_t)p); fake_log("free"); return 0; }
#ifndef FAKE_NO_LAUNCH_SYMBOL
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                        void **extra) {
    unsigned *out, n, i;
    (void)f; (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)stream; (void)extra;
    if (FAKE_LAUNCH_RC) return FAKE_LAUNCH_RC;
    out = (unsigned *)(size_t)*(CUdeviceptr *)params[0];
    n = *(unsigned *)params[1];
    for (i = 0; i < gx * bx && i < n; i++) out[i] = i * 3 + 7;
    if (FAKE_CORRUPT) out[3] = 0;
    fake_log("launch");
    return 0;
}
#endif
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { memcpy(dst, (void *)(size_t)src, n); return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake error"; return 0; }
"#;

/// Compiles the fake into `dir/name/libcuda.so.1` (SONAME `libcuda.so`). Always `Some`:
/// without a C compiler it panics naming the setup command (a check it did not make never
/// passes).
fn fake_cuda(dir: &Path, name: &str, defines: &[&str]) -> Option<PathBuf> {
    let src = dir.join("fake_cuda.c");
    std::fs::write(&src, FAKE_CUDA_C).unwrap();
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let lib = out.join("libcuda.so.1");
    let mut cmd = Command::new("cc");
    cmd.args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so", "-o"])
        .arg(&lib)
        .arg(&src);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    match cmd.status() {
        Ok(s) if s.success() => Some(lib),
        Ok(s) => panic!("cc failed ({s}) for the fake libcuda"),
        Err(e) => panic!(
            "no C compiler (cc) to build the fake libcuda ({e}): run \
             scripts/setup.sh (./scripts/test.sh runs it first)"
        ),
    }
}

/// Not a test of its own: the child side. Runs the check `IC_TEST_CUDA_RUNS` times (default
/// 1) with the library and plan from the environment and prints each pass as one JSON line.
#[test]
fn cuda_child() {
    let Ok(lib) = std::env::var(CHILD_LIB) else {
        return;
    };
    let plan: NodePlan = serde_json::from_str(&std::env::var(CHILD_PLAN).unwrap()).unwrap();
    let runs: usize = std::env::var(CHILD_RUNS)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1);
    let timeout = std::env::var(CHILD_TIMEOUT)
        .ok()
        .and_then(|t| t.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(ChecksConfig::default().cuda_timeout);
    let pause = std::env::var(CHILD_PAUSE)
        .ok()
        .and_then(|t| t.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::ZERO);
    let interval = std::env::var(CHILD_INTERVAL)
        .ok()
        .and_then(|t| t.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(3600));
    let retry = std::env::var(CHILD_RETRY)
        .ok()
        .and_then(|t| t.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(ChecksConfig::default().cuda_failure_retry);
    let check = CudaCheck::new(&ChecksConfig {
        cuda_library: Some(PathBuf::from(lib)),
        cuda_interval: interval,
        cuda_failure_retry: retry,
        cuda_timeout: timeout,
        ..ChecksConfig::default()
    });
    for i in 0..runs {
        if i == 1 {
            if let Ok(wedge) = std::env::var(CHILD_WEDGE) {
                std::fs::write(wedge, b"").unwrap();
            }
            if let Ok(heal) = std::env::var(CHILD_HEAL) {
                std::fs::remove_file(heal).unwrap();
            }
        }
        if i > 0 {
            std::thread::sleep(pause);
        }
        let started = std::time::Instant::now();
        let r = check.run(&plan);
        println!(
            "ELAPSED {} RESULTS {}",
            started.elapsed().as_millis(),
            serde_json::to_string(&r).unwrap()
        );
    }
}

/// Runs `cuda_child` in a fresh process; returns the passes' results.
fn run_child(lib: &Path, plan: &NodePlan, runs: usize) -> Vec<Vec<CheckResult>> {
    run_child_timed(lib, plan, runs, &[])
        .into_iter()
        .map(|(_, r)| r)
        .collect()
}

/// [`run_child`] with extra environment; returns `(milliseconds the pass took, results)`.
fn run_child_timed(
    lib: &Path,
    plan: &NodePlan,
    runs: usize,
    env: &[(&str, &str)],
) -> Vec<(u64, Vec<CheckResult>)> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "cuda_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_LIB, lib)
        .env(CHILD_PLAN, serde_json::to_string(plan).unwrap())
        .env(CHILD_RUNS, runs.to_string());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let passes: Vec<(u64, Vec<CheckResult>)> = stdout
        .lines()
        .filter_map(|l| {
            let e = l.find("ELAPSED ")?;
            let r = l.find(" RESULTS ")?;
            Some((
                l[e + 8..r].parse().unwrap(),
                serde_json::from_str(&l[r + 9..]).unwrap(),
            ))
        })
        .collect();
    assert_eq!(passes.len(), runs, "{stdout}");
    for (_, pass) in &passes {
        for r in pass {
            println!("{:?} {} {}: {}", r.status, r.reason, r.subject, r.message);
        }
    }
    passes
}

fn plan(gpu_node: bool, runtime: Option<&str>) -> NodePlan {
    NodePlan {
        gpu_node,
        cuda: runtime.map(|v| CudaRequirement {
            runtime_version: Some(v.to_string()),
        }),
        ..NodePlan::default()
    }
}

fn log_counts(log: &Path) -> std::collections::HashMap<String, usize> {
    let mut m = std::collections::HashMap::new();
    for l in std::fs::read_to_string(log).unwrap_or_default().lines() {
        *m.entry(l.to_string()).or_insert(0) += 1;
    }
    m
}

#[test]
fn healthy_devices_run_the_kernel_and_release_everything() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("calls.log");
    let log_define = format!("FAKE_LOG=\"{}\"", log.display());
    let Some(lib) = fake_cuda(dir.path(), "healthy", &[&log_define]) else {
        return;
    };
    let passes = run_child(&lib, &plan(true, None), 2);
    let r = &passes[0];
    assert_eq!(r.len(), 2, "{r:#?}");
    for (i, c) in r.iter().enumerate() {
        assert_eq!(c.name, "cuda");
        assert_eq!(c.subject, format!("cuda{i}"));
        assert_eq!(
            (c.status, c.reason.as_str()),
            (CheckStatus::Ok, "CudaOk"),
            "{c:?}"
        );
        assert_eq!(c.observed["driverCudaVersion"], "12.4");
        assert_eq!(c.observed["driverVersionRaw"], "12040");
        assert_eq!(c.observed["computeCapability"], "9.0");
        assert_eq!(c.observed["ptxTarget"], "sm_90");
        assert_eq!(
            c.observed["ptxVersion"], "7.8",
            "sm_90's minimum without a plan"
        );
        assert_eq!(c.observed["mismatches"], "0");
        assert_eq!(c.observed["name"], format!("NVIDIA H200 (fake {i})"));
        assert_eq!(
            c.observed["uuid"],
            format!("GPU-abababab-abab-abab-abab-ababababab{i:02x}")
        );
        assert!(c.message.contains("supports CUDA 12.4"), "{}", c.message);
    }
    // the second pass within the interval is the cached first one
    assert_eq!(passes[1][0].reason, "CudaOk");
    assert!(passes[1][0].observed.contains_key("probeAgeSeconds"));
    let calls = log_counts(&log);
    assert_eq!(
        calls.get("cuInit"),
        Some(&1),
        "one probe for two passes: {calls:?}"
    );
    assert_eq!(calls.get("retain"), calls.get("release"), "{calls:?}");
    assert_eq!(calls.get("alloc"), calls.get("free"), "{calls:?}");
    assert_eq!(calls.get("load"), calls.get("unload"), "{calls:?}");
    assert_eq!(calls.get("launch"), Some(&2), "{calls:?}");
}

#[test]
fn driver_too_old_for_the_planned_runtime_fails_at_module_load() {
    let dir = tempfile::tempdir().unwrap();
    // a CUDA 12.4 driver (PTX 8.4) and engines built with CUDA 12.8 (PTX 8.7)
    let Some(lib) = fake_cuda(dir.path(), "old", &["FAKE_DRIVER=12040", "FAKE_MAX_PTX=84"]) else {
        return;
    };
    let r = &run_child(&lib, &plan(true, Some("12.8")), 1)[0];
    for c in r {
        assert_eq!(
            (c.status, c.reason.as_str()),
            (CheckStatus::Critical, "CudaLaunchFailed"),
            "{c:?}"
        );
        assert_eq!(
            c.observed["cudaError"],
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
        );
        assert_eq!(c.observed["cudaErrorCode"], "222");
        assert_eq!(c.observed["stage"], "module");
        assert_eq!(c.observed["ptxVersion"], "8.7");
        assert_eq!(c.observed["requiredRuntimeVersion"], "12.8");
        assert!(
            c.message
                .contains("supports CUDA 12.4 but the plan's engines use the CUDA 12.8 runtime"),
            "{}",
            c.message
        );
    }
    // the same driver with engines built for 12.4 is fine
    let r = &run_child(&lib, &plan(true, Some("12.4")), 1)[0];
    assert!(r.iter().all(|c| c.reason == "CudaOk"), "{r:#?}");
}

#[test]
fn init_failures_and_no_devices() {
    let dir = tempfile::tempdir().unwrap();
    // user-space driver and kernel module disagree
    let Some(lib) = fake_cuda(dir.path(), "mismatch", &["FAKE_INIT_RC=803"]) else {
        return;
    };
    let r = &run_child(&lib, &plan(false, None), 1)[0];
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].subject.as_str(), r[0].status, r[0].reason.as_str()),
        ("host", CheckStatus::Critical, "CudaInitFailed")
    );
    assert_eq!(
        r[0].observed["cudaError"],
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"
    );
    // no device: Ok as expected on a node planned without GPUs, Warning where the plan
    // expects GPUs
    let Some(lib) = fake_cuda(dir.path(), "nodevice", &["FAKE_INIT_RC=100"]) else {
        return;
    };
    for (gpu_node, status, reason) in [
        (false, CheckStatus::Ok, "CudaNotExpected"),
        (true, CheckStatus::Warning, "CudaUnavailable"),
    ] {
        let r = &run_child(&lib, &plan(gpu_node, None), 1)[0];
        assert_eq!((r[0].status, r[0].reason.as_str()), (status, reason));
        assert_eq!(r[0].observed["cause"], "NoDevice");
    }
}

#[test]
fn launch_failure_wrong_results_and_a_busy_device() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str, CheckStatus, &str)] = &[
        (
            "launch",
            &["FAKE_LAUNCH_RC=719"],
            "cuda0",
            CheckStatus::Critical,
            "CudaLaunchFailed",
        ),
        (
            "corrupt",
            &["FAKE_CORRUPT=1"],
            "cuda1",
            CheckStatus::Critical,
            "CudaResultMismatch",
        ),
        (
            "busy",
            &["FAKE_CTX_RC_DEV1=46"],
            "cuda1",
            CheckStatus::Unknown,
            "CudaDeviceBusy",
        ),
    ];
    for (name, defines, subject, status, reason) in cases {
        let Some(lib) = fake_cuda(dir.path(), name, defines) else {
            return;
        };
        let r = &run_child(&lib, &plan(true, None), 1)[0];
        let c = r.iter().find(|c| c.subject == *subject).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str()),
            (*status, *reason),
            "{name}: {c:?}"
        );
        match *name {
            "launch" => assert_eq!(c.observed["cudaError"], "CUDA_ERROR_LAUNCH_FAILED"),
            "corrupt" => {
                assert_eq!(c.observed["mismatches"], "1");
                assert!(
                    c.message.contains("element 3 is 0, expected 16"),
                    "{}",
                    c.message
                );
            }
            "busy" => {
                assert_eq!(c.observed["cudaError"], "CUDA_ERROR_DEVICE_UNAVAILABLE");
                let other = r.iter().find(|c| c.subject == "cuda0").unwrap();
                assert_eq!(other.reason, "CudaOk", "the other device still works");
            }
            _ => {}
        }
    }
}

#[test]
fn a_library_without_a_needed_symbol_is_refused_before_cudarc_panics() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_cuda(dir.path(), "nolaunch", &["FAKE_NO_LAUNCH_SYMBOL"]) else {
        return;
    };
    let r = &run_child(&lib, &plan(true, None), 1)[0];
    assert_eq!(
        (r[0].subject.as_str(), r[0].status, r[0].reason.as_str()),
        ("host", CheckStatus::Warning, "CudaUnavailable")
    );
    assert_eq!(r[0].observed["cause"], "NotLibcuda");
    assert!(r[0].message.contains("cuLaunchKernel"), "{}", r[0].message);
}

#[test]
fn absent_library_is_unavailable_in_process() {
    for (gpu_node, status, reason) in [
        (false, CheckStatus::Ok, "CudaNotExpected"),
        (true, CheckStatus::Warning, "CudaUnavailable"),
    ] {
        let check = CudaCheck::new(&ChecksConfig {
            cuda_library: Some(PathBuf::from("/nonexistent/libcuda.so.1")),
            ..ChecksConfig::default()
        });
        let r = check.run(&plan(gpu_node, None));
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].status, r[0].reason.as_str()), (status, reason));
        assert_eq!(r[0].observed["cause"], "LibraryNotFound");
        assert!(
            r[0].message.contains("/nonexistent/libcuda.so.1"),
            "{}",
            r[0].message
        );
    }
    // the default search on this host (no driver here): never a panic
    let r = CudaCheck::new(&ChecksConfig::default()).run(&plan(false, None));
    if r[0].reason == "CudaNotExpected" {
        assert_eq!(r[0].status, CheckStatus::Ok);
        assert_eq!(r[0].observed["cause"], "LibraryNotFound", "{:?}", r[0]);
        assert!(r[0].message.contains("libcuda.so.1"), "{}", r[0].message);
    } else {
        eprintln!("this host has a CUDA driver: {:?}", r[0]);
    }
}

#[test]
fn a_wedged_driver_times_out_without_holding_every_pass() {
    let dir = tempfile::tempdir().unwrap();
    // cuInit takes 2.5 s; the check waits at most 1 s for a first result
    let Some(lib) = fake_cuda(dir.path(), "wedged", &["FAKE_INIT_SLEEP_US=2500000"]) else {
        return;
    };
    let passes = run_child_timed(
        &lib,
        &plan(true, None),
        3,
        &[(CHILD_TIMEOUT, "1"), (CHILD_PAUSE, "1000")],
    );
    let (t1, r1) = &passes[0];
    assert_eq!(
        (r1[0].status, r1[0].reason.as_str()),
        (CheckStatus::Critical, "CudaInitFailed")
    );
    assert_eq!(r1[0].observed["stage"], "timeout");
    assert!((900..2400).contains(t1), "first pass waited {t1} ms");
    // the same probe is still running: the next pass does not wait again
    let (t2, r2) = &passes[1];
    assert_eq!(r2[0].reason, "CudaInitFailed");
    assert!(*t2 < 500, "second pass waited {t2} ms");
    // once the driver answers, the results arrive
    let (_, r3) = &passes[2];
    assert!(r3.iter().all(|c| c.reason == "CudaOk"), "{r3:#?}");
}

#[test]
fn a_re_probe_stuck_in_the_driver_is_not_hidden_behind_the_last_good_result() {
    let dir = tempfile::tempdir().unwrap();
    let wedge = dir.path().join("wedge");
    let sleep_file = format!("FAKE_INIT_SLEEP_FILE=\"{}\"", wedge.display());
    // cuInit answers at once until `wedge` exists, then takes 4 s.
    let Some(lib) = fake_cuda(
        dir.path(),
        "rewedged",
        &["FAKE_INIT_SLEEP_US=4000000", &sleep_file],
    ) else {
        return;
    };
    let wedge_env = wedge.display().to_string();
    let passes = run_child_timed(
        &lib,
        &plan(true, None),
        3,
        &[
            (CHILD_TIMEOUT, "1"),
            (CHILD_PAUSE, "1300"),
            (CHILD_INTERVAL, "0"),
            (CHILD_WEDGE, &wedge_env),
        ],
    );
    let (_, r1) = &passes[0];
    assert!(r1.iter().all(|c| c.reason == "CudaOk"), "{r1:#?}");
    // The re-probe has just started (and hangs): the last result stands, with its age.
    let (_, r2) = &passes[1];
    assert!(r2.iter().all(|c| c.reason == "CudaOk"), "{r2:#?}");
    // Past its timeout the hanging re-probe is the verdict, not the old CudaOk.
    let (t3, r3) = &passes[2];
    assert_eq!(
        (r3[0].status, r3[0].reason.as_str()),
        (CheckStatus::Critical, "CudaInitFailed"),
        "{r3:#?}"
    );
    assert_eq!(r3[0].observed["stage"], "timeout");
    assert!(*t3 < 500, "the pass did not wait again: {t3} ms");
}

/// A CUDA failure that clears (the driver recovered) is re-probed soon — after a short,
/// doubling back-off — not only after the hour-long interval this child runs with: the node does
/// not stay Critical for the rest of the interval (issue 39 item 10).
#[test]
fn a_cleared_failure_is_re_probed_before_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let fail = dir.path().join("fail");
    std::fs::write(&fail, b"").unwrap();
    let fail_define = format!("FAKE_FAIL_FILE=\"{}\"", fail.display());
    let Some(lib) = fake_cuda(dir.path(), "recovers", &[&fail_define]) else {
        return;
    };
    let fail_env = fail.display().to_string();
    let passes = run_child(&lib, &plan(true, None), 1);
    assert_ne!(passes[0][0].status, CheckStatus::Ok, "{:#?}", passes[0]);
    std::fs::write(&fail, b"").unwrap();
    // interval 1 h (the child's default); first retry after 1 s; a pass every 1.5 s
    let passes = run_child_timed(
        &lib,
        &plan(true, None),
        4,
        &[
            (CHILD_RETRY, "1000"),
            (CHILD_PAUSE, "1500"),
            (CHILD_HEAL, &fail_env),
        ],
    );
    let (_, first) = &passes[0];
    assert_eq!(
        (first[0].status, first[0].reason.as_str()),
        (CheckStatus::Critical, "CudaInitFailed"),
        "{first:#?}"
    );
    let (_, last) = &passes[3];
    assert!(
        last.iter().all(|c| c.reason == "CudaOk"),
        "still failing 4.5 s after the driver recovered: {last:#?}"
    );
}
