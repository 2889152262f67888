#!/usr/bin/env bash
# The whole test suite (what .ci/run calls). It runs scripts/setup.sh first: as root that installs
# or fetches every prerequisite (cached; seconds once done); not as root it stops, before compiling,
# with one message naming what is missing and the command that installs it.
# The privileged parts (node tests in node-tests/, scripts/install-tests.sh, scripts/image-tests.sh)
# need root; not as root they are reported as skipped, and counted so in the verdict line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck source=/dev/null
source target/ci-cache/test-env.sh
status=0
failed=()
skipped=()
# step NAME COMMAND...: run one part of the suite; a failure is recorded for the verdict line.
step() {
  local name=$1; shift
  if ! "$@"; then status=1; failed+=("$name"); fi
}
# root_step NAME COMMAND...: a step that needs root; skipped (and counted so) when not root.
root_step() {
  if [ "$(id -u)" != 0 ]; then
    echo "test.sh: $1 skipped: needs root" >&2; skipped+=("$1 (needs root)"); return 0
  fi
  step "$@"
}
# A test that cannot make its check for a reason the machine may legitimately have (not root,
# no /dev/shm, a real GPU present) writes one line "<test>: <reason>" here instead of passing
# silently (node-tests/tests/support/mod.rs `skip`); the verdict line counts them as skipped.
mkdir -p target
export IC_TEST_SKIP_LOG="$PWD/target/test-skips.log"
: >"$IC_TEST_SKIP_LOG"
# Every test binary and both product binaries first: the real control plane below runs
# target/debug/ic-controller.
cargo test --workspace --locked --no-run
# A real control plane for controller/tests/real_apiserver*.rs (docs/real-cluster.md): etcd,
# kube-apiserver, kube-controller-manager and kube-scheduler built from their Go modules (cached
# under target/cluster/bin; ~cold build in docs/real-cluster.md), the chart's CRDs, RBAC,
# admission policies and webhooks, the controller running as the chart's ServiceAccount. Started
# afresh (a running one is stopped first: its controller may be an older build, its audit log
# holds other runs' requests) and stopped at the end.
# Beside it, a bare one (etcd + kube-apiserver with the chart's CRDs, RBAC and policies; nothing
# else writes to it) for the tests that call the reconcilers themselves
# (controller/tests/bare_apiserver_support/), on its own ports and state directory.
bare() { IC_CLUSTER_DIR="$PWD/target/cluster/bare" IC_CLUSTER_ETCD_PORT=23801 IC_CLUSTER_API_PORT=16453 \
  bash scripts/cluster.sh "$@"; }
bash scripts/cluster.sh down >/dev/null
bare down >/dev/null
trap 'bash scripts/cluster.sh down >/dev/null 2>&1 || true; bare down >/dev/null 2>&1 || true' EXIT
step "cluster.sh up" bash scripts/cluster.sh up
step "cluster.sh up --bare" bare up --bare
# Its output is kept (target/test-output.log) for the verdict line's counts.
step "cargo test" bash -c 'set -o pipefail; cargo test --workspace --locked --no-fail-fast 2>&1 | tee target/test-output.log'

# Every relative link and repository path in README.md, docs/ and chart/README.md, and in the
# binaries' --help texts, resolves inside this repository; cited specs and issues are in
# docs/glossary.md (scripts/check-docs.py, a second).
step "docs check" python3 scripts/check-docs.py
# No import circle between the product code's files but the known ones, listed with their issue,
# which may only shrink (scripts/check-imports.py, after its self-test on a made-up crate).
step "imports check" bash -c 'python3 scripts/check-imports.py --self-test && python3 scripts/check-imports.py'

# Least privilege from the apiserver's audit log of the run above: every request the chart's
# identities made was allowed, and every grant was used (cluster/audit_check.py).
step "audit check" .venv/chart-tests/bin/python cluster/audit_check.py "$(dirname "$(bash scripts/cluster.sh env)")"
# The chart installed for real: `helm install` on a control plane with kwok nodes, the webhooks
# through the chart's Service, `helm upgrade`, `helm uninstall` and namespace deletion
# (scripts/install-tests.sh; its own state directory and ports; needs root and iptables).
root_step "install-tests" bash scripts/install-tests.sh
# The chart tests run every argument the chart passes through the real ic-controller and ic-agent
# (chart-tests/test_binary_args.py). `cargo test` has already built both binaries into
# target/debug (their packages have integration tests that run them). A separate
# `cargo build --bins` here would resolve dependency features without the dev-dependencies and
# so rebuild the whole dependency graph a second time (twice the disk; CI once ran out of it).
export IC_BIN_DIR="${IC_BIN_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/debug}"
# Helm chart: render with Helm's Go SDK, lint, validate against Kubernetes 1.29 and 1.33 schemas,
# and check the binaries accept the rendered arguments.
step "chart-tests" bash scripts/chart-tests.sh
# scripts/standalone.sh (the README's first command) against the same binaries: it fails fast and
# loudly when a part does not come up or dies, and stops cleanly on SIGTERM.
step "standalone-tests" bash scripts/standalone-tests.sh
# Both images built from the same binaries (Dockerfile BIN_SOURCE=prebuilt) on a local Debian base,
# run in Docker: the controller non-root on a read-only root answering /healthz; the agent under
# the chart's own securityContext next to engine "pods" — every check passes with only the granted
# capabilities, each dropped capability turns the checks that need it Unknown naming it, and only
# the checks thread holds capabilities. Needs root (skipped and counted so without) and Docker
# (fails without it).
root_step "image-tests" bash scripts/image-tests.sh
# The benchmarks (bench/: its own workspace and Cargo.lock, since dynamo-kv-router pins tokio) are
# outside `cargo test --workspace`, yet they call the index's API and build with --locked: a
# dependency added to a workspace crate without refreshing bench/Cargo.lock once broke
# `scripts/bench-kv.sh` with no test noticing. Type-check them (no codegen, ~2 min, own target
# directory so the workspace's build is not invalidated).
if ! CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/bench-check" \
    cargo check --locked --quiet --manifest-path bench/Cargo.toml; then
  echo "bench/ does not build: fix it, or refresh its lock with 'cargo update --workspace --manifest-path bench/Cargo.toml'" >&2
  status=1; failed+=("bench check")
fi
# One verdict line: the cargo tests counted from their "test result:" lines (a test that logged a
# skip, whole or in part, counts as skipped, not passed; so do #[ignore]d ones), plus the parts
# skipped for want of root; then every part that failed or was skipped, by name.
read -r passed nfailed ignored < <(awk '/^test result:/ {p+=$4; f+=$6; i+=$8} END {printf "%d %d %d\n", p, f, i}' \
  target/test-output.log 2>/dev/null || echo "0 0 0")
nskip=$(sed 's/: .*//' "$IC_TEST_SKIP_LOG" | sort -u | grep -c . || true)
counts="$((passed - nskip)) passed, $nfailed failed, $((ignored + nskip + ${#skipped[@]})) skipped"
while IFS= read -r line; do [ -n "$line" ] && skipped+=("$line"); done <"$IC_TEST_SKIP_LOG"
list() { local IFS=';'; echo "$*" | sed 's/;/; /g'; }
[ ${#skipped[@]} -gt 0 ] && echo "test.sh: skipped: $(list "${skipped[@]}")"
if ((status)); then
  echo "test.sh: FAILED — $counts; failed: $(list "${failed[@]:-?}")"
else
  echo "test.sh: passed — $counts (cargo tests, then the cluster, audit, install, chart, standalone, image and bench checks)"
fi
exit $status
