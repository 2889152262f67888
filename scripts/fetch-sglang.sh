#!/usr/bin/env bash
# Fetches SGLang's own metrics code for the HiCache host-tier tests (agent/tests/sglang_metrics.rs):
# the few pure-Python files of the `sglang==0.5.23` wheel that scripts/sglang-metrics-page.py
# executes (metrics_collector.py and what it imports), and a venv with the packages they need
# (prometheus_client, msgspec). The 39 MB wheel is checked against its pinned sha256 and deleted
# once the files are out (~200 KB kept). No torch, no GPU.
#
#   scripts/fetch-sglang.sh [DIR]     default DIR: target/ci-cache/sglang
#
# Afterwards DIR/0.5.23/sglang/srt/observability/metrics_collector.py and DIR/venv/bin/python
# exist; the test finds them there (or through IC_SGLANG_DIR=DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/ci-cache/sglang}"
version=0.5.23
# The cp311 manylinux_2_34 x86_64 wheel on PyPI (the files used are pure Python, the same in
# every build; this one is fetched on any host so the pin holds).
sha256=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$dir/venv/bin/python" -c 'import prometheus_client, msgspec' >/dev/null 2>&1; then
  mkdir -p "$dir"
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet --only-binary=:all: prometheus_client==0.26.0 msgspec==0.23.0
fi
out="$dir/$version"
if [ ! -f "$out/sglang/srt/observability/metrics_collector.py" ]; then
  mkdir -p "$out"
  "$dir/venv/bin/pip" download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_34_x86_64 "sglang==$version" -d "$out"
  whl=$(ls "$out"/sglang-"$version"-*.whl)
  echo "$sha256  $whl" | sha256sum -c --quiet -
  "$dir/venv/bin/python" - "$whl" "$out" <<'PY'
import sys, zipfile
keep = ["sglang/srt/observability/metrics_collector.py", "sglang/srt/observability/utils.py",
        "sglang/srt/observability/scheduler_stage_metrics.py",
        "sglang/srt/utils/gauge_histogram.py", "sglang/srt/disaggregation/utils.py",
        "sglang/srt/model_executor/forward_batch_info.py"]
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in keep:
        z.extract(n, sys.argv[2])
PY
  rm -f "$whl"
fi
echo "fetch-sglang: $out/sglang/srt/observability/metrics_collector.py"
