//! `shm`: `/dev/shm` of the host and of every planned engine pod (size, use, file-system
//! type) against the plan's requirements.
//!
//! Host: size and use come from `statvfs(2)` on [`ChecksConfig::shm_path`]; the file-system
//! type, mount source and configured `size=` come from the mount that contains that path in
//! `<proc_root>/self/mountinfo` (the longest mount point that is a prefix of the path; among
//! equal mount points the *last* line wins, because mounts stack).
//!
//! Engine pods (plan `engines[]` with a `podUid`): the pod's processes are found by their
//! cgroup ([`super::pods`]); each container (mount namespace) is inspected through
//! `<proc_root>/<pid>/root/dev/shm` (statvfs) and `<proc_root>/<pid>/mountinfo`. The one
//! compared with `shmRequiredBytes` is the first of the plan's `shmContainers` (the engine
//! container, then those sharing its `/dev/shm` volume) whose runtime ID is a running
//! container's cgroup; when none of them runs the verdict is `Unknown`
//! (`EngineContainerNotRunning`), never a sidecar's or the sandbox's 64 MiB default. A plan
//! that names no container (standalone) compares the largest `/dev/shm` of the pod.
//! Engines that map more shared memory than the tmpfs holds die with SIGBUS on first touch
//! (NCCL with tensor parallelism, LMCache's L1 in the MP worker), so undersized is `Critical`.
//!
//! Results: subject `host`, then `<namespace>/<pod>` per engine with a pod UID. Reasons (see
//! `docs/checks.md`): `ShmOk`, `ShmUndersized`, `ShmNearlyFull`, `ShmNotTmpfs`, `ShmMissing`,
//! `ShmUnreadable`, `PodNotFound`, `EngineContainerNotRunning`.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{EnginePlan, NodePlan, PlannedContainer};

use super::pods::{pod_not_found, short_id, PodContainer, PodFinder};
use super::units::{bytes_both, human_bytes, parse_size_option};
use super::{Check, ChecksConfig};

/// Check name.
pub const NAME: &str = "shm";

/// The path engines use inside their containers.
pub const POD_SHM_PATH: &str = "/dev/shm";

/// The `shm` check.
#[derive(Debug, Clone)]
pub struct ShmCheck {
    proc_root: PathBuf,
    shm_path: PathBuf,
    nearly_full_percent: u8,
    pods: Arc<PodFinder>,
}

impl ShmCheck {
    /// Reads `cfg.shm_path`, `cfg.proc_root` and `cfg.shm_nearly_full_percent`.
    pub fn new(cfg: &ChecksConfig) -> Self {
        Self::with_finder(cfg, Arc::new(PodFinder::new(&cfg.proc_root)))
    }

    /// Like [`ShmCheck::new`], sharing a pod finder with other checks.
    pub fn with_finder(cfg: &ChecksConfig, pods: Arc<PodFinder>) -> Self {
        ShmCheck {
            proc_root: cfg.proc_root.clone(),
            shm_path: cfg.shm_path.clone(),
            nearly_full_percent: cfg.shm_nearly_full_percent,
            pods,
        }
    }

