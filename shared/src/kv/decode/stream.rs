//! Streaming fast path of [`decode_batch`](super::decode_batch): reads the msgpack payload with
//! `rmp`'s low-level reads straight into an [`EventBatch`], without building an `rmpv::Value`
//! tree (one allocation per key, string and array) first.
//!
//! It decides every well-formed batch, including skipped events (unknown tag, bad event shape, bad
//! hash or identity field). What it cannot decide with certainty it gives up on with [`Bail`], and
//! [`decode_batch`](super::decode_batch) re-decodes the payload through the `rmpv` reference path
//! ([`decode_batch_value`](super::decode_batch_value)), so results and errors are identical to
//! that path:
//!
//! - bytes that are not one well-formed msgpack value (truncated anywhere), or trailing bytes;
//! - containers nested deeper than [`MAX_LEVEL`] (rmpv's depth accounting decides those);
//! - whole-batch errors (not an array, fewer than 2 elements, bad `ts` or `events`).
//!
//! Like the reference path it reads every byte of the payload, so a frame whose events are fine
//! but whose tail is cut still fails as a whole.

use rmp::decode::{read_marker, RmpRead};
use rmp::Marker;
use rmpv::Value;

use super::{truncate, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, SkippedEvent};

/// The fast path could not decide this payload: re-decode it through the `rmpv` path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bail;

/// Result of the fast path: `Err(Bail)` hands the payload to the reference path.
type Fast<T> = Result<T, Bail>;

/// Deepest container nesting level the fast path reads itself (the batch array is level 0, its
/// elements level 1, an event's fields level 3). A container at this level or deeper bails.
///
/// rmpv spends two of [`MAX_DEPTH`](super::MAX_DEPTH) = 64 per container level and up to three
/// for a string, so a value at level ≤ 24 (at most 2·24 + 3 = 51) can never hit its limit: where
/// the fast path answers, the reference path would not have failed on depth.
pub(super) const MAX_LEVEL: u32 = 24;

/// At most this many events are reserved up front (a length header is untrusted input).
const EVENTS_PREALLOC: usize = 64;

/// The head of one msgpack value: scalars complete, containers as their length (their elements
/// follow in the reader and must be consumed by the caller).
#[derive(Debug, Clone, Copy)]
enum Head<'a> {
    /// `nil`, or the never-used marker 0xc1, which rmpv reads as nil.
    Nil,
    /// A non-negative integer, whatever its marker (rmpv's `PosInt`).
    Uint(u64),
    /// A negative integer (rmpv's `NegInt`).
    Neg(i64),
    /// A float; f32 widened exactly.
    Float(f64),
    /// A string's bytes, not yet checked as UTF-8.
    Str(&'a [u8]),
    /// A bin's bytes.
    Bin(&'a [u8]),
    /// A boolean or an ext value: never a value any field reads.
    Other,
    /// An array of this many elements.
    Array(u32),
    /// A map of this many key/value pairs.
    Map(u32),
}

impl Head<'_> {
    /// An integer read from a signed marker, classified as rmpv does.
    fn signed(n: i64) -> Self {
        u64::try_from(n).map_or(Head::Neg(n), Head::Uint)
    }

    /// A non-negative integer that fits in `u32` (`Value::as_u64` then `u32::try_from`).
    fn as_u32(self) -> Option<u32> {
        match self {
            Head::Uint(n) => u32::try_from(n).ok(),
            _ => None,
        }
    }

    /// A valid UTF-8 string (`Value::as_str`).
    fn as_str(&self) -> Option<&str> {
        match self {
            Head::Str(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// One block hash: u64, i64 (bits reinterpreted) or a 1–64 byte bin (last 8 bytes
    /// big-endian). Same rules as the reference path's `hash`.
    fn as_hash(self) -> Option<u64> {
        match self {
            Head::Uint(n) => Some(n),
            Head::Neg(n) => Some(n as u64),
            Head::Bin(b) if !b.is_empty() && b.len() <= 64 => Some(
                b.iter()
                    .skip(b.len().saturating_sub(8))
                    .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte)),
            ),
            _ => None,
        }
    }
}

/// The fields of both event types, in the order of [`BLOCK_STORED_FIELDS`](super::BLOCK_STORED_FIELDS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    Ownership,
    SessionId,
    LookaheadTokenIds,
}

