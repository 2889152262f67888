//! Golden tests: every frame captured from the genuine vLLM/SGLang publishers
//! (`testdata/kv-events/*.json`) decodes to the JSON the engine's
//! own types produced, field by field; and content keys chained along the engine's parent links
//! equal `chain` over the same tokens.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ic_shared::kv::content_key::{block_key, chain, ROOT};
use ic_shared::kv::decode::{decode_batch, EventBatch, KvEvent};
use serde_json::Value as Json;

/// The repository's golden recordings (`testdata/kv-events`).
fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events")
}

fn fixture_files() -> Vec<(String, Json)> {
    let dir = fixtures_dir();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".json") || name == "hash-vectors.json" {
            continue;
        }
        let doc: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        out.push((name, doc));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        out.len() >= 6,
        "expected the six engine fixtures, found {}",
        out.len()
    );
    out
}

fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap()
}

/// A JSON hash (int, possibly negative, or hex digest string) as the u64 we decode to.
fn json_hash(v: &Json) -> u64 {
    if let Some(u) = v.as_u64() {
        u
    } else if let Some(i) = v.as_i64() {
        i as u64
    } else if let Some(s) = v.as_str() {
        let b = unhex(s);
        assert!(!b.is_empty());
        let tail = &b[b.len().saturating_sub(8)..];
        tail.iter().fold(0u64, |a, x| (a << 8) | u64::from(*x))
    } else {
        panic!("bad expected hash {v}")
    }
}

fn rmpv_to_json(v: &rmpv::Value) -> Json {
    match v {
        rmpv::Value::Nil => Json::Null,
        rmpv::Value::Boolean(b) => Json::Bool(*b),
        rmpv::Value::Integer(i) => {
            if let Some(u) = i.as_u64() {
                Json::from(u)
            } else {
                Json::from(i.as_i64().unwrap())
            }
        }
        rmpv::Value::F32(f) => Json::from(f64::from(*f)),
        rmpv::Value::F64(f) => Json::from(*f),
        rmpv::Value::String(s) => Json::from(s.as_str().unwrap()),
        rmpv::Value::Binary(b) => Json::from(hex::encode(b)),
        rmpv::Value::Array(a) => Json::Array(a.iter().map(rmpv_to_json).collect()),
        rmpv::Value::Map(m) => Json::Object(
            m.iter()
                .map(|(k, v)| (k.as_str().unwrap().to_string(), rmpv_to_json(v)))
                .collect(),
        ),
        rmpv::Value::Ext(_, _) => panic!("ext in fixture"),
    }
}

fn opt_str(v: &Option<String>) -> Json {
    v.as_ref()
        .map(|s| Json::from(s.as_str()))
        .unwrap_or(Json::Null)
}

fn opt_num<T: Into<Json> + Copy>(v: Option<T>) -> Json {
    v.map(Into::into).unwrap_or(Json::Null)
}

