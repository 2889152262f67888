//! Opt-in bearer-token protection of the agent's `/metrics` and `/v1/report`
//! (`ic-agent run --http-bearer-token-file`; docs/security.md "Agent endpoints").
//!
//! The agent has no Kubernetes API access of its own, so instead of a TokenReview it compares the
//! caller's `Authorization: Bearer <token>` with a shared secret read from a file (the chart
//! mounts a Secret; Prometheus sends it with `authorization.credentials`): the same opt-in shape as
//! dcgm-exporter's basic-auth web config. `/healthz` and `/readyz` stay open (kubelet probes).
//!
//! The file is re-read when its modification time or size changes, checked at most every
//! [`RECHECK`], so a rotated Secret takes effect without a restart; a file that becomes unreadable
//! or empty refuses every caller (fail closed) and logs why. The comparison is constant-time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;

/// How often the token file's metadata is looked at.
pub const RECHECK: Duration = Duration::from_secs(5);

/// Longest token file read (a service-account token is ~1 KiB; a Secret value is ≤ 1 MiB).
const MAX_TOKEN_BYTES: u64 = 16 * 1024;

/// The shared secret and where it comes from.
#[derive(Debug)]
pub struct BearerToken {
    path: PathBuf,
    cached: Mutex<Cached>,
}

#[derive(Debug)]
struct Cached {
    checked: Instant,
    stamp: Option<(SystemTime, u64)>,
    /// The token, or why there is none (every caller is refused then).
    token: Result<Vec<u8>, String>,
}

impl BearerToken {
    /// Reads `path` now.
    ///
    /// Errors: the file cannot be read, is larger than 16 KiB, or holds only whitespace — the
    /// agent must not start with an authentication it cannot apply.
    pub fn from_file(path: PathBuf) -> Result<Arc<Self>, String> {
        let token = read_token(&path)?;
        Ok(Arc::new(BearerToken {
            cached: Mutex::new(Cached {
                checked: Instant::now(),
                stamp: stamp(&path),
                token: Ok(token),
            }),
            path,
        }))
    }

    /// Whether `presented` (the bytes after `Bearer `) is the current token.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut c = self.cached.lock();
        if c.checked.elapsed() >= RECHECK {
            c.checked = Instant::now();
            let now = stamp(&self.path);
            if now != c.stamp || now.is_none() {
                c.stamp = now;
                c.token = read_token(&self.path);
                if let Err(e) = &c.token {
                    tracing::warn!(error = %e, "agent HTTP bearer token unusable: refusing every caller");
                }
            }
        }
        match &c.token {
            Ok(t) => bool::from(subtle::ConstantTimeEq::ct_eq(t.as_slice(), presented)),
            Err(_) => false,
        }
    }
}

fn stamp(path: &std::path::Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

fn read_token(path: &std::path::Path) -> Result<Vec<u8>, String> {
    let what = || format!("bearer token file {}", path.display());
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", what()))?
        .len();
    if len > MAX_TOKEN_BYTES {
        return Err(format!(
            "{}: {len} bytes, more than {MAX_TOKEN_BYTES}",
            what()
        ));
    }
    let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", what()))?;
    let token = raw.trim_ascii().to_vec();
    if token.is_empty() {
        return Err(format!("{}: empty", what()));
    }
    Ok(token)
}

/// axum middleware: 401 with `WWW-Authenticate: Bearer` unless the request carries the token.
pub async fn require(State(token): State<Arc<BearerToken>>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(p) if token.accepts(p) => next.run(req).await,
        _ => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a valid bearer token is required (--http-bearer-token-file)\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_trimmed_rotated_and_an_unusable_file_refuses_everyone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let t = BearerToken::from_file(path.clone()).unwrap();
        assert!(t.accepts(b"s3cret"));
        assert!(!t.accepts(b"s3cre"));
        assert!(!t.accepts(b"s3cret\n"));
        assert!(!t.accepts(b""));

        // Rotation: the new token once the recheck interval passed; the old one no more.
        std::fs::write(&path, "rotated-token").unwrap();
        t.cached.lock().checked -= RECHECK;
        assert!(t.accepts(b"rotated-token"));
        assert!(!t.accepts(b"s3cret"));

        // Gone or emptied: nobody gets in (fail closed).
        std::fs::write(&path, "  \n").unwrap();
        t.cached.lock().checked -= RECHECK;
        assert!(!t.accepts(b"rotated-token"));
        assert!(!t.accepts(b""));

        assert!(BearerToken::from_file(dir.path().join("missing")).is_err());
        std::fs::write(&path, vec![b'a'; 20_000]).unwrap();
        assert!(BearerToken::from_file(path)
            .unwrap_err()
            .contains("more than"));
    }
}
