//! Tokenization cost of LookupRoute `prompt_text` (issue 19 item 1): what the router adds to a
//! lookup before the index sees any id.
//!
//! `cargo bench -p ic-controller --bench tokenize` — criterion's statistics for
//! `Tokenizers::encode` (the router's call: lock, encode with the model's tokenizer, copy the
//! ids) on each tokenizer of `testdata/tokenizers/` (DeepSeek V4's byte-level BPE, MiniLM's
//! WordPiece), over the reference's `long` text (~1.5 k tokens) and that text repeated to
//! ~24 k tokens; throughput in tokens, so 1 000 / throughput is the cost per 1 k tokens
//! (docs/benchmarks.md "Tokenization").

// A benchmark harness, like a test: failing loudly on a broken setup is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use ic_controller::metrics::ControllerMetrics;
use ic_controller::tokenize::{TokenizerSpec, Tokenizers};

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizers");
    let mut c = Criterion::default()
        .configure_from_args()
        .measurement_time(Duration::from_secs(5));
    for name in ["deepseek-v4", "all-minilm-l6-v2"] {
        let t = Tokenizers::new(&[TokenizerSpec {
            model: name.into(),
            path: dir.join(name).join("tokenizer.json"),
        }])
        .unwrap();
        assert_eq!(t.reload(&ControllerMetrics::new().unwrap()), 1);
        let reference: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(name).join("reference.json")).unwrap(),
        )
        .unwrap();
        let long = reference["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "long")
            .unwrap()["text"]
            .as_str()
            .unwrap()
            .to_string();
        let mut g = c.benchmark_group(format!("tokenize/{name}"));
        for (label, text) in [
            ("long", long.clone()),
            ("long_x16", [long.as_str(); 16].join(" ")),
        ] {
            let tokens = t.encode(name, &text, true).unwrap().ids.len() as u64;
            println!("{name}/{label}: {} bytes, {tokens} tokens", text.len());
            g.throughput(Throughput::Elements(tokens));
            g.bench_function(label, |b| {
                b.iter(|| std::hint::black_box(t.encode(name, std::hint::black_box(&text), true)))
            });
        }
        g.finish();
    }
    c.final_summary();
}
