#!/usr/bin/env bash
# Fleet scale on one controller (issue 18 items 5–6, docs/scaling.md): `ic-fleet` (fleet/, a workspace member) runs
# many simulated node agents, each its own AgentService.Connect stream over loopback gRPC,
# against the real `ic-controller standalone` binary, and prints one Markdown row per size:
# controller RSS (VmRSS / VmHWM of its /proc/<pid>/status), time to converge (every agent
# connected, every entry indexed, read from the controller's /metrics), the reconnect storm after
# a SIGTERM restart (each agent resyncing in full) with LookupRoute round trips meanwhile, and
# the load average at each figure.
#
#   scripts/bench-fleet.sh                  # the curve: 3 entry sizes, 3 agent counts
#   SIZES="5000:20000" scripts/bench-fleet.sh   # agents:entries-per-agent pairs
#   IC_FLEET_ARGS="--churn-every-ms 1000" scripts/bench-fleet.sh   # plus a churn phase
#   IC_FLEET_ARGS="--agents-idle" scripts/bench-fleet.sh   # the simulated agents at SCHED_IDLE, so
#                                           # they take only the CPU the controller and gateway leave
#   SIZES="1500:20000" IC_FLEET_ARGS="--samples-out /tmp/lookups.txt" scripts/bench-fleet.sh
#                                           # every lookup's round trip (one size: each run rewrites it)
#
# Beside each row, stderr gets the controller's own side of the lookups (its
# lookup_duration_seconds between two scrapes: read-lock wait + walk, no transport) and the
# storm's index write-lock holds (index_write_hold_seconds), so a round-trip tail can be told
# apart from a slow index; and the controller's CPU of the cold start and the storm split into
# user and system time (on a VM that backs guest memory on first touch, page zeroing shows as
# system time: docs/scaling.md "Why the cold start is slower than the storm").
#
# Each agent holds one connection (the controller gets --max-connections agents + 64) and the
# generator one more descriptor per agent, so the script raises `ulimit -n`. Both binaries are
# built in one release invocation (one feature set) into $CARGO_TARGET_DIR (default target/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
# agents:entries-per-agent. Entries at 1 000 agents: 10 M, 30 M, 100 M; agents at 20 k entries
# each: 500, 1 500, 5 000 (10 M, 30 M, 100 M).
SIZES=${SIZES:-"500:20000 1500:20000 5000:20000 1000:10000 1000:30000 1000:100000"}
cargo build --quiet --release --locked -p ic-fleet -p ic-controller --bin ic-fleet --bin ic-controller
hard=$(ulimit -Hn)
want=65536
if [ "$hard" != unlimited ] && [ "$hard" -lt "$want" ]; then want=$hard; fi
ulimit -n "$want"
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB; uptime: $(uptime)"
header=--header
for size in $SIZES; do
  agents=${size%%:*}
  entries=${size##*:}
  # shellcheck disable=SC2086
  "$CARGO_TARGET_DIR/release/ic-fleet" $header --agents "$agents" --entries-per-agent "$entries" \
    --controller-bin "$CARGO_TARGET_DIR/release/ic-controller" ${IC_FLEET_ARGS:-}
  header=
done
