#!/usr/bin/env bash
# The chart installed, upgraded and uninstalled for real (docs/real-cluster.md "With the chart"):
# `scripts/cluster.sh up --with-chart` in its own state directory and ports (kube-apiserver,
# controller-manager, scheduler, kwok nodes, `helm install --wait` in self-signed mode, the
# controller on this host behind the chart's webhook Service), then, through the apiserver as a
# user would:
#
#   1. install: the release is deployed; every chart pod is Running on a kwok node and the agents
#      only on the GPU nodes; both webhook configurations point at the chart's Service (no url)
#      with the controller's CA in every caBundle; the controller holds the chart's Lease;
#   1b. `helm test --logs` passes for real: its pods run on this host (cluster/host_kubelet.py):
#      grpc-health-probe gets SERVING from the controller through its gRPC Service, and the agent
#      test pod (on kwok-gpu-0, the only node it can land on) gets 200 from /readyz of the real
#      ic-agent that runs there, which reports to the controller (CacheNode kwok-gpu-0 says
#      AgentConnected). It must be able to fail: with the controller stopped it fails (the
#      probe cannot connect) and passes once it is back; with the agent frozen (SIGSTOP) it
#      fails (/readyz times out) and passes once it runs again;
#   2. the webhooks through the Service: the quickstart CacheBackend (examples/quickstart) is
#      defaulted by the mutating webhook, an invalid one is refused naming its field, and the
#      quickstart engine pod is wired by the Pod webhook;
#   3. upgrade: `helm upgrade` with a changed value: the pre-upgrade hook Job runs for real (on
#      this host: cluster/host_kubelet.py) and applies the chart's CRDs; the controller rolled
#      (`cluster.sh chart-controller`) keeps its CA in the webhook configurations and they answer;
#      `helm test --logs` passes;
#   4. uninstall: `helm uninstall`, the controller stopped (its pods are gone), the real agent
#      stopped by host_kubelet.py (its pod is gone); no webhook
#      configuration, policy, ClusterRole or leader Lease of the release is left, a pod is created at once in
#      another namespace (nothing blocks pod creation), deleting the release namespace completes
#      (nothing blocks namespace deletion), and what is deliberately kept (the CRDs) is there; the
#      pre-delete hook (the model cache's finalizer strip) ran for real;
#   5. upgrade from the previous chart (testdata/chart/, packaged from an earlier commit, whose
#      CRDs differ): on a cluster without our CRDs it installs its own; `helm upgrade` to ./chart
#      ends with every CRD applied by the hook (field manager inference-cache-crd-upgrade) and
#      the changed one as chart/crds has it; the webhooks answer; then uninstall;
#   6. the chart's default values (webhook.certMode=certManager) with cert-manager running on this
#      host (cluster/cert-manager/): its Certificate is Ready, cert-manager's CA injector put the
#      issuing CA into every webhook, the controller serves the issued certificate (read from the
#      Secret as the Deployment's volume would give it), the webhooks answer, `helm test` passes,
#      and uninstall leaves no webhook configuration, Certificate or Issuer.
#
# Needs root and iptables (the Service's ClusterIP is routed to the controller with one DNAT
# rule). Exit 0 only when every step passed; each failure names the step and what was seen.
set -euo pipefail
cd "$(dirname "$0")/.."
export IC_CLUSTER_DIR="${IC_INSTALL_CLUSTER_DIR:-$PWD/target/cluster/chart}"
# Its own ports (IC_INSTALL_*_PORT move them), beside scripts/test.sh's two other control planes
# (the API port's +1..+4 are taken too: controller-manager, scheduler, kwok, host_kubelet's logs;
# the agent's metrics port is the agent port +1).
export IC_CLUSTER_ETCD_PORT="${IC_INSTALL_ETCD_PORT:-23811}" IC_CLUSTER_API_PORT="${IC_INSTALL_API_PORT:-16463}" \
  IC_CLUSTER_WEBHOOK_PORT="${IC_INSTALL_WEBHOOK_PORT:-19463}" IC_CLUSTER_GRPC_PORT="${IC_INSTALL_GRPC_PORT:-15071}" \
  IC_CLUSTER_HTTP_PORT="${IC_INSTALL_HTTP_PORT:-18100}" IC_CLUSTER_AGENT_PORT="${IC_INSTALL_AGENT_PORT:-19110}"