    /// The result for one engine pod (subject `<namespace>/<pod>`).
    fn pod(&self, engine: &EnginePlan, uid: &str) -> CheckResult {
        let subject = format!("{}/{}", engine.namespace, engine.pod);
        let containers = self.pods.containers(uid);
        if containers.is_empty() {
            return self.pods.unavailable(NAME, &subject, uid, "its /dev/shm");
        }
        let shm = Path::new(POD_SHM_PATH);
        let views: Vec<ContainerView<'_>> = containers
            .iter()
            .map(|c| {
                let usage = statvfs_usage(&c.path_inside(&self.proc_root, shm));
                let mi = c.mountinfo(&self.proc_root);
                let mount = std::fs::read_to_string(&mi)
                    .map(|t| find_mount(&parse_mountinfo(&t), shm).cloned())
                    .map_err(|e| format!("{}: {e}", mi.display()));
                (c, usage, mount)
            })
            .collect();
        let best = match pick_container(&engine.shm_containers, &containers) {
            Pick::Planned(i) => i,
            Pick::NoneRunning => return engine_not_running(&subject, uid, engine, &containers),
            Pick::Largest => {
                // No engine container planned: the container with the largest /dev/shm (an
                // unlimited tmpfs counts as largest); when none could be measured, the first.
                let rank = |v: &ContainerView<'_>| match (&v.1, &v.2) {
                    (Ok(u), Ok(Some(m))) if u.size_bytes == 0 && m.fs_type == "tmpfs" => {
                        Some(u64::MAX)
                    }
                    (Ok(u), _) => Some(u.size_bytes),
                    (Err(_), _) => None,
                };
                views
                    .iter()
                    .enumerate()
                    .max_by_key(|(i, v)| (rank(v), std::cmp::Reverse(*i)))
                    .map(|(i, _)| i)
                    .unwrap_or(0)
            }
        };
        let count = views.len();
        let Some((c, usage, mount)) = views.into_iter().nth(best) else {
            return pod_not_found(NAME, &subject, uid, "its /dev/shm");
        };
        let (mount, mountinfo_error) = match mount {
            Ok(m) => (m, None),
            Err(e) => (None, Some(e)),
        };
        let shown = format!("/dev/shm in pod {subject}");
        let mut r = evaluate_subject(
            &subject,
            &shown,
            POD_SHM_PATH,
            usage,
            mount.as_ref(),
            engine.shm_required_bytes,
            self.nearly_full_percent,
        )
        .with("podUid", uid)
        .with("pid", c.pid)
        .with("containersInspected", count);
        if let Some(name) = engine
            .shm_containers
            .iter()
            .find(|p| p.id.is_some() && p.id == c.container_id)
            .map(|p| p.name.as_str())
        {
            r = r.with("container", name);
        }
        if let Some(e) = mountinfo_error {
            r = r.with("mountinfoError", e);
        }
        r
    }
}

/// Which of a pod's containers the `/dev/shm` requirement is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The plan names no container (standalone, or no engine container found): the largest
    /// (unless only the sandbox runs: then [`Pick::NoneRunning`]).
    Largest,
    /// The first planned container with a running process: index into the containers.
    Planned(usize),
    /// The plan names the containers, and none of them has a process here (waiting, in
    /// crash-loop back-off, just restarted): only a sidecar's or the sandbox's `/dev/shm` is
    /// left, which is not the one the engine is given.
    NoneRunning,
}

/// The container to compare: the first of `planned` (plan `shmContainers`, engine first) whose
/// runtime ID matches a running container's cgroup ([`PodContainer::container_id`]).
pub fn pick_container(planned: &[PlannedContainer], running: &[PodContainer]) -> Pick {
    let sandbox_only = running
        .iter()
        .all(|c| c.exe.as_deref().is_some_and(super::pods::is_sandbox_exe));
    if planned.is_empty() {
        // Only the sandbox runs (the engine's image still pulling): its /dev/shm is the
        // runtime's 64 MiB default, nobody's the engine is given.
        return if sandbox_only {
            Pick::NoneRunning
        } else {
            Pick::Largest
        };
    }
    planned
        .iter()
        .filter_map(|p| p.id.as_deref())
        .find_map(|id| {
            running
                .iter()
                .position(|c| c.container_id.as_deref() == Some(id))
        })
        .map_or(Pick::NoneRunning, Pick::Planned)
}

/// `Unknown/EngineContainerNotRunning`: none of the planned containers runs, so the engine's
/// `/dev/shm` cannot be seen (the others' would be a false verdict).
fn engine_not_running(
    subject: &str,
    uid: &str,
    engine: &EnginePlan,
    running: &[PodContainer],
) -> CheckResult {
    let mut planned = engine
        .shm_containers
        .iter()
        .map(|p| match &p.id {
            Some(id) => format!("{} (ID {})", p.name, short_id(id)),
            None => format!("{} (not running in pod status)", p.name),
        })
        .collect::<Vec<_>>()
        .join(", ");
    if planned.is_empty() {
        planned = "(only the pod sandbox runs)".to_string();
    }
    let seen = running
        .iter()
        .map(|c| c.container_id.as_deref().map_or("?", short_id))
        .collect::<Vec<_>>()
        .join(", ");
    CheckResult::new(
        NAME,
        subject,
        CheckStatus::Unknown,
        "EngineContainerNotRunning",
        format!(
            "no process of the engine container {planned} of pod {subject} runs on this node \
             (waiting, in crash-loop back-off, or just restarted), so the /dev/shm it is given \
             cannot be inspected; the pod's other containers' /dev/shm is not the engine's, so it \
             is not judged. Check `kubectl describe pod` for why the engine is not running."
        ),
    )
    .with("podUid", uid)
    .with("containersRunning", seen)
}

