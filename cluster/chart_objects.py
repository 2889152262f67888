"""Renders the chart with Helm's Go SDK (helm-python-sdk, the chart tests' venv) for the local
control plane that scripts/cluster.sh starts, and writes what `up` applies and runs:

  OUT/objects.yaml        the chart's cluster objects: namespaces, ServiceAccounts, RBAC,
                          ConfigMaps, the controller's Lease, Services,
                          ValidatingAdmissionPolicies and the webhook
                          configurations; each webhook's clientConfig points at the controller's
                          loopback HTTPS listener by `url` with the local webhook CA as `caBundle`
                          (no pod backs the chart's Service here)
  OUT/controller-args     the controller container's own arguments, one per line, with only the
                          listen addresses and the certificate directory moved to loopback and
                          this run's files

Left out: Deployments, DaemonSets, Jobs and Helm hooks (no kubelet runs their pods here), and
cert-manager's Certificate/Issuer (no cert-manager: the certificate comes from cluster.sh's PKI).
The CRDs are applied from chart/crds/ directly, as Helm installs them.

Values beyond the chart's defaults (VALUES), so that every grant the chart gives the
controller is exercised here and cluster/audit_check.py can hold it to least privilege (the
ValidatingAdmissionPolicies that keep the controller's workload writes to objects it owns are on
by default, so they are enforced on its own writes here too):

  modelCache.featureGates.ModelCacheEncryption
                                          on (merged over the chart's featureGates map, so
                                          CachingSupport and HelmModelCaching keep their default
                                          `true`): new model caches on the shipped catalog's
                                          NVMesh entry (encryptionSupported) are encrypted, so the
                                          controller creates, reads and deletes key Secrets and
                                          derived StorageClasses. With the gate off the chart
                                          still grants Secret and StorageClass get/delete (the
                                          release of an encrypted cache made while it was on),
                                          which nothing here would use; with it on every Secret
                                          and StorageClass grant, `create` included, is exercised
                                          by the real-apiserver model-cache tests.

usage: chart_objects.py OUT CA_FILE WEBHOOK_PORT GRPC_PORT HTTP_PORT CERT_DIR
       chart_objects.py --controller-args-from MANIFEST OUT WEBHOOK_PORT GRPC_PORT HTTP_PORT [CERT_DIR]
           (`cluster.sh up --with-chart`: only OUT/controller-args, from the controller
           Deployment of an installed release's manifest, `helm get manifest`; CERT_DIR, in
           cert-manager mode, replaces the Deployment's --webhook-cert-dir)
       chart_objects.py --certificate-secret-from MANIFEST
           (prints the Secret of the manifest's cert-manager Certificate; nothing in
           self-signed mode)
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "inference-cache"
NAMESPACE = "inference-cache"
# What the local control plane installs beyond the defaults (see the docstring): the model
# cache's encryption gate on (Helm merges the featureGates map over the chart's, so
# CachingSupport and HelmModelCaching stay true).
VALUES = {
    "modelCache": {"featureGates": {"ModelCacheEncryption": True}},
}
APPLIED_KINDS = {
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Lease",
    "Service",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
}


def main() -> None:
    if sys.argv[1] == "--certificate-secret-from":
        for doc in yaml.safe_load_all(Path(sys.argv[2]).read_text()):
            if doc and doc["kind"] == "Certificate" and doc["apiVersion"].startswith("cert-manager.io/"):
                print(doc["spec"]["secretName"])
        return
    if sys.argv[1] == "--controller-args-from":
        manifest, out, webhook_port, grpc_port, http_port = sys.argv[2:7]
        cert_dir = sys.argv[7] if len(sys.argv) > 7 else None
        for doc in yaml.safe_load_all(Path(manifest).read_text()):
            if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("controller"):
                container = doc["spec"]["template"]["spec"]["containers"][0]
                args = controller_args(container["args"], webhook_port, grpc_port, http_port, cert_dir)
                (Path(out) / "controller-args").write_text("\n".join(args) + "\n")
                return
        sys.exit(f"chart_objects.py: {manifest} holds no controller Deployment")
    out, ca_file, webhook_port, grpc_port, http_port, cert_dir = sys.argv[1:7]
    out_dir = Path(out)
    ca_bundle = base64.b64encode(Path(ca_file).read_bytes()).decode()
    chart = helm.Chart.load(str(ROOT / "chart"))
    rendered = chart.render(VALUES, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    args: list[str] | None = None
    for path, text in sorted(rendered.items()):
        if "/tests/" in path or path.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            annotations = doc.get("metadata", {}).get("annotations") or {}
            if "helm.sh/hook" in annotations:
                continue
            kind = doc["kind"]
            if kind == "Deployment" and doc["metadata"]["name"].endswith("controller"):
                container = doc["spec"]["template"]["spec"]["containers"][0]
                args = controller_args(container["args"], webhook_port, grpc_port, http_port, cert_dir)
            if kind not in APPLIED_KINDS:
                continue
            if kind.endswith("WebhookConfiguration"):
                annotations.pop("cert-manager.io/inject-ca-from", None)
                for hook in doc["webhooks"]:
                    path_ = hook["clientConfig"]["service"].get("path", "/")
                    hook["clientConfig"] = {
                        "url": f"https://127.0.0.1:{webhook_port}{path_}",
                        "caBundle": ca_bundle,
                    }
            if kind != "Namespace" and kind not in CLUSTER_SCOPED:
                doc["metadata"].setdefault("namespace", NAMESPACE)
            objects.append(doc)
    if args is None:
        sys.exit("chart_objects.py: the chart rendered no controller Deployment")
    # Namespaces first, so that namespaced objects find theirs on one apply.
    objects.sort(key=lambda o: o["kind"] != "Namespace")
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    if NAMESPACE not in names:
        objects.insert(0, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    (out_dir / "objects.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    (out_dir / "controller-args").write_text("\n".join(args) + "\n")


CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
}


def controller_args(chart_args: list[str], webhook_port: str, grpc_port: str, http_port: str,
                    cert_dir: str | None) -> list[str]:
    """The chart's controller arguments with the listeners on loopback and (when given) this
    run's certificate directory; `$(POD_NAMESPACE)` becomes the release namespace (what the
    kubelet substitutes)."""
    moved = {
        "--grpc-addr": f"127.0.0.1:{grpc_port}",
        "--http-addr": f"127.0.0.1:{http_port}",
        "--webhook-addr": f"127.0.0.1:{webhook_port}",
        # The separate health listener (chart `controller.ports.health`): beside the HTTP port,
        # so that clusters side by side on this host do not collide on the chart's 8081.
        "--health-addr": f"127.0.0.1:{int(http_port) + 1}",
    }
    if cert_dir is not None:
        moved["--webhook-cert-dir"] = cert_dir
    args = []
    for a in chart_args:
        key = a.split("=", 1)[0]
        if key in moved:
            a = f"{key}={moved[key]}"
        args.append(a.replace("$(POD_NAMESPACE)", NAMESPACE))
    return args


if __name__ == "__main__":
    main()
