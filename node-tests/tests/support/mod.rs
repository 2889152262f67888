//! Helpers shared by the node tests: root detection, fake Kubernetes pod cgroups, and a
//! "fake pod" process in its own mount and network namespaces.
//!
//! Every helper undoes what it did on drop (cgroups removed leaf first, processes killed and
//! reaped); mounts made inside a fake pod's private mount namespace vanish with the process.

#![allow(dead_code)]

pub mod agent;
pub mod stack;

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// True when running as root (uid 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

// `skip` and `SETUP`: one home for the skip log's writer, shared with the agent's tests
// (agent/tests/support/skip.rs). A skip is only for a condition a machine may legitimately have
// (not root, no loop devices, no writable cgroup hierarchy), never a missing tool that `SETUP`
// installs (that fails the test); the inner run of [`rerun_in_unshare`] inherits
// `IC_TEST_SKIP_LOG`.
#[path = "../../../agent/tests/support/skip.rs"]
mod skip_log;
pub use skip_log::{skip, SETUP};

/// Environment variable that marks the inner run of a test re-executed by [`rerun_in_unshare`];
/// its value is the test's name.
pub const INNER: &str = "IC_NODE_TESTS_INNER";

/// True in the run of `test` that [`rerun_in_unshare`] started inside the namespaces.
pub fn is_inner(test: &str) -> bool {
    std::env::var(INNER).as_deref() == Ok(test)
}