/// Positional order of `BlockStored` array events (mirrors `BLOCK_STORED_FIELDS`).
const STORED_ORDER: [Field; 15] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
    Field::KvCacheSpecSlidingWindow,
    Field::Locality,
    Field::Ownership,
    Field::SessionId,
    Field::LookaheadTokenIds,
];

/// Positional order of `AllBlocksCleared` array events (mirrors `ALL_BLOCKS_CLEARED_FIELDS`).
const CLEARED_ORDER: [Field; 1] = [Field::Medium];

/// Positional order of `BlockRemoved` array events (mirrors `BLOCK_REMOVED_FIELDS`).
const REMOVED_ORDER: [Field; 5] = [
    Field::BlockHashes,
    Field::Medium,
    Field::GroupIdx,
    Field::Locality,
    Field::Ownership,
];

impl Field {
    /// The wire name (map key) of the field.
    #[cfg(test)]
    fn name(self) -> &'static str {
        match self {
            Field::BlockHashes => "block_hashes",
            Field::ParentBlockHash => "parent_block_hash",
            Field::TokenIds => "token_ids",
            Field::BlockSize => "block_size",
            Field::LoraId => "lora_id",
            Field::Medium => "medium",
            Field::LoraName => "lora_name",
            Field::ExtraKeys => "extra_keys",
            Field::GroupIdx => "group_idx",
            Field::KvCacheSpecKind => "kv_cache_spec_kind",
            Field::KvCacheSpecSlidingWindow => "kv_cache_spec_sliding_window",
            Field::Locality => "locality",
            Field::Ownership => "ownership",
            Field::SessionId => "session_id",
            Field::LookaheadTokenIds => "lookahead_token_ids",
        }
    }

    /// The field a map key names, if any.
    fn from_key(key: &[u8]) -> Option<Field> {
        Some(match key {
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::ParentBlockHash,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::KvCacheSpecKind,
            b"kv_cache_spec_sliding_window" => Field::KvCacheSpecSlidingWindow,
            b"locality" => Field::Locality,
            b"ownership" => Field::Ownership,
            b"session_id" => Field::SessionId,
            b"lookahead_token_ids" => Field::LookaheadTokenIds,
            _ => return None,
        })
    }
}

/// The known event tags.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    /// The kind a tag names; `Err` is the event's [`DecodeError::UnknownTag`].
    fn of(tag: &str) -> Result<Kind, DecodeError> {
        match tag {
            "BlockStored" => Ok(Kind::Stored),
            "BlockRemoved" => Ok(Kind::Removed),
            "AllBlocksCleared" => Ok(Kind::Cleared),
            other => Err(DecodeError::UnknownTag(truncate(other, 64))),
        }
    }
}

/// Every field of one event as decoded so far: absent fields hold the value an absent or null
/// field reads as; a later occurrence of a map key overwrites an earlier one (last wins, as in the
/// reference path). Identity fields keep their error until the event is built, so the error
/// reported is the first in the reference path's evaluation order, not in wire order.
struct Slots {
    block_hashes: Result<Vec<u64>, DecodeError>,
    parent_block_hash: Result<Option<u64>, DecodeError>,
    token_ids: Result<Vec<u32>, DecodeError>,
    block_size: Result<u32, DecodeError>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Value>,
    group_idx: Result<Option<u32>, DecodeError>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<u32>,
    locality: Option<String>,
    ownership: Option<String>,
    session_id: Option<String>,
    lookahead_token_ids: Option<Vec<u32>>,
}

impl Slots {
    fn new() -> Self {
        Slots {
            block_hashes: Ok(Vec::new()),
            parent_block_hash: Ok(None),
            token_ids: Ok(Vec::new()),
            block_size: Ok(0),
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: Ok(None),
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            locality: None,
            ownership: None,
            session_id: None,
            lookahead_token_ids: None,
        }
    }

    /// The event of `kind` from these fields (errors in the reference path's order).
    fn build(self, kind: Kind) -> Result<KvEvent, DecodeError> {
        match kind {
            Kind::Stored => Ok(KvEvent::BlockStored(BlockStored {
                block_hashes: self.block_hashes?,
                parent_block_hash: self.parent_block_hash?,
                token_ids: self.token_ids?,
                block_size: self.block_size?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                group_idx: self.group_idx?,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
                locality: self.locality,
                ownership: self.ownership,
                session_id: self.session_id,
                lookahead_token_ids: self.lookahead_token_ids,
            })),
            Kind::Removed => Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes?,
                medium: self.medium,
                group_idx: self.group_idx?,
                locality: self.locality,
                ownership: self.ownership,
            })),
            Kind::Cleared => Ok(KvEvent::AllBlocksCleared {
                medium: self.medium,
            }),
        }
    }
}

