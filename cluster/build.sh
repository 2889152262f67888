#!/usr/bin/env bash
# Builds the local control plane's binaries from their Go modules (no binary download: the Go
# module proxy serves the sources). Output: $OUT_DIR/{etcd,kube-apiserver,kube-controller-manager,
# kube-scheduler,kubectl}, and $OUT_DIR/.stamp holding the versions it was built from; a matching stamp
# skips the build. Used by scripts/cluster.sh; see docs/real-cluster.md.
#
# kubernetes: `go install k8s.io/kubernetes/cmd/...@v` fails because its go.mod requires every
# staging module at v0.0.0 and replaces them with ./staging. A generated wrapper module requires
# k8s.io/kubernetes and replaces each of those staging modules with its published v0.N.x.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
OUT_DIR="${OUT_DIR:?OUT_DIR must name the output folder}"
stamp="kubernetes=$KUBERNETES_VERSION etcd=$ETCD_VERSION bins=etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kubectl"
if [[ -f "$OUT_DIR/.stamp" && "$(cat "$OUT_DIR/.stamp")" == "$stamp" ]]; then
    exit 0
fi
mkdir -p "$OUT_DIR"
# One build at a time (.ci/run starts one early in the background; cluster.sh up waits for it).
exec 9>"$OUT_DIR/.lock"
flock 9
if [[ -f "$OUT_DIR/.stamp" && "$(cat "$OUT_DIR/.stamp")" == "$stamp" ]]; then
    exit 0
fi
work="$OUT_DIR/.work"
rm -rf "$work"; mkdir -p "$work/k8s" "$work/etcd"
export GOFLAGS=-mod=mod CGO_ENABLED=0
staging_version="v0.${KUBERNETES_VERSION#v1.}"
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"

build_kubernetes() {
    cd "$work/k8s"
    go mod init ic.local/cluster-k8s >/dev/null 2>&1
    go mod edit -require="k8s.io/kubernetes@$KUBERNETES_VERSION"
    local modfile
    modfile="$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')"
    # every k8s.io module the release lists at v0.0.0 is a staging module
    for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$modfile"); do
        go mod edit -replace="$m=$m@$staging_version"
    done
    printf 'package main\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver/app"\n\t_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"\n\t_ "k8s.io/kubernetes/cmd/kube-scheduler/app"\n)\nfunc main() {}\n' > tools.go
    go mod tidy >/dev/null
    local ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitTreeState=clean"
    go build -trimpath -ldflags "$ld" -o "$OUT_DIR/" \
        k8s.io/kubernetes/cmd/kube-apiserver \
        k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler \
        k8s.io/kubernetes/cmd/kubectl
}

build_etcd() {
    cd "$work/etcd"
    go mod init ic.local/cluster-etcd >/dev/null 2>&1
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    printf 'package main\nimport _ "go.etcd.io/etcd/server/v3"\nfunc main() {}\n' > tools.go
    go mod tidy >/dev/null
    go build -trimpath -ldflags "-s -w" -o "$OUT_DIR/etcd" go.etcd.io/etcd/server/v3
}

t0=$SECONDS
build_etcd
echo "cluster/build.sh: etcd $ETCD_VERSION built in $((SECONDS - t0)) s" >&2
t1=$SECONDS
build_kubernetes
echo "cluster/build.sh: kubernetes $KUBERNETES_VERSION built in $((SECONDS - t1)) s" >&2
rm -rf "$work"
echo "$stamp" > "$OUT_DIR/.stamp"
