//! A stand-in engine publisher for docs, demos and tests: replays golden frames from a fixture
//! (`testdata/kv-events/<engine>-<version>.json`) over real ZeroMQ sockets, byte for byte
//! as the engine sent them.
//!
//! ```text
//! ic-agent kv publish --fixture vllm-0.26.0.json --endpoint tcp://127.0.0.1:5557 \
//!     [--replay-endpoint tcp://127.0.0.1:5558] [--source dp0] [--repeat N] [--interval-ms M]
//! ```
//!
//! [`publish_fixture`] binds a PUB socket at the endpoint, waits
//! [`PublishOptions::connect_wait`] so subscribers can connect (a PUB drops messages nobody has
//! subscribed to yet), then sends the `live[]` frames of one `source` (`[topic, seq, payload]`,
//! unchanged) every [`PublishOptions::interval`], `repeat` times (each pass restarts at the
//! recorded seqs, which a subscriber sees as an engine restart). With a replay endpoint it also
//! binds a ROUTER that answers `["", start_seq]` requests like the engine: every batch of the
//! current pass published (or withheld by `--skip-seq`) so far with seq ≥ start, as `["", seq, payload]` or — when the fixture's engine sends
//! the topic in replies (vLLM ≥ 0.26) — `["", topic, seq, payload]`, then the end marker (seq of
//! all `0xFF` bytes, empty payload).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// One recorded live message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveFrame {
    /// Publisher the frame came from (`dp0`, `dp1`, `dp2`).
    pub source: String,
    /// Topic frame bytes.
    pub topic: Vec<u8>,
    /// Engine sequence number (from the 8-byte frame).
    pub seq: u64,
    /// msgpack payload bytes.
    pub payload: Vec<u8>,
}

/// The parts of a golden fixture file the publisher needs.
#[derive(Debug, Clone)]
pub struct Fixture {
    /// Every `live[]` message, in recorded order.
    pub live: Vec<LiveFrame>,
    /// True when the engine's replay replies carry the topic (4 frames).
    pub replay_with_topic: bool,
}

#[derive(Deserialize)]
struct RawFixture {
    live: Vec<RawLive>,
    #[serde(default)]
    replay: Vec<RawReplay>,
}

#[derive(Deserialize)]
struct RawLive {
    #[serde(default = "default_source")]
    source: String,
    frames_hex: Vec<String>,
}

#[derive(Deserialize)]
struct RawReplay {
    frames_hex: Vec<String>,
}

fn default_source() -> String {
    "dp0".to_string()
}

