#!/usr/bin/env bash
# Footprint of `ic-agent run` (issue 5, "Footprint"): the release agent with 4 engine KV-event
# streams (`ic-agent kv publish` replaying recorded engine frames) and a plan with every check,
# measured over a window: RSS (VmRSS / VmHWM from /proc/<pid>/status), CPU in millicores
# (utime + stime from /proc/<pid>/stat), and the full check pass duration (p99 from the agent's
# inferencecache_agent_check_pass_duration_seconds histogram). Targets: RSS <= 32 MiB,
# <= 2 millicores idle, pass p99 < 100 ms.
#
# Phases: "idle" (streams connected, publishers quiet after one pass over their fixture, checks
# every CHECK_INTERVAL seconds) is what the targets are about; "active" (ACTIVE_SECONDS > 0:
# publishers replay their fixtures in a loop every 50 ms) is reported for information.
#
# As root (the CI and bench machines) everything runs in a private network and mount namespace
# (`unshare -n -m`, nothing reaches the host's network), the publishers are put into kubepods
# cgroups (cgroup v1 pids or cgroup v2) so that the pod-aware checks (shm per pod, MP worker by
# pod UID) find real processes, and a read-only tmpfs is the reader volume; without root those
# parts fall back to paths and pods that do not exist.
#
#   WINDOW=60 CHECK_INTERVAL=5 ACTIVE_SECONDS=30 scripts/footprint.sh
#
# Memory by held block count (issue 37 item 6, issue 41 item 5): `--blocks N[,N…]` measures,
# for each N in a fresh stack, the release agent's VmRSS / VmHWM while it holds N blocks of one
# vLLM stream — vLLM's own publisher (node-tests/vllm-faults/engine.py: the released wheel's
# kv_events.py over the fault suite's block-pool model with N physical blocks) churning at RATE
# (20 000) block events/s for WINDOW (30) s, a release `ic-controller standalone` receiving —
# and prints KiB per held block (scripts/footprint-blocks.py; docs/benchmarks.md "Agent memory
# by held blocks"). Needs scripts/fetch-vllm.sh's output (IC_VLLM_DIR, default
# target/ci-cache/vllm).
#
#   scripts/footprint.sh --blocks 16384,65536,100000,300000,1000000
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --blocks | --blocks=*)
    counts=${1#--blocks}
    counts=${counts#=}
    [ -n "$counts" ] || counts=${2:-}
    [ -n "$counts" ] || { echo "usage: scripts/footprint.sh --blocks N[,N...]" >&2; exit 2; }
    cargo build --release --quiet -p ic-agent --bin ic-agent -p ic-controller --bin ic-controller
    exec python3 scripts/footprint-blocks.py "$counts"
    ;;
esac
WINDOW=${WINDOW:-60}
WARMUP=${WARMUP:-10}
CHECK_INTERVAL=${CHECK_INTERVAL:-5}
ACTIVE_SECONDS=${ACTIVE_SECONDS:-0}
FIXTURES=${IC_FIXTURES:-testdata/kv-events}
HTTP_PORT=${HTTP_PORT:-19090}
BASE_PORT=${BASE_PORT:-25557}

if [ -z "${FOOTPRINT_INNER:-}" ]; then
  cargo build --release --quiet -p ic-agent --bin ic-agent
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
    exec unshare -n -m --propagation private env FOOTPRINT_INNER=1 bash "$0" "$@"
  fi
fi
BIN=$PWD/target/release/ic-agent
# Under `unshare -n` this private network namespace stands for the host's: the ports check
# compares its socket tables with PID 1's otherwise (the real host's) and would report every
# port NotHostNetwork without reading the tables or scanning for owners.
[ -n "${FOOTPRINT_INNER:-}" ] && export IC_HOST_NETNS=/proc/self/net
WORK=$(mktemp -d)
PIDS=()
CGROUPS=()
is_root=0
if [ -n "${FOOTPRINT_INNER:-}" ]; then
  is_root=1
  ip link set lo up
fi

cleanup() {
  set +e
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  # cgroups: move anything left to the root, remove leaf first
  for ((i = ${#CGROUPS[@]} - 1; i >= 0; i--)); do
    d=${CGROUPS[$i]}
    if [ -f "$d/cgroup.procs" ]; then
      root=${d%%/kubepods*}
      while read -r p; do echo "$p" > "$root/cgroup.procs"; done < "$d/cgroup.procs"
    fi
    rmdir "$d" 2>/dev/null
  done
  [ $is_root = 1 ] && umount "$WORK/models" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# A kubepods cgroup for a pod UID (cgroupfs form under v1 pids, systemd form under cgroup v2);
# prints nothing and fails when this host does not allow it.
pod_cgroup() {
  local uid=$1 pid=$2 root dir
  for root in /sys/fs/cgroup/pids /sys/fs/cgroup/unified /sys/fs/cgroup; do
    [ -d "$root" ] || continue
    if [ "$root" = /sys/fs/cgroup/pids ]; then
      dir=$root/kubepods/besteffort/pod$uid
    else
      [ -f "$root/cgroup.controllers" ] || continue
      dir=$root/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod${uid//-/_}.slice
    fi
    local d=$root
    IFS=/ read -r -a parts <<< "${dir#"$root"/}"
    for part in "${parts[@]}"; do
      d=$d/$part
      if [ ! -d "$d" ]; then
        mkdir "$d" 2>/dev/null || return 1
        CGROUPS+=("$d")
      fi
    done
    echo "$pid" > "$dir/cgroup.procs" 2>/dev/null || return 1
    return 0
  done
  return 1
}

# ---- 4 engine streams
fixtures=(vllm-0.24.0 vllm-0.26.0 vllm-0.14.0 sglang-0.5.18)
PUBS=()
start_publisher() { # index repeat
  local i=$1 repeat=$2 pub rep uid
  pub=$((BASE_PORT + 2 * i))
  rep=$((pub + 1))
  "$BIN" kv publish --fixture "$FIXTURES/${fixtures[$i]}.json" --endpoint "tcp://127.0.0.1:$pub" \
    --replay-endpoint "tcp://127.0.0.1:$rep" --repeat "$repeat" --interval-ms 50 \
    --connect-wait-ms 3000 --linger-seconds 3600 >> "$WORK/pub$i.log" 2>&1 &
  PUBS[$i]=$!
  PIDS+=($!)
  uid=$(printf 'f00df00d-0000-4000-8000-%012d' "$i")
  IN_POD[$i]=0
  if [ $is_root = 1 ] && pod_cgroup "$uid" "${PUBS[$i]}"; then IN_POD[$i]=1; fi
}
IN_POD=()
for i in 0 1 2 3; do start_publisher "$i" 1; done

engines=""
ports_plan=""
for i in 0 1 2 3; do
  f=${fixtures[$i]}
  pub=$((BASE_PORT + 2 * i))
  rep=$((pub + 1))
  uid=$(printf 'f00df00d-0000-4000-8000-%012d' "$i")
  scheme=vllm
  [[ $f == sglang* ]] && scheme=sglang
  uid_line=""
  [ "${IN_POD[$i]}" = 1 ] && uid_line="    podUid: $uid"
  engines+="  - namespace: bench
    pod: engine-$i
$uid_line
    model: m$i
    hashScheme: $scheme
    shmRequiredBytes: 1048576
    mpWorkerPort: $((BASE_PORT + 100 + i))
    kvEvents:
      - { endpoint: \"tcp://127.0.0.1:$pub\", replayEndpoint: \"tcp://127.0.0.1:$rep\", dpRank: 0 }
"
  ports_plan+="  - { port: $pub, expect: held, owner: { exe: \"$BIN\" }, purpose: \"engine $i KV events\" }
  - { port: $((BASE_PORT + 200 + i)), expect: free, purpose: \"hostNetwork engine $i\" }
"
done

MODELS=$WORK/models
mkdir -p "$MODELS"
echo '{"architectures":["LlamaForCausalLM"]}' > "$WORK/config.json"
SHA=$(sha256sum "$WORK/config.json" | cut -d' ' -f1)
cat > "$WORK/plan.yaml" <<EOF
gpuNode: false
shm: { requiredBytes: 1048576 }
cuda: { runtimeVersion: "12.8" }
ports:
$ports_plan
engines:
$(printf '%s' "$engines" | sed '/^$/d')
readerMounts:
  - { namespace: bench, pod: reader-0, path: "$MODELS", samples: [{ file: config.json, sha256: "$SHA" }] }
EOF

# ---- the reader volume: a read-only tmpfs (private mount namespace, root only)
if [ $is_root = 1 ]; then
  mount -t tmpfs -o size=1m models "$MODELS"
  cp "$WORK/config.json" "$MODELS/"
  mount -o remount,ro "$MODELS"
fi

# ---- the agent
"$BIN" run --plan "$WORK/plan.yaml" --http-addr "127.0.0.1:$HTTP_PORT" \
  --check-interval-seconds "$CHECK_INTERVAL" --node footprint > "$WORK/agent.log" 2>&1 &
AGENT=$!
PIDS+=("$AGENT")

for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fs "http://127.0.0.1:$HTTP_PORT/healthz" >/dev/null || {
  echo "agent did not start:"; cat "$WORK/agent.log"; exit 1; }

CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$AGENT/stat"; }
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$AGENT/status"; }
hwm_kib() { awk '/^VmHWM:/ {print $2}' "/proc/$AGENT/status"; }

measure() { # name seconds
  local name=$1 secs=$2 t0 t1 c0 c1 max=0 sum=0 n=0 r
  c0=$(cpu_ticks); t0=$(date +%s.%N)
  for _ in $(seq "$secs"); do
    sleep 1
    r=$(rss_kib); sum=$((sum + r)); n=$((n + 1))
    [ "$r" -gt "$max" ] && max=$r
  done
  c1=$(cpu_ticks); t1=$(date +%s.%N)
  awk -v n="$name" -v c0="$c0" -v c1="$c1" -v t0="$t0" -v t1="$t1" -v hz="$CLK_TCK" \
      -v max="$max" -v sum="$sum" -v cnt="$n" 'BEGIN {
    printf "%-7s window %5.1f s  CPU %6.2f millicores  RSS avg %6.1f MiB  max %6.1f MiB\n",
      n, t1 - t0, (c1 - c0) / hz / (t1 - t0) * 1000, sum / cnt / 1024, max / 1024 }'
}

echo "warming up ${WARMUP}s (agent pid $AGENT, plan $WORK/plan.yaml) ..."
sleep "$WARMUP"
echo "--- results"
measure idle "$WINDOW"
if [ "$ACTIVE_SECONDS" -gt 0 ]; then
  # the same streams, now replaying their fixtures in a loop (subscribers see engine restarts)
  for i in 0 1 2 3; do kill "${PUBS[$i]}" 2>/dev/null; wait "${PUBS[$i]}" 2>/dev/null; done
  for i in 0 1 2 3; do start_publisher "$i" 0; done
  sleep 5
  measure active "$ACTIVE_SECONDS"
fi
awk '/^VmHWM:/ {printf "peak    VmHWM %.1f MiB\n", $2 / 1024}' "/proc/$AGENT/status"

curl -fs "http://127.0.0.1:$HTTP_PORT/metrics" > "$WORK/metrics.txt"
awk '
  /^inferencecache_agent_check_pass_duration_seconds_bucket/ {
    match($0, /le="[^"]+"/); le = substr($0, RSTART + 4, RLENGTH - 5); b[++n] = le; c[n] = $2 }
  /^inferencecache_agent_check_pass_duration_seconds_sum/ { sum = $2 }
  /^inferencecache_agent_check_pass_duration_seconds_count/ { cnt = $2 }
  END {
    want = cnt * 0.99; p99 = "+Inf"
    for (i = 1; i <= n; i++) if (c[i] >= want) { p99 = b[i]; break }
    printf "passes  %d  mean %.1f ms  p99 <= %s s (histogram bucket bound)\n", cnt, sum / cnt * 1000, p99 }
' "$WORK/metrics.txt"
curl -fs "http://127.0.0.1:$HTTP_PORT/v1/report" > "$WORK/report.json"
python3 - "$WORK/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("report  node %s, %s, %d results:" % (r["node"], r["status"], len(r["checks"])))
for c in r["checks"]:
    print("   %-9s %-32s %-8s %s" % (c["name"], c["subject"][:32], c["status"], c["reason"]))
for s in r.get("kvStreams", []) or []:
    print("   stream", json.dumps(s)[:160])
PY
