//! `ic-agent kv decode`: engine KV-event frames from a file or stdin, decoded to JSON.
//!
//! Accepted input (detected from the first non-blank byte):
//!
//! - **hex text**, one message per line, frames separated by spaces or tabs, e.g. what a
//!   capture tool or `kv tail --hex` prints: `6b76 0000000000000007 93cb41…`. With one frame the
//!   line is a payload; with more, the last frame is the payload, the one before it the 8-byte
//!   big-endian seq and the one before that the topic (so live `[topic, seq, payload]` and
//!   replay replies `["", topic, seq, payload]` both read right; an empty frame may be written
//!   `-` or `""`). Blank lines and lines starting with `#` are skipped.
//! - **JSON lines**: a JSON array of hex strings per line (the fixtures' `frames_hex`), or a whole
//!   fixture file (`{"live": [...], "replay": [...]}`: every live message, then every reply).
//! - **raw multipart dumps**: ZMTP 3 framing (`flags`, 1- or 8-byte size, body; the MORE flag
//!   joins frames into a message), with or without the 64-byte greeting — a TCP stream captured
//!   off the wire, or what `kv tail --save FILE` writes. Command frames (READY, SUBSCRIBE) are
//!   skipped.
//! - **a raw msgpack payload** (one batch, no framing).
//!
//! Each message becomes one JSON object (see [`message_json`]): the batch as the engine's own
//! types would serialise it (`ts`, `events` with every field, `data_parallel_rank`), plus `seq`,
//! `topic`, and `skipped` events with their reasons — or `error`/`reason` when the payload does
//! not decode, or `endMarker: true` for a replay end marker.

use ic_shared::kv::decode::{decode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent};
use serde_json::{json, Map, Value};
use thiserror::Error;

/// One message read from the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// 1-based line (text input) or message number (binary input), for error messages.
    pub position: usize,
    /// Topic frame, when the message had one.
    pub topic: Option<Vec<u8>>,
    /// Engine sequence number, when the message had an 8-byte seq frame.
    pub seq: Option<u64>,
    /// msgpack payload (the last frame).
    pub payload: Vec<u8>,
}

impl RawMessage {
    /// Builds a message from its frames (see the module docs for which frame is which).
    pub fn from_frames(position: usize, mut frames: Vec<Vec<u8>>) -> Option<Self> {
        let payload = frames.pop()?;
        let mut seq = None;
        if let Some(s) = frames.last() {
            if let Ok(b) = <[u8; 8]>::try_from(s.as_slice()) {
                seq = Some(u64::from_be_bytes(b));
                frames.pop();
            }
        }
        // A DEALER's replay replies start with an empty delimiter: skip it when a topic follows.
        let topic = if seq.is_some() { frames.pop() } else { None };
        Some(RawMessage {
            position,
            topic,
            seq,
            payload,
        })
    }

    /// True for a replay end marker (seq of all `0xFF` bytes, empty payload).
    pub fn is_end_marker(&self) -> bool {
        self.seq == Some(u64::MAX) && self.payload.is_empty()
    }
}

/// Why the input could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum InputError {
    /// A text line has a frame that is not hex.
    #[error("line {line}: frame {frame} is not hex: {message}")]
    BadHex {
        /// 1-based line.
        line: usize,
        /// 1-based frame within the line.
        frame: usize,
        /// Decoder message.
        message: String,
    },
    /// A JSON line or document is malformed or has the wrong shape.
    #[error("line {line}: {message}")]
    BadJson {
        /// 1-based line (1 for a whole document).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A binary dump is cut short or has reserved flag bits set.
    #[error("ZMTP dump: {0}")]
    BadDump(String),
}

/// Parses the input (see the module docs for the formats).
///
/// # Errors
/// [`InputError`] naming the line or offset that could not be read.
pub fn parse_input(bytes: &[u8]) -> Result<Vec<RawMessage>, InputError> {
    let first = bytes.iter().copied().find(|b| !b.is_ascii_whitespace());
    let Some(first) = first else {
        return Ok(Vec::new());
    };
    let texty = first.is_ascii_hexdigit() || matches!(first, b'[' | b'{' | b'#' | b'-' | b'"');
    if texty {
        if let Ok(text) = std::str::from_utf8(bytes) {
            return parse_text(text);
        }
    }
    if first == 0xFF || first & 0xF8 == 0 {
        return parse_zmtp(bytes);
    }
    // Neither text nor ZMTP: one raw payload.
    Ok(vec![RawMessage {
        position: 1,
        topic: None,
        seq: None,
        payload: bytes.to_vec(),
    }])
}

