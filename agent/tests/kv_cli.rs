//! The troubleshooting CLI: `ic-agent kv decode` on every golden fixture (the binary itself, fed
//! the fixture file, hex lines on stdin and a ZMTP dump) decodes every frame to the engine's own
//! JSON; `kv tail` over real sockets prints live batches, the gap and what replay brought back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use ic_agent::kv::inspect::{parse_input, write_zmtp};
use ic_agent::kv::tail::{tail, TailOptions};
use ic_agent::kv::{publish_fixture, PublishOptions};
use serde_json::Value;

/// The repository's golden recordings (`testdata/kv-events`).
fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events")
}

fn fixtures() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(fixtures_dir()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".json") || name == "hash-vectors.json" {
            continue;
        }
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        out.push((name, doc));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 6, "expected the engine fixtures");
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An expected hash (int, negative int, or hex digest) as the u64 the decoder reduces it to.
fn hash_value(v: &Value) -> Value {
    if v.is_u64() {
        return v.clone();
    }
    if let Some(i) = v.as_i64() {
        return Value::from(i as u64);
    }
    if let Some(s) = v.as_str() {
        let b = hex::decode(s).unwrap();
        let tail = &b[b.len().saturating_sub(8)..];
        return Value::from(tail.iter().fold(0u64, |a, x| (a << 8) | u64::from(*x)));
    }
    v.clone()
}

/// Compares a decoded message (CLI JSON) with the fixture's `expected` batch, field by field.
fn check(ctx: &str, got: &Value, expected: &Value) {
    assert!(got.get("error").is_none(), "{ctx}: {got}");
    assert_eq!(got["ts"].as_f64(), expected["ts"].as_f64(), "{ctx}: ts");
    let rank = expected
        .get("data_parallel_rank")
        .or_else(|| expected.get("attn_dp_rank"));
    if let Some(r) = rank {
        assert_eq!(&got["data_parallel_rank"], r, "{ctx}: rank");
    }
    let want = expected["events"].as_array().unwrap();
    let have = got["events"].as_array().unwrap();
    assert_eq!(have.len(), want.len(), "{ctx}: event count");
    for (i, (h, w)) in have.iter().zip(want).enumerate() {
        for (k, v) in w.as_object().unwrap() {
            // Recorder notes and SGLang's metadata map are not decoded.
            if k.starts_with('_') || k == "metadata" {
                continue;
            }
            let ctx = format!("{ctx}: event {i} field {k}");
            match k.as_str() {
                "block_hashes" => {
                    let w: Vec<Value> = v.as_array().unwrap().iter().map(hash_value).collect();
                    assert_eq!(h[k].as_array().unwrap(), &w, "{ctx}");
                }
                "parent_block_hash" => assert_eq!(h[k], hash_value(v), "{ctx}"),
                _ => assert_eq!(&h[k], v, "{ctx}"),
            }
        }
    }
}

fn ic_agent(args: &[&str], stdin: Option<&[u8]>) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        input.write_all(bytes).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
    )
}

#[test]
fn kv_decode_prints_every_golden_frame_as_the_engine_json() {
    for (name, doc) in fixtures() {
        let live = doc["live"].as_array().unwrap();
        let replay = doc["replay"].as_array().unwrap();

        // 1. The fixture file itself: every live message, then every replay reply.
        let path = fixtures_dir().join(&name);
        let (code, out) = ic_agent(&["kv", "decode", path.to_str().unwrap()], None);
        assert_eq!(code, 0, "{name}: {out}");
        let docs: Vec<Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(docs.len(), live.len() + replay.len(), "{name}");
        for (i, l) in live.iter().enumerate() {
            let ctx = format!("{name} live[{i}] ({})", l["label"]);
            assert_eq!(docs[i]["seq"], l["seq"], "{ctx}");
            let topic =
                String::from_utf8(hex::decode(l["frames_hex"][0].as_str().unwrap()).unwrap())
                    .unwrap();
            assert_eq!(docs[i]["topic"], topic, "{ctx}");
            check(&ctx, &docs[i], &l["expected"]);
        }
        let end = &docs[docs.len() - 1];
        assert_eq!(end["endMarker"], true, "{name}: end marker");
        // Replies decode to the same batch as the live message of their seq (source dp0).
        for d in &docs[live.len()..docs.len() - 1] {
            let seq = d["seq"].as_u64().unwrap();
            let l = live
                .iter()
                .find(|l| l["seq"] == seq && l["source"] == "dp0")
                .unwrap_or_else(|| panic!("{name}: replayed seq {seq} not live"));
            check(&format!("{name} replay seq {seq}"), d, &l["expected"]);
        }

        // 2. Hex lines on stdin (frames separated by spaces; an empty frame as "-").
        let mut text = String::from("# captured frames\n");
        for l in live {
            let frames: Vec<&str> = l["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| match f.as_str().unwrap() {
                    "" => "-",
                    s => s,
                })
                .collect();
            text.push_str(&frames.join(" "));
            text.push('\n');
        }
        let (code, out) = ic_agent(&["kv", "decode", "--lines"], Some(text.as_bytes()));
        assert_eq!(code, 0, "{name}");
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), live.len());
        for (i, l) in live.iter().enumerate() {
            check(&format!("{name} hex line {i}"), &lines[i], &l["expected"]);
        }

        // 3. A raw ZMTP multipart dump of the same messages.
        let mut dump = Vec::new();
        for l in live {
            let frames: Vec<Vec<u8>> = l["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| hex::decode(f.as_str().unwrap()).unwrap())
                .collect();
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            write_zmtp(&mut dump, &refs);
        }
        let msgs = parse_input(&dump).unwrap();
        assert_eq!(msgs.len(), live.len());
        let (code, out) = ic_agent(&["kv", "decode", "-"], Some(&dump));
        assert_eq!(code, 0);
        let docs: Vec<Value> = serde_json::from_str(&out).unwrap();
        for (i, l) in live.iter().enumerate() {
            check(&format!("{name} zmtp {i}"), &docs[i], &l["expected"]);
        }
    }
}