/// Errors of the publisher tool.
#[derive(Debug, Error)]
pub enum PublishError {
    /// The fixture file could not be read.
    #[error("cannot read fixture {path}: {source}")]
    Read {
        /// File path.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// The fixture is not valid JSON of the expected shape.
    #[error("invalid fixture {path}: {message}")]
    Parse {
        /// File path.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The fixture has no live frames for the requested source.
    #[error("fixture has no live frames for source {0:?}")]
    NoFrames(String),
    /// A socket could not be bound.
    #[error("cannot bind {endpoint}: {message}")]
    Bind {
        /// Endpoint as given.
        endpoint: String,
        /// ZeroMQ error.
        message: String,
    },
    /// Sending a frame failed.
    #[error("send failed: {0}")]
    Send(String),
}

impl Fixture {
    /// Reads a fixture file.
    ///
    /// # Errors
    /// [`PublishError::Read`] or [`PublishError::Parse`] (bad JSON, bad hex, a live message that
    /// is not 3 frames or whose seq frame is not 8 bytes).
    pub fn load(path: &Path) -> Result<Self, PublishError> {
        let text = std::fs::read_to_string(path).map_err(|source| PublishError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses fixture JSON; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, PublishError> {
        let bad = |message: String| PublishError::Parse {
            path: origin.to_string(),
            message,
        };
        let raw: RawFixture = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let mut live = Vec::with_capacity(raw.live.len());
        for (i, l) in raw.live.into_iter().enumerate() {
            if l.frames_hex.len() != 3 {
                return Err(bad(format!(
                    "live[{i}] has {} frames, expected 3",
                    l.frames_hex.len()
                )));
            }
            let mut frames = Vec::with_capacity(3);
            for h in &l.frames_hex {
                frames.push(hex::decode(h).map_err(|e| bad(format!("live[{i}]: {e}")))?);
            }
            let seq: [u8; 8] = frames[1]
                .as_slice()
                .try_into()
                .map_err(|_| bad(format!("live[{i}]: seq frame is not 8 bytes")))?;
            let payload = frames.pop().unwrap_or_default();
            let topic = frames.swap_remove(0);
            live.push(LiveFrame {
                source: l.source,
                topic,
                seq: u64::from_be_bytes(seq),
                payload,
            });
        }
        let replay_with_topic = raw.replay.first().is_some_and(|r| r.frames_hex.len() >= 4);
        Ok(Self {
            live,
            replay_with_topic,
        })
    }

    /// The live frames of one source, in recorded order.
    pub fn frames(&self, source: &str) -> Vec<LiveFrame> {
        self.live
            .iter()
            .filter(|f| f.source == source)
            .cloned()
            .collect()
    }
}

/// How [`publish_fixture`] plays a fixture.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// Which publisher's frames to send (`dp0`, `dp1`, `dp2`; default `dp0`).
    pub source: String,
    /// Passes over the frames; 0 = until the task is cancelled (default 1).
    pub repeat: u32,
    /// Pause between frames (default 50 ms).
    pub interval: Duration,
    /// Pause after binding, before the first frame, so subscribers connect (default 500 ms).
    pub connect_wait: Duration,
    /// How long to keep the sockets (and the replay service) up after the last frame
    /// (default 1 s).
    pub linger: Duration,
    /// Recorded seqs not sent live (the replay socket still serves them): simulates message loss
    /// — a subscriber that checks its tail by replay finds them.
    pub skip_seqs: BTreeSet<u64>,
    /// The recording ends after this seq: later frames are neither published nor replayable
    /// (an engine that has not got there). The recorded scenarios end with AllBlocksCleared
    /// (seq 9): `Some(8)` keeps their state.
    pub until_seq: Option<u64>,
    /// Send each live batch with the current time as its engine timestamp (the batch's first
    /// element, an msgpack float64) instead of the recorded one, so a subscriber's
    /// `kv_stream_lag_seconds` reads the real delay rather than the recording's age (default
    /// false: byte for byte; `ic-agent kv publish` turns it on unless `--recorded-timestamps`).
    pub retime: bool,
}

impl Default for PublishOptions {
    fn default() -> Self {
        Self {
            source: "dp0".to_string(),
            repeat: 1,
            interval: Duration::from_millis(50),
            connect_wait: Duration::from_millis(500),
            linger: Duration::from_secs(1),
            skip_seqs: BTreeSet::new(),
            until_seq: None,
            retime: false,
        }
    }
}

/// What [`publish_fixture`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishReport {
    /// Live messages sent.
    pub published: u64,
    /// Live messages withheld (`skip_seqs`).
    pub skipped: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Batches sent in replay replies.
    pub replayed_batches: u64,
}

/// Turns an engine-style bind endpoint (`tcp://*:5557`) into one ZeroMQ-rs binds
/// (`tcp://0.0.0.0:5557`).
pub fn bind_endpoint(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

/// `payload` with its batch timestamp replaced by `unix_seconds`, when it has the engines' shape
/// (`[ts: float64, events, (dp_rank)]`: fixarray of 2 or 3, then `0xcb` + 8 bytes); any other
/// payload is returned unchanged.
pub fn retimed(payload: &[u8], unix_seconds: f64) -> Vec<u8> {
    let mut out = payload.to_vec();
    if out.len() >= 10 && matches!(out[0], 0x92 | 0x93) && out[1] == 0xcb {
        out[2..10].copy_from_slice(&unix_seconds.to_be_bytes());
    }
    out
}

/// An endpoint without a transport (`127.0.0.1:5557`): ZeroMQ would only say "Could not parse
/// transport", so this says what to write instead.
fn require_transport(endpoint: &str) -> Result<(), PublishError> {
    if endpoint.contains("://") {
        return Ok(());
    }
    Err(PublishError::Bind {
        endpoint: endpoint.to_string(),
        message: format!("no transport: write tcp://{endpoint} (or ipc://PATH)"),
    })
}

/// Publishes a fixture's live frames on a PUB bound at `endpoint` (or connected to it, when it
/// is written `>tcp://host:port`, as vLLM connects a non-wildcard endpoint) and serves replay
/// requests on a ROUTER bound at `replay_endpoint` (see the module docs for the exact
/// behaviour).
///
/// Returns after the last pass plus [`PublishOptions::linger`].
///
/// # Errors
/// The fixture cannot be read or has no frames for the source ([`PublishError::NoFrames`]), a
/// socket cannot be bound ([`PublishError::Bind`]), or a send fails.
pub async fn publish_fixture(
    path: &Path,
    endpoint: &str,
    replay_endpoint: Option<&str>,
    opts: &PublishOptions,
) -> Result<PublishReport, PublishError> {
    publish_fixture_until(
        path,
        endpoint,
        replay_endpoint,
        opts,
        std::future::pending(),
    )
    .await
}

/// [`publish_fixture`] that also ends when `stop` resolves (SIGINT / SIGTERM for `ic-agent kv
/// publish`): publishing and the linger stop there and the report says what was done so far.
/// Logs (info) when the last frame is out and the linger begins, so a user sees that the
/// publisher is now only serving replay requests.
///
/// # Errors
/// As [`publish_fixture`].
pub async fn publish_fixture_until(
    path: &Path,
    endpoint: &str,
    replay_endpoint: Option<&str>,
    opts: &PublishOptions,
    stop: impl std::future::Future<Output = ()>,
) -> Result<PublishReport, PublishError> {
    tokio::pin!(stop);
    let fixture = Fixture::load(path)?;
    let mut frames = fixture.frames(&opts.source);
    if let Some(last) = opts.until_seq {
        frames.retain(|f| f.seq <= last);
    }
    if frames.is_empty() {
        return Err(PublishError::NoFrames(opts.source.clone()));
    }
    require_transport(endpoint)?;
    if let Some(ep) = replay_endpoint {
        require_transport(ep)?;
    }
    let mut publisher = PubSocket::new();
    // `>tcp://…` connects the PUB, as vLLM does for a non-wildcard endpoint.
    let attached = match endpoint.strip_prefix('>') {
        Some(ep) => publisher.connect(ep).await,
        None => publisher.bind(&bind_endpoint(endpoint)).await.map(|_| ()),
    };
    attached.map_err(|e| PublishError::Bind {
        endpoint: endpoint.to_string(),
        message: e.to_string(),
    })?;
    let requests = Arc::new(AtomicU64::new(0));
    let replayed = Arc::new(AtomicU64::new(0));
    // How many frames of the current pass were published (or withheld): the replay buffer holds
    // only those, as the engine's does; a new pass (an engine restart) starts it over.
    let progress = Arc::new(AtomicUsize::new(0));
    let server = match replay_endpoint {
        Some(ep) => {
            let mut router = RouterSocket::new();
            router
                .bind(&bind_endpoint(ep))
                .await
                .map_err(|e| PublishError::Bind {
                    endpoint: ep.to_string(),
                    message: e.to_string(),
                })?;
            Some(AbortOnDrop(tokio::spawn(serve_replay(
                router,
                frames.clone(),
                progress.clone(),
                fixture.replay_with_topic,
                requests.clone(),
                replayed.clone(),
            ))))
        }
        None => None,
    };
    let mut report = PublishReport::default();
    let mut pass = 0u32;
    let mut stopped = false;
    tokio::select! {
        () = tokio::time::sleep(opts.connect_wait) => {}
        () = &mut stop => stopped = true,
    }
    let result = loop {
        if stopped {
            break Ok(());
        }
        if opts.repeat != 0 && pass >= opts.repeat {
            break Ok(());
        }
        pass = pass.saturating_add(1);
        let mut failed = None;
        progress.store(0, Ordering::Relaxed);
        for (i, f) in frames.iter().enumerate() {
            if opts.skip_seqs.contains(&f.seq) {
                report.skipped += 1;
                progress.store(i + 1, Ordering::Relaxed);
                continue;
            }
            let mut msg = ZmqMessage::from(f.topic.clone());
            msg.push_back(f.seq.to_be_bytes().to_vec().into());
            let payload = if opts.retime {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                retimed(&f.payload, now)
            } else {
                f.payload.clone()
            };
            msg.push_back(payload.into());
            progress.store(i + 1, Ordering::Relaxed);
            if let Err(e) = publisher.send(msg).await {
                failed = Some(PublishError::Send(e.to_string()));
                break;
            }
            report.published += 1;
            tokio::select! {
                () = tokio::time::sleep(opts.interval) => {}
                () = &mut stop => {
                    stopped = true;
                    break;
                }
            }
        }
        if let Some(e) = failed {
            break Err(e);
        }
    };
    if result.is_ok() && !stopped {
        tracing::info!(
            published = report.published,
            withheld = report.skipped,
            linger_seconds = opts.linger.as_secs(),
            "last frame published; serving replay requests until the linger ends (Ctrl-C stops)"
        );
        tokio::select! {
            () = tokio::time::sleep(opts.linger) => {}
            () = &mut stop => {}
        }
    }
    drop(server);
    report.replay_requests = requests.load(Ordering::Relaxed);
    report.replayed_batches = replayed.load(Ordering::Relaxed);
    result.map(|()| report)
}

/// Aborts the replay server when the publisher stops — also when the publishing future itself is
/// dropped (a cancelled or aborted task), so the ROUTER's port is released with the PUB's (a
/// "restarted engine" can bind both again).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Answers replay requests `[identity, "", start_seq]` with the frames of the current pass
/// published so far (`progress` of them) whose seq is at least the start.
async fn serve_replay(
    mut router: RouterSocket,
    frames: Vec<LiveFrame>,
    progress: Arc<AtomicUsize>,
    with_topic: bool,
    requests: Arc<AtomicU64>,
    replayed: Arc<AtomicU64>,
) {
    loop {
        let Ok(req) = router.recv().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let parts = req.into_vec();
        // [identity, "", seq] from a DEALER (or [identity, seq] without the delimiter).
        let Some(identity) = parts.first().cloned() else {
            continue;
        };
        let Some(start) = parts
            .last()
            .and_then(|s| <[u8; 8]>::try_from(s.as_ref()).ok())
            .map(u64::from_be_bytes)
        else {
            continue;
        };
        requests.fetch_add(1, Ordering::Relaxed);
        let reply = |seq: u64, payload: Vec<u8>, topic: &[u8]| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(Vec::<u8>::new().into());
            if with_topic {
                m.push_back(topic.to_vec().into());
            }
            m.push_back(seq.to_be_bytes().to_vec().into());
            m.push_back(payload.into());
            m
        };
        let sent = progress.load(Ordering::Relaxed).min(frames.len());
        for f in frames[..sent].iter().filter(|f| f.seq >= start) {
            if router
                .send(reply(f.seq, f.payload.clone(), &f.topic))
                .await
                .is_err()
            {
                break;
            }
            replayed.fetch_add(1, Ordering::Relaxed);
        }
        // End marker: the engine sends an empty topic with it.
        let _ = router.send(reply(u64::MAX, Vec::new(), &[])).await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn parses_frames_and_replay_shape() {
        let text = r#"{
            "live": [
                {"source": "dp0", "seq": 0, "frames_hex": ["6b76", "0000000000000000", "93"]},
                {"source": "dp1", "seq": 0, "frames_hex": ["", "0000000000000000", "94"]}
            ],
            "replay": [{"frames_hex": ["", "6b76", "0000000000000001", "93"]}]
        }"#;
        let f = Fixture::parse(text, "t").unwrap();
        assert!(f.replay_with_topic);
        let dp0 = f.frames("dp0");
        assert_eq!(dp0.len(), 1);
        assert_eq!(dp0[0].topic, b"kv".to_vec());
        assert_eq!(dp0[0].payload, vec![0x93]);
        assert!(Fixture::parse(r#"{"live":[{"frames_hex":["00"]}]}"#, "t").is_err());
        assert_eq!(bind_endpoint("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }

    #[test]
    fn retiming_replaces_only_the_batch_timestamp() {
        // [1.5, [], 0] and a payload of another shape
        let batch = [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0x00];
        let out = retimed(&batch, 1_700_000_000.25);
        assert_eq!(out[..2], batch[..2]);
        assert_eq!(
            f64::from_be_bytes(out[2..10].try_into().unwrap()),
            1_700_000_000.25
        );
        assert_eq!(out[10..], batch[10..]);
        let other = [0x92, 0xca, 0, 0, 0, 0, 0x90];
        assert_eq!(retimed(&other, 1.0), other.to_vec());
    }

    #[test]
    fn an_endpoint_without_transport_says_what_to_write() {
        let err = require_transport("127.0.0.1:5557").unwrap_err().to_string();
        assert_eq!(
            err,
            "cannot bind 127.0.0.1:5557: no transport: write tcp://127.0.0.1:5557 (or ipc://PATH)"
        );
        assert!(require_transport("tcp://127.0.0.1:5557").is_ok());
    }
}
