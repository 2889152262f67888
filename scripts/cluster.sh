#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, with the chart's CRDs, RBAC, admission policies and
# webhooks installed and ic-controller answering them (docs/real-cluster.md).
#
#   scripts/cluster.sh up      build (cached) and start: etcd, kube-apiserver, kube-controller-manager,
#                              kube-scheduler, then install the chart's objects and start the
#                              controller as the chart's ServiceAccount; prints
#                              `export KUBECONFIG=<admin kubeconfig>` as its last line
#   scripts/cluster.sh up --bare
#                              etcd and kube-apiserver only, with the chart's CRDs, RBAC and
#                              admission policies: no controller-manager, scheduler, controller or
#                              webhooks. The API under tests that call the reconcilers themselves
#                              and play the Deployment controller and kubelet by writing status
#                              (controller/tests/bare_apiserver_support/). scripts/test.sh runs one
#                              in target/cluster/bare beside the full one.
#   scripts/cluster.sh up --with-chart
#                              what a user tries first: the full control plane plus kwok fake
#                              nodes (two GPU nodes, one CPU node) that take pods to Running, and
#                              the chart installed by `helm install` (Helm v4 built from its Go
#                              module) in self-signed certificate mode; the controller runs on this
#                              host as the chart's ServiceAccount with the chart's arguments, and
#                              the apiserver and pods reach it through the chart's own Services
#                              (iptables DNAT rules from each controller Service's ClusterIP:port
#                              to the controller's loopback listener: kube-proxy's job; needs root
#                              and iptables). cluster/host_kubelet.py runs for real, on this host:
#                              the chart's hook Jobs, its `helm test` pods, and the agent
#                              DaemonSet's pod on kwok-gpu-0 (a real ic-agent reporting to the
#                              controller). Prints what to try next.
#   scripts/cluster.sh up --with-chart --cert-manager
#                              the same with cert-manager (its own controllers and CA injector,
#                              built from its Go module: cluster/cert-manager/) and the chart
#                              installed with its default values (webhook.certMode=certManager):
#                              cert-manager issues the webhook certificate and injects its CA;
#                              the controller reads the Secret from a directory kept current as a
#                              kubelet's Secret volume is (component cert-sync)
#   scripts/cluster.sh down    stop everything `up` started and remove its state
#   scripts/cluster.sh status  say what runs (exit 0 only when all of it does)
#   scripts/cluster.sh restart COMPONENT
#                              stop one component and start it with the same command line (the
#                              restart tests: controller/tests/real_apiserver_restart.rs)
#   scripts/cluster.sh stop COMPONENT
#                              stop one component (e.g. ic-controller after `helm uninstall`, as
#                              its pods would go: scripts/install-tests.sh)
#   scripts/cluster.sh install-chart CHART [--cert-manager]
#                              (--with-chart) chart/README.md's install of CHART (e.g. an older
#                              packaged chart: scripts/install-tests.sh upgrades from one), then
#                              the controller as that release says; with --cert-manager (or on a
#                              cluster started with it) cert-manager runs and the chart's default
#                              certificate mode is kept
#   scripts/cluster.sh chart-controller
#                              (--with-chart) restart the controller as the installed release
#                              says (after `helm upgrade`, as the Deployment's rollout would)
#   scripts/cluster.sh env     print the file the tests read (see below)
#
# Both `up` and `down` are idempotent: `up` on a running cluster only prints the export line.
# Binaries are built from their Go modules by cluster/build.sh into target/cluster/bin (versions
# in cluster/versions.env; a matching stamp skips the build). Everything listens on 127.0.0.1.
#
# State lives in $IC_CLUSTER_DIR (default target/cluster/run): pki/, etcd data, logs/ (one per
# component), audit.log (every request with its user, verb and response code), admin.kubeconfig,
# controller.kubeconfig (a TokenRequest token of the chart's controller ServiceAccount: the
# controller gets exactly the chart's RBAC) and cluster.env (ports and paths, read by the
# real-apiserver tests: controller/tests/real_apiserver*.rs).
#
# Ports (environment): IC_CLUSTER_ETCD_PORT (23791; peer = +1), IC_CLUSTER_API_PORT (16443;
# controller-manager +1, scheduler +2, kwok +3, host_kubelet's log server +4),
# IC_CLUSTER_WEBHOOK_PORT (19443), IC_CLUSTER_GRPC_PORT (15051), IC_CLUSTER_HTTP_PORT (18080; the controller's health listener +1),
# IC_CLUSTER_AGENT_PORT (--with-chart: the real agent's /readyz port, the chart's
# agent.ports.http, 19090; its metrics port = +1).
# IC_CONTROLLER_BIN, IC_AGENT_BIN: the ic-controller and ic-agent to run (default
# target/debug/ic-{controller,agent}; built with `cargo build` when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
state="${IC_CLUSTER_DIR:-$root/target/cluster/run}"
bin="$root/target/cluster/bin"
etcd_port="${IC_CLUSTER_ETCD_PORT:-23791}"
etcd_peer_port=$((etcd_port + 1))
api_port="${IC_CLUSTER_API_PORT:-16443}"
webhook_port="${IC_CLUSTER_WEBHOOK_PORT:-19443}"
grpc_port="${IC_CLUSTER_GRPC_PORT:-15051}"
http_port="${IC_CLUSTER_HTTP_PORT:-18080}"
agent_port="${IC_CLUSTER_AGENT_PORT:-19090}"
controller_bin="${IC_CONTROLLER_BIN:-${CARGO_TARGET_DIR:-$root/target}/debug/ic-controller}"
agent_bin="${IC_AGENT_BIN:-${CARGO_TARGET_DIR:-$root/target}/debug/ic-agent}"
# A running cluster's ports are what `up` recorded (restart, stop and status of a cluster
# started with other IC_CLUSTER_*_PORT values work without them).
if [[ "${1:-}" != up && -f "$state/ports" ]]; then
  # shellcheck source=/dev/null
  source "$state/ports"
