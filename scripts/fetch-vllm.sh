#!/usr/bin/env bash
# Fetches what the KV-event fault suite (node-tests/tests/kv_faults_vllm.rs) runs: vLLM's own
# event publisher, `vllm/distributed/kv_events.py`, from the released wheels of each version
# below (the wheel is deleted once the file is out: ~300 MB each), and a Python venv with the
# only packages that file needs (msgspec, pyzmq). No torch, no GPU.
#
#   scripts/fetch-vllm.sh [DIR]     default DIR: target/ci-cache/vllm
#
# Afterwards DIR/<version>/vllm/distributed/kv_events.py and DIR/venv/bin/python exist; the test
# finds them there (or through IC_VLLM_DIR=DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/ci-cache/vllm}"
versions=(0.33.0 0.24.0)
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$dir"
if [ ! -x "$dir/venv/bin/python" ]; then
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet msgspec==0.23.0 pyzmq==27.3.0
fi
for v in "${versions[@]}"; do
  out="$dir/$v"
  [ -f "$out/vllm/distributed/kv_events.py" ] && continue
  mkdir -p "$out"
  "$dir/venv/bin/pip" download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 "vllm==$v" -d "$out"
  whl=$(ls "$out"/vllm-"$v"-*.whl)
  "$dir/venv/bin/python" - "$whl" "$out" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("vllm/distributed/kv_events.py", sys.argv[2])
PY
  rm -f "$whl"
  echo "fetch-vllm: $out/vllm/distributed/kv_events.py"
done
