//! `ports` check against a real `mooncake_master` (PyPI wheel `mooncake-transfer-engine`,
//! run straight from the unzipped wheel; needs apt `libibverbs1`), as root, inside a private
//! network namespace (`unshare -n`): the master binds 50051 (RPC), 8080 (HTTP metadata) and
//! 9003 (metrics, `/health`) on 0.0.0.0 whatever host flags say.
//!
//! Cases: the master holds its three ports (identified by its own executable), and the case
//! where 8080 is already taken: the master then runs without its metadata server and still
//! reports healthy, so only the port check shows that 8080 belongs to someone else.
//!
//! The binary is found through `IC_MOONCAKE_MASTER`, else where `scripts/setup.sh` unzips the
//! wheel (`target/ci-cache/mooncake-0.3.11.post1/mooncake/mooncake_master`); without it the test
//! fails naming that script. Without root it is recorded as skipped (`support::skip`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ic_agent::checks::ports::PortsCheck;
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, PortExpect, PortExpectation, PortOwner};
use support::{is_root, signal};

const INNER: &str = "IC_NODE_TESTS_INNER";
const MASTER: &str = "IC_MOONCAKE_MASTER";
const PORTS: [(u16, &str); 3] = [
    (50051, "mooncake master rpc"),
    (8080, "mooncake master http metadata"),
    (9003, "mooncake master metrics"),
];

struct Master {
    child: Child,
}

impl Master {
    fn start(exe: &Path, log: &Path) -> Self {
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(exe)
            .args([
                "--rpc_port=50051",
                "--metrics_port=9003",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_port=8080",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Master { child }
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        // it ignores SIGTERM for a while: ask, then insist
        if self.running() {
            signal(self.child.id(), "TERM");
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn check(plan: Vec<PortExpectation>) -> Vec<CheckResult> {
    // The test's private network namespace stands for the host's.
    let r = PortsCheck::new(&ChecksConfig {
        host_netns: Some("/proc/self/net".into()),
        ..ChecksConfig::default()
    })
    .run(&NodePlan {
        ports: plan,
        ..NodePlan::default()
    });
    for x in &r {
        println!("{:?} {} {}: {}", x.status, x.reason, x.subject, x.message);
    }
    r
}

fn held_by_master(exe: &Path) -> Vec<PortExpectation> {
    PORTS
        .iter()
        .map(|(port, purpose)| PortExpectation {
            port: *port,
            expect: PortExpect::Held,
            owner: Some(PortOwner {
                exe: Some(exe.display().to_string()),
                pod_uid: None,
            }),
            purpose: purpose.to_string(),
        })
        .collect()
}

fn wait_listening(ports: &[u16]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = check(vec![]);
        let listening = &r[0].observed["allAddressesPorts"];
        if ports
            .iter()
            .all(|p| listening.split(',').any(|l| l == p.to_string()))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ports {ports:?} not listening: {listening}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn http_get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// `IC_MOONCAKE_MASTER`, else scripts/setup.sh's copy; panics naming the setup script when
/// neither exists.
fn master_exe() -> PathBuf {
    let p = std::env::var_os(MASTER)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/ci-cache/mooncake-0.3.11.post1/mooncake/mooncake_master")
        });
    std::fs::canonicalize(&p).unwrap_or_else(|e| {
        panic!(
            "no mooncake_master at {} ({e}): run {} (or set {MASTER} to an unzipped \
             mooncake-transfer-engine==0.3.11.post1 wheel's mooncake/mooncake_master)",
            p.display(),
            support::SETUP
        )
    })
}

#[test]
fn mooncake_master_ports() {
    if std::env::var(INNER).as_deref() != Ok("mooncake_master_ports") {
        let exe = master_exe();
        if !is_root() {
            support::skip(
                "checks_mooncake::mooncake_master_ports",
                "needs root for a network namespace (CI runs as root)",
            );
            return;
        }
        let out = Command::new("unshare")
            .args(["-n", "--"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "mooncake_master_ports",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(INNER, "mooncake_master_ports")
            .env(MASTER, &exe)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!(
            "--- inner stdout\n{stdout}\n--- inner stderr\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "inner run failed: {}", out.status);
        assert!(stdout.contains("1 passed"), "the inner run did not run");
        // nothing of ours survives the namespace
        for p in std::fs::read_dir("/proc").unwrap().flatten() {
            if let Ok(e) = std::fs::read_link(p.path().join("exe")) {
                assert_ne!(
                    e,
                    exe,
                    "a mooncake_master was left running (pid {:?})",
                    p.file_name()
                );
            }
        }
        return;
    }
    let exe = master_exe();
    support::sh("ip", &["link", "set", "lo", "up"]);
    let dir = tempfile::tempdir().unwrap();

    // 1. the master holds all three ports, identified by its executable
    {
        let mut m = Master::start(&exe, &dir.path().join("master1.log"));
        wait_listening(&[50051, 8080, 9003]);
        assert!(m.running());
        let mut plan = held_by_master(&exe);
        plan.push(PortExpectation {
            port: 50051,
            expect: PortExpect::Free,
            owner: None,
            purpose: "hostNetwork engine".into(),
        });
        let r = check(plan);
        for x in &r[1..4] {
            assert_eq!(
                (x.status, x.reason.as_str()),
                (CheckStatus::Ok, "PortOk"),
                "{x:?}"
            );
            assert_eq!(x.observed["verdict"], "HeldByExpected");
            assert_eq!(x.observed["exes"], exe.display().to_string());
            assert_eq!(x.observed["pids"], m.child.id().to_string());
            assert_eq!(x.observed["bindScope"], "all");
        }
        assert_eq!(r[4].reason, "PortConflict");
        assert!(r[4].message.contains("mooncake_master"), "{}", r[4].message);
        assert!(http_get(9003, "/health").contains("\"status\":\"ok\""));
    }

    // 2. 8080 already taken: the master starts anyway, without its metadata server, and says
    //    it is healthy; the port check names the real holder
    let squatter = TcpListener::bind("0.0.0.0:8080").unwrap();
    let mut m = Master::start(&exe, &dir.path().join("master2.log"));
    wait_listening(&[50051, 9003]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        m.running(),
        "the master exited although only 8080 was taken"
    );
    let health = http_get(9003, "/health");
    println!("health: {health}");
    assert!(health.contains("\"status\":\"ok\""), "{health}");
    let r = check(held_by_master(&exe));
    assert_eq!(r[1].reason, "PortOk", "50051: {:?}", r[1]);
    assert_eq!(r[3].reason, "PortOk", "9003: {:?}", r[3]);
    assert_eq!(
        (r[2].status, r[2].reason.as_str()),
        (CheckStatus::Critical, "PortOwnerMismatch"),
        "8080: {:?}",
        r[2]
    );
    assert_eq!(r[2].observed["verdict"], "OwnerMismatch");
    let own = std::fs::read_link("/proc/self/exe").unwrap();
    assert_eq!(r[2].observed["exes"], own.display().to_string());
    assert_eq!(r[2].observed["pids"], std::process::id().to_string());
    drop(m);
    drop(squatter);
}
