//! `ic-agent kv tail`: follow one engine KV-event publisher and print what arrives, decoded —
//! sequence numbers, gaps, restarts, and (with a replay endpoint) what replay brings back.
//!
//! ```text
//! ic-agent kv tail --endpoint tcp://10.0.0.7:5557 [--replay tcp://10.0.0.7:5558] [--topic T]
//!     [--json] [--count N] [--from-seq S] [--save dump.zmtp]
//! ```
//!
//! Text output, one block per batch:
//!
//! ```text
//! live   seq=3 topic="kv@pod-a" ts=1780000000.004 dp=0 events=1
//!        BlockRemoved hashes=[17114257566480914271] medium=GPU
//! GAP    seq 4..5 missing (got 6)
//! replay seq=4 …
//! ```
//!
//! With `--json`, one JSON object per line: batches as [`message_json`] prints them plus
//! `"source": "live" | "replay"`, and notices `{"notice": "gap" | "restart" | "replay", …}`.
//! `--save FILE` also writes every live message in ZMTP framing, which `ic-agent kv decode FILE`
//! reads back.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ic_shared::kv::decode::{decode_batch, KvEvent};
use serde_json::{json, Value};
use thiserror::Error;
use zeromq::{Socket, SocketOptions, SocketRecv, SubSocket};

use super::inspect::{message_json, topic_text, write_zmtp, RawMessage};
use super::subscriber::replay::request_replay;
use super::subscriber::SubscriberOptions;
use super::zmtp_guard::{self, Dropped, OnDrop, ZmtpLimits};

/// What to follow and how to print it.
#[derive(Debug, Clone)]
pub struct TailOptions {
    /// PUB endpoint to connect to.
    pub endpoint: String,
    /// Replay ROUTER endpoint; gaps are replayed from it.
    pub replay: Option<String>,
    /// Topic prefix filter (empty = everything).
    pub topic: String,
    /// One JSON object per line instead of text.
    pub json: bool,
    /// Stop after this many live messages.
    pub count: Option<u64>,
    /// Before following, replay from this seq (needs `replay`).
    pub from_seq: Option<u64>,
    /// Limit of the connect and of each replay reply.
    pub timeout: Duration,
}

impl TailOptions {
    /// Defaults for `endpoint`: no replay, no topic filter, text, forever, 3 s timeouts.
    pub fn new(endpoint: impl Into<String>) -> Self {
        TailOptions {
            endpoint: endpoint.into(),
            replay: None,
            topic: String::new(),
            json: false,
            count: None,
            from_seq: None,
            timeout: Duration::from_secs(3),
        }
    }
}

/// What a tail saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TailSummary {
    /// Live messages received.
    pub live: u64,
    /// Batches printed from replay.
    pub replayed: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Gaps replay filled completely.
    pub healed: u64,
    /// Sequence restarts seen (engine restarted).
    pub restarts: u64,
}

/// Why tailing stopped.
#[derive(Debug, Error)]
pub enum TailError {
    /// The publisher could not be reached.
    #[error("connect {endpoint}: {message}")]
    Connect {
        /// Endpoint.
        endpoint: String,
        /// Error.
        message: String,
    },
    /// Receiving failed.
    #[error("receive: {0}")]
    Recv(String),
    /// The publisher broke the ZMTP frame or message limits and was dropped
    /// ([`super::zmtp_guard`]).
    #[error("publisher {endpoint}: connection dropped: {dropped}")]
    PeerDropped {
        /// Endpoint.
        endpoint: String,
        /// What it announced.
        dropped: Dropped,
    },
    /// Writing the output failed.
    #[error("output: {0}")]
    Output(#[from] std::io::Error),
}

/// Something worth printing besides a batch.
enum Notice {
    Gap {
        from: u64,
        to: u64,
        got: u64,
    },
    Restart {
        last: u64,
        got: u64,
    },
    Replay {
        from: u64,
        upto: u64,
        got: usize,
        complete: bool,
        error: Option<String>,
    },
}

struct Printer<'w, W: Write> {
    out: &'w mut W,
    json: bool,
}

