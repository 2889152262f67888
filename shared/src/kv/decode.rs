//! Decoding of one engine KV-event batch (the msgpack payload, third frame of a live message).
//!
//! Accepts every shape vLLM 0.9–0.33 and SGLang 0.4.9–0.5.23 have shipped
//! (`docs/kv-event-wire.md`):
//!
//! - batch: a msgpack array `[ts, events, data_parallel_rank]`; 2 elements (vLLM 0.9.0) or more
//!   (elements past the third are ignored). `ts` may be a float or an integer (unix seconds).
//!   A third element that is not a non-negative integer reads as `None`.
//! - event: a tagged array `[tag, field1, field2, …]` (fields positional in declaration order,
//!   extra trailing elements ignored) or a tagged map `{"type": tag, field: value, …}` (any map
//!   header width, key order free, unknown keys ignored). A missing field reads as null.
//! - hash: a u64, an i64 (its two's-complement bits reinterpreted as u64) or a msgpack bin (1–64
//!   bytes; the last 8 bytes, or all of them when shorter, read big-endian — for vLLM's 32-byte
//!   digests this equals the integer vLLM would have sent).
//!
//! # Errors and what is skipped
//!
//! A payload that is not one msgpack value, not an array, too short, or whose `ts`/`events` have
//! the wrong type fails as a whole ([`DecodeError`]). A single event that cannot be decoded —
//! unknown tag, not an array/map, a malformed hash, token id or other identity field — is
//! **skipped** and recorded in [`EventBatch::skipped`] with its error, and the rest of the batch is
//! kept: one future event type or one bad event must not cost the other events of the scheduler
//! step. Callers count skipped events by [`DecodeError::reason`].
//!
//! Optional descriptive fields (`medium`, `lora_name`, `lora_id`, `kv_cache_spec_*`, `locality`,
//! `ownership`, `session_id`, `lookahead_token_ids`) of an unexpected type read as `None` rather
//! than failing: SGLang's `BlockStoredWithMetadata` puts a metadata map where vLLM has
//! `lora_name`. Identity fields (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`,
//! `group_idx`) of the wrong type fail the event.
//!
//! Decoding never panics: nesting is limited to [`MAX_DEPTH`] and all arithmetic is checked.
//!
//! # Implementation
//!
//! [`decode_batch`] reads the msgpack in one streaming pass with `rmp`'s low-level reads,
//! straight into the result (`stream`), without first building an `rmpv::Value` tree. Payloads
//! that pass is not certain about — malformed or truncated msgpack, trailing bytes, nesting deeper
//! than the pass reads itself, whole-batch errors — are decoded again through the `rmpv` tree
//! (the reference implementation of the rules above), so every result and error is the one the
//! tree decoder gives; a property test holds the two paths to that.

use rmpv::Value;
use thiserror::Error;

pub mod sglang;
mod stream;

#[cfg(test)]
mod agreement_tests;

/// Maximum msgpack nesting accepted (rmpv counts two levels per container).
pub const MAX_DEPTH: usize = 64;

/// Field order of `BlockStored` in array-encoded events (vLLM declaration order; SGLang's array
/// layout is a prefix of it, possibly followed by a metadata map).
pub const BLOCK_STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// Field order of `AllBlocksCleared` in array-encoded events: no release in
/// `docs/kv-event-wire.md`'s range sends a field; a `medium` (map key, or the first element after
/// the tag) scopes the clear to one tier (issue 39 item 12).
pub const ALL_BLOCKS_CLEARED_FIELDS: &[&str] = &["medium"];

/// Field order of `BlockRemoved` in array-encoded events.
pub const BLOCK_REMOVED_FIELDS: &[&str] = &[
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// One decoded batch: the events of one engine scheduler step.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock time of the step, unix seconds.
    pub ts: f64,
    /// Decoded events in wire order (skipped events left out).
    pub events: Vec<KvEvent>,
    /// Data-parallel rank the publisher reported (SGLang: `attn_dp_rank`); `None` when absent.
    pub data_parallel_rank: Option<u32>,
    /// Events that could not be decoded, with their position in the wire `events` array.
    pub skipped: Vec<SkippedEvent>,
}

