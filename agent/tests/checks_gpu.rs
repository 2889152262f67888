//! `gpu` check: NVML absent on this host (the real loader path), bogus libraries, and a small
//! fake NVML compiled here with `cc` to drive the per-device path without a GPU: device state,
//! XID events through an event set (injected by appending `"<gpu> <xid> [<gi> <ci>]"` lines to a
//! file the fake reads), and MIG devices.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ic_agent::checks::gpu::GpuCheck;
use ic_agent::checks::xid::XidPolicy;
use ic_agent::checks::{Check, Checks, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::NodePlan;

#[path = "support/skip.rs"]
mod skip;

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
    let r = gpu_results(&ChecksConfig::default(), true);
    !(r.len() == 1 && r[0].reason == "NvmlUnavailable")
}

#[test]
fn default_registry_reports_nvml_unavailable_on_a_host_without_it() {
    if host_has_nvml() {
        skip::skip(
            "checks_gpu::default_registry_reports_nvml_unavailable_on_a_host_without_it",
            "this host loads libnvidia-ml.so.1 (a GPU host)",
        );
        return;
    }
    let results = Checks::new(&ChecksConfig::default()).run_all(&NodePlan::default());
    let gpu: Vec<_> = results.iter().filter(|r| r.name == "gpu").collect();
    assert_eq!(gpu.len(), 1, "{results:#?}");
    let g = gpu[0];
    assert_eq!(g.subject, "host");
    // the default plan is not a GPU node: no NVML is what such a node looks like
    assert_eq!(g.status, CheckStatus::Ok);
    assert_eq!(g.reason, "GpuNotExpected");
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
                (CheckStatus::Warning, "NvmlUnavailable")
            } else {
                (CheckStatus::Ok, "GpuNotExpected")
            };
            assert_eq!((r[0].status, r[0].reason.as_str()), want);
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
#ifndef FAKE_XID_FILE
#define FAKE_XID_FILE ""
#endif
#ifndef FAKE_EVENTS_RC
#define FAKE_EVENTS_RC 0 /* returned by nvmlDeviceRegisterEvents for gpu1 */
#endif
#ifndef FAKE_MIG
#define FAKE_MIG 0 /* gpu0 in MIG mode with two GPU instances (GI 1 and 2) */
#endif
#ifndef FAKE_GONE_FILE
#define FAKE_GONE_FILE "" /* when set: the physical GPU numbered in it is not enumerated */
#endif
#ifndef FAKE_RECOVERY_FILE
#define FAKE_RECOVERY_FILE "" /* when set: lines "<gpu> <action>" give recovery actions; unset:
                                 the field is not supported (a driver before R550) */
#endif
#include <unistd.h>
typedef int nvmlReturn_t;
struct fake_dev { unsigned idx; int is_mig; unsigned gi; unsigned phys; };
typedef struct fake_dev *nvmlDevice_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct {
    nvmlDevice_t device; unsigned long long eventType; unsigned long long eventData;
    unsigned gpuInstanceId; unsigned computeInstanceId;
} nvmlEventData_t;
static struct fake_dev devs[16];
static struct fake_dev migs[2];
static int fake_set;
static unsigned consumed;