fi
namespace=inference-cache
components=(etcd kube-apiserver kube-controller-manager kube-scheduler ic-controller)
# full, bare (`up --bare`) or chart (`up --with-chart`); recorded in $state/mode, so that
# status/down/restart know it.
mode=full
[[ -f "$state/mode" ]] && mode="$(cat "$state/mode")"
# Webhook certificates of the chart's release (--with-chart): selfSigned (chart/README.md's
# command) or certManager (--cert-manager: the chart's default, cert-manager running here);
# recorded in $state/cert-mode.
cert_mode=selfSigned
[[ -f "$state/cert-mode" ]] && cert_mode="$(cat "$state/cert-mode")"
if [[ "${1:-}" == up ]]; then
  case "${2:-}" in
    --bare) mode=bare ;;
    --with-chart) mode=chart ;;
    "") ;;
    *) echo "cluster: unknown option ${2}: up takes --bare or --with-chart [--cert-manager]" >&2; exit 2 ;;
  esac
  cert_mode=selfSigned
  case "${3:-}" in
    --cert-manager) [[ $mode == chart ]] || { echo "cluster: --cert-manager goes with --with-chart" >&2; exit 2; }
      cert_mode=certManager ;;
    "") ;;
    *) echo "cluster: unknown option ${3}: up --with-chart takes --cert-manager" >&2; exit 2 ;;
  esac
fi
bare=0
[[ $mode == bare ]] && bare=1
case $mode in
  bare) components=(etcd kube-apiserver) ;;
  chart) components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok host-kubelet cert-manager cert-sync ic-controller) ;;
esac
release=inference-cache

log() { echo "cluster: $*" >&2; }
die() { log "$*"; exit 1; }

alive() { # component
  local f="$state/pids/$1"
  [[ -f "$f" ]] && kill -0 "$(cat "$f")" 2>/dev/null
}

kubectl_admin() { "$bin/kubectl" --kubeconfig "$state/admin.kubeconfig" "$@"; }

wait_for() { # what seconds command...
  local what=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      die "$what not ready after ${secs}s (logs: $state/logs/)"
    fi
    sleep 0.5
  done
}

start() { # component command...
  local name=$1; shift
  if alive "$name"; then return; fi
  mkdir -p "$state/pids" "$state/logs" "$state/cmd"
  # The command line, for `restart`.
  printf '%q ' "$@" > "$state/cmd/$name"
  setsid "$@" >>"$state/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$state/pids/$name"
}

stop() { # component
  local pid
  alive "$1" || return 0
  pid=$(cat "$state/pids/$1")
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$state/pids/$1"
}

restart() { # component: stop it and start it again with the same command line
  local c=$1
  [[ " ${components[*]} " == *" $c "* ]] || die "restart: unknown component $c (one of: ${components[*]})"
  [[ -f "$state/cmd/$c" ]] || die "restart: $c was never started here"
  stop "$c"
  # When the apiserver came back: its RBAC caches fill a moment after /readyz, and the audit
  # check (cluster/audit_check.py) does not count refusals in that window as missing grants.
  [[ $c == kube-apiserver ]] && date -u +%Y-%m-%dT%H:%M:%S.%6NZ >> "$state/apiserver-restarts"
  eval "start $c $(cat "$state/cmd/$c")"
  if [[ $c == kube-apiserver ]]; then
    wait_for kube-apiserver 120 curl -sf --cacert "$state/pki/ca.crt" \
      --cert "$state/pki/admin.crt" --key "$state/pki/admin.key" "https://127.0.0.1:$api_port/readyz"
  fi
  log "restarted $c"
}