impl<W: Write> Printer<'_, W> {
    fn line(&mut self, v: &Value) -> std::io::Result<()> {
        writeln!(self.out, "{v}")
    }

    fn batch(&mut self, source: &str, m: &RawMessage) -> std::io::Result<()> {
        if self.json {
            let mut v = message_json(m);
            if let Some(o) = v.as_object_mut() {
                o.insert("source".into(), json!(source));
            }
            return self.line(&v);
        }
        let seq = m.seq.map(|s| s.to_string()).unwrap_or_else(|| "?".into());
        let topic = m.topic.as_deref().map(topic_text).unwrap_or_default();
        match decode_batch(&m.payload) {
            Err(e) => writeln!(
                self.out,
                "{source:<6} seq={seq} topic={topic:?} UNDECODABLE ({}): {e}",
                e.reason()
            ),
            Ok(b) => {
                let dp = b
                    .data_parallel_rank
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| "-".into());
                writeln!(
                    self.out,
                    "{source:<6} seq={seq} topic={topic:?} ts={:.3} dp={dp} events={}{}",
                    b.ts,
                    b.events.len(),
                    if b.skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" skipped={}", b.skipped.len())
                    }
                )?;
                for e in &b.events {
                    writeln!(self.out, "       {}", event_line(e))?;
                }
                for s in &b.skipped {
                    writeln!(
                        self.out,
                        "       SKIPPED event #{} ({}): {}",
                        s.index,
                        s.error.reason(),
                        s.error
                    )?;
                }
                Ok(())
            }
        }
    }

    fn notice(&mut self, n: &Notice) -> std::io::Result<()> {
        if self.json {
            let v = match n {
                Notice::Gap { from, to, got } => {
                    json!({"notice": "gap", "missingFrom": from, "missingTo": to, "got": got})
                }
                Notice::Restart { last, got } => {
                    json!({"notice": "restart", "lastSeq": last, "got": got})
                }
                Notice::Replay {
                    from,
                    upto,
                    got,
                    complete,
                    error,
                } => json!({"notice": "replay", "from": from,
                            "upto": (*upto != u64::MAX).then_some(*upto), "batches": got,
                            "complete": complete, "error": error}),
            };
            return self.line(&v);
        }
        match n {
            Notice::Gap { from, to, got } => {
                writeln!(self.out, "GAP    seq {from}..{to} missing (got {got})")
            }
            Notice::Restart { last, got } => writeln!(
                self.out,
                "RESTART seq went back from {last} to {got}: the engine restarted with an empty cache"
            ),
            Notice::Replay {
                from,
                upto,
                got,
                complete,
                error,
            } => match error {
                Some(e) => writeln!(self.out, "REPLAY from {from} failed: {e}"),
                None if *upto == u64::MAX => writeln!(
                    self.out,
                    "REPLAY from {from}: {got} batches (everything the engine still buffers)"
                ),
                None => writeln!(
                    self.out,
                    "REPLAY {from}..{upto}: {got} batches, {}",
                    if *complete {
                        "complete"
                    } else {
                        "NOT contiguous (an agent would resync the replica)"
                    }
                ),
            },
        }
    }
}

fn event_line(e: &KvEvent) -> String {
    match e {
        KvEvent::BlockStored(s) => {
            let mut line = format!(
                "BlockStored hashes={:?} parent={} tokens={} block_size={}",
                s.block_hashes,
                s.parent_block_hash
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "none".into()),
                s.token_ids.len(),
                s.block_size
            );
            for (k, v) in [
                ("medium", s.medium.clone()),
                ("lora", s.lora_name.clone()),
                ("group", s.group_idx.map(|g| g.to_string())),
                ("kind", s.kv_cache_spec_kind.clone()),
            ] {
                if let Some(v) = v {
                    line.push_str(&format!(" {k}={v}"));
                }
            }
            line
        }
        KvEvent::BlockRemoved(r) => {
            let mut line = format!("BlockRemoved hashes={:?}", r.block_hashes);
            if let Some(m) = &r.medium {
                line.push_str(&format!(" medium={m}"));
            }
            if let Some(g) = r.group_idx {
                line.push_str(&format!(" group={g}"));
            }
            line
        }
        KvEvent::AllBlocksCleared { medium: None } => "AllBlocksCleared".to_string(),
        KvEvent::AllBlocksCleared { medium: Some(m) } => format!("AllBlocksCleared medium={m}"),
    }
}

