//! Who owns a socket: the processes holding `socket:[<inode>]` among their fds, their executable
//! (`exe`, never `comm` or the command line) and their Kubernetes pod UID (from `cgroup`, cgroupfs
//! or systemd driver).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use ic_shared::plan::PortOwner;

/// The Kubernetes pod UID in a `/proc/<pid>/cgroup` text, normalised to lower case with
/// dashes, or `None` when no line has a kubepods path.
///
/// Accepts the cgroupfs driver's `…/kubepods/burstable/pod<uid>/<container>` and the systemd
/// driver's `…/kubepods-burstable-pod<uid_with_underscores>.slice/…`, on cgroup v1 and v2.
pub fn pod_uid_from_cgroup(text: &str) -> Option<String> {
    for path in kubepods_paths(text) {
        for seg in path.split('/') {
            let candidate = if let Some(stem) = seg.strip_suffix(".slice") {
                stem.rfind("-pod").map(|i| &stem[i + 4..])
            } else {
                seg.strip_prefix("pod")
            };
            if let Some(uid) = candidate.and_then(normalise_pod_uid) {
                return Some(uid);
            }
        }
    }
    None
}

/// The cgroup paths of a `/proc/<pid>/cgroup` text (`hierarchy:controllers:path` lines) that
/// lie under `kubepods`.
pub fn kubepods_paths(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .filter(|path| path.contains("kubepods"))
}

/// Lower-cases a pod UID and turns the systemd driver's underscores into dashes; `None` when
/// the result is not hex digits and dashes of a plausible length (a UUID, or a static pod's
/// 32-digit config hash).
pub fn normalise_pod_uid(uid: &str) -> Option<String> {
    let uid = uid.trim().replace('_', "-").to_ascii_lowercase();
    let hexdigits = uid.chars().filter(|c| c.is_ascii_hexdigit()).count();
    if uid.len() >= 8 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-') && hexdigits >= 8 {
        Some(uid)
    } else {
        None
    }
}

/// A process that holds a listening socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketOwner {
    /// Process id in the PID namespace of `proc_root`.
    pub pid: u32,
    /// Target of `/proc/<pid>/exe` (a ` (deleted)` suffix removed); `None` when unreadable.
    pub exe: Option<String>,
    /// Pod UID from `/proc/<pid>/cgroup`; `None` outside Kubernetes pods.
    pub pod_uid: Option<String>,
}

impl SocketOwner {
    pub(super) fn describe(&self) -> String {
        let mut s = format!("pid {}", self.pid);
        let exe = self.exe.as_deref().unwrap_or("exe unreadable");
        let _ = write!(s, " ({exe}");
        if let Some(uid) = &self.pod_uid {
            let _ = write!(s, ", pod {uid}");
        }
        s.push(')');
        s
    }

    /// True when every field the expected owner gives matches.
    pub fn matches(&self, want: &PortOwner) -> bool {
        let exe_ok = want
            .exe
            .as_deref()
            .is_none_or(|e| self.exe.as_deref() == Some(e));
        let pod_ok = want.pod_uid.as_deref().is_none_or(|u| {
            normalise_pod_uid(u).is_some_and(|u| self.pod_uid.as_deref() == Some(u.as_str()))
        });
        exe_ok && pod_ok
    }
}

