#!/usr/bin/env bash
# Fetches SGLang 0.5.5's own radix cache and KV-event classes for the SGLang chain tests
# (issue 39 item 9; agent/tests/kv_sglang_radix.rs): the four pure-Python files of the
# `sglang==0.5.5` wheel that scripts/sglang-radix-events.py executes. The 3.4 MB wheel is checked
# against its pinned sha256 and deleted once the files are out. The generator runs with the
# venv of scripts/fetch-sglang.sh (msgspec). No torch, no GPU.
#
#   scripts/fetch-sglang-radix.sh [DIR]     default DIR: target/ci-cache/sglang
#
# Afterwards DIR/0.5.5/sglang/srt/mem_cache/radix_cache.py exists.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/ci-cache/sglang}"
version=0.5.5
sha256=3c57f135ec0a7a5cf6ae4ed5e0b231d7bf7e0fae588bbc1a881560f1c18db995
out="$dir/$version"
[ -f "$out/sglang/srt/mem_cache/radix_cache.py" ] && exit 0
mkdir -p "$out"
[ -x "$dir/venv/bin/pip" ] || python3 -m venv "$dir/venv"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$dir/venv/bin/pip" download --quiet --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_34_x86_64 "sglang==$version" -d "$out"
whl=$(ls "$out"/sglang-"$version"-*.whl)
echo "$sha256  $whl" | sha256sum -c --quiet -
python3 - "$whl" "$out" <<'PY'
import sys, zipfile
keep = ["sglang/srt/mem_cache/radix_cache.py", "sglang/srt/mem_cache/base_prefix_cache.py",
        "sglang/srt/mem_cache/evict_policy.py", "sglang/srt/disaggregation/kv_events.py"]
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in keep:
        z.extract(n, sys.argv[2])
PY
rm -f "$whl"
echo "fetch-sglang-radix: $out/sglang/srt/mem_cache/radix_cache.py"
