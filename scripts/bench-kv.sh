#!/usr/bin/env bash
# KV index and decoder benchmarks against dynamo-kv-router 1.6.1, on the Mooncake FAST'25
# conversation trace (../shared/fixtures/traces/). Prints one Markdown table (workload summary
# on the lines above it). The peer crate lives in bench/, outside the workspace, with its own
# Cargo.lock (dynamo-kv-router pins tokio =1.52.4).
#
#   scripts/bench-kv.sh                          # 1000 workers, 1024 blocks each, trace × 4
#   scripts/bench-kv.sh --workers 200 --copies 1 # any ic-bench flag (see --help)
#
# Build output goes to $IC_BENCH_TARGET_DIR (default target/bench). Fixtures and trace are found
# above the repository (the sibling ../shared) or via IC_FIXTURES_DIR / IC_TRACE.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TARGET_DIR=${IC_BENCH_TARGET_DIR:-$ROOT/target/bench}
if [[ -z "${IC_FIXTURES_DIR:-}" ]]; then
  for d in "$ROOT/shared/fixtures" "$ROOT/../shared/fixtures"; do
    if [[ -d "$d/kv-events" ]]; then export IC_FIXTURES_DIR="$d"; break; fi
  done
fi
cargo build --quiet --release --locked --manifest-path bench/Cargo.toml
exec "$CARGO_TARGET_DIR/release/ic-bench" "$@"