bin="$PWD/target/cluster/bin"
state="$IC_CLUSTER_DIR"
release=inference-cache
ns=inference-cache
failures=0

say() { echo "install-tests: $*" >&2; }
fail() { say "FAIL: $*"; failures=$((failures + 1)); }
k() { "$bin/kubectl" --kubeconfig "$state/admin.kubeconfig" "$@"; }
helm() { "$bin/helm" --kubeconfig "$state/admin.kubeconfig" "$@"; }
# Polls a command until it succeeds (seconds, command...); 1 when it never did.
eventually() {
  local secs=$1; shift
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 1
  done
}

bash scripts/cluster.sh down >/dev/null 2>&1 || true
# On the way out the cluster goes; its logs stay in target/cluster/chart-logs when a step failed.
cleanup() {
  if ((failures)) && [[ -d $state/logs ]]; then
    rm -rf "$state-logs"; cp -r "$state/logs" "$state-logs"; say "logs kept in $state-logs"
  fi
  bash scripts/cluster.sh down >/dev/null 2>&1 || true
}
trap cleanup EXIT
t0=$SECONDS
bash scripts/cluster.sh up --with-chart >/dev/null || { failures=1; say "FAIL: cluster.sh up --with-chart"; exit 1; }
say "up --with-chart (helm install --wait included) in $((SECONDS - t0)) s"

# --- 1. install -----------------------------------------------------------------------------------
status="$(helm status "$release" -n "$ns" -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["info"]["status"])')"
[[ $status == deployed ]] || fail "install: release status $status, not deployed"
not_running="$(k get pods -n "$ns" -o jsonpath='{range .items[?(@.status.phase!="Running")]}{.metadata.name} {end}')"
[[ -z $not_running ]] || fail "install: chart pods not Running: $not_running"
agent_nodes="$(k get pods -n "$ns" -l app.kubernetes.io/component=agent -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | sort | tr '\n' ' ')"
[[ $agent_nodes == "kwok-gpu-0 kwok-gpu-1 " ]] || fail "install: agents on '$agent_nodes', expected the two GPU nodes only"
for kind in mutatingwebhookconfigurations validatingwebhookconfigurations; do
  for hook in $(k get "$kind" -l "app.kubernetes.io/instance=$release" -o name); do
    urls="$(k get "$hook" -o jsonpath='{range .webhooks[*]}{.clientConfig.url}{end}')"
    svcs="$(k get "$hook" -o jsonpath='{range .webhooks[*]}{.clientConfig.service.name} {end}')"
    empty_ca="$(k get "$hook" -o jsonpath='{range .webhooks[?(@.clientConfig.caBundle=="")]}{.name} {end}')"
    [[ -z $urls && -n $svcs ]] || fail "install: $hook does not go through the chart's Service (url '$urls', service '$svcs')"
    [[ -z $empty_ca ]] || fail "install: $hook has webhooks without the controller's CA: $empty_ca"
  done
done

# kwok renews the nodes' Leases (else the controller-manager marks them NotReady within a minute
# and every pod with them).
node_leases="$(k get leases -n kube-node-lease -o name | grep -c kwok- || true)"
((node_leases == 3)) || fail "install: $node_leases node Leases in kube-node-lease, expected one per kwok node"
# The controller leads through the Lease the chart created (its RBAC has no Lease create).
holder() { [[ -n "$(k get lease -n "$ns" inference-cache-controller -o jsonpath='{.spec.holderIdentity}')" ]]; }
eventually 60 holder || fail "install: the controller never took the chart's Lease"