nvmlReturn_t nvmlInit_v2(void) { return FAKE_INIT_RC; }
nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return FAKE_INIT_RC; }
nvmlReturn_t nvmlShutdown(void) { return 0; }
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned n) { snprintf(v, n, "550.54.15"); return 0; }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 12040; return 0; }
/* the physical GPU hidden from enumeration (-1: none), read from FAKE_GONE_FILE on each call */
static int gone(void) {
    int g = -1; FILE *f;
    if (!FAKE_GONE_FILE[0] || !(f = fopen(FAKE_GONE_FILE, "r"))) return -1;
    if (fscanf(f, "%d", &g) != 1) g = -1;
    fclose(f); return g;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *c) {
    int g = gone(); *c = FAKE_COUNT - (g >= 0 && g < FAKE_COUNT); return 0;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d) {
    int g = gone(); unsigned n = FAKE_COUNT - (g >= 0 && g < FAKE_COUNT);
    if (i >= n || i >= 16) return 2;
    if ((int)i == FAKE_LOST_INDEX) return 15;
    devs[i].idx = i; devs[i].phys = (g >= 0 && (int)i >= g) ? i + 1 : i; *d = &devs[i]; return 0;
}
typedef struct {
    unsigned fieldId, scopeId; long long timestamp, latencyUsec; int valueType; int nvmlReturn;
    union { double d; unsigned ui; unsigned long ul; unsigned long long ull; long long sll; int si; unsigned short us; } value;
} nvmlFieldValue_t;
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *v) {
    int k;
    for (k = 0; k < count; k++) {
        FILE *f; char line[64]; unsigned dev, action = 0;
        v[k].valueType = 1; /* NVML_VALUE_TYPE_UNSIGNED_INT */
        v[k].nvmlReturn = 3; /* NOT_SUPPORTED */
        if (v[k].fieldId != 230 || !FAKE_RECOVERY_FILE[0]) continue;
        v[k].nvmlReturn = 0; v[k].value.ui = 0;
        if (!(f = fopen(FAKE_RECOVERY_FILE, "r"))) continue;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "%u %u", &dev, &action) == 2 && dev == d->phys) v[k].value.ui = action;
        fclose(f);
    }
    return 0;
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *n, unsigned len) { (void)d; snprintf(n, len, "NVIDIA H200"); return 0; }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *u, unsigned len) {
    if (d->is_mig) snprintf(u, len, "MIG-00000000-0000-0000-0000-0000000000%02u", d->gi);
    else snprintf(u, len, "GPU-00000000-0000-0000-0000-00000000000%u", d->phys);
    return 0;
}
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *i) { *i = d->idx; return 0; }
/* events: one event set; XIDs come from the lines of FAKE_XID_FILE, each delivered once */
nvmlReturn_t nvmlEventSetCreate(void **set) { *set = &fake_set; return 0; }
nvmlReturn_t nvmlEventSetFree(void *set) { (void)set; return 0; }
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, void *set) {
    (void)types; (void)set;
    if (FAKE_EVENTS_RC && d->idx == 1) return FAKE_EVENTS_RC;
    return 0;
}
static int next_event(nvmlEventData_t *data) {
    FILE *f = fopen(FAKE_XID_FILE, "r");
    char line[128]; unsigned n = 0; int found = 0;
    if (!f) return 0;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned dev, gi = 0xFFFFFFFFu, ci = 0xFFFFFFFFu; unsigned long long xid;
        if (n++ < consumed) continue;
        consumed++;
        if (sscanf(line, "%u %llu %u %u", &dev, &xid, &gi, &ci) < 2 || dev >= FAKE_COUNT) continue;
        data->device = &devs[dev]; data->eventType = 8; /* nvmlEventTypeXidCriticalError */
        data->eventData = xid; data->gpuInstanceId = gi; data->computeInstanceId = ci;
        found = 1;
    }
    fclose(f);
    return found;
}
nvmlReturn_t nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned timeout_ms) {
    unsigned waited = 0;
    (void)set;
    for (;;) {
        if (next_event(data)) return 0;
        if (waited >= timeout_ms) return 10; /* NVML_ERROR_TIMEOUT */
        usleep(10000); waited += 10;
    }
}
/* MIG */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *cur, unsigned *pend) {
    if (!FAKE_MIG || d->is_mig) return 3;
    *cur = d->idx == 0; *pend = *cur; return 0;
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned *c) {
    if (!FAKE_MIG) return 3;
    *c = d->idx == 0 ? 2 : 0; return 0;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned i, nvmlDevice_t *m) {
    if (!FAKE_MIG || d->idx != 0 || i >= 2) return 6; /* NVML_ERROR_NOT_FOUND */
    migs[i].idx = 100 + i; migs[i].is_mig = 1; migs[i].gi = i + 1; *m = &migs[i]; return 0;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned *id) {
    if (!d->is_mig) return 3;
    *id = d->gi; return 0;
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

/// Compiles the fake with `-D` overrides into its own directory. Always `Some`: without a C
/// compiler it panics naming the setup command (a check it did not make never passes).
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
        Err(e) => panic!(
            "no C compiler (cc) to build the fake NVML ({e}): run {}",
            skip::SETUP
        ),
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
        // A health query that fails (NVML_ERROR_UNKNOWN) is not "healthy"; one that answers
        // NVML_ERROR_RESET_REQUIRED asks for a reset.
        (
            "pagesunknown",
            &["FAKE_PAGES_RC=999"],
            "gpu0",
            CheckStatus::Unknown,
            "GpuHealthUnknown",
        ),
        (
            "pagesreset",
            &["FAKE_PAGES_RC=16"],
            "gpu1",
            CheckStatus::Warning,
            "GpuResetRequired",
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
        if *name == "pagesunknown" {
            assert!(g.message.contains("retiredPages: "), "{}", g.message);
            assert!(!g.message.contains("is healthy"), "{}", g.message);
        }
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
            // no kernel driver on a node planned without GPUs is expected; no permission
            // could hide GPUs, so it stays Unknown
            let want = match (gpu_node, cause) {
                (true, _) => (CheckStatus::Warning, "NvmlUnavailable"),
                (false, "DriverNotLoaded") => (CheckStatus::Ok, "GpuNotExpected"),
                (false, _) => (CheckStatus::Unknown, "NvmlUnavailable"),
            };
            assert_eq!((r[0].status, r[0].reason.as_str()), want);
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
        skip::skip(
            "checks_gpu::a_real_library_that_is_not_nvml",
            "no libc.so.6 at a known path",
        );
        return;
    };
    let r = gpu_results(&with_library(&libc), false);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Unknown, "NvmlUnavailable")
    );
    assert_eq!(r[0].observed["cause"], "NotNvml", "{:?}", r[0]);
}

