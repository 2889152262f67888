//! `mp_worker` check against a ZMQ ROUTER that answers with the LMCache MP worker's exact
//! frames, in this process's network namespace (no root needed; the pod-namespace path is in
//! `node-tests/tests/checks_pods.rs`). The worker runs in a child process (this test binary,
//! running `mp_worker_child`) so that it can be stopped with SIGSTOP for the Hung case.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ic_agent::checks::fake::{serve_mp_worker, MpWorkerMode};
use ic_agent::checks::mp_worker::{probe, MpVerdict, MpWorkerCheck};
use ic_agent::checks::{Check, ChecksConfig};
use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{EnginePlan, NodePlan};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const CHILD_MODE: &str = "IC_TEST_MP_MODE";

/// Not a test of its own: the worker. Serves until stdin closes.
#[test]
fn mp_worker_child() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        return;
    };
    let mode = match mode.as_str() {
        "answer" => MpWorkerMode::Answer,
        "wrong-id" => MpWorkerMode::WrongId,
        _ => MpWorkerMode::Silent,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (bound, serve) = serve_mp_worker("tcp://127.0.0.1:0", mode).await.unwrap();
        let port = bound.rsplit(':').next().unwrap().to_string();
        println!("MPWORKER {port}");
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        });
        tokio::select! {
            _ = serve => {}
            _ = stdin_closed => {}
        }
    });
}

struct Worker {
    child: Child,
    port: u16,
}

impl Worker {
    fn start(mode: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "mp_worker_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_MODE, mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = loop {
            let line = lines.next().expect("worker exited").unwrap();
            if let Some(i) = line.find("MPWORKER ") {
                break line[i + 9..].trim().parse().unwrap();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        Worker { child, port }
    }

    /// Sends `s`; for SIGSTOP/SIGCONT, waits until every thread of the worker shows the new
    /// state in /proc (delivery is asynchronous: on a busy machine a thread can still run — and
    /// answer a ZMTP greeting — for a moment after kill() returns).
    fn signal(&self, s: Signal) {
        let pid = self.child.id();
        kill(Pid::from_raw(pid as i32), s).unwrap();
        let want_stopped = match s {
            Signal::SIGSTOP => true,
            Signal::SIGCONT => false,
            _ => return,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let states: Vec<char> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| {
                    d.flatten()
                        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
                        .filter_map(|stat| {
                            stat.rsplit_once(") ")
                                .and_then(|(_, rest)| rest.chars().next())
                        })
                        .collect()
                })
                .unwrap_or_default();
            let done = !states.is_empty() && states.iter().all(|c| (*c == 'T') == want_stopped);
            if done || std::time::Instant::now() > deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGCONT);
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn engine(pod: &str, port: u16) -> EnginePlan {
    EnginePlan {
        namespace: "team-a".into(),
        pod: pod.into(),
        mp_worker_port: Some(port),
        ..EnginePlan::default()
    }
}

fn run(engines: Vec<EnginePlan>, timeout: Duration) -> Vec<CheckResult> {
    let cfg = ChecksConfig {
        mp_worker_timeout: timeout,
        ..ChecksConfig::default()
    };
    let r = MpWorkerCheck::new(&cfg).run(&NodePlan {
        engines,
        ..NodePlan::default()
    });
    for x in &r {
        println!("{:?} {} {}: {}", x.status, x.reason, x.subject, x.message);
    }
    r
}

#[test]
fn the_fake_worker_speaks_the_exact_bytes() {
    let w = Worker::start("answer");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut d = DealerSocket::new();
        d.connect(&format!("tcp://127.0.0.1:{}", w.port))
            .await
            .unwrap();
        for (req, want) in [
            (
                vec![vec![0x07], vec![0x18]],
                vec![vec![0x07], vec![0x18], vec![0xa2, b'O', b'K']],
            ),
            (
                vec![vec![0x08], vec![0x16], vec![0xc0]],
                vec![vec![0x08], vec![0x16], vec![0xc3]],
            ),
            (
                vec![vec![0x0a], vec![0x15]],
                vec![vec![0x0a], vec![0x15], vec![0xcd, 0x01, 0x00]],
            ),
        ] {
            let mut it = req.into_iter();
            let mut m = ZmqMessage::from(it.next().unwrap());
            for f in it {
                m.push_back(f.into());
            }
            d.send(m).await.unwrap();
            let got: Vec<Vec<u8>> = tokio::time::timeout(Duration::from_secs(5), d.recv())
                .await
                .unwrap()
                .unwrap()
                .into_vec()
                .into_iter()
                .map(|b| b.to_vec())
                .collect();
            assert_eq!(got, want);
        }
    });
}