fn parse_text(text: &str) -> Result<Vec<RawMessage>, InputError> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        return parse_fixture(trimmed);
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let frames = if line.starts_with('[') {
            let hexes: Vec<String> =
                serde_json::from_str(line).map_err(|e| InputError::BadJson {
                    line: line_no,
                    message: e.to_string(),
                })?;
            hexes
                .iter()
                .enumerate()
                .map(|(f, h)| unhex(h, line_no, f + 1))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            line.split_whitespace()
                .enumerate()
                .map(|(f, h)| {
                    let h = if h == "-" || h == "\"\"" { "" } else { h };
                    unhex(h, line_no, f + 1)
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        if let Some(m) = RawMessage::from_frames(line_no, frames) {
            out.push(m);
        }
    }
    Ok(out)
}

fn unhex(h: &str, line: usize, frame: usize) -> Result<Vec<u8>, InputError> {
    hex::decode(h.trim_start_matches("0x")).map_err(|e| InputError::BadHex {
        line,
        frame,
        message: e.to_string(),
    })
}

fn parse_fixture(text: &str) -> Result<Vec<RawMessage>, InputError> {
    let doc: Value = serde_json::from_str(text).map_err(|e| InputError::BadJson {
        line: 1,
        message: e.to_string(),
    })?;
    if !["live", "replay"]
        .iter()
        .any(|k| doc.get(*k).is_some_and(Value::is_array))
    {
        return Err(InputError::BadJson {
            line: 1,
            message: "a JSON document must be a frame recording with a live[] or replay[] array \
                      of {\"frames_hex\": [...]} (testdata/kv-events format)"
                .to_string(),
        });
    }
    let mut out = Vec::new();
    for section in ["live", "replay"] {
        let Some(items) = doc.get(section).and_then(Value::as_array) else {
            continue;
        };
        for (i, item) in items.iter().enumerate() {
            let bad = |message: &str| InputError::BadJson {
                line: 1,
                message: format!("{section}[{i}]: {message}"),
            };
            let hexes = item
                .get("frames_hex")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no frames_hex array"))?;
            let mut frames = Vec::with_capacity(hexes.len());
            for (f, h) in hexes.iter().enumerate() {
                let h = h.as_str().ok_or_else(|| bad("frame is not a string"))?;
                frames.push(unhex(h, 1, f + 1)?);
            }
            if let Some(m) = RawMessage::from_frames(out.len() + 1, frames) {
                out.push(m);
            }
        }
    }
    Ok(out)
}

/// ZMTP frame flags.
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

fn parse_zmtp(bytes: &[u8]) -> Result<Vec<RawMessage>, InputError> {
    let mut pos = 0usize;
    // Greeting: 0xFF, 8 bytes padding, 0x7F, then 54 more bytes (version, mechanism, filler).
    if bytes.first() == Some(&0xFF) {
        if bytes.len() >= 64 && bytes.get(9) == Some(&0x7F) {
            pos = 64;
        } else {
            return Err(InputError::BadDump("truncated ZMTP greeting".into()));
        }
    }
    let mut out = Vec::new();
    let mut frames: Vec<Vec<u8>> = Vec::new();
    while pos < bytes.len() {
        let flags = bytes[pos];
        if flags & 0xF8 != 0 {
            return Err(InputError::BadDump(format!(
                "reserved flag bits set at offset {pos} (0x{flags:02x})"
            )));
        }
        pos += 1;
        let size = if flags & LONG != 0 {
            let b: [u8; 8] = bytes
                .get(pos..pos + 8)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| InputError::BadDump(format!("size cut short at offset {pos}")))?;
            pos += 8;
            u64::from_be_bytes(b)
        } else {
            let b = *bytes
                .get(pos)
                .ok_or_else(|| InputError::BadDump(format!("size cut short at offset {pos}")))?;
            pos += 1;
            u64::from(b)
        };
        let end = usize::try_from(size)
            .ok()
            .and_then(|s| pos.checked_add(s))
            .filter(|e| *e <= bytes.len())
            .ok_or_else(|| {
                InputError::BadDump(format!(
                    "frame of {size} bytes at offset {pos} runs past the end ({} bytes)",
                    bytes.len()
                ))
            })?;
        let body = bytes[pos..end].to_vec();
        pos = end;
        if flags & COMMAND != 0 {
            continue;
        }
        frames.push(body);
        if flags & MORE == 0 {
            if let Some(m) = RawMessage::from_frames(out.len() + 1, std::mem::take(&mut frames)) {
                out.push(m);
            }
        }
    }
    if !frames.is_empty() {
        return Err(InputError::BadDump(
            "the last message is cut short (its final frame has the MORE flag)".into(),
        ));
    }
    Ok(out)
}