/// A msgpack reader over the rest of the payload.
struct Reader<'a> {
    buf: &'a [u8],
}

/// Maps any `rmp` read error (the payload ended early) to [`Bail`].
fn eof<E>(_: E) -> Bail {
    Bail
}

impl<'a> Reader<'a> {
    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Fast<&'a [u8]> {
        let (head, rest) = self.buf.split_at_checked(n).ok_or(Bail)?;
        self.buf = rest;
        Ok(head)
    }

    /// A length read from a 32-bit header.
    fn len32(&mut self) -> Fast<usize> {
        let n = self.buf.read_data_u32().map_err(eof)?;
        usize::try_from(n).map_err(eof)
    }

    /// The bytes of an ext value's type and body.
    fn ext(&mut self, len: usize) -> Fast<Head<'a>> {
        self.take(len.checked_add(1).ok_or(Bail)?)?;
        Ok(Head::Other)
    }

    /// Reads one value's head; see [`Head`].
    fn head(&mut self) -> Fast<Head<'a>> {
        let marker = read_marker(&mut self.buf).map_err(eof)?;
        let rd = &mut self.buf;
        Ok(match marker {
            Marker::Null | Marker::Reserved => Head::Nil,
            Marker::True | Marker::False => Head::Other,
            Marker::FixPos(n) => Head::Uint(u64::from(n)),
            Marker::FixNeg(n) => Head::Neg(i64::from(n)),
            Marker::U8 => Head::Uint(u64::from(rd.read_data_u8().map_err(eof)?)),
            Marker::U16 => Head::Uint(u64::from(rd.read_data_u16().map_err(eof)?)),
            Marker::U32 => Head::Uint(u64::from(rd.read_data_u32().map_err(eof)?)),
            Marker::U64 => Head::Uint(rd.read_data_u64().map_err(eof)?),
            Marker::I8 => Head::signed(i64::from(rd.read_data_i8().map_err(eof)?)),
            Marker::I16 => Head::signed(i64::from(rd.read_data_i16().map_err(eof)?)),
            Marker::I32 => Head::signed(i64::from(rd.read_data_i32().map_err(eof)?)),
            Marker::I64 => Head::signed(rd.read_data_i64().map_err(eof)?),
            Marker::F32 => Head::Float(f64::from(rd.read_data_f32().map_err(eof)?)),
            Marker::F64 => Head::Float(rd.read_data_f64().map_err(eof)?),
            Marker::FixStr(n) => Head::Str(self.take(usize::from(n))?),
            Marker::Str8 => {
                let n = rd.read_data_u8().map_err(eof)?;
                Head::Str(self.take(usize::from(n))?)
            }
            Marker::Str16 => {
                let n = rd.read_data_u16().map_err(eof)?;
                Head::Str(self.take(usize::from(n))?)
            }
            Marker::Str32 => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            Marker::Bin8 => {
                let n = rd.read_data_u8().map_err(eof)?;
                Head::Bin(self.take(usize::from(n))?)
            }
            Marker::Bin16 => {
                let n = rd.read_data_u16().map_err(eof)?;
                Head::Bin(self.take(usize::from(n))?)
            }
            Marker::Bin32 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = rd.read_data_u8().map_err(eof)?;
                self.ext(usize::from(n))?
            }
            Marker::Ext16 => {
                let n = rd.read_data_u16().map_err(eof)?;
                self.ext(usize::from(n))?
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            Marker::FixArray(n) => Head::Array(u32::from(n)),
            Marker::Array16 => Head::Array(u32::from(rd.read_data_u16().map_err(eof)?)),
            Marker::Array32 => Head::Array(rd.read_data_u32().map_err(eof)?),
            Marker::FixMap(n) => Head::Map(u32::from(n)),
            Marker::Map16 => Head::Map(u32::from(rd.read_data_u16().map_err(eof)?)),
            Marker::Map32 => Head::Map(rd.read_data_u32().map_err(eof)?),
        })
    }

    /// Consumes the elements of a container whose head (at `level`) was just read; nothing for a
    /// scalar.
    fn skip_rest(&mut self, head: Head<'a>, level: u32) -> Fast<()> {
        let values = match head {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => u64::from(n) * 2,
            _ => return Ok(()),
        };
        let inner = enter(level)?;
        for _ in 0..values {
            self.skip(inner)?;
        }
        Ok(())
    }

    /// Consumes one whole value at `level`.
    fn skip(&mut self, level: u32) -> Fast<()> {
        let head = self.head()?;
        self.skip_rest(head, level)
    }

    /// Consumes `n` whole values at `level`.
    fn skip_n(&mut self, n: u32, level: u32) -> Fast<()> {
        for _ in 0..n {
            self.skip(level)?;
        }
        Ok(())
    }

    /// How many elements of an `n`-element list to reserve: never more than bytes remain (each
    /// element takes at least one).
    fn prealloc(&self, n: u32) -> usize {
        usize::try_from(n).map_or(0, |n| n.min(self.buf.len()))
    }

    /// A hash list (`hash_list` of the reference path): null → empty, an array of hashes, anything
    /// else → `BadHash(field)`.
    fn hash_list(
        &mut self,
        head: Head<'a>,
        level: u32,
        field: &'static str,
    ) -> Fast<Result<Vec<u64>, DecodeError>> {
        let n = match head {
            Head::Nil => return Ok(Ok(Vec::new())),
            Head::Array(n) => n,
            other => {
                self.skip_rest(other, level)?;
                return Ok(Err(DecodeError::BadHash(field)));
            }
        };
        let inner = enter(level)?;
        let mut out = Vec::with_capacity(self.prealloc(n));
        let mut ok = true;
        for _ in 0..n {
            let h = self.head()?;
            match h.as_hash() {
                Some(x) => out.push(x),
                None => {
                    ok = false;
                    self.skip_rest(h, inner)?;
                }
            }
        }
        Ok(if ok {
            Ok(out)
        } else {
            Err(DecodeError::BadHash(field))
        })
    }

    /// A token-id list (`token_list` of the reference path): null → `None`, an array of u32,
    /// anything else → `BadField(field)`.
    fn token_list(
        &mut self,
        head: Head<'a>,
        level: u32,
        field: &'static str,
    ) -> Fast<Result<Option<Vec<u32>>, DecodeError>> {
        let n = match head {
            Head::Nil => return Ok(Ok(None)),
            Head::Array(n) => n,
            other => {
                self.skip_rest(other, level)?;
                return Ok(Err(DecodeError::BadField(field)));
            }
        };
        let inner = enter(level)?;
        let mut out = Vec::with_capacity(self.prealloc(n));
        let mut ok = true;
        for _ in 0..n {
            // Token ids are mostly positive fixints: one byte, no marker dispatch.
            if let Some((&b, rest)) = self.buf.split_first() {
                if b < 0x80 {
                    out.push(u32::from(b));
                    self.buf = rest;
                    continue;
                }
            }
            let h = self.head()?;
            match h.as_u32() {
                Some(t) => out.push(t),
                None => {
                    ok = false;
                    self.skip_rest(h, inner)?;
                }
            }
        }
        Ok(if ok {
            Ok(Some(out))
        } else {
            Err(DecodeError::BadField(field))
        })
    }

    /// A u32 when the value is one (any other value consumed and `None`).
    fn lenient_u32(&mut self, head: Head<'a>, level: u32) -> Fast<Option<u32>> {
        self.skip_rest(head, level)?;
        Ok(head.as_u32())
    }

    /// A string when the value is a valid UTF-8 string (any other value consumed and `None`).
    fn opt_string(&mut self, head: Head<'a>, level: u32) -> Fast<Option<String>> {
        self.skip_rest(head, level)?;
        Ok(head.as_str().map(str::to_string))
    }

    /// Reads the value of `field` (at `level`) into `slots`.
    fn field(&mut self, field: Field, level: u32, slots: &mut Slots) -> Fast<()> {
        if field == Field::ExtraKeys {
            // Kept as sent: the value's bytes, measured by skipping it, read by rmpv.
            let start = self.buf;
            self.skip(level)?;
            let used = start.len().checked_sub(self.buf.len()).ok_or(Bail)?;
            let mut raw = start.get(..used).ok_or(Bail)?;
            let value = rmpv::decode::read_value(&mut raw).map_err(eof)?;
            slots.extra_keys = (!value.is_nil()).then_some(value);
            return Ok(());
        }
        let head = self.head()?;
        match field {
            Field::BlockHashes => {
                slots.block_hashes = self.hash_list(head, level, "block_hashes")?;
            }
            Field::ParentBlockHash => {
                self.skip_rest(head, level)?;
                slots.parent_block_hash = match head {
                    Head::Nil => Ok(None),
                    h => h
                        .as_hash()
                        .map(Some)
                        .ok_or(DecodeError::BadHash("parent_block_hash")),
                };
            }
            Field::TokenIds => {
                slots.token_ids = self
                    .token_list(head, level, "token_ids")?
                    .map(Option::unwrap_or_default);
            }
            Field::BlockSize => {
                self.skip_rest(head, level)?;
                slots.block_size = match head {
                    Head::Nil => Ok(0),
                    h => h.as_u32().ok_or(DecodeError::BadField("block_size")),
                };
            }
            Field::LoraId => {
                self.skip_rest(head, level)?;
                slots.lora_id = match head {
                    Head::Uint(n) => i64::try_from(n).ok(),
                    Head::Neg(n) => Some(n),
                    _ => None,
                };
            }
            Field::Medium => slots.medium = self.opt_string(head, level)?,
            Field::LoraName => slots.lora_name = self.opt_string(head, level)?,
            Field::GroupIdx => {
                self.skip_rest(head, level)?;
                slots.group_idx = match head {
                    Head::Nil => Ok(None),
                    h => h
                        .as_u32()
                        .map(Some)
                        .ok_or(DecodeError::BadField("group_idx")),
                };
            }
            Field::KvCacheSpecKind => slots.kv_cache_spec_kind = self.opt_string(head, level)?,
            Field::KvCacheSpecSlidingWindow => {
                slots.kv_cache_spec_sliding_window = self.lenient_u32(head, level)?;
            }
            Field::Locality => slots.locality = self.opt_string(head, level)?,
            Field::Ownership => slots.ownership = self.opt_string(head, level)?,
            Field::SessionId => slots.session_id = self.opt_string(head, level)?,
            Field::LookaheadTokenIds => {
                slots.lookahead_token_ids = self
                    .token_list(head, level, "lookahead_token_ids")?
                    .ok()
                    .flatten();
            }
            // Handled above.
            Field::ExtraKeys => {}
        }
        Ok(())
    }

    /// One event (at `level`), consumed whole: `Ok(Err(_))` is an event to skip.
    fn event(&mut self, level: u32) -> Fast<Result<KvEvent, DecodeError>> {
        match self.head()? {
            Head::Array(n) => self.array_event(n, enter(level)?),
            Head::Map(n) => self.map_event(n, enter(level)?),
            other => {
                self.skip_rest(other, level)?;
                Ok(Err(DecodeError::BadEvent("neither array nor map")))
            }
        }
    }

    /// A tagged-array event of `n` elements at `level`: `[tag, field…]`, positional.
    fn array_event(&mut self, n: u32, level: u32) -> Fast<Result<KvEvent, DecodeError>> {
        let Some(rest) = n.checked_sub(1) else {
            return Ok(Err(DecodeError::BadEvent("empty array")));
        };
        let tag = self.head()?;
        self.skip_rest(tag, level)?;
        let kind = match tag.as_str() {
            None => Err(DecodeError::BadEvent("tag is not a string")),
            Some(t) => Kind::of(t),
        };
        let order: &[Field] = match kind {
            Ok(Kind::Stored) => &STORED_ORDER,
            Ok(Kind::Removed) => &REMOVED_ORDER,
            Ok(Kind::Cleared) => &CLEARED_ORDER,
            Err(_) => &[],
        };
        let mut slots = Slots::new();
        let mut pos = 0usize;
        for _ in 0..rest {
            match order.get(pos) {
                Some(f) => self.field(*f, level, &mut slots)?,
                None => self.skip(level)?,
            }
            pos = pos.saturating_add(1);
        }
        Ok(kind.and_then(|k| slots.build(k)))
    }

    /// A tagged-map event of `n` pairs at `level`: `{"type": tag, field: value…}`; the last
    /// occurrence of a key wins.
    fn map_event(&mut self, n: u32, level: u32) -> Fast<Result<KvEvent, DecodeError>> {
        // None: no "type" key yet; Some(None): the last one was not a string.
        let mut tag: Option<Option<&'a str>> = None;
        let mut slots = Slots::new();
        for _ in 0..n {
            let key = self.head()?;
            self.skip_rest(key, level)?;
            let Head::Str(key) = key else {
                self.skip(level)?;
                continue;
            };
            if key == b"type" {
                let value = self.head()?;
                self.skip_rest(value, level)?;
                tag = Some(match value {
                    Head::Str(b) => std::str::from_utf8(b).ok(),
                    _ => None,
                });
            } else if let Some(f) = Field::from_key(key) {
                self.field(f, level, &mut slots)?;
            } else {
                self.skip(level)?;
            }
        }
        Ok(match tag {
            None => Err(DecodeError::BadEvent("map without type")),
            Some(None) => Err(DecodeError::BadEvent("tag is not a string")),
            Some(Some(t)) => Kind::of(t).and_then(|k| slots.build(k)),
        })
    }
}