/// One container's `/dev/shm`: statvfs outcome and the mount (or why mountinfo was unreadable).
type ContainerView<'a> = (
    &'a PodContainer,
    io::Result<FsUsage>,
    Result<Option<MountEntry>, String>,
);

impl Check for ShmCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&self, plan: &NodePlan) -> Vec<CheckResult> {
        let mut out = vec![self.host(plan)];
        for engine in &plan.engines {
            if let Some(uid) = engine.pod_uid.as_deref() {
                out.push(self.pod(engine, uid));
            }
        }
        out
    }
}

impl ShmCheck {
    /// The `host` result.
    fn host(&self, plan: &NodePlan) -> CheckResult {
        let usage = statvfs_usage(&self.shm_path);
        let mountinfo_path = self.proc_root.join("self").join("mountinfo");
        let (mount, mountinfo_error) = match std::fs::read_to_string(&mountinfo_path) {
            Ok(text) => {
                // Resolve symlinks (/dev/shm -> /run/shm) so the mount lookup sees the real path.
                let target =
                    std::fs::canonicalize(&self.shm_path).unwrap_or_else(|_| self.shm_path.clone());
                (find_mount(&parse_mountinfo(&text), &target).cloned(), None)
            }
            Err(e) => (None, Some(format!("{}: {e}", mountinfo_path.display()))),
        };
        let required = plan.shm.as_ref().map(|s| s.required_bytes);
        let mut result = evaluate(
            &self.shm_path,
            usage,
            mount.as_ref(),
            required,
            self.nearly_full_percent,
        );
        if let Some(e) = mountinfo_error {
            result = result.with("mountinfoError", e);
        }
        result
    }
}

/// Capacity and use of a file system, in bytes (from `statvfs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsUsage {
    /// Total size: `f_blocks × f_frsize`. 0 on a tmpfs mounted with `size=0` (unlimited).
    pub size_bytes: u64,
    /// Used: `(f_blocks − f_bfree) × f_frsize`.
    pub used_bytes: u64,
    /// Available to unprivileged writers: `f_bavail × f_frsize`.
    pub available_bytes: u64,
}

/// `statvfs(2)` on `path`, converted to bytes. Errors are the raw OS error (`ENOENT` when the
/// path does not exist).
// The statvfs field types are u64 on 64-bit Linux but narrower on some 32-bit targets.
#[allow(clippy::useless_conversion)]
pub fn statvfs_usage(path: &Path) -> io::Result<FsUsage> {
    let st = nix::sys::statvfs::statvfs(path).map_err(io::Error::from)?;
    let frsize = u64::from(st.fragment_size());
    let blocks = u64::from(st.blocks());
    let free = u64::from(st.blocks_free());
    let avail = u64::from(st.blocks_available());
    Ok(FsUsage {
        size_bytes: blocks.saturating_mul(frsize),
        used_bytes: blocks.saturating_sub(free).saturating_mul(frsize),
        available_bytes: avail.saturating_mul(frsize),
    })
}

/// One line of `/proc/<pid>/mountinfo` (fields we use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Mount point, with the kernel's octal escapes (`\040` …) decoded.
    pub mount_point: PathBuf,
    /// File-system type after the ` - ` separator, e.g. `tmpfs`.
    pub fs_type: String,
    /// Mount source, e.g. `tmpfs` or `shm`.
    pub source: String,
    /// Per-mount options (field 6), e.g. `ro,nosuid,nodev,relatime`: a bind mount remounted
    /// read-only carries `ro` here while its super-block stays `rw`.
    pub mount_options: String,
    /// Super-block options, e.g. `rw,size=65536k,inode64`.
    pub super_options: String,
}