/// Writes one message's frames in ZMTP 3 framing (what [`parse_input`] reads back as a raw
/// multipart dump).
pub fn write_zmtp(out: &mut Vec<u8>, frames: &[&[u8]]) {
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        if f.len() > 255 {
            out.push(more | LONG);
            out.extend_from_slice(&(f.len() as u64).to_be_bytes());
        } else {
            out.push(more);
            out.push(f.len() as u8);
        }
        out.extend_from_slice(f);
    }
}

fn rmpv_json(v: &rmpv::Value) -> Value {
    match v {
        rmpv::Value::Nil => Value::Null,
        rmpv::Value::Boolean(b) => Value::Bool(*b),
        rmpv::Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Value::from(u),
            (None, Some(s)) => Value::from(s),
            _ => Value::Null,
        },
        rmpv::Value::F32(f) => Value::from(f64::from(*f)),
        rmpv::Value::F64(f) => Value::from(*f),
        rmpv::Value::String(s) => match s.as_str() {
            Some(s) => Value::from(s),
            None => Value::from(hex::encode(s.as_bytes())),
        },
        rmpv::Value::Binary(b) => Value::from(hex::encode(b)),
        rmpv::Value::Array(a) => Value::Array(a.iter().map(rmpv_json).collect()),
        rmpv::Value::Map(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = match k.as_str() {
                        Some(s) => s.to_string(),
                        None => k.to_string(),
                    };
                    (key, rmpv_json(v))
                })
                .collect(),
        ),
        rmpv::Value::Ext(t, b) => json!({ "ext": t, "data": hex::encode(b) }),
    }
}

fn stored_json(s: &BlockStored) -> Value {
    json!({
        "type": "BlockStored",
        "block_hashes": s.block_hashes,
        "parent_block_hash": s.parent_block_hash,
        "token_ids": s.token_ids,
        "block_size": s.block_size,
        "lora_id": s.lora_id,
        "medium": s.medium,
        "lora_name": s.lora_name,
        "extra_keys": s.extra_keys.as_ref().map(rmpv_json),
        "group_idx": s.group_idx,
        "kv_cache_spec_kind": s.kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
        "locality": s.locality,
        "ownership": s.ownership,
        "session_id": s.session_id,
        "lookahead_token_ids": s.lookahead_token_ids,
    })
}

fn removed_json(r: &BlockRemoved) -> Value {
    json!({
        "type": "BlockRemoved",
        "block_hashes": r.block_hashes,
        "medium": r.medium,
        "group_idx": r.group_idx,
        "locality": r.locality,
        "ownership": r.ownership,
    })
}

/// One event as JSON: `type` and every field of the newest release (absent ones `null`).
/// Hashes are the u64 values the decoder reduced them to (bin digests: last 8 bytes).
pub fn event_json(e: &KvEvent) -> Value {
    match e {
        KvEvent::BlockStored(s) => stored_json(s),
        KvEvent::BlockRemoved(r) => removed_json(r),
        KvEvent::AllBlocksCleared { medium: None } => json!({ "type": "AllBlocksCleared" }),
        KvEvent::AllBlocksCleared { medium: Some(m) } => {
            json!({ "type": "AllBlocksCleared", "medium": m })
        }
    }
}

/// One decoded batch as JSON (`ts`, `events`, `data_parallel_rank`, `skipped`).
pub fn batch_json(b: &EventBatch) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("ts".into(), json!(b.ts));
    m.insert(
        "events".into(),
        Value::Array(b.events.iter().map(event_json).collect()),
    );
    m.insert("data_parallel_rank".into(), json!(b.data_parallel_rank));
    m.insert(
        "skipped".into(),
        Value::Array(
            b.skipped
                .iter()
                .map(|s| json!({ "index": s.index, "reason": s.error.reason(), "error": s.error.to_string() }))
                .collect(),
        ),
    );
    m
}

/// Topic bytes as text (lossy UTF-8).
pub fn topic_text(t: &[u8]) -> String {
    String::from_utf8_lossy(t).into_owned()
}

