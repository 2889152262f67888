//! File access confined to one directory tree (a model-cache volume as a reader pod sees it):
//! every path is resolved by the kernel beneath the volume's root directory, so a symbolic link
//! (or `..`) that leads out of the volume is refused instead of followed (docs/security.md
//! "Mounts check").
//!
//! Paths are opened with `openat2(2)` and `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS` relative to
//! the root's descriptor: links that stay inside the volume (Hugging Face caches link
//! `snapshots/<rev>/…` to `blobs/…`) still resolve. On kernels without `openat2` (before 5.6)
//! each component is opened with `O_NOFOLLOW` instead, which refuses every symbolic link. Names
//! the write probes create, rename or remove are single components handled with the `*at`
//! calls on the root's descriptor.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// An open volume root.
#[derive(Debug)]
pub struct Volume {
    root: OwnedFd,
}

/// Whether an error means "the path leaves the volume" (a link outside it, or any link on a
/// kernel without `openat2`).
pub fn is_escape(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EXDEV) | Some(libc::ELOOP))
}

/// A sentence for an error of [`Volume`]'s calls.
pub fn describe(e: &io::Error) -> String {
    if is_escape(e) {
        format!("the path leads out of the volume through a symbolic link ({e}); not followed")
    } else {
        e.to_string()
    }
}

impl Volume {
    /// Opens `dir` (which must be a directory, not a symbolic link) as the root.
    pub fn open(dir: &Path) -> io::Result<Self> {
        let root = nix::fcntl::open(
            dir,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Volume { root })
    }

    /// Opens `rel` (relative, `..` and absolute paths refused) beneath the root with `flags`.
    pub fn open_file(&self, rel: &Path, flags: OFlag) -> io::Result<File> {
        if rel.as_os_str().is_empty()
            || !rel
                .components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(io::Error::from_raw_os_error(libc::EXDEV));
        }
        let flags = flags | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        let how = OpenHow::new()
            .flags(flags)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        match nix::fcntl::openat2(self.root.as_fd(), rel, how) {
            Ok(fd) => Ok(File::from(fd)),
            // No openat2 (kernel before 5.6, or a seccomp profile that refuses it).
            Err(Errno::ENOSYS) | Err(Errno::EPERM) => self.walk(rel, flags),
            Err(e) => Err(e.into()),
        }
    }

    /// `openat2` fallback: one component at a time, none of them followed if a link.
    pub(crate) fn walk(&self, rel: &Path, flags: OFlag) -> io::Result<File> {
        let names: Vec<&OsStr> = rel
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n),
                _ => None,
            })
            .collect();
        let Some((last, dirs)) = names.split_last() else {
            return Err(io::Error::from_raw_os_error(libc::EXDEV));
        };
        let mut dir: Option<OwnedFd> = None;
        for name in dirs {
            let at = dir.as_ref().map_or(self.root.as_fd(), |d| d.as_fd());
            let next = nix::fcntl::openat(
                at,
                *name,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            dir = Some(next);
        }
        let at = dir.as_ref().map_or(self.root.as_fd(), |d| d.as_fd());
        let fd = nix::fcntl::openat(at, *last, flags | OFlag::O_NOFOLLOW, Mode::empty())?;
        Ok(File::from(fd))
    }

    /// Creates the new file `name` (one component) in the root, exclusively, mode 0600.
    pub fn create_new(&self, name: &str) -> io::Result<File> {
        let fd = nix::fcntl::openat(
            self.root.as_fd(),
            name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )?;
        Ok(File::from(fd))
    }

    /// Removes the file `name` (one component) from the root.
    pub fn unlink(&self, name: &str) -> io::Result<()> {
        nix::unistd::unlinkat(
            self.root.as_fd(),
            name,
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        )
        .map_err(io::Error::from)
    }

    /// Creates the directory `name` (one component) in the root.
    pub fn mkdir(&self, name: &str) -> io::Result<()> {
        nix::sys::stat::mkdirat(self.root.as_fd(), name, Mode::from_bits_truncate(0o700))
            .map_err(io::Error::from)
    }

    /// Removes the directory `name` (one component) from the root.
    pub fn rmdir(&self, name: &str) -> io::Result<()> {
        nix::unistd::unlinkat(
            self.root.as_fd(),
            name,
            nix::unistd::UnlinkatFlags::RemoveDir,
        )
        .map_err(io::Error::from)
    }

    /// Renames `from` to `to` (one component each) within the root.
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        nix::fcntl::renameat(self.root.as_fd(), from, self.root.as_fd(), to)
            .map_err(io::Error::from)
    }

    /// The first regular file directly in the root (at most 256 entries looked at), as a
    /// relative path; symbolic links are not taken.
    pub fn first_regular_file(&self) -> Option<std::path::PathBuf> {
        let dup = self.root.try_clone().ok()?;
        let mut dir = nix::dir::Dir::from_fd(dup).ok()?;
        let found = dir
            .iter()
            .flatten()
            .take(256)
            .filter(|e| e.file_type() == Some(nix::dir::Type::File))
            .map(|e| std::path::PathBuf::from(OsStr::from_bytes(e.file_name().to_bytes())))
            .next();
        found
    }
}
