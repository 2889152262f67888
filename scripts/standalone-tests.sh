#!/usr/bin/env bash
# Tests of scripts/standalone.sh (run by scripts/test.sh after `cargo test` built the binaries):
# it must fail fast and loudly — non-zero exit, the dead part's last log lines — when a part does
# not come up or dies later, and stop cleanly (exit 0, no process left) on SIGTERM.
#
#   IC_BIN_DIR=target/debug scripts/standalone-tests.sh
#
# Every case runs the real script with the real binaries on free loopback ports.
set -euo pipefail
cd "$(dirname "$0")/.."
export IC_BIN_DIR=${IC_BIN_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/debug}
for b in ic-controller ic-agent; do
  [ -x "$IC_BIN_DIR/$b" ] || { echo "standalone-tests: $IC_BIN_DIR/$b missing (run cargo test first)" >&2; exit 1; }
done
WORK=$(mktemp -d)
BG=()
cleanup() {
  for p in "${BG[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }

# Three distinct free loopback ports (held together while chosen, so they differ).
free_ports() {
  python3 -c 'import socket
ss = [socket.socket() for _ in range(3)]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))'
}
new_ports() {
  local p
  read -r -a p <<<"$(free_ports)"
  export IC_GRPC_PORT=${p[0]} IC_HTTP_PORT=${p[1]} IC_AGENT_HTTP_PORT=${p[2]}
  export IC_LOG_DIR=$WORK/logs-$RANDOM
  export IC_UP_TIMEOUT=30
}
# occupy MODE PORT: a python process holding 127.0.0.1:PORT; MODE listen (answers connects) or
# bind (bound, not listening: connects are refused, but a second bind gets EADDRINUSE).
occupy() {
  python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[2])))
if sys.argv[1] == "listen": s.listen()
print("held", flush=True); time.sleep(300)' "$1" "$2" >"$WORK/occupy-$2.out" &
  BG+=($!)
  # Its own file: a previous occupier's "held" must not count for this one.
  for _ in $(seq 50); do grep -q held "$WORK/occupy-$2.out" 2>/dev/null && return 0; sleep 0.1; done
  echo "could not occupy port $2" >&2; return 1
}
# run_script OUT [timeout]: runs standalone.sh to completion (or timeout), echoing its exit status.
run_script() {
  local out=$1 limit=${2:-60} st=0
  timeout "$limit" bash scripts/standalone.sh >"$out" 2>&1 || st=$?
  echo "$st"
}

# 1. A port someone already listens on: refused before anything starts, exit 3, names the port.
new_ports
occupy listen "$IC_HTTP_PORT"
st=$(run_script "$WORK/1.out" 30)
if [ "$st" = 3 ] && grep -q "127.0.0.1:$IC_HTTP_PORT is already in use" "$WORK/1.out"; then
  pass "listening port taken: exit 3 and the port named"
else fail "listening port taken: exit $st"; sed 's/^/  /' "$WORK/1.out" >&2; fi
kill "${BG[-1]}" 2>/dev/null || true

# 2. The controller cannot bind its gRPC port (bound by another socket, not listening, so the
#    pre-check does not see it): the controller exits, the script says so with its log tail.
new_ports
occupy bind "$IC_GRPC_PORT"
st=$(run_script "$WORK/2.out" 60)
if [ "$st" = 1 ] && grep -q "FAILED: ic-controller (pid [0-9]*) exited with status [1-9]" "$WORK/2.out" \
   && grep -q "  | .*[Aa]ddress already in use" "$WORK/2.out" && ! grep -q "stack is up" "$WORK/2.out"; then
  pass "controller dies on a taken port: exit 1 with its last log lines"
else fail "controller dies on a taken port: exit $st"; sed 's/^/  /' "$WORK/2.out" >&2; fi
kill "${BG[-1]}" 2>/dev/null || true

# 3. A plan the agent cannot read: the agent exits, the script says so with its log tail.
new_ports
printf 'shm: [not, a, mapping\n' >"$WORK/bad-plan.yaml"
st=$(IC_PLAN=$WORK/bad-plan.yaml run_script "$WORK/3.out" 60)
if [ "$st" = 1 ] && grep -q "FAILED: ic-agent (pid [0-9]*) exited with status [1-9]" "$WORK/3.out" \
   && grep -q "  | .*bad-plan.yaml" "$WORK/3.out" && ! grep -q "stack is up" "$WORK/3.out"; then
  pass "agent dies on a bad plan: exit 1 with its last log lines"
