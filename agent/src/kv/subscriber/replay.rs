//! The replay client (a DEALER asks `["", start]` and reads replies up to the end marker of seq
//! `u64::MAX`) and what a replay's replies show: whether the engine still holds the batch we
//! anchored at ([`Anchored`]), and how a run of replies continues ([`Run`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::Notify;
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use super::super::zmtp_guard::{self, Dropped, OnDrop};
use super::reader::limits;
use super::SubscriberOptions;

/// What an anchored replay (from the last applied seq) showed.
pub(super) enum Anchored {
    /// The engine's batch at our last seq is the one we applied; the replies after it follow.
    Same(Vec<(u64, Vec<u8>)>),
    /// As `Same`, but the replay ended without its end marker (replies lost past the engine's
    /// send high-water mark, vLLM < 0.33): the replies received after the anchor; the rest of
    /// the tail is unknown.
    Cut(Vec<(u64, Vec<u8>)>),
    /// The engine holds another batch at that seq, or nothing from it on: another incarnation.
    Other,
    /// The engine's buffer starts after our last seq: it cannot be told.
    Unverifiable,
    /// The engine's replay holds nothing at all (buffer off or empty): it cannot be told, and
    /// nothing was lost that a replay could give back.
    Silent,
}

/// How a run of replies continues from `next`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Run {
    /// Contiguous up to (excluding) the wanted end.
    Complete,
    /// Contiguous, but ended (end marker) before the wanted end.
    EndedEarly,
    /// A seq is missing inside the run.
    Holes,
}

/// Classifies `replies` (seqs ascending) as a continuation from `next` up to `upto` (`None`: to
/// the end of the engine's buffer).
pub(super) fn classify_run(next: u64, replies: &[(u64, Vec<u8>)], upto: Option<u64>) -> Run {
    let mut expected = next;
    for (s, _) in replies {
        if upto.is_some_and(|u| *s >= u) {
            break;
        }
        if *s != expected {
            return Run::Holes;
        }
        expected += 1;
    }
    match upto {
        Some(u) if expected < u => Run::EndedEarly,
        _ => Run::Complete,
    }
}

/// The longest contiguous suffix of `replies` that ends at `upto - 1` (or at the last reply
/// when `upto` is `None`), and whether the replies had holes. Returns the index it starts at.
pub(super) fn tail_run(replies: &[(u64, Vec<u8>)], upto: Option<u64>) -> (Option<usize>, bool) {
    let end = match upto {
        Some(u) => replies.iter().take_while(|(s, _)| *s < u).count(),
        None => replies.len(),
    };
    if end == 0 {
        return (None, false);
    }
    let mut start = end - 1;
    let mut holes = false;
    for i in (1..end).rev() {
        if replies[i].0 != replies[i - 1].0.wrapping_add(1) {
            holes = true;
            break;
        }
        start = i - 1;
    }
    if !holes {
        start = 0;
    }
    let connects = match upto {
        Some(u) => replies[end - 1].0.checked_add(1) == Some(u),
        None => true,
    };
    (connects.then_some(start), holes)
}

/// Judges replies from `last` against the anchor digest (see [`Anchored`]); `older`: for an
/// empty reply, whether the engine holds batches before `last`.
pub(super) fn judge_anchor(
    last: u64,
    digest: u64,
    mut replies: Vec<(u64, Vec<u8>)>,
    older: Option<bool>,
) -> Anchored {
    match replies.first() {
        // Nothing at or after our last seq. The engine keeps its newest batches, so if it
        // holds any at all it has restarted (all of them are older than ours); if it holds
        // none, its replay buffer is off or empty and tells nothing.
        None if older == Some(true) => Anchored::Other,
        None => Anchored::Silent,
        Some((s, p)) if *s == last && xxh3_64(p) == digest => {
            replies.remove(0);
            Anchored::Same(replies)
        }
        Some((s, _)) if *s <= last => Anchored::Other,
        Some(_) => Anchored::Unverifiable,
    }
}

/// A verified anchor from a replay that ended without its end marker is [`Anchored::Cut`].
pub(super) fn cut(a: Anchored) -> Anchored {
    match a {
        Anchored::Same(r) => Anchored::Cut(r),
        other => other,
    }
}

/// How many replies continue contiguously from `next`.
pub(super) fn contiguous_len(next: u64, replies: &[(u64, Vec<u8>)]) -> usize {
    replies
        .iter()
        .enumerate()
        .take_while(|(i, (s, _))| next.checked_add(*i as u64) == Some(*s))
        .count()
}

