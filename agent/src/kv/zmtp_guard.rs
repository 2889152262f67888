//! A bounded ZMTP 3 transport in front of every `zeromq` socket the agent opens (issue 38 item 1).
//!
//! The `zeromq` crate (0.7) has no `ZMQ_MAXMSGSIZE`: its codec reserves whatever length a frame
//! header announces, so a 9-byte header announcing 1 TiB aborts the process (allocation
//! failure) and a real 256 MiB frame is buffered whole. So the library never talks to an
//! engine directly: the agent opens the TCP (or IPC) connection to the engine itself, and
//! relays it to the library over a one-shot loopback TCP connection, reading the engine's side
//! as ZMTP — the 64-byte greeting, then frame headers (flags byte, 1- or 8-byte big-endian
//! length) — and checking every header **before** the library sees it:
//!
//! - a command frame (READY, PING, …) longer than [`MAX_COMMAND_BYTES`],
//! - a message frame longer than [`ZmtpLimits::max_message_bytes`],
//! - a multi-part message whose frames add up to more than that, or that has more than
//!   [`ZmtpLimits::max_frames`] frames,
//! - a greeting that does not start with `0xFF` or a frame header with reserved flag bits set
//!
//! drops the peer: both connections are closed (the library sees a disconnect and the
//! subscriber connects afresh with its backoff) and the violation is reported
//! ([`Violation::reason`], counted by the caller as
//! `inferencecache_agent_kv_peers_dropped_total{stream,socket,reason}` and logged). Nothing of
//! the announced size is ever allocated: the relay reads in [`RELAY_CHUNK`]-byte chunks, and
//! the library buffers at most one accepted message.
//!
//! A command frame must also be a well-formed READY ([`check_command`]; the library knows no
//! other command and would close the connection without a word). With a [`RelayBudget`] (the
//! subscriber's SUB sockets), each message frame of [`RELAY_CHUNK`] bytes or more is charged
//! [`LIBRARY_FACTOR`] × its length against the node-wide in-flight budget before any of it is
//! relayed, waiting for the budget up to [`RelayBudget::wait`] (the engine is slowed meanwhile);
//! the charge of each completed message goes to [`RelayBudget::charges`] for the reader.
//!
//! The bytes the library sends to the engine (subscriptions, replay requests) are relayed
//! unchanged. The loopback listener accepts exactly one connection and is closed at once: the
//! library *connects* to it, so a local process that raced to it could only read the engine's
//! own events (which it can read from the engine anyway), never write to the agent's socket.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::plan::HashScheme;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::subscriber::budget::{InflightBudget, InflightPermit};

/// The hard cap on one accepted ZMQ message (all frames together), bytes: 16 MiB. No plan or
/// option can raise a stream's limit above it (the chart gives the agent 128 Mi for every
/// engine on its node).
pub const HARD_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// vLLM's limit, bytes: 4 MiB. vLLM publishes one `KVEventBatch` per engine step: the blocks
/// stored and removed in that step, each BlockStored with its hash (9 bytes as u64, 34 as
/// bytes) and token ids (≤ 5 bytes each). A 256 Ki-token step (chunked prefill off, long
/// context) encodes to about 2 MB; the recorded fixtures' batches are under 1 KiB.
pub const VLLM_MAX_MESSAGE_BYTES: usize = 4 << 20;

/// SGLang's limit, bytes: the hard cap (16 MiB). SGLang's radix cache defaults to a page size
/// of 1, so every token of a step is its own BlockStored (hash + token id + array overhead,
/// about 25 bytes per token): a 512 Ki-token unchunked prefill is about 13 MB.
pub const SGLANG_MAX_MESSAGE_BYTES: usize = HARD_MAX_MESSAGE_BYTES;

/// Longest command frame accepted (READY with its metadata, PING, SUBSCRIBE…), bytes: 64 KiB.
pub const MAX_COMMAND_BYTES: u64 = 64 << 10;

