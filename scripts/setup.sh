#!/usr/bin/env bash
# Installs or fetches everything the test suite (scripts/test.sh) needs, once: the Debian packages,
# the engines' own files (scripts/fetch-*.sh), the mooncake_master wheel, the chart tests' venv,
# and the local control plane's Go-built binaries (started in the background:
# `scripts/cluster.sh up` waits for them). Idempotent and cached (target/ci-cache, .venv,
# target/cluster/bin): a second run checks and returns in about a second.
#
# scripts/test.sh runs it first (and .ci/run calls it before its lints, so that the slow
# downloads and the Go build overlap them); there is no other list of prerequisites.
#
# As root it installs missing Debian packages with apt-get. Not as root, it installs nothing:
# when something is missing it prints one message that lists what and the one command that
# installs it, and exits 1 before anything is compiled.
#
# Output: target/ci-cache/test-env.sh, the environment the tests read (IC_MOONCAKE_MASTER,
# IC_LMCACHE_DIR, IC_VLLM_DIR, IC_SGLANG_DIR, IC_TOKENIZERS_PYTHON); scripts/test.sh sources it.
#
# Environment: IC_SETUP_NO_CLUSTER_BUILD=1 skips the background control-plane build (the one step
# that needs a Go toolchain).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
say() { printf 'setup: %s\n' "$*" >&2; }
cache=target/ci-cache
mkdir -p "$cache" target/cluster

# --- Debian packages: COMMAND:PACKAGE pairs ------------------------------------------------------
# cc (gcc): links every Rust binary, and builds the no-device CUDA/NVML stand-ins the checks and
#   the Mooncake store client load (agent/tests/checks_{cuda,gpu}.rs, t2_probe_mooncake.rs);
# unshare, flock, losetup, mkfs.ext4, mkfs.xfs, ip, kill: the node tests in namespaces and on loop
#   file systems (node-tests/); openssl, curl: the clusters' certificates and readiness probes;
# promtool (prometheus): `promtool test rules` and the live-Prometheus dashboard test;
# redis-server: the functional probe's tier-2 stage (controller/tests/t2_probe.rs);
# dockerd (docker.io), debootstrap, objcopy (binutils): scripts/image-tests.sh builds and runs
#   both images on a debootstrap base (no registry is reachable);
#   (scripts/image-tests.sh starts dockerd itself when none answers);
# iptables: scripts/install-tests.sh routes the chart's Services to the controller (DNAT);
# wget: the chart's agent `helm test` pod's command, run on this host by cluster/host_kubelet.py;
# valgrind: `scripts/bench-kv.sh --stable` (callgrind), and its headers for the bench's crabgrind.
pairs=(cc:gcc valgrind:valgrind unshare:util-linux flock:util-linux losetup:mount mkfs.ext4:e2fsprogs mkfs.xfs:xfsprogs
  ip:iproute2 kill:procps openssl:openssl curl:curl promtool:prometheus redis-server:redis-server)
# The image and chart-install tests run only as root (scripts/test.sh reports them skipped
# otherwise): their tools are needed only then.
if [ "$(id -u)" = 0 ]; then
  pairs+=(dockerd:docker.io debootstrap:debootstrap objcopy:binutils iptables:iptables wget:wget)
