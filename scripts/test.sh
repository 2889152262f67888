#!/usr/bin/env bash
# The whole test suite (what .ci/run calls after installing prerequisites).
# Privileged node tests in node-tests/ need root; they run as root in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
cargo test --workspace --locked --no-fail-fast || status=$?
# Helm chart: render with Helm's Go SDK, lint, validate against Kubernetes 1.29 and 1.33 schemas.
bash scripts/chart-tests.sh || status=$?
exit $status
