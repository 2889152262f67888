//! `shm` check on real tmpfs mounts, as root, in a private mount namespace.
//!
//! The outer test re-runs this test binary under `unshare -m --propagation private` with
//! `IC_NODE_TESTS_INNER=checks_shm`; the inner run mounts small tmpfs (and ramfs) file systems
//! in a temp dir, points `shm_path` at them and checks what the agent reports. Nothing leaks
//! to the host's mount table. Recorded as skipped (`support::skip`) when not root; fails
//! when `unshare` is missing; CI runs as root.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write;
use std::path::Path;
use std::process::Command;

use ic_agent::checks::shm::ShmCheck;
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, ShmRequirement};
use support::{is_inner, rerun_in_unshare};

fn mount(args: &[&str], target: &Path) {
    let st = Command::new("mount")
        .args(args)
        .arg(target)
        .status()
        .unwrap();
    assert!(st.success(), "mount {args:?} {} failed", target.display());
}

fn umount(target: &Path) {
    let st = Command::new("umount").arg(target).status().unwrap();
    assert!(st.success(), "umount {} failed", target.display());
}

fn check(shm: &Path, required: Option<u64>) -> CheckResult {
    let cfg = ChecksConfig {
        shm_path: shm.to_path_buf(),
        ..ChecksConfig::default()
    };
    let plan = NodePlan {
        shm: required.map(|required_bytes| ShmRequirement { required_bytes }),
        ..NodePlan::default()
    };
    let mut r = ShmCheck::new(&cfg).run(&plan);
    assert_eq!(r.len(), 1);
    let r = r.remove(0);
    println!(
        "{:?} {} {}: {}",
        r.status,
        r.reason,
        shm.display(),
        r.message
    );
    r
}

fn status_reason(r: &CheckResult) -> (CheckStatus, &str) {
    (r.status, r.reason.as_str())
}

#[test]
fn shm_on_real_tmpfs_mounts() {
    if !is_inner("shm_on_real_tmpfs_mounts") {
        rerun_in_unshare(
            "shm_on_real_tmpfs_mounts",
            &["-m", "--propagation", "private"],
            "mount namespaces and mounts",
        );
        return;
    }

    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let shm = base.join("shm");
    std::fs::create_dir(&shm).unwrap();
    mount(&["-t", "tmpfs", "-o", "size=8m", "icshm"], &shm);

    // undersized: both sizes in human units and bytes, observed from statvfs and mountinfo
    let r = check(&shm, Some(16 * MIB));
    assert_eq!(status_reason(&r), (CheckStatus::Critical, "ShmUndersized"));
    let want = format!(
        "{} is 8.0 MiB (8388608 bytes) but the plan requires 16.0 MiB (16777216 bytes)",
        shm.display()
    );
    assert!(r.message.contains(&want), "{want:?} not in {:?}", r.message);
    assert_eq!(r.observed["sizeBytes"], "8388608");
    assert_eq!(r.observed["configuredSizeBytes"], "8388608");
    assert_eq!(r.observed["fsType"], "tmpfs");
    assert_eq!(r.observed["mountSource"], "icshm");
    assert_eq!(r.observed["usedBytes"], "0");
    assert_eq!(r.observed["availableBytes"], "8388608");
    assert_eq!(
        status_reason(&check(&shm, Some(4 * MIB))),
        (CheckStatus::Ok, "ShmOk")
    );
    assert_eq!(
        status_reason(&check(&shm, None)),
        (CheckStatus::Ok, "ShmOk")
    );

    // through a symlink (as /dev/shm -> /run/shm): the mount of the target is found
    let link = base.join("link");
    std::os::unix::fs::symlink(&shm, &link).unwrap();
    let r = check(&link, Some(16 * MIB));
    assert_eq!(r.reason, "ShmUndersized");
    assert_eq!(r.observed["mountSource"], "icshm");

    // mounts stack: the last line for the mount point wins, and statvfs sees the top one
    mount(&["-t", "tmpfs", "-o", "size=32m", "icshm-top"], &shm);
    let r = check(&shm, Some(16 * MIB));
    assert_eq!(status_reason(&r), (CheckStatus::Ok, "ShmOk"));
    assert_eq!(r.observed["configuredSizeBytes"], (32 * MIB).to_string());
    assert_eq!(r.observed["sizeBytes"], (32 * MIB).to_string());
    assert_eq!(r.observed["mountSource"], "icshm-top");
    umount(&shm);
    assert_eq!(check(&shm, None).observed["mountSource"], "icshm");

    // fill past the threshold: ShmNearlyFull; past the size: ENOSPC, then 100 % full
    let mut f = std::fs::File::create(shm.join("segment")).unwrap();
    f.write_all(&vec![0x5a; (7 * MIB + MIB / 2) as usize])
        .unwrap();
    f.sync_all().unwrap();
    let r = check(&shm, Some(4 * MIB));
    assert_eq!(status_reason(&r), (CheckStatus::Warning, "ShmNearlyFull"));
    let pct: u64 = r.observed["usedPercent"].parse().unwrap();
    assert!((90..=100).contains(&pct), "{pct}");
    assert!(r.message.contains(&format!("{pct}% full")), "{}", r.message);
    let err = f.write_all(&vec![0x5a; MIB as usize]).unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(28),
        "ENOSPC past the tmpfs size: {err}"
    );
    let r = check(&shm, Some(16 * MIB));
    assert_eq!(status_reason(&r), (CheckStatus::Critical, "ShmUndersized"));
    assert!(
        r.message.contains("100% full"),
        "both findings: {}",
        r.message
    );
    assert_eq!(r.observed["availableBytes"], "0");
    drop(f);
    std::fs::remove_file(shm.join("segment")).unwrap();
    assert_eq!(
        status_reason(&check(&shm, None)),
        (CheckStatus::Ok, "ShmOk")
    );

    // a RAM file system that is not tmpfs (ramfs has no size, statvfs reports 0)
    let ram = base.join("ram");
    std::fs::create_dir(&ram).unwrap();
    mount(&["-t", "ramfs", "icram"], &ram);
    let r = check(&ram, None);
    assert_eq!(status_reason(&r), (CheckStatus::Warning, "ShmNotTmpfs"));
    assert_eq!(r.observed["fsType"], "ramfs");
    assert_eq!(r.observed["mountSource"], "icram");
    umount(&ram);

    // tmpfs size=0 is unlimited: statvfs reports 0 blocks, any requirement is met
    mount(&["-t", "tmpfs", "-o", "size=0", "icunlimited"], &ram);
    let r = check(&ram, Some(1 << 40));
    assert_eq!(status_reason(&r), (CheckStatus::Ok, "ShmOk"));
    assert!(r.message.contains("unlimited"), "{}", r.message);
    assert_eq!(r.observed["sizeBytes"], "0");
    umount(&ram);

    // gone: missing is Critical when required, Unknown otherwise
    umount(&shm);
    std::fs::remove_dir(&shm).unwrap();
    assert_eq!(
        status_reason(&check(&shm, Some(MIB))),
        (CheckStatus::Critical, "ShmMissing")
    );
    assert_eq!(
        status_reason(&check(&shm, None)),
        (CheckStatus::Unknown, "ShmMissing")
    );
}