/// Connects and prints until `count` live messages arrived (or forever), writing the raw
/// messages to `save` when given.
///
/// # Errors
/// [`TailError`] when the publisher cannot be reached, receiving fails, or output fails.
pub async fn tail<W: Write, S: Write>(
    opts: &TailOptions,
    out: &mut W,
    mut save: Option<&mut S>,
) -> Result<TailSummary, TailError> {
    // A fresh socket per attempt, retried until the timeout: the publisher may not be
    // listening yet.
    // The publisher's bytes reach the socket through the guard (frames and messages at most
    // the hard cap); a peer it drops ends the tail.
    let started = std::time::Instant::now();
    let dropped = Arc::new(Mutex::new(None::<Dropped>));
    let wake = Arc::new(tokio::sync::Notify::new());
    let on_drop: OnDrop = {
        let (dropped, wake) = (dropped.clone(), wake.clone());
        Arc::new(move |d| {
            *dropped.lock().unwrap_or_else(|p| p.into_inner()) = Some(d);
            wake.notify_one();
        })
    };
    let (mut sock, _relay) = loop {
        let message = match zmtp_guard::connect(
            &opts.endpoint,
            ZmtpLimits::default(),
            opts.timeout,
            on_drop.clone(),
        )
        .await
        {
            Err(e) => e,
            Ok(relay) => {
                let mut zopts = SocketOptions::default();
                zopts.connect_timeout(opts.timeout);
                let mut sock = SubSocket::with_options(zopts);
                match sock.subscribe(&opts.topic).await {
                    Err(e) => e.to_string(),
                    Ok(()) => {
                        match tokio::time::timeout(opts.timeout, sock.connect(relay.endpoint()))
                            .await
                        {
                            Ok(Ok(())) => break (sock, relay),
                            Ok(Err(e)) => e.to_string(),
                            Err(_) => "timed out".to_string(),
                        }
                    }
                }
            }
        };
        // The guard may have dropped the publisher during the handshake.
        if let Some(d) = *dropped.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(TailError::PeerDropped {
                endpoint: opts.endpoint.clone(),
                dropped: d,
            });
        }
        if started.elapsed() >= opts.timeout {
            return Err(TailError::Connect {
                endpoint: opts.endpoint.clone(),
                message,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let ropts = SubscriberOptions {
        replay_timeout: opts.timeout,
        ..SubscriberOptions::default()
    };
    let mut p = Printer {
        out,
        json: opts.json,
    };
    let mut summary = TailSummary::default();
    let mut last: Option<u64> = None;
    if let (Some(from), Some(ep)) = (opts.from_seq, opts.replay.as_deref()) {
        last = replay(&mut p, ep, from, u64::MAX, &ropts, &mut summary)
            .await?
            .or(last);
    }
    while opts.count.is_none_or(|c| summary.live < c) {
        let msg = tokio::select! {
            m = sock.recv() => m.map_err(|e| TailError::Recv(e.to_string()))?,
            () = wake.notified() => {
                let d = *dropped.lock().unwrap_or_else(|p| p.into_inner());
                return Err(match d {
                    Some(dropped) => TailError::PeerDropped {
                        endpoint: opts.endpoint.clone(),
                        dropped,
                    },
                    None => TailError::Recv("the publisher's connection was dropped".into()),
                });
            }
        };
        let frames: Vec<Vec<u8>> = msg.into_vec().into_iter().map(|f| f.to_vec()).collect();
        if let Some(s) = save.as_deref_mut() {
            let mut buf = Vec::new();
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            write_zmtp(&mut buf, &refs);
            s.write_all(&buf)?;
            s.flush()?;
        }
        summary.live += 1;
        let Some(m) = RawMessage::from_frames(summary.live as usize, frames) else {
            continue;
        };
        if let Some(seq) = m.seq {
            match last {
                Some(l) if seq <= l => {
                    summary.restarts += 1;
                    p.notice(&Notice::Restart { last: l, got: seq })?;
                }
                Some(l) if seq > l.saturating_add(1) => {
                    summary.gaps += 1;
                    p.notice(&Notice::Gap {
                        from: l + 1,
                        to: seq - 1,
                        got: seq,
                    })?;
                    if let Some(ep) = opts.replay.as_deref() {
                        replay(&mut p, ep, l + 1, seq, &ropts, &mut summary).await?;
                    }
                }
                _ => {}
            }
            last = Some(seq);
        }
        p.batch("live", &m)?;
        p.out.flush()?;
    }
    Ok(summary)
}

/// Replays `[from, upto)`, prints the batches and a summary notice; returns the last seq
/// printed.
async fn replay<W: Write>(
    p: &mut Printer<'_, W>,
    ep: &str,
    from: u64,
    upto: u64,
    ropts: &SubscriberOptions,
    summary: &mut TailSummary,
) -> Result<Option<u64>, TailError> {
    // The tool shows what the engine sends, whatever its topic.
    let result = request_replay(ep, from, upto, "", ropts).await;
    match result {
        Err(e) => {
            p.notice(&Notice::Replay {
                from,
                upto,
                got: 0,
                complete: false,
                error: Some(e.to_string()),
            })?;
            Ok(None)
        }
        Ok(batches) => {
            let mut expected = from;
            let mut last = None;
            for (seq, payload) in &batches {
                if *seq == expected {
                    expected += 1;
                }
                summary.replayed += 1;
                last = Some(*seq);
                p.batch(
                    "replay",
                    &RawMessage {
                        position: 0,
                        topic: None,
                        seq: Some(*seq),
                        payload: payload.clone(),
                    },
                )?;
            }
            let complete = upto == u64::MAX || expected == upto;
            if complete && upto != u64::MAX {
                summary.healed += 1;
            }
            p.notice(&Notice::Replay {
                from,
                upto,
                got: batches.len(),
                complete,
                error: None,
            })?;
            Ok(last)
        }
    }
}
