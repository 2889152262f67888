#!/usr/bin/env bash
# Starts the standalone stack on this machine: ic-controller (index, agent ingest, router) and
# this host's ic-agent connected to it, with the plan in config/standalone/plan.yaml.
# Ctrl-C (or SIGTERM) stops both and exits 0.
#
#   controller gRPC  127.0.0.1:50051  (AgentService, RouterService, grpc.health.v1)
#   controller HTTP  http://127.0.0.1:8080/v1/nodes  /snapshot  /metrics  /healthz  /readyz
#   agent HTTP       http://127.0.0.1:9090/v1/report  /metrics  /healthz  /readyz
#
# Fails fast and loudly: when a part does not come up (port taken, bad plan, crash) or dies later,
# the script stops the other part, prints the dead part's exit status and the last lines of its
# log, and exits non-zero (3 = a port was taken before start, 1 = a part did not come up or died).
#
# Binaries: $IC_BIN_DIR if set, else ${CARGO_TARGET_DIR:-target}/debug. Ones that are newer than
# every source file (e.g. what ./scripts/test.sh just built) are used as they are; otherwise
# `cargo build` runs with its progress shown — with the workspace's dev-dependency features
# (`--workspace --examples`), exactly the dependency build `./scripts/test.sh` uses, so
# running one after the other compiles every dependency once.
#
# Environment: IC_PLAN (node plan; a relative path is taken from the directory the script is run
# from; default config/standalone/plan.yaml with its controller port set to IC_GRPC_PORT),
# IC_GRPC_PORT (50051), IC_HTTP_PORT (8080), IC_AGENT_HTTP_PORT (9090), IC_LOG_DIR (where the
# two logs go; default a fresh temporary directory), IC_UP_TIMEOUT (seconds each part has to
# become ready; 60). Needs curl (the readiness probes).
set -euo pipefail
say() { printf 'standalone: %s\n' "$*" >&2; }
# A relative IC_PLAN names a file from where the user stands, not from the repository root.
if [ -n "${IC_PLAN:-}" ] && [ "${IC_PLAN#/}" = "$IC_PLAN" ]; then
  [ -e "$IC_PLAN" ] || { say "FAILED: IC_PLAN=$IC_PLAN: no such file (from $PWD)"; exit 1; }
  IC_PLAN="$(cd "$(dirname "$IC_PLAN")" && pwd)/$(basename "$IC_PLAN")"
