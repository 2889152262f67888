"""Shared fixtures of the chart tests: the chart rendered by Helm's own Go SDK (helm-python-sdk),
for the default values and each variant, as parsed Kubernetes objects."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate.utils as kv_utils
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = ROOT / "chart"
RELEASE = "inference-cache"
NAMESPACE = "inference-cache"

# Kubernetes versions every rendered object must be valid for (the chart's floor and a current one).
KUBE_VERSIONS = ("1.29", "1.33")

# kubernetes-validate reads and parses its JSON schema files on every call; they never change.
kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)

# Every model-cache value (and the engine-wiring images) away from its default.
MODEL_CACHE_CUSTOM: dict[str, Any] = {
    "modelCache": {
        "controlNamespace": "mc-control",
        "createControlNamespace": False,
        "storageClass": "weka-retain",
        "featureGates": {"ModelCacheEncryption": True, "HelmModelCaching": False},
        "idlePeriodSeconds": 2592000,
        "writerServiceAccount": "model-writer",
        "catalog": {"name": "my-catalog"},
    },
    "engine": {
        "lmcacheWorkerImage": "registry.example/lmcache:0.3.9",
        "lmcacheKernelCheckImage": "registry.example/kernel-check:1.0",
    },
    "kvEventSubscriber": {"image": "registry.example/ic-agent:0.1.0"},
}

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # A cluster without NVIDIA GPUs.
    "gpu-off": {"agent": {"gpu": {"enabled": False}}},
    # NVML through the NVIDIA RuntimeClass, agents on GPU nodes only.
    "gpu-runtimeclass": {
        "agent": {"gpu": {"runtimeClassName": "nvidia", "nodeAffinity": {"enabled": True}}}
    },
    # More replicas spread over nodes, priority classes.
    "ha": {
        "controller": {
            "replicas": 3,
            "podAntiAffinity": "hard",
            "priorityClassName": "system-cluster-critical",
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {
                        "matchLabels": {"app.kubernetes.io/component": "controller"}
                    },
                }
            ],
        },
        "agent": {"priorityClassName": "system-node-critical"},
    },
    # The opt-in NetworkPolicies, the agent on the pod network so both are rendered.
    "network-policy": {
        "networkPolicy": {"enabled": True, "nodeCIDRs": ["10.0.0.0/16"]},
        "agent": {"hostNetwork": False},
    },
    # No cert-manager: the controller generates the CA and patches the webhook configurations.
    "self-signed-certs": {"webhook": {"certMode": "selfSigned"}},
    # prometheus-operator and the Grafana dashboard sidecar.
    "monitoring-on": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "dashboards": {"enabled": True, "annotations": {"grafana_folder": "inference-cache"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
        # The scrape authenticates (the binaries must accept --http-bearer-token-file).
        "agent": {"httpAuth": {"bearerTokenSecret": {"name": "agent-scrape"}}},
    },
    # The chart renders the (privileged) namespace itself.
    "namespace-create": {"namespace": {"create": True}},
    # The agent outside the host network namespace.
    "agent-pod-network": {"agent": {"hostNetwork": False}},
    # Only the controller.
    "agent-off": {"agent": {"enabled": False}},
    # No model cache: no model-cache flags besides --model-cache-enabled=false, RBAC, control
    # namespace or uninstall hook.
    "model-cache-off": {"modelCache": {"enabled": False}},
    # Every model-cache and engine-wiring value away from its default.
    "model-cache-custom": MODEL_CACHE_CUSTOM,
    # NVML and libcuda from the host's driver (no NVIDIA runtime), extra volumes on both parts.
    "driver-root-extra-volumes": {
        "agent": {
            "gpu": {"driverRoot": "/run/nvidia/driver", "driverLibDir": "/usr/lib64/"},
            "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
            "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/corp-ca", "readOnly": True}],
        },
        "controller": {
            "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
            "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/corp-ca", "readOnly": True}],
        },
    },
    # LookupRoute prompt_text tokenizers: a small one from a ConfigMap, a large one (over the
    # ConfigMap limit) from a PVC at a custom path.
    "tokenizers": {
        "controller": {
            "tokenizers": [
                {
                    "model": "sentence-transformers/all-MiniLM-L6-v2",
                    "volume": {"configMap": {"name": "minilm-tokenizer"}},
                },
                {
                    "model": "deepseek-ai/DeepSeek-V4-Flash",
                    "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                    "path": "deepseek-ai/DeepSeek-V4-Flash/tokenizer.json",
                },
            ],
            "tokenizerReloadSeconds": 30,
        }
    },
    # An existing cert-manager ClusterIssuer.
    "cluster-issuer": {
        "webhook": {
            "certManager": {
                "issuerRef": {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "ca"}
            }
        }
    },
}

# Every port set away from its default (for the "every port is configurable" test).
CUSTOM_PORTS: dict[str, Any] = {
    "controller": {
        "ports": {"grpc": 15051, "http": 18080, "health": 18081, "webhook": 19443},
        "service": {"grpc": {"port": 25051}, "metrics": {"port": 28080}, "webhook": {"port": 28443}},
    },
    "agent": {"ports": {"http": 19090, "metrics": 19091}},
}
DEFAULT_PORTS = (50051, 8080, 8081, 9443, 443, 9090, 9091)


@dataclass
class Rendered:
    """One rendering of the chart."""

    values: dict[str, Any]
    manifests: dict[str, str]  # template path -> rendered text (NOTES.txt included)
    objects: list[dict[str, Any]]  # every object, CRDs first

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    @property
    def notes(self) -> str:
        return next(v for k, v in self.manifests.items() if k.endswith("NOTES.txt"))


def is_hook(o: dict[str, Any]) -> bool:
    """A Helm hook (the `helm test` pods, the model-cache pre-delete hook)."""
    return "helm.sh/hook" in (o["metadata"].get("annotations") or {})


def hook_of(o: dict[str, Any]) -> str | None:
    """The object's `helm.sh/hook` annotation (None for an ordinary object)."""
    return (o["metadata"].get("annotations") or {}).get("helm.sh/hook")


@functools.lru_cache(maxsize=None)
def load_chart() -> helm.Chart:
    return helm.Chart.load(str(CHART_DIR))


def crd_objects() -> list[dict[str, Any]]:
    """The chart's crds/ files exactly as Helm ships them."""
    return [
        d
        for c in load_chart().crds
        for d in yaml.safe_load_all(c["data"])
        if d
    ]


def render(values: dict[str, Any], namespace: str = NAMESPACE, name: str = RELEASE) -> Rendered:
    chart = load_chart()
    manifests = chart.render(
        copy.deepcopy(values), name=name, namespace=namespace, is_install=True
    )
    objects = crd_objects()
    for path in sorted(manifests):
        if path.endswith(".txt"):
            continue
        objects.extend(d for d in yaml.safe_load_all(manifests[path]) if d)
    return Rendered(values=values, manifests=manifests, objects=objects)


@functools.lru_cache(maxsize=None)
def _render_variant(name: str) -> Rendered:
    return render(VARIANTS[name])


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> Rendered:
    return _render_variant(request.param)


@pytest.fixture
def default() -> Rendered:
    return _render_variant("default")


def variant_named(name: str) -> Rendered:
    return _render_variant(name)


def pod_specs(r: Rendered, include_hooks: bool = True) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) of every workload and bare pod."""
    out = []
    for o in r.objects:
        if not include_hooks and is_hook(o):
            continue
        if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
            out.append((o, o["spec"]["template"]["spec"]))
        elif o["kind"] == "CronJob":
            out.append((o, o["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            out.append((o, o["spec"]))
    return out


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])