// ---- XID events ----------------------------------------------------------------------------

/// A fake NVML whose XID events come from `<dir>/<name>/xids`.
struct XidFake {
    lib: PathBuf,
    xids: PathBuf,
}

impl XidFake {
    fn build(dir: &Path, name: &str, defines: &[&str]) -> Option<Self> {
        let xids = dir.join(format!("{name}.xids"));
        std::fs::write(&xids, "").unwrap();
        let file_define = format!("FAKE_XID_FILE=\"{}\"", xids.display());
        let mut all = vec![file_define.as_str()];
        all.extend_from_slice(defines);
        let lib = fake_nvml(dir, name, &all)?;
        Some(XidFake { lib, xids })
    }

    fn inject(&self, line: &str) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.xids)
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }

    fn check(&self, policy: XidPolicy) -> GpuCheck {
        GpuCheck::new(&ChecksConfig {
            nvml_library: Some(self.lib.clone()),
            xid_policy: policy,
            ..ChecksConfig::default()
        })
    }
}

fn gpu_plan() -> NodePlan {
    NodePlan {
        gpu_node: true,
        ..NodePlan::default()
    }
}

/// Runs the check until `pred` holds for the result of `subject` (up to 60 s).
fn wait_for(
    check: &GpuCheck,
    subject: &str,
    what: &str,
    pred: impl Fn(&CheckResult) -> bool,
) -> CheckResult {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = check.run(&gpu_plan());
        let g = r.iter().find(|g| g.subject == subject).cloned().unwrap();
        if pred(&g) {
            return g;
        }
        assert!(Instant::now() < deadline, "{what}: still {g:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn quiet(secs: u64) -> XidPolicy {
    XidPolicy {
        quiet_period: Duration::from_secs(secs),
        ..XidPolicy::default()
    }
}

#[test]
fn the_fake_delivers_xids_as_nvml_wrapper_expects() {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::error::NvmlError;
    let dir = tempfile::tempdir().unwrap();
    let Some(fake) = XidFake::build(dir.path(), "wrapper", &[]) else {
        return;
    };
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(fake.lib.as_os_str())
        .init()
        .unwrap();
    let device = nvml.device_by_index(0).unwrap();
    let set = device
        .register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap(),
        )
        .unwrap();
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
    fake.inject("0 79");
    let ev = set.wait(1000).unwrap();
    assert_eq!(ev.event_data, Some(XidError::Value(79)));
    assert!(ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
    assert_eq!(ev.device.index().unwrap(), 0);
    assert!(
        matches!(set.wait(50), Err(NvmlError::Timeout)),
        "each XID once"
    );
}

#[test]
fn xid_events_under_the_default_policy_and_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fake) = XidFake::build(dir.path(), "xids", &[]) else {
        return;
    };
    let check = fake.check(quiet(2));
    let r = check.run(&gpu_plan());
    assert_eq!(r.len(), 2, "{r:#?}");
    for g in &r {
        assert_eq!(g.reason, "GpuOk", "{g:?}");
        assert_eq!(g.observed["xidEvents"], "monitored");
        assert_eq!(g.observed["xidEventsTotal"], "0");
        assert_eq!(g.observed["xidQuietPeriodSeconds"], "2");
    }

    // a fatal XID (DCGM's set): Critical, on that GPU only
    fake.inject("0 79");
    let g = wait_for(&check, "gpu0", "XID 79", |g| g.reason == "GpuXidFatal");
    assert_eq!(g.status, CheckStatus::Critical);
    assert_eq!(g.observed["lastXid"], "79");
    assert_eq!(g.observed["activeXids"], "79");
    assert!(
        g.message.contains("XID 79 (GPU has fallen off the bus)"),
        "{}",
        g.message
    );
    assert!(g.message.contains("(fatal)"), "{}", g.message);
    let other = check.run(&gpu_plan());
    assert_eq!(other[1].reason, "GpuOk");

    // an application error is counted, not judged
    fake.inject("1 13");
    let g = wait_for(&check, "gpu1", "XID 13 counted", |g| {
        g.observed["xidEventsTotal"] == "1"
    });
    assert_eq!(g.reason, "GpuOk");
    assert_eq!(g.observed["xidIgnored"], "1");
    assert_eq!(g.observed["lastXid"], "13");

    // an unlisted XID: Warning
    fake.inject("1 92");
    let g = wait_for(&check, "gpu1", "XID 92", |g| g.reason == "GpuXidError");
    assert_eq!(g.status, CheckStatus::Warning);

    // quiet for the quiet period: the GPU with a warning reads healthy again, with its
    // history; the fatal XID does not expire (only a reset or a reboot clears it)
    let g = wait_for(&check, "gpu1", "recovery", |g| g.reason == "GpuOk");
    assert_eq!(g.observed["xidEventsTotal"], "2");
    assert_eq!(g.observed["xidRecovered"], "true");
    assert_eq!(g.observed["lastXid"], "92");
    let g = check
        .run(&gpu_plan())
        .into_iter()
        .find(|g| g.subject == "gpu0")
        .unwrap();
    assert_eq!(
        (g.status, g.reason.as_str()),
        (CheckStatus::Critical, "GpuXidFatal"),
        "a fatal XID expired with the quiet period: {g:?}"
    );
    assert!(
        g.message.contains("until the GPU is reset"),
        "{}",
        g.message
    );
}

