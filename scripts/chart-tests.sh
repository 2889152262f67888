#!/usr/bin/env bash
# Helm chart tests (chart-tests/): render the chart with Helm's Go SDK for the default values and
# each variant, lint it strictly, validate every object for Kubernetes 1.29 and 1.33, check the
# samples against the CRDs, assert the chart's rules, and run every argument the chart passes to
# ic-controller and ic-agent through the real binaries (with --help appended; test_binary_args.py).
# Creates or reuses .venv/chart-tests.
#
# Needs the built binaries: `cargo test --workspace` (what scripts/test.sh runs first) or
# `cargo build --workspace --bins` leaves them in target/debug. They are taken from $IC_BIN_DIR,
# else $CARGO_TARGET_DIR/debug, else target/debug; the
# binary test fails (it never skips) when they are missing.
#
#   scripts/chart-tests.sh              run the tests (extra arguments go to pytest)
#   scripts/chart-tests.sh --regen      regenerate chart/values.schema.json and chart/README.md from
#                                       values.yaml first
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv/chart-tests
bash scripts/chart-venv.sh
export PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "${1:-}" = "--regen" ]; then
  shift
  "$venv/bin/python" chart-tests/gen_values_schema.py --write
  (cd chart-tests && "../$venv/bin/python" gen_chart_readme.py --write)
fi

bin_dir="${IC_BIN_DIR:-${CARGO_TARGET_DIR:-target}/debug}"
export IC_BIN_DIR="$bin_dir"
if [ ! -x "$bin_dir/ic-controller" ] || [ ! -x "$bin_dir/ic-agent" ]; then
  echo "chart-tests: $bin_dir/ic-controller or $bin_dir/ic-agent is missing; build them with" \
    "\`cargo build --workspace --bins --locked\` or \`cargo test --workspace\` (or set IC_BIN_DIR). test_binary_args.py will fail." >&2
fi

exec "$venv/bin/python" -m pytest chart-tests -q -p no:cacheprovider "$@"