/// Most frames in one message: 16. Engines send 3 (`[topic, seq, payload]`) live and 3 or 4
/// (`["", topic?, seq, payload]`) in replay replies.
pub const MAX_FRAMES_PER_MESSAGE: usize = 16;

/// Bytes read from the engine per relay step (and the relay's whole buffer): 64 KiB.
pub const RELAY_CHUNK: usize = 64 << 10;

/// What one connection may carry from the engine to the library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZmtpLimits {
    /// Longest message (sum of its frames' bodies), bytes; also the longest single frame.
    /// Clamped to [`HARD_MAX_MESSAGE_BYTES`].
    pub max_message_bytes: usize,
    /// Most frames in one message.
    pub max_frames: usize,
}

impl Default for ZmtpLimits {
    /// The hard cap ([`HARD_MAX_MESSAGE_BYTES`], [`MAX_FRAMES_PER_MESSAGE`]).
    fn default() -> Self {
        Self {
            max_message_bytes: HARD_MAX_MESSAGE_BYTES,
            max_frames: MAX_FRAMES_PER_MESSAGE,
        }
    }
}

impl ZmtpLimits {
    /// The limits of an engine family's publisher and replay sockets
    /// ([`VLLM_MAX_MESSAGE_BYTES`], [`SGLANG_MAX_MESSAGE_BYTES`]).
    pub fn for_scheme(scheme: HashScheme) -> Self {
        let max_message_bytes = match scheme {
            HashScheme::Vllm => VLLM_MAX_MESSAGE_BYTES,
            HashScheme::Sglang => SGLANG_MAX_MESSAGE_BYTES,
        };
        Self {
            max_message_bytes,
            ..Self::default()
        }
    }

    /// `max_message_bytes` (in bytes) within the hard cap; at least 1 frame per message.
    pub fn clamped(self) -> Self {
        Self {
            max_message_bytes: self.max_message_bytes.min(HARD_MAX_MESSAGE_BYTES),
            max_frames: self.max_frames.clamp(1, MAX_FRAMES_PER_MESSAGE),
        }
    }
}

/// Why a peer was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// The first byte was not ZMTP's `0xFF` signature.
    BadGreeting,
    /// A frame header had reserved flag bits set.
    BadFlags,
    /// A command frame announced more than [`MAX_COMMAND_BYTES`].
    CommandTooLarge,
    /// One message frame announced more than the stream's limit.
    FrameTooLarge,
    /// The frames of one message added up to more than the stream's limit.
    MessageTooLarge,
    /// A message had more frames than [`ZmtpLimits::max_frames`].
    TooManyFrames,
    /// A command frame that is not a well-formed READY ([`check_command`]): an unknown
    /// command name, or a property name or value running past the frame (a 4 GiB value
    /// length). The `zeromq` library closes such a connection itself, without a word; the guard
    /// refuses it first so it is counted and logged.
    BadCommand,
    /// A large frame waited longer than [`RelayBudget::wait`] for the node's in-flight budget
    /// (or needs more than all of it).
    InflightBudget,
}

impl Violation {
    /// Every `reason` label value, for metric initialisation.
    pub const REASONS: &'static [&'static str] = &[
        "bad_greeting",
        "bad_flags",
        "command_too_large",
        "frame_too_large",
        "message_too_large",
        "too_many_frames",
        "bad_command",
        "inflight_budget",
    ];

    /// The `reason` label value.
    pub fn reason(self) -> &'static str {
        match self {
            Violation::BadGreeting => "bad_greeting",
            Violation::BadFlags => "bad_flags",
            Violation::CommandTooLarge => "command_too_large",
            Violation::FrameTooLarge => "frame_too_large",
            Violation::MessageTooLarge => "message_too_large",
            Violation::TooManyFrames => "too_many_frames",
            Violation::BadCommand => "bad_command",
            Violation::InflightBudget => "inflight_budget",
        }
    }
}

