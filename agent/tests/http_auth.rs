//! `ic-agent run --http-bearer-token-file`: the real binary's `/metrics` and `/v1/report` (on the
//! troubleshooting listener and on the separate metrics listener) answer only a caller that
//! presents the file's token; `/healthz` and `/readyz` stay open; a rotated file takes effect
//! without a restart; an unusable file stops the agent at start with a clear error.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `GET path` with an optional bearer token: (status code, whole response).
fn get(addr: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, out)
}

const PLAN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../config/standalone/plan.yaml"
);

#[test]
fn metrics_and_report_need_the_token_probes_do_not_and_rotation_applies() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "first-token\n").unwrap();
    let (http, metrics) = (free_addr(), free_addr());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args(["run", "--plan", PLAN, "--http-addr", &http])
        .args(["--metrics-addr", &metrics])
        .arg("--http-bearer-token-file")
        .arg(&token)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    // Both listeners: the metrics one may come up after the HTTP one reads ready (a 2-core CI
    // machine under load refused the first metrics connection once).
    while std::net::TcpStream::connect(&http).is_err()
        || std::net::TcpStream::connect(&metrics).is_err()
        || get(&http, "/readyz", None).0 != 200
    {
        assert!(Instant::now() < deadline, "ic-agent never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(get(&http, "/healthz", None).0, 200);
    for (addr, path) in [
        (&http, "/metrics"),
        (&http, "/v1/report"),
        (&metrics, "/metrics"),
    ] {
        let (code, resp) = get(addr, path, None);
        assert_eq!(code, 401, "{path} without a token: {resp}");
        assert!(
            resp.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{resp}"
        );
        assert_eq!(
            get(addr, path, Some("wrong")).0,
            401,
            "{path} with a wrong token"
        );
        assert_eq!(
            get(addr, path, Some("first-toke")).0,
            401,
            "{path} with a prefix of the token"
        );
        let (code, resp) = get(addr, path, Some("first-token"));
        assert_eq!(code, 200, "{path} with the token: {resp}");
    }
    assert!(get(&metrics, "/metrics", Some("first-token"))
        .1
        .contains("inferencecache_agent_check_results"));

    // A rotated Secret: the new token within the recheck interval, the old one refused.
    std::fs::write(&token, "second-token").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(&http, "/metrics", Some("second-token")).0 != 200 {
        assert!(
            Instant::now() < deadline,
            "the rotated token was never accepted"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(get(&http, "/metrics", Some("first-token")).0, 401);
    assert_eq!(get(&metrics, "/metrics", Some("second-token")).0, 200);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn an_unusable_token_file_stops_the_agent_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    for (file, want) in [
        (dir.path().join("missing"), "bearer token file"),
        (empty, "empty"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
            .args(["run", "--plan", PLAN, "--http-addr", &free_addr()])
            .arg("--http-bearer-token-file")
            .arg(&file)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{err}");
    }
}