#[test]
fn kv_decode_reports_undecodable_payloads_and_exits_1() {
    let (code, out) = ic_agent(
        &["kv", "decode", "--lines"],
        Some(b"6b76 0000000000000001 cd01\n"),
    );
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["seq"], 1);
    assert_eq!(v["reason"], "not_msgpack");
    let (code, _) = ic_agent(&["kv", "decode"], Some(b"6b76 zz\n"));
    assert_ne!(code, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_tail_prints_batches_the_gap_and_the_replayed_batch() {
    let fixture = fixtures_dir().join("vllm-0.26.0.json");
    let (pub_port, replay_port) = (free_port(), free_port());
    let endpoint = format!("tcp://127.0.0.1:{pub_port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let publisher = {
        let (fixture, endpoint, replay) = (fixture.clone(), endpoint.clone(), replay.clone());
        tokio::spawn(async move {
            let opts = PublishOptions {
                connect_wait: Duration::from_millis(1200),
                interval: Duration::from_millis(30),
                linger: Duration::from_secs(5),
                skip_seqs: [3].into_iter().collect(),
                ..PublishOptions::default()
            };
            publish_fixture(&fixture, &endpoint, Some(&replay), &opts).await
        })
    };
    let mut opts = TailOptions::new(endpoint);
    opts.replay = Some(replay);
    opts.topic = "kv@".into();
    opts.json = true;
    opts.count = Some(9); // dp0 publishes seqs 0..=9 live, minus the withheld 3
    let mut out: Vec<u8> = Vec::new();
    let mut save: Vec<u8> = Vec::new();
    let summary = tokio::time::timeout(
        Duration::from_secs(20),
        tail(&opts, &mut out, Some(&mut save)),
    )
    .await
    .expect("tail finishes")
    .unwrap();
    publisher.abort();
    assert_eq!(
        (summary.live, summary.gaps, summary.healed, summary.replayed),
        (9, 1, 1, 1)
    );
    let lines: Vec<Value> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seqs: Vec<(String, u64)> = lines
        .iter()
        .filter(|l| l.get("seq").is_some())
        .map(|l| {
            (
                l["source"].as_str().unwrap().to_string(),
                l["seq"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: Vec<(String, u64)> = [0, 1, 2]
        .iter()
        .map(|s| ("live".to_string(), *s))
        .chain([("replay".to_string(), 3)])
        .chain((4..=9).map(|s| ("live".to_string(), s)))
        .collect();
    assert_eq!(seqs, want);
    let gap = lines.iter().find(|l| l["notice"] == "gap").unwrap();
    assert_eq!(
        (gap["missingFrom"].as_u64(), gap["got"].as_u64()),
        (Some(3), Some(4))
    );
    let rep = lines.iter().find(|l| l["notice"] == "replay").unwrap();
    assert_eq!(rep["complete"], true);
    // The saved dump reads back as the 9 live messages.
    let saved = parse_input(&save).unwrap();
    assert_eq!(saved.len(), 9);
    assert_eq!(saved[3].seq, Some(4));
}

/// `ic-agent kv publish` as the README runs it: it says when the last frame is out and it only
/// serves replay requests (the default linger is an hour), and SIGTERM ends it with the summary
/// and exit status 0. An endpoint without `tcp://` is refused with what to write instead.
#[test]
fn kv_publish_reports_the_linger_and_prints_its_summary_on_sigterm() {
    use std::io::{BufRead, BufReader};
    let fixture = fixtures_dir().join("vllm-0.24.0.json");
    let fixture = fixture.to_str().unwrap();
    let (pub_port, replay_port) = (free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args(["kv", "publish", "--fixture", fixture, "--until-seq", "8"])
        .args(["--endpoint", &format!("tcp://127.0.0.1:{pub_port}")])
        .args([
            "--replay-endpoint",
            &format!("tcp://127.0.0.1:{replay_port}"),
        ])
        .args(["--connect-wait-ms", "0", "--interval-ms", "1"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("last frame published") {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "exited early:\n{seen}"
        );
        seen.push_str(&line);
    }
    assert!(seen.contains("linger_seconds=3600"), "{seen}");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{seen}{rest}");
    // seqs 0..=8 of dp0 (the recording's seq 9 is after --until-seq)
    assert!(
        rest.contains("published 9 batches (0 withheld), answered 0 replay requests"),
        "{rest}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_ic-agent"))
        .args([
            "kv",
            "publish",
            "--fixture",
            fixture,
            "--endpoint",
            "127.0.0.1:5557",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no transport: write tcp://127.0.0.1:5557 (or ipc://PATH)")
            && !err.contains("Could not parse"),
        "{err}"
    );
}