# --- 1b. helm test, for real ----------------------------------------------------------------------
t_test=$SECONDS
# `helm test --logs` into $state/logs/helm-test-<what>.log; its exit status.
helm_test() { # what
  helm test "$release" -n "$ns" --logs --timeout 2m >"$state/logs/helm-test-$1.log" 2>&1
}
# The agent of kwok-gpu-0 is a real process on this host (host_kubelet.py), connected to the
# controller through the gRPC Service.
agent_pid() { cat "$state/host-pods/agent.pid" 2>/dev/null; }
agent_connected() {
  [[ "$(k get cachenode kwok-gpu-0 -o jsonpath='{.status.conditions[?(@.type=="AgentConnected")].status}')" == True ]]
}
[[ -n "$(agent_pid)" ]] && kill -0 "$(agent_pid)" 2>/dev/null || fail "helm test: no real agent runs for kwok-gpu-0"
eventually 90 agent_connected || fail "helm test: CacheNode kwok-gpu-0 never said AgentConnected (the real agent did not reach the controller through the gRPC Service)"
# Whatever the agent test pod's node, it must be the real agent's (kwok-gpu-1 is cordoned).
if helm_test install; then
  grep -q "status: SERVING" "$state/logs/helm-test-install.log" && grep -q "^ready" "$state/logs/helm-test-install.log" \
    || fail "helm test: passed without the probes' answers in its logs: $(tail -8 "$state/logs/helm-test-install.log")"
else
  fail "helm test: failed after install: $(tail -8 "$state/logs/helm-test-install.log")"
fi
# A stopped controller fails it (the gRPC probe cannot connect through the Service) ...
bash scripts/cluster.sh stop ic-controller >/dev/null 2>&1
if helm_test controller-stopped; then
  fail "helm test: passed with the controller stopped"
else
  grep -q "test-controller-grpc" "$state/logs/helm-test-controller-stopped.log" \
    && grep -q "failed to connect service" "$state/logs/helm-test-controller-stopped.log" \
    || fail "helm test: with the controller stopped it failed, but not on the gRPC test: $(tail -5 "$state/logs/helm-test-controller-stopped.log")"
fi
# ... and it passes again once the controller is back (the same command line: `restart`).
bash scripts/cluster.sh restart ic-controller >/dev/null 2>&1
eventually 60 helm_test controller-back || fail "helm test: still failing after the controller came back: $(tail -5 "$state/logs/helm-test-controller-back.log")"
# A frozen agent (SIGSTOP: it accepts connections but answers nothing) fails it ...
kill -STOP "$(agent_pid)"
if helm_test agent-stopped; then
  fail "helm test: passed with the agent stopped"
else
  grep -q "test-agent-readyz.*failed" "$state/logs/helm-test-agent-stopped.log" \
    && grep -q "did not answer 200" "$state/logs/helm-test-agent-stopped.log" \
    || fail "helm test: with the agent stopped it failed, but not on the agent test: $(tail -5 "$state/logs/helm-test-agent-stopped.log")"
fi
# ... and it passes once the agent runs again.
kill -CONT "$(agent_pid)"
eventually 60 helm_test agent-back || fail "helm test: still failing after the agent was resumed: $(tail -5 "$state/logs/helm-test-agent-back.log")"
say "helm test: passed, failed with the controller stopped and with the agent frozen, passed again ($((SECONDS - t_test)) s)"

# --- 2. the webhooks through the Service ------------------------------------------------------------
k apply -f examples/quickstart/cachebackend.yaml >/dev/null || fail "webhooks: the quickstart CacheBackend was refused"
mode="$(k get cachebackend quickstart -n default -o jsonpath='{.spec.integration.mode}')"
[[ $mode == Offload ]] || fail "webhooks: spec.integration.mode '$mode', not defaulted to Offload by the mutating webhook"
# Through the apiserver's REST API (a dry run), so that the Status message is read as the
# apiserver wrote it (kubectl rewrites refusals with field causes).
api="$(sed -n 's/^IC_CLUSTER_API=//p' "$state/cluster.env")"
refusal="$(curl -s --cacert "$state/pki/ca.crt" --cert "$state/pki/admin.crt" --key "$state/pki/admin.key" \
  -H 'Content-Type: application/yaml' --data-binary @- \
  "$api/apis/inferencecache.io/v1alpha1/namespaces/default/cachebackends?dryRun=All" <<'EOF'
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {name: zero-replicas, namespace: default}
spec: {runtime: VLLM, replicas: 0, autoscaling: {maxReplicas: 3}, engineSelector: {matchLabels: {app: x}}}
EOF
)"
[[ $refusal == *vcachebackend.inferencecache.io* && $refusal == *spec.autoscaling.minReplicas* ]] \
  || fail "webhooks: the validating webhook did not refuse replicas 0 with autoscaling, naming the field: $refusal"
