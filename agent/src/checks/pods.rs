//! Finding a Kubernetes pod's processes on the node, and its containers' namespaces.
//!
//! A pod is known to the agent by its UID (the node plan's `podUid`). Its processes are the
//! ones whose `<proc_root>/<pid>/cgroup` names that UID ([`pod_uid_from_cgroup`]: cgroupfs and
//! systemd drivers, cgroup v1 and v2). The containers of a pod share its network namespace but
//! each has its own mount namespace, so checks that look at files (`/dev/shm`, reader volumes)
//! inspect every container's view: `<proc_root>/<pid>/root/…` resolves paths through that
//! process's mounts, and `<proc_root>/<pid>/mountinfo` lists them. The sandbox (`pause`)
//! process is skipped: it holds the namespaces but none of the pod's volumes.
//!
//! A full scan of `<proc_root>/*/cgroup` costs a read per process, so [`PodFinder`] shares one
//! scan among the checks of a pass: it rescans when the last scan is older than
//! [`PodFinder::MIN_RESCAN`] and, within a scan's lifetime, re-reads only the cgroup files of
//! the pids it answers (dropping those that left). A scan is never kept longer: a pod first seen
//! with only its sandbox (image still pulling) must show its engine on the next pass.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ic_shared::check::{CheckResult, CheckStatus};
use parking_lot::Mutex;

pub use super::ports::owners::{normalise_pod_uid, pod_uid_from_cgroup};

/// One container of a pod, as seen through one of its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodContainer {
    /// Lowest pid of the pod in this mount namespace (in the PID namespace of the proc root).
    pub pid: u32,
    /// Mount namespace inode (`<proc_root>/<pid>/ns/mnt`); `None` when unreadable.
    pub mnt_ns: Option<u64>,
    /// Executable of `pid` (`<proc_root>/<pid>/exe`); `None` when unreadable.
    pub exe: Option<String>,
    /// The container runtime's ID of the container `pid` runs in, from its cgroup path
    /// ([`container_id_from_cgroup`]); `None` when the path names none.
    pub container_id: Option<String>,
}

impl PodContainer {
    /// `<proc_root>/<pid>/root`: the container's file-system root.
    pub fn root(&self, proc_root: &Path) -> PathBuf {
        proc_root.join(self.pid.to_string()).join("root")
    }

    /// `<proc_root>/<pid>/root/<path>` for an absolute path inside the container.
    pub fn path_inside(&self, proc_root: &Path, path: &Path) -> PathBuf {
        let rel = path.strip_prefix("/").unwrap_or(path);
        self.root(proc_root).join(rel)
    }

    /// `<proc_root>/<pid>/mountinfo`.
    pub fn mountinfo(&self, proc_root: &Path) -> PathBuf {
        proc_root.join(self.pid.to_string()).join("mountinfo")
    }

    /// `<proc_root>/<pid>/ns/net`: the pod's network namespace.
    pub fn netns(&self, proc_root: &Path) -> PathBuf {
        proc_root.join(self.pid.to_string()).join("ns").join("net")
    }
}

/// Namespace inode from a `/proc/<pid>/ns/<kind>` link target such as `mnt:[4026531840]`.
pub fn ns_inode(link_target: &str) -> Option<u64> {
    link_target
        .split_once(":[")
        .and_then(|(_, rest)| rest.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
}

fn read_ns(proc_root: &Path, pid: u32, kind: &str) -> Option<u64> {
    std::fs::read_link(proc_root.join(pid.to_string()).join("ns").join(kind))
        .ok()
        .and_then(|t| t.to_str().and_then(ns_inode))
}

/// Namespace inode of the process reading `proc_root` (`<proc_root>/self/ns/<kind>`).
pub fn own_ns(proc_root: &Path, kind: &str) -> Option<u64> {
    std::fs::read_link(proc_root.join("self").join("ns").join(kind))
        .ok()
        .and_then(|t| t.to_str().and_then(ns_inode))
}

fn read_exe(proc_root: &Path, pid: u32) -> Option<String> {
    std::fs::read_link(proc_root.join(pid.to_string()).join("exe"))
        .ok()
        .map(|p| {
            let s = p.to_string_lossy().into_owned();
            s.strip_suffix(" (deleted)")
                .map(str::to_string)
                .unwrap_or(s)
        })
}

fn pid_uid(proc_root: &Path, pid: u32) -> Option<String> {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))
        .ok()
        .and_then(|t| pod_uid_from_cgroup(&t))
}