impl MountEntry {
    /// Value of one comma-separated super option (`size` → `65536k`).
    pub fn super_option(&self, key: &str) -> Option<&str> {
        self.super_options
            .split(',')
            .find_map(|o| o.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
    }

    /// The tmpfs `size=` option in bytes, if present and absolute (not a percentage).
    pub fn configured_size_bytes(&self) -> Option<u64> {
        self.super_option("size").and_then(parse_size_option)
    }

    /// True when the mount or its super-block is read-only (`ro` in either option list).
    pub fn read_only(&self) -> bool {
        let has_ro = |opts: &str| opts.split(',').any(|o| o == "ro");
        has_ro(&self.mount_options) || has_ro(&self.super_options)
    }
}

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_mountinfo_line).collect()
}

fn parse_mountinfo_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let mut left = left.split(' ');
    let mount_point = left.nth(4)?;
    let mount_options = left.next().unwrap_or("");
    let mut right = right.split(' ');
    let fs_type = right.next()?;
    let source = right.next()?;
    let super_options = right.next().unwrap_or("");
    Some(MountEntry {
        mount_point: PathBuf::from(OsString::from_vec(unescape_octal_bytes(mount_point))),
        fs_type: fs_type.to_string(),
        source: unescape_octal(source),
        mount_options: mount_options.to_string(),
        super_options: super_options.to_string(),
    })
}

/// Decodes the kernel's `\ooo` escapes (space, tab, newline, backslash) in mountinfo fields.
fn unescape_octal(s: &str) -> String {
    String::from_utf8_lossy(&unescape_octal_bytes(s)).into_owned()
}

fn unescape_octal_bytes(s: &str) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let v = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// The mount that contains `path`: the longest mount point that is a path prefix of it; among
/// equal mount points, the last one listed (the top of the stack).
pub fn find_mount<'a>(mounts: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    let mut best: Option<&MountEntry> = None;
    for m in mounts {
        if !path.starts_with(&m.mount_point) {
            continue;
        }
        let better = match best {
            None => true,
            Some(b) => m.mount_point.components().count() >= b.mount_point.components().count(),
        };
        if better {
            best = Some(m);
        }
    }
    best
}

/// The pure decision of the `shm` check from what was observed.
///
/// `usage` is the `statvfs` outcome (`ENOENT` → `ShmMissing`, other errors → `ShmUnreadable`),
/// `mount` the mount containing `path` (None when unknown), `required` the plan's minimum size
/// in bytes, `nearly_full_percent` the use above which `ShmNearlyFull` is reported. Findings are
/// combined into one result: the status is the worst, the reason that of the first worst finding
/// (order: undersized, not tmpfs, nearly full), the message all findings' sentences.
pub fn evaluate(
    path: &Path,
    usage: io::Result<FsUsage>,
    mount: Option<&MountEntry>,
    required: Option<u64>,
    nearly_full_percent: u8,
) -> CheckResult {
    let shown = path.display().to_string();
    evaluate_subject(
        "host",
        &shown,
        &shown,
        usage,
        mount,
        required,
        nearly_full_percent,
    )
}