#[test]
fn explicit_enable_beats_disable_and_disable_all() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fake) = XidFake::build(dir.path(), "policy", &[]) else {
        return;
    };
    let policy = XidPolicy::configured(Some("13"), Some("13,92"), None, None).unwrap();
    let check = fake.check(policy);
    check.run(&gpu_plan());
    fake.inject("0 92");
    let g = wait_for(&check, "gpu0", "92 seen", |g| {
        g.observed["xidEventsTotal"] == "1"
    });
    assert_eq!(g.reason, "GpuOk", "92 is disabled");
    fake.inject("0 13");
    let g = wait_for(&check, "gpu0", "13 enabled", |g| g.reason == "GpuXidFatal");
    assert!(g.message.contains("(enabled)"), "{}", g.message);
    drop(check);

    let Some(fake) = XidFake::build(dir.path(), "all-off", &[]) else {
        return;
    };
    let check = fake.check(XidPolicy::configured(None, Some("all"), None, None).unwrap());
    check.run(&gpu_plan());
    fake.inject("0 79");
    let g = wait_for(&check, "gpu0", "79 seen", |g| {
        g.observed["xidEventsTotal"] == "1"
    });
    assert_eq!(g.reason, "GpuOk", "every XID disabled: {g:?}");
}

#[test]
fn mig_attribution_and_a_gpu_without_events() {
    let dir = tempfile::tempdir().unwrap();
    // gpu0 in MIG mode; gpu1 refuses event registration (NVML_ERROR_NOT_SUPPORTED)
    let Some(fake) = XidFake::build(dir.path(), "mig", &["FAKE_MIG=1", "FAKE_EVENTS_RC=3"]) else {
        return;
    };
    let check = fake.check(XidPolicy::configured(Some("43"), None, None, None).unwrap());
    let r = check.run(&gpu_plan());
    assert_eq!(r[0].observed["migMode"], "enabled");
    assert_eq!(r[0].observed["migDevices"], "2");
    assert_eq!(r[1].observed["migMode"], "disabled");
    assert_eq!(r[0].observed["xidEvents"], "monitored");
    assert!(
        r[1].observed["xidEvents"].starts_with("unavailable: "),
        "{:?}",
        r[1]
    );
    // an application XID in GPU instance 2, enabled by the operator
    fake.inject("0 43 2 0");
    let g = wait_for(&check, "gpu0", "MIG XID", |g| g.reason == "GpuXidFatal");
    assert!(
        g.message
            .contains("on MIG instance GI 2/CI 0 (MIG-00000000-0000-0000-0000-000000000002)"),
        "{}",
        g.message
    );
    assert_eq!(g.observed["lastXidGpuInstance"], "2");
    assert_eq!(g.observed["lastXidComputeInstance"], "0");
    assert_eq!(
        g.observed["lastXidMigUuid"],
        "MIG-00000000-0000-0000-0000-000000000002"
    );
}

// ---- a node planned without GPUs (issue 36 item 5) and GPU identity labels (issue 40 item 8) --