/// The container ID in a kubepods cgroup path (`/proc/<pid>/cgroup`), lower-case: the last
/// segment below the pod's, as the runtimes name it — systemd driver
/// `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`; cgroupfs driver
/// `<id>`. It is what pod status shows as `containerStatuses[].containerID` after
/// `<runtime>://`. `None` for a process in the pod's own cgroup, for CRI-O's monitor
/// (`crio-conmon-<id>.scope`, which runs in the host's namespaces), and for a segment that is
/// not at least 12 hex digits.
pub fn container_id_from_cgroup(text: &str) -> Option<String> {
    for path in super::ports::owners::kubepods_paths(text) {
        let Some(last) = path.trim_end_matches('/').rsplit('/').next() else {
            continue;
        };
        let id = match last.strip_suffix(".scope") {
            Some(stem) if stem.contains("conmon") => return None,
            Some(stem) => stem.rsplit('-').next().unwrap_or(stem),
            None => last,
        };
        if id.len() >= 12 && id.chars().all(|c| c.is_ascii_hexdigit()) {
            return Some(id.to_ascii_lowercase());
        }
    }
    None
}

/// The first 12 hex digits of a container ID (what `crictl ps` shows).
pub fn short_id(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

/// True for a pod sandbox process (`…/pause`), which holds namespaces but no volumes.
pub fn is_sandbox_exe(exe: &str) -> bool {
    Path::new(exe)
        .file_name()
        .is_some_and(|n| n == "pause" || n == "pause.exe")
}

/// Every pod UID on the node and its pids, from one scan of `<proc_root>/*/cgroup`.
/// Processes that vanish or cannot be read are skipped; pids are ascending.
pub fn scan_pods(proc_root: &Path) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
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
        if let Some(uid) = pid_uid(proc_root, pid) {
            out.entry(uid).or_default().push(pid);
        }
    }
    for pids in out.values_mut() {
        pids.sort_unstable();
    }
    out
}

/// Groups a pod's pids into containers (one per mount namespace), skipping sandbox processes
/// unless nothing else is left. Ordered by pid.
pub fn containers(proc_root: &Path, pids: &[u32]) -> Vec<PodContainer> {
    let mut by_ns: BTreeMap<(Option<u64>, u32), PodContainer> = BTreeMap::new();
    let mut sandboxes = Vec::new();
    let mut seen_ns: Vec<u64> = Vec::new();
    for &pid in pids {
        let exe = read_exe(proc_root, pid);
        let mnt_ns = read_ns(proc_root, pid, "mnt");
        if exe.is_none() && mnt_ns.is_none() {
            // vanished since the scan (or not readable at all): nothing to look through
            continue;
        }
        let container_id = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))
            .ok()
            .and_then(|t| container_id_from_cgroup(&t));
        let c = PodContainer {
            pid,
            mnt_ns,
            exe,
            container_id,
        };
        if c.exe.as_deref().is_some_and(is_sandbox_exe) {
            sandboxes.push(c);
            continue;
        }
        match mnt_ns {
            Some(ns) if seen_ns.contains(&ns) => {}
            Some(ns) => {
                seen_ns.push(ns);
                by_ns.insert((Some(ns), pid), c);
            }
            // namespace unreadable but the process is there: keep it as its own container
            None => {
                by_ns.insert((None, pid), c);
            }
        }
    }
    let mut out: Vec<PodContainer> = by_ns.into_values().collect();
    if out.is_empty() {
        out = sandboxes;
    }
    out.sort_by_key(|c| c.pid);
    out
}