/// An event left out of [`EventBatch::events`].
#[derive(Debug, Clone, PartialEq)]
pub struct SkippedEvent {
    /// Zero-based position in the wire `events` array.
    pub index: usize,
    /// Why it was skipped.
    pub error: DecodeError,
}

/// One engine KV-cache event.
// Events live briefly in one batch's Vec; boxing the common variant would cost an allocation per
// event for no gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// A run of newly full blocks of one request (and one KV-cache group) was cached.
    BlockStored(BlockStored),
    /// Blocks were evicted from a medium.
    BlockRemoved(BlockRemoved),
    /// The engine reset its prefix cache. `medium`: `None` (every release so far) — the cache
    /// the engine's own reset clears; `Some(m)` — only medium `m` (`GPU`, `CPU`, …) was wiped
    /// (a tier-scoped clear; an unexpected type reads as `None`).
    AllBlocksCleared {
        /// The medium wiped, when the event names one.
        medium: Option<String>,
    },
}

impl KvEvent {
    /// The wire tag (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared { .. } => "AllBlocksCleared",
        }
    }
}

/// Fields of a `BlockStored` event. Absent or null fields are `None` / empty.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, first block first (engine-private; never index keys).
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the run; `None` when the run starts at block 0.
    pub parent_block_hash: Option<u64>,
    /// Token ids of the whole run (empty for an offload placeholder).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 for an offload placeholder; SGLang: the partial page's length).
    pub block_size: u32,
    /// LoRA adapter id (deprecated in vLLM in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// Storage medium, e.g. `GPU`, `CPU`, `CPU_PINNED`, `STORAGE` (vLLM ≥ 0.10.2; `None` = GPU).
    pub medium: Option<String>,
    /// LoRA adapter name (vLLM ≥ 0.14).
    pub lora_name: Option<String>,
    /// Per-block extra hash keys (vLLM ≥ 0.17), as sent; `None` when null or absent.
    pub extra_keys: Option<Value>,
    /// KV-cache group index (vLLM ≥ 0.20, hybrid models).
    pub group_idx: Option<u32>,
    /// KV-cache spec kind of the group, e.g. `full_attention`, `sliding_window`, `mamba`.
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window of the group in tokens, when it has one.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// `LOCAL` or `REMOTE` relative to the publisher (vLLM ≥ 0.26).
    pub locality: Option<String>,
    /// Secondary offloading tier identifier (vLLM ≥ 0.29).
    pub ownership: Option<String>,
    /// Session id (vLLM ≥ 0.30).
    pub session_id: Option<String>,
    /// Speculative lookahead token ids (vLLM ≥ 0.33).
    pub lookahead_token_ids: Option<Vec<u32>>,
}

/// Fields of a `BlockRemoved` event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Medium the blocks were removed from (`None` = GPU).
    pub medium: Option<String>,
    /// KV-cache group index.
    pub group_idx: Option<u32>,
    /// `LOCAL` or `REMOTE`.
    pub locality: Option<String>,
    /// Secondary offloading tier identifier.
    pub ownership: Option<String>,
}

