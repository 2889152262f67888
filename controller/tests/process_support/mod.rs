//! Running the `ic-controller` binary in the integration tests that start it as a process
//! (`binary_metrics`, `ingest_flood_bounds`, `listener_bounds`): a free loopback port, a child
//! killed when the test ends however it ends, and its memory from `/proc/<pid>/status`.

#![allow(dead_code, clippy::unwrap_used)]

/// A free TCP port on 127.0.0.1 (bound and released: the caller binds it next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process, killed and reaped when dropped (a failed assertion leaves no process).
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `kB` field of `/proc/<pid>/status` (`"VmRSS:"`, `"VmHWM:"`), KiB.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}