fi
missing=()   # "what (package)" for the message
pkgs=()      # Debian packages to install
for pair in "${pairs[@]}"; do
  cmd=${pair%%:*} pkg=${pair#*:}
  # sbin tools are not on a user's PATH on Debian
  if ! command -v "$cmd" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$cmd" ] && [ ! -x "/sbin/$cmd" ]; then
    missing+=("$cmd ($pkg)")
    [[ " ${pkgs[*]} " == *" $pkg "* ]] || pkgs+=("$pkg")
  fi
done
# mooncake_master (the Mooncake node test and tier-2 probe) links libibverbs.
# (grep without -q: under pipefail, ldconfig killed by SIGPIPE would read as missing)
if ! /sbin/ldconfig -p 2>/dev/null | grep 'libibverbs.so.1' >/dev/null; then
  missing+=("libibverbs.so.1 (libibverbs1)"); pkgs+=(libibverbs1)
fi
# Python >= 3.10 with venv and pip: the fetch scripts, the chart tests, the engines' own code.
if ! python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; then
  missing+=("Python >= 3.10 with venv (python3 python3-venv)"); pkgs+=(python3 python3-venv)
fi

other=()     # not from apt: "what: how"
command -v cargo >/dev/null 2>&1 || other+=("cargo (Rust): https://rustup.rs")
cluster_built() { [ -x target/cluster/bin/kube-apiserver ] && [ -x target/cluster/bin/etcd ] &&
  [ -x target/cluster/bin/helm ] && [ -x target/cluster/bin/kwok ]; }
if [ "${IC_SETUP_NO_CLUSTER_BUILD:-}" != 1 ] && ! command -v go >/dev/null 2>&1 && ! cluster_built; then
  other+=("go (the Go toolchain: cluster/build.sh builds the local control plane from its Go modules): https://go.dev/dl/")
fi

if [ ${#pkgs[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing ${pkgs[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  pkgs=() missing=()
fi
if [ ${#pkgs[@]} -gt 0 ] || [ ${#other[@]} -gt 0 ]; then
  {
    echo "setup: the test suite needs what this machine lacks (nothing was built):"
    for m in "${missing[@]}" "${other[@]}"; do echo "  - $m"; done
    if [ ${#pkgs[@]} -gt 0 ]; then
      echo "Install the packages with:"
      echo "  sudo apt-get install -y --no-install-recommends ${pkgs[*]}"
    fi
    echo "then run ./scripts/test.sh again (or run it as root: it installs them itself)."
  } >&2
  exit 1
fi

# --- the local control plane's binaries (Go modules), in the background ---------------------------
# `scripts/cluster.sh up` waits for this build (cluster/build.sh holds a lock) and finds them
# cached; its log: target/cluster/build.log. It returns at once when every component's stamp
# matches cluster/versions.env.
if [ "${IC_SETUP_NO_CLUSTER_BUILD:-}" != 1 ] && command -v go >/dev/null 2>&1; then
  (OUT_DIR="$PWD/target/cluster/bin" cluster/build.sh || true) \
    >>target/cluster/build.log 2>&1 </dev/null &
  cluster_built || say "building the local control plane in the background (log target/cluster/build.log)"
fi

# --- the engines' own files and the wheels (each script returns at once when cached) -------------
# A real mooncake_master (the binary ships inside the PyPI wheel): the Mooncake node test and the
# Mooncake tier-2 probe (node-tests/tests/checks_mooncake.rs, controller/tests/t2_probe_mooncake.rs).
mc=$cache/mooncake-0.3.11.post1
if [ ! -x "$mc/mooncake/mooncake_master" ]; then
  say "fetching mooncake_master (the mooncake-transfer-engine wheel)"
  mkdir -p "$mc"
  [ -x "$cache/venv/bin/pip" ] || python3 -m venv "$cache/venv"
  plat=manylinux_2_35_x86_64; [ "$(uname -m)" = aarch64 ] && plat=manylinux_2_39_aarch64
  "$cache/venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform "$plat" mooncake-transfer-engine==0.3.11.post1 -d "$mc"
  python3 -m zipfile -e "$mc"/mooncake_transfer_engine-*.whl "$mc"
  chmod +x "$mc/mooncake/mooncake_master"
fi
# LMCache's own standalone server (the `lm://` tier) for the tier-2 probe tests; vLLM's own
# KV-event publisher for the KV fault suite; SGLang's own metrics code for
# agent/tests/sglang_metrics.rs; the `tokenizers` package for controller/tests/tokenizer_reference.rs.
bash scripts/fetch-lmcache.sh "$cache/lmcache" >/dev/null
bash scripts/fetch-vllm.sh "$cache/vllm" >/dev/null
bash scripts/fetch-sglang.sh "$cache/sglang" >/dev/null
bash scripts/fetch-sglang-radix.sh "$cache/sglang" >/dev/null
bash scripts/fetch-tokenizers.sh "$cache/tokenizers" >/dev/null
# The chart tests' venv (.venv/chart-tests: Helm's Go SDK, kubernetes-validate, pytest).
bash scripts/chart-venv.sh >/dev/null

cat >"$cache/test-env.sh" <<ENV
# Written by scripts/setup.sh: where the tests find what it fetched.
export IC_MOONCAKE_MASTER="$PWD/$mc/mooncake/mooncake_master"
export IC_LMCACHE_DIR="$PWD/$cache/lmcache"
export IC_VLLM_DIR="$PWD/$cache/vllm"
export IC_SGLANG_DIR="$PWD/$cache/sglang"
export IC_TOKENIZERS_PYTHON="$PWD/$cache/tokenizers/venv/bin/python"
ENV
say "ready (environment: $cache/test-env.sh)"