/// Compares one decoded event with its expected JSON, every field the JSON names.
fn check_event(ctx: &str, got: &KvEvent, want: &Json) {
    let obj = want.as_object().unwrap();
    let tag = obj["type"].as_str().unwrap();
    assert_eq!(got.tag(), tag, "{ctx}: tag");
    for (key, exp) in obj {
        let ctx = format!("{ctx}: {tag}.{key}");
        // `_note` is the recorder's comment; SGLang's trailing `metadata` map
        // (BlockStoredWithMetadata) is deliberately not decoded.
        if key == "type" || key.starts_with('_') || key == "metadata" {
            continue;
        }
        match got {
            KvEvent::BlockStored(s) => match key.as_str() {
                "block_hashes" => {
                    let e: Vec<u64> = exp.as_array().unwrap().iter().map(json_hash).collect();
                    assert_eq!(s.block_hashes, e, "{ctx}");
                }
                "parent_block_hash" => {
                    let e = (!exp.is_null()).then(|| json_hash(exp));
                    assert_eq!(s.parent_block_hash, e, "{ctx}");
                }
                "token_ids" => {
                    let e: Vec<u32> = exp
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
                        .collect();
                    assert_eq!(s.token_ids, e, "{ctx}");
                }
                "block_size" => assert_eq!(Json::from(s.block_size), *exp, "{ctx}"),
                "lora_id" => assert_eq!(opt_num(s.lora_id), *exp, "{ctx}"),
                "medium" => assert_eq!(opt_str(&s.medium), *exp, "{ctx}"),
                "lora_name" => assert_eq!(opt_str(&s.lora_name), *exp, "{ctx}"),
                "extra_keys" => {
                    let g = s
                        .extra_keys
                        .as_ref()
                        .map(rmpv_to_json)
                        .unwrap_or(Json::Null);
                    assert_eq!(g, *exp, "{ctx}");
                }
                "group_idx" => assert_eq!(opt_num(s.group_idx), *exp, "{ctx}"),
                "kv_cache_spec_kind" => assert_eq!(opt_str(&s.kv_cache_spec_kind), *exp, "{ctx}"),
                "kv_cache_spec_sliding_window" => {
                    assert_eq!(opt_num(s.kv_cache_spec_sliding_window), *exp, "{ctx}")
                }
                "locality" => assert_eq!(opt_str(&s.locality), *exp, "{ctx}"),
                "ownership" => assert_eq!(opt_str(&s.ownership), *exp, "{ctx}"),
                "session_id" => assert_eq!(opt_str(&s.session_id), *exp, "{ctx}"),
                "lookahead_token_ids" => {
                    let g = s
                        .lookahead_token_ids
                        .as_ref()
                        .map(|v| Json::from(v.clone()))
                        .unwrap_or(Json::Null);
                    assert_eq!(g, *exp, "{ctx}");
                }
                other => panic!("{ctx}: expected field {other} is not decoded"),
            },
            KvEvent::BlockRemoved(r) => match key.as_str() {
                "block_hashes" => {
                    let e: Vec<u64> = exp.as_array().unwrap().iter().map(json_hash).collect();
                    assert_eq!(r.block_hashes, e, "{ctx}");
                }
                "medium" => assert_eq!(opt_str(&r.medium), *exp, "{ctx}"),
                "group_idx" => assert_eq!(opt_num(r.group_idx), *exp, "{ctx}"),
                "locality" => assert_eq!(opt_str(&r.locality), *exp, "{ctx}"),
                "ownership" => assert_eq!(opt_str(&r.ownership), *exp, "{ctx}"),
                other => panic!("{ctx}: expected field {other} is not decoded"),
            },
            KvEvent::AllBlocksCleared { .. } => panic!("{ctx}: AllBlocksCleared has no fields"),
        }
    }
}

fn check_batch(ctx: &str, got: &EventBatch, want: &Json) {
    assert!(got.skipped.is_empty(), "{ctx}: skipped {:?}", got.skipped);
    assert_eq!(got.ts, want["ts"].as_f64().unwrap(), "{ctx}: ts");
    let rank = want
        .get("data_parallel_rank")
        .or_else(|| want.get("attn_dp_rank"))
        .and_then(Json::as_u64)
        .map(|r| u32::try_from(r).unwrap());
    assert_eq!(got.data_parallel_rank, rank, "{ctx}: rank");
    let events = want["events"].as_array().unwrap();
    assert_eq!(got.events.len(), events.len(), "{ctx}: event count");
    for (i, (g, w)) in got.events.iter().zip(events).enumerate() {
        check_event(&format!("{ctx} event {i}"), g, w);
    }
}

/// The raw shape of the first event of a payload: "array" or "map".
fn raw_event_shape(payload: &[u8]) -> Option<&'static str> {
    let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let first = v.as_array()?.get(1)?.as_array()?.first()?.clone();
    Some(if first.is_array() { "array" } else { "map" })
}

#[test]
fn every_live_frame_decodes_to_its_expected_json() {
    let mut shapes = std::collections::BTreeSet::new();
    let mut frames = 0;
    let mut bin_hashes = 0;
    let mut negative_hashes = 0;
    for (name, doc) in fixture_files() {
        let encoding = doc["event_encoding"].as_str().unwrap();
        for live in doc["live"].as_array().unwrap() {
            let ctx = format!("{name} {} {}", live["source"], live["label"]);
            let f = live["frames_hex"].as_array().unwrap();
            assert_eq!(f.len(), 3, "{ctx}: live messages are 3 frames");
            let seq = unhex(f[1].as_str().unwrap());
            assert_eq!(seq.len(), 8, "{ctx}");
            let seq = u64::from_be_bytes(seq.try_into().unwrap());
            assert_eq!(seq, live["seq"].as_u64().unwrap(), "{ctx}: seq");
            let payload = unhex(f[2].as_str().unwrap());
            let got = decode_batch(&payload).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            check_batch(&ctx, &got, &live["expected"]);
            if let Some(shape) = raw_event_shape(&payload) {
                assert_eq!(shape, encoding, "{ctx}: wire shape");
                shapes.insert(shape);
            }
            let exp = live["expected"].to_string();
            if exp.contains("\"block_hashes\":[\"") {
                bin_hashes += 1;
            }
            if live["expected"]["events"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|e| e["block_hashes"].as_array().cloned().unwrap_or_default())
                .any(|h| h.as_i64().is_some_and(|i| i < 0))
            {
                negative_hashes += 1;
            }
            frames += 1;
        }
    }
    assert_eq!(shapes.len(), 2, "both array and map shapes covered");
    assert!(bin_hashes >= 6, "bin hashes covered ({bin_hashes})");
    assert!(
        negative_hashes >= 2,
        "i64 hashes covered ({negative_hashes})"
    );
    assert!(frames >= 60, "{frames} frames");
}