/// The level of the elements of a container at `level`; bails past [`MAX_LEVEL`].
fn enter(level: u32) -> Fast<u32> {
    if level >= MAX_LEVEL {
        return Err(Bail);
    }
    Ok(level + 1)
}

/// Decodes one batch payload, or bails (see the module documentation).
pub(super) fn decode_batch(payload: &[u8]) -> Fast<EventBatch> {
    let mut rd = Reader { buf: payload };
    let Head::Array(n) = rd.head()? else {
        return Err(Bail);
    };
    if n < 2 {
        return Err(Bail);
    }
    let level = enter(0)?;
    let ts = match rd.head()? {
        Head::Float(f) => f,
        Head::Uint(u) => u as f64,
        Head::Neg(i) => i as f64,
        _ => return Err(Bail),
    };
    let Head::Array(count) = rd.head()? else {
        return Err(Bail);
    };
    let event_level = enter(level)?;
    let count = usize::try_from(count).map_err(eof)?;
    let mut events = Vec::with_capacity(count.min(EVENTS_PREALLOC));
    let mut skipped = Vec::new();
    for index in 0..count {
        match rd.event(event_level)? {
            Ok(ev) => events.push(ev),
            Err(error) => skipped.push(SkippedEvent { index, error }),
        }
    }
    let data_parallel_rank = if n >= 3 {
        let head = rd.head()?;
        rd.lenient_u32(head, level)?
    } else {
        None
    };
    rd.skip_n(n.saturating_sub(3), level)?;
    if !rd.buf.is_empty() {
        return Err(Bail);
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
        skipped,
    })
}

