//! `ports` check: real listeners of this test process on the real `/proc`, and a fixture
//! procfs tree for owners, pods and errors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::TcpListener;
use std::os::unix::fs::symlink;
use std::path::Path;

use ic_agent::checks::ports::PortsCheck;
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{NodePlan, PortExpect, PortExpectation, PortOwner};

fn expect(port: u16, expect: PortExpect, owner: Option<PortOwner>) -> PortExpectation {
    PortExpectation {
        port,
        expect,
        owner,
        purpose: String::new(),
    }
}

fn run(cfg: &ChecksConfig, ports: Vec<PortExpectation>) -> Vec<CheckResult> {
    PortsCheck::new(cfg).run(&NodePlan {
        ports,
        ..NodePlan::default()
    })
}

fn by_subject<'a>(r: &'a [CheckResult], subject: &str) -> &'a CheckResult {
    r.iter()
        .find(|r| r.subject == subject)
        .unwrap_or_else(|| panic!("no {subject} in {r:#?}"))
}

fn own_exe() -> String {
    std::fs::read_link("/proc/self/exe")
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn a_real_loopback_listener_is_held_by_this_process() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let exe = own_exe();
    let pid = std::process::id().to_string();

    let r = run(
        &ChecksConfig::default(),
        vec![
            expect(
                port,
                PortExpect::Held,
                Some(PortOwner {
                    exe: Some(exe.clone()),
                    pod_uid: None,
                }),
            ),
            expect(port, PortExpect::Free, None),
        ],
    );
    // host, the two expectations, the ephemeral-range result
    assert_eq!(r.len(), 4, "{r:#?}");
    let host = by_subject(&r, "host");
    assert_eq!(
        (host.status, host.reason.as_str()),
        (CheckStatus::Ok, "ListeningPorts")
    );
    assert!(host.observed["listeningPorts"].parse::<usize>().unwrap() >= 1);
    assert!(
        host.observed["loopbackPorts"]
            .split(',')
            .any(|p| p == port.to_string()),
        "{host:?}"
    );

    let held = &r[1];
    assert_eq!(held.subject, format!("tcp/{port}"));
    assert_eq!(
        (held.status, held.reason.as_str()),
        (CheckStatus::Ok, "PortOk"),
        "{held:?}"
    );
    assert_eq!(held.observed["pids"], pid);
    assert_eq!(held.observed["exes"], exe);
    assert_eq!(held.observed["bindScope"], "loopback");
    assert_eq!(held.observed["addresses"], "127.0.0.1");
    assert_eq!(held.observed["listening"], "true");

    let free = &r[2];
    assert_eq!(
        (free.status, free.reason.as_str()),
        (CheckStatus::Critical, "PortConflict")
    );
    for needle in [format!("port {port}"), format!("pid {pid}"), exe.clone()] {
        assert!(
            free.message.contains(&needle),
            "{needle} not in {}",
            free.message
        );
    }

    // the wrong owner
    let r = run(
        &ChecksConfig::default(),
        vec![expect(
            port,
            PortExpect::Held,
            Some(PortOwner {
                exe: Some("/usr/bin/not-this".into()),
                pod_uid: None,
            }),
        )],
    );
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Critical, "PortOwnerMismatch")
    );
    assert!(
        r[1].message.contains("/usr/bin/not-this"),
        "{}",
        r[1].message
    );

    // closed: free is Ok, held is NotListening
    drop(l);
    let r = run(
        &ChecksConfig::default(),
        vec![
            expect(port, PortExpect::Free, None),
            expect(port, PortExpect::Held, None),
        ],
    );
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Ok, "PortOk")
    );
    assert_eq!(r[1].observed["listening"], "false");
    assert_eq!(
        (r[2].status, r[2].reason.as_str()),
        (CheckStatus::Critical, "PortNotListening")
    );
}

#[test]
fn a_real_all_addresses_listener_is_counted_as_such() {
    let l = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let r = run(
        &ChecksConfig::default(),
        vec![expect(port, PortExpect::Free, None)],
    );
    let host = by_subject(&r, "host");
    assert!(
        host.observed["allAddressesPorts"]
            .split(',')
            .any(|p| p == port.to_string()),
        "{host:?}"
    );
    let c = by_subject(&r, &format!("tcp/{port}"));
    assert_eq!(c.reason, "PortConflict");
    assert_eq!(c.observed["bindScope"], "all");
    assert_eq!(c.observed["addresses"], "0.0.0.0");
}