else fail "agent dies on a bad plan: exit $st"; sed 's/^/  /' "$WORK/3.out" >&2; fi

# 4. The stack comes up, then the agent dies: the script notices, stops the controller, exits 1.
new_ports
bash scripts/standalone.sh >"$WORK/4.out" 2>&1 &
script=$!
BG+=($script)
for _ in $(seq 300); do grep -q "stack is up" "$WORK/4.out" && break; sleep 0.1; done
agent=$(sed -n 's/.*agent pid \([0-9]*\)).*/\1/p' "$WORK/4.out")
ctrl=$(sed -n 's/.*(controller pid \([0-9]*\),.*/\1/p' "$WORK/4.out")
if [ -n "$agent" ] && curl -fs "http://127.0.0.1:$IC_HTTP_PORT/v1/nodes" >/dev/null; then
  kill -KILL "$agent"
  st=0; timeout 20 tail --pid="$script" -f /dev/null || st=timeout
  wait "$script" 2>/dev/null || st=$?
  if [ "$st" = 1 ] && grep -q "FAILED: ic-agent (pid $agent) exited with status 137" "$WORK/4.out" \
     && ! kill -0 "$ctrl" 2>/dev/null; then
    pass "agent killed after start: exit 1, controller stopped"
  else fail "agent killed after start: exit $st"; sed 's/^/  /' "$WORK/4.out" >&2; fi
else fail "stack did not come up"; sed 's/^/  /' "$WORK/4.out" >&2; kill "$script" 2>/dev/null || true; fi

# 5. SIGTERM stops both parts and exits 0.
new_ports
bash scripts/standalone.sh >"$WORK/5.out" 2>&1 &
script=$!
BG+=($script)
for _ in $(seq 300); do grep -q "stack is up" "$WORK/5.out" && break; sleep 0.1; done
agent=$(sed -n 's/.*agent pid \([0-9]*\)).*/\1/p' "$WORK/5.out")
ctrl=$(sed -n 's/.*(controller pid \([0-9]*\),.*/\1/p' "$WORK/5.out")
if [ -n "$agent" ]; then
  kill -TERM "$script"
  st=0; timeout 20 tail --pid="$script" -f /dev/null || st=timeout
  wait "$script" 2>/dev/null || st=$?
  if [ "$st" = 0 ] && ! kill -0 "$agent" 2>/dev/null && ! kill -0 "$ctrl" 2>/dev/null; then
    pass "SIGTERM: exit 0, both parts stopped"
  else fail "SIGTERM: exit $st"; sed 's/^/  /' "$WORK/5.out" >&2; fi
else fail "stack did not come up"; sed 's/^/  /' "$WORK/5.out" >&2; kill "$script" 2>/dev/null || true; fi

# 6. A gRPC port other than 50051 with the default plan: the plan the agent checks follows it (the
#    node's ports check finds the controller's port held, no PortNotListening on 50051); a
#    relative IC_PLAN is taken from the caller's directory (here: a missing one is named as such).
new_ports
bash scripts/standalone.sh >"$WORK/6.out" 2>&1 &
script=$!
BG+=($script)
for _ in $(seq 300); do grep -q "stack is up" "$WORK/6.out" && break; sleep 0.1; done
ok6=""
for _ in $(seq 150); do
  nodes=$(curl -fs "http://127.0.0.1:$IC_HTTP_PORT/v1/nodes" || true)
  if grep -q "port $IC_GRPC_PORT (ic-controller gRPC) is listening" <<<"$nodes"; then ok6=1; break; fi
  sleep 0.2
done
if [ -n "$ok6" ] && ! grep -q PortNotListening <<<"$nodes"; then
  pass "IC_GRPC_PORT=$IC_GRPC_PORT: the plan's controller port follows it"
else fail "IC_GRPC_PORT=$IC_GRPC_PORT: the node's checks do not show that port held"; sed 's/^/  /' "$WORK/6.out" >&2
  printf '  %s\n' "$nodes" >&2; fi