/// Runs `test` (this binary's test of that name) again inside `unshare <flags>`, with [`INNER`]
/// set, and asserts that the inner run passed exactly that test. Returns false (recorded as
/// skipped by [`skip`]) when not root (`needs` says what for); panics, naming [`SETUP`], when
/// `unshare` cannot run.
pub fn rerun_in_unshare(test: &str, flags: &[&str], needs: &str) -> bool {
    if !is_root() {
        // "<test binary>::<test>", as cargo names the binary (its file name without the hash)
        let bin = std::env::current_exe()
            .ok()
            .and_then(|e| e.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .map(|s| s.split('-').next().unwrap_or_default().to_string())
            .unwrap_or_default();
        skip(
            &format!("{bin}::{test}"),
            &format!("needs root for {needs} (CI runs as root)"),
        );
        return false;
    }
    let exe = std::env::current_exe().unwrap();
    let out = match Command::new("unshare")
        .args(flags)
        .arg("--")
        .arg(&exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(INNER, test)
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!("{test}: cannot run unshare (util-linux: {e}): run {SETUP}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- inner stdout\n{stdout}\n--- inner stderr\n{stderr}");
    assert!(out.status.success(), "inner run failed: {}", out.status);
    assert!(
        stdout.contains("1 passed"),
        "the inner run did not run {test}"
    );
    true
}

/// True when `cmd` runs (`cmd --version` or `cmd -V` exits at all).
pub fn have(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .or_else(|_| {
            Command::new(cmd)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
        })
        .is_ok()
}

/// Runs a command, panicking with its output when it fails.
pub fn sh(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A kubepods cgroup made for the test in one hierarchy; removed (leaf first) on drop.
pub struct PodCgroup {
    dirs: Vec<PathBuf>,
    root: PathBuf,
    leaf: PathBuf,
}

impl PodCgroup {
    /// Creates `root/<rel>` (each component) and moves `pid` into it; `None` when this host's
    /// cgroup file system does not allow it.
    pub fn create(root: &Path, rel: &[String], pid: u32) -> Option<Self> {
        let mut dirs = Vec::new();
        let mut path = root.to_path_buf();
        for comp in rel {
            path.push(comp);
            if !path.exists() {
                if let Err(e) = std::fs::create_dir(&path) {
                    eprintln!("cannot create {}: {e}", path.display());
                    drop(PodCgroup {
                        dirs,
                        root: root.to_path_buf(),
                        leaf: path.clone(),
                    });
                    return None;
                }
                dirs.push(path.clone());
            }
        }
        let cg = PodCgroup {
            dirs,
            root: root.to_path_buf(),
            leaf: path.clone(),
        };
        match std::fs::write(path.join("cgroup.procs"), pid.to_string()) {
            Ok(()) => Some(cg),
            Err(e) => {
                eprintln!("cannot move {pid} into {}: {e}", path.display());
                None
            }
        }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        // move whatever is still inside back to the hierarchy's root
        if let Ok(procs) = std::fs::read_to_string(self.leaf.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
            }
        }
        for d in self.dirs.iter().rev() {
            for _ in 0..100 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Mount points of this process's cgroup hierarchies: (v1 super options or "cgroup2", dir).
pub fn cgroup_mounts() -> Vec<(String, PathBuf)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mp = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fs = r.next()?;
            let opts = r.nth(1).unwrap_or("");
            match fs {
                "cgroup2" => Some(("cgroup2".to_string(), PathBuf::from(mp))),
                "cgroup" => Some((opts.to_string(), PathBuf::from(mp))),
                _ => None,
            }
        })
        .collect()
}

/// The runtime ID of the fake pod's one container: its cgroup leaf is named after it, as
/// containerd names a container's (`cri-containerd-<id>.scope`, or `<id>` under cgroupfs).
pub const FAKE_CONTAINER_ID: &str =
    "5e0f8a3c2b1d4e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f";

/// Puts `pid` into a kubepods cgroup for `uid` (its container's, [`FAKE_CONTAINER_ID`]) in every
/// hierarchy that allows it (cgroupfs form in v1 `pids`, systemd form in cgroup2 and v1
/// `name=systemd`). Empty when none did.
pub fn pod_cgroups(uid: &str, pid: u32) -> Vec<PodCgroup> {
    let mut out = Vec::new();
    for (kind, root) in cgroup_mounts() {
        let opts: Vec<&str> = kind.split(',').collect();
        let systemd_form = vec![
            "kubepods.slice".to_string(),
            "kubepods-besteffort.slice".to_string(),
            format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")),
            format!("cri-containerd-{FAKE_CONTAINER_ID}.scope"),
        ];
        let cgroupfs_form = vec![
            "kubepods".to_string(),
            "besteffort".to_string(),
            format!("pod{uid}"),
            FAKE_CONTAINER_ID.to_string(),
        ];
        let rel = if kind == "cgroup2" || opts.contains(&"name=systemd") {
            systemd_form
        } else if opts.contains(&"pids") {
            cgroupfs_form
        } else {
            continue;
        };
        if let Some(cg) = PodCgroup::create(&root, &rel, pid) {
            out.push(cg);
        }
    }
    out
}

/// A process standing in for a Kubernetes pod: this test binary running `child_test` under
/// `unshare <flags>`, placed in kubepods cgroups for `uid`. When this host allows no cgroup,
/// [`FakePod::proc_root`] is a directory that mirrors `/proc` for the process with a fake
/// `cgroup` file (links to `/proc/<pid>/root`, `mountinfo`, `ns`, `exe`), so the agent still
/// finds it by UID.
pub struct FakePod {
    pub child: Child,
    pub pid: u32,
    pub uid: String,
    /// Lines the child printed before `READY`, and the READY line's words.
    pub ready: Vec<String>,
    pub proc_root: PathBuf,
    cgroups: Vec<PodCgroup>,
    fake_root: Option<tempfile::TempDir>,
    _stdout: Lines<BufReader<ChildStdout>>,
}

impl FakePod {
    /// Starts the pod and waits (up to 60 s) for the child to print `READY …`.
    pub fn start(child_test: &str, flags: &[&str], env: &[(&str, String)], uid: &str) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new("unshare");
        cmd.args(flags)
            .arg("--")
            .arg(&exe)
            .args(["--exact", child_test, "--nocapture", "--test-threads=1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        let ready = loop {
            assert!(Instant::now() < deadline, "fake pod did not get ready");
            let line = match lines.next() {
                Some(Ok(l)) => l,
                _ => {
                    let _ = child.kill();
                    let st = child.wait();
                    panic!("fake pod exited before READY: {st:?}");
                }
            };
            println!("pod: {line}");
            // libtest prints "test <name> ... " on the same line
            if let Some(i) = line.find("READY") {
                break line[i..].split_whitespace().map(str::to_string).collect();
            }
        };
        let cgroups = pod_cgroups(uid, pid);
        let (proc_root, fake_root) = if cgroups.is_empty() {
            eprintln!(
                "note: no writable cgroup hierarchy here; the pod is found through a mirror of \
                 /proc with a fake kubepods cgroup file"
            );
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join(pid.to_string());
            std::fs::create_dir(&p).unwrap();
            std::fs::write(
                p.join("cgroup"),
                format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{FAKE_CONTAINER_ID}.scope\n", uid.replace('-', "_")),
            )
            .unwrap();
            for link in ["root", "mountinfo", "ns", "exe"] {
                std::os::unix::fs::symlink(format!("/proc/{pid}/{link}"), p.join(link)).unwrap();
            }
            std::os::unix::fs::symlink("/proc/self", d.path().join("self")).unwrap();
            (d.path().to_path_buf(), Some(d))
        } else {
            (PathBuf::from("/proc"), None)
        };
        FakePod {
            child,
            pid,
            uid: uid.to_string(),
            ready,
            proc_root,
            cgroups,
            fake_root,
            _stdout: lines,
        }
    }

    /// True when the pod is in real kubepods cgroups (found through the real `/proc`).
    pub fn in_real_cgroups(&self) -> bool {
        !self.cgroups.is_empty()
    }

    /// Sends a signal (`STOP`, `CONT`, …) to the pod's process.
    pub fn signal(&self, s: &str) {
        signal(self.pid, s);
    }

    /// Ends the pod (stdin closed, then killed if needed) and removes its cgroups.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            signal(self.pid, "CONT");
        }
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        self.cgroups.clear();
        self.fake_root.take();
    }
}

impl Drop for FakePod {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// `kill -<sig> <pid>` (util-linux or procps `kill`).
pub fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// Waits until `cond` holds (up to `secs`), polling.
pub fn eventually(secs: u64, what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