/// [`evaluate`] for any subject: `shown` names the file system in messages (`/dev/shm in pod
/// team-a/vllm-0`), `path` is the `path` observed value.
pub fn evaluate_subject(
    subject: &str,
    shown: &str,
    path: &str,
    usage: io::Result<FsUsage>,
    mount: Option<&MountEntry>,
    required: Option<u64>,
    nearly_full_percent: u8,
) -> CheckResult {
    let shown = shown.to_string();
    let mut observed: Vec<(&str, String)> = vec![("path", path.to_string())];
    if let Some(r) = required {
        observed.push(("requiredBytes", r.to_string()));
    }
    if let Some(m) = mount {
        observed.push(("fsType", m.fs_type.clone()));
        observed.push(("mountSource", m.source.clone()));
        observed.push(("mountPoint", m.mount_point.display().to_string()));
        if let Some(c) = m.configured_size_bytes() {
            observed.push(("configuredSizeBytes", c.to_string()));
        }
    } else {
        observed.push(("fsType", "unknown".to_string()));
    }
    let finish = |status, reason: &str, message: String, observed: Vec<(&str, String)>| {
        observed.into_iter().fold(
            CheckResult::new(NAME, subject, status, reason, message),
            |r, (k, v)| r.with(k, v),
        )
    };

    let usage = match usage {
        Ok(u) => u,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let (status, tail) = match required {
                Some(r) => (
                    CheckStatus::Critical,
                    format!(
                        "engines that need {} of shared memory will fail; mount a tmpfs there",
                        bytes_both(r)
                    ),
                ),
                None => (
                    CheckStatus::Unknown,
                    "the plan requires none, so this is not an error yet".to_string(),
                ),
            };
            return finish(
                status,
                "ShmMissing",
                format!("{shown} does not exist on this node; {tail}."),
                observed,
            );
        }
        Err(e) => {
            observed.push(("error", e.to_string()));
            return finish(
                CheckStatus::Unknown,
                "ShmUnreadable",
                format!("cannot statvfs {shown}: {e}; its size and use are unknown."),
                observed,
            );
        }
    };

    observed.push(("sizeBytes", usage.size_bytes.to_string()));
    observed.push(("usedBytes", usage.used_bytes.to_string()));
    observed.push(("availableBytes", usage.available_bytes.to_string()));
    let fs_type = mount.map(|m| m.fs_type.as_str());
    let unlimited = usage.size_bytes == 0 && fs_type == Some("tmpfs");
    let used_percent = if usage.size_bytes == 0 {
        0
    } else {
        (u128::from(usage.used_bytes) * 100 / u128::from(usage.size_bytes)) as u64
    };
    if !unlimited {
        observed.push(("usedPercent", used_percent.to_string()));
    }

    let mut findings: Vec<(CheckStatus, &str, String)> = Vec::new();
    if let Some(r) = required {
        if !unlimited && usage.size_bytes < r {
            findings.push((
                CheckStatus::Critical,
                "ShmUndersized",
                format!(
                    "{shown} is {} but the plan requires {}; engines mapping more than the \
                     tmpfs holds die with SIGBUS.",
                    bytes_both(usage.size_bytes),
                    bytes_both(r)
                ),
            ));
        }
    }
    if let Some(m) = mount {
        if m.fs_type != "tmpfs" {
            findings.push((
                CheckStatus::Warning,
                "ShmNotTmpfs",
                format!(
                    "{shown} is on a {} file system (source {}, mounted at {}), not tmpfs; \
                     engines expect a RAM-backed tmpfs with a fixed size there.",
                    m.fs_type,
                    m.source,
                    m.mount_point.display()
                ),
            ));
        }
    }
    if !unlimited
        && usage.size_bytes > 0
        && u128::from(usage.used_bytes) * 100
            > u128::from(usage.size_bytes) * u128::from(nearly_full_percent)
    {
        findings.push((
            CheckStatus::Warning,
            "ShmNearlyFull",
            format!(
                "{shown} is {used_percent}% full: {} of {} used, {} available (threshold \
                 {nearly_full_percent}%); find and remove stale segments.",
                human_bytes(usage.used_bytes),
                human_bytes(usage.size_bytes),
                bytes_both(usage.available_bytes)
            ),
        ));
    }

    if findings.is_empty() {
        let size = if unlimited {
            "an unlimited tmpfs (size=0)".to_string()
        } else {
            format!("{} ({used_percent}% used)", bytes_both(usage.size_bytes))
        };
        let req = match required {
            Some(r) => format!(", enough for the plan's {}", bytes_both(r)),
            None => ", and the plan sets no requirement".to_string(),
        };
        return finish(
            CheckStatus::Ok,
            "ShmOk",
            format!("{shown} is {size}{req}."),
            observed,
        );
    }
    let status = CheckStatus::worst(findings.iter().map(|f| f.0));
    let reason = findings
        .iter()
        .find(|f| f.0 == status)
        .map(|f| f.1)
        .unwrap_or("ShmOk");
    let message = findings
        .iter()
        .map(|f| f.2.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    finish(status, reason, message, observed)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    const MI: &str = "\
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=12334492k,nr_inodes=3083623,mode=755
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684092k
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
30 25 0:27 / /dev/shm rw,nosuid,nodev master:7 - tmpfs shm rw,size=65536k,inode64
41 27 0:40 / /mnt/with\\040space rw - tmpfs tmpfs rw,size=1g
";

    #[test]
    fn last_dev_shm_line_wins_and_size_is_parsed() {
        let mounts = parse_mountinfo(MI);
        assert_eq!(mounts.len(), 5);
        let m = find_mount(&mounts, Path::new("/dev/shm")).unwrap();
        assert_eq!(m.source, "shm");
        assert_eq!(m.fs_type, "tmpfs");
        assert_eq!(m.configured_size_bytes(), Some(64 << 20));
        assert_eq!(m.super_option("inode64"), None);
        assert_eq!(m.mount_options, "rw,nosuid,nodev");
        assert!(!m.read_only());
        let m = find_mount(&mounts, Path::new("/dev/shm/sub/dir")).unwrap();
        assert_eq!(m.source, "shm");
        let m = find_mount(&mounts, Path::new("/dev/pts")).unwrap();
        assert_eq!(m.fs_type, "devtmpfs");
        let m = find_mount(&mounts, Path::new("/dev/shmx")).unwrap();
        assert_eq!(
            m.fs_type, "devtmpfs",
            "component-wise prefix, not string prefix"
        );
        let m = find_mount(&mounts, Path::new("/mnt/with space/x")).unwrap();
        assert_eq!(m.configured_size_bytes(), Some(1 << 30));
        assert_eq!(
            find_mount(&mounts, Path::new("/srv")).unwrap().fs_type,
            "ext4"
        );
    }

    #[test]
    fn malformed_lines_are_skipped() {
        let mounts = parse_mountinfo("garbage\n1 2 3\n\n1 2 0:1 / /x rw - tmpfs\n");
        assert!(mounts.is_empty());
        assert_eq!(unescape_octal("a\\134b\\0"), "a\\b\\0");
    }

    fn tmpfs(size: &str) -> MountEntry {
        MountEntry {
            mount_point: PathBuf::from("/dev/shm"),
            fs_type: "tmpfs".into(),
            source: "shm".into(),
            mount_options: "rw".into(),
            super_options: format!("rw,size={size}"),
        }
    }

    fn usage(size: u64, used: u64) -> io::Result<FsUsage> {
        Ok(FsUsage {
            size_bytes: size,
            used_bytes: used,
            available_bytes: size - used,
        })
    }

    fn container(pid: u32, exe: &str, id: Option<&str>) -> PodContainer {
        PodContainer {
            pid,
            mnt_ns: Some(u64::from(pid)),
            exe: Some(exe.to_string()),
            container_id: id.map(str::to_string),
        }
    }

    fn planned(name: &str, id: Option<&str>) -> PlannedContainer {
        PlannedContainer {
            name: name.to_string(),
            id: id.map(str::to_string),
        }
    }

    /// The engine container's /dev/shm is judged when it runs, else the one sharing its volume
    /// (the MP worker), else nothing: never a sidecar's or the sandbox's default.
    #[test]
    fn the_planned_engine_container_is_the_one_judged() {
        let engine = "aaaaaaaaaaaa1111";
        let worker = "bbbbbbbbbbbb2222";
        let running = [
            container(10, "/usr/bin/envoy", Some("cccccccccccc3333")),
            container(11, "/usr/bin/python3", Some(worker)),
            container(12, "/usr/bin/python3", Some(engine)),
        ];
        let both = [
            planned("sglang", Some(engine)),
            planned("lmcache-mp-worker", Some(worker)),
        ];
        assert_eq!(pick_container(&both, &running), Pick::Planned(2));
        let waiting = [
            planned("sglang", None),
            planned("lmcache-mp-worker", Some(worker)),
        ];
        assert_eq!(pick_container(&waiting, &running), Pick::Planned(1));
        let restarted = [planned("sglang", Some("dddddddddddd4444"))];
        assert_eq!(pick_container(&restarted, &running), Pick::NoneRunning);
        assert_eq!(
            pick_container(&[planned("sglang", None)], &running),
            Pick::NoneRunning
        );
        assert_eq!(pick_container(&[], &running), Pick::Largest);
        let sandbox = [container(9, "/pause", Some("eeeeeeeeeeee5555"))];
        assert_eq!(pick_container(&[], &sandbox), Pick::NoneRunning);
    }

    #[test]
    fn undersized_names_both_sizes() {
        let m = tmpfs("65536k");
        let r = evaluate(
            Path::new("/dev/shm"),
            usage(64 << 20, 0),
            Some(&m),
            Some(1 << 30),
            90,
        );
        assert_eq!(r.status, CheckStatus::Critical);
        assert_eq!(r.reason, "ShmUndersized");
        assert!(
            r.message.contains(
                "/dev/shm is 64.0 MiB (67108864 bytes) but the plan requires 1.0 GiB (1073741824 bytes)"
            ),
            "{}",
            r.message
        );
        assert_eq!(r.observed["sizeBytes"], "67108864");
        assert_eq!(r.observed["requiredBytes"], "1073741824");
        assert_eq!(r.observed["configuredSizeBytes"], "67108864");
        assert_eq!(r.observed["fsType"], "tmpfs");
        assert_eq!(r.observed["mountSource"], "shm");
    }

    #[test]
    fn ok_nearly_full_and_combined() {
        let m = tmpfs("1g");
        let p = Path::new("/dev/shm");
        let r = evaluate(p, usage(1 << 30, 1 << 20), Some(&m), Some(1 << 30), 90);
        assert_eq!((r.status, r.reason.as_str()), (CheckStatus::Ok, "ShmOk"));
        assert_eq!(r.observed["usedPercent"], "0");
        let r = evaluate(p, usage(100 << 20, 95 << 20), Some(&m), None, 90);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Warning, "ShmNearlyFull")
        );
        assert!(r.message.contains("95% full"), "{}", r.message);
        // exactly at the threshold is not "above" it
        let r = evaluate(p, usage(100, 90), Some(&m), None, 90);
        assert_eq!(r.status, CheckStatus::Ok);
        // undersized and nearly full: Critical, reason undersized, both sentences
        let r = evaluate(p, usage(100 << 20, 99 << 20), Some(&m), Some(1 << 30), 90);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Critical, "ShmUndersized")
        );
        assert!(r.message.contains("99% full"), "{}", r.message);
    }

    #[test]
    fn not_tmpfs_missing_unreadable_unlimited() {
        let p = Path::new("/dev/shm");
        let ext4 = MountEntry {
            mount_point: PathBuf::from("/"),
            fs_type: "ext4".into(),
            source: "/dev/vda".into(),
            mount_options: "ro,relatime".into(),
            super_options: "rw".into(),
        };
        let r = evaluate(p, usage(10 << 30, 0), Some(&ext4), Some(1 << 20), 90);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Warning, "ShmNotTmpfs")
        );
        assert_eq!(r.observed["fsType"], "ext4");

        let enoent = || Err(io::Error::from_raw_os_error(libc::ENOENT));
        let r = evaluate(p, enoent(), None, Some(1 << 30), 90);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Critical, "ShmMissing")
        );
        let r = evaluate(p, enoent(), None, None, 90);
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Unknown, "ShmMissing")
        );
        let r = evaluate(
            p,
            Err(io::Error::from_raw_os_error(libc::EACCES)),
            None,
            None,
            90,
        );
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Unknown, "ShmUnreadable")
        );

        let m = tmpfs("0");
        let r = evaluate(p, usage(0, 0), Some(&m), Some(1 << 40), 90);
        assert_eq!((r.status, r.reason.as_str()), (CheckStatus::Ok, "ShmOk"));
        assert!(r.message.contains("unlimited"), "{}", r.message);
    }
}
