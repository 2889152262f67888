//! The streaming fast path ([`stream`](super::stream)) against the `rmpv` reference path
//! ([`decode_batch_value`](super::decode_batch_value)): wherever the fast path answers, its answer
//! is the reference's, on genuine frames, on random valid batches, on random wire shapes
//! (every header and integer width, duplicate and unknown keys, wrong types, 0xc1, bins, exts)
//! and on mutated and truncated versions of all of them; and genuine frames never fall back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use rmpv::Value;

use super::stream::{self, Bail};
use super::{
    decode_batch, decode_batch_value, encode_batch, BlockRemoved, BlockStored, DecodeError,
    EventBatch, EventShape, KvEvent,
};

/// Both paths on one payload. `Debug` text compares NaN timestamps and floats inside
/// `extra_keys` as equal to themselves (bit patterns aside), which `PartialEq` does not.
fn both(p: &[u8]) -> (Result<String, Bail>, Result<String, DecodeError>) {
    let fast = stream::decode_batch(p).map(|b| format!("{b:?}"));
    let reference = decode_batch_value(p).map(|b| format!("{b:?}"));
    (fast, reference)
}

/// Where the fast path answers, it answers as the reference does; where it bails, the public
/// entry point answers as the reference does. Returns whether the fast path answered.
fn assert_agree(p: &[u8]) -> Result<bool, TestCaseError> {
    let (fast, reference) = both(p);
    let public = decode_batch(p).map(|b| format!("{b:?}"));
    prop_assert_eq!(&public, &reference, "payload {:02x?}", p);
    match fast {
        Ok(f) => {
            prop_assert_eq!(Ok(f), reference, "payload {:02x?}", p);
            Ok(true)
        }
        Err(Bail) => Ok(false),
    }
}

// ------------------------------------------------------------------ genuine frames

/// The repository's golden recordings (`testdata/kv-events`).
fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events")
}

/// Every live frame payload of the golden fixtures (the frames the benchmarks decode).
fn golden_payloads() -> &'static [Vec<u8>] {
    static PAYLOADS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    PAYLOADS.get_or_init(|| {
        let mut out = Vec::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .filter(|p| !p.ends_with("hash-vectors.json"))
            .collect();
        files.sort();
        for path in files {
            let doc: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            collect_payloads(&doc, &mut out);
        }
        assert!(
            out.len() >= 60,
            "expected the golden frames, got {}",
            out.len()
        );
        out
    })
}

/// The payload (third frame) of every live message in a fixture document.
fn collect_payloads(doc: &serde_json::Value, out: &mut Vec<Vec<u8>>) {
    for live in doc["live"].as_array().into_iter().flatten() {
        let h = live["frames_hex"][2].as_str().unwrap();
        out.push(hex::decode(h).unwrap());
    }
}

#[test]
fn genuine_frames_take_the_fast_path_and_agree() {
    for p in golden_payloads() {
        let fast = stream::decode_batch(p);
        assert!(fast.is_ok(), "fast path bailed on a genuine frame {p:02x?}");
        assert_eq!(fast.ok(), decode_batch_value(p).ok(), "{p:02x?}");
    }
}

// ------------------------------------------------------------------ random valid batches

fn opt_string() -> impl Strategy<Value = Option<String>> {
    prop::option::of("[A-Za-z_]{0,12}")
}

fn stored() -> impl Strategy<Value = BlockStored> {
    (
        (
            prop::collection::vec(any::<u64>(), 0..5),
            prop::option::of(any::<u64>()),
            prop::collection::vec(any::<u32>(), 0..40),
            any::<u32>(),
            prop::option::of(any::<i64>()),
            opt_string(),
            opt_string(),
            prop::option::of(
                prop::collection::vec(
                    prop_oneof![Just(Value::Nil), any::<i64>().prop_map(Value::from)],
                    0..3,
                )
                .prop_map(Value::Array),
            ),
        ),
        (
            prop::option::of(any::<u32>()),
            opt_string(),
            prop::option::of(any::<u32>()),
            opt_string(),
            opt_string(),
            opt_string(),
            prop::option::of(prop::collection::vec(any::<u32>(), 0..4)),
        ),
    )
        .prop_map(
            |((bh, parent, tokens, bs, lora_id, medium, lora_name, ek), rest)| {
                let (group_idx, kind, window, locality, ownership, session_id, lookahead) = rest;
                BlockStored {
                    block_hashes: bh,
                    parent_block_hash: parent,
                    token_ids: tokens,
                    block_size: bs,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys: ek,
                    group_idx,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: window,
                    locality,
                    ownership,
                    session_id,
                    lookahead_token_ids: lookahead,
                }
            },
        )
}