/// A violation with the length that caused it, for the log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// What was violated.
    pub violation: Violation,
    /// The announced frame length, or the message total, or the frame count (0 for
    /// [`Violation::BadGreeting`]/[`Violation::BadFlags`]).
    pub announced: u64,
    /// The limit it exceeded (same unit).
    pub limit: u64,
}

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.violation {
            Violation::BadGreeting => write!(f, "not a ZMTP greeting"),
            Violation::BadFlags => write!(f, "frame header with reserved flags set"),
            Violation::InflightBudget => write!(
                f,
                "a frame needing {} bytes of the node's in-flight budget of {} waited too long",
                self.announced, self.limit
            ),
            Violation::BadCommand => write!(
                f,
                "a command frame that is not a well-formed READY ({} bytes)",
                self.announced
            ),
            Violation::TooManyFrames => write!(
                f,
                "a message of more than {} frames ({} so far)",
                self.limit, self.announced
            ),
            v => write!(
                f,
                "{} of {} bytes announced, limit {}",
                match v {
                    Violation::CommandTooLarge => "a command frame",
                    Violation::FrameTooLarge => "a frame",
                    _ => "a message",
                },
                self.announced,
                self.limit
            ),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Bytes of the 64-byte greeting still to come.
    Greeting(u8),
    /// Waiting for a frame's flags byte.
    Flags,
    /// Reading the length: `left` bytes still to come, `acc` so far.
    Len {
        command: bool,
        more: bool,
        left: u8,
        acc: u64,
    },
    /// Skipping a body; `more` of the frame.
    Body {
        left: u64,
        more: bool,
        command: bool,
    },
}

/// Incremental checker of the engine-to-library byte stream (see the module docs).
#[derive(Debug)]
pub struct FrameGuard {
    limits: ZmtpLimits,
    state: State,
    /// Body bytes of the message in progress.
    msg_bytes: u64,
    /// Frames of the message in progress.
    msg_frames: usize,
    /// Body of the command frame in progress (at most [`MAX_COMMAND_BYTES`]).
    command: Vec<u8>,
    /// What the last [`FrameGuard::check`] saw, in order: message frames of at least
    /// [`RELAY_CHUNK`] bytes (their length) and completed messages (`None`).
    events: Vec<Option<u64>>,
}

/// Checks one command frame's body as the `zeromq` library reads it (its only command is READY):
/// a name length and name `READY`, then properties — name length (1 byte), a UTF-8 name, value
/// length (4 bytes big-endian), value — each within the frame.
///
/// # Errors
/// A static description of the first defect.
pub fn check_command(body: &[u8]) -> Result<(), &'static str> {
    let (&name_len, rest) = body.split_first().ok_or("missing command name")?;
    let (name, mut rest) = rest
        .split_at_checked(usize::from(name_len))
        .ok_or("command name past the frame")?;
    if name != b"READY" {
        return Err("unknown command");
    }
    while let Some((&len, after)) = rest.split_first() {
        let (prop, after) = after
            .split_at_checked(usize::from(len))
            .ok_or("property name past the frame")?;
        std::str::from_utf8(prop).map_err(|_| "property name not UTF-8")?;
        let (value_len, after) = after
            .split_first_chunk::<4>()
            .ok_or("missing property value length")?;
        let value_len = usize::try_from(u32::from_be_bytes(*value_len))
            .map_err(|_| "property value past the frame")?;
        rest = after
            .get(value_len..)
            .ok_or("property value past the frame")?;
    }
    Ok(())
}

const GREETING_LEN: u8 = 64;

