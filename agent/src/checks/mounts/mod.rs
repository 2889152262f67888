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
//!
//! # Files
//!
//! - this file: the check itself ([`MountsCheck`]): finds each reader pod's views of its
//!   volumes, reads them (digests cached by inode, size and mtime) and judges each view;
//! - [`probes`]: the write probes, each of which must fail with `EROFS` and none of which may
//!   disturb a reader;
//! - [`samples`]: sample files resolved inside the volume and their SHA-256;
//! - [`verdict`]: one view of a planned mount judged ([`verdict::evaluate_view`]), pure.

pub mod probes;
pub mod samples;
pub mod verdict;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, ReaderMount};
use parking_lot::Mutex;

use nix::fcntl::OFlag;

use super::beneath::{self, Volume};
use super::pods::{is_sandbox_exe, short_id, PodContainer, PodFinder};
use super::shm::{find_mount, parse_mountinfo};
use super::{Check, ChecksConfig};

use probes::write_probes_in;
use samples::{sample_path, sha256_of, SampleState};
use verdict::{evaluate_view, MountView};

/// Check name.
pub const NAME: &str = "mounts";

/// Digest cache key: device, inode, size, mtime (ns).
type FileKey = (u64, u64, u64, i64, i64);

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
    use std::os::unix::fs::PermissionsExt;

    use super::probes::ProbeOutcome;

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
}