/// Why a replay request failed.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// The replay socket could not be reached.
    #[error("connect: {0}")]
    Connect(String),
    /// Sending the request or receiving a reply failed.
    #[error("socket: {0}")]
    Socket(String),
    /// No reply (or no end marker) within the timeout.
    #[error("timed out waiting for replies")]
    Timeout,
    /// Replies came, then none (and no end marker) within the timeout: what was received,
    /// seqs ascending (vLLM < 0.33 drops replies, the end marker included, past its ROUTER's
    /// send high-water mark).
    #[error("timed out after {} replies without the end marker", .0.len())]
    Unterminated(Vec<(u64, Vec<u8>)>),
    /// A reply had fewer than 2 frames or a seq frame that is not 8 bytes.
    #[error("malformed reply")]
    BadReply,
    /// More batches than [`SubscriberOptions::replay_max_batches`].
    #[error("more than {0} batches")]
    TooMany(usize),
    /// More payload bytes than [`SubscriberOptions::replay_max_bytes`].
    #[error("more than {0} bytes of batches")]
    TooLarge(usize),
    /// The replay socket's peer broke the ZMTP limits and was dropped ([`zmtp_guard`]).
    #[error("connection dropped: {0}")]
    PeerDropped(Dropped),
    /// The engine's replies carry a topic the subscription's prefix does not match: its live
    /// messages never pass this SUB socket's filter.
    #[error("the engine publishes under topic {engine:?}, which the subscription to {subscribed:?} filters out")]
    TopicMismatch {
        /// The topic of the engine's replies.
        engine: String,
        /// The topic prefix subscribed to.
        subscribed: String,
    },
}

/// Requests a replay from `start` on a fresh DEALER connected to `endpoint` (through the guard,
/// [`zmtp_guard`], at [`SubscriberOptions::max_message_bytes`]) and collects
/// `(seq, payload)` pairs up to the end marker. Replies at or past `upto` are not needed, so
/// collection stops at the first one (the engine keeps sending; the socket is then closed).
/// Replies that carry a topic (vLLM ≥ 0.26, SGLang ≥ 0.5.22: `["", topic, seq, payload]`) must
/// start with `topic`, the live subscription's prefix: otherwise the live messages are being
/// filtered out, and the replay is refused with [`ReplayError::TopicMismatch`]. At most
/// [`SubscriberOptions::replay_max_batches`] batches and
/// [`SubscriberOptions::replay_max_bytes`] payload bytes are collected.
///
/// # Errors
/// [`ReplayError`]; [`ReplayError::PeerDropped`] when the endpoint sent a frame or message over
/// the limit (or not ZMTP at all).
pub async fn request_replay(
    endpoint: &str,
    start: u64,
    upto: u64,
    topic: &str,
    opts: &SubscriberOptions,
) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
    let dropped = Arc::new(Mutex::new(None::<Dropped>));
    let wake = Arc::new(Notify::new());
    let on_drop: OnDrop = {
        let (dropped, wake) = (dropped.clone(), wake.clone());
        Arc::new(move |d| {
            *dropped.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
            wake.notify_one();
        })
    };
    let guarded = zmtp_guard::connect(
        endpoint,
        limits(opts),
        opts.replay_timeout + Duration::from_millis(500),
        on_drop,
    )
    .await
    .map_err(ReplayError::Connect)?;
    let peer_dropped = || {
        dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(ReplayError::PeerDropped)
    };
    let mut zopts = SocketOptions::default();
    zopts.connect_timeout(opts.replay_timeout);
    let mut sock = DealerSocket::with_options(zopts);
    match tokio::time::timeout(
        opts.replay_timeout + Duration::from_millis(500),
        sock.connect(guarded.endpoint()),
    )
    .await
    {
        Ok(Ok(())) => {}
        // The guard may have dropped the peer during the handshake.
        Ok(Err(e)) => return Err(peer_dropped().unwrap_or(ReplayError::Connect(e.to_string()))),
        Err(_) => return Err(peer_dropped().unwrap_or(ReplayError::Connect("timed out".into()))),
    }
    let mut req = ZmqMessage::from(Vec::<u8>::new());
    req.push_back(start.to_be_bytes().to_vec().into());
    sock.send(req)
        .await
        .map_err(|e| ReplayError::Socket(e.to_string()))?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    let deadline = tokio::time::Instant::now() + opts.replay_deadline;
    loop {
        let wait = (tokio::time::Instant::now() + opts.replay_timeout).min(deadline);
        let msg = tokio::select! {
            m = tokio::time::timeout_at(wait, sock.recv()) => m,
            () = wake.notified() => {
                return Err(peer_dropped().unwrap_or(ReplayError::Timeout));
            }
        };
        let msg = match msg {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(peer_dropped().unwrap_or(ReplayError::Socket(e.to_string()))),
            Err(_) => {
                return Err(peer_dropped().unwrap_or(if out.is_empty() {
                    ReplayError::Timeout
                } else {
                    ReplayError::Unterminated(out)
                }))
            }
        };
        let frames = msg.into_vec();
        let n = frames.len();
        if n < 2 {
            return Err(ReplayError::BadReply);
        }
        let seq: [u8; 8] = frames[n - 2]
            .as_ref()
            .try_into()
            .map_err(|_| ReplayError::BadReply)?;
        let seq = u64::from_be_bytes(seq);
        if seq == u64::MAX {
            break;
        }
        if n >= 4 && !frames[n - 3].starts_with(topic.as_bytes()) {
            return Err(ReplayError::TopicMismatch {
                engine: String::from_utf8_lossy(&frames[n - 3]).into_owned(),
                subscribed: topic.to_string(),
            });
        }
        bytes = bytes.saturating_add(frames[n - 1].len());
        if bytes > opts.replay_max_bytes {
            return Err(ReplayError::TooLarge(opts.replay_max_bytes));
        }
        out.push((seq, frames[n - 1].to_vec()));
        if seq.saturating_add(1) >= upto {
            break;
        }
        if out.len() > opts.replay_max_batches {
            return Err(ReplayError::TooMany(opts.replay_max_batches));
        }
    }
    Ok(out)
}
