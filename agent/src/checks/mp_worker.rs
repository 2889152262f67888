//! `mp_worker`: is each planned LMCache multi-process (MP) worker alive and answering?
//!
//! SGLang with LMCache in Offload mode talks to an LMCache MP worker over ZMQ inside the pod
//! (server ROUTER on `127.0.0.1:<workerPort>`, client DEALER, no auth). For every engine in the
//! plan with `mpWorkerPort`, the agent enters the pod's network namespace (`setns(2)` on
//! `<proc_root>/<pid>/ns/net`, on a dedicated short-lived thread, because a network namespace is
//! a per-thread attribute), and there:
//!
//! 1. opens a plain TCP connection to `127.0.0.1:<port>`: refused → `MpWorkerNotListening`;
//! 2. opens a ZMQ DEALER (the `zeromq` crate on a current-thread tokio runtime owned by that
//!    thread) and waits for the ZMTP handshake: no greeting within the timeout → `MpWorkerHung`
//!    (a stopped or wedged server: the kernel accepts the TCP connection, nobody answers);
//! 3. sends the MP protocol's no-op, two frames `[msgpack(request id), msgpack(24)]`, and waits
//!    for the reply `[request id, 24, "OK"]`: none within the timeout → `MpWorkerHung`; a reply
//!    that does not echo the id and op → `MpWorkerBadReply`; otherwise `MpWorkerLive`.
//!
//! Exact bytes (request id 7): request `07` `18`, reply `07` `18` `a2 4f 4b`.
//!
//! Without a pod UID (standalone mode) the worker is probed in the agent's own network
//! namespace. Results: subject `<namespace>/<pod>` per engine with an MP-worker port; one
//! `host` result `NoMpWorkers` (Ok) when the plan has none.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::{EnginePlan, NodePlan};
use rmpv::Value;
use thiserror::Error;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::pods::{own_ns, PodFinder};
use super::{Check, ChecksConfig};
use crate::kv::zmtp_guard::{self, OnDrop, ZmtpLimits};
use crate::privilege::Capability;

/// Longest reply the probe accepts from an MP worker, bytes: its answer to a no-op request is a
/// few dozen bytes; a worker announcing more is dropped before anything is allocated
/// (docs/security.md "Engine connections are bounded").
pub const MAX_REPLY_BYTES: usize = 64 << 10;

/// Check name.
pub const NAME: &str = "mp_worker";

/// The MP protocol's no-op op code (`RequestType.NOOP`).
pub const OP_NOOP: u8 = 24;

/// What the probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MpVerdict {
    /// The worker answered the no-op.
    Live {
        /// Round trip of the no-op (after the handshake).
        rtt: Duration,
        /// The reply's result frame, decoded (`"OK"`).
        result: String,
    },
    /// Nothing accepts TCP connections on the port (`error`: the connect error).
    NotListening {
        /// The OS error of the TCP connect.
        error: String,
    },
    /// The port accepts connections but the worker does not answer in time.
    Hung {
        /// `connect` (TCP SYN unanswered), `greeting` (no ZMTP handshake) or `reply` (no
        /// answer to the no-op).
        stage: &'static str,
    },
    /// Something answered, but not as an MP worker does.
    BadReply {
        /// What was wrong.
        why: String,
    },
}

/// Why the probe could not run at all.
#[derive(Debug, Error)]
pub enum ProbeError {
    /// The pod's network namespace could not be opened.
    #[error("cannot open network namespace {path}: {source}")]
    OpenNetns {
        /// `<proc_root>/<pid>/ns/net`.
        path: String,
        /// OS error.
        source: io::Error,
    },
    /// `setns(2)` failed (the agent needs CAP_SYS_ADMIN).
    #[error("cannot enter network namespace {path}: {source}")]
    Setns {
        /// Namespace path.
        path: String,
        /// errno.
        source: nix::Error,
    },
    /// The probe thread or its runtime could not be started.
    #[error("cannot start the probe: {0}")]
    Runtime(String),
    /// The ZMQ socket failed in a way that says nothing about the worker.
    #[error("ZMQ error: {0}")]
    Zmq(String),
    /// The probe thread could not drop its capabilities after entering the namespace; it does
    /// not talk to the worker with them.
    #[error("cannot drop the probe thread's capabilities: {0}")]
    DropCapabilities(String),
}

impl ProbeError {
    /// Stable label for observed values and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ProbeError::OpenNetns { .. } => "OpenNetns",
            ProbeError::Setns { .. } => "Setns",
            ProbeError::Runtime(_) => "Runtime",
            ProbeError::DropCapabilities(_) => "DropCapabilities",
            ProbeError::Zmq(_) => "Zmq",
        }
    }
}

