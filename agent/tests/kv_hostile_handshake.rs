//! Issue 38, D6: a publisher whose READY handshake is malformed — a 4 GiB property value
//! length, a property name running past the frame, an unknown command name — is refused by the
//! agent's ZMTP guard and counted (`inferencecache_agent_kv_peers_dropped_total{reason=
//! "bad_command"}`) with a log line, instead of being closed by the ZMQ library without a word.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use support::{http_get, kv_engine, sample, FakeController};

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ic_shared::plan::{EnginePlan, HashScheme, NodePlan};

const BIN: &str = env!("CARGO_BIN_EXE_ic-agent");

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A publisher on loopback that greets and then sends `command` as its handshake, on every
/// connection.
fn bad_handshake(command: Vec<u8>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let command = command.clone();
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let mut run = || -> std::io::Result<()> {
                    s.write_all(&greeting())?;
                    let mut peer = [0u8; 64];
                    s.read_exact(&mut peer)?;
                    let mut frame = vec![0b100, command.len() as u8];
                    frame.extend_from_slice(&command);
                    s.write_all(&frame)?;
                    let mut sink = [0u8; 4096];
                    while s.read(&mut sink)? > 0 {}
                    Ok(())
                };
                let _ = run();
            });
        }
    });
    port
}

fn engine(pod: &str, port: u16) -> EnginePlan {
    kv_engine(
        pod,
        HashScheme::Vllm,
        format!("tcp://127.0.0.1:{port}"),
        None,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_ready_handshakes_are_refused_and_counted() {
    let (_fake, grpc, _received) = FakeController::start().await;
    let mut four_gib = b"\x05READY\x0bSocket-Type".to_vec();
    four_gib.extend_from_slice(&u32::MAX.to_be_bytes());
    four_gib.extend_from_slice(b"PUB");
    let attacks = [
        ("four-gib", four_gib),
        ("name-overrun", b"\x05READY\xffSocket-Type".to_vec()),
        (
            "bad-name",
            b"\x05HELLO\x0bSocket-Type\x00\x00\x00\x03PUB".to_vec(),
        ),
    ];
    let plan = NodePlan {
        engines: attacks
            .iter()
            .map(|(pod, cmd)| engine(pod, bad_handshake(cmd.clone())))
            .collect(),
        ..NodePlan::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, serde_json::to_vec(&plan).unwrap()).unwrap();
    let http = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let stderr = dir.path().join("stderr");
    // IC_TEST_AGENT_BIN runs another build (an older release, to show what it did).
    let bin = std::env::var("IC_TEST_AGENT_BIN").unwrap_or_else(|_| BIN.to_string());
    let mut child = Command::new(bin)
        .args(["run", "--controller", &format!("http://{grpc}"), "--plan"])
        .arg(&plan_path)
        .args(["--http-addr", &http, "--t2-scrape-interval-seconds", "0"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let dropped = "inferencecache_agent_kv_peers_dropped_total";
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(child.try_wait().unwrap().is_none(), "the agent died");
        if TcpStream::connect(&http).is_ok() {
            let text = http_get(&http, "/metrics");
            let counted = attacks.iter().all(|(pod, _)| {
                sample(
                    &text,
                    dropped,
                    &[
                        &format!("stream=\"team-a/{pod}#0\""),
                        "socket=\"events\"",
                        "reason=\"bad_command\"",
                    ],
                ) >= 1.0
            });
            if counted {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not every malformed handshake was counted:\n{}",
                text.lines()
                    .filter(|l| l.starts_with(dropped) && !l.ends_with(" 0"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        } else {
            assert!(Instant::now() < deadline, "no /metrics on {http}");
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&stderr).unwrap();
    assert!(
        log.contains("engine connection dropped") && log.contains("not a well-formed READY"),
        "no log line names the refused handshake:\n{log}"
    );
}
