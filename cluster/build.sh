#!/usr/bin/env bash
# Builds the local control plane's binaries from their Go modules (no binary download: the Go
# module proxy serves the sources). Output: $OUT_DIR/{etcd,kube-apiserver,kube-controller-manager,
# kube-scheduler,kubectl,helm,kwok,grpc-health-probe,cert-manager-local,cert-manager-crds.yaml}, and one stamp per component ($OUT_DIR/.stamp-<component>)
# holding the version it was built from; a matching stamp skips that component. Used by
# scripts/cluster.sh; see docs/real-cluster.md.
#
# kubernetes: `go install k8s.io/kubernetes/cmd/...@v` fails because its go.mod requires every
# staging module at v0.0.0 and replaces them with ./staging. A generated wrapper module requires
# k8s.io/kubernetes and replaces each of those staging modules with its published v0.N.x.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
OUT_DIR="${OUT_DIR:?OUT_DIR must name the output folder}"
stamp_of() { # component version
    echo "$1=$2 bins=$(bins_of "$1")"
}
bins_of() {
    case $1 in
        kubernetes) echo kube-apiserver,kube-controller-manager,kube-scheduler,kubectl ;;
        kwok) echo kwok,kwok-stages.yaml ;;
        cert-manager) echo cert-manager-local,cert-manager-crds.yaml ;;
        *) echo "$1" ;;
    esac
}
fresh() { # component version: its stamp matches
    [[ -f "$OUT_DIR/.stamp-$1" && "$(cat "$OUT_DIR/.stamp-$1")" == "$(stamp_of "$1" "$2")" ]]
}
all_fresh() {
    fresh etcd "$ETCD_VERSION" && fresh kubernetes "$KUBERNETES_VERSION" &&
        fresh helm "$HELM_VERSION" && fresh kwok "$KWOK_VERSION" &&
        fresh grpc-health-probe "$GRPC_HEALTH_PROBE_VERSION" &&
        fresh cert-manager "$(cert_manager_version)"
}
# cert-manager's stamp: its version and the wiring's sources (an edit of main.go rebuilds it).
cert_manager_version() {
    echo "$CERT_MANAGER_VERSION+$(cat "$here"/cert-manager/{main.go,go.mod,go.sum} | sha256sum | cut -c1-12)"
}
all_fresh && exit 0
mkdir -p "$OUT_DIR"
# One build at a time (.ci/run starts one early in the background; cluster.sh up waits for it).
exec 9>"$OUT_DIR/.lock"
flock 9
all_fresh && exit 0
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

# A tool module's command, built in a wrapper module that requires it: `go build` of a
# package path resolves the module's own requirements (no replace lines in these two).
build_tool() { # module version package ldflags library-package
    local dir="$work/$(basename "$3")"
    mkdir -p "$dir"; cd "$dir"
    go mod init "ic.local/cluster-$(basename "$3")" >/dev/null 2>&1
    go mod edit -require="$1@$2"
    # A blank import of a library package of the module keeps `go mod tidy` from dropping it.
    printf 'package main\nimport _ "%s"\nfunc main() {}\n' "$5" > tools.go
    go mod tidy >/dev/null
    go build -trimpath -ldflags "-s -w $4" -o "$OUT_DIR/" "$3"
}

# kwok and the stages it plays for nodes (initialize, heartbeat with a Lease) and pods (ready,
# complete, delete): the module's own "fast" stage set, concatenated into kwok-stages.yaml.
build_kwok() {
    build_tool sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok "" sigs.k8s.io/kwok/pkg/kwok/cmd
    local src
    src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
    for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
        pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
        cat "$src/$f"; echo "---"
    done > "$OUT_DIR/kwok-stages.yaml"
}

# grpc-health-probe, the chart's controller `helm test` (chart/templates/tests/): its command is
# the module's root package, which no wrapper module can import, so `go install module@version`
# (the module has no replace lines) with the release's version stamped in as its own build does.
build_grpc_health_probe() {
    cd "$work"
    GOFLAGS= GOBIN="$OUT_DIR" go install -trimpath \
        -ldflags "-s -w -X main.versionTag=$GRPC_HEALTH_PROBE_VERSION" \
        "github.com/grpc-ecosystem/grpc-health-probe@$GRPC_HEALTH_PROBE_VERSION"
}

# cert-manager: cluster/cert-manager/main.go wires cert-manager's library packages (its command
# modules are not on the Go proxy; see that file), built as cert-manager-local; its CRDs from the
# module's deploy/crds as cert-manager-crds.yaml.
build_cert_manager() {
    grep -q "github.com/cert-manager/cert-manager $CERT_MANAGER_VERSION\$" "$here/cert-manager/go.mod" ||
        { echo "cluster/build.sh: cluster/cert-manager/go.mod does not require cert-manager $CERT_MANAGER_VERSION (versions.env)" >&2; exit 1; }
    (cd "$here/cert-manager" && GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" -o "$OUT_DIR/cert-manager-local" .)
    local src
    src="$(cd "$here/cert-manager" && go list -m -f '{{.Dir}}' github.com/cert-manager/cert-manager)"
    local f
    for f in "$src"/deploy/crds/*.yaml; do
        echo "---"; cat "$f"
    done > "$OUT_DIR/cert-manager-crds.yaml"
}

component() { # name version builder...
    local name=$1 version=$2 t=$SECONDS; shift 2
    fresh "$name" "$version" && return 0
    "$@"
    stamp_of "$name" "$version" > "$OUT_DIR/.stamp-$name"
    echo "cluster/build.sh: $name $version built in $((SECONDS - t)) s" >&2
}

component etcd "$ETCD_VERSION" build_etcd
component kubernetes "$KUBERNETES_VERSION" build_kubernetes
component helm "$HELM_VERSION" build_tool helm.sh/helm/v4 "$HELM_VERSION" helm.sh/helm/v4/cmd/helm \
    "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" helm.sh/helm/v4/pkg/action
component kwok "$KWOK_VERSION" build_kwok
component grpc-health-probe "$GRPC_HEALTH_PROBE_VERSION" build_grpc_health_probe
component cert-manager "$(cert_manager_version)" build_cert_manager
rm -rf "$work"
rm -f "$OUT_DIR/.stamp"