/// Finds pods' processes with a small cache (see the module docs). Shared by the checks of
/// one registry; thread-safe.
#[derive(Debug)]
pub struct PodFinder {
    proc_root: PathBuf,
    cache: Mutex<FinderCache>,
}

#[derive(Debug, Default)]
struct FinderCache {
    pods: HashMap<String, Vec<u32>>,
    scanned_at: Option<Instant>,
}

impl PodFinder {
    /// Shortest time between two full scans of the proc root.
    pub const MIN_RESCAN: Duration = Duration::from_secs(1);

    /// A finder over `proc_root` (`/proc` on a node).
    pub fn new(proc_root: &Path) -> Self {
        PodFinder {
            proc_root: proc_root.to_path_buf(),
            cache: Mutex::new(FinderCache::default()),
        }
    }

    /// The proc root this finder reads.
    pub fn proc_root(&self) -> &Path {
        &self.proc_root
    }

    /// Pids of the pod with this UID (any case, dashes or underscores), ascending; empty when
    /// none runs on this node (or the UID is malformed).
    pub fn pids(&self, pod_uid: &str) -> Vec<u32> {
        let Some(uid) = normalise_pod_uid(pod_uid) else {
            return Vec::new();
        };
        let mut cache = self.cache.lock();
        let fresh = cache
            .scanned_at
            .is_some_and(|t| t.elapsed() < Self::MIN_RESCAN);
        if !fresh {
            cache.pods = scan_pods(&self.proc_root);
            cache.scanned_at = Some(Instant::now());
        }
        // Within one scan's lifetime, drop the pids that left the pod (or exited) since.
        cache
            .pods
            .get(&uid)
            .into_iter()
            .flatten()
            .copied()
            .filter(|p| pid_uid(&self.proc_root, *p).as_deref() == Some(uid.as_str()))
            .collect()
    }

    /// The pod's containers ([`containers`]); empty when the pod has no process here.
    pub fn containers(&self, pod_uid: &str) -> Vec<PodContainer> {
        let pids = self.pids(pod_uid);
        containers(&self.proc_root, &pids)
    }

    /// The `Unknown` result for a planned pod whose containers [`PodFinder::containers`] did not
    /// find: `PodNotInspectable` when processes of the pod run (their cgroup names it) but none
    /// of their `/proc/<pid>/exe` and `ns/mnt` can be read — the agent lacks `CAP_SYS_PTRACE`,
    /// named in the message when its checks thread does —, else `PodNotFound`. `what` completes
    /// "so … cannot be inspected" (`its /dev/shm`).
    pub fn unavailable(
        &self,
        check: &str,
        subject: &str,
        pod_uid: &str,
        what: &str,
    ) -> CheckResult {
        let pids = self.pids(pod_uid);
        if pids.is_empty() {
            return pod_not_found(check, subject, pod_uid, what);
        }
        let needed = [crate::privilege::Capability::CAP_SYS_PTRACE];
        let lacking = crate::privilege::missing(&needed);
        let cause = crate::privilege::lacking_clause(&needed).unwrap_or_else(|| {
            "the agent holds CAP_SYS_PTRACE, so something else refuses it: a security module \
             (AppArmor, SELinux) or a /proc mounted with hidepid"
                .to_string()
        });
        let shown: Vec<String> = pids.iter().take(5).map(u32::to_string).collect();
        let r = CheckResult::new(
            check,
            subject,
            CheckStatus::Unknown,
            "PodNotInspectable",
            format!(
                "processes of pod {subject} (UID {pod_uid}) run on this node (pid {}), but none of \
                 their /proc entries (exe, ns/mnt) can be read, so {what} cannot be inspected; \
                 {cause}.",
                shown.join(", ")
            ),
        )
        .with("podUid", pod_uid)
        .with("pids", shown.join(","));
        if lacking.is_empty() {
            r
        } else {
            r.with("missingCapabilities", crate::privilege::names(&lacking))
        }
    }
}

