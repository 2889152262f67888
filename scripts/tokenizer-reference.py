#!/usr/bin/env python3
"""Engine-side reference token ids for the tokenizer files in testdata/tokenizers/.

An engine (vLLM, SGLang) tokenizes a prompt with transformers' fast tokenizer: the Hugging Face
`tokenizers` library running the model's tokenizer.json, with truncation and padding off
(transformers' default truncation=False / padding=False calls no_truncation() / no_padding()).
This script does exactly that through the Python `tokenizers` package and writes, for every
testdata/tokenizers/<name>/tokenizer.json, the ids of each case below with and without
add_special_tokens to testdata/tokenizers/<name>/reference.json.

The controller's test controller/tests/tokenizer_reference.rs compares its own ids (the Rust
`tokenizers` crate behind LookupRoute prompt_text) with those files, and reruns this script into
a temporary directory to check that the checked-in files are what the Python package computes
(the venv comes from scripts/fetch-tokenizers.sh).

usage: tokenizer-reference.py [--out-dir DIR]   (default: write next to each tokenizer.json)
"""

import argparse
import hashlib
import json
import pathlib
import sys

from tokenizers import Tokenizer, __version__ as TOKENIZERS_VERSION

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTDATA = ROOT / "testdata" / "tokenizers"

# Our own words. "long" is many blocks at any block size in use (16, 32, 64) and longer than
# the 128-token truncation one of the files configures (which the engine does not apply).
LONG = " ".join(
    f"Paragraph {i}: the router sends a request to the replica that already holds the longest "
    f"cached prefix of its prompt, so the engine skips recomputing those {16 * i} tokens."
    for i in range(40)
)

CASES = [
    ("empty", ""),
    ("ascii", "Hello, world! The quick brown fox jumps over the lazy dog."),
    (
        "non_ascii",
        "Grüße aus Köln — naïve café; 你好，世界！日本語のテキスト。Привет, мир! 🚀🤖 مرحبا Ελληνικά",
    ),
    (
        "special_tokens_in_text",
        "[CLS]<｜begin▁of▁sentence｜>System: be brief.[SEP]<｜User｜>hi<｜Assistant｜>",
    ),
    ("code_whitespace", "def f(x):\n\treturn x  +  1\n\n\n    # comment\r\n"),
    ("numbers", "In 2026, 1234567 × 3.14159 = 3878498.6 (approx.)"),
    ("long", LONG),
    ("long_non_ascii", "Über 缓存 の前置き — " * 60),
]


def reference(tokenizer_json: pathlib.Path) -> dict:
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_truncation()
    tok.no_padding()
    cases = []
    for name, text in CASES:
        for add_special_tokens in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special_tokens).ids
            cases.append(
                {
                    "name": name,
                    "add_special_tokens": add_special_tokens,
                    "text": text,
                    "ids": ids,
                }
            )
    return {
        "generator": "scripts/tokenizer-reference.py",
        "tokenizers_version": TOKENIZERS_VERSION,
        "tokenizer": str(tokenizer_json.relative_to(ROOT)),
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(),
        "cases": cases,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=pathlib.Path, help="write <name>/reference.json under DIR")
    args = ap.parse_args()
    files = sorted(TESTDATA.glob("*/tokenizer.json"))
    if not files:
        print(f"no tokenizer.json under {TESTDATA}", file=sys.stderr)
        return 1
    for f in files:
        out_dir = (args.out_dir / f.parent.name) if args.out_dir else f.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / "reference.json"
        out.write_text(json.dumps(reference(f), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"tokenizer-reference: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
