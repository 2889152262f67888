#!/usr/bin/env bash
# KV index and decoder benchmarks against dynamo-kv-router 1.6.1, on the Mooncake FAST'25
# conversation trace (testdata/traces/). Prints one Markdown table (workload summary
# on the lines above it). The peer crate lives in bench/, outside the workspace, with its own
# Cargo.lock (dynamo-kv-router pins tokio =1.52.4).
#
#   scripts/bench-kv.sh                          # 1000 workers, 1024 blocks each, trace × 4
#   scripts/bench-kv.sh --workers 200 --copies 1 # any ic-bench flag (see --help)
#   scripts/bench-kv.sh --stable                 # per-op instructions, misses and cycle estimate
#                                                # of each phase alone under valgrind callgrind
#                                                # (load-independent; docs/benchmarks.md)
#
# Build output goes to $IC_BENCH_TARGET_DIR (default target/bench). Fixtures and trace are the
# repository's testdata/ unless IC_FIXTURES_DIR / IC_TRACE say otherwise.
# Both indexers allocate through mimalloc (the controller's allocator) unless
# IC_BENCH_ALLOCATOR=system.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TARGET_DIR=${IC_BENCH_TARGET_DIR:-$ROOT/target/bench}
export IC_FIXTURES_DIR=${IC_FIXTURES_DIR:-$ROOT/testdata}
# --stable keeps its callgrind dumps (our ingest's, for callgrind_annotate) here.
export IC_BENCH_STABLE_DIR=${IC_BENCH_STABLE_DIR:-$CARGO_TARGET_DIR/stable}
cargo build --quiet --release --locked --manifest-path bench/Cargo.toml
# The machine and its load beside the figures: wall-clock numbers on a shared VM move with it
# (the --stable figures do not).
machine() {
  local model
  model=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
  echo "machine: $(nproc) CPUs, ${model:-unknown model}; load average $(cut -d' ' -f1-3 /proc/loadavg) ($1)"
}
machine "before the run"
rc=0
"$CARGO_TARGET_DIR/release/ic-bench" "$@" || rc=$?
machine "after the run"
exit "$rc"