/// Why a payload (or one event of it) could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// The bytes are not one well-formed msgpack value (or nest deeper than [`MAX_DEPTH`]).
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(String),
    /// Bytes follow the msgpack value.
    #[error("{0} trailing bytes after the msgpack value")]
    TrailingBytes(usize),
    /// The batch is not a msgpack array.
    #[error("batch is not an array")]
    NotArray,
    /// The batch array has fewer than 2 elements.
    #[error("batch has {0} elements, expected at least 2")]
    ShortBatch(usize),
    /// `ts` is not a number.
    #[error("batch ts is not a number")]
    BadTimestamp,
    /// `events` is not an array.
    #[error("batch events is not an array")]
    BadEvents,
    /// An event is neither a tagged array nor a tagged map, or its tag is missing or not a string.
    #[error("malformed event: {0}")]
    BadEvent(&'static str),
    /// An event's tag is not one we know.
    #[error("unknown event tag {0:?}")]
    UnknownTag(String),
    /// A block hash is not an integer or a 1–64 byte bin.
    #[error("bad block hash in {0}")]
    BadHash(&'static str),
    /// An identity field has the wrong type or range.
    #[error("bad field {0}")]
    BadField(&'static str),
}

impl DecodeError {
    /// Stable, bounded label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::NotMsgpack(_) => "not_msgpack",
            DecodeError::TrailingBytes(_) => "trailing_bytes",
            DecodeError::NotArray => "not_array",
            DecodeError::ShortBatch(_) => "short_batch",
            DecodeError::BadTimestamp => "bad_timestamp",
            DecodeError::BadEvents => "bad_events",
            DecodeError::BadEvent(_) => "bad_event",
            DecodeError::UnknownTag(_) => "unknown_tag",
            DecodeError::BadHash(_) => "bad_hash",
            DecodeError::BadField(_) => "bad_field",
        }
    }

    /// Every label [`reason`](Self::reason) can return.
    pub const REASONS: &'static [&'static str] = &[
        "not_msgpack",
        "trailing_bytes",
        "not_array",
        "short_batch",
        "bad_timestamp",
        "bad_events",
        "bad_event",
        "unknown_tag",
        "bad_hash",
        "bad_field",
    ];
}

/// Decodes one batch payload. See the module documentation for accepted shapes and errors.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if let Some(e) = stream::scalar_payload(payload) {
        return Err(e);
    }
    stream::decode_batch(payload).or_else(|stream::Bail| decode_batch_value(payload))
}

/// An upper bound of the heap bytes [`decode_batch`] may hold at once while it decodes
/// `payload` (bytes), computed in one pass over the payload without allocating: what a caller
/// charges against a memory budget **before** decoding (issue 38, D1).
///
/// A decoded batch is larger than its wire form: a msgpack value of 1 byte becomes a 32-byte
/// `rmpv::Value` in the reference path, and an event of about 25 bytes (SGLang's page-size-1
/// `BlockStored`) a [`KvEvent`] of a few hundred bytes plus its vectors; vectors grow by
/// doubling. The bound is `2 × payload.len()` (strings and bins copied, with growth) plus the
/// larger of the two paths: the reference tree (`2 × values × size_of::<Value>()`) and the typed
/// batch (`2 × events × size_of::<KvEvent>()` plus 16 bytes per value for the event vectors and
/// strings), where `values` counts every msgpack value present and `events` the length the
/// batch's `events` array announces (both limited to what the payload holds). A payload whose
/// top value is a scalar costs nothing: it is refused (`NotArray`) without a copy. Never
/// panics.
pub fn decoded_bytes_bound(payload: &[u8]) -> usize {
    if stream::scalar_payload(payload).is_some() {
        // Refused before anything is copied.
        return 0;
    }
    let (values, events) = stream::shape(payload);
    let values = usize::try_from(values).unwrap_or(usize::MAX);
    let events = usize::try_from(events).unwrap_or(usize::MAX);
    let event_size = std::mem::size_of::<KvEvent>().max(std::mem::size_of::<SkippedEvent>());
    let tree = values.saturating_mul(2 * std::mem::size_of::<Value>());
    let typed = events
        .saturating_mul(2 * event_size)
        .saturating_add(values.saturating_mul(16));
    payload
        .len()
        .saturating_mul(2)
        .saturating_add(tree.max(typed))
}

/// The reference decoder: the whole payload as one `rmpv::Value` tree, then the fields. Decides
/// what the streaming path bails on; its results define [`decode_batch`]'s.
fn decode_batch_value(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let Value::Array(items) = value else {
        return Err(DecodeError::NotArray);
    };
    if items.len() < 2 {
        return Err(DecodeError::ShortBatch(items.len()));
    }
    let ts = match &items[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().ok_or(DecodeError::BadTimestamp)?,
        _ => return Err(DecodeError::BadTimestamp),
    };
    let Value::Array(raw_events) = &items[1] else {
        return Err(DecodeError::BadEvents);
    };
    let data_parallel_rank = items.get(2).and_then(opt_u32_lenient);
    let mut events = Vec::with_capacity(raw_events.len());
    let mut skipped = Vec::new();
    for (index, raw) in raw_events.iter().enumerate() {
        match decode_event(raw) {
            Ok(ev) => events.push(ev),
            Err(error) => skipped.push(SkippedEvent { index, error }),
        }
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
        skipped,
    })
}