/// On a node whose plan says `gpuNode: false`, no NVML (or NVML without its kernel driver) is
/// what a CPU node looks like: Ok `GpuNotExpected`, so the node does not read Unknown for it.
/// What could hide GPUs (a library that is not NVML, no permission) stays Unknown.
#[test]
fn a_cpu_node_without_nvml_reads_ok_as_expected() {
    let r = gpu_results(
        &with_library(Path::new("/nonexistent/libnvidia-ml.so.1")),
        false,
    );
    assert_eq!(r.len(), 1, "{r:#?}");
    assert_eq!(
        (r[0].subject.as_str(), r[0].status, r[0].reason.as_str()),
        ("host", CheckStatus::Ok, "GpuNotExpected")
    );
    assert!(
        r[0].message.starts_with(
            "not a GPU node (plan gpuNode=false): NVML not loaded, as expected (the NVML \
             library /nonexistent/libnvidia-ml.so.1 could not be loaded"
        ),
        "{}",
        r[0].message
    );
    assert_eq!(r[0].observed["cause"], "LibraryNotFound");
    assert_eq!(r[0].observed["planGpuNode"], "false");

    let dir = tempfile::tempdir().unwrap();
    // NVML_ERROR_DRIVER_NOT_LOADED = 9: the user-space library without the kernel driver
    let Some(nodriver) = fake_nvml(dir.path(), "cpu-nodriver", &["FAKE_INIT_RC=9"]) else {
        return;
    };
    let r = gpu_results(&with_library(&nodriver), false);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Ok, "GpuNotExpected")
    );
    assert!(
        r[0].message
            .contains("no NVIDIA kernel driver, as expected"),
        "{}",
        r[0].message
    );
    // NVML_ERROR_NO_PERMISSION = 4: GPUs may be there, unseen
    let Some(noperm) = fake_nvml(dir.path(), "cpu-noperm", &["FAKE_INIT_RC=4"]) else {
        return;
    };
    let r = gpu_results(&with_library(&noperm), false);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Unknown, "NvmlUnavailable")
    );
    // a GPU node without NVML is still not healthy
    let r = gpu_results(&with_library(&nodriver), true);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Warning, "NvmlUnavailable")
    );
}

/// NVML shows GPUs on a node whose plan says `gpuNode: false` (no engine there requests one):
/// a `host` result says so with its own reason, and each GPU is still judged — a broken GPU is
/// not hidden behind the plan.
#[test]
fn gpus_on_a_node_planned_without_them_are_said_and_still_judged() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_nvml(dir.path(), "unplanned", &[]) else {
        return;
    };
    let r = gpu_results(&with_library(&lib), false);
    assert_eq!(r.len(), 3, "{r:#?}");
    let host = r.iter().find(|g| g.subject == "host").unwrap();
    assert_eq!(
        (host.status, host.reason.as_str()),
        (CheckStatus::Ok, "GpusNotPlanned")
    );
    assert!(
        host.message.starts_with(
            "NVML shows 2 GPU(s) (NVIDIA H200) on this node, but its plan expects none"
        ),
        "{}",
        host.message
    );
    assert_eq!(host.observed["deviceCount"], "2");
    assert_eq!(host.observed["models"], "NVIDIA H200");
    assert_eq!(host.observed["driverVersion"], "550.54.15");
    for i in 0..2 {
        let g = r.iter().find(|g| g.subject == format!("gpu{i}")).unwrap();
        assert_eq!((g.status, g.reason.as_str()), (CheckStatus::Ok, "GpuOk"));
    }
    // the plan's GPU node gets no such result
    let r = gpu_results(&with_library(&lib), true);
    assert!(r.iter().all(|g| g.reason != "GpusNotPlanned"), "{r:#?}");

    let Some(dbe) = fake_nvml(dir.path(), "unplanned-dbe", &["FAKE_DBE=2"]) else {
        return;
    };
    let r = gpu_results(&with_library(&dbe), false);
    let g = r.iter().find(|g| g.subject == "gpu0").unwrap();
    assert_eq!(
        (g.status, g.reason.as_str()),
        (CheckStatus::Critical, "GpuEccErrors")
    );
    assert_eq!(
        CheckStatus::worst(r.iter().map(|g| g.status)),
        CheckStatus::Critical
    );
}

/// GET `path` from `addr` over HTTP/1.1; `(status line, body)`.
fn http_get(addr: &str, path: &str) -> Option<(String, String)> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_string(), body.to_string()))
}