cert() { # name subject san(or "") [ca-prefix] [eku]
  local name=$1 subj=$2 san=$3 ca=${4:-ca} eku=${5:-clientAuth}
  local d="$state/pki"
  [[ -f "$d/$name.crt" ]] && return
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$name.key" 2>/dev/null
  openssl req -new -key "$d/$name.key" -subj "$subj" -out "$d/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n "$san" ]] && echo "subjectAltName=$san"
  } > "$d/$name.ext"
  openssl x509 -req -in "$d/$name.csr" -CA "$d/$ca.crt" -CAkey "$d/$ca.key" -CAcreateserial \
    -days 365 -sha256 -extfile "$d/$name.ext" -out "$d/$name.crt" 2>/dev/null
  rm -f "$d/$name.csr" "$d/$name.ext"
}

ca() { # name cn
  local d="$state/pki"
  [[ -f "$d/$1.crt" ]] && return
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$1.key" 2>/dev/null
  openssl req -x509 -new -key "$d/$1.key" -subj "/CN=$2" -days 365 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$d/$1.crt" 2>/dev/null
}

kubeconfig() { # file user cert-name | file user token-file
  local file=$1 user=$2 cred=$3 kind=${4:-cert}
  {
    echo "apiVersion: v1"
    echo "kind: Config"
    echo "clusters:"
    echo "- name: local"
    echo "  cluster:"
    echo "    server: https://127.0.0.1:$api_port"
    echo "    certificate-authority-data: $(base64 -w0 "$state/pki/ca.crt")"
    echo "users:"
    echo "- name: $user"
    echo "  user:"
    if [[ $kind == cert ]]; then
      echo "    client-certificate-data: $(base64 -w0 "$state/pki/$cred.crt")"
      echo "    client-key-data: $(base64 -w0 "$state/pki/$cred.key")"
    else
      echo "    token: $(cat "$cred")"
    fi
    echo "contexts:"
    echo "- name: local"
    echo "  context: {cluster: local, user: $user}"
    echo "current-context: local"
  } > "$file"
  chmod 600 "$file"
}

pki() {
  mkdir -p "$state/pki"
  ca ca inference-cache-local-ca
  ca webhook-ca inference-cache-local-webhook-ca
  cert apiserver "/CN=kube-apiserver" \
    "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
    ca serverAuth
  cert admin "/O=system:masters/CN=kubernetes-admin" ""
  cert kcm "/CN=system:kube-controller-manager" ""
  cert scheduler "/CN=system:kube-scheduler" ""
  # host_kubelet.py's kubelet API (container logs) on loopback, which the apiserver reaches at
  # the nodes' address (kwok --node-ip 127.0.0.1, --node-port).
  cert kubelet "/CN=host-kubelet" "IP:127.0.0.1" ca serverAuth
  # The controller's webhook serving certificate: the loopback address the webhook
  # configurations name, and the chart Service's names.
  local svc=inference-cache-webhook
  cert webhook "/CN=$svc.$namespace.svc" \
    "IP:127.0.0.1,DNS:$svc,DNS:$svc.$namespace,DNS:$svc.$namespace.svc,DNS:$svc.$namespace.svc.cluster.local" \
    webhook-ca serverAuth
  mkdir -p "$state/webhook-certs"
  cp "$state/pki/webhook.crt" "$state/webhook-certs/tls.crt"
  cp "$state/pki/webhook.key" "$state/webhook-certs/tls.key"
  [[ -f "$state/pki/sa.key" ]] || {
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$state/pki/sa.key" 2>/dev/null
    openssl pkey -in "$state/pki/sa.key" -pubout -out "$state/pki/sa.pub" 2>/dev/null
  }
  kubeconfig "$state/admin.kubeconfig" kubernetes-admin admin
  kubeconfig "$state/kcm.kubeconfig" system:kube-controller-manager kcm
  kubeconfig "$state/scheduler.kubeconfig" system:kube-scheduler scheduler
}

audit_policy() {
  # Every request, with its user and response code (Metadata level: no bodies). The
  # least-privilege tests read this log (controller/tests/real_apiserver_rbac.rs).
  cat > "$state/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
EOF
}