// ---- fixture procfs -------------------------------------------------------------------------

const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:C383 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 7001 1 0000000000000000 100 0 0 10 0
   1: 0100007F:15B5 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 7002 1 0000000000000000 100 0 0 10 0
   2: 0100007F:15B5 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 7003 1 0000000000000000 20 4 30 10 -1
   3: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 7004 1 0000000000000000 100 0 0 10 0
";
const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:C383 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 7101 1 0000000000000000 100 0 0 10 0
";
const POD: &str = "3f1c2a9e-1b2c-4d5e-8f90-0123456789ab";

fn process(root: &Path, pid: u32, exe: &str, cgroup: &str, sockets: &[u64]) {
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(dir.join("fd")).unwrap();
    symlink(exe, dir.join("exe")).unwrap();
    std::fs::write(dir.join("cgroup"), cgroup).unwrap();
    symlink("/dev/null", dir.join("fd").join("0")).unwrap();
    symlink("pipe:[1]", dir.join("fd").join("1")).unwrap();
    for (i, inode) in sockets.iter().enumerate() {
        symlink(
            format!("socket:[{inode}]"),
            dir.join("fd").join((3 + i).to_string()),
        )
        .unwrap();
    }
}

fn fixture() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let p = root.path();
    std::fs::create_dir_all(p.join("net")).unwrap();
    std::fs::write(p.join("net/tcp"), TCP).unwrap();
    std::fs::write(p.join("net/tcp6"), TCP6).unwrap();
    // the kernel's defaults: 50051 lies in the ephemeral range, nothing is reserved
    std::fs::create_dir_all(p.join("sys/net/ipv4")).unwrap();
    std::fs::write(p.join("sys/net/ipv4/ip_local_port_range"), "32768\t60999\n").unwrap();
    std::fs::write(p.join("sys/net/ipv4/ip_local_reserved_ports"), "\n").unwrap();
    // mooncake master (systemd cgroup driver, in a pod) holds 50051 on 0.0.0.0 and ::
    process(
        p,
        4242,
        "/opt/mooncake/mooncake_master",
        &format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-ab.scope\n",
            POD.replace('-', "_")
        ),
        &[7001, 7101],
    );
    // its python wrapper: same comm, no socket
    process(p, 4241, "/usr/bin/python3.11", "0::/\n", &[]);
    // an engine on 5557 (cgroupfs driver, cgroup v1 lines), and a forked worker sharing it
    let engine_cg = format!("12:pids:/kubepods/besteffort/pod{POD}/0123\n0::/\n");
    process(
        p,
        5000,
        "/usr/bin/python3.11 (deleted)",
        &engine_cg,
        &[7002],
    );
    process(p, 5001, "/usr/bin/python3.11", &engine_cg, &[7002]);
    // a node-level process on 8080; 7004's owner is invisible (another PID namespace)
    std::fs::create_dir_all(p.join("self")).unwrap();
    std::fs::create_dir_all(p.join("notapid/fd")).unwrap();
    root
}

