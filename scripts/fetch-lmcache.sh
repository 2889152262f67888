#!/usr/bin/env bash
# Fetches the real LMCache standalone server (the `lm://` tier) for the tier-2 probe tests
# (controller/tests/t2_probe.rs, t2_probe_gate.rs): the pure-Python files of the `lmcache`
# wheel that `lmcache/v1/server/__main__.py` executes, at the version of the chart's default
# server image (controller/src/reconcile/render/lmcache_server.rs). The 13 MB wheel is deleted
# once they are out. No torch, no GPU: controller/tests/t2_support/lmcache_server.py runs them.
#
#   scripts/fetch-lmcache.sh [DIR]     default DIR: target/ci-cache/lmcache
#
# The tests find DIR there (or through IC_LMCACHE_DIR=DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/ci-cache/lmcache}"
version=0.4.7
[ -f "$dir/$version/lmcache/v1/server/__main__.py" ] && exit 0
mkdir -p "$dir/$version"
# pip from a venv of its own: a distribution's python3 may come without pip.
[ -x "$dir/venv/bin/pip" ] || python3 -m venv "$dir/venv"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$dir/venv/bin/pip" download --quiet --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_28_x86_64 "lmcache==$version" -d "$dir/$version"
whl=$(ls "$dir/$version"/lmcache-"$version"-*.whl)
python3 - "$whl" "$dir/$version" <<'PY'
import sys, zipfile
keep = ("lmcache/logging.py", "lmcache/utils.py", "lmcache/v1/protocol.py",
        "lmcache/v1/memory_management.py", "lmcache/v1/server/")
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith(keep) and n.endswith(".py"):
            z.extract(n, sys.argv[2])
PY
rm -f "$whl"
echo "fetch-lmcache: $dir/$version/lmcache/v1/server/__main__.py"