/// The real `ic-agent run` with the fake NVML: every per-GPU series on `/metrics` carries the
/// GPU's `uuid` and `model` as NVML reports them (what dcgm-exporter calls `UUID` and
/// `modelName`), and the node planned without GPUs reports `GpusNotPlanned`.
#[test]
fn the_agent_exports_gpu_series_with_uuid_and_model() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_nvml(dir.path(), "binary", &["FAKE_TEMP=52"]) else {
        return;
    };
    let plan = dir.path().join("plan.yaml");
    std::fs::write(&plan, "gpuNode: false\n").unwrap();
    let http = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args(["run", "--checks-only", "--plan"])
        .arg(&plan)
        .arg("--nvml-library")
        .arg(&lib)
        .args(["--http-addr", &http, "--check-interval-seconds", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        if let Some((status, body)) = http_get(&http, "/metrics") {
            if status.contains(" 200") && body.contains("inferencecache_agent_gpu_status{") {
                break body;
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("ic-agent exited with {st}");
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("no GPU series on http://{http}/metrics after 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    for i in 0..2 {
        let labels = format!(
            "gpu=\"{i}\",model=\"NVIDIA H200\",uuid=\"GPU-00000000-0000-0000-0000-00000000000{i}\""
        );
        for line in [
            format!("inferencecache_agent_gpu_status{{{labels}}} 0"),
            format!("inferencecache_agent_gpu_temperature_celsius{{{labels}}} 52"),
            format!("inferencecache_agent_gpu_last_xid{{{labels}}} 0"),
            format!("inferencecache_agent_gpu_xid_events_total{{{labels}}} 0"),
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
    }
    // one series per GPU: no other label combination
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("inferencecache_agent_gpu_status{"))
            .count(),
        2,
        "{text}"
    );
    let reason = "inferencecache_agent_check_reasons{check=\"gpu\",reason=\"GpusNotPlanned\",status=\"ok\"} 1";
    assert!(
        text.lines().any(|l| l == reason),
        "no `{reason}` in:\n{text}"
    );
}

// ---- field truth (issue 39 items 3, 4, 12): latched XIDs, missing GPUs, recovery actions -----

/// GET `/metrics` until `line_prefix` has a sample; returns that sample's value.
fn metric_value(addr: &str, line_prefix: &str, child: &mut std::process::Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((status, body)) = http_get(addr, "/metrics") {
            if status.contains(" 200") {
                if let Some(l) = body.lines().find(|l| l.starts_with(line_prefix)) {
                    return l.rsplit(' ').next().unwrap_or_default().to_string();
                }
            }
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("ic-agent exited with {st}");
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("no `{line_prefix}` on http://{addr}/metrics after 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn spawn_agent(lib: &Path, plan: &Path, state_dir: &Path, http: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args(["run", "--checks-only", "--plan"])
        .arg(plan)
        .arg("--nvml-library")
        .arg(lib)
        .arg("--state-dir")
        .arg(state_dir)
        .args(["--http-addr", http, "--check-interval-seconds", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// XID 79 ("GPU has fallen off the bus") seen by one agent process is still Critical after the
/// agent restarts (a DaemonSet upgrade) with the same `--state-dir`: the real `ic-agent run`,
/// killed and started again, the second one never receiving the event.
#[test]
fn a_fatal_xid_survives_an_agent_restart() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fake) = XidFake::build(dir.path(), "restart", &[]) else {
        return;
    };
    let plan = dir.path().join("plan.yaml");
    std::fs::write(&plan, "gpuNode: true\n").unwrap();
    let state = dir.path().join("state");
    let http = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let gpu0 = "inferencecache_agent_gpu_status{gpu=\"0\",";
    let mut child = spawn_agent(&fake.lib, &plan, &state, &http);
    assert_eq!(metric_value(&http, gpu0, &mut child), "0");
    fake.inject("0 79");
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric_value(&http, gpu0, &mut child) != "3" {
        assert!(Instant::now() < deadline, "XID 79 never read Critical");
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = child.kill();
    let _ = child.wait();
    // the new process's NVML never delivers the event again
    std::fs::write(&fake.xids, "").unwrap();
    let mut child = spawn_agent(&fake.lib, &plan, &state, &http);
    let after = metric_value(&http, gpu0, &mut child);
    let (_, report) = http_get(&http, "/v1/report").unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(after, "3", "gpu0 forgot XID 79 across the restart");
    assert!(report.contains("GpuXidFatal"), "{report}");
    assert!(report.contains("XID 79"), "{report}");
    assert!(state.join("gpu-state.json").exists());
}

/// One of eight GPUs drops out of NVML's enumeration: the node does not read "7 GPUs, all
/// Ok" but Critical `GpuMissing` naming the vanished GPU's UUID — also after an agent restart
/// (the inventory is in the state directory).
#[test]
fn a_gpu_that_vanishes_from_enumeration_is_critical_with_its_uuid() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("gone");
    let define = format!("FAKE_GONE_FILE=\"{}\"", gone.display());
    let Some(lib) = fake_nvml(dir.path(), "eight", &["FAKE_COUNT=8", &define]) else {
        return;
    };
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let cfg = ChecksConfig {
        nvml_library: Some(lib),
        state_dir: Some(state.clone()),
        ..ChecksConfig::default()
    };
    let check = GpuCheck::new(&cfg);
    let r = check.run(&gpu_plan());
    assert_eq!(r.len(), 8, "{r:#?}");
    assert!(r.iter().all(|g| g.reason == "GpuOk"), "{r:#?}");
    std::fs::write(&gone, "5").unwrap();
    let uuid = "GPU-00000000-0000-0000-0000-000000000005";
    for check in [check, GpuCheck::new(&cfg)] {
        let r = check.run(&gpu_plan());
        assert_eq!(r.iter().filter(|g| g.subject.starts_with("gpu")).count(), 7);
        let m = r
            .iter()
            .find(|g| g.reason == "GpuMissing")
            .unwrap_or_else(|| panic!("7 of 8 GPUs read as healthy: {r:#?}"));
        assert_eq!(
            (m.subject.as_str(), m.status),
            (uuid, CheckStatus::Critical)
        );
        assert_eq!(m.observed["uuid"], uuid);
        assert_eq!(m.observed["lastIndex"], "5");
        assert_eq!(m.observed["deviceCount"], "7");
        assert_eq!(m.observed["expectedCount"], "8");
        assert_eq!(m.observed["inventory"], "stateDir");
        assert!(m.message.contains(uuid), "{}", m.message);
        assert!(m.message.contains("7 of 8"), "{}", m.message);
        // the GPUs after it moved up one index and kept their UUIDs
        let g5 = r.iter().find(|g| g.subject == "gpu5").unwrap();
        assert_eq!(
            g5.observed["uuid"],
            "GPU-00000000-0000-0000-0000-000000000006"
        );
    }
    // it comes back: no longer missing
    std::fs::write(&gone, "-1").unwrap();
    let r = GpuCheck::new(&cfg).run(&gpu_plan());
    assert_eq!(r.len(), 8, "{r:#?}");
    assert!(r.iter().all(|g| g.reason == "GpuOk"), "{r:#?}");
}

/// Where the driver exposes NVML's recovery action, severity follows it: an XID 149 variant
/// that needs a GPU reset is Critical for as long as the driver asks for the reset (not a
/// Warning that expires with the quiet period); draining P2P is a Warning; once the driver
/// reports `None` again (the GPU was reset), a latched fatal XID is cleared too.
#[test]
fn severity_follows_the_recovery_action_and_a_reset_clears_the_latch() {
    let dir = tempfile::tempdir().unwrap();
    let recovery = dir.path().join("recovery-actions");
    std::fs::write(&recovery, "").unwrap();
    let define = format!("FAKE_RECOVERY_FILE=\"{}\"", recovery.display());
    let Some(fake) = XidFake::build(dir.path(), "recovery", &[&define]) else {
        return;
    };
    let check = fake.check(quiet(1));
    let r = check.run(&gpu_plan());
    assert_eq!(r[1].observed["recoveryAction"], "None", "{:?}", r[1]);
    fake.inject("1 149");
    std::fs::write(&recovery, "1 1\n").unwrap();
    let g = wait_for(&check, "gpu1", "149 seen", |g| {
        g.observed["xidEventsTotal"] == "1"
    });
    assert_eq!(
        (g.status, g.reason.as_str()),
        (CheckStatus::Critical, "GpuRecoveryRequired"),
        "{g:?}"
    );
    assert_eq!(g.observed["recoveryAction"], "GpuReset");
    assert!(g.message.contains("XID 149"), "{}", g.message);
    // past the quiet period: still Critical while the driver asks for the reset
    std::thread::sleep(Duration::from_millis(1500));
    let g = wait_for(&check, "gpu1", "149 quiet", |g| {
        g.observed.contains_key("xidRecovered")
    });
    assert_eq!(g.status, CheckStatus::Critical, "{g:?}");
    std::fs::write(&recovery, "1 3\n").unwrap();
    let g = wait_for(&check, "gpu1", "drain p2p", |g| {
        g.observed["recoveryAction"] == "DrainP2P"
    });
    assert_eq!(
        (g.status, g.reason.as_str()),
        (CheckStatus::Warning, "GpuRecoveryRequired")
    );
    std::fs::write(&recovery, "1 0\n").unwrap();
    wait_for(&check, "gpu1", "reset", |g| g.reason == "GpuOk");

    // a fatal XID latches; the driver's reset (an action, then None) clears it
    fake.inject("0 79");
    wait_for(&check, "gpu0", "79", |g| g.reason == "GpuXidFatal");
    std::fs::write(&recovery, "0 2\n").unwrap();
    let g = wait_for(&check, "gpu0", "79 reboot", |g| {
        g.observed["recoveryAction"] == "NodeReboot"
    });
    assert_eq!(g.status, CheckStatus::Critical);
    std::fs::write(&recovery, "0 0\n").unwrap();
    let g = wait_for(&check, "gpu0", "79 reset", |g| g.reason == "GpuOk");
    assert_eq!(g.observed["xidEventsTotal"], "1");
}

/// `xidIgnored` counts every ignored XID since the agent started, not those still in the
/// bounded log.
#[test]
fn xid_ignored_is_a_count_not_a_window() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fake) = XidFake::build(dir.path(), "ignored", &[]) else {
        return;
    };
    let check = fake.check(XidPolicy::default());
    check.run(&gpu_plan());
    let n = ic_agent::checks::xid::LOG_CAPACITY + 20;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&fake.xids)
        .unwrap();
    for _ in 0..n {
        writeln!(f, "0 13").unwrap();
    }
    drop(f);
    let g = wait_for(&check, "gpu0", "all seen", |g| {
        g.observed["xidEventsTotal"] == n.to_string()
    });
    assert_eq!(g.observed["xidIgnored"], n.to_string(), "{g:?}");
}

/// The latch is cleared by a reboot: a new kernel boot id (read under the configured procfs
/// root) means every GPU was reset. The same boot id (an agent restart) keeps it.
#[test]
fn a_reboot_clears_latched_xids_and_an_agent_restart_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fake) = XidFake::build(dir.path(), "reboot", &[]) else {
        return;
    };
    let proc_root = dir.path().join("proc");
    let boot_id = proc_root.join("sys/kernel/random/boot_id");
    std::fs::create_dir_all(boot_id.parent().unwrap()).unwrap();
    std::fs::write(&boot_id, "6f1c0d2e-0000-4000-8000-000000000001\n").unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let cfg = ChecksConfig {
        nvml_library: Some(fake.lib.clone()),
        state_dir: Some(state.clone()),
        proc_root: proc_root.clone(),
        ..ChecksConfig::default()
    };
    let check = GpuCheck::new(&cfg);
    check.run(&gpu_plan());
    fake.inject("1 95");
    wait_for(&check, "gpu1", "XID 95", |g| g.reason == "GpuXidFatal");
    drop(check);
    // XIDs already delivered are not delivered again by the fake's next reader
    std::fs::write(&fake.xids, "").unwrap();
    let g = GpuCheck::new(&cfg).run(&gpu_plan());
    assert_eq!(g[1].reason, "GpuXidFatal", "restart, same boot: {:?}", g[1]);
    assert!(g[1].message.contains("XID 95"), "{}", g[1].message);
    std::fs::write(&boot_id, "6f1c0d2e-0000-4000-8000-000000000002\n").unwrap();
    let g = GpuCheck::new(&cfg).run(&gpu_plan());
    assert_eq!(g[1].reason, "GpuOk", "after a reboot: {:?}", g[1]);
}