/// The `Unknown` result for a planned pod none of whose processes runs on this node
/// (`PodNotFound`); `what` completes "so … cannot be inspected" (`its /dev/shm`).
pub fn pod_not_found(check: &str, subject: &str, uid: &str, what: &str) -> CheckResult {
    CheckResult::new(
        check,
        subject,
        CheckStatus::Unknown,
        "PodNotFound",
        format!(
            "no process of pod {subject} (UID {uid}) runs on this node, so {what} cannot be \
             inspected; the pod may not have started yet, or the agent lacks hostPID."
        ),
    )
    .with("podUid", uid)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn namespace_inodes() {
        assert_eq!(ns_inode("mnt:[4026531840]"), Some(4026531840));
        assert_eq!(ns_inode("net:[1]"), Some(1));
        assert_eq!(ns_inode("net:[]"), None);
        assert_eq!(ns_inode("/proc/1/ns/net"), None);
        assert!(is_sandbox_exe("/pause"));
        assert!(is_sandbox_exe("/usr/bin/pause"));
        assert!(!is_sandbox_exe("/usr/bin/python3"));
    }

    /// Container IDs as the runtimes write them into cgroup paths (containerd, CRI-O and Docker
    /// under the systemd driver, cgroup v2 and v1; the cgroupfs driver), and what is not one.
    #[test]
    fn container_ids_from_cgroup_paths() {
        let id = "0b5c3e1f9a8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b";
        for text in [
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3f1c2a9e_1b2c_4d5e_8f90_0123456789ab.slice/cri-containerd-{id}.scope\n"),
            format!("0::/kubepods.slice/kubepods-pod3f1c2a9e_1b2c.slice/crio-{id}.scope\n"),
            format!("12:pids:/kubepods/besteffort/pod3f1c2a9e-1b2c-4d5e-8f90-0123456789ab/{id}\n1:name=systemd:/kubepods/besteffort/pod3f1c2a9e-1b2c-4d5e-8f90-0123456789ab/{id}\n"),
            format!("0::/kubepods.slice/kubepods-pod1.slice/docker-{}.scope\n", id.to_uppercase()),
        ] {
            assert_eq!(container_id_from_cgroup(&text).as_deref(), Some(id), "{text}");
        }
        for text in [
            "0::/kubepods.slice/kubepods-pod3f1c2a9e_1b2c.slice\n".to_string(),
            format!("0::/kubepods.slice/kubepods-pod1.slice/crio-conmon-{id}.scope\n"),
            format!("0::/system.slice/containerd.service/{id}\n"),
            "0::/kubepods/besteffort/pod3f1c2a9e-1b2c-4d5e-8f90-0123456789ab/abc\n".to_string(),
            "0::/kubepods/besteffort/pod3f1c2a9e-1b2c-4d5e-8f90-0123456789ab\n".to_string(),
        ] {
            assert_eq!(container_id_from_cgroup(&text), None, "{text}");
        }
    }

    #[test]
    fn fixture_proc_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let uid = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";
        let cg = format!("0::/kubepods/burstable/pod{uid}/abc\n");
        for (pid, cgroup, exe, mnt) in [
            (10, cg.as_str(), "/pause", "mnt:[100]"),
            (11, cg.as_str(), "/usr/bin/python3", "mnt:[101]"),
            (12, cg.as_str(), "/usr/bin/python3", "mnt:[101]"),
            (13, cg.as_str(), "/bin/sidecar", "mnt:[102]"),
            (
                20,
                "0::/system.slice/sshd.service\n",
                "/usr/sbin/sshd",
                "mnt:[1]",
            ),
        ] {
            let d = root.join(pid.to_string());
            std::fs::create_dir_all(d.join("ns")).unwrap();
            std::fs::write(d.join("cgroup"), cgroup).unwrap();
            std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
            std::os::unix::fs::symlink(mnt, d.join("ns").join("mnt")).unwrap();
        }
        std::fs::create_dir_all(root.join("self")).unwrap();
        let pods = scan_pods(root);
        assert_eq!(pods.len(), 1);
        assert_eq!(pods[uid], vec![10, 11, 12, 13]);
        let f = PodFinder::new(root);
        assert_eq!(
            f.pids(&uid.to_uppercase().replace('-', "_")),
            vec![10, 11, 12, 13]
        );
        let c = f.containers(uid);
        assert_eq!(
            c.iter().map(|c| c.pid).collect::<Vec<_>>(),
            vec![11, 13],
            "one per mount namespace, pause skipped"
        );
        assert_eq!(c[0].mnt_ns, Some(101));
        assert_eq!(
            c[0].path_inside(root, Path::new("/dev/shm")),
            root.join("11/root/dev/shm")
        );
        assert!(f.pids("00000000-0000-0000-0000-000000000000").is_empty());
        assert!(f.pids("not a uid").is_empty());
        // a process that left the pod is noticed through the cached pids
        std::fs::write(root.join("13/cgroup"), "0::/\n").unwrap();
        std::thread::sleep(PodFinder::MIN_RESCAN);
        assert_eq!(f.pids(uid), vec![10, 11, 12]);
        // only the sandbox left: it is the container
        assert_eq!(containers(root, &[10])[0].pid, 10);
    }

    /// A pod first seen with only its sandbox (the engine image still pulling) shows the engine
    /// once it starts: a cached answer whose pids are all alive is not taken as complete.
    #[test]
    fn a_container_that_starts_after_the_first_look_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let uid = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";
        let cg = format!("0::/kubepods/burstable/pod{uid}/abc\n");
        let add = |pid: u32, exe: &str, mnt: &str| {
            let d = root.join(pid.to_string());
            std::fs::create_dir_all(d.join("ns")).unwrap();
            std::fs::write(d.join("cgroup"), &cg).unwrap();
            std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
            std::os::unix::fs::symlink(mnt, d.join("ns").join("mnt")).unwrap();
        };
        add(10, "/pause", "mnt:[100]");
        let f = PodFinder::new(root);
        assert_eq!(f.pids(uid), vec![10]);
        add(11, "/usr/bin/python3", "mnt:[101]");
        std::thread::sleep(PodFinder::MIN_RESCAN);
        assert_eq!(f.pids(uid), vec![10, 11]);
        assert_eq!(
            f.containers(uid).iter().map(|c| c.pid).collect::<Vec<_>>(),
            vec![11]
        );
    }

    /// A pod whose processes show in their cgroups but whose exe and ns/mnt cannot be read (what
    /// an agent without CAP_SYS_PTRACE sees of an engine container) is PodNotInspectable, not
    /// PodNotFound; the capability is named only when this thread lacks it.
    #[test]
    fn unreadable_processes_are_not_inspectable_rather_than_absent() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let uid = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";
        let d = root.join("42");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("cgroup"),
            format!(
                "0::/kubepods/pod{uid}/c
"
            ),
        )
        .unwrap();
        let f = PodFinder::new(root);
        assert!(f.containers(uid).is_empty());
        let r = f.unavailable("shm", "team-a/vllm-0", uid, "its /dev/shm");
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Unknown, "PodNotInspectable")
        );
        assert_eq!(r.observed["pids"], "42");
        assert!(r.message.contains("CAP_SYS_PTRACE"), "{}", r.message);
        let lacking = crate::privilege::missing(&[crate::privilege::Capability::CAP_SYS_PTRACE]);
        assert_eq!(
            r.observed.contains_key("missingCapabilities"),
            !lacking.is_empty()
        );
        // Without the capability (a thread that dropped everything) it is named as missing.
        let r = std::thread::scope(|s| {
            s.spawn(|| {
                crate::privilege::drop_all().unwrap();
                f.unavailable("shm", "team-a/vllm-0", uid, "its /dev/shm")
            })
            .join()
            .unwrap()
        });
        assert_eq!(r.observed["missingCapabilities"], "CAP_SYS_PTRACE");
        assert!(
            r.message.contains("the agent lacks CAP_SYS_PTRACE"),
            "{}",
            r.message
        );
        // No process at all: PodNotFound.
        let r = f.unavailable(
            "shm",
            "team-a/vllm-1",
            "00000000-0000-0000-0000-000000000001",
            "x",
        );
        assert_eq!(r.reason, "PodNotFound");
    }
}