# Refuses to start when one of our ports is already taken (by something `up` did not start),
# naming the port and the variable that moves it.
ports_free() {
  local pair port var
  local pairs=("$etcd_port:IC_CLUSTER_ETCD_PORT" "$etcd_peer_port:IC_CLUSTER_ETCD_PORT (peer = +1)"
    "$api_port:IC_CLUSTER_API_PORT")
  ((bare)) || pairs+=("$((api_port + 1)):IC_CLUSTER_API_PORT (controller-manager = +1)"
    "$((api_port + 2)):IC_CLUSTER_API_PORT (scheduler = +2)" "$webhook_port:IC_CLUSTER_WEBHOOK_PORT"
    "$grpc_port:IC_CLUSTER_GRPC_PORT" "$http_port:IC_CLUSTER_HTTP_PORT"
    "$((http_port + 1)):IC_CLUSTER_HTTP_PORT (the controller's health listener = +1)")
  [[ $mode == chart ]] && pairs+=("$((api_port + 3)):IC_CLUSTER_API_PORT (kwok = +3)"
    "$((api_port + 4)):IC_CLUSTER_API_PORT (host_kubelet's logs = +4)" "$agent_port:IC_CLUSTER_AGENT_PORT"
    "$((agent_port + 1)):IC_CLUSTER_AGENT_PORT (agent metrics = +1)")
  for pair in "${pairs[@]}"; do
    port=${pair%%:*}; var=${pair#*:}
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      die "127.0.0.1:$port is already in use (another cluster.sh state dir, or another program); set $var to move it"
    fi
  done
}

write_env() { # cluster.env, read by the tests
  cat > "$state/cluster.env" <<EOF
IC_CLUSTER_KUBECONFIG=$state/admin.kubeconfig
IC_CLUSTER_CONTROLLER_KUBECONFIG=$state/controller.kubeconfig
IC_CLUSTER_AUDIT_LOG=$state/audit.log
IC_CLUSTER_API=https://127.0.0.1:$api_port
IC_CLUSTER_CA=$state/pki/ca.crt
IC_CLUSTER_WEBHOOK_PORT=$webhook_port
IC_CLUSTER_GRPC_PORT=$grpc_port
IC_CLUSTER_HTTP_PORT=$http_port
IC_CLUSTER_NAMESPACE=$namespace
IC_CLUSTER_ETCD=http://127.0.0.1:$etcd_port
IC_CLUSTER_CONTROLLER_BIN=$controller_bin
IC_CLUSTER_BIN=$bin
IC_CLUSTER_STATE=$state
IC_CLUSTER_MODE=$mode
IC_CLUSTER_RELEASE=$release
IC_CLUSTER_AGENT_PORT=$agent_port
IC_CLUSTER_CHART_VALUES=$state/chart-values.yaml
EOF
}

# A server-side dry run of a CacheBackend: it goes through both CacheBackend webhooks. The object
# is given anew on each call (wait_for retries it; a heredoc on wait_for itself would be read by
# the first try only).
webhooks_answer() {
  kubectl_admin create --dry-run=server -n default -f - <<'EOF'
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {name: webhook-ready}
spec: {runtime: VLLM, engineSelector: {matchLabels: {app: webhook-ready}}}
EOF
}

# The controller on this host as the chart's ServiceAccount (a bound token of that account,
# nothing else) with the arguments in $state/controller-args.
start_controller() {
  local sa
  sa="$(kubectl_admin get sa -n "$namespace" -o name | sed -n 's#serviceaccount/\(.*-controller\)$#\1#p' | head -1)"
  [[ -n "$sa" ]] || die "the chart rendered no controller ServiceAccount in $namespace"
  kubectl_admin create token "$sa" -n "$namespace" --duration 48h > "$state/controller.token"
  kubeconfig "$state/controller.kubeconfig" "system:serviceaccount:$namespace:$sa" "$state/controller.token" token
  mapfile -t args < "$state/controller-args"
  start ic-controller env POD_NAMESPACE=$namespace POD_NAME=ic-controller-local \
    IC_LEADER_ELECTION_IDENTITY=ic-controller-local \
    "$controller_bin" "${args[@]}" --kubeconfig "$state/controller.kubeconfig"
  wait_for ic-controller 60 curl -sf "http://127.0.0.1:$http_port/readyz"
}

# kube-proxy's job for the controller's Services: connections from this host (the apiserver, the
# pods host_kubelet.py runs) to a Service's ClusterIP:port go to the controller's loopback
# listener for that port's targetPort (the container port it names: webhook, grpc, http). One
# iptables DNAT rule per port in the nat table's OUTPUT chain, tagged with this state directory
# and removed by `down`; what was routed is listed in $state/dnat-services. (Headless Services
# have no ClusterIP: their names resolve to pod IPs, which lead nowhere here.)
dnat_controller_services() {
  local name ip port target loopback
  while read -r name ip port target; do
    case $target in
      webhook) loopback=$webhook_port ;;
      grpc) loopback=$grpc_port ;;
      http) loopback=$http_port ;;
      *) continue ;;
    esac
    [[ $ip != None ]] || continue
    ip route get "$ip" >/dev/null 2>&1 || die "no route to the Service network ($ip): iptables DNAT needs one (a default route)"
    local rule=(-d "$ip/32" -p tcp --dport "$port" -m comment --comment "ic-cluster:$state" -j DNAT --to-destination "127.0.0.1:$loopback")
    iptables -t nat -A OUTPUT "${rule[@]}"
    printf '%q ' "${rule[@]}" >> "$state/dnat-rules"; echo >> "$state/dnat-rules"
    echo "$name $ip:$port -> 127.0.0.1:$loopback" >> "$state/dnat-services"
  done < <(kubectl_admin get svc -n "$namespace" -l app.kubernetes.io/component=controller -o json |
    python3 -c 'import json, sys
for s in json.load(sys.stdin)["items"]:
    for p in s["spec"].get("ports", []):
        print(s["metadata"]["name"], s["spec"].get("clusterIP") or "None", p["port"], p.get("targetPort", p["port"]))')
}

