//! The write probes of a reader volume: `create`, `append`, `rename`, `unlink`, `chmod`,
//! `truncate`, `mkdir` (and `ftruncate`, recorded, proving nothing), each of which must fail with
//! `EROFS` on a read-only mount, and none of which changes anything a reader could see if the
//! volume turns out writable (what a probe creates is removed at once).

use std::fmt;
use std::io::{self};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::OFlag;

use super::super::beneath::{self, Volume};

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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

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
}
