//! The tier-2 probe against a real Mooncake master (issue 19 item 2; spec 000 Stage C): the
//! `mooncake_master` binary of the PyPI wheel `mooncake-transfer-engine` and, as the engines'
//! side, the wheel's own store client (`mooncake.store`, over TCP, with no-device stand-ins for
//! the CUDA libraries it links: `t2_support/cuda_stub.c`) mounting a host-memory segment.
//!
//! The master binds its metadata (8080) and metrics (9003) ports on 0.0.0.0 whatever host flags
//! say, so the test re-runs itself inside a private user + network namespace (`unshare -rn`):
//! loopback, and a veth pair for the address the store client's transfer engine insists on (it
//! refuses loopback-only hosts). Cases, in order: a master no client mounted storage on fails
//! with its own capacity numbers; with a client's 64 MiB segment it passes and says what it
//! proved (and leaves no metadata key behind); a stopped master fails at the health check within
//! the timeout; a killed one fails at the RPC port.
//!
//! `IC_MOONCAKE_MASTER` names `<unzipped wheel>/mooncake/mooncake_master` (`scripts/setup.sh`
//! fetches it; `scripts/test.sh` sets it); without it the test fails with that instruction.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod t2_support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ic_controller::t2probe::{http, ProviderT2Prober, T2Outcome, T2ProbeConfig, T2Prober};
use t2_support::managed;

const INNER: &str = "IC_T2_MOONCAKE_INNER";
const MASTER: &str = "IC_MOONCAKE_MASTER";
/// The veth address the store client registers its segment under.
const LOCAL_IP: &str = "10.99.0.1";

fn master_exe() -> PathBuf {
    let p = std::env::var(MASTER).unwrap_or_else(|_| {
        panic!(
            "set {MASTER} to an unzipped mooncake-transfer-engine==0.3.11.post1 wheel's \
             mooncake/mooncake_master (scripts/setup.sh downloads it)"
        )
    });
    std::fs::canonicalize(&p).unwrap_or_else(|e| panic!("{MASTER}={p}: {e}"))
}

fn sh(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd).args(args).status().unwrap();
    assert!(st.success(), "{cmd} {args:?}: {st}");
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_master(exe: &Path, log: &Path) -> Proc {
    let log = std::fs::File::create(log).unwrap();
    let master = Proc(
        Command::new(exe)
            .args(
                ic_controller::reconcile::render::mooncake::default_command()
                    .iter()
                    .skip(1),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let up = [50051, 8080, 9003]
            .iter()
            .all(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_ok());
        if up {
            return master;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("mooncake_master did not listen on 50051, 8080 and 9003");
}

/// The no-device CUDA stand-ins, built into `dir`.
fn cuda_stubs(dir: &Path) {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/t2_support/cuda_stub.c");
    let map = dir.join("cudart.map");
    std::fs::write(&map, "libcudart.so.12 { global: *; };\n").unwrap();
    let out = |n: &str| dir.join(n).to_string_lossy().into_owned();
    let src = src.to_string_lossy().into_owned();
    sh(
        "cc",
        &[
            "-shared",
            "-fPIC",
            "-DDRIVER",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            &out("libcuda.so.1"),
            &src,
        ],
    );
    sh(
        "cc",
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcudart.so.12",
            &format!("-Wl,--version-script={}", map.display()),
            "-o",
            &out("libcudart.so.12"),
            &src,
        ],
    );
}

/// The wheel's store client, mounted (it printed `mounted`); stays up until dropped.
fn start_client(wheel: &Path, stubs: &Path, log: &Path) -> Proc {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/t2_support/mooncake_client.py");
    let mut child = Command::new("python3")
        .arg(script)
        .arg(wheel)
        .args([LOCAL_IP, "127.0.0.1"])
        .env("LD_LIBRARY_PATH", stubs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "mounted",
        "the store client did not mount: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    Proc(child)
}

fn probe(rt: &tokio::runtime::Runtime, timeout: Duration, nonce: u64) -> T2Outcome {
    let cb = managed("Mooncake", "mooncakestore://127.0.0.1:50051");
    rt.block_on(ProviderT2Prober::new(T2ProbeConfig { timeout }).probe(&cb, nonce))
}

#[test]
fn mooncake_master_probe() {
    if std::env::var(INNER).is_err() {
        let exe = master_exe();
        let out = Command::new("unshare")
            .args(["-rn", "--"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "mooncake_master_probe",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(INNER, "1")
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
        return;
    }
    let exe = master_exe();
    let wheel = exe.parent().unwrap().parent().unwrap().to_path_buf();
    sh("ip", &["link", "set", "lo", "up"]);
    sh(
        "ip",
        &["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
    );
    sh(
        "ip",
        &["addr", "add", &format!("{LOCAL_IP}/24"), "dev", "v0"],
    );
    sh("ip", &["link", "set", "v0", "up"]);
    sh("ip", &["link", "set", "v1", "up"]);
    let dir = tempfile::tempdir().unwrap();
    cuda_stubs(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let timeout = Duration::from_secs(2);

    let mut master = start_master(&exe, &dir.path().join("master.log"));

    // 1. Up and ready, but no client mounted storage: every object put would fail.
    match probe(&rt, timeout, 1) {
        T2Outcome::Failed(m) => assert!(
            m.contains("master_total_capacity_bytes 0") && m.contains("0 active clients"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }

    // 2. A store client mounted a 64 MiB segment (and round-tripped an object through it).
    {
        let _client = start_client(&wheel, dir.path(), &dir.path().join("client.log"));
        match probe(&rt, timeout, 2) {
            T2Outcome::Ok(m) => {
                assert!(m.contains("67108864 bytes mounted by 1 clients"), "{m}");
                assert!(
                    m.contains("metadata put, get and delete round-tripped"),
                    "{m}"
                );
                assert!(m.contains("object put/get is not probed"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        let left = rt
            .block_on(http::exchange(
                hyper::Method::GET,
                "127.0.0.1:8080",
                "/metadata?key=inferencecache-probe.ml.kv.2",
                Vec::new(),
                timeout,
            ))
            .unwrap();
        assert_eq!(
            left.status, 404,
            "the probe's metadata key was deleted: {left:?}"
        );
    }

    // 3. A stopped master: the kernel still accepts on its ports, nothing answers.
    sh("kill", &["-STOP", &master.0.id().to_string()]);
    let started = Instant::now();
    let got = probe(&rt, Duration::from_millis(700), 3);
    sh("kill", &["-CONT", &master.0.id().to_string()]);
    match got {
        T2Outcome::Failed(m) => assert!(
            m.contains("health check failed") && m.contains("within 700 ms"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(650));

    // 4. Gone.
    let _ = master.0.kill();
    let _ = master.0.wait();
    match probe(&rt, timeout, 4) {
        T2Outcome::Failed(m) => assert!(m.contains("RPC port 127.0.0.1:50051 refused"), "{m}"),
        other => panic!("{other:?}"),
    }
}
