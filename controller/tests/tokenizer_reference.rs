//! LookupRoute `prompt_text` tokenizes as the engine does (issue 19 item 1): the controller's
//! ids for real tokenizer files (testdata/tokenizers/, see testdata/README.md) equal the ids the
//! Python `tokenizers` package — what vLLM and SGLang run through transformers — computes for
//! the same text, with and without special tokens. The reference files are checked in
//! (scripts/tokenizer-reference.py) and regenerated here with the Python package, so a drift of
//! either side fails.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use ic_controller::metrics::ControllerMetrics;
use ic_controller::tokenize::{TokenizerSpec, Tokenizers};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `testdata/tokenizers/<name>` of every checked-in tokenizer.
fn tokenizer_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root().join("testdata/tokenizers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("tokenizer.json").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 2, "{dirs:?}");
    dirs
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn sha256_hex(path: &Path) -> String {
    hex::encode(ring::digest::digest(
        &ring::digest::SHA256,
        &std::fs::read(path).unwrap(),
    ))
}

#[test]
fn prompt_text_ids_equal_the_python_tokenizers_reference() {
    let mut specials_differ = 0;
    for dir in tokenizer_dirs() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let reference = read_json(&dir.join("reference.json"));
        assert_eq!(
            reference["tokenizer_sha256"].as_str().unwrap(),
            sha256_hex(&dir.join("tokenizer.json")),
            "{name}: reference.json is not of the checked-in tokenizer.json; rerun scripts/tokenizer-reference.py"
        );
        let t = Tokenizers::new(&[TokenizerSpec {
            model: name.clone(),
            path: dir.join("tokenizer.json"),
        }])
        .unwrap();
        assert_eq!(t.reload(&ControllerMetrics::new().unwrap()), 1);
        let cases = reference["cases"].as_array().unwrap();
        let mut names = std::collections::BTreeSet::new();
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let special = case["add_special_tokens"].as_bool().unwrap();
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let got = t.encode(&name, text, special).unwrap();
            assert!(!got.stale);
            assert_eq!(
                got.ids, want,
                "{name} / {} / add_special_tokens={special}",
                case["name"]
            );
            names.insert(case["name"].as_str().unwrap().to_string());
        }
        // The cases the issue asks for are there: empty, non-ASCII, longer than many blocks
        // (and than the 128-token truncation one file configures, which engines do not apply).
        for must in ["empty", "non_ascii", "long"] {
            assert!(names.contains(must), "{name}: no {must} case");
        }
        let long = cases.iter().find(|c| c["name"] == "long").unwrap();
        assert!(long["ids"].as_array().unwrap().len() > 8 * 64, "{name}");
        // Whether add_special_tokens changes the ids is the file's post-processor's business.
        let with = t.encode(&name, "Hello", true).unwrap().ids;
        let without = t.encode(&name, "Hello", false).unwrap().ids;
        if with != without {
            specials_differ += 1;
        }
    }
    // One file has a template post-processor ([CLS] … [SEP]), so the flag is exercised.
    assert!(specials_differ >= 1);
}

/// The Python interpreter with `tokenizers` (scripts/fetch-tokenizers.sh, run by scripts/setup.sh; scripts/test.sh sets
/// IC_TOKENIZERS_PYTHON).
fn reference_python() -> PathBuf {
    let python = std::env::var_os("IC_TOKENIZERS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/ci-cache/tokenizers/venv/bin/python"));
    assert!(
        python.exists(),
        "{} does not exist: run scripts/fetch-tokenizers.sh (or set IC_TOKENIZERS_PYTHON to a python that imports tokenizers)",
        python.display()
    );
    python
}

#[test]
fn the_checked_in_references_are_what_python_tokenizers_computes() {
    let out = tempfile::tempdir().unwrap();
    let run = std::process::Command::new(reference_python())
        .arg(root().join("scripts/tokenizer-reference.py"))
        .arg("--out-dir")
        .arg(out.path())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    for dir in tokenizer_dirs() {
        let name = dir.file_name().unwrap();
        let fresh = read_json(&out.path().join(name).join("reference.json"));
        let checked_in = read_json(&dir.join("reference.json"));
        for key in ["tokenizer", "tokenizer_sha256", "cases"] {
            assert_eq!(
                fresh[key], checked_in[key],
                "{name:?}: {key} differs from a fresh scripts/tokenizer-reference.py run"
            );
        }
    }
}