#[test]
fn live_not_listening_and_hung() {
    let w = Worker::start("answer");
    let free = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t = Duration::from_millis(700);
    let r = run(vec![engine("live", w.port), engine("gone", free)], t);
    assert_eq!(r.len(), 2);
    assert_eq!(
        (r[0].subject.as_str(), r[0].status, r[0].reason.as_str()),
        ("team-a/live", CheckStatus::Ok, "MpWorkerLive")
    );
    assert_eq!(r[0].observed["result"], "OK");
    assert_eq!(r[0].observed["verdict"], "Live");
    assert_eq!(r[0].observed["netns"], "agent");
    // The worker's reply is tenant input: the probe thread parsed it without capabilities,
    // although the thread that ran the check holds them (the tests run as root).
    assert_eq!(r[0].observed["probeThreadCapEff"], "0000000000000000");
    assert_ne!(
        ic_agent::privilege::thread_cap_eff().as_deref(),
        Some("0000000000000000"),
        "run the agent tests as root (CI does)"
    );
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Critical, "MpWorkerNotListening")
    );
    assert_eq!(r[1].observed["verdict"], "NotListening");

    // stopped: the kernel still accepts TCP, the ZMTP greeting never comes
    w.signal(Signal::SIGSTOP);
    let started = std::time::Instant::now();
    let r = run(vec![engine("live", w.port)], t);
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Critical, "MpWorkerHung")
    );
    assert_eq!(r[0].observed["stage"], "greeting");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // and alive again once continued
    w.signal(Signal::SIGCONT);
    let r = run(vec![engine("live", w.port)], Duration::from_secs(3));
    assert_eq!(r[0].reason, "MpWorkerLive", "{:?}", r[0]);
}

#[test]
fn a_stuck_request_loop_and_a_wrong_reply() {
    let silent = Worker::start("silent");
    let wrong = Worker::start("wrong-id");
    let t = Duration::from_millis(700);
    let r = run(
        vec![engine("silent", silent.port), engine("wrong", wrong.port)],
        t,
    );
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Critical, "MpWorkerHung")
    );
    assert_eq!(r[0].observed["stage"], "reply");
    assert_eq!(
        (r[1].status, r[1].reason.as_str()),
        (CheckStatus::Warning, "MpWorkerBadReply")
    );
    assert!(r[1].observed["error"].contains("request id"), "{:?}", r[1]);
}

#[test]
fn the_probe_alone_and_no_workers_planned() {
    let w = Worker::start("answer");
    match probe(None, w.port, 9, Duration::from_secs(3)).unwrap() {
        MpVerdict::Live { result, .. } => assert_eq!(result, "OK"),
        other => panic!("{other:?}"),
    }
    let r = run(vec![], Duration::from_secs(1));
    assert_eq!(
        (r[0].subject.as_str(), r[0].status, r[0].reason.as_str()),
        ("host", CheckStatus::Ok, "NoMpWorkers")
    );
    // a pod UID that runs nothing here
    let mut e = engine("ghost", w.port);
    e.pod_uid = Some("00000000-0000-0000-0000-000000000000".into());
    let r = run(vec![e], Duration::from_secs(1));
    assert_eq!(
        (r[0].status, r[0].reason.as_str()),
        (CheckStatus::Unknown, "PodNotFound")
    );
}

/// A worker (tenant code in an engine pod) whose reply announces a 1 TiB frame: the probe's
/// frame bound drops it and the check reads BadReply naming the bound — the ZMQ library alone
/// would reserve the announced length and abort the agent.
#[test]
fn a_worker_announcing_a_huge_frame_is_dropped_not_allocated() {
    use std::io::Write;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                // ZMTP 3.0 greeting, NULL mechanism, then READY as a ROUTER.
                let mut g = [0u8; 64];
                g[0] = 0xFF;
                g[9] = 0x7F;
                g[10] = 3;
                g[12..16].copy_from_slice(b"NULL");
                let _ = s.write_all(&g);
                let mut peer = [0u8; 64];
                if s.read_exact(&mut peer).is_err() {
                    return;
                }
                let mut body = vec![5u8];
                body.extend_from_slice(b"READY");
                body.push(11);
                body.extend_from_slice(b"Socket-Type");
                body.extend_from_slice(&6u32.to_be_bytes());
                body.extend_from_slice(b"ROUTER");
                let mut frame = vec![0b100, body.len() as u8];
                frame.extend(body);
                let _ = s.write_all(&frame);
                // A long-frame header announcing 1 TiB, then hold the connection.
                let mut h = vec![0b10u8];
                h.extend_from_slice(&(1u64 << 40).to_be_bytes());
                let _ = s.write_all(&h);
                let mut sink = [0u8; 4096];
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    let verdict = probe(None, port, 7, Duration::from_secs(3)).unwrap();
    match verdict {
        MpVerdict::BadReply { why } => assert!(
            why.contains("frame bound") && why.contains("1099511627776"),
            "{why}"
        ),
        other => panic!("expected BadReply from the frame bound, got {other:?}"),
    }
}
