//! `mounts`: model-cache volumes as reader pods see them (spec 004 "Qualification").
//!
//! For every `readerMounts[]` entry of the plan the agent looks at the volume through the
//! reader pod's mount namespace: the pod's processes are found by UID ([`super::pods`]) and the
//! path is resolved through `<proc_root>/<pid>/root/<path>` (one view per container; a container
//! where the path is not a mount point does not mount the volume). Without a pod UID the path
//! is looked up in the agent's own mount namespace. For each view:
//!
//! 1. `<proc_root>/<pid>/mountinfo`: the mount at the path must carry `ro` (per mount or
//!    super-block);
//! 2. write probes, each of which must fail with `EROFS`, and none of which may disturb a
//!    reader if the volume turns out writable (the check runs every few seconds on production
//!    volumes): `create` (a new name, `O_CREAT|O_EXCL`, removed again), `append`
//!    (`O_WRONLY|O_APPEND` on an existing file, nothing written), `rename` and `unlink` (of a
//!    name that does not exist: the kernel checks write access to the mount before it looks the
//!    name up, so a read-only mount answers `EROFS` and a writable one `ENOENT`), `chmod` (an
//!    existing file to its current mode), `truncate` (to its current length), `mkdir` (a new
//!    name, removed again). `ftruncate` on a read-only descriptor is also recorded: it fails
//!    with `EINVAL` on any mount and proves nothing. `EEXIST` (the new name exists) and
//!    `EACCES`/`EPERM` (an agent without root) are inconclusive;
//! 3. the SHA-256 of every planned sample file must equal the writer's digest (digests are
//!    cached by inode, size and mtime, so a large file is hashed once).
//!
//! Every file is opened beneath the volume's root ([`super::beneath`]: `openat2` with
//! `RESOLVE_BENEATH`): a sample or probe file reached through a symbolic link out of the volume
//! is neither hashed nor probed — its sample reads unreadable ("leads out of the volume").
//!
//! One result per planned mount, subject `<namespace>/<pod>:<path>` (one `host` result
//! `NoReaderMounts`, Ok, when the plan has none). Reasons (see `docs/checks.md`): `ReaderVolumeReadOnly`, `ReaderVolumeMounted`, `ReaderVolumeWritable`,
//! `ReaderVolumeDigestMismatch`, `ReaderVolumeMissing`, `PodNotFound`.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, ReaderMount};
use parking_lot::Mutex;

use nix::fcntl::OFlag;

use super::beneath::{self, Volume};
use super::pods::{is_sandbox_exe, short_id, PodContainer, PodFinder};
use super::shm::{find_mount, parse_mountinfo, MountEntry};
use super::{Check, ChecksConfig};

/// Check name.
pub const NAME: &str = "mounts";

/// The write probes, in the order they run.
pub const PROBES: [&str; 8] = [
    "create",
    "append",
    "chmod",
    "truncate",
    "ftruncate",
    "rename",
    "unlink",
    "mkdir",
];

/// What one write probe got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Refused with this errno (`EROFS` is the expected one).
    Refused(i32),
    /// The write went through; `undo` says whether it was undone (`Err` with the reason when
    /// undoing failed).
    Succeeded {
        /// Result of undoing the change.
        undo: Result<(), String>,
    },
    /// Not run (no existing file to probe, …).
    Skipped(&'static str),
}

impl ProbeOutcome {
    /// True when the outcome shows the mount accepts writes: a probe that succeeded, or
    /// `rename`/`unlink` of a missing name answered with `ENOENT` (the kernel checks write
    /// access to the mount before looking the name up).
    pub fn shows_writable(&self, probe: &str) -> bool {
        match self {
            ProbeOutcome::Succeeded { .. } => true,
            ProbeOutcome::Refused(e) => {
                (probe == "unlink" || probe == "rename") && *e == libc::ENOENT
            }
            ProbeOutcome::Skipped(_) => false,
        }
    }
}

impl fmt::Display for ProbeOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeOutcome::Refused(e) => f.write_str(errno_name(*e)),
            ProbeOutcome::Succeeded { undo: Ok(()) } => f.write_str("succeeded(undone)"),
            ProbeOutcome::Succeeded { undo: Err(_) } => f.write_str("succeeded(NOT undone)"),
            ProbeOutcome::Skipped(why) => write!(f, "skipped({why})"),
        }
    }
}