/// One message as JSON: `seq` and `topic` (when present), then the decoded batch
/// ([`batch_json`]), or `error` + `reason` ([`DecodeError::reason`]) when the payload does not
/// decode, or `endMarker: true`.
///
/// [`DecodeError::reason`]: ic_shared::kv::decode::DecodeError::reason
pub fn message_json(m: &RawMessage) -> Value {
    let mut out = Map::new();
    if let Some(s) = m.seq {
        out.insert("seq".into(), json!(s));
    }
    if let Some(t) = &m.topic {
        out.insert("topic".into(), json!(topic_text(t)));
    }
    if m.is_end_marker() {
        out.insert("endMarker".into(), json!(true));
        return Value::Object(out);
    }
    match decode_batch(&m.payload) {
        Ok(b) => out.extend(batch_json(&b)),
        Err(e) => {
            out.insert("error".into(), json!(e.to_string()));
            out.insert("reason".into(), json!(e.reason()));
        }
    }
    Value::Object(out)
}

/// Block events (hashes stored or removed, one per block; `AllBlocksCleared` counts one) in a
/// decoded batch — the unit of the decode benchmark.
pub fn block_events(b: &EventBatch) -> usize {
    b.events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len(),
            KvEvent::BlockRemoved(r) => r.block_hashes.len(),
            KvEvent::AllBlocksCleared { .. } => 1,
        })
        .sum()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    const PAYLOAD: &str = "92cb3ff8000000000000910a"; // [1.5, [10]] : one bad event

    #[test]
    fn json_that_is_not_a_frame_recording_is_an_error_not_an_empty_result() {
        for doc in [r#"{"kind": "Pod"}"#, r#"{"live": "nope"}"#, r#"{}"#] {
            assert!(
                matches!(parse_input(doc.as_bytes()), Err(InputError::BadJson { .. })),
                "{doc}"
            );
        }
        assert!(parse_input(br#"{"live": []}"#).unwrap().is_empty());
    }

    #[test]
    fn text_lines_take_payload_seq_and_topic_from_the_end() {
        let text = format!(
            "# comment\n\n{PAYLOAD}\n6b76 0000000000000007 {PAYLOAD}\n- 6b76 0000000000000008 {PAYLOAD}\n[\"\", \"ffffffffffffffff\", \"\"]\n"
        );
        let msgs = parse_input(text.as_bytes()).unwrap();
        assert_eq!(msgs.len(), 4);
        assert_eq!((msgs[0].seq, msgs[0].topic.clone()), (None, None));
        assert_eq!(msgs[1].seq, Some(7));
        assert_eq!(msgs[1].topic.as_deref(), Some(&b"kv"[..]));
        assert_eq!(msgs[2].seq, Some(8));
        assert_eq!(msgs[2].topic.as_deref(), Some(&b"kv"[..]));
        assert!(msgs[3].is_end_marker());
        let j = message_json(&msgs[1]);
        assert_eq!(j["seq"], 7);
        assert_eq!(j["topic"], "kv");
        assert_eq!(j["ts"], 1.5);
        assert_eq!(j["skipped"][0]["reason"], "bad_event");
        assert_eq!(message_json(&msgs[3])["endMarker"], true);
        let err = parse_input(b"6b76 zz 00").unwrap_err();
        assert!(matches!(
            err,
            InputError::BadHex {
                line: 1,
                frame: 2,
                ..
            }
        ));
    }

    #[test]
    fn zmtp_dumps_round_trip_with_and_without_greeting() {
        let payload = hex::decode(PAYLOAD).unwrap();
        let big = vec![0x90u8; 300];
        let mut dump = Vec::new();
        write_zmtp(&mut dump, &[b"kv", &5u64.to_be_bytes(), &payload]);
        write_zmtp(&mut dump, &[b"", &6u64.to_be_bytes(), &big]);
        let msgs = parse_input(&dump).unwrap();
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].seq, Some(5));
        assert_eq!(msgs[0].payload, payload);
        assert_eq!(msgs[1].payload.len(), 300);
        // With a greeting and a command frame (READY) in front.
        let mut wire = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F];
        wire.resize(64, 0);
        wire.extend_from_slice(&[COMMAND, 5, 5, b'R', b'E', b'A', b'D']);
        wire.extend_from_slice(&dump);
        assert_eq!(parse_input(&wire).unwrap(), msgs);
        // Cut short.
        assert!(parse_input(&dump[..dump.len() - 1]).is_err());
        // A bare msgpack payload.
        let raw = parse_input(&payload).unwrap();
        assert_eq!(raw.len(), 1);
        assert_eq!(message_json(&raw[0])["ts"], 1.5);
        // Garbage payload: an error object, not a failure.
        let j = message_json(&RawMessage {
            position: 1,
            topic: None,
            seq: Some(1),
            payload: vec![0xcd, 0x01],
        });
        assert_eq!(j["reason"], "not_msgpack");
    }
}