/// Encodes the no-op request frames for `request_id`.
pub fn noop_request(request_id: u8) -> Vec<Vec<u8>> {
    let mut id = Vec::new();
    let mut op = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut id, &Value::from(request_id));
    let _ = rmpv::encode::write_value(&mut op, &Value::from(OP_NOOP));
    vec![id, op]
}

fn decode(frame: &[u8]) -> Option<Value> {
    let mut r = frame;
    let v = rmpv::decode::read_value(&mut r).ok()?;
    r.is_empty().then_some(v)
}

/// Judges a reply to [`noop_request`]: `Ok(result)` when it echoes the request id and the
/// no-op (as 24 or the name `noop`, any case), with the decoded result frame (`"OK"`; an
/// absent result reads as empty); `Err(why)` otherwise. A leading empty delimiter frame is
/// tolerated.
pub fn judge_reply(request_id: u8, frames: &[Vec<u8>]) -> Result<String, String> {
    let frames: Vec<&Vec<u8>> = frames
        .iter()
        .skip_while(|f| f.is_empty())
        .collect::<Vec<_>>();
    if frames.len() < 2 {
        return Err(format!("reply has {} frame(s), expected 3", frames.len()));
    }
    let id = decode(frames[0]).ok_or("request id frame is not msgpack")?;
    if id.as_u64() != Some(u64::from(request_id)) {
        return Err(format!(
            "reply echoes request id {id}, expected {request_id}"
        ));
    }
    let op = decode(frames[1]).ok_or("op frame is not msgpack")?;
    let op_ok = op.as_u64() == Some(u64::from(OP_NOOP))
        || op.as_str().is_some_and(|s| s.eq_ignore_ascii_case("noop"));
    if !op_ok {
        return Err(format!("reply echoes op {op}, expected {OP_NOOP} (noop)"));
    }
    let result = match frames.get(2) {
        None => String::new(),
        Some(f) => match decode(f) {
            Some(Value::String(s)) => s.into_str().unwrap_or_default(),
            Some(Value::Nil) => String::new(),
            Some(other) => other.to_string(),
            None => return Err("result frame is not msgpack".into()),
        },
    };
    Ok(result)
}

/// Probes `127.0.0.1:port` from the network namespace at `netns` (`None`: the caller's) on a
/// dedicated thread, waiting at most about `2 × timeout` in all.
pub fn probe(
    netns: Option<PathBuf>,
    port: u16,
    request_id: u8,
    timeout: Duration,
) -> Result<MpVerdict, ProbeError> {
    let handle = std::thread::Builder::new()
        .name("ic-mp-probe".into())
        .spawn(move || probe_on_this_thread(netns.as_deref(), port, request_id, timeout))
        .map_err(|e| ProbeError::Runtime(e.to_string()))?;
    handle
        .join()
        .map_err(|_| ProbeError::Runtime("the probe thread panicked".into()))?
}

