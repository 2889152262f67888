//! Build script of both binary packages (`controller/`, `agent/`; `build = "../shared/build-commit.rs"`):
//! sets `IC_GIT_COMMIT` for `inferencecache_build_info{commit}` (ic_shared::telemetry).
//!
//! The commit is `$IC_GIT_COMMIT` when set at build time (image builds, where `.git` is not in the
//! build context), else `git rev-parse HEAD` of the checkout, else `unknown`. The script reruns
//! when HEAD or the branch it points to moves, so the number never lags the checkout.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=IC_GIT_COMMIT");
    let commit = match std::env::var("IC_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => {
            // Watch HEAD, the ref it names and packed-refs (wherever this checkout keeps them:
            // plain clone or worktree).
            let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
            if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
                watch.push(r);
            }
            for w in &watch {
                if let Some(p) = git(&["rev-parse", "--path-format=absolute", "--git-path", w]) {
                    if Path::new(&p).exists() {
                        println!("cargo:rerun-if-changed={p}");
                    }
                }
            }
            git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_string())
        }
    };
    println!("cargo:rustc-env=IC_GIT_COMMIT={commit}");
}
