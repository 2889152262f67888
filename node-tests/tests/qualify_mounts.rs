//! `ic-agent qualify` (spec 004 "Qualification") on real kernel mounts, as root, in a private
//! mount namespace. The writer process (this test binary re-executed as `writer_child`) runs in
//! a mount namespace of its own (`unshare -m`), as a writer pod does: it mounts its volume
//! there, fills it and exits, and its mount goes with it — only then does proof 1 read the
//! payload back, through the reader. A loop-mounted ext4 survives that and qualifies; a tmpfs
//! does not: its mount never goes away when the writer shares it, and its data goes with the
//! writer's namespace when the writer mounts it. A reader on the writer's own mount fails
//! proof 2.
//!
//! The outer test re-runs this binary under `unshare -m --propagation private` with
//! `IC_NODE_TESTS_INNER=<test>`; mounts vanish with the namespace, loop devices are detached
//! (autoclear) and the temp dirs removed, so nothing is left behind. Recorded as
//! skipped (`support::skip`) when not root; fails, naming scripts/setup.sh, when `unshare` or
//! mkfs.ext4 is missing.

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

/// The writer in this (the test's) mount namespace: its mount stays after it exits.
fn launcher() -> WriterLauncher {
    WriterLauncher::Exec {
        program: std::env::current_exe().unwrap(),
        args: ["--exact", "writer_child", "--nocapture", "--test-threads=1"]
            .into_iter()
            .map(Into::into)
            .collect(),
    }
}

/// The writer in a mount namespace of its own where `mount_cmd` (a shell command; `$W` is the
/// writer path) mounts its volume at the writer path: when it exits, its mount is gone.
fn own_namespace_launcher(mount_cmd: &str, writer: &Path) -> WriterLauncher {
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "W=\"$1\"; {mount_cmd} && exec \"$2\" --exact writer_child --nocapture --test-threads=1"
    );
    WriterLauncher::Exec {
        program: "unshare".into(),
        args: [
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
            "sh",
            s(writer),
            exe.to_str().unwrap(),
        ]
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
        provisioner: Some("loop.node-tests.local".into()),
        storage_class: Some("node-tests-retain".into()),
        payload_bytes: 4 * MIB + 7,
        reader_wait: Duration::from_secs(2),
        writer_teardown_wait: Duration::from_secs(1),
        keep: false,
    }
}

fn passed(r: &QualifyReport) -> Vec<bool> {
    r.proofs.iter().map(|p| p.passed).collect()
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
    assert!(r.writer_mount_gone);
    assert_ne!(r.writer_mount, r.reader_mount);
    assert_eq!(r.reader_sha256.as_deref(), Some(r.expected_sha256.as_str()));
    assert_eq!(r.provisioner.as_deref(), Some("loop.node-tests.local"));
    assert_eq!(r.storage_class.as_deref(), Some("node-tests-retain"));
    assert!(r.facts_source.contains("typed"));
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

    // A tmpfs the writer mounts in its own namespace: the data goes with the writer's mount.
    // The reader (a read-only bind of the writer directory here) never sees it: proof 1 fails.
    bind_ro(&w, &r);
    let own = own_namespace_launcher("mount -t tmpfs -o size=64m tmpfs \"$W\"", &w);
    let report = qualify(&opts(&w, &r, Some("Retain")), &own).unwrap();
    show(&report);
    assert!(!report.qualified);
    assert!(report.writer_mount_gone);
    assert!(!report.proofs[0].passed);
    assert!(
        report.proofs[0].detail.contains("did not survive"),
        "{}",
        report.proofs[0].detail
    );
    run("umount", &[s(&r)]);

    // A tmpfs shared with the writer: its mount never goes away, so persistence past the
    // writer is not shown — proof 1 fails although every byte is there; the rest passes.
    run("mount", &["-t", "tmpfs", "-o", "size=64m", "tmpfs", s(&w)]);
    bind_ro(&w, &r);
    let report = qualify(&opts(&w, &r, Some("Retain")), &launcher()).unwrap();
    show(&report);
    assert_eq!(passed(&report), vec![false, true, true, true]);
    assert!(!report.writer_mount_gone);
    assert!(
        report.proofs[0]
            .detail
            .contains("still reachable through the writer path"),
        "{}",
        report.proofs[0].detail
    );
    assert_eq!(
        report.reader_sha256.as_deref(),
        Some(report.expected_sha256.as_str())
    );
    assert!(
        entries(&w).is_empty(),
        "run directory removed: {:?}",
        entries(&w)
    );

    // The reader on the writer's own mount: proof 2 fails.
    let report = qualify(&opts(&w, &w, Some("Retain")), &launcher()).unwrap();
    show(&report);
    assert!(!report.proofs[1].passed);
    assert!(
        report.proofs[1].detail.contains("the writer's own mount"),
        "{}",
        report.proofs[1].detail
    );

    // A writable reader (bind mount without ro): proof 3 fails, and the probes left nothing.
    let rw = mkdir(&base, "reader-rw");
    run("mount", &["--bind", s(&w), s(&rw)]);
    let report = qualify(&opts(&w, &rw, Some("Retain")), &launcher()).unwrap();
    show(&report);
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
    assert!(
        Command::new("mkfs.ext4").arg("-V").output().is_ok(),
        "mkfs.ext4 (e2fsprogs) is missing: run {}",
        support::SETUP
    );
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let img = base.join("cache.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    run("mkfs.ext4", &["-q", "-F", s(&img)]);
    // The volume: the file system on the loop device, mounted here (as the node keeps a CSI
    // volume attached); the reader is a read-only bind of it; the writer mounts the same file
    // system in its own namespace and its mount goes when it exits.
    let vol = mkdir(&base, "volume");
    let w = mkdir(&base, "writer");
    let r = mkdir(&base, "reader");
    run("mount", &["-o", "loop", s(&img), s(&vol)]);
    bind_ro(&vol, &r);
    let own = own_namespace_launcher(&format!("mount --bind {} \"$W\"", s(&vol)), &w);
    let report = qualify(&opts(&w, &r, Some("Retain")), &own).unwrap();
    assert_qualified(&report);
    assert!(entries(&w).is_empty(), "the writer's mount is gone here");
    assert_eq!(
        entries(&vol),
        vec!["lost+found".to_string()],
        "the clean-up writer removed the run directory"
    );
    // Reclaim policy Delete or unknown: not qualified, only proof 4 fails.
    for policy in [Some("Delete"), None] {
        let report = qualify(&opts(&w, &r, policy), &own).unwrap();
        show(&report);
        assert!(!report.qualified);
        assert_eq!(passed(&report), vec![true, true, true, false]);
    }
    run("umount", &[s(&r)]);
    run("umount", &[s(&vol)]);
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