dnat_clear() {
  [[ -f "$state/dnat-rules" ]] || return 0
  local line
  while read -r line; do
    [[ -n "$line" ]] && { eval "iptables -t nat -D OUTPUT $line" 2>/dev/null || true; }
  done < "$state/dnat-rules"
  rm -f "$state/dnat-rules" "$state/dnat-services"
}

# chart/README.md's install of CHART (a directory or a packaged chart), then the controller.
chart_install() { # chart [--cert-manager]
  if [[ ${2:-} == --cert-manager ]]; then
    cert_mode=certManager
  fi
  echo "$cert_mode" > "$state/cert-mode"
  # chart/README.md's install commands (plus cluster/chart-values.yaml: agents on GPU nodes);
  # with cert-manager its default values (no --set webhook.certMode).
  local cert_args=(--set webhook.certMode=selfSigned)
  if [[ $cert_mode == certManager ]]; then
    cert_manager_up
    cert_args=()
  fi
  log "helm install $release $1 (chart/README.md's commands, webhook.certMode=$cert_mode, values cluster/chart-values.yaml)"
  # (Kept by an earlier `helm uninstall`: created only when absent.)
  kubectl_admin get namespace "$namespace" >/dev/null 2>&1 || kubectl_admin create namespace "$namespace" >/dev/null
  kubectl_admin label --overwrite namespace "$namespace" pod-security.kubernetes.io/enforce=privileged >/dev/null
  # Helm v4's wait for the CRDs of crds/ can fail at once ("CustomResourceDefinition … not ready.
  # status: InProgress") on an apiserver seconds old; the release is not recorded then, and a
  # second try goes through.
  local try
  for try in 1 2 3; do
    if "$bin/helm" --kubeconfig "$state/admin.kubeconfig" install "$release" "$1" \
      --namespace "$namespace" "${cert_args[@]}" --values cluster/chart-values.yaml \
      --values "$state/chart-values.yaml" --wait --timeout 5m >"$state/logs/helm-install.log" 2>&1; then
      break
    fi
    grep -q "CustomResourceDefinition.*not ready" "$state/logs/helm-install.log" && ((try < 3)) \
      && ! "$bin/helm" --kubeconfig "$state/admin.kubeconfig" status "$release" -n "$namespace" >/dev/null 2>&1 \
      || die "helm install failed: $(tail -5 "$state/logs/helm-install.log")"
    log "helm install: $(tail -1 "$state/logs/helm-install.log"); trying again"
    sleep 2
  done
  chart_controller
}

# cert-manager on this host (once per cluster): its CRDs, its namespace (ClusterIssuer Secrets),
# and cluster/cert-manager/'s process, which runs cert-manager's controllers and CA injector. It
# runs as the cluster admin (its own chart's RBAC is not installed here: docs/real-cluster.md).
cert_manager_up() {
  alive cert-manager && return 0
  kubectl_admin apply --server-side --field-manager=cluster.sh -f "$bin/cert-manager-crds.yaml" >/dev/null
  kubectl_admin wait --for condition=Established crd/certificates.cert-manager.io crd/issuers.cert-manager.io \
    crd/certificaterequests.cert-manager.io --timeout 60s >/dev/null
  kubectl_admin get namespace cert-manager >/dev/null 2>&1 || kubectl_admin create namespace cert-manager >/dev/null
  start cert-manager "$bin/cert-manager-local" --kubeconfig "$state/admin.kubeconfig" \
    --cluster-resource-namespace cert-manager
  log "cert-manager: running (logs: $state/logs/cert-manager.log)"
}

# The kubelet's part for the controller's webhook-cert Secret volume (certManager mode): the
# Secret's tls.crt and tls.key written into DIR, each replaced by a rename when the Secret
# changes (cert-manager renews it in place; the controller hot-reloads the directory).
secret_sync() { # secret dir
  mkdir -p "$2"
  local key tmp
  while true; do
    for key in tls.crt tls.key; do
      tmp="$2/.$key.new"
      if kubectl_admin get secret "$1" -n "$namespace" -o "go-template={{index .data \"$key\" | base64decode}}" > "$tmp" 2>/dev/null \
        && [[ -s $tmp ]] && ! cmp -s "$tmp" "$2/$key"; then
        mv -f "$tmp" "$2/$key"
      fi
      rm -f "$tmp"
    done
    sleep 5
  done
}

# This cluster's values beside cluster/chart-values.yaml: the real agent's ports on this host
# (IC_CLUSTER_AGENT_PORT), so that clusters side by side do not collide. `helm upgrade` without
# --reuse-values passes this file too (scripts/install-tests.sh: IC_CLUSTER_CHART_VALUES).
chart_values() {
  cat > "$state/chart-values.yaml" <<EOF
# Written by scripts/cluster.sh (IC_CLUSTER_AGENT_PORT): the agent on kwok-gpu-0 is a real
# process on this host, listening on these ports of its loopback.
agent:
  ports:
    http: $agent_port
    metrics: $((agent_port + 1))
EOF
}