/// Field accessor over either event shape.
enum Fields<'a> {
    /// Positional values after the tag, with the tag's field-name order.
    Array(&'a [Value], &'static [&'static str]),
    /// Key/value pairs of a map event.
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// The value of `name`, or `None` when absent (null is returned as `Some(Nil)`).
    fn get(&self, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Array(values, order) => {
                let pos = order.iter().position(|f| *f == name)?;
                values.get(pos)
            }
            // Last occurrence wins, as in msgspec.
            Fields::Map(pairs) => pairs
                .iter()
                .rev()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
        }
    }
}

/// Decodes one event value.
fn decode_event(raw: &Value) -> Result<KvEvent, DecodeError> {
    let (tag, body) = match raw {
        Value::Array(items) => {
            let (first, rest) = items
                .split_first()
                .ok_or(DecodeError::BadEvent("empty array"))?;
            let tag = tag_str(first)?;
            (tag, EventBody::Array(rest))
        }
        Value::Map(pairs) => {
            let tag_value = pairs
                .iter()
                .rev()
                .find(|(k, _)| k.as_str() == Some("type"))
                .map(|(_, v)| v)
                .ok_or(DecodeError::BadEvent("map without type"))?;
            (tag_str(tag_value)?, EventBody::Map(pairs))
        }
        _ => return Err(DecodeError::BadEvent("neither array nor map")),
    };
    match tag {
        "BlockStored" => decode_stored(&body.fields(BLOCK_STORED_FIELDS)).map(KvEvent::BlockStored),
        "BlockRemoved" => {
            decode_removed(&body.fields(BLOCK_REMOVED_FIELDS)).map(KvEvent::BlockRemoved)
        }
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared {
            medium: opt_string(body.fields(ALL_BLOCKS_CLEARED_FIELDS).get("medium")),
        }),
        other => Err(DecodeError::UnknownTag(truncate(other, 64))),
    }
}

/// An event's values after its tag, before the field order is known.
enum EventBody<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> EventBody<'a> {
    fn fields(&self, order: &'static [&'static str]) -> Fields<'a> {
        match self {
            EventBody::Array(v) => Fields::Array(v, order),
            EventBody::Map(p) => Fields::Map(p),
        }
    }
}

fn tag_str(v: &Value) -> Result<&str, DecodeError> {
    v.as_str()
        .ok_or(DecodeError::BadEvent("tag is not a string"))
}

fn truncate(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

fn decode_stored(f: &Fields<'_>) -> Result<BlockStored, DecodeError> {
    Ok(BlockStored {
        block_hashes: hash_list(f.get("block_hashes"), "block_hashes")?,
        parent_block_hash: match f.get("parent_block_hash") {
            None | Some(Value::Nil) => None,
            Some(v) => Some(hash(v).ok_or(DecodeError::BadHash("parent_block_hash"))?),
        },
        token_ids: token_list(f.get("token_ids"), "token_ids")?.unwrap_or_default(),
        block_size: match f.get("block_size") {
            None | Some(Value::Nil) => 0,
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(DecodeError::BadField("block_size"))?,
        },
        lora_id: f.get("lora_id").and_then(Value::as_i64),
        medium: opt_string(f.get("medium")),
        lora_name: opt_string(f.get("lora_name")),
        extra_keys: match f.get("extra_keys") {
            None | Some(Value::Nil) => None,
            Some(v) => Some(v.clone()),
        },
        group_idx: group(f.get("group_idx"))?,
        kv_cache_spec_kind: opt_string(f.get("kv_cache_spec_kind")),
        kv_cache_spec_sliding_window: f
            .get("kv_cache_spec_sliding_window")
            .and_then(opt_u32_lenient),
        locality: opt_string(f.get("locality")),
        ownership: opt_string(f.get("ownership")),
        session_id: opt_string(f.get("session_id")),
        lookahead_token_ids: token_list(f.get("lookahead_token_ids"), "lookahead_token_ids")
            .ok()
            .flatten(),
    })
}

fn decode_removed(f: &Fields<'_>) -> Result<BlockRemoved, DecodeError> {
    Ok(BlockRemoved {
        block_hashes: hash_list(f.get("block_hashes"), "block_hashes")?,
        medium: opt_string(f.get("medium")),
        group_idx: group(f.get("group_idx"))?,
        locality: opt_string(f.get("locality")),
        ownership: opt_string(f.get("ownership")),
    })
}

/// One hash value: u64, i64 (bits reinterpreted) or a 1–64 byte bin (last 8 bytes big-endian).
fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|n| n as u64)),
        Value::Binary(b) if !b.is_empty() && b.len() <= 64 => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(
                tail.iter()
                    .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte)),
            )
        }
        _ => None,
    }
}

