//! SGLang 0.5.5's radix cache through the agent's stream state (issue 39 item 9).
//!
//! `testdata/kv-events/radix/sglang-0.5.5.json` holds the batches SGLang 0.5.5's own
//! `RadixCache` emits (`scripts/sglang-radix-events.py` runs the wheel's `radix_cache.py` and
//! encodes each step with its `KVEventBatch`): every radix node's first page is parentless and
//! page hashes are `hash(tuple(page_tokens))`. The index the stream builds must hold only keys of
//! prefixes the engine really caches (a continuation page is never reachable as a prompt's first
//! block), and a repeated page must not cost the prefix its hint. The last test re-runs the
//! generator against the wheel's files (`scripts/fetch-sglang-radix.sh`, run by
//! `scripts/setup.sh`) and requires the committed batches to be what SGLang emits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use ic_agent::kv::{StreamConfig, StreamState};
use ic_shared::kv::content_key::chain;
use ic_shared::kv::coverage::CoverageState;
use ic_shared::kv::decode::decode_batch;
use ic_shared::proto::kv_op::Op;

const PAGE: u32 = 16;

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events/radix/sglang-0.5.5.json")
}

fn fixture() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_path()).expect("fixture");
    serde_json::from_str(&text).expect("fixture json")
}

fn tokens(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("token list")
        .iter()
        .map(|t| t.as_u64().expect("token") as u32)
        .collect()
}

/// Applies one scenario's batches to a fresh stream; returns the stream and the index its ops
/// build (content key → tier).
fn run(scenario: &serde_json::Value) -> (StreamState, BTreeMap<u64, i32>) {
    let mut st = StreamState::new(StreamConfig {
        block_size: PAGE,
        ..StreamConfig::default()
    });
    let mut index = BTreeMap::new();
    for (seq, step) in scenario["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .enumerate()
    {
        let payload = hex::decode(step["payload_hex"].as_str().expect("hex")).expect("hex");
        let batch = decode_batch(&payload).expect("SGLang's batch decodes");
        st.apply(seq as u64, &batch, 0);
        if let Some((_, ops, _)) = st.take_delta() {
            for op in ops {
                match op.op {
                    Some(Op::Store(s)) => {
                        assert_eq!(s.block_size, PAGE);
                        for k in s.content_keys {
                            index.insert(k, s.tier);
                        }
                    }
                    Some(Op::Remove(r)) => {
                        for k in r.content_keys {
                            index.remove(&k);
                        }
                    }
                    Some(Op::Clear(_)) => index.clear(),
                    None => {}
                }
            }
        }
    }
    (st, index)
}

/// Blocks of `probe` a lookup matches: consecutive content keys from block 0.
fn depth(index: &BTreeMap<u64, i32>, probe: &[u32]) -> usize {
    chain(probe, PAGE as usize)
        .iter()
        .take_while(|k| index.contains_key(k))
        .count()
}

/// Pages of `probe` the engine really caches: its longest page-aligned common prefix with a
/// request inserted.
fn truth_depth(requests: &[Vec<u32>], probe: &[u32]) -> usize {
    let p = chain(probe, PAGE as usize);
    requests
        .iter()
        .map(|r| {
            let c = chain(r, PAGE as usize);
            p.iter().zip(&c).take_while(|(a, b)| a == b).count()
        })
        .max()
        .unwrap_or(0)
}

fn scenario(label_start: &str) -> serde_json::Value {
    fixture()["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .find(|s| s["label"].as_str().unwrap_or("").starts_with(label_start))
        .cloned()
        .expect("scenario")
}

#[test]
fn a_parentless_continuation_page_is_never_a_prompt_root() {
    let s = scenario("split and continuation");
    let requests: Vec<Vec<u32>> = s["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(tokens)
        .collect();
    let (st, index) = run(&s);
    let truth: BTreeSet<u64> = requests
        .iter()
        .flat_map(|r| chain(r, PAGE as usize))
        .collect();
    for k in index.keys() {
        assert!(
            truth.contains(k),
            "indexed key {k:#x} is no prefix the engine caches"
        );
    }
    for probe in s["probes"].as_array().expect("probes").iter().map(tokens) {
        let (got, real) = (depth(&index, &probe), truth_depth(&requests, &probe));
        assert!(
            got <= real,
            "a prompt starting at token {} matches {got} pages, the engine caches {real}",
            probe[0]
        );
    }
    // The prompt starting at token 32 (a continuation page sent without its parent) matches
    // nothing; the real first pages still do.
    let from_32: Vec<u32> = (32..64).collect();
    assert_eq!(depth(&index, &from_32), 0);
    let from_0: Vec<u32> = (0..64).collect();
    assert!(
        depth(&index, &from_0) >= 2,
        "the prompt's real first pages keep their hint"
    );
    // Pages the engine holds but the stream could not place: a subset, and said so.
    let c = st.coverage();
    assert_eq!(c.state, CoverageState::Partial, "{c:?}");
}

#[test]
fn a_repeated_page_keeps_the_whole_prefix_hinted() {
    let s = scenario("repeated page: P Q S P T");
    let requests: Vec<Vec<u32>> = s["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(tokens)
        .collect();
    let (st, index) = run(&s);
    let req = &requests[0];
    assert_eq!(req.len(), 80);
    assert_eq!(depth(&index, req), 5, "every page of P Q S P T is matched");
    let truth: BTreeSet<u64> = chain(req, PAGE as usize).into_iter().collect();
    assert_eq!(index.keys().copied().collect::<BTreeSet<_>>(), truth);
    // A prompt P T (page 3's content at page 0, then T) is no prefix the engine holds.
    let p_t: Vec<u32> = (0..16).chain(48..64).collect();
    assert_eq!(depth(&index, &p_t), 1);
    assert!(st.coverage().state.routable());
}

#[test]
fn a_repeated_page_evicted_leaves_nothing_indexed() {
    let s = scenario("repeated page evicted");
    let (st, index) = run(&s);
    assert!(
        index.is_empty(),
        "left after every page was removed: {index:?}"
    );
    assert!(st.coverage().state.routable());
}

/// Where `scripts/fetch-sglang-radix.sh` put the wheel's files, and the venv of
/// `scripts/fetch-sglang.sh`.
fn sglang_dir() -> PathBuf {
    let base = std::env::var_os("IC_SGLANG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ci-cache/sglang")
        });
    assert!(
        base.join("0.5.5/sglang/srt/mem_cache/radix_cache.py").is_file()
            && base.join("venv/bin/python").is_file(),
        "SGLang 0.5.5's radix cache is not at {}: run scripts/setup.sh (or scripts/fetch-sglang.sh \
         and scripts/fetch-sglang-radix.sh) or set IC_SGLANG_DIR",
        base.display()
    );
    base
}

#[test]
fn the_committed_batches_are_what_sglang_0_5_5_emits() {
    let dir = sglang_dir();
    let out = Command::new(dir.join("venv/bin/python"))
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/sglang-radix-events.py"))
        .arg(dir.join("0.5.5"))
        .output()
        .expect("run the generator");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed = std::fs::read_to_string(fixture_path()).expect("fixture");
    assert_eq!(String::from_utf8_lossy(&out.stdout), committed);
}
