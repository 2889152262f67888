#!/usr/bin/env bash
# A Python venv with the Hugging Face `tokenizers` package (one wheel, ~3 MB, a few seconds),
# the engine-side reference of LookupRoute prompt_text: controller/tests/tokenizer_reference.rs
# runs scripts/tokenizer-reference.py with it to check testdata/tokenizers/*/reference.json.
#
#   scripts/fetch-tokenizers.sh [DIR]     default DIR: target/ci-cache/tokenizers
#
# Afterwards DIR/venv/bin/python imports tokenizers; the test finds it there (or through
# IC_TOKENIZERS_PYTHON=PATH-OF-PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/ci-cache/tokenizers}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$dir/venv/bin/python" -c 'import tokenizers' >/dev/null 2>&1; then
  mkdir -p "$dir"
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet --only-binary=:all: tokenizers==0.23.3
fi
echo "fetch-tokenizers: $dir/venv/bin/python"