/// The body of [`probe`]. Enters `netns` on the calling thread, which therefore must be a
/// thread of its own that ends afterwards.
fn probe_on_this_thread(
    netns: Option<&Path>,
    port: u16,
    request_id: u8,
    timeout: Duration,
) -> Result<MpVerdict, ProbeError> {
    if let Some(path) = netns {
        let f = std::fs::File::open(path).map_err(|source| ProbeError::OpenNetns {
            path: path.display().to_string(),
            source,
        })?;
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|source| {
            ProbeError::Setns {
                path: path.display().to_string(),
                source,
            }
        })?;
    }
    // Nothing below needs a capability, and the worker's bytes are tenant-controlled: this
    // thread gives up every capability before it connects (crate::privilege).
    crate::privilege::drop_all().map_err(|e| ProbeError::DropCapabilities(e.to_string()))?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpStream::connect_timeout(&addr, timeout) {
        Ok(s) => drop(s),
        Err(e) if e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock => {
            return Ok(MpVerdict::Hung { stage: "connect" })
        }
        Err(e) => {
            return Ok(MpVerdict::NotListening {
                error: e.to_string(),
            })
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ProbeError::Runtime(e.to_string()))?;
    rt.block_on(async move {
        // The worker's bytes go through the frame-bounding relay (crate::kv::zmtp_guard): the
        // ZMQ library would reserve whatever frame length a worker announces.
        let dropped: Arc<Mutex<Option<String>>> = Arc::default();
        let record = dropped.clone();
        let on_drop: OnDrop = Arc::new(move |d| {
            if let Ok(mut g) = record.lock() {
                *g = Some(d.to_string());
            }
        });
        let limits = ZmtpLimits {
            max_message_bytes: MAX_REPLY_BYTES,
            ..ZmtpLimits::default()
        };
        let endpoint = format!("tcp://127.0.0.1:{port}");
        let guarded = match zmtp_guard::connect(&endpoint, limits, timeout, on_drop).await {
            Ok(g) => g,
            Err(why) => {
                return Ok(MpVerdict::BadReply {
                    why: format!("connecting through the frame bound failed: {why}"),
                })
            }
        };
        // A verdict that the bound dropped the worker (its reason), whatever the socket saw.
        let refused = || {
            dropped
                .lock()
                .ok()
                .and_then(|g| g.clone())
                .map(|d| MpVerdict::BadReply {
                    why: format!("the worker was dropped by the frame bound: {d}"),
                })
        };
        let mut sock = DealerSocket::new();
        match tokio::time::timeout(timeout, sock.connect(guarded.endpoint())).await {
            Err(_) => return Ok(refused().unwrap_or(MpVerdict::Hung { stage: "greeting" })),
            Ok(Err(e)) => {
                // The bound may drop the worker before the library's handshake completes (a
                // greeting, READY and an oversize header can arrive in one read).
                return Ok(refused().unwrap_or(MpVerdict::BadReply {
                    why: format!("ZMTP handshake failed: {e}"),
                }));
            }
            Ok(Ok(())) => {}
        }
        let mut frames = noop_request(request_id).into_iter();
        let mut msg = ZmqMessage::from(frames.next().unwrap_or_default());
        for f in frames {
            msg.push_back(f.into());
        }
        let started = Instant::now();
        match tokio::time::timeout(timeout, sock.send(msg)).await {
            Err(_) => return Ok(MpVerdict::Hung { stage: "reply" }),
            Ok(Err(e)) => return Err(ProbeError::Zmq(e.to_string())),
            Ok(Ok(())) => {}
        }
        let reply = match tokio::time::timeout(timeout, sock.recv()).await {
            Err(_) => return Ok(refused().unwrap_or(MpVerdict::Hung { stage: "reply" })),
            Ok(Err(e)) => {
                return Ok(refused().unwrap_or(MpVerdict::BadReply {
                    why: format!("receive failed: {e}"),
                }))
            }
            Ok(Ok(m)) => m,
        };
        let rtt = started.elapsed();
        let frames: Vec<Vec<u8>> = reply.into_vec().into_iter().map(|b| b.to_vec()).collect();
        Ok(match judge_reply(request_id, &frames) {
            Ok(result) => MpVerdict::Live { rtt, result },
            Err(why) => MpVerdict::BadReply { why },
        })
    })
}

/// The `mp_worker` check.
#[derive(Debug, Clone)]
pub struct MpWorkerCheck {
    pods: Arc<PodFinder>,
    timeout: Duration,
    next_id: Arc<AtomicU8>,
}

impl MpWorkerCheck {
    /// Reads `cfg.proc_root` and `cfg.mp_worker_timeout`.
    pub fn new(cfg: &ChecksConfig) -> Self {
        Self::with_finder(cfg, Arc::new(PodFinder::new(&cfg.proc_root)))
    }

    /// Like [`MpWorkerCheck::new`], sharing a pod finder with other checks.
    pub fn with_finder(cfg: &ChecksConfig, pods: Arc<PodFinder>) -> Self {
        MpWorkerCheck {
            pods,
            timeout: cfg.mp_worker_timeout,
            next_id: Arc::new(AtomicU8::new(1)),
        }
    }

    fn request_id(&self) -> u8 {
        // 1..=127: a positive fixint, one byte on the wire.
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        n % 127 + 1
    }

    /// Where to probe one engine: `Ok(None)` the agent's namespace, `Ok(Some(path))` the pod's,
    /// `Err(result)` when the pod cannot be found.
    fn netns_for(
        &self,
        engine: &EnginePlan,
        subject: &str,
    ) -> Result<Option<PathBuf>, Box<CheckResult>> {
        let Some(uid) = engine.pod_uid.as_deref() else {
            return Ok(None);
        };
        let proc_root = self.pods.proc_root();
        let containers = self.pods.containers(uid);
        let Some(c) = containers.first() else {
            return Err(Box::new(self.pods.unavailable(
                NAME,
                subject,
                uid,
                "its LMCache MP worker",
            )));
        };
        let path = c.netns(proc_root);
        let theirs = std::fs::read_link(&path)
            .ok()
            .and_then(|t| t.to_str().and_then(super::pods::ns_inode));
        // A hostNetwork pod shares the agent's namespace: no setns needed.
        if theirs.is_some() && theirs == own_ns(proc_root, "net") {
            return Ok(None);
        }
        Ok(Some(path))
    }
}