#[test]
fn every_replay_reply_decodes_like_the_live_frame_of_its_seq() {
    for (name, doc) in fixture_files() {
        let live: HashMap<u64, &Json> = doc["live"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["source"] == "dp0")
            .map(|l| (l["seq"].as_u64().unwrap(), &l["expected"]))
            .collect();
        let replies = doc["replay"].as_array().unwrap();
        let mut next = 1u64;
        for (i, reply) in replies.iter().enumerate() {
            let ctx = format!("{name} replay {i}");
            let f: Vec<Vec<u8>> = reply["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| unhex(h.as_str().unwrap()))
                .collect();
            assert!(f.len() == 3 || f.len() == 4, "{ctx}: {} frames", f.len());
            assert!(f[0].is_empty(), "{ctx}: leading empty delimiter");
            // seq is the second-to-last frame, the payload the last.
            let seq = u64::from_be_bytes(f[f.len() - 2].clone().try_into().unwrap());
            let payload = &f[f.len() - 1];
            if reply["end_marker"].as_bool() == Some(true) {
                assert_eq!(seq, u64::MAX, "{ctx}");
                assert!(payload.is_empty(), "{ctx}");
                assert_eq!(i, replies.len() - 1, "{ctx}: end marker last");
                continue;
            }
            assert_eq!(seq, next, "{ctx}: contiguous from the requested start");
            next += 1;
            let got = decode_batch(payload).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            check_batch(&ctx, &got, live[&seq]);
        }
        assert!(next > 2, "{name}: replay carried batches");
    }
}

/// Follows engine parent links exactly as the agent does (per group, `block_key` from the parent's
/// content key) and checks every full block's key equals `chain` over its whole token prefix.
#[test]
fn chaining_along_engine_events_equals_chain_over_the_tokens() {
    let mut checked = 0;
    for (name, doc) in fixture_files() {
        for source in ["dp0", "dp1", "dp2"] {
            // (group, engine hash) -> (content key, token prefix through this block, uniform).
            let mut known: HashMap<(u32, u64), (u64, Vec<u32>, bool)> = HashMap::new();
            for live in doc["live"].as_array().unwrap() {
                if live["source"] != source {
                    continue;
                }
                let payload = unhex(live["frames_hex"][2].as_str().unwrap());
                for ev in decode_batch(&payload).unwrap().events {
                    let s = match ev {
                        KvEvent::AllBlocksCleared { .. } => {
                            known.clear();
                            continue;
                        }
                        KvEvent::BlockRemoved(_) => continue,
                        KvEvent::BlockStored(s) => s,
                    };
                    let g = s.group_idx.unwrap_or(0);
                    let (mut key, mut prefix, mut uniform) = match s.parent_block_hash {
                        None => (ROOT, Vec::new(), true),
                        Some(p) => known
                            .get(&(g, p))
                            .cloned()
                            .unwrap_or_else(|| panic!("{name} {source}: unknown parent")),
                    };
                    let bs = s.block_size as usize;
                    for (i, h) in s.block_hashes.iter().enumerate() {
                        let end = ((i + 1) * bs).min(s.token_ids.len());
                        let block = &s.token_ids[i * bs..end];
                        key = block_key(key, block);
                        prefix.extend_from_slice(block);
                        uniform &= block.len() == 16;
                        if uniform {
                            assert_eq!(chain(&prefix, 16).last(), Some(&key), "{name} {source}");
                            checked += 1;
                        }
                        known.insert((g, *h), (key, prefix.clone(), uniform));
                    }
                }
            }
        }
    }
    assert!(checked >= 40, "{checked} blocks checked");
    // The scenario's request A (tokens 0..63) and B (0..15 + 1000..1015) in absolute terms.
    let a: Vec<u32> = (0..64).collect();
    assert_eq!(chain(&a, 16).len(), 4);
}
