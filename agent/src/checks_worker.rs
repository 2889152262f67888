//! The node checks in processes of their own (docs/security.md "The agent mounts only what its
//! checks read", docs/architecture.md).
//!
//! The checks need `CAP_SYS_PTRACE`, `CAP_SYS_ADMIN` and `CAP_DAC_READ_SEARCH` and no Landlock
//! domain ([`crate::privilege`]): with them, code can open any pod's files through
//! `/proc/<pid>/root`. Capabilities are per thread but memory is per process, so a thread that
//! holds them is only as safe as every parser of the same process. `ic-agent run` therefore
//! runs its checks in two child processes and drops every capability of its own:
//!
//! ```text
//! ic-agent run (no capability, Landlock, every thread)
//!  └─ ic-agent checks-supervisor (the three capabilities; reads a 4-byte length and copies
//!     │                           bytes, never parses JSON)
//!     └─ ic-agent checks-worker  (the three capabilities; runs `Checks::run_all`)
//! ```
//!
//! `ic-agent run` starts the supervisor on its main thread before it drops its capabilities or
//! confines any thread (a Landlock domain and `no_new_privs` are inherited across `fork`/
//! `execve`; a process without capabilities cannot give a child any). The supervisor keeps
//! them for the agent's lifetime so that it can start a new worker when one dies or hangs —
//! the agent itself no longer can.
//!
//! Wire (stdin/stdout pipes, both hops): frames of a 4-byte big-endian length and that many
//! bytes, at most [`MAX_FRAME_BYTES`] (a longer one is an error and ends the exchange). One
//! request frame, the [`NodePlan`] as JSON; one reply frame, a [`WorkerReply`] as JSON. The
//! supervisor forwards the agent's request to the worker and the worker's reply to the agent
//! unread; when the worker exits, breaks the framing or takes longer than
//! `--pass-timeout-seconds`, it kills it, answers [`WorkerReply::Unavailable`] itself and starts
//! a new one at the next request after a jittered exponential delay ([`restart_delays`]).
//!
//! What crosses: a plan in, check results out. No file content, descriptor or other data leaves
//! the worker; a compromised agent can only ask it to run the checks against a plan of its
//! choosing — which the controller can do too. Everything the checks keep between passes (the
//! NVML monitor thread, the CUDA probe, latched XIDs, the GPU inventory in `--state-dir`) lives
//! in the worker; the agent derives its check metrics from the results, as before.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_shared::check::CheckResult;
use ic_shared::plan::NodePlan;
use parking_lot::Mutex;
use prometheus::IntCounter;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::checks::{Checks, ChecksConfig};

/// Largest frame either end accepts, in bytes (16 MiB); the length is checked before anything
/// is allocated.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// The program both children run: the agent's own executable, as the kernel knows it.
pub const SELF_EXE: &str = "/proc/self/exe";

/// Hidden subcommand of the supervisor process.
pub const SUPERVISOR_COMMAND: &str = "checks-supervisor";

/// Hidden subcommand of the worker process.
pub const WORKER_COMMAND: &str = "checks-worker";

/// How much longer than `--pass-timeout-seconds` the agent waits for the supervisor's answer
/// before it takes the supervisor for hung (it answers by itself when the worker hangs).
pub const SUPERVISOR_GRACE: Duration = Duration::from_secs(30);

/// The one reply frame of a pass, from the worker (or, when the worker failed, the supervisor).
/// Defined once and used by both ends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum WorkerReply {
    /// Every check ran: [`Checks::run_all`]'s results, in order.
    #[serde(rename_all = "camelCase")]
    Pass {
        /// The worker's process id; a new one after the first means the worker was restarted
        /// (`inferencecache_agent_checks_worker_restarts_total`).
        worker_pid: u32,
        /// The pass's results.
        results: Vec<CheckResult>,
    },
    /// No check ran this pass; why, in a sentence (the worker exited, hung, is restarting, or
    /// could not read the plan).
    Unavailable {
        /// Why.
        why: String,
    },
}