k apply -f examples/quickstart/engine-pod.yaml >/dev/null
injected="$(k get pod vllm-quickstart -n default -o jsonpath='{.metadata.annotations.inferencecache\.io/injected-by}')"
[[ $injected == default/quickstart ]] || fail "webhooks: the quickstart engine pod was not wired (injected-by '$injected')"
eventually 60 bash -c "[[ \$('$bin/kubectl' --kubeconfig '$state/admin.kubeconfig' get pod vllm-quickstart -n default -o jsonpath='{.status.phase}') == Running ]]" \
  || fail "webhooks: the wired engine pod never reached Running on a kwok node"

# --- 3. upgrade -----------------------------------------------------------------------------------
helm upgrade "$release" chart -n "$ns" --reuse-values --set-string controller.podAnnotations.upgraded=true --wait --timeout 5m \
  >"$state/logs/helm-upgrade.log" 2>&1 || fail "upgrade: helm upgrade failed: $(tail -3 "$state/logs/helm-upgrade.log")"
revision="$(helm status "$release" -n "$ns" -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')"
[[ $revision == 2 ]] || fail "upgrade: release revision $revision, not 2"
ca_back() {
  local hook
  for hook in $(k get mutatingwebhookconfigurations,validatingwebhookconfigurations -l "app.kubernetes.io/instance=$release" -o name); do
    [[ -z "$(k get "$hook" -o jsonpath='{range .webhooks[?(@.clientConfig.caBundle=="")]}{.name}{end}')" ]] || return 1
  done
}
bash scripts/cluster.sh chart-controller >/dev/null 2>&1 || fail "upgrade: the controller did not come back as the upgraded release says"
eventually 120 ca_back || fail "upgrade: the controller did not put its CA back into the webhook configurations"
grep -q "upgrade-crds --crds-dir=.* exit 0\|: exit 0" "$state/logs/host-kubelet.log" \
  || fail "upgrade: the pre-upgrade hook Job did not run to success: $(tail -5 "$state/logs/host-kubelet.log")"
after_upgrade() { sed 's/name: quickstart/name: after-upgrade/' examples/quickstart/cachebackend.yaml | k create --dry-run=server -f -; }
eventually 60 after_upgrade || fail "upgrade: the CacheBackend webhooks do not answer after the upgrade"
eventually 60 helm_test upgrade || fail "upgrade: helm test fails after the upgrade: $(tail -8 "$state/logs/helm-test-upgrade.log")"

# --- 4. uninstall ---------------------------------------------------------------------------------
k delete -f examples/quickstart/engine-pod.yaml --wait=false >/dev/null 2>&1 || true
k delete -f examples/quickstart/cachebackend.yaml --timeout 60s >/dev/null || fail "uninstall: the quickstart CacheBackend was not deleted (its finalizer stayed)"
helm uninstall "$release" -n "$ns" --wait --timeout 5m >"$state/logs/helm-uninstall.log" 2>&1 \
  || fail "uninstall: helm uninstall failed: $(tail -3 "$state/logs/helm-uninstall.log")"
bash scripts/cluster.sh stop ic-controller >/dev/null 2>&1
# The agent's pod went with the DaemonSet: host_kubelet.py stopped the process.
agent_gone() { [[ -z "$(agent_pid)" ]]; }
eventually 60 agent_gone || fail "uninstall: the real agent (pid $(agent_pid)) still runs after its pod was deleted"
left="$(k get mutatingwebhookconfigurations,validatingwebhookconfigurations,validatingadmissionpolicies,validatingadmissionpolicybindings,clusterroles,clusterrolebindings \
  -l "app.kubernetes.io/instance=$release" -o name 2>/dev/null | tr '\n' ' ')"
