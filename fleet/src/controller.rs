//! The controller under test: the real `ic-controller standalone` binary as a child process,
//! its memory and CPU read from `/proc/<pid>/{status,stat}`, its convergence from `/metrics`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How to start the controller.
#[derive(Debug, Clone)]
pub struct ControllerCmd {
    /// `ic-controller` binary.
    pub bin: PathBuf,
    /// gRPC listen address (agents and the lookup client).
    pub grpc: SocketAddr,
    /// HTTP listen address (`/metrics`, `/readyz`).
    pub http: SocketAddr,
    /// `--max-connections` (per listener).
    pub max_connections: usize,
    /// Controller log file (stderr and stdout).
    pub log: PathBuf,
}

/// A running controller process (killed when dropped).
pub struct Controller {
    child: Child,
    /// Its pid.
    pub pid: u32,
    /// When it was spawned.
    pub started: Instant,
}

impl ControllerCmd {
    /// Spawns the controller (its log appended to [`ControllerCmd::log`]).
    pub fn spawn(&self) -> Result<Controller, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("cannot open {}: {e}", self.log.display()))?;
        let err = log
            .try_clone()
            .map_err(|e| format!("cannot open {}: {e}", self.log.display()))?;
        let child = Command::new(&self.bin)
            .arg("standalone")
            .arg("--grpc-addr")
            .arg(self.grpc.to_string())
            .arg("--http-addr")
            .arg(self.http.to_string())
            .arg("--max-connections")
            .arg(self.max_connections.to_string())
            .arg("--agent-expiry-seconds")
            .arg("3600")
            .env("RUST_LOG", "warn")
            // As Dockerfile.controller ships it (unless this environment says otherwise).
            .env(
                "MIMALLOC_PURGE_DELAY",
                std::env::var("MIMALLOC_PURGE_DELAY").unwrap_or_else(|_| "0".into()),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?;
        let pid = child.id();
        Ok(Controller {
            child,
            pid,
            started: Instant::now(),
        })
    }

    /// Waits until `/readyz` answers 200 (at most `limit`).
    pub async fn wait_ready(&self, limit: Duration) -> Result<Duration, String> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Ok(body) = http_get(self.http, "/readyz").await {
                if body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200") {
                    return Ok(t0.elapsed());
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("controller not ready within {limit:?}"))
    }

    /// The controller's metrics: each series by its full name with labels
    /// (`name{label="v"}`), and each name summed over its labels.
    pub async fn metrics(&self) -> Result<HashMap<String, f64>, String> {
        Ok(parse_metrics(&http_get(self.http, "/metrics").await?))
    }
}

/// Prometheus text exposition → each `inferencecache_` series by its full name with labels
/// (`name{label="v"}`), and each name summed over its labels.
pub fn parse_metrics(body: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in body.lines() {
        if line.starts_with('#') || !line.starts_with("inferencecache_") {
            continue;
        }
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let base = name.split('{').next().unwrap_or(name);
        if base != name {
            out.insert(name.to_string(), v);
        }
        *out.entry(base.to_string()).or_insert(0.0) += v;
    }
    out
}

impl Controller {
    /// SIGTERM (a rolling restart, as the kubelet does), then waits for the exit.
    pub async fn stop(mut self) -> Result<(), String> {
        // SAFETY: kill(2) on our own child's pid; no memory is touched.
        let rc = unsafe { libc::kill(self.pid as i32, libc::SIGTERM) };
        if rc != 0 {
            return Err(format!("kill({}) failed", self.pid));
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(30) {
            match self.child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => tokio::time::sleep(Duration::from_millis(10)).await,
                Err(e) => return Err(format!("waiting for the controller: {e}")),
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        Err("controller did not stop within 30 s of SIGTERM".into())
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Resident memory of a process, KiB: (VmRSS now, VmHWM = peak since start).
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time a process used so far, seconds: `utime` and `stime` of `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuTimes {
    /// In user mode.
    pub user: f64,
    /// In the kernel on the process's behalf: system calls, and page faults — on a VM whose
    /// host backs guest memory on first touch, zeroing fresh pages dominates it
    /// (docs/scaling.md "Why the cold start is slower than the storm").
    pub system: f64,
}

impl CpuTimes {
    /// User + system.
    pub fn total(&self) -> f64 {
        self.user + self.system
    }

    /// What was used since `earlier`.
    pub fn since(&self, earlier: CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user - earlier.user,
            system: self.system - earlier.system,
        }
    }
}

/// The CPU times of `pid` (zero when it cannot be read).
pub fn cpu_times(pid: u32) -> CpuTimes {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    parse_cpu_times(&stat, hz)
}

/// `utime` and `stime` (fields 14 and 15 of stat(5), clock ticks) of a `/proc/<pid>/stat` line,
/// in seconds at `hz` ticks per second.
fn parse_cpu_times(stat: &str, hz: f64) -> CpuTimes {
    // Fields after the command name (which may hold spaces and parentheses) start at the last
    // ") "; utime and stime are then the 12th and 13th.
    let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    CpuTimes {
        user: ticks(11) / hz,
        system: ticks(12) / hz,
    }
}

/// The kernel's count of connections dropped because a listener's accept queue was full
/// (`TcpExt: ListenOverflows` of `/proc/net/netstat`; the whole network namespace, so every
/// listener on the machine), when readable.
pub fn listen_overflows() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let names = lines.next()?;
    let values = lines.next()?;
    let i = names
        .split_whitespace()
        .position(|n| n == "ListenOverflows")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// The 1-minute load average (`/proc/loadavg`).
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_default()
}

/// One HTTP/1.0 GET (no chunked encoding to undo): the raw response.
async fn http_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&buf).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), io)
        .await
        .map_err(|_| format!("GET {path}: timed out"))?
        .map_err(|e| format!("GET {path}: {e}"))
}

/// The controller binary next to this one (the script builds both into one target dir).
pub fn default_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default()
        .join("ic-controller")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn cpu_times_read_utime_and_stime_after_any_command_name() {
        // A stat(5) line whose command name holds ") " and spaces: utime 250, stime 1000 ticks.
        let line =
            "4242 (ic ) (x) y) S 1 4242 4242 0 -1 4194560 5304 0 0 0 250 1000 0 0 20 0 9 0 100 0 0";
        let t = parse_cpu_times(line, 100.0);
        assert_eq!(
            t,
            CpuTimes {
                user: 2.5,
                system: 10.0
            }
        );
        assert_eq!(t.total(), 12.5);
        assert_eq!(
            t.since(CpuTimes {
                user: 0.5,
                system: 4.0
            }),
            CpuTimes {
                user: 2.0,
                system: 6.0
            }
        );
        assert_eq!(parse_cpu_times("garbage", 100.0), CpuTimes::default());
    }

    #[test]
    fn cpu_times_of_this_process_count_user_time_spent() {
        let before = cpu_times(std::process::id());
        let t0 = std::time::Instant::now();
        let mut x = 0u64;
        while t0.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let spent = cpu_times(std::process::id()).since(before);
        assert!(spent.user > 0.0, "{spent:?}");
        assert!(spent.total() >= spent.user);
    }
}