/// The whole-batch error of a payload whose top value is a scalar (a string, a bin, a number…,
/// not an array or map), decided without copying it: `TrailingBytes` when bytes follow it, else
/// `NotArray` — what the reference path returns after reading the value into a tree (a 15 MiB
/// bin would be copied whole). `None` for anything else (a container, malformed or truncated
/// bytes: the other paths decide).
pub(super) fn scalar_payload(payload: &[u8]) -> Option<DecodeError> {
    let mut rd = Reader { buf: payload };
    match rd.head().ok()? {
        Head::Array(_) | Head::Map(_) => None,
        _ if !rd.buf.is_empty() => Some(DecodeError::TrailingBytes(rd.buf.len())),
        _ => Some(DecodeError::NotArray),
    }
}

/// Consumes up to `pending` whole values without allocating or recursing (a container adds its
/// elements to `pending`), counting each value read in `elements`; `false` when the payload
/// ends (or is malformed) first.
fn walk(rd: &mut Reader<'_>, mut pending: u64, elements: &mut u64) -> bool {
    while pending > 0 {
        let Ok(head) = rd.head() else {
            return false;
        };
        pending -= 1;
        *elements += 1;
        pending = pending.saturating_add(children(head));
    }
    true
}

/// Values inside a container head (a map's keys and values); 0 for a scalar.
fn children(head: Head<'_>) -> u64 {
    match head {
        Head::Array(n) => u64::from(n),
        Head::Map(n) => u64::from(n) * 2,
        _ => 0,
    }
}