fn hash_list(v: Option<&Value>, field: &'static str) -> Result<Vec<u64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|h| hash(h).ok_or(DecodeError::BadHash(field)))
            .collect(),
        Some(_) => Err(DecodeError::BadHash(field)),
    }
}

fn token_list(v: Option<&Value>, field: &'static str) -> Result<Option<Vec<u32>>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or(DecodeError::BadField(field))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(DecodeError::BadField(field)),
    }
}

fn group(v: Option<&Value>) -> Result<Option<u32>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(DecodeError::BadField("group_idx")),
    }
}

fn opt_string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_string)
}

fn opt_u32_lenient(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// Event encoding shape used by [`encode_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventShape {
    /// `[tag, field…]` with every declared field present positionally (vLLM ≤ 0.23, SGLang <
    /// 0.5.20).
    Array,
    /// `{"type": tag, field: value…}` with null fields omitted (vLLM ≥ 0.24, SGLang ≥ 0.5.20).
    Map,
}

/// Encodes a batch in an engine's wire shape (for tests, fixtures and the publisher tool).
///
/// The batch has 2 elements when `data_parallel_rank` is `None`, else 3. Hashes are written as
/// unsigned integers. `skipped` is not encoded. Writing to a `Vec` cannot fail, so the result is
/// always complete.
pub fn encode_batch(batch: &EventBatch, shape: EventShape) -> Vec<u8> {
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|e| encode_event(e, shape))
        .collect();
    let mut items = vec![Value::F64(batch.ts), Value::Array(events)];
    if let Some(rank) = batch.data_parallel_rank {
        items.push(Value::from(rank));
    }
    let mut out = Vec::new();
    // Writing into a Vec<u8> has no I/O error path.
    let _ = rmpv::encode::write_value(&mut out, &Value::Array(items));
    out
}

fn encode_event(e: &KvEvent, shape: EventShape) -> Value {
    let (tag, fields): (&str, Vec<(&str, Value)>) = match e {
        KvEvent::BlockStored(s) => (
            "BlockStored",
            vec![
                ("block_hashes", hashes_value(&s.block_hashes)),
                ("parent_block_hash", opt_value(s.parent_block_hash)),
                ("token_ids", tokens_value(&s.token_ids)),
                ("block_size", Value::from(s.block_size)),
                ("lora_id", opt_value(s.lora_id)),
                ("medium", opt_str_value(&s.medium)),
                ("lora_name", opt_str_value(&s.lora_name)),
                ("extra_keys", s.extra_keys.clone().unwrap_or(Value::Nil)),
                ("group_idx", opt_value(s.group_idx)),
                ("kv_cache_spec_kind", opt_str_value(&s.kv_cache_spec_kind)),
                (
                    "kv_cache_spec_sliding_window",
                    opt_value(s.kv_cache_spec_sliding_window),
                ),
                ("locality", opt_str_value(&s.locality)),
                ("ownership", opt_str_value(&s.ownership)),
                ("session_id", opt_str_value(&s.session_id)),
                (
                    "lookahead_token_ids",
                    s.lookahead_token_ids
                        .as_deref()
                        .map(tokens_value)
                        .unwrap_or(Value::Nil),
                ),
            ],
        ),
        KvEvent::BlockRemoved(r) => (
            "BlockRemoved",
            vec![
                ("block_hashes", hashes_value(&r.block_hashes)),
                ("medium", opt_str_value(&r.medium)),
                ("group_idx", opt_value(r.group_idx)),
                ("locality", opt_str_value(&r.locality)),
                ("ownership", opt_str_value(&r.ownership)),
            ],
        ),
        // No field when unscoped: the engines send `["AllBlocksCleared"]`.
        KvEvent::AllBlocksCleared { medium } => (
            "AllBlocksCleared",
            medium
                .iter()
                .map(|m| ("medium", Value::from(m.as_str())))
                .collect(),
        ),
    };
    match shape {
        EventShape::Array => {
            let mut items = vec![Value::from(tag)];
            items.extend(fields.into_iter().map(|(_, v)| v));
            Value::Array(items)
        }
        EventShape::Map => {
            let mut pairs = vec![(Value::from("type"), Value::from(tag))];
            pairs.extend(
                fields
                    .into_iter()
                    .filter(|(_, v)| !v.is_nil())
                    .map(|(k, v)| (Value::from(k), v)),
            );
            Value::Map(pairs)
        }
    }
}

