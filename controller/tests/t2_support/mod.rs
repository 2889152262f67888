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

fn wait_listening(child: &mut Child, port: u16, what: &str) {
    for _ in 0..500 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited before listening on {port}: {st}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{what} did not listen on {port}");
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
        let port = free_port();
        let mut child = Command::new("redis-server")
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
            .expect("redis-server must be installed (apt-get install redis-server; scripts/setup.sh does)");
        wait_listening(&mut child, port, "redis-server");
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
        LmCacheServer::start_on(free_port())
    }

    /// Starts one on `port` (a restart where the last one listened).
    pub fn start_on(port: u16) -> LmCacheServer {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/t2_support/lmcache_server.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(lmcache_dir())
            .args(["127.0.0.1", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 (>= 3.10) runs the LMCache server");
        wait_listening(&mut child, port, "the LMCache server");
        LmCacheServer { child, port }
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