/// The shape of a payload as far as it is well-formed, read without allocating: `(values,
/// events)` — every msgpack value present (containers, their elements, keys), and the length
/// the batch's `events` array announces (at most `values`; 0 when the payload is not a batch).
/// Announced lengths past the payload's end are not counted: neither decoder allocates for
/// values that are not there.
pub(super) fn shape(payload: &[u8]) -> (u64, u64) {
    let mut rd = Reader { buf: payload };
    let mut values = 0u64;
    let Ok(top) = rd.head() else {
        return (0, 0);
    };
    values += 1;
    let n = match top {
        Head::Array(n) if n >= 2 => n,
        other => {
            walk(&mut rd, children(other), &mut values);
            return (values, 0);
        }
    };
    if !walk(&mut rd, 1, &mut values) {
        return (values, 0);
    }
    let Ok(events) = rd.head() else {
        return (values, 0);
    };
    values += 1;
    walk(
        &mut rd,
        children(events).saturating_add(u64::from(n - 2)),
        &mut values,
    );
    let announced = match events {
        Head::Array(c) => u64::from(c),
        _ => 0,
    };
    (values, announced.min(values))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::kv::decode::{BLOCK_REMOVED_FIELDS, BLOCK_STORED_FIELDS};

    #[test]
    fn positional_orders_mirror_the_public_field_lists() {
        let stored: Vec<_> = STORED_ORDER.iter().map(|f| f.name()).collect();
        assert_eq!(stored, BLOCK_STORED_FIELDS);
        let removed: Vec<_> = REMOVED_ORDER.iter().map(|f| f.name()).collect();
        assert_eq!(removed, BLOCK_REMOVED_FIELDS);
        for f in STORED_ORDER {
            assert_eq!(Field::from_key(f.name().as_bytes()), Some(f));
        }
        assert_eq!(Field::from_key(b"type"), None);
        assert_eq!(Field::from_key(b"block_hashes\0"), None);
    }

    #[test]
    fn reserved_marker_reads_as_nil_like_rmpv() {
        // [1, [["BlockStored", [7], 0xc1]]]: a 0xc1 parent reads as "no parent".
        let mut p = vec![0x92, 0x01, 0x91, 0x93, 0xab];
        p.extend_from_slice(b"BlockStored");
        p.extend_from_slice(&[0x91, 0x07, 0xc1]);
        let b = decode_batch(&p).unwrap();
        let KvEvent::BlockStored(s) = &b.events[0] else {
            panic!("not stored: {b:?}")
        };
        assert_eq!(s.block_hashes, vec![7]);
        assert_eq!(s.parent_block_hash, None);
    }

    #[test]
    fn malformed_and_whole_batch_errors_bail() {
        for p in [
            &[][..],
            &[0xcd, 0x01],
            &[0x01],
            &[0x91, 0x01],
            &[0x92, 0xa1, b'x', 0x90],
            &[0x92, 0x01, 0x01],
            &[0x92, 0x01, 0x90, 0x00],
            &[0x92, 0x01, 0x91, 0x92, 0xa1],
            &[0x92, 0x01, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff],
            &[0x92, 0x01, 0x91, 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
        ] {
            assert_eq!(decode_batch(p), Err(Bail), "{p:02x?}");
        }
    }

    #[test]
    fn nesting_past_the_fast_levels_bails() {
        // An unknown event field holding containers nested down to level MAX_LEVEL.
        let mut p = vec![0x92, 0x01, 0x91, 0x92, 0xb0];
        p.extend_from_slice(b"AllBlocksCleared");
        let depth = usize::try_from(MAX_LEVEL).unwrap() - 3;
        p.extend(std::iter::repeat_n(0x91, depth));
        p.push(0xc0);
        assert_eq!(
            decode_batch(&p).unwrap().events,
            vec![KvEvent::AllBlocksCleared { medium: None }]
        );
        let mut deeper = vec![0x92, 0x01, 0x91, 0x92, 0xb0];
        deeper.extend_from_slice(b"AllBlocksCleared");
        deeper.extend(std::iter::repeat_n(0x91, depth + 1));
        deeper.push(0xc0);
        assert_eq!(decode_batch(&deeper), Err(Bail));
        // The reference path still decides it.
        assert_eq!(
            crate::kv::decode::decode_batch(&deeper).unwrap().events,
            vec![KvEvent::AllBlocksCleared { medium: None }]
        );
    }
}