/// Turns a probe outcome into the result for one engine.
pub fn evaluate(
    subject: &str,
    port: u16,
    netns: &str,
    timeout: Duration,
    outcome: Result<MpVerdict, ProbeError>,
) -> CheckResult {
    let worker = format!("the LMCache MP worker of {subject} on 127.0.0.1:{port}");
    let t = format!("{} ms", timeout.as_millis());
    let (status, reason, message, extra): (CheckStatus, &str, String, Vec<(&str, String)>) =
        match outcome {
            Ok(MpVerdict::Live { rtt, result }) => (
                CheckStatus::Ok,
                "MpWorkerLive",
                format!(
                    "{worker} answered the no-op ({result:?}) in {:.1} ms.",
                    rtt.as_secs_f64() * 1000.0
                ),
                vec![
                    ("rttMicros", rtt.as_micros().to_string()),
                    ("result", result),
                    ("verdict", "Live".into()),
                ],
            ),
            Ok(MpVerdict::NotListening { error }) => (
                CheckStatus::Critical,
                "MpWorkerNotListening",
                format!(
                    "nothing listens for {worker} ({error}); the engine cannot offload to \
                     LMCache: check the worker container's logs and its --port."
                ),
                vec![("error", error), ("verdict", "NotListening".into())],
            ),
            Ok(MpVerdict::Hung { stage }) => (
                CheckStatus::Critical,
                "MpWorkerHung",
                match stage {
                    "connect" => format!(
                        "{worker} did not accept a TCP connection within {t}; the engine's \
                         cache requests will hang."
                    ),
                    "greeting" => format!(
                        "{worker} accepts TCP connections but sent no ZMTP greeting within {t}: \
                         the process is stopped or wedged; the engine's cache requests will \
                         hang. Restart the worker."
                    ),
                    _ => format!(
                        "{worker} completed the handshake but did not answer the no-op within \
                         {t}: its request loop is stuck; the engine's cache requests will hang. \
                         Restart the worker."
                    ),
                },
                vec![("stage", stage.to_string()), ("verdict", "Hung".into())],
            ),
            Ok(MpVerdict::BadReply { why }) => (
                CheckStatus::Warning,
                "MpWorkerBadReply",
                format!(
                    "{worker} answered, but not as an LMCache MP worker does ({why}); another \
                     service may hold the port, or the LMCache version speaks another protocol."
                ),
                vec![("error", why), ("verdict", "BadReply".into())],
            ),
            Err(e) => {
                // What the failed step needs, and which of it this (the checks) thread lacks.
                let needed: &[Capability] = match &e {
                    ProbeError::OpenNetns { .. } => &[Capability::CAP_SYS_PTRACE],
                    ProbeError::Setns { .. } => &[Capability::CAP_SYS_ADMIN],
                    _ => &[],
                };
                let lacking = crate::privilege::missing(needed);
                let mut extra = vec![("error", e.to_string()), ("cause", e.label().into())];
                let advice = match crate::privilege::lacking_clause(needed) {
                    Some(clause) => {
                        extra.push(("missingCapabilities", crate::privilege::names(&lacking)));
                        format!("{clause}.")
                    }
                    None => "the agent needs CAP_SYS_PTRACE, CAP_SYS_ADMIN and hostPID to enter \
                             the pod's network namespace."
                        .to_string(),
                };
                (
                    CheckStatus::Unknown,
                    "MpWorkerProbeFailed",
                    format!("cannot probe {worker}: {e}; {advice}"),
                    extra,
                )
            }
        };
    extra.into_iter().fold(
        CheckResult::new(NAME, subject, status, reason, message)
            .with("port", port)
            .with("netns", netns)
            .with("timeoutMillis", timeout.as_millis()),
        |r, (k, v)| r.with(k, v),
    )
}

