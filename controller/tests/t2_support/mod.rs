//! Real tier-2 servers for the tier-2 probe tests: `redis-server` (apt; `scripts/setup.sh` installs it)
//! and LMCache's own standalone server from its wheel (`scripts/fetch-lmcache.sh`; run by
//! `lmcache_server.py` without torch). Each listens on 127.0.0.1 on a free port and is killed
//! on drop.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ic_shared::crd::CacheBackend;

/// LMCache version of the chart's default server image, as `scripts/fetch-lmcache.sh` lays it out.
pub const LMCACHE_VERSION: &str = "0.4.7";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether process `pid` holds a listening TCP socket on 127.0.0.1/any `port` (its
/// `/proc/<pid>/fd` links to the LISTEN socket's inode in `/proc/net/tcp{,6}`).
fn listens(pid: u32, port: u16) -> bool {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let local_port = f[1]
                .rsplit(':')
                .next()
                .and_then(|h| u16::from_str_radix(h, 16).ok());
            if local_port == Some(port) {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .map(|l| inodes.iter().any(|i| l.to_string_lossy() == *i))
            .unwrap_or(false)
    })
}

/// Waits until `child` itself listens on `port`: a port taken by another test's server between
/// [`free_port`] and the child's bind makes the child exit (an error: the caller tries another
/// port), never a test talking to someone else's server.
fn wait_listening(child: &mut Child, port: u16, what: &str) -> Result<(), String> {
    for _ in 0..500 {
        if listens(child.id(), port) {
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!("{what} exited before listening on {port}: {st}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("{what} did not listen on {port}"))
}

/// Runs `spawn(port)` on fresh free ports until its child listens there itself (5 tries).
fn start_on_a_free_port(what: &str, spawn: impl Fn(u16) -> Child) -> (Child, u16) {
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port();
        let mut child = spawn(port);
        match wait_listening(&mut child, port, what) {
            Ok(()) => return (child, port),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                last = e;
            }
        }
    }
    panic!("{last} (5 ports tried)");
}

/// A `redis-server` on 127.0.0.1.
pub struct Redis {
    child: Child,
    /// Its port.
    pub port: u16,
}

impl Redis {
    /// Starts one with no persistence.
    pub fn start() -> Redis {
        Redis::start_with(&[])
    }

    /// Starts one with extra command-line arguments.
    pub fn start_with(extra: &[&str]) -> Redis {
        let (child, port) = start_on_a_free_port("redis-server", |port| {
            Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (apt-get install redis-server; scripts/setup.sh does)")
        });
        Redis { child, port }
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `CONFIG SET key value`.
    pub async fn config_set(&self, key: &str, value: &str) {
        let client = redis::Client::open(format!("redis://{}/", self.endpoint())).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(key)
            .arg(value)
            .query_async(&mut c)
            .await
            .unwrap();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where `scripts/fetch-lmcache.sh` put the LMCache files: `IC_LMCACHE_DIR`, else the
/// workspace's `target/ci-cache/lmcache`. Panics with the fix when they are not there: this
/// test does not skip.
pub fn lmcache_dir() -> PathBuf {
    let base = std::env::var_os("IC_LMCACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ci-cache/lmcache")
        });
    let dir = base.join(LMCACHE_VERSION);
    assert!(
        dir.join("lmcache/v1/server/__main__.py").is_file(),
        "LMCache {LMCACHE_VERSION} server files not found under {}: run scripts/fetch-lmcache.sh \
         (scripts/setup.sh does) or set IC_LMCACHE_DIR",
        base.display()
    );
    dir
}

/// LMCache's standalone server (its own code from the wheel) on 127.0.0.1.
pub struct LmCacheServer {
    child: Child,
    /// Its port.
    pub port: u16,
}

impl LmCacheServer {
    /// Starts one (`python3 lmcache_server.py <dir> 127.0.0.1 <port>`).
    pub fn start() -> LmCacheServer {
        let (child, port) = start_on_a_free_port("the LMCache server", LmCacheServer::spawn);
        LmCacheServer { child, port }
    }

    /// Starts one on `port` (a restart where the last one listened).
    pub fn start_on(port: u16) -> LmCacheServer {
        let mut child = LmCacheServer::spawn(port);
        if let Err(e) = wait_listening(&mut child, port, "the LMCache server") {
            panic!("{e}");
        }
        LmCacheServer { child, port }
    }

    fn spawn(port: u16) -> Child {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/t2_support/lmcache_server.py");
        Command::new("python3")
            .arg(script)
            .arg(lmcache_dir())
            .args(["127.0.0.1", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 (>= 3.10) runs the LMCache server")
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Sends `sig` (`STOP`, `CONT`) to the server process.
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(st.success());
    }
}

impl Drop for LmCacheServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A managed CacheBackend `ml/kv` of `provider` whose `status.endpoint` is `endpoint`.
pub fn managed(provider: &str, endpoint: &str) -> CacheBackend {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "kv", "namespace": "ml"},
        "spec": {"runtime": "VLLM", "remoteStorage": {"provider": provider, "ownership": "Managed"}},
        "status": {"endpoint": endpoint}
    }))
    .unwrap()
}
