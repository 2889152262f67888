//! `ic-agent qualify` (spec 004 "Qualification") on real kernel mounts, as root, in a private
//! mount namespace: a tmpfs and a loop-mounted ext4 are the "writer volume"; a bind mount of the
//! same file system remounted read-only is the "reader volume". A separate writer process (this
//! test binary re-executed as `writer_child`) fills the writer and exits.
//!
//! The outer test re-runs this binary under `unshare -m --propagation private` with
//! `IC_NODE_TESTS_INNER=<test>`; mounts vanish with the namespace, loop devices are detached
//! (autoclear) and the temp dirs removed, so nothing is left behind. Skipped, with the reason
//! printed, when not root or `unshare` is missing; the ext4 part is skipped without mkfs.ext4.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ic_agent::qualify::{qualify, QualifyOptions, QualifyReport, WriterLauncher, ENV_WRITE_DIR};
use support::{is_inner, rerun_in_unshare};

/// `unshare` flags of the qualifications: a private mount namespace.
const PRIVATE_MOUNTS: &[&str] = &["-m", "--propagation", "private"];

const MIB: u64 = 1 << 20;

/// The writer process of every qualification below: a no-op unless re-executed with the
/// qualification's environment.
#[test]
fn writer_child() {
    if std::env::var_os(ENV_WRITE_DIR).is_none() {
        return;
    }
    ic_agent::qualify::write_payload_from_env().unwrap();
}

fn launcher() -> WriterLauncher {
    WriterLauncher::Exec {
        program: std::env::current_exe().unwrap(),
        args: ["--exact", "writer_child", "--nocapture", "--test-threads=1"]
            .into_iter()
            .map(Into::into)
            .collect(),
    }
}

fn run(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd).args(args).status().unwrap();
    assert!(st.success(), "{cmd} {args:?} failed");
}

fn mkdir(base: &Path, name: &str) -> PathBuf {
    let p = base.join(name);
    std::fs::create_dir(&p).unwrap();
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `reader` becomes a read-only bind mount of `writer`.
fn bind_ro(writer: &Path, reader: &Path) {
    run("mount", &["--bind", s(writer), s(reader)]);
    run("mount", &["-o", "remount,bind,ro", s(reader)]);
}

fn opts(writer: &Path, reader: &Path, reclaim: Option<&str>) -> QualifyOptions {
    QualifyOptions {
        writer_path: writer.to_path_buf(),
        reader_path: reader.to_path_buf(),
        reclaim_policy: reclaim.map(str::to_string),
        payload_bytes: 4 * MIB + 7,
        reader_wait: Duration::from_secs(2),
        keep: false,
    }
}

fn show(r: &QualifyReport) {
    println!("{}", r.render_text());
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

fn assert_qualified(r: &QualifyReport) {
    show(r);
    assert!(r.qualified, "not qualified");
    assert!(r.proofs.iter().all(|p| p.passed));
    assert_eq!(r.writer_sha256.as_deref(), Some(r.expected_sha256.as_str()));
    assert_eq!(r.reader_sha256.as_deref(), Some(r.expected_sha256.as_str()));
    for probe in [
        "create", "append", "rename", "chmod", "truncate", "unlink", "mkdir",
    ] {
        let got = r
            .probes
            .iter()
            .find(|(n, _)| n == probe)
            .map(|(_, o)| o.as_str());
        assert_eq!(got, Some("EROFS"), "{probe}");
    }
    assert!(
        r.proofs[0].detail.contains("exited 0"),
        "a separate writer process ran: {}",
        r.proofs[0].detail
    );
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
}

#[test]
fn qualify_on_tmpfs() {
    if !is_inner("qualify_on_tmpfs") {
        rerun_in_unshare(
            "qualify_on_tmpfs",
            PRIVATE_MOUNTS,
            "mount namespaces and mounts",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let w = mkdir(&base, "writer");
    let r = mkdir(&base, "reader");
    run("mount", &["-t", "tmpfs", "-o", "size=64m", "tmpfs", s(&w)]);
    bind_ro(&w, &r);

    // The four proofs pass on a read-only view of the writer's file system.
    let report = qualify(&opts(&w, &r, Some("Retain")), &launcher()).unwrap();
    assert_qualified(&report);
    assert!(
        entries(&w).is_empty(),
        "run directory removed: {:?}",
        entries(&w)
    );

    // Reclaim policy Delete or unknown: not qualified, only proof 4 fails.
    for policy in [Some("Delete"), None] {
        let report = qualify(&opts(&w, &r, policy), &launcher()).unwrap();
        show(&report);
        assert!(!report.qualified);
        assert_eq!(
            report.proofs.iter().map(|p| p.passed).collect::<Vec<_>>(),
            vec![true, true, true, false]
        );
    }

    // A writable reader (bind mount without ro): proof 3 fails, and the probes left nothing.
    let rw = mkdir(&base, "reader-rw");
    run("mount", &["--bind", s(&w), s(&rw)]);
    let report = qualify(&opts(&w, &rw, Some("Retain")), &launcher()).unwrap();
    show(&report);
    assert!(!report.qualified);
    assert!(!report.proofs[2].passed);
    assert!(
        report.proofs[2].detail.contains("create=succeeded(undone)"),
        "{}",
        report.proofs[2].detail
    );
    assert!(entries(&w).is_empty(), "{:?}", entries(&w));

    // A reader on a new, empty volume (a fresh dynamic claim): proof 2 fails.
    let other = mkdir(&base, "other");
    run(
        "mount",
        &["-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", s(&other)],
    );
    run("mount", &["-o", "remount,ro", s(&other)]);
    let report = qualify(&opts(&w, &other, Some("Retain")), &launcher()).unwrap();
    show(&report);
    assert!(report.proofs[0].passed);
    assert!(!report.proofs[1].passed);
    assert!(
        report.proofs[1].detail.contains("no payload"),
        "{}",
        report.proofs[1].detail
    );
    assert!(!report.qualified);

    for m in [&other, &rw, &r, &w] {
        run("umount", &[s(m)]);
    }
}

#[test]
fn qualify_on_loop_ext4() {
    if !is_inner("qualify_on_loop_ext4") {
        rerun_in_unshare(
            "qualify_on_loop_ext4",
            PRIVATE_MOUNTS,
            "mount namespaces and mounts",
        );
        return;
    }
    if Command::new("mkfs.ext4").arg("-V").output().is_err() {
        eprintln!("skipped the ext4 part: mkfs.ext4 is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let img = base.join("cache.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    run("mkfs.ext4", &["-q", "-F", s(&img)]);
    let w = mkdir(&base, "writer");
    let r = mkdir(&base, "reader");
    run("mount", &["-o", "loop", s(&img), s(&w)]);
    bind_ro(&w, &r);
    let report = qualify(&opts(&w, &r, Some("Retain")), &launcher()).unwrap();
    assert_qualified(&report);
    assert_eq!(entries(&w), vec!["lost+found".to_string()]);
    run("umount", &[s(&r)]);
    run("umount", &[s(&w)]);
    // The loop device went with the last mount (autoclear): nothing is left attached.
    let out = Command::new("losetup")
        .args(["-j", s(&img)])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "loop device left behind"
    );
}
