#!/usr/bin/env bash
# Starts the standalone stack on this machine: ic-controller (index, agent ingest, router) and
# this host's ic-agent connected to it, with the plan in config/standalone/plan.yaml.
# Ctrl-C stops both.
#
#   controller gRPC  127.0.0.1:50051  (AgentService, RouterService, grpc.health.v1)
#   controller HTTP  http://127.0.0.1:8080/v1/nodes  /snapshot  /metrics  /healthz  /readyz
#   agent HTTP       http://127.0.0.1:9090/v1/report  /metrics  /healthz  /readyz
set -euo pipefail
cd "$(dirname "$0")/.."
PLAN=${IC_PLAN:-config/standalone/plan.yaml}
cargo build --quiet --bins
BIN=target/debug
"$BIN/ic-controller" standalone --grpc-addr 127.0.0.1:50051 --http-addr 127.0.0.1:8080 &
CTRL=$!
trap 'kill $CTRL ${AGENT:-} 2>/dev/null; wait 2>/dev/null' EXIT INT TERM
for _ in $(seq 50); do
  curl -fs http://127.0.0.1:8080/readyz >/dev/null 2>&1 && break
  sleep 0.1
done
"$BIN/ic-agent" run --controller http://127.0.0.1:50051 --plan "$PLAN" --http-addr 127.0.0.1:9090 &
AGENT=$!
cat <<TXT

inference-cache standalone stack is up (controller pid $CTRL, agent pid $AGENT).
  Nodes and their checks:   curl -s http://127.0.0.1:8080/v1/nodes
  Index per replica:        curl -s http://127.0.0.1:8080/snapshot
  Agent report:             curl -s http://127.0.0.1:9090/v1/report
  Replay an engine stream:  $BIN/ic-agent kv publish --fixture ../shared/fixtures/kv-events/vllm-0.24.0.json --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --until-seq 8
  Ask the router:           $BIN/ic-controller lookup --tokens 0..32
Ctrl-C stops both.
TXT
wait
