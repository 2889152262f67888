#!/usr/bin/env bash
# Real-GPU validation of the agent's `gpu` (NVML: devices, XID event registration, ECC, remaps,
# throttling, MIG) and `cuda` (cudarc: init, context, PTX kernel launch, result check) checks.
# Run on a machine with NVIDIA GPUs and the driver installed; prints what the host has, then
# `ic-agent check` as a table and as JSON with a plan that marks the node as a GPU node.
#
#   scripts/gpu-validate.sh                     # builds target/release/ic-agent if missing
#   IC_AGENT_BIN=path/to/ic-agent scripts/gpu-validate.sh   # a binary built elsewhere
#   IC_CUDA_RUNTIME_VERSION=12.8 scripts/gpu-validate.sh    # probe at that runtime's PTX ISA
#
# The JSON also lands in $OUT/gpu-validate.json when OUT is set (a device run's output folder).
# Exit status: that of `ic-agent check` (0 ok/unknown, 1 warning, 2 critical, 3 bad plan).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${IC_AGENT_BIN:-target/release/ic-agent}
RUNTIME=${IC_CUDA_RUNTIME_VERSION:-}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-300}

if [ ! -x "$BIN" ]; then
  echo "== building $BIN"
  cargo build --release -p ic-agent --bin ic-agent || exit 3
fi

echo "== host"
uname -r
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,uuid,driver_version,mig.mode.current,temperature.gpu,ecc.errors.uncorrected.volatile.total --format=csv 2>&1 | head -20
command -v nvidia-smi >/dev/null && nvidia-smi 2>&1 | sed -n '1,4p'
echo "NVML / libcuda on the loader path:"
ldconfig -p 2>/dev/null | grep -E 'libnvidia-ml\.so|libcuda\.so' | sed 's/^/  /'
ls -l /dev/nvidia* 2>/dev/null | head -12

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plan=$work/plan.yaml
{
  echo "gpuNode: true"
  if [ -n "$RUNTIME" ]; then
    echo "cuda: { runtimeVersion: \"$RUNTIME\" }"
  fi
} > "$plan"
echo "== plan"
cat "$plan"

echo "== ic-agent check (table)"
timeout "$CHECK_TIMEOUT" "$BIN" check --plan "$plan" --node gpu-validate
echo "table exit status: $?"

echo "== ic-agent check --json (gpu and cuda results)"
timeout "$CHECK_TIMEOUT" "$BIN" check --json --plan "$plan" --node gpu-validate > "$work/report.json"
rc=$?
python3 - "$work/report.json" <<'PY' || cat "$work/report.json"
import json, sys
r = json.load(open(sys.argv[1]))
checks = [c for c in r["checks"] if c["name"] in ("gpu", "cuda")]
print(json.dumps({"node": r["node"], "status": r["status"], "checks": checks}, indent=2))
bad = [c for c in checks if c["status"] != "Ok"]
print("== summary: %d gpu/cuda results, %d not Ok" % (len(checks), len(bad)))
for c in checks:
    o = c["observed"]
    extra = ", ".join("%s=%s" % (k, o[k]) for k in (
        "name", "driverVersion", "cudaDriverVersion", "driverCudaVersion", "computeCapability",
        "ptxVersion", "xidEvents", "migMode", "elapsedMillis", "cudaError") if k in o)
    print("  %-4s %-6s %-8s %-20s %s" % (c["name"], c["subject"], c["status"], c["reason"], extra))
PY
if [ -n "${OUT:-}" ]; then
  cp "$work/report.json" "$OUT/gpu-validate.json"
fi
echo "json exit status: $rc"
exit "$rc"
