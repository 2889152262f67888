//! `ports` check on the real kernel, as root, in a private network namespace.
//!
//! The outer test re-runs this test binary under `unshare -n` with `IC_NODE_TESTS_INNER`; the
//! inner run brings `lo` up, so its socket tables start empty and the counts are exact. Another
//! process (a copy of this binary under another name, `fake-engine`) holds a port, and is moved
//! into kubepods cgroups (cgroupfs and systemd forms) where the host's cgroup file systems allow
//! it, to read its pod UID from the real `/proc/<pid>/cgroup`. Recorded as skipped
//! (`support::skip`) when not root; fails when `unshare` is missing; CI runs as root.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use ic_agent::checks::ports::{self, PortsCheck};
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, PortExpect, PortExpectation, PortOwner};
use support::{is_inner, rerun_in_unshare, INNER};

const LISTENER: &str = "IC_NODE_TESTS_LISTENER";

/// Not a test of its own: the body of the `fake-engine` child. Binds 127.0.0.1:0, prints the
/// port, and holds it until its stdin closes.
#[test]
fn listener_child() {
    if std::env::var(LISTENER).is_err() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("LISTENING {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

struct FakeEngine {
    child: Child,
    // kept open so that the child's last lines do not hit a closed pipe
    _stdout: std::io::Lines<BufReader<ChildStdout>>,
    port: u16,
    exe: PathBuf,
}

impl FakeEngine {
    fn start(dir: &Path) -> Self {
        let exe = dir.join("fake-engine");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "listener_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(LISTENER, "1")
            .env_remove(INNER)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = loop {
            let line = lines.next().expect("fake-engine exited").unwrap();
            // libtest prints "test listener_child ... " on the same line
            if let Some(i) = line.find("LISTENING ") {
                break line[i + "LISTENING ".len()..].trim().parse().unwrap();
            }
        };
        FakeEngine {
            child,
            _stdout: lines,
            port,
            exe,
        }
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// The check as this namespace's agent: the test's private network namespace stands for the
/// host's (the default reference, PID 1's table, is the real host's; tested apart below).
fn run(ports: Vec<PortExpectation>) -> Vec<CheckResult> {
    run_with(
        &ChecksConfig {
            host_netns: Some("/proc/self/net".into()),
            ..ChecksConfig::default()
        },
        ports,
    )
}

fn run_with(cfg: &ChecksConfig, ports: Vec<PortExpectation>) -> Vec<CheckResult> {
    let r = PortsCheck::new(cfg).run(&NodePlan {
        ports,
        ..NodePlan::default()
    });
    for x in &r {
        println!("{:?} {} {}: {}", x.status, x.reason, x.subject, x.message);
    }
    r
}

fn held_by(port: u16, exe: Option<&Path>, pod_uid: Option<&str>) -> PortExpectation {
    PortExpectation {
        port,
        expect: PortExpect::Held,
        owner: Some(PortOwner {
            exe: exe.map(|e| e.display().to_string()),
            pod_uid: pod_uid.map(str::to_string),
        }),
        purpose: "engine".into(),
    }
}

fn free(port: u16) -> PortExpectation {
    PortExpectation {
        port,
        expect: PortExpect::Free,
        owner: None,
        purpose: "mooncake master".into(),
    }
}

/// A kubepods cgroup made for the test in one hierarchy; removed (leaf first) on drop.
struct PodCgroup {
    dirs: Vec<PathBuf>,
}

impl PodCgroup {
    /// Creates `root/<rel>` (each component) and moves `pid` into it; `None` when this host's
    /// cgroup file system does not allow it.
    fn create(root: &Path, rel: &[String], pid: u32) -> Option<Self> {
        let mut dirs = Vec::new();
        let mut path = root.to_path_buf();
        for comp in rel {
            path.push(comp);
            if !path.exists() {
                if let Err(e) = std::fs::create_dir(&path) {
                    eprintln!("cannot create {}: {e}", path.display());
                    drop(PodCgroup { dirs });
                    return None;
                }
                dirs.push(path.clone());
            }
        }
        let cg = PodCgroup { dirs };
        match std::fs::write(path.join("cgroup.procs"), pid.to_string()) {
            Ok(()) => Some(cg),
            Err(e) => {
                eprintln!("cannot move {pid} into {}: {e}", path.display());
                None
            }
        }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for d in self.dirs.iter().rev() {
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Mount points of this process's cgroup hierarchies: (v1 controller list or "cgroup2", dir).
fn cgroup_mounts() -> Vec<(String, PathBuf)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mp = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fs = r.next()?;
            let opts = r.nth(1).unwrap_or("");
            match fs {
                "cgroup2" => Some(("cgroup2".to_string(), PathBuf::from(mp))),
                "cgroup" => Some((opts.to_string(), PathBuf::from(mp))),
                _ => None,
            }
        })
        .collect()
}

#[test]
fn ports_in_a_private_network_namespace() {
    if !is_inner("ports_in_a_private_network_namespace") {
        rerun_in_unshare(
            "ports_in_a_private_network_namespace",
            &["-n"],
            "network namespaces",
        );
        return;
    }
    let st = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(st.success(), "ip link set lo up");

    // An agent outside the host's network namespace (no hostNetwork) reads its own sockets.
    // Against the real host's table — PID 1's, the default, and the outer test process's (our
    // parent, in the namespace this one was unshared from) — every verdict is Unknown /
    // NotHostNetwork, instead of `Free` ports read Ok and `Held` ones Critical from a namespace
    // where nothing listens.
    let parent = format!("/proc/{}/net", std::os::unix::process::parent_id());
    for host in [None, Some(parent.into())] {
        let outside = ChecksConfig {
            host_netns: host,
            ..ChecksConfig::default()
        };
        let r = run_with(&outside, vec![free(22), held_by(80, None, None)]);
        assert_eq!(r.len(), 3, "{r:?}");
        for x in &r {
            assert_eq!(
                (x.status, x.reason.as_str()),
                (CheckStatus::Unknown, ports::NOT_HOST_NETWORK),
                "{x:?}"
            );
        }
        assert!(r[0].message.contains("hostNetwork"), "{}", r[0].message);
    }

    // a fresh namespace: nothing listens
    let r = run(vec![]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].observed["listeningPorts"], "0", "{:?}", r[0]);

    // our own listeners, by scope
    let all4 = TcpListener::bind("0.0.0.0:0").unwrap();
    let lo4 = TcpListener::bind("127.0.0.1:0").unwrap();
    let all6 = TcpListener::bind("[::]:0").unwrap();
    let lo6 = TcpListener::bind("[::1]:0").unwrap();
    let p = |l: &TcpListener| l.local_addr().unwrap().port();
    let mut all = [p(&all4), p(&all6)];
    all.sort_unstable();
    let mut lo = [p(&lo4), p(&lo6)];
    lo.sort_unstable();
    let r = run(vec![]);
    let h = &r[0];
    assert_eq!(h.observed["listeningPorts"], "4");
    assert_eq!(h.observed["listeningSockets"], "4");
    assert_eq!(
        h.observed["allAddressesPorts"],
        format!("{},{}", all[0], all[1])
    );
    assert_eq!(h.observed["loopbackPorts"], format!("{},{}", lo[0], lo[1]));
    assert_eq!(h.observed["specificAddressCount"], "0");
    let r = run(vec![free(p(&all6)), free(p(&lo6))]);
    assert_eq!(r[1].observed["addresses"], "::");
    assert_eq!(r[1].observed["bindScope"], "all");
    assert_eq!(r[2].observed["addresses"], "::1");
    assert_eq!(r[2].observed["bindScope"], "loopback");

    // another process holds a port: identified by its own exe, not ours
    let dir = tempfile::tempdir().unwrap();
    let engine = FakeEngine::start(dir.path());
    let pid = engine.child.id();
    let own = std::fs::read_link("/proc/self/exe").unwrap();
    let r = run(vec![
        held_by(engine.port, Some(&engine.exe), None),
        held_by(engine.port, Some(&own), None),
        free(engine.port),
    ]);
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Ok, "PortOk")
    );
    assert_eq!(r[1].observed["pids"], pid.to_string());
    assert_eq!(r[1].observed["exes"], engine.exe.display().to_string());
    assert_eq!(
        (r[2].status, r[2].reason.as_str()),
        (CheckStatus::Critical, "PortOwnerMismatch")
    );
    assert_eq!(
        (r[3].status, r[3].reason.as_str()),
        (CheckStatus::Critical, "PortConflict")
    );
    assert_eq!(r[1].observed["verdict"], "HeldByExpected");
    assert_eq!(r[3].observed["verdict"], "Conflict");
    // the engine runs but does not listen on another planned port: a ghost
    let ghost_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let g = run(vec![held_by(ghost_port, Some(&engine.exe), None)]);
    assert_eq!(
        (g[1].status, g[1].reason.as_str()),
        (CheckStatus::Critical, "PortOwnerNotListening")
    );
    assert_eq!(g[1].observed["verdict"], "Ghost");
    assert_eq!(g[1].observed["runningPids"], pid.to_string());
    // nobody of that exe runs: plainly not listening
    let g = run(vec![held_by(
        ghost_port,
        Some(Path::new("/nonexistent/engine")),
        None,
    )]);
    assert_eq!(g[1].reason, "PortNotListening");
    for needle in [
        format!("port {} (mooncake master)", engine.port),
        format!("pid {pid}"),
        engine.exe.display().to_string(),
    ] {
        assert!(
            r[3].message.contains(&needle),
            "{needle} not in {}",
            r[3].message
        );
    }

    // the pod UID from real cgroup files, both drivers, where this host lets us make cgroups
    let uid = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";
    let mut tried = 0;
    for (kind, root) in cgroup_mounts() {
        let opts: Vec<&str> = kind.split(',').collect();
        let systemd_form = vec![
            "kubepods.slice".to_string(),
            "kubepods-besteffort.slice".to_string(),
            format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")),
        ];
        let cgroupfs_form = vec![
            "kubepods".to_string(),
            "besteffort".to_string(),
            format!("pod{uid}"),
        ];
        let (kind, rel) = if kind == "cgroup2" {
            ("cgroup v2, systemd driver form", systemd_form)
        } else if opts.contains(&"name=systemd") {
            ("cgroup v1 name=systemd, systemd driver form", systemd_form)
        } else if opts.contains(&"pids") {
            ("cgroup v1 pids, cgroupfs driver form", cgroupfs_form)
        } else {
            continue;
        };
        let Some(cg) = PodCgroup::create(&root, &rel, pid) else {
            eprintln!("skipped the {kind} cgroup at {}", root.display());
            continue;
        };
        tried += 1;
        let r = run(vec![
            held_by(engine.port, Some(&engine.exe), Some(uid)),
            held_by(
                engine.port,
                None,
                Some("00000000-0000-0000-0000-000000000000"),
            ),
            free(engine.port),
        ]);
        assert_eq!(
            (r[1].status, r[1].reason.as_str()),
            (CheckStatus::Ok, "PortOk"),
            "{kind}: {:?}",
            r[1]
        );
        assert_eq!(r[1].observed["podUids"], uid);
        assert_eq!(r[2].reason, "PortOwnerMismatch");
        assert!(r[3].message.contains(uid), "{}", r[3].message);
        // move the engine back to the hierarchy's root before removing the cgroup
        let _ = std::fs::write(root.join("cgroup.procs"), pid.to_string());
        drop(cg);
        println!("pod UID read through {kind} at {}", root.display());
    }
    if tried == 0 {
        support::skip(
            "checks_ports::ports_in_a_private_network_namespace",
            "the pod-UID part: no writable cgroup hierarchy on this host",
        );
    }

    drop(engine);
    drop((all4, lo4, all6, lo6));
}

/// Field case (issue 39 item 2): Mooncake's master cannot bind 50051 because an outgoing
/// connection of the node took 50051 as its ephemeral source port. In a private network
/// namespace the kernel is made to pick exactly 50051 (`ip_local_port_range` is per namespace),
/// a real connection is made from it, and the check must read the port as held — the same bind
/// the owner would make fails with EADDRINUSE — not free; and 50051 inside the range is flagged
/// until it is reserved in `ip_local_reserved_ports`.
#[test]
fn a_port_an_outgoing_connection_holds_is_not_free() {
    if !is_inner("a_port_an_outgoing_connection_holds_is_not_free") {
        rerun_in_unshare(
            "a_port_an_outgoing_connection_holds_is_not_free",
            &["-n"],
            "network namespaces",
        );
        return;
    }
    let st = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(st.success(), "ip link set lo up");
    let sysctl = |name: &str, value: &str| {
        std::fs::write(format!("/proc/sys/net/ipv4/{name}"), value)
            .unwrap_or_else(|e| panic!("{name}={value}: {e}"));
    };
    const RPC: u16 = 50051;
    let server = TcpListener::bind("127.0.0.1:7070").unwrap();
    sysctl("ip_local_port_range", &format!("{RPC} {RPC}"));
    let client = std::net::TcpStream::connect("127.0.0.1:7070").unwrap();
    assert_eq!(client.local_addr().unwrap().port(), RPC);
    let (accepted, _) = server.accept().unwrap();
    // What the master meets: its bind fails (std sets SO_REUSEADDR; it does not help).
    let err = TcpListener::bind(("0.0.0.0", RPC)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");

    let own = std::fs::read_link("/proc/self/exe").unwrap();
    let r = run(vec![free(RPC), held_by(RPC, Some(&own), None)]);
    let pid = std::process::id().to_string();
    for x in &r[1..3] {
        assert_eq!(
            (x.status, x.reason.as_str()),
            (CheckStatus::Critical, "PortHeldByConnection"),
            "{x:?}"
        );
        assert_eq!(x.observed["verdict"], "HeldByConnection");
        assert_eq!(x.observed["listening"], "false");
        assert_eq!(x.observed["connectionStates"], "ESTABLISHED");
        assert_eq!(
            x.observed["connections"],
            format!("127.0.0.1:{RPC}->127.0.0.1:7070")
        );
        assert_eq!(x.observed["connectionPids"], pid);
        assert!(x.message.contains("EADDRINUSE"), "{}", x.message);
    }
    // The range: 50051 is the whole range here, and not reserved.
    let range = &r[3];
    assert_eq!(range.subject, ports::ephemeral::EPHEMERAL_SUBJECT);
    assert_eq!(
        (range.status, range.reason.as_str()),
        (CheckStatus::Warning, "PortsInEphemeralRange")
    );
    assert!(
        range
            .message
            .contains(&format!("{RPC} (mooncake master, engine)"))
            && range.message.contains(&format!("{RPC}-{RPC}")),
        "{}",
        range.message
    );
    assert_eq!(r[1].observed["ephemeralRange"], format!("{RPC}-{RPC}"));

    // The connection closes: its TIME_WAIT remnant still blocks the bind, for up to 60 s.
    drop(client);
    drop(accepted);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let r = loop {
        let r = run(vec![free(RPC)]);
        if r[1].observed.get("connectionStates").map(String::as_str) == Some("TIME_WAIT") {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "no TIME_WAIT: {r:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Warning, "PortHeldByConnection")
    );
    assert_eq!(
        TcpListener::bind(("0.0.0.0", RPC)).unwrap_err().kind(),
        std::io::ErrorKind::AddrInUse
    );

    // Reserved: the kernel no longer picks it as a source port, and the range result clears.
    sysctl("ip_local_port_range", "32768 60999");
    sysctl("ip_local_reserved_ports", &RPC.to_string());
    let r = run(vec![free(RPC)]);
    assert_eq!(
        (r[2].status, r[2].reason.as_str()),
        (CheckStatus::Ok, "EphemeralRangeClear"),
        "{:?}",
        r[2]
    );
    assert_eq!(r[2].observed["reservedPorts"], RPC.to_string());
    assert!(!r[1].observed.contains_key("ephemeralRange"));
    drop(server);
}
