#!/usr/bin/env bash
# Image tests (issue 16 "Images that build and run", issue 15 item 6 "Agent without privileged"),
# in a real Docker engine:
#
#  1. builds Dockerfile.controller and Dockerfile.agent from the binaries the test build already
#     made (BIN_SOURCE=prebuilt; no Rust toolchain in a container, no release build) on a base
#     image made here (debootstrap --variant=minbase bookworm + docker import: no registry is
#     reachable) and prints their sizes;
#  2. runs the controller image under the chart's controller securityContext (flags derived from
#     the rendered chart by chart-tests/docker_flags.py): non-root, read-only root, /healthz;
#  3. runs `ic-agent check` in the agent image under exactly the DaemonSet's securityContext,
#     hostPID, hostNetwork, host mounts and environment (derived the same way), next to engine
#     "pods" — containers under kubepods cgroup parents with their own network namespace and
#     /dev/shm: an engine with an LMCache MP worker, a hostNetwork engine holding a port, a reader
#     of a read-only model volume (one sample readable by its writer's uid alone). Every check
#     passes with only the granted capabilities; with one of them taken away, the checks that
#     need it read Unknown naming it;
#  4. runs `ic-agent run` the same way and reads /proc/<pid>/task/*/status: only the checks
#     thread (and threads it started) holds capabilities; every other thread — those that parse
#     engine input — has empty effective and permitted sets, and so has the MP-worker probe.
#
# Needs root, Docker (Debian docker.io; dockerd is started here when none answers) and, for the
# base image, debootstrap and the Debian mirror (once: the root file system is cached as a tar in
# ${CARGO_TARGET_DIR:-target}/ci-cache). Binaries: $IC_BIN_DIR (default
# ${CARGO_TARGET_DIR:-target}/debug) ic-controller, ic-agent and examples/fake_engine, which
# `cargo test -p ic-agent` builds. Python: $IC_CHART_PYTHON (default .venv/chart-tests/bin/python,
# made by scripts/chart-tests.sh).
#
# Without a usable Docker engine this fails. IC_IMAGE_TESTS_ALLOW_SKIP=1 turns that into a loud
# SKIPPED with exit 0 (for machines without Docker; CI never sets it).
#
# Environment: IC_BASE_IMAGE (default local/bookworm:min, made when missing), IC_DOCKER (the
# docker CLI; default one that can build with BuildKit), IC_KEEP_WORKDIR=1 (keep the temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf 'image-tests: %s\n' "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
started=$(date +%s)

unavailable() {
  if [ "${IC_IMAGE_TESTS_ALLOW_SKIP:-}" = 1 ]; then
    say "SKIPPED (IC_IMAGE_TESTS_ALLOW_SKIP=1): $*"
    exit 0
  fi
  fail "$* (install docker.io and debootstrap and run as root; IC_IMAGE_TESTS_ALLOW_SKIP=1 skips loudly)"
}

BIN=${IC_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/debug}
EXAMPLES=${IC_EXAMPLES_DIR:-$BIN/examples}
CACHE=${CARGO_TARGET_DIR:-$ROOT/target}/ci-cache
BASE=${IC_BASE_IMAGE:-local/bookworm:min}
PY=${IC_CHART_PYTHON:-$ROOT/.venv/chart-tests/bin/python}
for f in "$BIN/ic-controller" "$BIN/ic-agent" "$EXAMPLES/fake_engine"; do
  [ -x "$f" ] || fail "$f is missing: run 'cargo test -p ic-agent -p ic-controller --no-run' (or scripts/test.sh) first"
done
[ -x "$PY" ] || fail "$PY is missing: run scripts/chart-tests.sh first (it makes the venv with the Helm SDK)"
[ "$(id -u)" = 0 ] || unavailable "not root"