fn removed() -> impl Strategy<Value = BlockRemoved> {
    (
        prop::collection::vec(any::<u64>(), 0..5),
        opt_string(),
        prop::option::of(any::<u32>()),
        opt_string(),
        opt_string(),
    )
        .prop_map(
            |(block_hashes, medium, group_idx, locality, ownership)| BlockRemoved {
                block_hashes,
                medium,
                group_idx,
                locality,
                ownership,
            },
        )
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>(),
        prop::collection::vec(
            prop_oneof![
                stored().prop_map(KvEvent::BlockStored),
                removed().prop_map(KvEvent::BlockRemoved),
                prop::option::of(prop_oneof![Just("GPU"), Just("CPU"), Just("STORAGE")]).prop_map(
                    |m| KvEvent::AllBlocksCleared {
                        medium: m.map(str::to_string)
                    }
                ),
            ],
            0..6,
        ),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
            skipped: Vec::new(),
        })
}

// ------------------------------------------------------------------ random wire shapes

/// A msgpack value as written on the wire (rmpv's `Value` cannot express 0xc1, invalid UTF-8
/// through its constructors, or a header width).
#[derive(Debug, Clone)]
enum W {
    Nil,
    Reserved,
    Bool(bool),
    Uint(u64),
    Neg(i64),
    F32(f32),
    F64(f64),
    Str(Vec<u8>),
    Bin(Vec<u8>),
    Ext(i8, Vec<u8>),
    Array(Vec<W>),
    Map(Vec<(W, W)>),
}

/// Deterministic choices of header and integer widths.
struct Widths(u64);