fn hashes_value(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|x| Value::from(*x)).collect())
}

fn tokens_value(t: &[u32]) -> Value {
    Value::Array(t.iter().map(|x| Value::from(*x)).collect())
}

fn opt_value<T: Into<Value>>(v: Option<T>) -> Value {
    v.map(Into::into).unwrap_or(Value::Nil)
}

fn opt_str_value(v: &Option<String>) -> Value {
    v.as_deref().map(Value::from).unwrap_or(Value::Nil)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn enc(v: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    #[test]
    fn the_decoded_size_bound_follows_values_not_bytes() {
        // A 1 MiB bin (the breaker's flood payload): refused without a copy, as the reference
        // path refuses it.
        let mut bin = vec![0xc6];
        bin.extend_from_slice(&(1u32 << 20).to_be_bytes());
        bin.resize(bin.len() + (1 << 20), 0);
        assert_eq!(decoded_bytes_bound(&bin), 0);
        assert_eq!(decode_batch(&bin), Err(DecodeError::NotArray));
        assert_eq!(decode_batch(&bin), decode_batch_value(&bin));
        bin.push(0);
        assert_eq!(decode_batch(&bin), Err(DecodeError::TrailingBytes(1)));
        assert_eq!(decode_batch(&bin), decode_batch_value(&bin));
        // Wrapped in an array it is copied: twice its size bounds it.
        let mut arr = vec![0x91];
        arr.extend_from_slice(&bin[..bin.len() - 1]);
        let b = decoded_bytes_bound(&arr);
        assert!((2 << 20..(2 << 20) + 1024).contains(&b), "{b}");
        eprintln!(
            "size_of: KvEvent {} SkippedEvent {} Value {}",
            std::mem::size_of::<KvEvent>(),
            std::mem::size_of::<SkippedEvent>(),
            std::mem::size_of::<Value>()
        );
        // One-byte events (each a skipped event, or a Value in the tree) cost far more than
        // their bytes: the bound says so.
        let n = 100_000usize;
        let mut tiny = vec![0x92, 0x01, 0xdd];
        tiny.extend_from_slice(&(n as u32).to_be_bytes());
        tiny.resize(tiny.len() + n, 0x80);
        let per_event = decoded_bytes_bound(&tiny) / n;
        assert!(
            per_event >= 2 * std::mem::size_of::<SkippedEvent>(),
            "{per_event}"
        );
        assert_eq!(decode_batch(&tiny).unwrap().skipped.len(), n);
        // An announced length the payload does not hold is not counted.
        let mut lying = vec![0x92, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff];
        lying.extend_from_slice(&[0x80; 10]);
        assert!(decoded_bytes_bound(&lying) < 10_000);
        // Nothing (and garbage) is cheap and never panics.
        assert_eq!(decoded_bytes_bound(&[]), 0);
        assert!(decoded_bytes_bound(&[0xc1, 0xdf, 0xff]) < 1000);
        // A genuine batch: bounded by a few hundred bytes per event.
        let one = enc(Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(7u64)]),
                Value::Nil,
                Value::Array(vec![Value::from(1u64); 16]),
                Value::from(16u64),
            ])]),
        ]));
        let b = decoded_bytes_bound(&one);
        assert!(b >= std::mem::size_of::<KvEvent>() && b < 8192, "{b}");
    }

    #[test]
    fn whole_batch_errors_have_stable_reasons() {
        assert_eq!(
            decode_batch(&[0xcd, 0x01]).unwrap_err().reason(),
            "not_msgpack"
        );
        assert_eq!(decode_batch(&[]).unwrap_err().reason(), "not_msgpack");
        assert_eq!(decode_batch(&[0x01]).unwrap_err().reason(), "not_array");
        assert_eq!(
            decode_batch(&[0x91, 0x01]).unwrap_err().reason(),
            "short_batch"
        );
        assert_eq!(
            decode_batch(&[0x92, 0xa1, b'x', 0x90])
                .unwrap_err()
                .reason(),
            "bad_timestamp"
        );
        assert_eq!(
            decode_batch(&[0x92, 0x01, 0x01]).unwrap_err().reason(),
            "bad_events"
        );
        assert_eq!(
            decode_batch(&[0x92, 0x01, 0x90, 0x00])
                .unwrap_err()
                .reason(),
            "trailing_bytes"
        );
        for r in DecodeError::REASONS {
            assert!(r.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        }
    }

    #[test]
    fn unknown_and_bad_events_are_skipped_not_fatal() {
        let payload = enc(Value::Array(vec![
            Value::from(1.5),
            Value::Array(vec![
                Value::Array(vec![Value::from("KVCacheTierMoved"), Value::from(1)]),
                Value::Array(vec![Value::from("AllBlocksCleared")]),
                Value::from(7),
                Value::Map(vec![(Value::from("block_hashes"), Value::Array(vec![]))]),
                Value::Array(vec![
                    Value::from("BlockRemoved"),
                    Value::Array(vec![Value::from("nope")]),
                ]),
            ]),
        ]));
        let b = decode_batch(&payload).unwrap();
        assert_eq!(b.events, vec![KvEvent::AllBlocksCleared { medium: None }]);
        let reasons: Vec<_> = b
            .skipped
            .iter()
            .map(|s| (s.index, s.error.reason()))
            .collect();
        assert_eq!(
            reasons,
            vec![
                (0, "unknown_tag"),
                (2, "bad_event"),
                (3, "bad_event"),
                (4, "bad_hash")
            ]
        );
        assert_eq!(b.data_parallel_rank, None);
    }

    #[test]
    fn hashes_accept_u64_i64_and_bin() {
        assert_eq!(hash(&Value::from(u64::MAX)), Some(u64::MAX));
        assert_eq!(hash(&Value::from(-1i64)), Some(u64::MAX));
        let mut digest = vec![0xaa; 24];
        digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(hash(&Value::Binary(digest)), Some(0x0102_0304_0506_0708));
        assert_eq!(hash(&Value::Binary(vec![1, 2])), Some(0x0102));
        assert_eq!(hash(&Value::Binary(vec![])), None);
        assert_eq!(hash(&Value::from("x")), None);
    }

    #[test]
    fn sglang_metadata_in_lora_name_position_is_ignored() {
        let payload = enc(Value::Array(vec![
            Value::from(1.0),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(5)]),
                Value::Nil,
                Value::Array(vec![Value::from(1), Value::from(2)]),
                Value::from(2),
                Value::Nil,
                Value::from("GPU"),
                Value::Map(vec![(Value::from("cache_salt"), Value::from("t"))]),
            ])]),
            Value::from(0),
        ]));
        let b = decode_batch(&payload).unwrap();
        let KvEvent::BlockStored(s) = &b.events[0] else {
            panic!("not stored")
        };
        assert_eq!(s.lora_name, None);
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert_eq!(s.token_ids, vec![1, 2]);
        assert_eq!(b.data_parallel_rank, Some(0));
    }
}