/// Symbolic name of the errnos the probes meet (`EROFS`, `EACCES`, …), or `errno<N>`.
pub fn errno_name(e: i32) -> &'static str {
    match e {
        libc::EROFS => "EROFS",
        libc::EACCES => "EACCES",
        libc::EPERM => "EPERM",
        libc::EEXIST => "EEXIST",
        libc::EINVAL => "EINVAL",
        libc::ENOENT => "ENOENT",
        libc::EBUSY => "EBUSY",
        libc::EISDIR => "EISDIR",
        libc::ENOSPC => "ENOSPC",
        libc::EDQUOT => "EDQUOT",
        libc::ENOTDIR => "ENOTDIR",
        libc::EXDEV => "EXDEV",
        libc::ETXTBSY => "ETXTBSY",
        libc::EIO => "EIO",
        _ => "errnoOther",
    }
}

fn outcome<T>(r: io::Result<T>, undo: impl FnOnce(T) -> io::Result<()>) -> ProbeOutcome {
    match r {
        Ok(v) => ProbeOutcome::Succeeded {
            undo: undo(v).map_err(|e| e.to_string()),
        },
        Err(e) => ProbeOutcome::Refused(e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

static PROBE_SEQ: AtomicU64 = AtomicU64::new(0);

fn probe_name(kind: &str) -> String {
    format!(
        ".ic-agent-probe-{}-{}-{kind}",
        std::process::id(),
        PROBE_SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs every write probe against the directory `dir` (as the agent sees it, e.g. through
/// `/proc/<pid>/root`), using `file` (an existing regular file under `dir`, absolute or
/// relative to it) for the probes that need one. Anything a probe changes is undone at once.
/// Every path is resolved beneath `dir` ([`Volume`]): a file reached through a symbolic link
/// out of the volume is not touched (its probes read `Skipped`).
pub fn write_probes(dir: &Path, file: Option<&Path>) -> Vec<(&'static str, ProbeOutcome)> {
    match Volume::open(dir) {
        Ok(volume) => {
            let rel = file.map(|f| f.strip_prefix(dir).unwrap_or(f));
            write_probes_in(&volume, rel)
        }
        Err(_) => PROBES
            .iter()
            .map(|p| (*p, ProbeOutcome::Skipped("volume root unreadable")))
            .collect(),
    }
}

/// [`write_probes`] on an open volume, `file` relative to its root.
pub fn write_probes_in(volume: &Volume, file: Option<&Path>) -> Vec<(&'static str, ProbeOutcome)> {
    let mut out = Vec::with_capacity(PROBES.len());
    // create: a new name, exclusive
    let created = probe_name("create");
    out.push((
        "create",
        outcome(volume.create_new(&created), |f| {
            drop(f);
            volume.unlink(&created)
        }),
    ));
    let opened = file.map(|f| volume.open_file(f, OFlag::O_RDONLY));
    match (file, opened) {
        (Some(file), Some(Ok(ro))) => {
            // append: open for writing, write nothing
            out.push((
                "append",
                outcome(
                    volume.open_file(file, OFlag::O_WRONLY | OFlag::O_APPEND),
                    |f| {
                        drop(f);
                        Ok(())
                    },
                ),
            ));
            // chmod and truncate: to what the file already has
            match ro.metadata() {
                Ok(meta) => {
                    let mode = meta.permissions().mode() & 0o7777;
                    out.push((
                        "chmod",
                        outcome(
                            nix::sys::stat::fchmod(
                                &ro,
                                nix::sys::stat::Mode::from_bits_truncate(mode),
                            )
                            .map_err(io::Error::from),
                            |()| Ok(()),
                        ),
                    ));
                    let len = i64::try_from(meta.len()).unwrap_or(i64::MAX);
                    out.push((
                        "truncate",
                        outcome(
                            volume.open_file(file, OFlag::O_WRONLY).and_then(|f| {
                                nix::unistd::ftruncate(&f, len).map_err(io::Error::from)
                            }),
                            |()| Ok(()),
                        ),
                    ));
                    out.push((
                        "ftruncate",
                        outcome(
                            nix::unistd::ftruncate(&ro, len).map_err(io::Error::from),
                            |()| Ok(()),
                        ),
                    ));
                }
                Err(_) => {
                    for p in ["chmod", "truncate", "ftruncate"] {
                        out.push((p, ProbeOutcome::Skipped("file unreadable")));
                    }
                }
            }
        }
        (Some(_), Some(Err(e))) => {
            let why = if beneath::is_escape(&e) {
                "file outside the volume"
            } else {
                "file unreadable"
            };
            for p in ["append", "chmod", "truncate", "ftruncate"] {
                out.push((p, ProbeOutcome::Skipped(why)));
            }
        }
        _ => {
            for p in ["append", "chmod", "truncate", "ftruncate"] {
                out.push((p, ProbeOutcome::Skipped("no file")));
            }
        }
    }
    // rename: a name that does not exist (nothing of the volume moves, even if writable)
    let from = probe_name("rename");
    let to = probe_name("renamed");
    out.push((
        "rename",
        outcome(volume.rename(&from, &to), |()| volume.rename(&to, &from)),
    ));
    // unlink: a name that does not exist
    out.push((
        "unlink",
        outcome(volume.unlink(&probe_name("unlink")), |()| Ok(())),
    ));
    // mkdir: a new name, removed again
    let made = probe_name("mkdir");
    out.push((
        "mkdir",
        outcome(volume.mkdir(&made), |()| volume.rmdir(&made)),
    ));
    out
}

/// Joins a sample's relative path to the mount's path; `None` for an absolute path or one
/// with `..` (a plan must not make the agent read outside the volume).
pub fn sample_path(mount: &Path, file: &str) -> Option<PathBuf> {
    let rel = Path::new(file);
    if rel
        .components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && !file.is_empty()
    {
        Some(mount.join(rel))
    } else {
        None
    }
}

/// SHA-256 of a file as 64 lower-case hex digits.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    sha256_of(&mut std::fs::File::open(path)?)
}

/// SHA-256 of what `f` reads, as 64 lower-case hex digits.
pub fn sha256_of(f: &mut impl Read) -> io::Result<String> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    Ok(hex::encode(ctx.finish().as_ref()))
}

/// Digest cache key: device, inode, size, mtime (ns).
type FileKey = (u64, u64, u64, i64, i64);

/// What a sample file looked like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SampleState {
    /// The content's SHA-256.
    Digest(String),
    /// The file could not be read (`ENOENT` …) or the plan's path is not inside the volume.
    Unreadable(String),
    /// Opening the file was refused by its permissions (`EACCES`/`EPERM`): says nothing about
    /// the content. An agent without `CAP_DAC_READ_SEARCH` meets this on a file another uid
    /// may read alone (docs/checks.md "Capabilities").
    Denied(String),
}

/// What one container shows of a planned mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountView {
    /// Process the view was taken through (`None`: the agent itself).
    pub pid: Option<u32>,
    /// The mountinfo entry whose mount point is the planned path (`None`: not mounted there).
    pub mount: Option<MountEntry>,
    /// Why mountinfo could not be read, if it could not.
    pub mountinfo_error: Option<String>,
    /// Why the mounted volume's root could not be opened, if it could not (the mount is there,
    /// its state is not known).
    pub open_error: Option<String>,
    /// Write probes (empty when the volume is missing or not expected read-only).
    pub probes: Vec<(&'static str, ProbeOutcome)>,
    /// Planned samples: (relative path, expected digest, state).
    pub samples: Vec<(String, String, SampleState)>,
}

/// The pure decision for one planned mount from one container's view.
pub fn evaluate_view(subject: &str, plan: &ReaderMount, view: &MountView) -> CheckResult {
    let path = &plan.path;
    let who = format!("pod {}/{}", plan.namespace, plan.pod);
    let binding = if plan.binding.is_empty() {
        String::new()
    } else {
        format!(" (model cache {})", plan.binding)
    };
    let r = |status, reason: &str, message: String| {
        let mut r = CheckResult::new(NAME, subject, status, reason, message)
            .with("path", path)
            .with("expectReadOnly", plan.expect_read_only);
        if let Some(uid) = &plan.pod_uid {
            r = r.with("podUid", uid);
        }
        if let Some(pid) = view.pid {
            r = r.with("pid", pid);
        }
        if let Some(e) = &view.mountinfo_error {
            r = r.with("mountinfoError", e);
        }
        r
    };
    if view.mount.is_none() {
        if let Some(e) = &view.mountinfo_error {
            return r(
                CheckStatus::Unknown,
                "ReaderVolumeUnobservable",
                format!(
                    "cannot read the mount table of {who}{binding} ({e}), so whether {path} is \
                     mounted is unknown."
                ),
            );
        }
    }
    if let (Some(_), Some(e)) = (&view.mount, &view.open_error) {
        return r(
            CheckStatus::Unknown,
            "ReaderVolumeUnreadable",
            format!(
                "{path} is mounted in {who}{binding}, but the agent cannot open it ({e}): whether \
                 it is read-only and what it holds are unknown. An agent without \
                 CAP_DAC_READ_SEARCH, or a network filesystem that squashes root, refuses it: \
                 grant the capability in agent.securityContext.capabilities.add, or make the \
                 volume root world-searchable."
            ),
        )
        .with("openError", e);
    }
    let Some(m) = &view.mount else {
        return r(
            CheckStatus::Critical,
            "ReaderVolumeMissing",
            format!(
                "nothing is mounted at {path} in {who}{binding}; the engine would load the model \
                 from the container image or fail. Check the pod's volumeMounts."
            ),
        );
    };
    let mut findings: Vec<(CheckStatus, &str, String)> = Vec::new();
    let writable: Vec<String> = view
        .probes
        .iter()
        .filter(|(p, o)| o.shows_writable(p))
        .map(|(p, o)| format!("{p} {o}"))
        .collect();
    let not_undone = view
        .probes
        .iter()
        .any(|(_, o)| matches!(o, ProbeOutcome::Succeeded { undo: Err(_) }));
    if plan.expect_read_only && (!m.read_only() || !writable.is_empty()) {
        let flag = if m.read_only() {
            "is mounted read-only".to_string()
        } else {
            format!("is mounted read-write ({})", m.mount_options)
        };
        let probes = if writable.is_empty() {
            String::new()
        } else {
            format!(
                " and accepts writes ({}{})",
                writable.join(", "),
                if not_undone {
                    "; some changes could NOT be undone"
                } else {
                    "; every change was undone"
                }
            )
        };
        findings.push((
            CheckStatus::Critical,
            "ReaderVolumeWritable",
            format!(
                "{path} in {who}{binding} {flag}{probes}; a reader can corrupt the shared model \
                 cache for every pod. Mount it with readOnly: true."
            ),
        ));
    }
    let bad: Vec<String> = view
        .samples
        .iter()
        .filter_map(|(file, want, got)| match got {
            SampleState::Digest(d) if d.eq_ignore_ascii_case(want) => None,
            SampleState::Digest(d) => {
                Some(format!("{file} has SHA-256 {d}, the writer's is {want}"))
            }
            SampleState::Unreadable(e) => Some(format!("{file} cannot be read ({e})")),
            SampleState::Denied(_) => None,
        })
        .collect();
    let denied: Vec<String> = view
        .samples
        .iter()
        .filter_map(|(file, _, got)| match got {
            SampleState::Denied(e) => Some(format!("{file} ({e})")),
            _ => None,
        })
        .collect();
    if !bad.is_empty() {
        findings.push((
            CheckStatus::Critical,
            "ReaderVolumeDigestMismatch",
            format!(
                "{path} in {who}{binding} does not hold what the writer wrote: {}; the volume is \
                 stale, partial or another one. Re-run the writer or fix the binding.",
                bad.join("; ")
            ),
        ));
    }
    if !denied.is_empty() {
        // Permissions, not content: Unknown, and which capability would read it.
        let advice =
            crate::privilege::lacking_clause(&[crate::privilege::Capability::CAP_DAC_READ_SEARCH])
                .unwrap_or_else(|| "the file's permissions refuse the agent".to_string());
        findings.push((
            CheckStatus::Unknown,
            "ReaderVolumeSampleUnreadable",
            format!(
                "{path} in {who}{binding}: the agent may not read {}, so the digests cannot \
                 be compared; {advice}.",
                denied.join(", ")
            ),
        ));
    }
    let (status, reason, message) = if findings.is_empty() {
        let checked = if view.samples.is_empty() {
            String::new()
        } else {
            format!(
                ", and its {} sample file(s) match the writer's digests",
                view.samples.len()
            )
        };
        if plan.expect_read_only {
            (
                CheckStatus::Ok,
                "ReaderVolumeReadOnly",
                format!(
                    "{path} in {who}{binding} is mounted read-only ({} {}) and every write probe \
                     was refused{checked}.",
                    m.fs_type, m.source
                ),
            )
        } else {
            (
                CheckStatus::Ok,
                "ReaderVolumeMounted",
                format!(
                    "{path} in {who}{binding} is mounted ({} {}){checked}.",
                    m.fs_type, m.source
                ),
            )
        }
    } else {
        let status = CheckStatus::worst(findings.iter().map(|f| f.0));
        let reason = findings
            .iter()
            .find(|f| f.0 == status)
            .map(|f| f.1)
            .unwrap_or("ReaderVolumeWritable");
        let message = findings
            .iter()
            .map(|f| f.2.as_str())
            .collect::<Vec<_>>()
            .join(" ");
        (status, reason, message)
    };
    let mut result = r(status, reason, message)
        .with("fsType", &m.fs_type)
        .with("mountSource", &m.source)
        .with("mountOptions", &m.mount_options)
        .with("readOnlyFlag", m.read_only());
    if !view.probes.is_empty() {
        result = result.with(
            "probes",
            view.probes
                .iter()
                .map(|(p, o)| format!("{p}={o}"))
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    if !view.samples.is_empty() {
        let ok = view
            .samples
            .iter()
            .filter(|(_, want, got)| matches!(got, SampleState::Digest(d) if d.eq_ignore_ascii_case(want)))
            .count();
        result = result
            .with("samples", view.samples.len())
            .with("samplesMatching", ok);
    }
    result
}

/// The `mounts` check.
#[derive(Debug)]
pub struct MountsCheck {
    proc_root: PathBuf,
    pods: Arc<PodFinder>,
    digests: Mutex<HashMap<PathBuf, (FileKey, String)>>,
}

impl MountsCheck {
    /// Reads `cfg.proc_root`.
    pub fn new(cfg: &ChecksConfig) -> Self {
        Self::with_finder(cfg, Arc::new(PodFinder::new(&cfg.proc_root)))
    }

    /// Like [`MountsCheck::new`], sharing a pod finder with other checks.
    pub fn with_finder(cfg: &ChecksConfig, pods: Arc<PodFinder>) -> Self {
        MountsCheck {
            proc_root: cfg.proc_root.clone(),
            pods,
            digests: Mutex::new(HashMap::new()),
        }
    }

    /// The digest of `rel` beneath `volume` (`path` is its full name, the cache's key). A
    /// symbolic link out of the volume is not followed.
    fn digest(&self, volume: &Volume, rel: &Path, path: &Path) -> SampleState {
        let mut f = match volume.open_file(rel, OFlag::O_RDONLY) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return SampleState::Denied(beneath::describe(&e))
            }
            Err(e) => return SampleState::Unreadable(beneath::describe(&e)),
        };
        let meta = match f.metadata() {
            Ok(m) if m.is_file() => m,
            Ok(_) => return SampleState::Unreadable("not a regular file".into()),
            Err(e) => return SampleState::Unreadable(e.to_string()),
        };
        let key: FileKey = (
            meta.dev(),
            meta.ino(),
            meta.size(),
            meta.mtime(),
            meta.mtime_nsec(),
        );
        if let Some((k, d)) = self.digests.lock().get(path) {
            if *k == key {
                return SampleState::Digest(d.clone());
            }
        }
        match sha256_of(&mut f) {
            Ok(d) => {
                let mut cache = self.digests.lock();
                if cache.len() > 4096 {
                    cache.clear();
                }
                cache.insert(path.to_path_buf(), (key, d.clone()));
                SampleState::Digest(d)
            }
            Err(e) => SampleState::Unreadable(e.to_string()),
        }
    }

    /// Looks at `plan` through the mount namespace of `pid` (`None`: the agent's).
    fn view(&self, plan: &ReaderMount, pid: Option<u32>) -> MountView {
        let inside = Path::new(&plan.path);
        let (mountinfo, target) = match pid {
            Some(pid) => {
                let base = self.proc_root.join(pid.to_string());
                let rel = inside.strip_prefix("/").unwrap_or(inside);
                (base.join("mountinfo"), base.join("root").join(rel))
            }
            None => (
                self.proc_root.join("self").join("mountinfo"),
                inside.to_path_buf(),
            ),
        };
        let mut view = MountView {
            pid,
            mount: None,
            mountinfo_error: None,
            open_error: None,
            probes: Vec::new(),
            samples: Vec::new(),
        };
        // the planned path without trailing slashes or `.` components
        let normal: PathBuf = inside.components().collect();
        match std::fs::read_to_string(&mountinfo) {
            Ok(text) => {
                let mounts = parse_mountinfo(&text);
                view.mount = find_mount(&mounts, &normal)
                    .filter(|m| m.mount_point == normal)
                    .cloned();
            }
            Err(e) => view.mountinfo_error = Some(format!("{}: {e}", mountinfo.display())),
        }
        let volume = match view.mount.as_ref().map(|_| Volume::open(&target)) {
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                // Mounted, but not observable by this agent: never "missing".
                view.open_error = Some(format!("{}: {e}", target.display()));
                return view;
            }
            None => return view,
        };
        let samples: Vec<(String, String, Option<PathBuf>)> = plan
            .samples
            .iter()
            .map(|s| {
                (
                    s.file.clone(),
                    s.sha256.clone(),
                    sample_path(&target, &s.file),
                )
            })
            .collect();
        if plan.expect_read_only {
            // A planned sample that is a regular file beneath the volume, else the first
            // regular file of its root.
            let file = samples
                .iter()
                .filter(|(_, _, p)| p.is_some())
                .map(|(f, _, _)| PathBuf::from(f))
                .find(|rel| {
                    volume
                        .open_file(rel, OFlag::O_RDONLY)
                        .and_then(|f| f.metadata())
                        .is_ok_and(|m| m.is_file())
                })
                .or_else(|| volume.first_regular_file());
            view.probes = write_probes_in(&volume, file.as_deref());
        }
        view.samples = samples
            .into_iter()
            .map(|(file, want, p)| {
                let state = match p {
                    Some(p) => self.digest(&volume, Path::new(&file), &p),
                    None => SampleState::Unreadable("path outside the volume".into()),
                };
                (file, want, state)
            })
            .collect();
        view
    }
}

/// Whether `c` is one of the containers the plan says mount `m` (by runtime ID); with no
/// containers planned (standalone), any container but the pod sandbox.
fn mounts_it(m: &ReaderMount, c: &PodContainer) -> bool {
    if m.containers.is_empty() {
        return !c.exe.as_deref().is_some_and(is_sandbox_exe);
    }
    m.containers
        .iter()
        .any(|p| p.id.is_some() && p.id == c.container_id)
}

/// `Unknown/PodNotFound` for a reader mount none of whose mounting containers runs (the pod
/// still pulling its image or running init containers, or the reader container restarting):
/// the other containers never mount the volume, so they cannot say it is missing.
fn not_running(subject: &str, uid: &str, m: &ReaderMount, running: &[PodContainer]) -> CheckResult {
    let who = if m.containers.is_empty() {
        "its containers (only the pod sandbox runs)".to_string()
    } else {
        let names: Vec<&str> = m.containers.iter().map(|p| p.name.as_str()).collect();
        format!("the container(s) that mount it ({})", names.join(", "))
    };
    CheckResult::new(
        NAME,
        subject,
        CheckStatus::Unknown,
        "PodNotFound",
        format!(
            "{who} of pod {}/{} have no process on this node yet (image pull, init containers, \
             a restart), so the volume at {} cannot be inspected; the pod's other containers do \
             not mount it.",
            m.namespace, m.pod, m.path
        ),
    )
    .with("podUid", uid)
    .with("path", &m.path)
    .with(
        "containersRunning",
        running
            .iter()
            .map(|c| c.container_id.as_deref().map_or("?", short_id))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

impl Check for MountsCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&self, plan: &NodePlan) -> Vec<CheckResult> {
        if plan.reader_mounts.is_empty() {
            return vec![CheckResult::new(
                NAME,
                "host",
                CheckStatus::Ok,
                "NoReaderMounts",
                "the plan has no model-cache reader volume on this node.".to_string(),
            )];
        }
        plan.reader_mounts
            .iter()
            .map(|m| {
                let subject = format!("{}/{}:{}", m.namespace, m.pod, m.path);
                if !Path::new(&m.path).is_absolute() {
                    return CheckResult::new(
                        NAME,
                        &subject,
                        CheckStatus::Unknown,
                        "ReaderVolumeMissing",
                        format!(
                            "the plan's reader path {:?} is not absolute; nothing was inspected.",
                            m.path
                        ),
                    );
                }
                let views: Vec<MountView> = match m.pod_uid.as_deref() {
                    None => vec![self.view(m, None)],
                    Some(uid) => {
                        let containers = self.pods.containers(uid);
                        if containers.is_empty() {
                            return self
                                .pods
                                .unavailable(NAME, &subject, uid, "its model volume")
                                .with("path", &m.path);
                        }
                        let looked: Vec<&PodContainer> =
                            containers.iter().filter(|c| mounts_it(m, c)).collect();
                        if looked.is_empty() {
                            return not_running(&subject, uid, m, &containers);
                        }
                        looked.iter().map(|c| self.view(m, Some(c.pid))).collect()
                    }
                };
                let mounted: Vec<&MountView> = views.iter().filter(|v| v.mount.is_some()).collect();
                let results: Vec<CheckResult> = if mounted.is_empty() {
                    views
                        .first()
                        .map(|v| evaluate_view(&subject, m, v))
                        .into_iter()
                        .collect()
                } else {
                    mounted
                        .iter()
                        .map(|v| evaluate_view(&subject, m, v))
                        .collect()
                };
                let n = views.len();
                let worst = CheckStatus::worst(results.iter().map(|r| r.status));
                results
                    .into_iter()
                    .find(|r| r.status == worst)
                    .map(|r| r.with("containersInspected", n))
                    .unwrap_or_else(|| {
                        CheckResult::new(
                            NAME,
                            &subject,
                            CheckStatus::Unknown,
                            "ReaderVolumeMissing",
                            "no view of the volume could be taken.".to_string(),
                        )
                    })
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::plan::SampleDigest;

    fn ro_mount() -> MountEntry {
        MountEntry {
            mount_point: PathBuf::from("/models"),
            fs_type: "ext4".into(),
            source: "/dev/loop3".into(),
            mount_options: "ro,relatime".into(),
            super_options: "rw".into(),
        }
    }

    fn refused_all() -> Vec<(&'static str, ProbeOutcome)> {
        PROBES
            .iter()
            .map(|p| {
                let e = if *p == "ftruncate" {
                    libc::EINVAL
                } else {
                    libc::EROFS
                };
                (*p, ProbeOutcome::Refused(e))
            })
            .collect()
    }

    fn plan() -> ReaderMount {
        ReaderMount {
            namespace: "team-a".into(),
            pod: "reader-0".into(),
            path: "/models".into(),
            samples: vec![SampleDigest {
                file: "config.json".into(),
                sha256: "AA".into(),
            }],
            ..ReaderMount::default()
        }
    }

    #[test]
    fn verdict_table() {
        use CheckStatus::*;
        let good = MountView {
            pid: Some(42),
            mount: Some(ro_mount()),
            mountinfo_error: None,
            open_error: None,
            probes: refused_all(),
            samples: vec![(
                "config.json".into(),
                "AA".into(),
                SampleState::Digest("aa".into()),
            )],
        };
        type Case = (
            Box<dyn Fn(&mut MountView, &mut ReaderMount)>,
            CheckStatus,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (Box::new(|_, _| {}), Ok, "ReaderVolumeReadOnly"),
            (
                Box::new(|v, _| v.mount = None),
                Critical,
                "ReaderVolumeMissing",
            ),
            (
                // the mount table could not be read: not "missing"
                Box::new(|v, _| {
                    v.mount = None;
                    v.mountinfo_error = Some("/proc/42/mountinfo: No such process".into());
                }),
                Unknown,
                "ReaderVolumeUnobservable",
            ),
            (
                // mounted, but the agent may not open its root (EACCES, root_squash)
                Box::new(|v, _| {
                    v.open_error = Some("/proc/42/root/models: Permission denied".into());
                    v.probes.clear();
                    v.samples.clear();
                }),
                Unknown,
                "ReaderVolumeUnreadable",
            ),
            (
                Box::new(|v, _| {
                    if let Some(m) = v.mount.as_mut() {
                        m.mount_options = "rw,relatime".into();
                    }
                }),
                Critical,
                "ReaderVolumeWritable",
            ),
            (
                Box::new(|v, _| {
                    v.probes[2].1 = ProbeOutcome::Succeeded {
                        undo: Result::Ok(()),
                    }
                }),
                Critical,
                "ReaderVolumeWritable",
            ),
            (
                Box::new(|v, _| v.probes[6].1 = ProbeOutcome::Refused(libc::ENOENT)),
                Critical,
                "ReaderVolumeWritable",
            ),
            (
                // a non-root agent: inconclusive, the ro flag decides
                Box::new(|v, _| v.probes[0].1 = ProbeOutcome::Refused(libc::EACCES)),
                Ok,
                "ReaderVolumeReadOnly",
            ),
            (
                Box::new(|v, _| v.samples[0].2 = SampleState::Digest("bb".into())),
                Critical,
                "ReaderVolumeDigestMismatch",
            ),
            (
                Box::new(|v, _| v.samples[0].2 = SampleState::Unreadable("ENOENT".into())),
                Critical,
                "ReaderVolumeDigestMismatch",
            ),
            (
                // refused by the file's permissions: says nothing about the content
                Box::new(|v, _| v.samples[0].2 = SampleState::Denied("EACCES".into())),
                Unknown,
                "ReaderVolumeSampleUnreadable",
            ),
            (
                // a wrong digest beside a refused one still reads Critical
                Box::new(|v, _| {
                    v.samples[0].2 = SampleState::Denied("EACCES".into());
                    v.samples
                        .push(("b".into(), "AA".into(), SampleState::Digest("cc".into())));
                }),
                Critical,
                "ReaderVolumeDigestMismatch",
            ),
            (
                Box::new(|v, p| {
                    p.expect_read_only = false;
                    v.probes.clear();
                    if let Some(m) = v.mount.as_mut() {
                        m.mount_options = "rw".into();
                    }
                }),
                Ok,
                "ReaderVolumeMounted",
            ),
            (
                // writable and wrong content: both sentences, reason of the first
                Box::new(|v, _| {
                    v.probes[0].1 = ProbeOutcome::Succeeded {
                        undo: Result::Ok(()),
                    };
                    v.samples[0].2 = SampleState::Digest("bb".into());
                }),
                Critical,
                "ReaderVolumeWritable",
            ),
        ];
        for (i, (mutate, status, reason)) in cases.into_iter().enumerate() {
            let mut v = good.clone();
            let mut p = plan();
            mutate(&mut v, &mut p);
            let r = evaluate_view("team-a/reader-0:/models", &p, &v);
            assert_eq!(
                (r.status, r.reason.as_str()),
                (status, reason),
                "case {i}: {r:?}"
            );
        }
        let r = evaluate_view("s", &plan(), &good);
        assert_eq!(
            r.observed["probes"],
            "create=EROFS,append=EROFS,chmod=EROFS,truncate=EROFS,ftruncate=EINVAL,rename=EROFS,unlink=EROFS,mkdir=EROFS"
        );
        assert_eq!(r.observed["samplesMatching"], "1");
        assert_eq!(r.observed["readOnlyFlag"], "true");
    }

    #[test]
    fn sample_paths_stay_inside() {
        let m = Path::new("/proc/1/root/models");
        assert_eq!(
            sample_path(m, "a/config.json"),
            Some(m.join("a/config.json"))
        );
        assert_eq!(sample_path(m, "../etc/shadow"), None);
        assert_eq!(sample_path(m, "/etc/shadow"), None);
        assert_eq!(sample_path(m, ""), None);
    }

    #[test]
    fn probes_on_a_writable_directory_are_undone() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("weights.bin");
        std::fs::write(&file, b"abc").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let before = std::fs::metadata(&file).unwrap();
        let probes = write_probes(dir.path(), Some(&file));
        let names: Vec<&str> = probes.iter().map(|p| p.0).collect();
        assert_eq!(names, PROBES);
        for (p, o) in &probes {
            match *p {
                // not writable through a read-only descriptor, on any file system
                "ftruncate" => assert_eq!(*o, ProbeOutcome::Refused(libc::EINVAL)),
                "unlink" | "rename" => assert_eq!(*o, ProbeOutcome::Refused(libc::ENOENT)),
                _ => assert_eq!(*o, ProbeOutcome::Succeeded { undo: Ok(()) }, "{p}"),
            }
            if *p != "ftruncate" {
                assert!(o.shows_writable(p), "{p} {o}");
            }
        }
        // nothing left behind, nothing changed
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("weights.bin")]);
        let after = std::fs::metadata(&file).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"abc");
        assert_eq!(after.permissions().mode(), before.permissions().mode());
        assert_eq!(after.ino(), before.ino());
        let no_file = write_probes(dir.path(), None);
        assert_eq!(no_file[1].1, ProbeOutcome::Skipped("no file"));
    }

    #[test]
    fn symlinks_out_of_the_volume_are_neither_hashed_nor_probed() {
        // The attack: a link in the volume to a mode-0600 file outside it was hashed
        // (the hash printed), appended to, chmod-ed and truncated, and reported
        // ReaderVolumeWritable.
        let top = tempfile::tempdir().unwrap();
        let outside = top.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let secret = outside.join("secret");
        std::fs::write(&secret, b"private").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let before = std::fs::metadata(&secret).unwrap();
        let vol = top.path().join("volume");
        std::fs::create_dir_all(vol.join("blobs")).unwrap();
        std::fs::create_dir_all(vol.join("snapshots/r1")).unwrap();
        std::fs::write(vol.join("blobs/abc"), b"test").unwrap();
        // Links that stay inside (the Hugging Face cache layout) and links that leave.
        std::os::unix::fs::symlink("../../blobs/abc", vol.join("snapshots/r1/config.json"))
            .unwrap();
        std::os::unix::fs::symlink(&secret, vol.join("weights.bin")).unwrap();
        std::os::unix::fs::symlink("../outside", vol.join("sub")).unwrap();

        let volume = Volume::open(&vol).unwrap();
        let check = MountsCheck::new(&ChecksConfig::default());
        for rel in ["weights.bin", "sub/secret"] {
            match check.digest(&volume, Path::new(rel), &vol.join(rel)) {
                SampleState::Unreadable(why) => {
                    assert!(why.contains("leads out of the volume"), "{rel}: {why}")
                }
                other => panic!("{rel} was read: {other:?}"),
            }
        }
        assert_eq!(
            check.digest(
                &volume,
                Path::new("snapshots/r1/config.json"),
                &vol.join("snapshots/r1/config.json")
            ),
            SampleState::Digest(
                "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".into()
            )
        );
        for rel in ["weights.bin", "sub/secret"] {
            let probes = write_probes_in(&volume, Some(Path::new(rel)));
            for (p, o) in &probes {
                if ["append", "chmod", "truncate", "ftruncate"].contains(p) {
                    assert_eq!(
                        *o,
                        ProbeOutcome::Skipped("file outside the volume"),
                        "{rel} {p}"
                    );
                }
            }
        }
        // The file outside is untouched.
        let after = std::fs::metadata(&secret).unwrap();
        assert_eq!(std::fs::read(&secret).unwrap(), b"private");
        assert_eq!(after.permissions().mode(), before.permissions().mode());
        assert_eq!(after.mtime_nsec(), before.mtime_nsec());
        // Without openat2 every link is refused, the in-volume one included.
        assert!(volume
            .walk(Path::new("snapshots/r1/config.json"), OFlag::O_RDONLY)
            .is_err_and(|e| beneath::is_escape(&e)));
        assert!(volume.walk(Path::new("blobs/abc"), OFlag::O_RDONLY).is_ok());
        // `..` and absolute paths never resolve.
        assert!(volume
            .open_file(Path::new("../outside/secret"), OFlag::O_RDONLY)
            .is_err());
        assert!(volume.open_file(&secret, OFlag::O_RDONLY).is_err());
    }

    #[test]
    fn sha256_of_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x");
        std::fs::write(&f, b"test").unwrap();
        assert_eq!(
            sha256_file(&f).unwrap(),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
    }
}