# The controller on this host as the installed release's controller Deployment says (its args,
# its ServiceAccount), reached through the release's webhook Service: what a rollout of the
# Deployment does in a cluster. Run again after `helm upgrade` (`cluster.sh chart-controller`).
chart_controller() {
  stop ic-controller
  dnat_clear
  stop cert-sync
  "$bin/helm" --kubeconfig "$state/admin.kubeconfig" get manifest "$release" -n "$namespace" > "$state/manifest.yaml"
  local cert_dir=()
  local secret
  secret="$(.venv/chart-tests/bin/python cluster/chart_objects.py --certificate-secret-from "$state/manifest.yaml")"
  if [[ -n $secret ]]; then
    # cert-manager issues the serving certificate into this Secret; the Deployment's volume
    # is played by cert-sync.
    wait_for "cert-manager's webhook certificate Secret $namespace/$secret" 120 kubectl_admin get secret "$secret" -n "$namespace"
    start cert-sync bash "$root/scripts/cluster.sh" _secret-sync "$secret" "$state/webhook-cert-manager"
    wait_for "the webhook certificate files" 30 test -s "$state/webhook-cert-manager/tls.key"
    cert_dir=("$state/webhook-cert-manager")
  fi
  .venv/chart-tests/bin/python cluster/chart_objects.py --controller-args-from "$state/manifest.yaml" \
    "$state" "$webhook_port" "$grpc_port" "$http_port" "${cert_dir[@]}"
  start_controller
  dnat_controller_services
  grep -q -- '-webhook ' "$state/dnat-services" 2>/dev/null || die "the chart installed no webhook Service in $namespace"
  # The webhooks answer the apiserver through the Service (self-signed mode: the controller put
  # its CA into the configurations' caBundle; cert-manager mode: its CA injector did).
  wait_for "the CacheBackend webhooks through the webhook Service" 90 webhooks_answer
}

# `up --with-chart` after the controller-manager and scheduler: kwok and its nodes, `helm
# install`, the controller on this host, the webhook Service's DNAT rule.
up_chart() {
  command -v iptables >/dev/null || die "--with-chart needs iptables (and root): the controller Services' ClusterIPs are routed to the controller with DNAT rules"
  local tool
  for tool in unshare setpriv wget; do
    command -v "$tool" >/dev/null || die "--with-chart needs $tool: cluster/host_kubelet.py runs the chart's hook, test and agent pods on this host (unshare, setpriv: util-linux; wget: the agent test pod's command)"
  done
  # kwok plays every kubelet except for the pods cluster/host_kubelet.py runs on this host for
  # real: the chart's hook Jobs (so helm upgrade's CRD upgrade and uninstall's finalizer strip
  # happen, or fail, as they would in a cluster), its `helm test` pods, and the agent on
  # kwok-gpu-0.
  bash scripts/chart-venv.sh
  .venv/chart-tests/bin/python cluster/host_kubelet.py --kwok-stages "$bin/kwok-stages.yaml" "$state/kwok-stages.yaml"
  chart_values
  start host-kubelet env IC_KUBECTL="$bin/kubectl" .venv/chart-tests/bin/python -u cluster/host_kubelet.py \
    "$state" "$controller_bin" "$agent_bin" "$bin" --logs-port $((api_port + 4)) \
    --tls-cert "$state/pki/kubelet.crt" --tls-key "$state/pki/kubelet.key"
  # Every node's address is 127.0.0.1 and its kubelet port host_kubelet.py's log server (the
  # apiserver asks it for `kubectl logs`, `helm test --logs`).
  start kwok "$bin/kwok" --kubeconfig "$state/admin.kubeconfig" --config "$state/kwok-stages.yaml" \
    --manage-nodes-with-label-selector type=kwok --cidr 10.244.0.0/16 \
    --node-ip 127.0.0.1 --node-port $((api_port + 4)) \
    --node-lease-duration-seconds 40 --server-address "127.0.0.1:$((api_port + 3))"
  # (Node Leases renewed: without them kwok's status heartbeats come further apart than the
  # controller-manager's grace period, every node flaps NotReady and every pod goes Ready=False
  # about 50 s after start.)
  kubectl_admin apply --server-side --field-manager=cluster.sh -f cluster/kwok-nodes.yaml >/dev/null
  wait_for "kwok nodes" 60 kubectl_admin wait --for condition=Ready node -l type=kwok --timeout 5s
  chart_install ./chart
  write_env
}