#[test]
fn fixture_owners_pods_and_scopes() {
    let root = fixture();
    let cfg = ChecksConfig {
        proc_root: root.path().to_path_buf(),
        ..ChecksConfig::default()
    };
    let r = run(
        &cfg,
        vec![
            expect(50051, PortExpect::Free, None),
            expect(
                50051,
                PortExpect::Held,
                Some(PortOwner {
                    exe: Some("/opt/mooncake/mooncake_master".into()),
                    pod_uid: Some(POD.to_uppercase()),
                }),
            ),
            expect(
                5557,
                PortExpect::Held,
                Some(PortOwner {
                    exe: Some("/usr/bin/python3.11".into()),
                    pod_uid: Some(POD.into()),
                }),
            ),
            expect(
                5557,
                PortExpect::Held,
                Some(PortOwner {
                    exe: None,
                    pod_uid: Some("00000000-0000-0000-0000-000000000000".into()),
                }),
            ),
            expect(
                8080,
                PortExpect::Held,
                Some(PortOwner {
                    exe: Some("/usr/bin/x".into()),
                    pod_uid: None,
                }),
            ),
            expect(8080, PortExpect::Free, None),
            expect(9000, PortExpect::Free, None),
        ],
    );
    let host = &r[0];
    assert_eq!(host.subject, "host");
    assert_eq!(host.observed["listeningPorts"], "3");
    assert_eq!(host.observed["listeningSockets"], "4");
    assert_eq!(host.observed["allAddressesPorts"], "8080,50051");
    assert_eq!(host.observed["loopbackPorts"], "5557");
    assert_eq!(host.observed["allAddressesCount"], "2");
    assert_eq!(host.observed["loopbackCount"], "1");

    let got: Vec<(&str, CheckStatus, &str)> = r[1..]
        .iter()
        .map(|r| (r.subject.as_str(), r.status, r.reason.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("tcp/50051", CheckStatus::Critical, "PortConflict"),
            ("tcp/50051", CheckStatus::Ok, "PortOk"),
            ("tcp/5557", CheckStatus::Ok, "PortOk"),
            ("tcp/5557", CheckStatus::Critical, "PortOwnerMismatch"),
            ("tcp/8080", CheckStatus::Unknown, "PortOwnerUnknown"),
            ("tcp/8080", CheckStatus::Critical, "PortConflict"),
            ("tcp/9000", CheckStatus::Ok, "PortOk"),
            (
                "ephemeral-range",
                CheckStatus::Warning,
                "PortsInEphemeralRange"
            ),
        ]
    );
    // 50051 (the Mooncake master's RPC port) can be taken as a source port: said on the port
    // and in the node's range result.
    assert_eq!(r[1].observed["ephemeralRange"], "32768-60999");
    assert!(!r[3].observed.contains_key("ephemeralRange"));
    assert_eq!(r[8].observed["atRiskPorts"], "50051");
    assert!(r[8].message.contains("32768-60999"), "{}", r[8].message);
    let conflict = &r[1];
    for needle in [
        "port 50051",
        "pid 4242",
        "/opt/mooncake/mooncake_master",
        POD,
    ] {
        assert!(
            conflict.message.contains(needle),
            "{needle} not in {}",
            conflict.message
        );
    }
    assert!(
        !conflict.message.contains("4241"),
        "the wrapper holds no socket"
    );
    assert_eq!(conflict.observed["addresses"], "0.0.0.0,::");
    assert_eq!(conflict.observed["bindScope"], "all");
    assert_eq!(conflict.observed["podUids"], POD);
    let engine = &r[3];
    assert_eq!(engine.observed["pids"], "5000,5001");
    assert_eq!(
        engine.observed["exes"],
        "/usr/bin/python3.11,/usr/bin/python3.11"
    );
    assert_eq!(engine.observed["bindScope"], "loopback");
    let invisible = &r[6];
    assert!(
        invisible.message.contains("socket inode 7004"),
        "{}",
        invisible.message
    );
}

#[test]
fn fixture_missing_tables() {
    let root = tempfile::tempdir().unwrap();
    let cfg = ChecksConfig {
        proc_root: root.path().to_path_buf(),
        ..ChecksConfig::default()
    };
    let r = run(&cfg, vec![expect(80, PortExpect::Free, None)]);
    assert_eq!(r.len(), 2);
    for x in &r {
        assert_eq!(
            (x.status, x.reason.as_str()),
            (CheckStatus::Unknown, "ProcNetUnavailable")
        );
    }
    assert_eq!(r[1].subject, "tcp/80");

    // IPv6 disabled: tcp only is fine
    std::fs::create_dir_all(root.path().join("net")).unwrap();
    std::fs::write(root.path().join("net/tcp"), TCP).unwrap();
    let r = run(&cfg, vec![expect(5557, PortExpect::Held, None)]);
    assert_eq!(r[0].reason, "ListeningPorts");
    assert_eq!(r[0].observed["listeningPorts"], "3");
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Ok, "PortOk")
    );
}