impl Check for MpWorkerCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&self, plan: &NodePlan) -> Vec<CheckResult> {
        // Probes run in parallel (each on its own thread), so a pass waits for the slowest.
        let mut pending = Vec::new();
        let mut out: Vec<Option<CheckResult>> = Vec::new();
        for engine in &plan.engines {
            let Some(port) = engine.mp_worker_port else {
                continue;
            };
            let subject = format!("{}/{}", engine.namespace, engine.pod);
            let slot = out.len();
            out.push(None);
            match self.netns_for(engine, &subject) {
                Err(r) => out[slot] = Some((*r).with("port", port)),
                Ok(netns) => {
                    let label = match (&netns, &engine.pod_uid) {
                        (Some(p), _) => p.display().to_string(),
                        (None, Some(_)) => "agent (hostNetwork pod)".to_string(),
                        (None, None) => "agent".to_string(),
                    };
                    let id = self.request_id();
                    let timeout = self.timeout;
                    let handle = std::thread::Builder::new()
                        .name("ic-mp-probe".into())
                        .spawn(move || {
                            let outcome = probe_on_this_thread(netns.as_deref(), port, id, timeout);
                            // Read on the thread that parsed the worker's reply, afterwards:
                            // a cleared permitted set cannot have been raised in between.
                            (outcome, crate::privilege::thread_cap_eff())
                        });
                    pending.push((slot, subject, port, label, handle));
                }
            }
        }
        for (slot, subject, port, label, handle) in pending {
            let outcome = match handle {
                Err(e) => Err(ProbeError::Runtime(e.to_string())),
                Ok(h) => h
                    .join()
                    .map_err(|_| ProbeError::Runtime("the probe thread panicked".into())),
            };
            let (outcome, cap_eff) = match outcome {
                Ok((o, c)) => (o, c),
                Err(e) => (Err(e), None),
            };
            let mut r = evaluate(&subject, port, &label, self.timeout, outcome);
            if let Some(c) = cap_eff {
                r = r.with("probeThreadCapEff", c);
            }
            if let Some(p) = plan
                .engines
                .iter()
                .find(|e| format!("{}/{}", e.namespace, e.pod) == subject)
                .and_then(|e| e.pod_uid.as_deref())
            {
                r = r.with("podUid", p);
            }
            out[slot] = Some(r);
        }
        let out: Vec<CheckResult> = out.into_iter().flatten().collect();
        if out.is_empty() {
            return vec![CheckResult::new(
                NAME,
                "host",
                CheckStatus::Ok,
                "NoMpWorkers",
                "the plan has no LMCache MP worker on this node.".to_string(),
            )];
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn request_and_reply_bytes_match_the_protocol() {
        assert_eq!(noop_request(7), vec![vec![0x07], vec![0x18]]);
        let ok = vec![vec![0x07], vec![0x18], vec![0xa2, b'O', b'K']];
        assert_eq!(judge_reply(7, &ok), Ok("OK".to_string()));
        // with an empty delimiter frame in front
        let mut delimited = vec![vec![]];
        delimited.extend(ok.clone());
        assert_eq!(judge_reply(7, &delimited), Ok("OK".to_string()));
        // op echoed by name
        let named = vec![vec![0x07], vec![0xa4, b'n', b'o', b'o', b'p'], vec![0xc0]];
        assert_eq!(judge_reply(7, &named), Ok(String::new()));
        assert!(judge_reply(8, &ok).unwrap_err().contains("request id"));
        let wrong_op = vec![vec![0x07], vec![0x16], vec![0xc3]];
        assert!(judge_reply(7, &wrong_op).unwrap_err().contains("op"));
        assert!(judge_reply(7, &[vec![0x07]]).is_err());
        assert!(judge_reply(7, &[vec![0xc1], vec![0x18]]).is_err());
    }

    #[test]
    fn verdict_table() {
        let t = Duration::from_millis(500);
        let cases: Vec<(Result<MpVerdict, ProbeError>, CheckStatus, &str)> = vec![
            (
                Ok(MpVerdict::Live {
                    rtt: Duration::from_micros(300),
                    result: "OK".into(),
                }),
                CheckStatus::Ok,
                "MpWorkerLive",
            ),
            (
                Ok(MpVerdict::NotListening {
                    error: "Connection refused".into(),
                }),
                CheckStatus::Critical,
                "MpWorkerNotListening",
            ),
            (
                Ok(MpVerdict::Hung { stage: "greeting" }),
                CheckStatus::Critical,
                "MpWorkerHung",
            ),
            (
                Ok(MpVerdict::Hung { stage: "reply" }),
                CheckStatus::Critical,
                "MpWorkerHung",
            ),
            (
                Ok(MpVerdict::BadReply { why: "x".into() }),
                CheckStatus::Warning,
                "MpWorkerBadReply",
            ),
            (
                Err(ProbeError::Runtime("no threads".into())),
                CheckStatus::Unknown,
                "MpWorkerProbeFailed",
            ),
        ];
        for (outcome, status, reason) in cases {
            let r = evaluate("ns/p", 6000, "agent", t, outcome);
            assert_eq!((r.status, r.reason.as_str()), (status, reason), "{r:?}");
            assert_eq!(r.observed["port"], "6000");
            assert!(r.message.contains("127.0.0.1:6000"), "{}", r.message);
        }
    }
}