/// Maps each socket inode in `wanted` to the pids whose fd table holds it, by scanning
/// `<proc_root>/<pid>/fd`. Processes that vanish or cannot be read are skipped.
pub fn socket_pids(proc_root: &Path, wanted: &HashSet<u64>) -> HashMap<u64, Vec<u32>> {
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    if wanted.is_empty() {
        return out;
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return out;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            if wanted.contains(&inode) {
                let pids = out.entry(inode).or_default();
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
    }
    for pids in out.values_mut() {
        pids.sort_unstable();
    }
    out
}

/// Reads a process's executable and pod UID under `proc_root`.
pub fn read_owner(proc_root: &Path, pid: u32) -> SocketOwner {
    let dir = proc_root.join(pid.to_string());
    let exe = std::fs::read_link(dir.join("exe")).ok().map(|p| {
        let s = p.to_string_lossy().into_owned();
        s.strip_suffix(" (deleted)")
            .map(str::to_string)
            .unwrap_or(s)
    });
    let pod_uid = std::fs::read_to_string(dir.join("cgroup"))
        .ok()
        .and_then(|t| pod_uid_from_cgroup(&t));
    SocketOwner { pid, exe, pod_uid }
}

/// Processes matching every field of `want` (exe, pod UID), by a scan of
/// `<proc_root>/<pid>/exe` and `cgroup`; at most `limit`, ascending by pid. An owner with no
/// field matches nothing (every process would).
pub fn find_owners(proc_root: &Path, want: &PortOwner, limit: usize) -> Vec<SocketOwner> {
    if want.exe.is_none() && want.pod_uid.is_none() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    pids.sort_unstable();
    let mut out = Vec::new();
    for pid in pids {
        let owner = read_owner(proc_root, pid);
        if want.exe.is_some() && owner.exe.is_none() {
            continue;
        }
        if owner.matches(want) {
            out.push(owner);
            if out.len() >= limit {
                break;
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn pod_uid_from_both_cgroup_drivers() {
        let cgroupfs =
            "12:pids:/kubepods/burstable/pod3f1c2a9e-1b2c-4d5e-8f90-0123456789ab/9a8b7c\n0::/\n";
        assert_eq!(
            pod_uid_from_cgroup(cgroupfs).as_deref(),
            Some("3f1c2a9e-1b2c-4d5e-8f90-0123456789ab")
        );
        let guaranteed = "0::/kubepods/pod3F1C2A9E-1B2C-4D5E-8F90-0123456789AB/abc\n";
        assert_eq!(
            pod_uid_from_cgroup(guaranteed).as_deref(),
            Some("3f1c2a9e-1b2c-4d5e-8f90-0123456789ab")
        );
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3f1c2a9e_1b2c_4d5e_8f90_0123456789ab.slice/cri-containerd-0123.scope\n";
        assert_eq!(
            pod_uid_from_cgroup(systemd).as_deref(),
            Some("3f1c2a9e-1b2c-4d5e-8f90-0123456789ab")
        );
        let besteffort_v1 = "4:memory:/kubepods.slice/kubepods-pod0123456789abcdef0123456789abcdef.slice/docker-1.scope\n";
        assert_eq!(
            pod_uid_from_cgroup(besteffort_v1).as_deref(),
            Some("0123456789abcdef0123456789abcdef")
        );
        assert_eq!(
            pod_uid_from_cgroup("0::/system.slice/sshd.service\n1:name=systemd:/user.slice\n"),
            None
        );
        assert_eq!(
            pod_uid_from_cgroup("0::/kubepods.slice/kubepods-burstable.slice\n"),
            None
        );
        assert_eq!(pod_uid_from_cgroup("0::/podman/podzzz/x\n"), None);
    }

    #[test]
    fn find_owners_in_a_fixture_tree() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, exe) in [
            (5, "/usr/bin/python3"),
            (9, "/opt/mooncake_master"),
            (12, "/opt/mooncake_master"),
        ] {
            let d = dir.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
            std::fs::write(d.join("cgroup"), "0::/\n").unwrap();
        }
        let want = PortOwner {
            exe: Some("/opt/mooncake_master".into()),
            pod_uid: None,
        };
        let found = find_owners(dir.path(), &want, 8);
        assert_eq!(found.iter().map(|o| o.pid).collect::<Vec<_>>(), vec![9, 12]);
        assert_eq!(find_owners(dir.path(), &want, 1).len(), 1);
        assert!(find_owners(dir.path(), &PortOwner::default(), 8).is_empty());
    }
}
