#!/usr/bin/env bash
# The whole test suite (what .ci/run calls after installing prerequisites).
# Privileged node tests in node-tests/ need root; they run as root in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked --no-fail-fast