impl FrameGuard {
    /// A checker at the start of a connection.
    pub fn new(limits: ZmtpLimits) -> Self {
        Self {
            limits: limits.clamped(),
            state: State::Greeting(GREETING_LEN),
            msg_bytes: 0,
            msg_frames: 0,
            command: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Checks the next `bytes` of the stream; `Err` at the first violation (the connection
    /// must then be dropped: none of `bytes` may reach the library).
    ///
    /// # Errors
    /// [`Dropped`] naming the violation.
    pub fn check(&mut self, mut bytes: &[u8]) -> Result<(), Dropped> {
        self.events.clear();
        let drop = |violation, announced, limit| Dropped {
            violation,
            announced,
            limit,
        };
        while !bytes.is_empty() {
            match self.state {
                State::Greeting(left) => {
                    if left == GREETING_LEN && bytes[0] != 0xFF {
                        return Err(drop(Violation::BadGreeting, 0, 0));
                    }
                    let n = bytes.len().min(usize::from(left));
                    bytes = &bytes[n..];
                    // n <= left <= 64
                    let left = left - n as u8;
                    self.state = if left == 0 {
                        State::Flags
                    } else {
                        State::Greeting(left)
                    };
                }
                State::Flags => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    if flags & 0b1111_1000 != 0 {
                        return Err(drop(Violation::BadFlags, 0, 0));
                    }
                    self.state = State::Len {
                        command: flags & 0b100 != 0,
                        more: flags & 0b1 != 0,
                        left: if flags & 0b10 != 0 { 8 } else { 1 },
                        acc: 0,
                    };
                }
                State::Len {
                    command,
                    more,
                    left,
                    acc,
                } => {
                    let acc = (acc << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    if left > 1 {
                        self.state = State::Len {
                            command,
                            more,
                            left: left - 1,
                            acc,
                        };
                        continue;
                    }
                    self.header_complete(command, more, acc)?;
                }
                State::Body {
                    left,
                    more,
                    command,
                } => {
                    let n = (bytes.len() as u64).min(left);
                    // n <= bytes.len()
                    let (body, rest) = bytes.split_at(n as usize);
                    bytes = rest;
                    if command {
                        // At most MAX_COMMAND_BYTES: the header was checked.
                        self.command.extend_from_slice(body);
                    }
                    let left = left - n;
                    if left > 0 {
                        self.state = State::Body {
                            left,
                            more,
                            command,
                        };
                    } else {
                        self.frame_done(command, more)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn header_complete(&mut self, command: bool, more: bool, len: u64) -> Result<(), Dropped> {
        let max = self.limits.max_message_bytes as u64;
        if command {
            if len > MAX_COMMAND_BYTES {
                return Err(Dropped {
                    violation: Violation::CommandTooLarge,
                    announced: len,
                    limit: MAX_COMMAND_BYTES,
                });
            }
        } else {
            if len > max {
                return Err(Dropped {
                    violation: Violation::FrameTooLarge,
                    announced: len,
                    limit: max,
                });
            }
            self.msg_frames += 1;
            if self.msg_frames > self.limits.max_frames {
                return Err(Dropped {
                    violation: Violation::TooManyFrames,
                    announced: self.msg_frames as u64,
                    limit: self.limits.max_frames as u64,
                });
            }
            self.msg_bytes += len;
            if self.msg_bytes > max {
                return Err(Dropped {
                    violation: Violation::MessageTooLarge,
                    announced: self.msg_bytes,
                    limit: max,
                });
            }
            if len >= RELAY_CHUNK as u64 {
                self.events.push(Some(len));
            }
        }
        if len == 0 {
            self.frame_done(command, more)?;
        } else {
            self.state = State::Body {
                left: len,
                more,
                command,
            };
        }
        Ok(())
    }

    fn frame_done(&mut self, command: bool, more: bool) -> Result<(), Dropped> {
        if command {
            let body = std::mem::take(&mut self.command);
            if let Err(why) = check_command(&body) {
                tracing::debug!(why, "zmtp guard: bad command frame");
                return Err(Dropped {
                    violation: Violation::BadCommand,
                    announced: body.len() as u64,
                    limit: 0,
                });
            }
        } else if !more {
            self.msg_bytes = 0;
            self.msg_frames = 0;
            self.events.push(None);
        }
        self.state = State::Flags;
        Ok(())
    }
}

/// A byte stream to an engine (TCP or IPC).
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Where a ZMQ endpoint string points.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// `tcp://host:port` (host: name, IPv4, `[IPv6]`, or `*` when binding).
    Tcp(String, u16),
    /// `ipc://path`.
    Ipc(PathBuf),
}

fn parse_endpoint(endpoint: &str) -> Result<Target, String> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(format!("{endpoint}: an ipc endpoint needs a path"));
        }
        return Ok(Target::Ipc(PathBuf::from(path)));
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(format!(
            "{endpoint}: not a tcp:// or ipc:// endpoint (the agent speaks ZMTP over TCP or IPC)"
        ));
    };
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{endpoint}: no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{endpoint}: port {port:?} is not a number 0-65535"))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(format!("{endpoint}: no host"));
    }
    Ok(Target::Tcp(host.to_string(), port))
}

/// Called with each violation (count it, log it).
pub type OnDrop = Arc<dyn Fn(Dropped) + Send + Sync>;

/// Charges of the messages the relay passed to the library, in order, for the socket's reader
/// to take one per message it receives (`None`: a message of small frames, not charged here).
pub type Charges = Arc<std::sync::Mutex<std::collections::VecDeque<Option<InflightPermit>>>>;

/// The node-wide budget a relay charges the large frames it passes to the library against
/// (issue 38, D1): the library buffers a whole message before the socket's reader sees it (up
/// to twice its size, measured), so a flood of under-cap messages on many streams is bounded
/// only if those bytes are charged before they are relayed.
#[derive(Clone)]
pub struct RelayBudget {
    /// The budget.
    pub budget: Arc<InflightBudget>,
    /// Where each completed message's charge goes.
    pub charges: Charges,
    /// Longest wait for the budget before the peer is dropped ([`Violation::InflightBudget`]).
    pub wait: Duration,
}

/// What the library may hold for a frame of `len` bytes: twice it (measured: a stream whose
/// 15 MiB messages were all dropped on arrival held 31 MiB).
pub const LIBRARY_FACTOR: u64 = 2;

/// A relay from one engine connection to a loopback endpoint the library connects to; dropping
/// it closes both connections.
#[derive(Debug)]
pub struct Guarded {
    endpoint: String,
    task: tokio::task::JoinHandle<()>,
}

impl Guarded {
    /// The loopback endpoint (`tcp://127.0.0.1:<port>`) for the library's socket to connect
    /// to; it accepts one connection.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect_io(endpoint: &str, timeout: Duration) -> Result<Box<dyn Io>, String> {
    let target = parse_endpoint(endpoint)?;
    let attempt = async {
        match &target {
            Target::Tcp(host, port) => TcpStream::connect((host.as_str(), *port)).await.map(|s| {
                let _ = s.set_nodelay(true);
                Box::new(s) as Box<dyn Io>
            }),
            Target::Ipc(path) => tokio::net::UnixStream::connect(path)
                .await
                .map(|s| Box::new(s) as Box<dyn Io>),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(io)) => Ok(io),
        Ok(Err(e)) => Err(format!("connect {endpoint}: {e}")),
        Err(_) => Err(format!("connect {endpoint}: timed out")),
    }
}

/// Connects to the engine at `endpoint` (`tcp://…` or `ipc://…`, within `timeout`) and returns
/// the guarded loopback endpoint for the library's socket to connect to (within `timeout`,
/// else the relay ends).
///
/// # Errors
/// A message naming the endpoint when it is malformed or cannot be reached.
pub async fn connect(
    endpoint: &str,
    limits: ZmtpLimits,
    timeout: Duration,
    on_drop: OnDrop,
) -> Result<Guarded, String> {
    connect_budgeted(endpoint, limits, timeout, on_drop, None).await
}

/// [`connect`], charging the large frames relayed against `budget` ([`RelayBudget`]).
///
/// # Errors
/// As [`connect`].
pub async fn connect_budgeted(
    endpoint: &str,
    limits: ZmtpLimits,
    timeout: Duration,
    on_drop: OnDrop,
    budget: Option<RelayBudget>,
) -> Result<Guarded, String> {
    let engine = connect_io(endpoint, timeout).await?;
    relay_via_loopback(engine, limits, timeout, on_drop, budget).await
}

/// A listener where engines connect (a SUB that binds, `@tcp://host:port`).
pub struct GuardListener {
    inner: Listener,
}

enum Listener {
    Tcp(TcpListener),
    Ipc(tokio::net::UnixListener),
}

impl GuardListener {
    /// Binds `endpoint` (`tcp://host:port`, `*` for every address; `ipc://path`).
    ///
    /// # Errors
    /// A message naming the endpoint when it is malformed or cannot be bound.
    pub async fn bind(endpoint: &str) -> Result<Self, String> {
        let inner = match parse_endpoint(endpoint)? {
            Target::Tcp(host, port) => {
                let host = if host == "*" {
                    "0.0.0.0".to_string()
                } else {
                    host
                };
                TcpListener::bind((host.as_str(), port))
                    .await
                    .map(Listener::Tcp)
                    .map_err(|e| format!("bind {endpoint}: {e}"))?
            }
            Target::Ipc(path) => {
                // A stale socket file of an earlier run would make the bind fail.
                let _ = std::fs::remove_file(&path);
                tokio::net::UnixListener::bind(&path)
                    .map(Listener::Ipc)
                    .map_err(|e| format!("bind {endpoint}: {e}"))?
            }
        };
        Ok(Self { inner })
    }

    /// Waits for one engine to connect and returns the guarded loopback endpoint for the
    /// library's socket to connect to (within `timeout`).
    ///
    /// # Errors
    /// A message when accepting fails.
    pub async fn accept(
        &self,
        limits: ZmtpLimits,
        timeout: Duration,
        on_drop: OnDrop,
        budget: Option<RelayBudget>,
    ) -> Result<Guarded, String> {
        let engine: Box<dyn Io> = match &self.inner {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await.map_err(|e| format!("accept: {e}"))?;
                let _ = s.set_nodelay(true);
                Box::new(s)
            }
            Listener::Ipc(l) => Box::new(l.accept().await.map_err(|e| format!("accept: {e}"))?.0),
        };
        relay_via_loopback(engine, limits, timeout, on_drop, budget).await
    }
}

async fn relay_via_loopback(
    engine: Box<dyn Io>,
    limits: ZmtpLimits,
    timeout: Duration,
    on_drop: OnDrop,
    budget: Option<RelayBudget>,
) -> Result<Guarded, String> {
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| format!("loopback relay: {e}"))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("loopback relay: {e}"))?
        .port();
    let task = tokio::spawn(async move {
        let Ok(Ok((lib, _))) = tokio::time::timeout(timeout, listener.accept()).await else {
            return;
        };
        drop(listener);
        let _ = lib.set_nodelay(true);
        relay(engine, lib, limits, on_drop, budget).await;
    });
    Ok(Guarded {
        endpoint: format!("tcp://127.0.0.1:{port}"),
        task,
    })
}

