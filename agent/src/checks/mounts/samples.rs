//! The planned sample files of a volume: their paths, kept inside the mount, and their SHA-256.

use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

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