[[ -z $left ]] || fail "uninstall: left behind: $left"
# The release namespace is kept (helm.sh/resource-policy: keep); the controller's Lease goes with
# the release (the chart creates it).
leases="$(k get leases -n "$ns" -o name | tr '\n' ' ')"
[[ -z $leases ]] || fail "uninstall: leases left in $ns: $leases"
pod_t=$SECONDS
k run after-uninstall -n default --image=busybox --restart=Never --labels app=vllm-quickstart >/dev/null \
  || fail "uninstall: a pod could not be created after uninstall"
((SECONDS - pod_t <= 5)) || fail "uninstall: creating a pod took $((SECONDS - pod_t)) s (a webhook left behind?)"
k delete namespace "$ns" --wait=false >/dev/null
eventually 180 bash -c "! '$bin/kubectl' --kubeconfig '$state/admin.kubeconfig' get namespace '$ns' >/dev/null 2>&1" \
  || fail "uninstall: namespace $ns still there 180 s after its deletion: $(k get namespace "$ns" -o jsonpath='{.status.conditions}')"
grep -q "strip-finalizers" "$state/logs/host-kubelet.log" \
  || fail "uninstall: the pre-delete hook (strip-finalizers) never ran"
crds="$(k get crd -o name | grep -c inferencecache.io || true)"
((crds > 0)) || fail "uninstall: the CRDs are gone (they are kept on purpose: docs/install.md)"
say "kept after uninstall: $crds CustomResourceDefinitions (inferencecache.io)"

# --- 5. upgrade from the previous chart, CRDs changed -----------------------------------------------
prev="$(ls testdata/chart/inference-cache-*.tgz | head -1)"
mapfile -t crd_names < <(ls chart/crds | sed 's/\.yaml$//')
k delete crd "${crd_names[@]}" --wait --timeout 120s >/dev/null || fail "previous: the CRDs could not be deleted"
bash scripts/cluster.sh install-chart "$prev" >/dev/null || fail "previous: $prev did not install"
mc_crd() { k get crd modelcaches.inferencecache.io -o json; }
old_text="cannot see inside the template"
mc_crd | grep -q "$old_text" || fail "previous: $prev did not install its own CRDs"
chart_values="$(sed -n 's/^IC_CLUSTER_CHART_VALUES=//p' "$state/cluster.env")"
helm upgrade "$release" ./chart -n "$ns" --set webhook.certMode=selfSigned --values cluster/chart-values.yaml \
  --values "$chart_values" --wait --timeout 5m >"$state/logs/helm-upgrade-from-previous.log" 2>&1 \
  || fail "previous: helm upgrade from $prev failed: $(tail -3 "$state/logs/helm-upgrade-from-previous.log")"
! mc_crd | grep -q "$old_text" || fail "previous: the changed CRD was not upgraded (modelcaches still the old one)"
for crd in "${crd_names[@]}"; do
  managers="$(k get crd "$crd" -o jsonpath='{.metadata.managedFields[*].manager}')"
  [[ $managers == *inference-cache-crd-upgrade* ]] || fail "previous: $crd not applied by the upgrade hook (managers: $managers)"
done
bash scripts/cluster.sh chart-controller >/dev/null 2>&1 || fail "previous: the upgraded controller's webhooks do not answer"
helm uninstall "$release" -n "$ns" --wait --timeout 5m >/dev/null 2>&1 || fail "previous: helm uninstall failed"
bash scripts/cluster.sh stop ic-controller >/dev/null 2>&1