impl Widths {
    /// One of the first `n` options (`n` ≥ 1).
    fn pick(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn header(out: &mut Vec<u8>, w: &mut Widths, len: usize, fix: Option<(u8, usize)>, wide: [u8; 3]) {
    let mut options = Vec::new();
    if let Some((_, max)) = fix {
        if len <= max {
            options.push(0);
        }
    }
    if wide[0] != 0 && len <= 0xff {
        options.push(1);
    }
    if len <= 0xffff {
        options.push(2);
    }
    options.push(3);
    match options[w.pick(options.len())] {
        0 => out.push(fix.unwrap().0 | len as u8),
        1 => out.extend_from_slice(&[wide[0], len as u8]),
        2 => {
            out.push(wide[1]);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ => {
            out.push(wide[2]);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }
}

fn encode_w(v: &W, w: &mut Widths, out: &mut Vec<u8>) {
    match v {
        W::Nil => out.push(0xc0),
        W::Reserved => out.push(0xc1),
        W::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        W::Uint(n) => {
            let n = *n;
            let mut options: Vec<Vec<u8>> = vec![];
            if n < 0x80 {
                options.push(vec![n as u8]);
            }
            if let Ok(x) = u8::try_from(n) {
                options.push([&[0xcc][..], &x.to_be_bytes()].concat());
            }
            if let Ok(x) = u16::try_from(n) {
                options.push([&[0xcd][..], &x.to_be_bytes()].concat());
            }
            if let Ok(x) = u32::try_from(n) {
                options.push([&[0xce][..], &x.to_be_bytes()].concat());
            }
            options.push([&[0xcf][..], &n.to_be_bytes()].concat());
            if let Ok(x) = i8::try_from(n) {
                options.push([&[0xd0][..], &x.to_be_bytes()].concat());
            }
            if let Ok(x) = i32::try_from(n) {
                options.push([&[0xd2][..], &x.to_be_bytes()].concat());
            }
            if let Ok(x) = i64::try_from(n) {
                options.push([&[0xd3][..], &x.to_be_bytes()].concat());
            }
            out.extend_from_slice(&options[w.pick(options.len())]);
        }
        W::Neg(n) => {
            let n = *n;
            let mut options: Vec<Vec<u8>> = vec![];
            if n >= -32 {
                options.push(vec![n as u8]);
            }
            if let Ok(x) = i8::try_from(n) {
                options.push([&[0xd0][..], &x.to_be_bytes()].concat());
            }
            if let Ok(x) = i16::try_from(n) {
                options.push([&[0xd1][..], &x.to_be_bytes()].concat());
            }
            if let Ok(x) = i32::try_from(n) {
                options.push([&[0xd2][..], &x.to_be_bytes()].concat());
            }
            options.push([&[0xd3][..], &n.to_be_bytes()].concat());
            out.extend_from_slice(&options[w.pick(options.len())]);
        }
        W::F32(f) => {
            out.push(0xca);
            out.extend_from_slice(&f.to_be_bytes());
        }
        W::F64(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        W::Str(b) => {
            header(out, w, b.len(), Some((0xa0, 31)), [0xd9, 0xda, 0xdb]);
            out.extend_from_slice(b);
        }
        W::Bin(b) => {
            header(out, w, b.len(), None, [0xc4, 0xc5, 0xc6]);
            out.extend_from_slice(b);
        }
        W::Ext(ty, b) => {
            let fix = match b.len() {
                1 => Some(0xd4),
                2 => Some(0xd5),
                4 => Some(0xd6),
                8 => Some(0xd7),
                16 => Some(0xd8),
                _ => None,
            };
            match fix {
                Some(m) if w.pick(2) == 0 => out.push(m),
                _ => header(out, w, b.len(), None, [0xc7, 0xc8, 0xc9]),
            }
            out.push(*ty as u8);
            out.extend_from_slice(b);
        }
        W::Array(items) => {
            header(out, w, items.len(), Some((0x90, 15)), [0, 0xdc, 0xdd]);
            items.iter().for_each(|i| encode_w(i, w, out));
        }
        W::Map(pairs) => {
            header(out, w, pairs.len(), Some((0x80, 15)), [0, 0xde, 0xdf]);
            for (k, v) in pairs {
                encode_w(k, w, out);
                encode_w(v, w, out);
            }
        }
    }
}

const NAMES: &[&str] = &[
    "type",
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
    "future_field",
];

const TAGS: &[&str] = &[
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVCacheTierMoved",
    "",
];

fn s(x: &str) -> W {
    W::Str(x.as_bytes().to_vec())
}

fn leaf() -> impl Strategy<Value = W> {
    prop_oneof![
        Just(W::Nil),
        Just(W::Reserved),
        any::<bool>().prop_map(W::Bool),
        any::<u64>().prop_map(W::Uint),
        (0u64..300).prop_map(W::Uint),
        (u64::from(u32::MAX) - 1..u64::from(u32::MAX) + 2).prop_map(W::Uint),
        (i64::from(i32::MAX)..=i64::MAX).prop_map(|n| W::Uint(n as u64)),
        (i64::MIN..0).prop_map(W::Neg),
        (-40i64..0).prop_map(W::Neg),
        any::<f32>().prop_map(W::F32),
        any::<f64>().prop_map(W::F64),
        "[a-zA-Z_]{0,10}".prop_map(|x| s(&x)),
        prop::sample::select(NAMES).prop_map(s),
        prop::sample::select(TAGS).prop_map(s),
        prop::collection::vec(any::<u8>(), 0..4).prop_map(W::Str),
        prop::collection::vec(any::<u8>(), 0..70).prop_map(W::Bin),
        (any::<i8>(), prop::collection::vec(any::<u8>(), 0..18)).prop_map(|(t, b)| W::Ext(t, b)),
    ]
}

fn any_w() -> impl Strategy<Value = W> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(W::Array),
            prop::collection::vec((inner.clone(), inner), 0..3).prop_map(W::Map),
        ]
    })
}

/// Integers around every boundary a field checks (u32, i64, u64).
fn edge_uint() -> impl Strategy<Value = W> {
    prop_oneof![
        (0u64..300),
        any::<u32>().prop_map(u64::from),
        (u64::from(u32::MAX) - 1..=u64::from(u32::MAX) + 1),
        (i64::MAX as u64 - 1..=i64::MAX as u64 + 1),
        (u64::MAX - 1..=u64::MAX),
        any::<u64>(),
    ]
    .prop_map(W::Uint)
}

fn neg() -> impl Strategy<Value = W> {
    prop_oneof![(i64::MIN..0), (-40i64..0), Just(i64::MIN)].prop_map(W::Neg)
}

fn nil() -> impl Strategy<Value = W> {
    prop_oneof![Just(W::Nil), Just(W::Reserved)]
}

/// A block hash as the engines send it.
fn hash_w() -> impl Strategy<Value = W> {
    prop_oneof![
        3 => any::<u64>().prop_map(W::Uint),
        1 => edge_uint(),
        2 => neg(),
        2 => prop::collection::vec(any::<u8>(), 32).prop_map(W::Bin),
        1 => prop::collection::vec(any::<u8>(), 1..=64).prop_map(W::Bin),
    ]
}

/// Not a block hash: a bin of 0 or 65+ bytes, or any other non-integer.
fn bad_hash_w() -> impl Strategy<Value = W> {
    prop_oneof![
        Just(W::Bin(Vec::new())),
        prop::collection::vec(any::<u8>(), 65..70).prop_map(W::Bin),
        leaf(),
    ]
}

fn token_w() -> impl Strategy<Value = W> {
    prop_oneof![
        2 => (0u64..0x80).prop_map(W::Uint),
        1 => any::<u32>().prop_map(|n| W::Uint(u64::from(n))),
    ]
}

/// Not a token id (or, from `leaf`, sometimes one).
fn bad_token_w() -> impl Strategy<Value = W> {
    prop_oneof![edge_uint(), neg(), leaf()]
}

/// A list of `good` values, one of which is replaced by a `bad` one a fifth of the time.
fn list_w(
    good: impl Strategy<Value = W>,
    bad: impl Strategy<Value = W>,
    max: usize,
) -> impl Strategy<Value = W> {
    (
        prop::collection::vec(good, 0..max),
        prop::option::weighted(0.2, (any::<prop::sample::Index>(), bad)),
    )
        .prop_map(|(mut items, bad)| {
            if let Some((at, b)) = bad {
                let i = at.index(items.len() + 1);
                items.insert(i, b);
            }
            W::Array(items)
        })
}

fn string_w() -> impl Strategy<Value = W> {
    prop_oneof![
        4 => "[A-Za-z_]{0,12}".prop_map(|x| s(&x)),
        1 => prop::collection::vec(any::<u8>(), 0..6).prop_map(W::Str),
        1 => Just(W::Str(b"GP\xffU".to_vec())),
        1 => prop::collection::vec(any::<u8>(), 0..6).prop_map(W::Bin),
    ]
}

/// A value for the field `name`: mostly of the field's type with boundary values, sometimes
/// null (0xc0 or 0xc1), sometimes anything.
fn field_w(name: &str) -> BoxedStrategy<W> {
    let typed: BoxedStrategy<W> = match name {
        "type" => tag().boxed(),
        "block_hashes" => list_w(hash_w(), bad_hash_w(), 5).boxed(),
        "parent_block_hash" => prop_oneof![8 => hash_w(), 1 => bad_hash_w()].boxed(),
        "token_ids" | "lookahead_token_ids" => list_w(token_w(), bad_token_w(), 40).boxed(),
        "block_size" | "group_idx" | "kv_cache_spec_sliding_window" => prop_oneof![
            6 => (0u64..300).prop_map(W::Uint),
            2 => any::<u32>().prop_map(|n| W::Uint(u64::from(n))),
            2 => edge_uint(),
            1 => neg(),
            1 => any::<f64>().prop_map(W::F64),
        ]
        .boxed(),
        "lora_id" => prop_oneof![edge_uint(), neg()].boxed(),
        "medium" | "lora_name" | "kv_cache_spec_kind" | "locality" | "ownership" | "session_id" => {
            string_w().boxed()
        }
        _ => any_w().boxed(),
    };
    prop_oneof![16 => typed, 2 => nil().boxed(), 1 => any_w().boxed()].boxed()
}

fn tag() -> impl Strategy<Value = W> {
    prop_oneof![
        12 => prop::sample::select(&TAGS[..3]).prop_map(s),
        2 => prop::sample::select(TAGS).prop_map(s),
        1 => leaf(),
        1 => Just(W::Str(b"Block\xffStored".to_vec())),
    ]
}

/// `[tag, field…]` with each position's value drawn for the field the tag puts there, up to two
/// elements past the declared fields.
fn array_event_w() -> impl Strategy<Value = W> {
    (tag(), 0usize..=17).prop_flat_map(|(t, len)| {
        let order: &[&str] = match &t {
            W::Str(b) if b.as_slice() == b"BlockRemoved" => super::BLOCK_REMOVED_FIELDS,
            _ => super::BLOCK_STORED_FIELDS,
        };
        let fields: Vec<BoxedStrategy<W>> = (0..len)
            .map(|i| field_w(order.get(i).copied().unwrap_or("future_field")))
            .collect();
        (Just(t), fields).prop_map(|(t, f)| {
            let mut items = vec![t];
            items.extend(f);
            W::Array(items)
        })
    })
}

/// `{"type": tag, field: value…}`: keys from the known names (duplicates and unknown keys
/// included) with values of their field's type, sometimes a non-string key, "type" anywhere or
/// missing.
fn map_event_w() -> impl Strategy<Value = W> {
    let pair = prop_oneof![
        8 => prop::sample::select(NAMES).prop_flat_map(|k| (Just(s(k)), field_w(k))),
        1 => (leaf(), any_w()),
    ];
    (
        prop::collection::vec(pair, 0..12),
        prop::option::weighted(0.9, (tag(), any::<prop::sample::Index>())),
    )
        .prop_map(|(mut pairs, t)| {
            if let Some((t, at)) = t {
                let i = at.index(pairs.len() + 1);
                pairs.insert(i, (s("type"), t));
            }
            W::Map(pairs)
        })
}

fn event_w() -> impl Strategy<Value = W> {
    prop_oneof![
        4 => array_event_w(),
        4 => map_event_w(),
        1 => Just(W::Array(vec![])),
        1 => any_w(),
    ]
}

fn batch_w() -> impl Strategy<Value = W> {
    let ts = prop_oneof![
        any::<f64>().prop_map(W::F64),
        any::<f32>().prop_map(W::F32),
        any::<u64>().prop_map(W::Uint),
        neg(),
        leaf(),
    ];
    let events = prop_oneof![
        8 => prop::collection::vec(event_w(), 0..6).prop_map(W::Array),
        1 => leaf(),
    ];
    let rank = prop_oneof![edge_uint(), neg(), nil(), any_w()];
    (ts, events, prop::collection::vec(rank, 0..3)).prop_map(|(ts, events, rest)| {
        let mut items = vec![ts, events];
        items.extend(rest);
        W::Array(items)
    })
}

/// Byte edits and a cut, as the fuzz target does.
fn mutate(
    mut p: Vec<u8>,
    edits: &[(prop::sample::Index, u8)],
    cut: Option<prop::sample::Index>,
) -> Vec<u8> {
    if !p.is_empty() {
        for (at, byte) in edits {
            let i = at.index(p.len());
            p[i] = *byte;
        }
    }
    if let Some(cut) = cut {
        let n = cut.index(p.len() + 1);
        p.truncate(n);
    }
    p
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn valid_batches_take_the_fast_path_in_both_shapes(b in batch(), seed in 1u64.., recode in any::<bool>()) {
        for shape in [EventShape::Array, EventShape::Map] {
            let mut bytes = encode_batch(&b, shape);
            if recode {
                // The same batch with random header and integer widths.
                let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
                let mut out = Vec::new();
                encode_w(&from_value(&v), &mut Widths(seed), &mut out);
                bytes = out;
            }
            prop_assert!(assert_agree(&bytes)?, "fell back on a valid batch ({:?})", shape);
        }
    }

    #[test]
    fn random_wire_shapes_agree(v in batch_w(), seed in 1u64..) {
        let mut bytes = Vec::new();
        encode_w(&v, &mut Widths(seed), &mut bytes);
        let answered = assert_agree(&bytes)?;
        // The generator nests far less than the fast path's limit: it falls back only where the
        // reference fails the whole batch.
        prop_assert_eq!(answered, decode_batch_value(&bytes).is_ok(), "payload {:02x?}", bytes);
    }

    #[test]
    fn mutated_wire_shapes_agree(
        v in batch_w(),
        seed in 1u64..,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = Vec::new();
        encode_w(&v, &mut Widths(seed), &mut bytes);
        assert_agree(&mutate(bytes, &edits, cut))?;
    }

    #[test]
    fn mutated_genuine_frames_agree(
        which in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let frames = golden_payloads();
        let p = frames[which.index(frames.len())].clone();
        assert_agree(&mutate(p, &edits, cut))?;
    }

    #[test]
    fn random_bytes_agree(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        assert_agree(&bytes)?;
    }
}

/// An rmpv value as a wire value (for re-encoding with other widths).
fn from_value(v: &Value) -> W {
    match v {
        Value::Nil => W::Nil,
        Value::Boolean(b) => W::Bool(*b),
        Value::Integer(i) => match i.as_u64() {
            Some(u) => W::Uint(u),
            None => W::Neg(i.as_i64().unwrap()),
        },
        Value::F32(f) => W::F32(*f),
        Value::F64(f) => W::F64(*f),
        Value::String(x) => W::Str(x.as_bytes().to_vec()),
        Value::Binary(b) => W::Bin(b.clone()),
        Value::Ext(t, b) => W::Ext(*t, b.clone()),
        Value::Array(a) => W::Array(a.iter().map(from_value).collect()),
        Value::Map(m) => W::Map(
            m.iter()
                .map(|(k, v)| (from_value(k), from_value(v)))
                .collect(),
        ),
    }
}

#[test]
fn wide_headers_and_duplicate_keys_decode_on_the_fast_path() {
    // map32 event, str16 keys, a u64-marked small block_size, a duplicate medium (last wins),
    // an earlier bad token_ids overridden by a later good one, "type" last.
    let ev = W::Map(vec![
        (s("token_ids"), s("oops")),
        (
            s("block_hashes"),
            W::Array(vec![W::Neg(-2), W::Bin(vec![1, 2, 3])]),
        ),
        (s("medium"), s("CPU")),
        (s("medium"), W::Uint(3)),
        (s("block_size"), W::Uint(16)),
        (s("token_ids"), W::Array(vec![W::Uint(1), W::Uint(300)])),
        (W::Uint(1), W::Nil),
        (s("type"), s("BlockStored")),
    ]);
    let b = W::Array(vec![W::Uint(7), W::Array(vec![ev]), W::Uint(2), W::Nil]);
    for seed in 1..64 {
        let mut bytes = Vec::new();
        encode_w(&b, &mut Widths(seed), &mut bytes);
        let got = stream::decode_batch(&bytes).unwrap();
        assert_eq!(Ok(&got), decode_batch_value(&bytes).as_ref());
        assert_eq!(got.ts, 7.0);
        assert_eq!(got.data_parallel_rank, Some(2));
        assert_eq!(
            got.events,
            vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![(-2i64) as u64, 0x010203],
                token_ids: vec![1, 300],
                block_size: 16,
                ..BlockStored::default()
            })]
        );
    }
}