kill -TERM "$script" 2>/dev/null || true
wait "$script" 2>/dev/null || true
new_ports
st=0; (cd "$WORK" && IC_PLAN=no-such-plan.yaml timeout 30 bash "$OLDPWD/scripts/standalone.sh") >"$WORK/6b.out" 2>&1 || st=$?
if [ "$st" = 1 ] && grep -q "IC_PLAN=no-such-plan.yaml: no such file (from $WORK)" "$WORK/6b.out"; then
  pass "a relative IC_PLAN is read from the caller's directory"
else fail "relative IC_PLAN: exit $st"; sed 's/^/  /' "$WORK/6b.out" >&2; fi

# 7. No curl: said up front, before anything starts (not "command not found" every 0.2 s).
mkdir -p "$WORK/nocurl"
for t in bash dirname mktemp sed grep find cat tail sleep kill timeout; do
  p=$(command -v "$t" 2>/dev/null) && [ "${p#/}" != "$p" ] && ln -sf "$p" "$WORK/nocurl/$t"
done
st=0; PATH="$WORK/nocurl" timeout 30 bash scripts/standalone.sh >"$WORK/7.out" 2>&1 || st=$?
if [ "$st" = 1 ] && grep -q "curl is not installed" "$WORK/7.out" && ! grep -q "command not found" "$WORK/7.out"; then
  pass "no curl: named before starting"
else fail "no curl: exit $st"; sed 's/^/  /' "$WORK/7.out" >&2; fi

# 8. The demo on a healthy machine without an NVIDIA stack (the plan's gpuNode: false) reads Ok,
#    not Unknown: the gpu and cuda checks say GpuNotExpected / CudaNotExpected (they read Unknown
#    before), in the agent's report and in the controller's /v1/nodes. The gRPC port (which the
#    default plan follows) is taken below the ephemeral port range: the ports check warns about a
#    planned port inside it, as 50051 is in Linux's default range.
new_ports
IC_GRPC_PORT=$(python3 -c 'import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for p in random.sample(range(20000, min(low, 32768)), 200):
    try:
        s = socket.socket(); s.bind(("127.0.0.1", p)); s.close(); print(p); break
    except OSError: pass')
export IC_GRPC_PORT
bash scripts/standalone.sh >"$WORK/8.out" 2>&1 &
script=$!
BG+=($script)
for _ in $(seq 300); do grep -q "stack is up" "$WORK/8.out" && break; sleep 0.1; done
verdict=none
for _ in $(seq 150); do
  verdict=$(python3 - "$IC_AGENT_HTTP_PORT" "$IC_HTTP_PORT" <<'PYEOF' 2>/dev/null || echo unreachable
import json, sys, urllib.request
get = lambda port, path: json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5))
report = get(sys.argv[1], "/v1/report")
if not {"gpu", "cuda"} <= {c["name"] for c in report["checks"]}:
    print("pending"); sys.exit()
nodes = [n["status"] for n in get(sys.argv[2], "/v1/nodes")["nodes"]]
bad = [f'{c["name"]}/{c["subject"]}: {c["status"]} {c["reason"]}' for c in report["checks"] if c["status"] != "Ok"]
if report["status"] != "Ok" or nodes != ["Ok"]:
    print(f'report {report["status"]}, /v1/nodes {nodes}: {bad}'); sys.exit()
host = [c["reason"] for c in report["checks"] if c["name"] in ("gpu", "cuda") and c["subject"] == "host"]
# without an NVIDIA stack; on a GPU machine gpu adds GpusNotPlanned next to its GpuOk results
print("ok" if host in (["GpuNotExpected", "CudaNotExpected"], ["GpusNotPlanned"]) else f"gpu/cuda host results {host}")
PYEOF
)
  [ "$verdict" = ok ] && break
  case $verdict in pending|unreachable) sleep 0.2 ;; *) break ;; esac
done
kill -TERM "$script" 2>/dev/null || true
timeout 20 tail --pid="$script" -f /dev/null || true
if [ "$verdict" = ok ]; then
  pass "a healthy machine without GPUs (plan gpuNode: false) reads Ok in the report and /v1/nodes"
else fail "a healthy machine without GPUs reads: $verdict"; sed 's/^/  /' "$WORK/8.out" >&2; fi

[ "$failures" = 0 ] || { echo "standalone-tests: $failures failed" >&2; exit 1; }
echo "standalone-tests: all passed"