# --- Docker ------------------------------------------------------------------------------------
# A CLI that builds with BuildKit (the Dockerfiles use RUN --mount and skip unused stages): a
# docker with the buildx plugin, else Debian's own 20.10 CLI, whose built-in BuildKit needs none.
DOCKER=${IC_DOCKER:-}
if [ -z "$DOCKER" ]; then
  if command -v docker >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; then
    DOCKER=docker
  elif [ -x /usr/bin/docker ]; then
    DOCKER=/usr/bin/docker
  elif command -v docker >/dev/null 2>&1; then
    DOCKER=docker
  else
    unavailable "no docker CLI"
  fi
fi
export DOCKER_BUILDKIT=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ic-image-tests.XXXXXX")
started_dockerd=""
LABEL="ic-image-tests=$$"
cleanup() {
  local ids
  ids=$($DOCKER ps -aq --filter "label=$LABEL" 2>/dev/null || true)
  [ -n "$ids" ] && $DOCKER rm -f $ids >/dev/null 2>&1 || true
  if [ -n "$started_dockerd" ]; then kill "$started_dockerd" 2>/dev/null || true; wait "$started_dockerd" 2>/dev/null || true; fi
  if [ "${IC_KEEP_WORKDIR:-}" = 1 ]; then say "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
if ! $DOCKER info >/dev/null 2>&1; then
  command -v dockerd >/dev/null 2>&1 || unavailable "no Docker engine answers and dockerd is not installed"
  say "starting dockerd (log: $WORK/dockerd.log)"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 0.5; done
  $DOCKER info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; unavailable "dockerd did not come up"; }
fi

# --- base image ----------------------------------------------------------------------------------
if ! $DOCKER image inspect "$BASE" >/dev/null 2>&1; then
  [ "$BASE" = local/bookworm:min ] || fail "base image $BASE is not present (IC_BASE_IMAGE)"
  tarball=$CACHE/bookworm-minbase.tar
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null 2>&1 || unavailable "debootstrap is not installed (needed once for the base image)"
    say "debootstrap --variant=minbase bookworm (once, about 2 minutes)"
    rootfs=$WORK/rootfs
    debootstrap --variant=minbase bookworm "$rootfs" >"$WORK/debootstrap.log" 2>&1 ||
      { tail -20 "$WORK/debootstrap.log" >&2; fail "debootstrap failed"; }
    # What a slim image leaves out: package caches, lists, documentation.
    rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
      "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    mkdir -p "$CACHE"
    tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  $DOCKER import "$tarball" "$BASE" >/dev/null
fi

# --- build ----------------------------------------------------------------------------------------
ctx=$WORK/ctx
mkdir -p "$ctx/bin"
for b in ic-controller ic-agent; do
  # Debug info is no part of an image (CI builds without it already).
  objcopy --strip-debug "$BIN/$b" "$ctx/bin/$b" 2>/dev/null || cp "$BIN/$b" "$ctx/bin/$b"
done
for c in controller agent; do
  say "building ic-$c:image-test on $BASE from $BIN/ic-$c"
  $DOCKER build -q -f "Dockerfile.$c" --build-arg BIN_SOURCE=prebuilt --build-arg BIN_DIR=bin \
    --build-arg BASE_IMAGE="$BASE" -t "ic-$c:image-test" "$ctx" >"$WORK/build-$c.log" 2>&1 ||
    { cat "$WORK/build-$c.log" >&2; fail "docker build -f Dockerfile.$c"; }
done
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
base_size=$($DOCKER image inspect -f '{{.Size}}' "$BASE")
for c in controller agent; do
  size=$($DOCKER image inspect -f '{{.Size}}' "ic-$c:image-test")
  say "size: ic-$c:image-test $(mib "$size") ($size bytes; base $BASE $(mib "$base_size"), binary $(mib "$(stat -c %s "$ctx/bin/ic-$c")"), a debug build)"
done

run() { $DOCKER run --label "$LABEL" "$@"; }
status_field() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }

# --- controller: non-root, read-only root, /healthz ------------------------------------------------
mapfile -t cflags < <("$PY" chart-tests/docker_flags.py controller --workdir "$WORK")
[ ${#cflags[@]} -gt 0 ] || fail "no controller flags from the chart"
say "controller flags from the chart: ${cflags[*]}"
image_user=$($DOCKER image inspect -f '{{.Config.User}}' ic-controller:image-test)
[ "${image_user%%:*}" != 0 ] && [ -n "$image_user" ] || fail "the controller image's user is '$image_user' (runAsNonRoot)"
cid=$(run -d "${cflags[@]}" ic-controller:image-test standalone --grpc-addr 0.0.0.0:50051 \
  --http-addr 0.0.0.0:8080 --allow-unauthenticated-non-loopback)
ip=$($DOCKER inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$cid")
healthz=""
for _ in $(seq 60); do
  healthz=$(curl -fsS --max-time 2 "http://$ip:8080/healthz" 2>/dev/null || true)
  [ -n "$healthz" ] && break
  [ "$($DOCKER inspect -f '{{.State.Running}}' "$cid")" = true ] || break
  sleep 0.5
done
[ "$healthz" = ok ] || { $DOCKER logs "$cid" 2>&1 | tail -20 >&2; fail "controller /healthz on $ip:8080 answered '${healthz}'"; }
cpid=$($DOCKER inspect -f '{{.State.Pid}}' "$cid")
cuid=$(status_field "$cpid" Uid)
[ "$cuid" = 65532 ] || fail "the controller runs as uid $cuid, not 65532"
root_opts=$(awk '$5 == "/" { print $6 }' "/proc/$cpid/mountinfo" | tail -1)
case ",$root_opts," in *,ro,*) ;; *) fail "the controller's root is mounted '$root_opts', not read-only" ;; esac
[ "$(status_field "$cpid" CapEff)" = 0000000000000000 ] || fail "the controller holds capabilities: $(status_field "$cpid" CapEff)"
say "ok: controller image answers /healthz as uid $cuid on a read-only root ($root_opts), no capabilities"
$DOCKER rm -f "$cid" >/dev/null

# --- engine "pods" ---------------------------------------------------------------------------------
uuid() { cat /proc/sys/kernel/random/uuid; }
ENGINE_UID=$(uuid) HOSTNET_UID=$(uuid) READER_UID=$(uuid)
fake=(-v "$EXAMPLES/fake_engine:/usr/local/bin/fake-engine:ro")
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ENGINE_PORT=$(free_port)
AGENT_PORT=$(free_port)
mkdir -p "$WORK/models" "$WORK/plan"
printf '{"architectures": ["LlamaForCausalLM"]}\n' >"$WORK/models/config.json"
SAMPLE_SHA=$(sha256sum "$WORK/models/config.json" | cut -d' ' -f1)
# A writer Job running as another uid with umask 077: only that uid may read the file.
printf 'weights\n' >"$WORK/models/model.safetensors"
chown 1000:1000 "$WORK/models/model.safetensors" && chmod 0600 "$WORK/models/model.safetensors"
PRIVATE_SHA=$(sha256sum "$WORK/models/model.safetensors" | cut -d' ' -f1)
# An engine with its own network namespace and a 64 MiB /dev/shm (Docker's --shm-size, as an
# emptyDir medium Memory would give), serving an LMCache MP worker on its loopback.
run -d --cgroup-parent "/kubepods/besteffort/pod$ENGINE_UID" --shm-size 64m "${fake[@]}" "$BASE" \
  fake-engine --mp-worker tcp://127.0.0.1:5555 >/dev/null
# A hostNetwork engine holding a node port.
run -d --cgroup-parent "/kubepods/burstable/pod$HOSTNET_UID" --network host "${fake[@]}" "$BASE" \
  fake-engine --listen "127.0.0.1:$ENGINE_PORT" >/dev/null
# A reader of a model volume mounted read-only.
run -d --cgroup-parent "/kubepods/besteffort/pod$READER_UID" -v "$WORK/models:/models:ro" "${fake[@]}" \
  "$BASE" fake-engine >/dev/null
cat >"$WORK/plan/plan.yaml" <<EOF
gpuNode: false
shm: {requiredBytes: 1048576}
ports:
  - {port: $ENGINE_PORT, expect: held, purpose: engine serving port, owner: {exe: /usr/local/bin/fake-engine, podUid: $HOSTNET_UID}}
engines:
  - {namespace: team-a, pod: engine-0, podUid: $ENGINE_UID, model: m, shmRequiredBytes: 33554432, mpWorkerPort: 5555}
readerMounts:
  - {namespace: team-a, pod: reader-0, podUid: $READER_UID, path: /models, samples: [{file: config.json, sha256: $SAMPLE_SHA}, {file: model.safetensors, sha256: $PRIVATE_SHA}]}
EOF
sleep 1
for id in $($DOCKER ps -q --filter "label=$LABEL"); do
  $DOCKER logs "$id" 2>&1 | grep -q '^ready$' || { $DOCKER logs "$id" >&2; fail "an engine pod did not come up"; }
done

# --- agent: exactly the DaemonSet's securityContext, mounts, hostPID, hostNetwork ------------------
# The chart's default mounts no kubelet pod directory (agent.hostPaths.kubeletPodsDir is opt-in,
# for `ic-agent qualify`): every check below passes without it.
mapfile -t aflags < <("$PY" chart-tests/docker_flags.py agent --workdir "$WORK" \
  --set "agent.hostPaths.state=$WORK/agent-state")
[ ${#aflags[@]} -gt 0 ] || fail "no agent flags from the chart"
say "agent flags from the chart: ${aflags[*]}"
granted=()
for i in "${!aflags[@]}"; do [ "${aflags[$i]}" = --cap-add ] && granted+=("${aflags[$((i + 1))]}"); done
[ ${#granted[@]} -gt 0 ] || fail "the chart grants the agent no capability: nothing to prove"
# without CAP: the flags with `--cap-add CAP` taken out.
without() {
  local out=() i=0
  while [ $i -lt ${#aflags[@]} ]; do
    if [ "${aflags[$i]}" = --cap-add ] && [ "${aflags[$((i + 1))]}" = "$1" ]; then i=$((i + 2)); continue; fi
    out+=("${aflags[$i]}"); i=$((i + 1))
  done
  printf '%s\n' "${out[@]}"
}
plan_mount=(-v "$WORK/plan:/etc/ic-plan:ro")
verify() { # verify LABEL DROPPED_CAP JSON_FILE
  "$PY" - "$@" "$ENGINE_PORT" <<'PYEOF'
import json, sys
label, dropped, path, port = sys.argv[1:5]
report = json.load(open(path))
got = {(r["name"], r["subject"]): r for r in report["checks"]}
ok = {
    ("shm", "host"): ("Ok", "ShmOk"),
    ("shm", "team-a/engine-0"): ("Ok", "ShmOk"),
    ("mp_worker", "team-a/engine-0"): ("Ok", "MpWorkerLive"),
    ("ports", "host"): ("Ok", "ListeningPorts"),
    ("ports", f"tcp/{port}"): ("Ok", "PortOk"),
    ("mounts", "team-a/reader-0:/models"): ("Ok", "ReaderVolumeReadOnly"),
    # No NVIDIA driver on this machine and the plan expects no GPU: Ok as expected, unrelated
    # to capabilities.
    ("gpu", "host"): ("Ok", "GpuNotExpected"),
    ("cuda", "host"): ("Ok", "CudaNotExpected"),
}
# What each capability's absence turns Unknown (docs/checks.md "Capabilities").
affected = {
    "SYS_ADMIN": {("mp_worker", "team-a/engine-0"): "MpWorkerProbeFailed"},
    "DAC_READ_SEARCH": {("mounts", "team-a/reader-0:/models"): "ReaderVolumeSampleUnreadable"},
    "SYS_PTRACE": {
        ("shm", "team-a/engine-0"): "PodNotInspectable",
        ("mp_worker", "team-a/engine-0"): "PodNotInspectable",
        ("mounts", "team-a/reader-0:/models"): "PodNotInspectable",
        ("ports", f"tcp/{port}"): "PortOwnerUnknown",
    },
}
# The ports check's ephemeral-range result follows this host's sysctls (the agent reads the
# host's /proc): the engine port inside net.ipv4.ip_local_port_range and not reserved is a
# Warning, else Clear.
def reserved(p: int) -> bool:
    text = open("/proc/sys/net/ipv4/ip_local_reserved_ports").read().strip()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        if int(a) <= p <= int(b or a):
            return True
    return False
lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
at_risk = lo <= int(port) <= hi and not reserved(int(port))
ok[("ports", "ephemeral-range")] = ("Warning", "PortsInEphemeralRange") if at_risk else ("Ok", "EphemeralRangeClear")
want = dict(ok)
for key, reason in affected.get(dropped, {}).items():
    want[key] = ("Unknown", reason)
errors = []
for key, (status, reason) in want.items():
    r = got.get(key)
    if r is None:
        errors.append(f"{key}: no result")
        continue
    if (r["status"], r["reason"]) != (status, reason):
        errors.append(f"{key}: {r['status']}/{r['reason']} ({r['message']}), want {status}/{reason}")
    elif key in affected.get(dropped, {}) and f"CAP_{dropped}" not in r["message"]:
        errors.append(f"{key}: the message does not name CAP_{dropped}: {r['message']}")
for key in set(got) - set(want):
    errors.append(f"{key}: unexpected result {got[key]['status']}/{got[key]['reason']}")
# The ports check compares its socket tables with the host's by stat(2), which needs no
# capability: in every run it must have vouched that they are the host's (hostNetwork).
unverified = (got.get(("ports", "host"), {}).get("observed") or {}).get("hostNetworkUnverified")
if unverified:
    errors.append(f"('ports', 'host'): the host network namespace was not verified: {unverified}")
if errors:
    print(f"{label}:\n  " + "\n  ".join(errors), file=sys.stderr)
    sys.exit(1)
for key in sorted(affected.get(dropped, {})):
    print(f"  {label}: {key[0]} {key[1]} -> Unknown {got[key]['reason']}: {got[key]['message']}")
print(f"{label}: {len(want)} results as expected")
PYEOF
}
check_with() { # check_with NAME FLAGS...
  local name=$1; shift
  set +e
  run --rm "$@" "${plan_mount[@]}" ic-agent:image-test check --plan /etc/ic-plan/plan.yaml --json \
    >"$WORK/check-$name.json" 2>"$WORK/check-$name.err"
  local rc=$?
  set -e
  [ -s "$WORK/check-$name.json" ] || { cat "$WORK/check-$name.err" >&2; fail "ic-agent check ($name) printed nothing (exit $rc)"; }
  echo "$rc"
}
rc=$(check_with granted "${aflags[@]}")
verify "granted ${granted[*]}" none "$WORK/check-granted.json" || fail "ic-agent check with the chart's capabilities"
# Its exit status follows the worst result verify() pinned: 0 with every check Ok or Unknown, 1
# with a Warning (the ephemeral-range result on a host whose range holds the engine's port).
want_rc=$("$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(1 if any(c["status"] == "Warning" for c in r["checks"]) else 0)' "$WORK/check-granted.json")
[ "$rc" = "$want_rc" ] || fail "ic-agent check exited $rc, not $want_rc (0 for Ok/Unknown, 1 for a Warning)"
say "ok: every check passes in the agent image with only ${granted[*]}"
for cap in "${granted[@]}"; do
  mapfile -t fewer < <(without "$cap")
  check_with "no-$cap" "${fewer[@]}" >/dev/null
  verify "without $cap" "$cap" "$WORK/check-no-$cap.json" || fail "ic-agent check without $cap"
done

# --- agent run: which threads hold capabilities ----------------------------------------------------
aid=$(run -d "${aflags[@]}" "${plan_mount[@]}" ic-agent:image-test run --plan /etc/ic-plan/plan.yaml \
  --http-addr "127.0.0.1:$AGENT_PORT" --check-interval-seconds 1 --t2-scrape-interval-seconds 0)
ready=""
for _ in $(seq 60); do
  ready=$(curl -fsS --max-time 2 "http://127.0.0.1:$AGENT_PORT/readyz" 2>/dev/null || true)
  [ -n "$ready" ] && break
  sleep 0.5
done
[ -n "$ready" ] || { $DOCKER logs "$aid" 2>&1 | tail -20 >&2; fail "ic-agent run did not become ready"; }
sleep 2 # a second pass, so the MP-worker probe thread has come and gone again
curl -fsS --max-time 5 "http://127.0.0.1:$AGENT_PORT/v1/report" >"$WORK/report.json"
apid=$($DOCKER inspect -f '{{.State.Pid}}' "$aid")
# The checks run in the supervisor (the agent's child) and its worker (the supervisor's child):
# ic_agent::checks_worker. Their pids from /proc/*/stat's ppid field (comm ic-checks-sup / -work).
child_of() { # PARENT COMM -> pid of the live child of PARENT named COMM
  local s
  for s in /proc/[0-9]*/stat; do
    awk -v p="$1" -v c="($2)" '$2 == c && $3 != "Z" && $4 == p { print $1 }' "$s" 2>/dev/null
  done | head -1
}
spid=$(child_of "$apid" ic-checks-sup)
wpid=""
[ -n "$spid" ] && wpid=$(child_of "$spid" ic-checks-work)
[ -n "$spid" ] && [ -n "$wpid" ] || fail "ic-agent run has no checks supervisor/worker child (supervisor '${spid}', worker '${wpid}')"
: >"$WORK/threads.txt"
for who in agent:"$apid" supervisor:"$spid" worker:"$wpid"; do
  for t in /proc/"${who#*:}"/task/*; do
    # A short-lived thread (the MP-worker probe's, checked through the report below) may end
    # between the listing and these reads: it is skipped, not read half.
    comm=$(cat "$t/comm" 2>/dev/null) && status=$(cat "$t/status" 2>/dev/null) || continue
    printf '%s %s %s %s %s\n' "${who%%:*}" "${t##*/}" "$comm" "$(awk '$1 == "CapEff:" { print $2 }' <<<"$status")" \
      "$(awk '$1 == "CapPrm:" { print $2 }' <<<"$status")" >>"$WORK/threads.txt"
  done
done
"$PY" - "$WORK/threads.txt" "$WORK/report.json" "$(status_field "$apid" CapBnd)" <<'PYEOF' || fail "thread capabilities of ic-agent run"
import json, sys
threads = [l.split() for l in open(sys.argv[1]) if l.strip()]
report = json.load(open(sys.argv[2]))
bounding = int(sys.argv[3], 16)
zero = "0000000000000000"
errors = []
for who, tid, comm, eff, prm in threads:
    if who == "agent":
        # No thread of the agent's own process holds a capability, the main thread included.
        if (eff, prm) != (zero, zero):
            errors.append(f"agent thread {tid} ({comm}) holds CapEff {eff} CapPrm {prm}")
    elif comm != "ic-mp-probe" and (int(eff, 16), int(prm, 16)) != (bounding, bounding):
        # The checks processes hold the granted set (the MP-worker probe thread drops it).
        errors.append(f"{who} thread {tid} ({comm}) holds CapEff {eff} CapPrm {prm}, not {bounding:016x}")
for who in ("agent", "supervisor", "worker"):
    if not any(t[0] == who for t in threads):
        errors.append(f"no thread of the {who} read")
mp = [r for r in report["checks"] if r["name"] == "mp_worker" and r["subject"] == "team-a/engine-0"]
if not mp or mp[0]["reason"] != "MpWorkerLive" or mp[0]["observed"].get("probeThreadCapEff") != zero:
    errors.append(f"the MP-worker probe thread: {mp}")
if errors:
    print("\n".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"  {sum(t[0] == 'agent' for t in threads)} agent threads hold nothing; the checks supervisor and worker hold {bounding:016x}; "
      f"the MP-worker probe parsed the reply with CapEff {mp[0]['observed']['probeThreadCapEff']}")
PYEOF
say "ok: in ic-agent run only the checks supervisor and worker processes hold capabilities"
say "passed in $(($(date +%s) - started)) s"