/// NVML's indexes shift when a GPU drops out of enumeration: an XID is kept for the GPU that
/// reported it (by UUID), not for whichever GPU now has its old index.
#[test]
fn an_xid_stays_with_its_gpu_when_indexes_shift() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("gone");
    let define = format!("FAKE_GONE_FILE=\"{}\"", gone.display());
    let Some(fake) = XidFake::build(dir.path(), "shift", &["FAKE_COUNT=8", &define]) else {
        return;
    };
    let check = fake.check(XidPolicy::default());
    check.run(&gpu_plan());
    fake.inject("6 79");
    wait_for(&check, "gpu6", "XID 79", |g| g.reason == "GpuXidFatal");
    std::fs::write(&gone, "5").unwrap();
    let r = check.run(&gpu_plan());
    let by_uuid = |u: &str| {
        r.iter()
            .find(|g| g.observed.get("uuid").map(String::as_str) == Some(u))
            .unwrap()
    };
    let reporter = by_uuid("GPU-00000000-0000-0000-0000-000000000006");
    assert_eq!(
        (reporter.subject.as_str(), reporter.reason.as_str()),
        ("gpu5", "GpuXidFatal"),
        "{reporter:?}"
    );
    let next = by_uuid("GPU-00000000-0000-0000-0000-000000000007");
    assert_eq!(
        (next.subject.as_str(), next.reason.as_str()),
        ("gpu6", "GpuOk"),
        "the XID moved to the GPU that took its index: {next:?}"
    );
}
