//! `shm` check against the real `/dev/shm` of this host and against temp dirs described by a
//! fixture `mountinfo`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_agent::checks::shm::{statvfs_usage, ShmCheck};
use ic_agent::checks::units::bytes_both;
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, ShmRequirement};

#[path = "support/skip.rs"]
mod skip;

fn run(cfg: &ChecksConfig, required: Option<u64>) -> CheckResult {
    let plan = NodePlan {
        shm: required.map(|required_bytes| ShmRequirement { required_bytes }),
        ..NodePlan::default()
    };
    let mut r = ShmCheck::new(cfg).run(&plan);
    assert_eq!(r.len(), 1, "{r:#?}");
    r.remove(0)
}

#[test]
fn real_dev_shm_undersized_names_both_sizes() {
    let cfg = ChecksConfig::default();
    if !cfg.shm_path.exists() {
        skip::skip(
            "checks_shm::real_dev_shm_undersized_names_both_sizes",
            "this host has no /dev/shm",
        );
        return;
    }
    let size = statvfs_usage(&cfg.shm_path).unwrap().size_bytes;
    let required = size + (1 << 30);
    let r = run(&cfg, Some(required));
    assert_eq!(r.name, "shm");
    assert_eq!(r.subject, "host");
    assert_eq!(
        (r.status, r.reason.as_str()),
        (CheckStatus::Critical, "ShmUndersized"),
        "{r:?}"
    );
    let want = format!(
        "/dev/shm is {} but the plan requires {}",
        bytes_both(size),
        bytes_both(required)
    );
    assert!(r.message.contains(&want), "{want:?} not in {:?}", r.message);
    assert_eq!(r.observed["sizeBytes"], size.to_string());
    assert_eq!(r.observed["requiredBytes"], required.to_string());
    assert_eq!(r.observed["fsType"], "tmpfs");
    for key in ["usedBytes", "availableBytes", "mountSource", "mountPoint"] {
        assert!(r.observed.contains_key(key), "{key} missing: {r:?}");
    }
    // the configured size (last /dev/shm line of mountinfo) agrees with statvfs
    if let Some(c) = r.observed.get("configuredSizeBytes") {
        assert_eq!(c, &size.to_string());
    }
}

#[test]
fn real_dev_shm_tiny_requirement_is_ok() {
    let cfg = ChecksConfig::default();
    if !cfg.shm_path.exists() {
        skip::skip(
            "checks_shm::real_dev_shm_tiny_requirement_is_ok",
            "this host has no /dev/shm",
        );
        return;
    }
    for required in [Some(1), None] {
        let r = run(&cfg, required);
        let used: u64 = r.observed["usedPercent"].parse().unwrap();
        if used > 90 {
            assert_eq!(r.reason, "ShmNearlyFull", "{r:?}");
        } else {
            assert_eq!(
                (r.status, r.reason.as_str()),
                (CheckStatus::Ok, "ShmOk"),
                "{r:?}"
            );
        }
    }
}

/// A proc root whose `self/mountinfo` mounts `mount_point` with `fs_line` (`"<fs> <source>
/// <opts>"`), on top of a root file system.
fn proc_root_with(mount_point: &Path, fs_line: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("self")).unwrap();
    let escaped = mount_point.to_string_lossy().replace(' ', "\\040");
    let text = format!(
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
         25 27 0:23 / {escaped} rw,relatime - tmpfs tmpfs rw,size=8k\n\
         30 25 0:27 / {escaped} rw,nosuid - {fs_line}\n"
    );
    std::fs::write(root.path().join("self/mountinfo"), text).unwrap();
    root
}

fn canonical_tempdir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("shm with space")
        .tempdir()
        .unwrap();
    let path = std::fs::canonicalize(dir.path()).unwrap();
    (dir, path)
}

#[test]
fn fixture_mountinfo_last_line_gives_type_source_and_configured_size() {
    let (_dir, shm) = canonical_tempdir();
    let proc = proc_root_with(&shm, "tmpfs shm rw,size=65536k,inode64");
    let cfg = ChecksConfig {
        proc_root: proc.path().to_path_buf(),
        shm_path: shm.clone(),
        ..ChecksConfig::default()
    };
    let r = run(&cfg, Some(1));
    assert_eq!(r.observed["fsType"], "tmpfs");
    assert_eq!(r.observed["mountSource"], "shm");
    assert_eq!(r.observed["configuredSizeBytes"], (64u64 << 20).to_string());
    assert_eq!(r.observed["mountPoint"], shm.display().to_string());
    assert_eq!(r.observed["path"], shm.display().to_string());
}

#[test]
fn fixture_not_tmpfs_is_a_warning() {
    let (_dir, shm) = canonical_tempdir();
    let proc = proc_root_with(&shm, "ext4 /dev/vdb rw");
    let cfg = ChecksConfig {
        proc_root: proc.path().to_path_buf(),
        shm_path: shm,
        ..ChecksConfig::default()
    };
    let r = run(&cfg, Some(1));
    assert_eq!(
        (r.status, r.reason.as_str()),
        (CheckStatus::Warning, "ShmNotTmpfs"),
        "{r:?}"
    );
    assert!(r.message.contains("ext4"), "{}", r.message);
    assert_eq!(r.observed["mountSource"], "/dev/vdb");
}

#[test]
fn missing_path_and_missing_mountinfo() {
    let (_dir, base) = canonical_tempdir();
    let cfg = ChecksConfig {
        shm_path: base.join("absent"),
        ..ChecksConfig::default()
    };
    let r = run(&cfg, Some(1 << 30));
    assert_eq!(
        (r.status, r.reason.as_str()),
        (CheckStatus::Critical, "ShmMissing")
    );
    assert!(
        r.message.contains("1.0 GiB (1073741824 bytes)"),
        "{}",
        r.message
    );
    let r = run(&cfg, None);
    assert_eq!(
        (r.status, r.reason.as_str()),
        (CheckStatus::Unknown, "ShmMissing")
    );

    // unreadable mountinfo: sizes still come from statvfs, the type is unknown
    let cfg = ChecksConfig {
        proc_root: base.join("no-proc"),
        shm_path: base.clone(),
        ..ChecksConfig::default()
    };
    let r = run(&cfg, Some(1));
    assert_eq!(r.reason, "ShmOk", "{r:?}");
    assert_eq!(r.observed["fsType"], "unknown");
    assert!(r.observed["mountinfoError"].contains("mountinfo"));
}