next_steps() {
  cat >&2 <<EOF
cluster: try next (export the KUBECONFIG below; kubectl and helm of the cluster's version are in
  $bin: export PATH=$bin:\$PATH):
  kubectl get nodes                      # kwok nodes: kwok-gpu-0 (this host), kwok-gpu-1 (GPU,
                                         # cordoned), kwok-cpu-0
  kubectl get pods -n $namespace -o wide # the chart's pods: kwok plays them, except the agent on
                                         # kwok-gpu-0 (a real ic-agent on this host)
  kubectl get cachenodes                 # kwok-gpu-0, reported by that agent
  helm test $release -n $namespace --logs   # runs for real: gRPC health through the Service, the agent's /readyz
  kubectl apply -f examples/quickstart/cachebackend.yaml
  kubectl apply -f examples/quickstart/engine-pod.yaml
  kubectl get pod vllm-quickstart -o jsonpath='{.metadata.annotations}'   # wired by the Pod webhook
  kubectl describe cachebackend quickstart   # conditions and Events
  helm list -A
The controller serving the webhooks and gRPC is the host process (logs in $state/logs/); the
pods run here (hooks, tests, the kwok-gpu-0 agent) have logs (kubectl logs). kwok's pods run
nothing: no logs, and kubectl exec and port-forward do not work. After helm uninstall:
scripts/cluster.sh stop ic-controller (its ServiceAccount is gone).
What the quickstart backend then says, and why (no engine runs on kwok, and this host has no GPU):
  Ready False AwaitingFirstKVEvent     nothing publishes KV events (see README "Attach a replayed
                                       engine stream" for a publisher)
  NodeHealthy False on kwok-gpu-0      the real agent checks this host: gpu NvmlUnavailable and
                                       cuda CudaUnavailable once a GPU engine pod is planned there
  EngineKernelsHealthy Unknown         kwok "ran" the kernel-check init container without running it
  an EngineSelectorUnmatched Event     when the backend was applied before the engine pod
EOF
}

up() {
  local t0=$SECONDS
  command -v openssl >/dev/null || die "needs openssl"
  for tool in curl flock setsid python3; do
    command -v "$tool" >/dev/null || die "needs $tool"
  done
  ports_free
  log "building the control plane (cached in $bin; versions in cluster/versions.env)"
  OUT_DIR="$bin" cluster/build.sh
  log "binaries ready after $((SECONDS - t0)) s"
  if ((!bare)) && [[ ! -x "$controller_bin" ]]; then
    log "building ic-controller ($controller_bin)"
    cargo build -p ic-controller --bin ic-controller --locked
  fi
  if [[ $mode == chart && ! -x "$agent_bin" ]]; then
    log "building ic-agent ($agent_bin)"
    cargo build -p ic-agent --bin ic-agent --locked
  fi
  mkdir -p "$state"
  echo "$mode" > "$state/mode"
  echo "$cert_mode" > "$state/cert-mode"
  declare -p etcd_port etcd_peer_port api_port webhook_port grpc_port http_port agent_port | sed 's/^declare -- //' > "$state/ports"
  pki
  audit_policy

  start etcd "$bin/etcd" --name local --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "local=http://127.0.0.1:$etcd_peer_port" --listen-metrics-urls "" \
    --unsafe-no-fsync --log-level warn
  wait_for etcd 60 curl -sf "http://127.0.0.1:$etcd_port/health"

  start kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --tls-cert-file "$state/pki/apiserver.crt" --tls-private-key-file "$state/pki/apiserver.key" \
    --client-ca-file "$state/pki/ca.crt" \
    --service-account-key-file "$state/pki/sa.pub" --service-account-signing-key-file "$state/pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --authorization-mode RBAC --enable-admission-plugins NodeRestriction,OwnerReferencesPermissionEnforcement \
    --service-cluster-ip-range 10.96.0.0/12 --allow-privileged=true \
    --audit-policy-file "$state/audit-policy.yaml" --audit-log-path "$state/audit.log" \
    --audit-log-maxsize 0 --audit-log-mode batch --audit-log-batch-max-wait 1s \
    --etcd-compaction-interval 1m --profiling=false
  wait_for kube-apiserver 120 curl -sf --cacert "$state/pki/ca.crt" \
    --cert "$state/pki/admin.crt" --key "$state/pki/admin.key" "https://127.0.0.1:$api_port/readyz"

  if ((!bare)); then
    start kube-controller-manager "$bin/kube-controller-manager" \
      --kubeconfig "$state/kcm.kubeconfig" --authentication-kubeconfig "$state/kcm.kubeconfig" \
      --authorization-kubeconfig "$state/kcm.kubeconfig" \
      --bind-address 127.0.0.1 --secure-port $((api_port + 1)) --leader-elect=false \
      --service-account-private-key-file "$state/pki/sa.key" --root-ca-file "$state/pki/ca.crt" \
      --cluster-signing-cert-file "$state/pki/ca.crt" --cluster-signing-key-file "$state/pki/ca.key" \
      --use-service-account-credentials --profiling=false
    start kube-scheduler "$bin/kube-scheduler" \
      --kubeconfig "$state/scheduler.kubeconfig" --authentication-kubeconfig "$state/scheduler.kubeconfig" \
      --authorization-kubeconfig "$state/scheduler.kubeconfig" \
      --bind-address 127.0.0.1 --secure-port $((api_port + 2)) --leader-elect=false --profiling=false
  fi

  if [[ $mode == chart ]]; then
    up_chart
    log "up (with the chart) in $((SECONDS - t0)) s: kube-apiserver https://127.0.0.1:$api_port, nodes and pods by kwok, controller on this host (logs: $state/logs/)"
    next_steps
    echo "export KUBECONFIG=$state/admin.kubeconfig"
    return
  fi

  # The chart's objects (rendered by Helm's Go SDK) and CRDs.
  bash scripts/chart-venv.sh
  .venv/chart-tests/bin/python cluster/chart_objects.py "$state" "$state/pki/webhook-ca.crt" \
    "$webhook_port" "$grpc_port" "$http_port" "$state/webhook-certs"
  kubectl_admin apply --server-side --force-conflicts --field-manager=cluster.sh -f chart/crds/ >/dev/null
  kubectl_admin wait --for condition=Established --timeout=60s crd --all >/dev/null
  # The webhook configurations go in once the controller answers (below): a CacheBackend
  # webhook that fails closed would otherwise refuse writes while it starts.
  .venv/chart-tests/bin/python - "$state" <<'EOF'
import sys, yaml
from pathlib import Path
state = Path(sys.argv[1])
docs = list(yaml.safe_load_all((state / "objects.yaml").read_text()))
hooks = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
rest = [d for d in docs if not d["kind"].endswith("WebhookConfiguration")]
(state / "objects-base.yaml").write_text(yaml.safe_dump_all(rest, sort_keys=False))
(state / "objects-webhooks.yaml").write_text(yaml.safe_dump_all(hooks, sort_keys=False))
EOF
  kubectl_admin apply --server-side --force-conflicts --field-manager=cluster.sh -f "$state/objects-base.yaml" >/dev/null
  if ((bare)); then
    write_env
    log "up (bare) in $((SECONDS - t0)) s: kube-apiserver https://127.0.0.1:$api_port (logs: $state/logs/)"
    echo "export KUBECONFIG=$state/admin.kubeconfig"
    return
  fi

  start_controller
  kubectl_admin apply --server-side --force-conflicts --field-manager=cluster.sh -f "$state/objects-webhooks.yaml" >/dev/null

  # The webhooks answer the apiserver: a server-side dry run of a CacheBackend goes through both.
  wait_for "the CacheBackend webhooks" 60 webhooks_answer

  write_env
  log "up in $((SECONDS - t0)) s: kube-apiserver https://127.0.0.1:$api_port, controller webhooks https://127.0.0.1:$webhook_port (logs: $state/logs/)"
  echo "export KUBECONFIG=$state/admin.kubeconfig"
}

down() {
  dnat_clear
  # The real agent runs in a session of its own; host_kubelet.py stops it on TERM, and this
  # catches one left by a host_kubelet.py that was killed.
  local pid
  pid="$(cat "$state/host-pods/agent.pid" 2>/dev/null || true)"
  for ((i = ${#components[@]} - 1; i >= 0; i--)); do
    stop "${components[$i]}"
  done
  [[ -n "$pid" ]] && grep -qs ic-agent "/proc/$pid/cmdline" && kill -KILL "$pid" 2>/dev/null
  rm -rf "$state"
  log "down"
}

status() {
  local ok=0 c
  for c in "${components[@]}"; do
    if alive "$c"; then echo "$c: running (pid $(cat "$state/pids/$c"))"
    elif [[ $c == cert-manager || $c == cert-sync ]] && [[ $cert_mode != certManager ]]; then
      echo "$c: not used (webhook.certMode=$cert_mode)"
    else echo "$c: not running"; ok=1; fi
  done
  return $ok
}

case "${1:-}" in
  up)
    if status >/dev/null 2>&1 && [[ -f "$state/cluster.env" ]]; then
      log "already up"
      echo "export KUBECONFIG=$state/admin.kubeconfig"
    else
      # A partial earlier start (a component died) is cleared first.
      down 2>/dev/null
      up
    fi
    ;;
  down) down ;;
  status) status ;;
  restart) restart "${2:?restart needs a component}" ;;
  install-chart)
    [[ $mode == chart ]] || die "install-chart: only on a cluster started with up --with-chart"
    chart_install "${2:?install-chart needs a chart (directory or .tgz)}" "${3:-}" ;;
  _secret-sync) secret_sync "$2" "$3" ;;
  chart-controller)
    [[ $mode == chart ]] || die "chart-controller: only on a cluster started with up --with-chart"
    chart_controller ;;
  stop)
    [[ " ${components[*]} " == *" ${2:?stop needs a component} "* ]] || die "stop: unknown component $2 (one of: ${components[*]})"
    stop "$2"; log "stopped $2" ;;
  env) echo "$state/cluster.env" ;;
  "" | -h | --help | help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; [[ -n "${1:-}" ]] && exit 0; exit 2 ;;
  *)
    log "unknown command ${1:-}: use up, down, status, restart COMPONENT, stop COMPONENT, install-chart CHART, chart-controller or env"
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