/// Charges `bytes` against the budget, waiting up to `rb.wait`; the violation when it cannot.
async fn charge(rb: &RelayBudget, bytes: u64) -> Result<InflightPermit, Dropped> {
    let over = Dropped {
        violation: Violation::InflightBudget,
        announced: bytes,
        limit: rb.budget.limit() as u64,
    };
    let want = usize::try_from(bytes).map_err(|_| over)?;
    let deadline = tokio::time::Instant::now() + rb.wait;
    loop {
        if want > rb.budget.limit() {
            return Err(over);
        }
        if let Some(p) = rb.budget.try_charge(want) {
            return Ok(p);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(over);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn relay(
    engine: Box<dyn Io>,
    lib: TcpStream,
    limits: ZmtpLimits,
    on_drop: OnDrop,
    budget: Option<RelayBudget>,
) {
    let (mut er, mut ew) = tokio::io::split(engine);
    let (mut lr, mut lw) = lib.into_split();
    let to_lib = async {
        let mut guard = FrameGuard::new(limits);
        let mut buf = vec![0u8; RELAY_CHUNK];
        // The charge of the message being relayed (its large frames).
        let mut pending: Option<InflightPermit> = None;
        loop {
            let n = match er.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Err(d) = guard.check(&buf[..n]) {
                on_drop(d);
                return;
            }
            if let Some(rb) = &budget {
                // Before any of these bytes reach the library: charge each large frame they
                // start, and hand each message they complete its charge, in order.
                for ev in std::mem::take(&mut guard.events) {
                    match ev {
                        Some(len) => match charge(rb, len.saturating_mul(LIBRARY_FACTOR)).await {
                            Ok(p) => {
                                pending = Some(match pending.take() {
                                    Some(mut held) => {
                                        held.absorb(p);
                                        held
                                    }
                                    None => p,
                                });
                            }
                            Err(d) => {
                                on_drop(d);
                                return;
                            }
                        },
                        None => rb
                            .charges
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push_back(pending.take()),
                    }
                }
            }
            if lw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let to_engine = async {
        let _ = tokio::io::copy(&mut lr, &mut ew).await;
    };
    // Either side ending ends both: the halves are dropped, closing both connections.
    tokio::select! {
        () = to_lib => {}
        () = to_engine => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greeting() -> Vec<u8> {
        let mut g = vec![0u8; 64];
        g[0] = 0xFF;
        g[9] = 0x7F;
        g[10] = 3;
        g[12..16].copy_from_slice(b"NULL");
        g
    }

    fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        if body.len() > 255 {
            out.push(flags | 0b10);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            out.push(flags);
            out.push(body.len() as u8);
        }
        out.extend_from_slice(body);
        out
    }

    fn limits(max: usize) -> ZmtpLimits {
        ZmtpLimits {
            max_message_bytes: max,
            max_frames: 4,
        }
    }

    /// Feeds `bytes` one byte at a time and all at once: both must agree.
    fn check_both(l: ZmtpLimits, bytes: &[u8]) -> Result<(), Dropped> {
        let mut a = FrameGuard::new(l);
        let whole = a.check(bytes);
        let mut b = FrameGuard::new(l);
        let split = bytes
            .iter()
            .try_for_each(|x| b.check(std::slice::from_ref(x)));
        assert_eq!(whole, split);
        whole
    }

    #[test]
    fn a_well_formed_session_passes_in_any_split() {
        let mut s = greeting();
        s.extend(frame(0b100, b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"));
        s.extend(frame(1, b"kv@pod"));
        s.extend(frame(1, &7u64.to_be_bytes()));
        s.extend(frame(0, &[0x55; 1000]));
        s.extend(frame(1, b""));
        s.extend(frame(0, &[1; 1024]));
        assert_eq!(check_both(limits(1024 + 8), &s), Ok(()));
    }

    #[test]
    fn a_header_announcing_one_tebibyte_is_refused_before_its_body() {
        let mut s = greeting();
        s.extend(frame(0b100, b"\x05READY"));
        s.push(0b10);
        s.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let err = check_both(ZmtpLimits::default(), &s).unwrap_err();
        assert_eq!(err.violation, Violation::FrameTooLarge);
        assert_eq!(err.announced, 1 << 40);
        assert_eq!(err.limit, HARD_MAX_MESSAGE_BYTES as u64);
        // u64::MAX, which no usize holds on 32-bit, is refused the same way.
        let mut s = greeting();
        s.push(0b10);
        s.extend_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(
            check_both(ZmtpLimits::default(), &s).unwrap_err().violation,
            Violation::FrameTooLarge
        );
    }

    #[test]
    fn frames_that_add_up_past_the_limit_are_refused() {
        let mut s = greeting();
        s.extend(frame(1, &[0; 600]));
        s.extend(frame(0, &[0; 600]));
        assert_eq!(
            check_both(limits(1000), &s).unwrap_err().violation,
            Violation::MessageTooLarge
        );
        // The same frames as two messages are fine.
        let mut s = greeting();
        s.extend(frame(0, &[0; 600]));
        s.extend(frame(0, &[0; 600]));
        assert_eq!(check_both(limits(1000), &s), Ok(()));
    }

    #[test]
    fn too_many_frames_oversize_commands_bad_flags_and_greetings_are_refused() {
        let mut s = greeting();
        for _ in 0..5 {
            s.extend(frame(1, b""));
        }
        assert_eq!(
            check_both(limits(1000), &s).unwrap_err().violation,
            Violation::TooManyFrames
        );
        let mut s = greeting();
        s.push(0b110);
        s.extend_from_slice(&(MAX_COMMAND_BYTES + 1).to_be_bytes());
        assert_eq!(
            check_both(limits(1000), &s).unwrap_err().violation,
            Violation::CommandTooLarge
        );
        let mut s = greeting();
        s.push(0x80);
        assert_eq!(
            check_both(limits(1000), &s).unwrap_err().violation,
            Violation::BadFlags
        );
        assert_eq!(
            check_both(limits(1000), b"GET / HTTP/1.1\r\n")
                .unwrap_err()
                .violation,
            Violation::BadGreeting
        );
    }

    #[test]
    fn malformed_ready_commands_are_refused_before_the_library_sees_them() {
        // The breaker's D6: a 4 GiB property value length, a property name running past the
        // frame, an unknown command name — and an empty command, a non-UTF-8 property name.
        let mut four_gib = b"\x05READY\x0bSocket-Type".to_vec();
        four_gib.extend_from_slice(&u32::MAX.to_be_bytes());
        four_gib.extend_from_slice(b"PUB");
        for body in [
            &four_gib[..],
            b"\x05READY\xffSocket-Type",
            b"\x05HELLO",
            b"\x04PING\x00\x00",
            b"",
            b"\x05READY\x02\xff\xfe\x00\x00\x00\x00",
            b"\x09READY",
        ] {
            let mut s = greeting();
            s.extend(frame(0b100, body));
            let err = check_both(limits(1000), &s).unwrap_err();
            assert_eq!(err.violation, Violation::BadCommand, "{body:02x?}");
            assert_eq!(err.violation.reason(), "bad_command");
        }
        // Well-formed READYs pass: no properties, an empty value, two properties.
        for body in [
            &b"\x05READY"[..],
            b"\x05READY\x08Identity\x00\x00\x00\x00",
            b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB\x08Identity\x00\x00\x00\x01x",
        ] {
            let mut s = greeting();
            s.extend(frame(0b100, body));
            assert_eq!(check_both(limits(1000), &s), Ok(()), "{body:02x?}");
        }
    }

    #[test]
    fn limits_never_exceed_the_hard_cap() {
        let l = ZmtpLimits {
            max_message_bytes: usize::MAX,
            max_frames: usize::MAX,
        }
        .clamped();
        assert_eq!(l.max_message_bytes, HARD_MAX_MESSAGE_BYTES);
        assert_eq!(l.max_frames, MAX_FRAMES_PER_MESSAGE);
        assert!(
            ZmtpLimits::for_scheme(HashScheme::Vllm).max_message_bytes < HARD_MAX_MESSAGE_BYTES
        );
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            parse_endpoint("tcp://10.0.0.5:5557"),
            Ok(Target::Tcp("10.0.0.5".into(), 5557))
        );
        assert_eq!(
            parse_endpoint("tcp://[::1]:5557"),
            Ok(Target::Tcp("::1".into(), 5557))
        );
        assert_eq!(
            parse_endpoint("ipc:///tmp/x.sock"),
            Ok(Target::Ipc("/tmp/x.sock".into()))
        );
        assert!(parse_endpoint("tcp://host").is_err());
        assert!(parse_endpoint("inproc://x").is_err());
    }
}