/// Writes one frame: `body.len()` as a 4-byte big-endian number, then `body`.
///
/// # Errors
/// `body` is longer than [`MAX_FRAME_BYTES`] (`InvalidInput`), or the write failed.
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    if body.len() > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a frame of {} bytes is longer than the {MAX_FRAME_BYTES} allowed",
                body.len()
            ),
        ));
    }
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too long"))?;
    w.write_all(&len.to_be_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// Reads one frame. `Ok(None)` when the stream ends before a frame starts.
///
/// # Errors
/// A length above [`MAX_FRAME_BYTES`] (`InvalidData`, nothing allocated), a stream that ends
/// inside a frame (`UnexpectedEof`), or a failed read.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame announces {len} bytes, more than the {MAX_FRAME_BYTES} allowed"),
        ));
    }
    let mut body = Vec::new();
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(body))
}

/// What the checks are built from, passed to both children on their command line (the `IC_*`
/// tuning variables of [`crate::checks::ENV_VARS`] reach them through the inherited
/// environment).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct WorkerArgs {
    /// procfs root the checks read.
    #[arg(long)]
    pub proc_root: PathBuf,
    /// The host's /dev/shm.
    #[arg(long)]
    pub shm_path: PathBuf,
    /// libnvidia-ml path.
    #[arg(long)]
    pub nvml_library: Option<PathBuf>,
    /// The agent's state directory (the gpu check's inventory and latched XIDs).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Seconds one pass may take before the supervisor kills the worker.
    #[arg(long, default_value_t = 180)]
    pub pass_timeout_seconds: u64,
}

impl WorkerArgs {
    /// These settings as command-line arguments (what clap parses back into them).
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut out: Vec<std::ffi::OsString> = vec![
            "--proc-root".into(),
            self.proc_root.clone().into(),
            "--shm-path".into(),
            self.shm_path.clone().into(),
        ];
        if let Some(p) = &self.nvml_library {
            out.extend(["--nvml-library".into(), p.clone().into()]);
        }
        if let Some(p) = &self.state_dir {
            out.extend(["--state-dir".into(), p.clone().into()]);
        }
        out.extend([
            "--pass-timeout-seconds".into(),
            self.pass_timeout_seconds.to_string().into(),
        ]);
        out
    }

    /// The check configuration: the `IC_*` variables overlaid with these settings (as
    /// `ic-agent run` builds it in one process).
    ///
    /// # Errors
    /// A malformed `IC_*` variable.
    pub fn checks_config(&self) -> Result<ChecksConfig, crate::checks::ChecksConfigError> {
        Ok(ChecksConfig {
            proc_root: self.proc_root.clone(),
            shm_path: self.shm_path.clone(),
            nvml_library: self.nvml_library.clone(),
            state_dir: self.state_dir.clone(),
            ..ChecksConfig::from_env()?
        })
    }

    fn pass_timeout(&self) -> Duration {
        Duration::from_secs(self.pass_timeout_seconds.max(1))
    }
}

/// Asks the kernel to SIGKILL the calling process when the thread that started it ends
/// (`PR_SET_PDEATHSIG`): the children never outlive the agent, even when it is killed.
/// Also names the process `name` (`/proc/<pid>/comm`; it would read `exe`).
fn die_with_parent(name: &std::ffi::CStr) -> io::Result<()> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(io::Error::from)?;
    nix::sys::prctl::set_name(name).map_err(io::Error::from)
}

/// `/proc/<pid>/comm` of the supervisor process.
pub const SUPERVISOR_COMM: &str = "ic-checks-sup";

/// `/proc/<pid>/comm` of the worker process.
pub const WORKER_COMM: &str = "ic-checks-work";

fn encode(reply: &WorkerReply) -> Vec<u8> {
    serde_json::to_vec(reply).unwrap_or_else(|_| {
        br#"{"kind":"unavailable","why":"the checks reply could not be encoded"}"#.to_vec()
    })
}

