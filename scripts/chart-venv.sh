#!/usr/bin/env bash
# Creates or reuses .venv/chart-tests: Python >= 3.10 with the chart tests' pinned packages
# (chart-tests/requirements.txt: Helm's Go SDK as helm-python-sdk, kubernetes-validate, pytest).
# Used by scripts/chart-tests.sh and scripts/cluster.sh (which renders the chart with it).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv/chart-tests
req=chart-tests/requirements.txt
export PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

python=""
for candidate in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "chart-tests: need Python >= 3.10 with venv (set PYTHON=...)" >&2
  exit 1
fi

# (Re)create the venv when it is missing or the pinned requirements changed.
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$venv/.requirements.txt"; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --requirement "$req"
  cp "$req" "$venv/.requirements.txt"
fi

