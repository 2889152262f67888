#!/usr/bin/env bash
# The whole test suite (what .ci/run calls after installing prerequisites).
# Privileged node tests in node-tests/ need root; they run as root in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
cargo test --workspace --locked --no-fail-fast || status=$?
# The chart tests run every argument the chart passes through the real ic-controller and ic-agent
# (chart-tests/test_binary_args.py), so the binaries must exist and be current. After `cargo test`
# (which already compiled the workspace) this only links them, or does nothing.
cargo build --workspace --bins --locked || status=$?
export IC_BIN_DIR="${IC_BIN_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/debug}"
# Helm chart: render with Helm's Go SDK, lint, validate against Kubernetes 1.29 and 1.33 schemas,
# and check the binaries accept the rendered arguments.
bash scripts/chart-tests.sh || status=$?
exit $status