/// `ic-agent checks-worker`: builds the checks from `args` and answers every plan frame on
/// stdin with one [`WorkerReply`] frame on stdout, until stdin ends (exit 0).
///
/// # Errors
/// A malformed `IC_*` variable, or stdin/stdout failed (a frame over the bound included).
pub fn run_worker(args: &WorkerArgs) -> anyhow::Result<()> {
    die_with_parent(c"ic-checks-work")?;
    let checks = Checks::new(&args.checks_config()?);
    let pid = std::process::id();
    let mut stdin = io::stdin().lock();
    let mut stdout = io::stdout().lock();
    while let Some(frame) = read_frame(&mut stdin)? {
        let reply = match serde_json::from_slice::<NodePlan>(&frame) {
            Ok(plan) => WorkerReply::Pass {
                worker_pid: pid,
                results: checks.run_all(&plan),
            },
            Err(e) => WorkerReply::Unavailable {
                why: format!("the checks worker could not read the plan: {e}"),
            },
        };
        write_frame(&mut stdout, &encode(&reply))?;
    }
    Ok(())
}

/// The jittered exponential delays before each new worker after a failed one: 1 s doubling
/// to 60 s (`backon`, as the controller link's reconnects), never exhausted.
pub fn restart_delays() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(60))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// A running worker, seen from the supervisor.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    replies: mpsc::Receiver<io::Result<Vec<u8>>>,
}