#[test]
fn skipped_events_are_decided_on_the_fast_path_with_the_reference_reasons() {
    let events = W::Array(vec![
        W::Array(vec![s("KVCacheTierMoved"), W::Uint(1)]),
        W::Array(vec![]),
        W::Array(vec![W::Uint(1)]),
        W::Uint(7),
        W::Map(vec![(s("block_hashes"), W::Array(vec![]))]),
        W::Map(vec![(s("type"), W::Nil)]),
        // Both bad: the reference reports block_hashes (evaluated first), not token_ids.
        W::Map(vec![
            (s("token_ids"), W::Array(vec![W::Neg(-1)])),
            (s("block_hashes"), s("x")),
            (s("type"), s("BlockStored")),
        ]),
        W::Array(vec![
            s("BlockStored"),
            W::Array(vec![]),
            W::Nil,
            W::Nil,
            W::F64(1.0),
        ]),
        W::Array(vec![s("BlockRemoved"), W::Nil, W::Nil, W::Uint(1 << 40)]),
        W::Array(vec![s("BlockStored"), W::Array(vec![W::Bin(vec![0; 65])])]),
        W::Array(vec![s("AllBlocksCleared"), W::Map(vec![(W::Nil, W::Nil)])]),
    ]);
    let mut bytes = Vec::new();
    encode_w(
        &W::Array(vec![W::F64(1.0), events]),
        &mut Widths(1),
        &mut bytes,
    );
    let got = stream::decode_batch(&bytes).unwrap();
    assert_eq!(Ok(&got), decode_batch_value(&bytes).as_ref());
    let reasons: Vec<_> = got
        .skipped
        .iter()
        .map(|s| (s.index, s.error.clone()))
        .collect();
    assert_eq!(
        reasons,
        vec![
            (0, DecodeError::UnknownTag("KVCacheTierMoved".into())),
            (1, DecodeError::BadEvent("empty array")),
            (2, DecodeError::BadEvent("tag is not a string")),
            (3, DecodeError::BadEvent("neither array nor map")),
            (4, DecodeError::BadEvent("map without type")),
            (5, DecodeError::BadEvent("tag is not a string")),
            (6, DecodeError::BadHash("block_hashes")),
            (7, DecodeError::BadField("block_size")),
            (8, DecodeError::BadField("group_idx")),
            (9, DecodeError::BadHash("block_hashes")),
        ]
    );
    assert_eq!(got.events, vec![KvEvent::AllBlocksCleared { medium: None }]);
}