# --- 6. the default values: cert-manager issues the webhook certificate ------------------------------
t6=$SECONDS
if bash scripts/cluster.sh install-chart ./chart --cert-manager >"$state/logs/install-cert-manager.log" 2>&1; then
  user_values="$(helm get values "$release" -n "$ns" -o json)"
  [[ $user_values != *certMode* ]] || fail "cert-manager: the install set webhook.certMode ($user_values): not the default values"
  cert_ready() {
    [[ "$(k get certificates.cert-manager.io -n "$ns" -o jsonpath='{.items[*].status.conditions[?(@.type=="Ready")].status}')" == True ]]
  }
  eventually 60 cert_ready || fail "cert-manager: the chart's Certificate is not Ready: $(k get certificates.cert-manager.io -n "$ns" -o yaml | tail -20)"
  secret="$(k get certificates.cert-manager.io -n "$ns" -o jsonpath='{.items[0].spec.secretName}')"
  issued_ca="$(k get secret "$secret" -n "$ns" -o jsonpath='{.data.ca\.crt}')"
  [[ -n $issued_ca ]] || fail "cert-manager: Secret $secret has no ca.crt"
  # cert-manager's CA injector (not the controller: it patches nothing in this mode) put the
  # issuing CA into every webhook of both configurations.
  injected() {
    local hook
    for hook in $(k get mutatingwebhookconfigurations,validatingwebhookconfigurations -l "app.kubernetes.io/instance=$release" -o name); do
      [[ -n "$(k get "$hook" -o jsonpath='{.metadata.annotations.cert-manager\.io/inject-ca-from}')" ]] || return 1
      [[ "$(k get "$hook" -o jsonpath='{range .webhooks[*]}{.clientConfig.caBundle}{"\n"}{end}' | sort -u)" == "$issued_ca" ]] || return 1
    done
  }
  eventually 60 injected || fail "cert-manager: the webhook configurations do not carry the issuing CA of $secret (cainjector)"
  # The controller serves the certificate cert-manager issued (read from the Secret's volume).
  served="$(openssl s_client -connect "127.0.0.1:$IC_CLUSTER_WEBHOOK_PORT" -servername x </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256 2>/dev/null)"
  issued="$(k get secret "$secret" -n "$ns" -o jsonpath='{.data.tls\.crt}' | base64 -d | openssl x509 -noout -fingerprint -sha256)"
  [[ -n $served && $served == "$issued" ]] || fail "cert-manager: the controller serves '$served', not the issued certificate '$issued'"
  after_cm() { sed 's/name: quickstart/name: cert-manager-mode/' examples/quickstart/cachebackend.yaml | k create --dry-run=server -f -; }
  eventually 60 after_cm || fail "cert-manager: the CacheBackend webhooks do not answer through the Service"
  eventually 60 helm_test cert-manager || fail "cert-manager: helm test fails: $(tail -8 "$state/logs/helm-test-cert-manager.log")"
  helm uninstall "$release" -n "$ns" --wait --timeout 5m >"$state/logs/helm-uninstall-cert-manager.log" 2>&1 \
    || fail "cert-manager: helm uninstall failed: $(tail -3 "$state/logs/helm-uninstall-cert-manager.log")"
  bash scripts/cluster.sh stop ic-controller >/dev/null 2>&1
  left="$(k get mutatingwebhookconfigurations,validatingwebhookconfigurations,certificates.cert-manager.io,issuers.cert-manager.io \
    -A -l "app.kubernetes.io/instance=$release" -o name 2>/dev/null | tr '\n' ' ')"
  [[ -z $left ]] || fail "cert-manager: left behind after uninstall: $left"
  # cert-manager keeps the Secret it wrote (it owns it only with --enable-certificate-owner-ref):
  # listed in docs/install.md as what stays until the namespace goes.
  k get secret "$secret" -n "$ns" >/dev/null 2>&1 || fail "cert-manager: Secret $secret is gone (docs/install.md says it stays)"
  say "default values with cert-manager: Certificate Ready, CA injected, served, helm test passed, uninstalled ($((SECONDS - t6)) s)"
else
  fail "cert-manager: install with the default values failed: $(tail -5 "$state/logs/install-cert-manager.log")"
fi

if ((failures)); then
  say "$failures step(s) failed (logs: $state/logs/)"
  exit 1
fi
say "ok: install, helm test (and its failures with the controller or agent stopped), webhooks through the Service, upgrade, uninstall, upgrade from $(basename "$prev"), the default values with cert-manager ($((SECONDS - t0)) s)"