impl Worker {
    fn start(args: &WorkerArgs) -> io::Result<Worker> {
        let mut child = Command::new(SELF_EXE)
            .arg(WORKER_COMMAND)
            .args(args.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let (Some(stdin), Some(mut stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other("the worker's pipes were not opened"));
        };
        let (tx, replies) = mpsc::channel();
        std::thread::Builder::new()
            .name("ic-checks-read".into())
            .spawn(move || loop {
                let r = read_frame(&mut stdout).and_then(|f| {
                    f.ok_or_else(|| {
                        io::Error::new(io::ErrorKind::UnexpectedEof, "the worker closed stdout")
                    })
                });
                let end = r.is_err();
                if tx.send(r).is_err() || end {
                    return;
                }
            })?;
        Ok(Worker {
            child,
            stdin,
            replies,
        })
    }

    /// One request to the worker and its reply, within `timeout`.
    fn exchange(&mut self, request: &[u8], timeout: Duration) -> Result<Vec<u8>, String> {
        if let Err(e) = write_frame(&mut self.stdin, request) {
            return Err(format!(
                "the checks worker did not take the plan ({e}){}",
                self.exit_clause()
            ));
        }
        match self.replies.recv_timeout(timeout) {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(format!(
                "the checks worker's reply broke off ({e}){}",
                self.exit_clause()
            )),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
                "the check pass took longer than {} s in the checks worker (pid {}), which was \
                 killed",
                timeout.as_secs(),
                self.child.id()
            )),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(format!(
                "the checks worker's reply stream is gone{}",
                self.exit_clause()
            )),
        }
    }

    /// `": it exited with …"` once the worker has ended (waiting for it up to 1 s), else `""`.
    fn exit_clause(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return format!(": it exited with {status}"),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => return String::new(),
            }
        }
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ic-agent checks-supervisor`: answers every request frame on stdin with one reply frame on
/// stdout — the worker's, forwarded unread, or [`WorkerReply::Unavailable`] when the worker
/// failed (then killed, and started again after [`restart_delays`]). Ends, with its worker,
/// when stdin ends.
///
/// # Errors
/// stdin/stdout failed (a frame over the bound included).
pub fn run_supervisor(args: &WorkerArgs) -> io::Result<()> {
    die_with_parent(c"ic-checks-sup")?;
    let timeout = args.pass_timeout();
    let mut stdin = io::stdin().lock();
    let mut stdout = io::stdout().lock();
    let mut worker: Option<Worker> = None;
    let mut delays = restart_delays();
    let mut next_start = Instant::now();
    while let Some(request) = read_frame(&mut stdin)? {
        let now = Instant::now();
        if worker.is_none() && now >= next_start {
            match Worker::start(args) {
                Ok(w) => {
                    info!(pid = w.child.id(), "checks worker started");
                    worker = Some(w);
                }
                Err(e) => {
                    next_start = now + delays.next().unwrap_or(Duration::from_secs(60));
                    let why = format!("the checks worker could not be started: {e}");
                    warn!("{why}");
                    write_frame(&mut stdout, &encode(&WorkerReply::Unavailable { why }))?;
                    continue;
                }
            }
        }
        let reply = match worker.as_mut() {
            None => encode(&WorkerReply::Unavailable {
                why: format!(
                    "the checks worker failed and is started again in {:.1} s",
                    next_start.saturating_duration_since(now).as_secs_f64()
                ),
            }),
            Some(w) => match w.exchange(&request, timeout) {
                Ok(reply) => {
                    delays = restart_delays();
                    reply
                }
                Err(why) => {
                    if let Some(w) = worker.take() {
                        w.stop();
                    }
                    let delay = delays.next().unwrap_or(Duration::from_secs(60));
                    next_start = Instant::now() + delay;
                    warn!(
                        restart_in_seconds = delay.as_secs_f64(),
                        "{why}; a new checks worker starts at the next pass after the delay"
                    );
                    encode(&WorkerReply::Unavailable { why })
                }
            },
        };
        write_frame(&mut stdout, &reply)?;
    }
    if let Some(w) = worker {
        w.stop();
    }
    Ok(())
}

/// The agent's end: the supervisor process and the pipes to it.
pub struct SupervisorClient {
    io: Arc<Mutex<Option<(ChildStdin, ChildStdout)>>>,
    child: Mutex<Child>,
    wait: Duration,
    last_worker: Mutex<Option<u32>>,
    restarts: IntCounter,
}

impl std::fmt::Debug for SupervisorClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorClient")
            .field("pid", &self.child.lock().id())
            .finish()
    }
}

/// Why the supervisor could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The process could not be created.
    #[error("cannot start the checks supervisor ({SELF_EXE} {SUPERVISOR_COMMAND}): {0}")]
    Spawn(#[from] io::Error),
    /// The restart counter could not be created.
    #[error("cannot create the checks worker restart counter: {0}")]
    Metric(#[from] prometheus::Error),
}

impl SupervisorClient {
    /// Starts `ic-agent checks-supervisor` with `args`, which inherits the calling thread's
    /// capabilities (and Landlock domain: call it before confining) and dies with that thread.
    /// `env` is set in the child (the log format).
    ///
    /// # Errors
    /// The process or the counter could not be created.
    pub fn spawn(args: &WorkerArgs, env: &[(&str, String)]) -> Result<Self, SpawnError> {
        let mut cmd = Command::new(SELF_EXE);
        cmd.arg(SUPERVISOR_COMMAND)
            .args(args.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let io = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => Some((i, o)),
            _ => None,
        };
        let restarts = IntCounter::new(
            "inferencecache_agent_checks_worker_restarts_total",
            "Checks worker processes that answered after the first one (each a restart after \
             the worker exited or hung; docs/operations.md).",
        )?;
        Ok(SupervisorClient {
            io: Arc::new(Mutex::new(io)),
            child: Mutex::new(child),
            wait: args.pass_timeout() + SUPERVISOR_GRACE,
            last_worker: Mutex::new(None),
            restarts,
        })
    }

    /// The supervisor's process id.
    pub fn pid(&self) -> u32 {
        self.child.lock().id()
    }

    /// Registers `inferencecache_agent_checks_worker_restarts_total` in `registry` (one already
    /// there is left as it is).
    pub fn register_metrics(&self, registry: &prometheus::Registry) {
        match registry.register(Box::new(self.restarts.clone())) {
            Ok(()) | Err(prometheus::Error::AlreadyReg) => {}
            Err(e) => warn!(error = %e, "cannot register the checks worker restart counter"),
        }
    }

    /// Runs one pass in the worker: its results, or `Err(why)` when no check ran (the caller
    /// turns it into the one `ChecksUnavailable` result).
    pub async fn run(&self, plan: &NodePlan) -> Result<Vec<CheckResult>, String> {
        let body = serde_json::to_vec(plan).map_err(|e| format!("cannot encode the plan: {e}"))?;
        let Some(mut io) = self.io.lock().take() else {
            return Err(format!(
                "the agent's checks supervisor (pid {}) is gone or did not answer an earlier \
                 pass{}",
                self.pid(),
                self.exit_clause()
            ));
        };
        let exchange = tokio::task::spawn_blocking(move || {
            write_frame(&mut io.0, &body)?;
            let reply = read_frame(&mut io.1)?;
            Ok::<_, io::Error>((io, reply))
        });
        let reply = match tokio::time::timeout(self.wait, exchange).await {
            Ok(Ok(Ok((io, Some(reply))))) => {
                *self.io.lock() = Some(io);
                reply
            }
            Ok(Ok(Ok((_, None)))) => {
                return Err(format!(
                    "the agent's checks supervisor closed its pipe{}",
                    self.exit_clause()
                ))
            }
            Ok(Ok(Err(e))) => {
                return Err(format!(
                    "the agent's checks supervisor pipe failed ({e}){}",
                    self.exit_clause()
                ))
            }
            Ok(Err(e)) => return Err(format!("the exchange with the checks supervisor: {e}")),
            Err(_) => {
                return Err(format!(
                    "the agent's checks supervisor did not answer in {} s",
                    self.wait.as_secs()
                ))
            }
        };
        match serde_json::from_slice::<WorkerReply>(&reply) {
            Ok(WorkerReply::Pass {
                worker_pid,
                results,
            }) => {
                let mut last = self.last_worker.lock();
                if last.is_some_and(|p| p != worker_pid) {
                    self.restarts.inc();
                    info!(pid = worker_pid, "a new checks worker answered");
                }
                *last = Some(worker_pid);
                Ok(results)
            }
            Ok(WorkerReply::Unavailable { why }) => Err(why),
            Err(e) => Err(format!("the checks worker's reply does not parse: {e}")),
        }
    }

    /// `": it exited with …"` when the supervisor has ended, else `""`.
    fn exit_clause(&self) -> String {
        match self.child.lock().try_wait() {
            Ok(Some(status)) => format!(" (it exited with {status}; restart the agent pod)"),
            _ => String::new(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::check::CheckStatus;

    #[test]
    fn frames_round_trip_and_end_cleanly() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"{}").unwrap();
        write_frame(&mut buf, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r).unwrap(), Some(b"{}".to_vec()));
        assert_eq!(read_frame(&mut r).unwrap(), Some(Vec::new()));
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }

    #[test]
    fn a_frame_over_the_bound_is_an_error_without_allocation() {
        let mut r = &u32::MAX.to_be_bytes()[..];
        let e = read_frame(&mut r).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let big = vec![0u8; MAX_FRAME_BYTES + 1];
        let e = write_frame(&mut Vec::new(), &big).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        // A stream that ends inside a frame.
        let mut r = &[0u8, 0, 0, 9, b'x'][..];
        assert_eq!(
            read_frame(&mut r).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        let mut r = &[0u8, 0][..];
        assert_eq!(
            read_frame(&mut r).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn the_reply_type_reads_back() {
        let pass = WorkerReply::Pass {
            worker_pid: 7,
            results: vec![CheckResult::new(
                "shm",
                "host",
                CheckStatus::Ok,
                "ShmOk",
                "fine".to_string(),
            )],
        };
        let back: WorkerReply = serde_json::from_slice(&encode(&pass)).unwrap();
        assert_eq!(back, pass);
        let back: WorkerReply =
            serde_json::from_slice(&encode(&WorkerReply::Unavailable { why: "hung".into() }))
                .unwrap();
        assert_eq!(back, WorkerReply::Unavailable { why: "hung".into() });
    }

    #[test]
    fn worker_args_parse_back_from_their_arguments() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: WorkerArgs,
        }
        let args = WorkerArgs {
            proc_root: "/host/proc".into(),
            shm_path: "/host/dev/shm".into(),
            nvml_library: Some("/driver/libnvidia-ml.so.1".into()),
            state_dir: Some("/var/lib/ic".into()),
            pass_timeout_seconds: 42,
        };
        let mut argv: Vec<std::ffi::OsString> = vec!["x".into()];
        argv.extend(args.to_args());
        assert_eq!(Cli::parse_from(argv).args, args);
    }
}
