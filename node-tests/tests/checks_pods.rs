//! Pod-aware checks on the real kernel, as root: `shm` per engine pod, `mp_worker` through the
//! pod's network namespace, and `mounts` (reader volumes) through the pod's mount namespace.
//!
//! A "fake pod" is this test binary under `unshare -m -n --propagation private`, moved into a
//! kubepods cgroup for a pod UID (real cgroups where the host allows, else a mirror of `/proc`
//! with a fake cgroup file). Inside its namespaces it brings `lo` up, mounts an 8 MiB tmpfs on
//! `/dev/shm`, mounts reader volumes (tmpfs, loop ext4 and, with xfsprogs, loop xfs — each
//! written, then bind-mounted and remounted read-only, plus a read-write tmpfs), and serves a
//! ZMQ ROUTER answering the LMCache MP worker's exact frames on 127.0.0.1. The agent's checks
//! then find it by UID and look through `/proc/<pid>/…`. When the pod ends, its mounts, loop
//! devices and namespaces go with it; the test verifies that nothing is left behind.
//! Recorded as skipped (`support::skip`) when not root, and the loop volumes when the machine
//! has no loop devices; fails, naming scripts/setup.sh, when unshare, losetup, mkfs.ext4 or
//! mkfs.xfs is missing. CI runs as root.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ic_agent::checks::fake::{serve_mp_worker, MpWorkerMode};
use ic_agent::checks::mounts::MountsCheck;
use ic_agent::checks::mp_worker::MpWorkerCheck;
use ic_agent::checks::shm::ShmCheck;
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{EnginePlan, NodePlan, PlannedContainer, ReaderMount, SampleDigest};
use support::{eventually, have, is_root, sh, FakePod};

const BASE: &str = "IC_POD_BASE";
const EXT4: &str = "IC_POD_EXT4";
const XFS: &str = "IC_POD_XFS";
const POD_UID: &str = "5e1f0c2a-7b3d-4e8f-9a01-23456789abcd";
const CONFIG_JSON: &[u8] = b"{\"architectures\": [\"LlamaForCausalLM\"]}\n";

fn sha256_hex(data: &[u8]) -> String {
    // the same digest the agent computes, via coreutils, as an independent reference
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("x");
    std::fs::write(&f, data).unwrap();
    let out = Command::new("sha256sum").arg(&f).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Writer side of a volume: mount `src` (already mounted by the caller), write the sample,
/// then bind it at `ro` and remount that read-only.
fn publish_read_only(src: &Path, ro: &Path) {
    std::fs::write(src.join("config.json"), CONFIG_JSON).unwrap();
    std::fs::write(src.join("model.safetensors"), vec![7u8; 4096]).unwrap();
    sh(
        "mount",
        &[
            "--bind",
            &src.display().to_string(),
            &ro.display().to_string(),
        ],
    );
    sh(
        "mount",
        &["-o", "remount,bind,ro", &ro.display().to_string()],
    );
}

/// Not a test of its own: the fake pod (see the module docs). Runs until stdin closes.
#[test]
fn fake_pod_child() {
    let Ok(base) = std::env::var(BASE) else {
        return;
    };
    let base = PathBuf::from(base);
    let p = |n: &str| base.join(n).display().to_string();
    sh("ip", &["link", "set", "lo", "up"]);
    sh(
        "mount",
        &["-t", "tmpfs", "-o", "size=8m", "podshm", "/dev/shm"],
    );
    sh(
        "mount",
        &["-t", "tmpfs", "-o", "size=4m", "models", &p("src-tmpfs")],
    );
    publish_read_only(&base.join("src-tmpfs"), &base.join("ro-tmpfs"));
    sh(
        "mount",
        &["-t", "tmpfs", "-o", "size=4m", "scratch", &p("rw-tmpfs")],
    );
    std::fs::write(base.join("rw-tmpfs").join("weights.bin"), b"abc").unwrap();
    for (var, fs) in [(EXT4, "ext4"), (XFS, "xfs")] {
        if let Some(img) = std::env::var(var).ok().filter(|v| !v.is_empty()) {
            sh("mount", &["-o", "loop", &img, &p(&format!("src-{fs}"))]);
            publish_read_only(
                &base.join(format!("src-{fs}")),
                &base.join(format!("ro-{fs}")),
            );
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (bound, serve) = serve_mp_worker("tcp://127.0.0.1:0", MpWorkerMode::Answer)
            .await
            .unwrap();
        let port = bound.rsplit(':').next().unwrap().to_string();
        println!("READY {port}");
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        });
        tokio::select! {
            _ = serve => {}
            _ = stdin_closed => {}
        }
    });
}