fi
cd "$(dirname "$0")/.."
command -v curl >/dev/null 2>&1 || {
  say "FAILED: curl is not installed (the readiness probes and the commands below use it): apt-get install curl"
  exit 1
}
PLAN=${IC_PLAN:-config/standalone/plan.yaml}
GRPC_PORT=${IC_GRPC_PORT:-50051}
HTTP_PORT=${IC_HTTP_PORT:-8080}
AGENT_PORT=${IC_AGENT_HTTP_PORT:-9090}
UP_TIMEOUT=${IC_UP_TIMEOUT:-60}
BIN=${IC_BIN_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/debug}
LOG_DIR=${IC_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/ic-standalone.XXXXXX")}
mkdir -p "$LOG_DIR"
CTRL_LOG=$LOG_DIR/controller.log
AGENT_LOG=$LOG_DIR/agent.log
# The demo plan says the controller's gRPC port must be held: the port this stack uses.
if [ -z "${IC_PLAN:-}" ] && [ "$GRPC_PORT" != 50051 ]; then
  sed "s/^  - port: 50051\$/  - port: $GRPC_PORT/" "$PLAN" >"$LOG_DIR/plan.yaml"
  grep -q "^  - port: $GRPC_PORT\$" "$LOG_DIR/plan.yaml" ||
    { say "FAILED: $PLAN has no '  - port: 50051' line to set to $GRPC_PORT"; exit 1; }
  PLAN=$LOG_DIR/plan.yaml
fi

# --- binaries: reuse a fresh build, else build with progress ------------------------------------
# fresh BINARY PACKAGE_DIR: the binary exists and no input of it (the workspace manifests,
# shared/ and its package's sources, protos, build scripts) is newer; tests and benches do not
# count.
fresh() {
  local b=$1 pkg=$2
  [ -x "$b" ] || return 1
  [ -z "$(find Cargo.toml Cargo.lock shared/Cargo.toml shared/build.rs shared/build-commit.rs \
          shared/src shared/proto "$pkg/Cargo.toml" "$pkg/src" \
          -newer "$b" -type f -print -quit 2>/dev/null)" ]
}
if fresh "$BIN/ic-controller" controller && fresh "$BIN/ic-agent" agent; then
  say "using the existing build in $BIN (newer than every source file)"
else
  [ -n "${IC_BIN_DIR:-}" ] && { say "IC_BIN_DIR=$IC_BIN_DIR has no up-to-date ic-controller and ic-agent"; exit 1; }
  say "building ic-controller and ic-agent into $BIN (first build: several minutes)"
  # --workspace --examples: the dependencies get the features `cargo test --workspace` gives
  # them (dev-dependencies unify features only when a target that uses them is built), so
  # ./scripts/test.sh afterwards reuses every unit built here instead of recompiling ~60 crates
  # (checked with `cargo +nightly build -Z unstable-options --unit-graph`: all 445 units of this
  # command are units of `cargo test --workspace --no-run`).
  cargo build --locked --workspace --bin ic-controller --bin ic-agent --examples
fi

# --- ports: refuse to start next to something that already listens -------------------------------
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in "$GRPC_PORT" "$HTTP_PORT" "$AGENT_PORT"; do
  if port_taken "$p"; then
    say "FAILED: 127.0.0.1:$p is already in use (another standalone stack? see: ss -ltnp 'sport = :$p')"
    exit 3
  fi
done

# --- start and supervise --------------------------------------------------------------------------
CTRL=
AGENT=
stopping=0
stop_all() {
  for pid in $AGENT $CTRL; do kill "$pid" 2>/dev/null || true; done
  for pid in $AGENT $CTRL; do wait "$pid" 2>/dev/null || true; done
}
on_signal() { stopping=1; say "stopping"; stop_all; exit 0; }
trap on_signal INT TERM
trap stop_all EXIT

# dead NAME PID LOG [STATUS]: the part is gone — say so with its log tail, stop the rest, fail.
dead() {
  local name=$1 pid=$2 log=$3 status=${4:-}
  if [ -z "$status" ]; then
    status=0
    wait "$pid" 2>/dev/null || status=$?
  fi
  say "FAILED: $name (pid $pid) exited with status $status; last lines of $log:"
  tail -n 20 "$log" | sed 's/^/  | /' >&2
  exit 1
}

# wait_ready NAME PID LOG URL: until URL answers 200, failing as soon as PID is gone.
wait_ready() {
  local name=$1 pid=$2 log=$3 url=$4 deadline=$((SECONDS + UP_TIMEOUT))
  while :; do
    kill -0 "$pid" 2>/dev/null || dead "$name" "$pid" "$log"
    if curl -fs -o /dev/null --max-time 2 "$url"; then
      # Answered: make sure it is our process that answered, not a late-bound neighbour.
      kill -0 "$pid" 2>/dev/null || dead "$name" "$pid" "$log"
      return 0
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "FAILED: $name (pid $pid) not ready at $url after ${UP_TIMEOUT}s; last lines of $log:"
      tail -n 20 "$log" | sed 's/^/  | /' >&2
      exit 1
    fi
    sleep 0.2
  done
}

# As Dockerfile.controller ships it: freed pages go back to the kernel at once.
MIMALLOC_PURGE_DELAY=${MIMALLOC_PURGE_DELAY:-0} \
"$BIN/ic-controller" standalone --grpc-addr "127.0.0.1:$GRPC_PORT" \
  --http-addr "127.0.0.1:$HTTP_PORT" >"$CTRL_LOG" 2>&1 &
CTRL=$!
wait_ready ic-controller "$CTRL" "$CTRL_LOG" "http://127.0.0.1:$HTTP_PORT/readyz"
"$BIN/ic-agent" run --controller "http://127.0.0.1:$GRPC_PORT" --plan "$PLAN" \
  --http-addr "127.0.0.1:$AGENT_PORT" >"$AGENT_LOG" 2>&1 &
AGENT=$!
wait_ready ic-agent "$AGENT" "$AGENT_LOG" "http://127.0.0.1:$AGENT_PORT/readyz"

cat <<TXT

inference-cache standalone stack is up (controller pid $CTRL, agent pid $AGENT).
  Nodes and their checks:   curl -s http://127.0.0.1:$HTTP_PORT/v1/nodes
  Index per replica:        curl -s http://127.0.0.1:$HTTP_PORT/snapshot
  Agent report:             curl -s http://127.0.0.1:$AGENT_PORT/v1/report
  Replay an engine stream:  $BIN/ic-agent kv publish --fixture testdata/kv-events/vllm-0.24.0.json --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --until-seq 8
  Ask the router:           $BIN/ic-controller lookup --controller http://127.0.0.1:$GRPC_PORT --tokens 0..32
  Plan:                     $PLAN
  Logs:                     tail -f $CTRL_LOG $AGENT_LOG
Ctrl-C stops both. If either part dies, this script stops the other and exits non-zero.
TXT

# Whichever part exits first ends the stack; a signal ends it cleanly (on_signal).
while :; do
  status=0
  wait -n "$CTRL" "$AGENT" 2>/dev/null || status=$?
  [ "$stopping" = 1 ] && exit 0
  if ! kill -0 "$CTRL" 2>/dev/null; then dead ic-controller "$CTRL" "$CTRL_LOG" "$status"; fi
  if ! kill -0 "$AGENT" 2>/dev/null; then dead ic-agent "$AGENT" "$AGENT_LOG" "$status"; fi
done