fn show(r: &[CheckResult]) {
    for x in r {
        println!("{:?} {} {}: {}", x.status, x.reason, x.subject, x.message);
    }
}

fn engine(shm: Option<u64>, port: Option<u16>) -> EnginePlan {
    EnginePlan {
        namespace: "team-a".into(),
        pod: "engine-0".into(),
        pod_uid: Some(POD_UID.into()),
        shm_required_bytes: shm,
        mp_worker_port: port,
        ..EnginePlan::default()
    }
}

fn reader(path: &Path, samples: Vec<SampleDigest>, expect_ro: bool) -> ReaderMount {
    ReaderMount {
        namespace: "team-a".into(),
        pod: "engine-0".into(),
        pod_uid: Some(POD_UID.into()),
        path: path.display().to_string(),
        expect_read_only: expect_ro,
        samples,
        binding: "team-a/llama".into(),
        containers: Vec::new(),
    }
}

fn host_mounts_under(base: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&*base.to_string_lossy()))
        .map(str::to_string)
        .collect()
}

fn loop_devices_of(img: &Path) -> String {
    let out = Command::new("losetup").arg("-j").arg(img).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn engine_pod_shm_mp_worker_and_reader_volumes() {
    const TEST: &str = "checks_pods::engine_pod_shm_mp_worker_and_reader_volumes";
    if !is_root() {
        support::skip(
            TEST,
            "needs root for namespaces, mounts and cgroups (CI runs as root)",
        );
        return;
    }
    assert!(
        have("unshare"),
        "unshare (util-linux) is missing: run {}",
        support::SETUP
    );
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    for d in [
        "src-tmpfs",
        "ro-tmpfs",
        "rw-tmpfs",
        "src-ext4",
        "ro-ext4",
        "src-xfs",
        "ro-xfs",
        "not-mounted",
    ] {
        std::fs::create_dir(base.join(d)).unwrap();
    }
    let loop_ok = Path::new("/dev/loop-control").exists() && have("losetup");
    let mut images: Vec<(&str, PathBuf)> = Vec::new();
    for (fs, mkfs, size, args) in [
        ("ext4", "mkfs.ext4", "16M", vec!["-q", "-F"]),
        ("xfs", "mkfs.xfs", "320M", vec!["-q", "-f"]),
    ] {
        assert!(
            have(mkfs) && have("losetup"),
            "{mkfs} or losetup is missing (for the loop {fs} volume): run {}",
            support::SETUP
        );
        if !loop_ok {
            support::skip(
                TEST,
                &format!("the loop {fs} volume: this machine has no /dev/loop-control"),
            );
            continue;
        }
        let img = base.join(format!("{fs}.img"));
        sh("truncate", &["-s", size, &img.display().to_string()]);
        let mut a = args.clone();
        let img_s = img.display().to_string();
        a.push(&img_s);
        sh(mkfs, &a);
        images.push((fs, img));
    }
    let env_img = |fs: &str| {
        images
            .iter()
            .find(|(f, _)| *f == fs)
            .map(|(_, p)| p.display().to_string())
            .unwrap_or_default()
    };
    let pod = FakePod::start(
        "fake_pod_child",
        &["-m", "-n", "--propagation", "private"],
        &[
            (BASE, base.display().to_string()),
            (EXT4, env_img("ext4")),
            (XFS, env_img("xfs")),
        ],
        POD_UID,
    );
    let port: u16 = pod.ready[1].parse().unwrap();
    println!(
        "pod pid {} found through {} ({})",
        pod.pid,
        pod.proc_root.display(),
        if pod.in_real_cgroups() {
            "real kubepods cgroups"
        } else {
            "a /proc mirror"
        }
    );
    let cfg = ChecksConfig {
        proc_root: pod.proc_root.clone(),
        mp_worker_timeout: Duration::from_millis(800),
        ..ChecksConfig::default()
    };

    // ---- shm: the pod's own /dev/shm (8 MiB), not the host's
    let shm = ShmCheck::new(&cfg);
    let r = shm.run(&NodePlan {
        engines: vec![engine(Some(16 * MIB), None)],
        ..NodePlan::default()
    });
    show(&r);
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].subject, "host");
    let p = &r[1];
    assert_eq!(
        (p.subject.as_str(), p.status, p.reason.as_str()),
        ("team-a/engine-0", CheckStatus::Critical, "ShmUndersized")
    );
    assert!(
        p.message.contains(
            "/dev/shm in pod team-a/engine-0 is 8.0 MiB (8388608 bytes) but the plan requires \
             16.0 MiB (16777216 bytes)"
        ),
        "{}",
        p.message
    );
    assert_eq!(p.observed["sizeBytes"], "8388608");
    assert_eq!(p.observed["configuredSizeBytes"], "8388608");
    assert_eq!(p.observed["mountSource"], "podshm");
    assert_eq!(p.observed["pid"], pod.pid.to_string());
    assert_eq!(p.observed["podUid"], POD_UID);
    let r = shm.run(&NodePlan {
        engines: vec![engine(Some(4 * MIB), None)],
        ..NodePlan::default()
    });
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Ok, "ShmOk")
    );
    // The plan names the engine container: its /dev/shm is judged (found by the runtime ID in
    // its cgroup); when pod status says it is not running, or its ID is not this process's (it
    // restarted), the pod's /dev/shm is not judged at all.
    let named = |id: Option<&str>| {
        let mut e = engine(Some(16 * MIB), None);
        e.shm_containers = vec![PlannedContainer {
            name: "vllm".into(),
            id: id.map(str::to_string),
        }];
        shm.run(&NodePlan {
            engines: vec![e],
            ..NodePlan::default()
        })
    };
    let r = named(Some(support::FAKE_CONTAINER_ID));
    show(&r);
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Critical, "ShmUndersized")
    );
    assert_eq!(r[1].observed["container"], "vllm");
    for id in [None, Some("0123456789abcdef0123456789abcdef")] {
        let r = named(id);
        show(&r);
        assert_eq!(
            (r[1].status, r[1].reason.as_str()),
            (CheckStatus::Unknown, "EngineContainerNotRunning"),
            "{id:?}"
        );
        assert_eq!(
            r[1].observed["containersRunning"],
            &support::FAKE_CONTAINER_ID[..12]
        );
        assert!(r[1].message.contains("vllm"), "{}", r[1].message);
    }
    let mut gone = engine(Some(MIB), None);
    gone.pod_uid = Some("00000000-0000-0000-0000-000000000000".into());
    let r = shm.run(&NodePlan {
        engines: vec![gone],
        ..NodePlan::default()
    });
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Unknown, "PodNotFound")
    );

    // ---- mp_worker: reachable only inside the pod's network namespace
    let mp = MpWorkerCheck::new(&cfg);
    let probe = |port: u16| {
        let e = engine(None, Some(port));
        let r = mp.run(&NodePlan {
            engines: vec![e],
            ..NodePlan::default()
        });
        show(&r);
        r.into_iter().next().unwrap()
    };
    let r = probe(port);
    assert_eq!(
        (r.status, r.reason.as_str()),
        (CheckStatus::Ok, "MpWorkerLive")
    );
    assert_eq!(r.observed["result"], "OK");
    assert!(
        r.observed["netns"].ends_with(&format!("{}/ns/net", pod.pid)),
        "{r:?}"
    );
    let other_port = if port == 65535 { port - 1 } else { port + 1 };
    let r = probe(other_port);
    assert_eq!(r.reason, "MpWorkerNotListening", "{r:?}");

    // ---- mounts: through the pod's mount namespace
    let digest = sha256_hex(CONFIG_JSON);
    let good = || {
        vec![SampleDigest {
            file: "config.json".into(),
            sha256: digest.to_uppercase(),
        }]
    };
    let mounts = MountsCheck::new(&cfg);
    // The plan names the container that mounts the volume: looked through when its ID is the
    // running process's; when it does not run (or restarted since the plan) the mount is
    // Unknown, not ReaderVolumeMissing from a container that never mounts it.
    let named = |id: Option<&str>| {
        let mut m = reader(&base.join("not-mounted"), vec![], true);
        m.containers = vec![PlannedContainer {
            name: "reader".into(),
            id: id.map(str::to_string),
        }];
        mounts.run(&NodePlan {
            reader_mounts: vec![m],
            ..NodePlan::default()
        })
    };
    let r = named(Some(support::FAKE_CONTAINER_ID));
    show(&r);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Critical, "ReaderVolumeMissing")
    );
    for id in [None, Some("0123456789abcdef0123456789abcdef")] {
        let r = named(id);
        show(&r);
        assert_eq!(
            (r[0].status, r[0].reason.as_str()),
            (CheckStatus::Unknown, "PodNotFound"),
            "{id:?}"
        );
        assert!(r[0].message.contains("(reader)"), "{}", r[0].message);
    }
    let mut plans = vec![
        reader(&base.join("ro-tmpfs"), good(), true),
        reader(&base.join("rw-tmpfs"), vec![], true),
        reader(
            &base.join("ro-tmpfs"),
            vec![SampleDigest {
                file: "config.json".into(),
                sha256: "00".repeat(32),
            }],
            true,
        ),
        reader(&base.join("not-mounted"), vec![], true),
        reader(&base.join("rw-tmpfs"), vec![], false),
    ];
    for (fs, _) in &images {
        plans.push(reader(&base.join(format!("ro-{fs}")), good(), true));
    }
    let r = mounts.run(&NodePlan {
        reader_mounts: plans,
        ..NodePlan::default()
    });
    show(&r);
    let ro_probes = "create=EROFS,append=EROFS,chmod=EROFS,truncate=EROFS,ftruncate=EINVAL,\
                     rename=EROFS,unlink=EROFS,mkdir=EROFS";
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Ok, "ReaderVolumeReadOnly"),
        "{:?}",
        r[0]
    );
    assert_eq!(r[0].observed["probes"], ro_probes);
    assert_eq!(r[0].observed["samplesMatching"], "1");
    assert_eq!(r[0].observed["fsType"], "tmpfs");
    assert_eq!(r[0].observed["readOnlyFlag"], "true");
    assert_eq!(
        r[0].subject,
        format!("team-a/engine-0:{}", base.join("ro-tmpfs").display())
    );
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Critical, "ReaderVolumeWritable")
    );
    assert!(
        r[1].message.contains("every change was undone"),
        "{}",
        r[1].message
    );
    assert_eq!(
        r[1].observed["probes"],
        "create=succeeded(undone),append=succeeded(undone),chmod=succeeded(undone),\
         truncate=succeeded(undone),ftruncate=EINVAL,rename=ENOENT,unlink=ENOENT,\
         mkdir=succeeded(undone)"
    );
    // nothing left behind in the writable volume, content unchanged
    let rw = PathBuf::from(format!("/proc/{}/root", pod.pid))
        .join(base.join("rw-tmpfs").strip_prefix("/").unwrap());
    let left: Vec<String> = std::fs::read_dir(&rw)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["weights.bin".to_string()]);
    assert_eq!(std::fs::read(rw.join("weights.bin")).unwrap(), b"abc");
    assert_eq!(
        (r[2].status, r[2].reason.as_str()),
        (CheckStatus::Critical, "ReaderVolumeDigestMismatch")
    );
    assert!(r[2].message.contains(&digest), "{}", r[2].message);
    assert_eq!(
        (r[3].status, r[3].reason.as_str()),
        (CheckStatus::Critical, "ReaderVolumeMissing")
    );
    assert_eq!(
        (r[4].status, r[4].reason.as_str()),
        (CheckStatus::Ok, "ReaderVolumeMounted")
    );
    for (i, (fs, _)) in images.iter().enumerate() {
        let x = &r[5 + i];
        assert_eq!(
            (x.status, x.reason.as_str()),
            (CheckStatus::Ok, "ReaderVolumeReadOnly"),
            "{fs}: {x:?}"
        );
        assert_eq!(x.observed["fsType"], *fs);
        assert_eq!(x.observed["probes"], ro_probes, "{fs}");
        assert_eq!(x.observed["samplesMatching"], "1");
    }
    // the host's view of the same directories is untouched: no mounts there
    assert!(
        host_mounts_under(&base).is_empty(),
        "{:?}",
        host_mounts_under(&base)
    );

    // ---- mp_worker hung: the pod stopped; TCP is accepted, the greeting never comes
    pod.signal("STOP");
    let started = Instant::now();
    let r = probe(port);
    pod.signal("CONT");
    assert_eq!(
        (r.status, r.reason.as_str()),
        (CheckStatus::Critical, "MpWorkerHung")
    );
    assert_eq!(r.observed["stage"], "greeting");
    assert!(started.elapsed() < Duration::from_secs(5));
    let r = probe(port);
    assert_eq!(r.reason, "MpWorkerLive", "{r:?}");

    // ---- leave nothing behind
    let pid = pod.pid;
    pod.stop();
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "pod process left"
    );
    for (fs, img) in &images {
        eventually(10, &format!("the {fs} loop device to be released"), || {
            loop_devices_of(img).is_empty()
        });
    }
    assert!(host_mounts_under(&base).is_empty());
    for (kind, root) in support::cgroup_mounts() {
        for leftover in ["kubepods", "kubepods.slice"] {
            let d = root.join(leftover);
            if d.exists() {
                let has_pod =
                    walk_contains(&d, &POD_UID.replace('-', "_")) || walk_contains(&d, POD_UID);
                assert!(
                    !has_pod,
                    "cgroup of the fake pod left in {kind} at {}",
                    d.display()
                );
            }
        }
    }
}

fn walk_contains(dir: &Path, needle: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p = e.path();
        p.is_dir()
            && (e.file_name().to_string_lossy().contains(needle) || walk_contains(&p, needle))
    })
}
