"""The rules the chart must keep (issue "Helm chart, images and operator docs")."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from conftest import (
    CHART_DIR,
    CUSTOM_PORTS,
    DEFAULT_PORTS,
    NAMESPACE,
    Rendered,
    containers,
    hook_of,
    is_hook,
    pod_specs,
    render,
    variant_named,
)

CONTROLLER = "inference-cache-controller"
AGENT = "inference-cache-agent"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*", "escalate", "bind", "impersonate"}


# ----------------------------------------------------------------------------- helpers


def tolerates(tolerations: list[dict[str, Any]], key: str, value: str, effect: str) -> bool:
    """Kubernetes' toleration matching (v1.Toleration.ToleratesTaint)."""
    for t in tolerations or []:
        if t.get("effect") and t["effect"] != effect:
            continue
        op = t.get("operator", "Equal")
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t["key"] != key:
            continue
        if op == "Exists" or (op == "Equal" and t.get("value", "") == value):
            return True
    return False


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env") or []}


def args_of(container: dict[str, Any]) -> dict[str, str]:
    """`--flag=value` arguments as a dict (`--flag` alone maps to "")."""
    out = {}
    for a in container.get("args") or []:
        if a.startswith("--"):
            k, _, v = a.partition("=")
            out[k] = v
    return out


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def rules_of(r: Rendered, kind: str, name: str) -> list[dict[str, Any]]:
    return r.one(kind, name).get("rules") or []


def grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str, tuple[str, ...]], set[str]]:
    out: dict[tuple[str, str, tuple[str, ...]], set[str]] = {}
    for rule in rules:
        for g in rule.get("apiGroups", []):
            for res in rule.get("resources", []):
                key = (g, res, tuple(rule.get("resourceNames") or ()))
                out.setdefault(key, set()).update(rule["verbs"])
    return out


def controller_deployment(r: Rendered) -> dict[str, Any]:
    return r.one("Deployment", CONTROLLER)


def agent_daemonset(r: Rendered) -> dict[str, Any]:
    return r.one("DaemonSet", AGENT)


def the_container(workload: dict[str, Any]) -> dict[str, Any]:
    cs = workload["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


# ----------------------------------------------------------------------------- chart metadata


def test_chart_metadata() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == "0.1.0"
    assert meta["kubeVersion"] == ">=1.29.0-0"
    # The icon URL points at the chart's own icon file, which must exist and be an SVG.
    assert meta["icon"].endswith("/main/chart/icon.svg")
    assert (CHART_DIR / "icon.svg").read_text().startswith("<svg ")


def test_image_tags_default_to_app_version(default: Rendered) -> None:
    assert the_container(controller_deployment(default))["image"].endswith("/ic-controller:0.1.0")
    assert the_container(agent_daemonset(default))["image"].endswith("/ic-agent:0.1.0")


def test_image_digest_wins_over_tag() -> None:
    digest = "sha256:" + "a" * 64
    r = render({"controller": {"image": {"tag": "9.9.9", "digest": digest}}})
    assert the_container(controller_deployment(r))["image"].endswith(f"/ic-controller@{digest}")


def test_no_latest_or_untagged_images(variant: Rendered) -> None:
    for obj, spec in pod_specs(variant):
        for c in containers(spec):
            image = c["image"]
            name = image.split("@")[0].rsplit("/", 1)[-1]
            assert "@sha256:" in image or ":" in name, f"{obj['metadata']['name']}: untagged {image}"
            assert not image.endswith(":latest"), f"{obj['metadata']['name']}: {image}"


# ----------------------------------------------------------------------------- probes, resources


def test_probes_on_every_long_running_container(variant: Rendered) -> None:
    """Every container of every workload has liveness and readiness probes (the `helm test` pods
    are one-shot checks and have none)."""
    for obj, spec in pod_specs(variant, include_hooks=False):
        for c in containers(spec):
            for probe in ("livenessProbe", "readinessProbe"):
                assert c.get(probe), f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}: no {probe}"


def test_resources_on_every_container(variant: Rendered) -> None:
    for obj, spec in pod_specs(variant):
        for c in containers(spec):
            res = c.get("resources") or {}
            assert res.get("requests", {}).get("memory"), f"{obj['metadata']['name']}/{c['name']}"
            assert res.get("limits", {}).get("memory"), f"{obj['metadata']['name']}/{c['name']}"


def test_probe_ports_are_served(variant: Rendered) -> None:
    """Controller probes use a named port of the container; agent probes use the --http-addr port."""
    c = the_container(controller_deployment(variant))
    names = {p["name"] for p in c["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] in names
    if not variant.values.get("agent", {}).get("enabled", True):
        return
    a = the_container(agent_daemonset(variant))
    http_addr = args_of(a)["--http-addr"]
    host, _, port = http_addr.rpartition(":")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = a[probe]["httpGet"]
        assert str(get["port"]) == port
        if agent_daemonset(variant)["spec"]["template"]["spec"].get("hostNetwork"):
            # The kubelet shares the host network namespace with a hostNetwork pod: it reaches
            # the agent's loopback listener only when told to.
            assert host == "127.0.0.1" and get["host"] == "127.0.0.1"
        else:
            assert "host" not in get and host == "$(POD_IP)"
    assert a["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert a["livenessProbe"]["httpGet"]["path"] == "/healthz"


# ----------------------------------------------------------------------------- controller


def test_controller_replicas_and_leader_election(default: Rendered) -> None:
    d = controller_deployment(default)
    assert d["spec"]["replicas"] == 2
    args = args_of(the_container(d))
    assert args["--leader-election-namespace"] == "$(POD_NAMESPACE)"
    assert args["--leader-election-lease-name"] == "inference-cache-controller"
    env = env_of(the_container(d))
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    role = default.one("Role", CONTROLLER)
    g = grants(role["rules"])
    assert ("coordination.k8s.io", "leases", ()) not in g
    assert g[("coordination.k8s.io", "leases", ("inference-cache-controller",))] == {"get", "update"}
    # The chart creates the Lease (helm uninstall deletes it): empty spec, a free Lease.
    lease = default.one("Lease", "inference-cache-controller")
    assert lease["metadata"]["namespace"] == NAMESPACE and lease["spec"] == {}


def test_controller_flags(default: Rendered) -> None:
    args = args_of(the_container(controller_deployment(default)))
    assert the_container(controller_deployment(default))["args"][0] == "run"
    assert args["--grpc-addr"] == "0.0.0.0:50051"
    assert args["--http-addr"] == "0.0.0.0:8080"
    assert args["--webhook-addr"] == "0.0.0.0:9443"
    assert args["--webhook-cert-dir"] == "/etc/inference-cache/webhook"
    assert "--webhook-self-signed" not in args
    assert args["--agent-service-account"] == f"{NAMESPACE}:{AGENT}"
    assert args["--token-audience"] == "inference-cache"
    assert args["--log-format"] == "json"


def test_controller_pdb_and_anti_affinity(variant: Rendered) -> None:
    d = controller_deployment(variant)
    pdb = variant.one("PodDisruptionBudget", CONTROLLER)
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    assert labels_match(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert pdb["spec"]["maxUnavailable"] == 1
    anti = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    hard = variant.values.get("controller", {}).get("podAntiAffinity") == "hard"
    if hard:
        term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
    else:
        term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert labels_match(term["labelSelector"]["matchLabels"], pod_labels)


def test_ha_variant() -> None:
    r = variant_named("ha")
    d = controller_deployment(r)
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["template"]["spec"]["priorityClassName"] == "system-cluster-critical"
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert agent_daemonset(r)["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"


def _restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Pod Security Standards, restricted profile (v1.29+), for one pod spec."""
    v = []
    psc = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            v.append(field)
    allowed_volumes = {
        "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
        "projected", "secret",
    }
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= allowed_volumes:
            v.append(f"volume {vol['name']}: {kinds}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for c in containers(spec):
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            v.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            v.append(f"{name}: allowPrivilegeEscalation")
        if not (sc.get("runAsNonRoot") or (psc.get("runAsNonRoot") and sc.get("runAsNonRoot") is not False)):
            v.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            v.append(f"{name}: runAsUser 0")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            v.append(f"{name}: capabilities.drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            v.append(f"{name}: capabilities.add")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            v.append(f"{name}: seccompProfile")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                v.append(f"{name}: hostPort")
    return v


def test_controller_is_restricted_psa_compliant(variant: Rendered) -> None:
    spec = controller_deployment(variant)["spec"]["template"]["spec"]
    assert _restricted_violations(spec) == []
    sc = the_container(controller_deployment(variant))["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"


def test_restricted_checker_catches_the_agent(default: Rendered) -> None:
    """The restricted checker is not vacuous: the agent (hostPID, root, three capabilities) fails it."""
    v = _restricted_violations(agent_daemonset(default)["spec"]["template"]["spec"])
    assert "hostPID" in v and "agent: capabilities.add" in v and "agent: runAsUser 0" in v


def test_controller_grpc_test_pod_is_restricted(variant: Rendered) -> None:
    pod = variant.one("Pod", "inference-cache-test-controller-grpc")
    assert _restricted_violations(pod["spec"]) == []


# ----------------------------------------------------------------------------- services


def test_services_select_their_pods(variant: Rendered) -> None:
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in variant.objects if o["kind"] in ("Deployment", "DaemonSet")}
    for svc in variant.of_kind("Service"):
        matched = [
            t for t in pods.values() if labels_match(svc["spec"]["selector"], t["metadata"]["labels"])
        ]
        assert matched, f"Service {svc['metadata']['name']} selects no pods"
        for t in matched:
            port_names = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports") or []}
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in port_names, (svc["metadata"]["name"], p)


def test_services_for_grpc_metrics_and_webhooks(default: Rendered) -> None:
    grpc = default.one("Service", CONTROLLER)["spec"]["ports"]
    assert [(p["name"], p["port"], p.get("appProtocol")) for p in grpc] == [("grpc", 50051, "grpc")]
    metrics = default.one("Service", f"{CONTROLLER}-metrics")["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in metrics] == [("http-metrics", 8080)]
    webhook = default.one("Service", "inference-cache-webhook")["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in webhook] == [(443, "webhook")]


def test_agent_reaches_every_controller_replica_through_the_headless_service(default: Rendered) -> None:
    """Each controller replica serves LookupRoute from its own index, so the agent streams to
    every replica: its URL names a headless Service selecting the controller pods, on the
    container's gRPC port (the DNS answer is pod IPs)."""
    url = args_of(the_container(agent_daemonset(default)))["--controller"]
    assert url == f"http://{CONTROLLER}-agents.{NAMESPACE}.svc:50051"
    svc = default.one("Service", f"{CONTROLLER}-agents")
    assert svc["spec"]["clusterIP"] == "None"
    pod_labels = controller_deployment(default)["spec"]["template"]["metadata"]["labels"]
    assert labels_match(svc["spec"]["selector"], pod_labels)
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["grpc"]


# ----------------------------------------------------------------------------- agent


def test_agent_daemonset(default: Rendered) -> None:
    ds = agent_daemonset(default)
    spec = ds["spec"]["template"]["spec"]
    c = the_container(ds)
    assert spec["hostPID"] is True
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["automountServiceAccountToken"] is False
    assert c["securityContext"]["privileged"] is False
    assert spec["priorityClassName"] == "system-node-critical"
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    assert c["resources"] == {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}
    assert c["args"][0] == "run"
    args = args_of(c)
    assert args["--http-addr"] == "127.0.0.1:9090"
    assert args["--metrics-addr"] == "$(POD_IP):9091"
    assert args["--token-file"] == "/var/run/secrets/inference-cache/token"
    assert args["--log-format"] == "json"
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # `kubectl exec … -- ic-agent check` reads these from the pod's environment.
    assert env["IC_PROC_ROOT"]["value"] == "/host/proc"
    assert env["IC_SHM_PATH"]["value"] == "/host/dev/shm"


def test_agent_host_mounts_are_read_only(variant: Rendered) -> None:
    if not variant.values.get("agent", {}).get("enabled", True):
        return
    ds = agent_daemonset(variant)
    spec = ds["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    # The one writable host path is the agent's own KV stream state, under /var/lib/inference-cache.
    state = host_paths.pop("kv-state")
    assert state == "/var/lib/inference-cache/agent"
    driver = host_paths.pop("nvidia-driver", None)
    assert driver == variant.values.get("agent", {}).get("gpu", {}).get("driverRoot")
    pods_dir = variant.values.get("agent", {}).get("hostPaths", {}).get("kubeletPodsDir")
    assert set(host_paths.values()) == {"/proc", "/sys", "/dev/shm"} | ({pods_dir} if pods_dir else set())
    mounts = {m["name"]: m for m in the_container(ds)["volumeMounts"]}
    for name in host_paths:
        assert mounts[name].get("readOnly") is True, name
    assert mounts["kv-state"]["mountPath"] == state and not mounts["kv-state"].get("readOnly")
    assert args_of(the_container(ds))["--state-dir"] == state
    assert mounts["host-proc"]["mountPath"] == "/host/proc"
    if pods_dir:
        assert mounts["kubelet-pods"]["mountPropagation"] == "HostToContainer"


def test_agent_projected_token(variant: Rendered) -> None:
    if not variant.values.get("agent", {}).get("enabled", True):
        return
    ds = agent_daemonset(variant)
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    src = vols["controller-token"]["projected"]["sources"]
    assert src == [{"serviceAccountToken": {"audience": "inference-cache", "expirationSeconds": 3600, "path": "token"}}]
    mounts = {m["name"]: m for m in the_container(ds)["volumeMounts"]}
    assert mounts["controller-token"]["mountPath"] == "/var/run/secrets/inference-cache"
    token_file = args_of(the_container(ds))["--token-file"]
    assert token_file == mounts["controller-token"]["mountPath"] + "/token"


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute", "PreferNoSchedule"])
def test_gpu_taint_tolerated(default: Rendered, effect: str) -> None:
    spec = agent_daemonset(default)["spec"]["template"]["spec"]
    assert tolerates(spec["tolerations"], "nvidia.com/gpu", "present", effect)
    assert tolerates(spec["tolerations"], "nvidia.com/gpu", "", effect)
    # The agent /readyz test pod lands where agents run.
    test_pod = default.one("Pod", "inference-cache-test-agent-readyz")
    assert tolerates(test_pod["spec"]["tolerations"], "nvidia.com/gpu", "present", effect)
    env = env_of(the_container(agent_daemonset(default)))
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "runtimeClassName" not in spec
    assert "affinity" not in spec


def test_gpu_off() -> None:
    r = variant_named("gpu-off")
    spec = agent_daemonset(r)["spec"]["template"]["spec"]
    assert not tolerates(spec.get("tolerations"), "nvidia.com/gpu", "present", "NoSchedule")
    env = env_of(the_container(agent_daemonset(r)))
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert "runtimeClassName" not in spec


def test_driver_root_and_extra_volumes() -> None:
    r = variant_named("driver-root-extra-volumes")
    ds = agent_daemonset(r)
    c = the_container(ds)
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert vols["nvidia-driver"]["hostPath"] == {"path": "/run/nvidia/driver", "type": "Directory"}
    assert mounts["nvidia-driver"] == {"name": "nvidia-driver", "mountPath": "/host/driver", "readOnly": True}
    env = env_of(c)
    assert env["IC_NVML_LIBRARY"]["value"] == "/host/driver/usr/lib64/libnvidia-ml.so.1"
    assert env["IC_CUDA_LIBRARY"]["value"] == "/host/driver/usr/lib64/libcuda.so.1"
    assert "LD_LIBRARY_PATH" not in env
    assert vols["ca"] == {"name": "ca", "configMap": {"name": "corp-ca"}}
    assert mounts["ca"]["mountPath"] == "/etc/corp-ca"
    dep = r.one("Deployment", CONTROLLER)
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "ca", "mountPath": "/etc/corp-ca", "readOnly": True} in the_container(dep)["volumeMounts"]
    # Off by default, and with the GPU off.
    for r in (variant_named("default"), render({"agent": {"gpu": {"enabled": False, "driverRoot": "/"}}})):
        c = the_container(agent_daemonset(r))
        assert "IC_NVML_LIBRARY" not in env_of(c)
        assert "nvidia-driver" not in {m["name"] for m in c["volumeMounts"]}


def test_tokenizers_are_mounted_and_passed_per_model() -> None:
    r = variant_named("tokenizers")
    dep = r.one("Deployment", CONTROLLER)
    c = the_container(dep)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert vols["tokenizer-0"] == {"name": "tokenizer-0", "configMap": {"name": "minilm-tokenizer"}}
    assert vols["tokenizer-1"] == {
        "name": "tokenizer-1",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    for i in (0, 1):
        assert mounts[f"tokenizer-{i}"] == {
            "name": f"tokenizer-{i}",
            "mountPath": f"/etc/inference-cache/tokenizers/{i}",
            "readOnly": True,
        }
    assert "--tokenizer=sentence-transformers/all-MiniLM-L6-v2=/etc/inference-cache/tokenizers/0/tokenizer.json" in c["args"]
    assert (
        "--tokenizer=deepseek-ai/DeepSeek-V4-Flash=/etc/inference-cache/tokenizers/1/deepseek-ai/DeepSeek-V4-Flash/tokenizer.json"
        in c["args"]
    )
    assert "--tokenizer-reload-seconds=30" in c["args"]
    # None by default: no flag, no volume.
    c = the_container(variant_named("default").one("Deployment", CONTROLLER))
    assert not [a for a in c["args"] if a.startswith("--tokenizer")]
    assert not [m for m in c["volumeMounts"] if m["name"].startswith("tokenizer-")]


def test_gpu_runtime_class_with_node_affinity() -> None:
    r = variant_named("gpu-runtimeclass")
    spec = agent_daemonset(r)["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]
    assert "NOTE: agent.gpu.runtimeClassName" not in r.notes


def test_runtime_class_without_affinity_is_flagged_in_notes() -> None:
    r = render({"agent": {"gpu": {"runtimeClassName": "nvidia"}}})
    assert "agent.gpu.nodeAffinity.enabled=true" in r.notes


def test_agent_pod_network_variant() -> None:
    r = variant_named("agent-pod-network")
    spec = agent_daemonset(r)["spec"]["template"]["spec"]
    assert "hostNetwork" not in spec and "dnsPolicy" not in spec
    assert args_of(the_container(agent_daemonset(r)))["--http-addr"] == "$(POD_IP):9090"
    assert not [p for p in r.of_kind("Pod") if p["metadata"]["name"].endswith("agent-readyz")]


def test_agent_pod_network_on_ipv6_brackets_the_pod_ip() -> None:
    """`$(POD_IP):9090` with an IPv6 pod IP is no socket address: the IPv6 setting of
    metricsBindAddress brackets --http-addr too."""
    r = render({"agent": {"hostNetwork": False, "metricsBindAddress": "[$(POD_IP)]"}})
    args = args_of(the_container(agent_daemonset(r)))
    assert args["--http-addr"] == "[$(POD_IP)]:9090"
    assert args["--metrics-addr"] == "[$(POD_IP)]:9091"


def test_agent_off_renders_no_agent() -> None:
    r = variant_named("agent-off")
    assert r.of_kind("DaemonSet") == []
    assert [o["metadata"]["name"] for o in r.of_kind("ServiceAccount") if not is_hook(o)] == [CONTROLLER]


# ----------------------------------------------------------------------------- RBAC


def _subjects_include(binding: dict[str, Any], namespace: str, name: str) -> bool:
    for s in binding.get("subjects") or []:
        if s["kind"] == "ServiceAccount" and s["name"] == name and s.get("namespace") == namespace:
            return True
        if s["kind"] == "Group" and s["name"] in (
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        ):
            return True
    return False


def agent_bindings(r: Rendered) -> list[tuple[str, dict[str, Any]]]:
    """(binding name, rule) for every rule bound to the agent's service account, directly or
    through a group that contains it."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in r.of_kind("Role") + r.of_kind("ClusterRole")
    }
    out = []
    for b in r.of_kind("RoleBinding") + r.of_kind("ClusterRoleBinding"):
        if not _subjects_include(b, NAMESPACE, AGENT):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], ns, ref["name"]), {"rules": [{"verbs": ["*"]}]})
        out.extend((b["metadata"]["name"], rule) for rule in role.get("rules") or [])
    return out


def test_agent_service_account_has_no_write_verbs(variant: Rendered) -> None:
    """No Role/ClusterRole bound to the agent's service account (directly or through a group)
    grants a write verb; in fact nothing is bound to it at all."""
    writes = [(b, rule) for b, rule in agent_bindings(variant) if set(rule["verbs"]) & WRITE_VERBS]
    assert writes == []
    assert agent_bindings(variant) == []
    for sa in variant.of_kind("ServiceAccount"):
        if sa["metadata"]["name"] == AGENT:
            assert sa["automountServiceAccountToken"] is False


def test_agent_binding_check_is_not_vacuous(default: Rendered) -> None:
    extra = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "sneaky"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CONTROLLER},
            "subjects": [{"kind": "Group", "name": f"system:serviceaccounts:{NAMESPACE}"}],
        }
    ]
    r = Rendered(values={}, manifests=default.manifests, objects=default.objects + extra)
    assert any(set(rule["verbs"]) & WRITE_VERBS for _, rule in agent_bindings(r))


def test_controller_cluster_role_is_exact(variant: Rendered) -> None:
    self_signed = variant.values.get("webhook", {}).get("certMode") == "selfSigned"
    read = {"get", "list", "watch"}
    owned = {"list", "watch", "create", "patch", "delete"}
    expected = {
        ("inferencecache.io", "cachebackends", ()): read,
        ("inferencecache.io", "cachepolicies", ()): {"list", "watch"},
        ("inferencecache.io", "cachetenants", ()): {"list", "watch"},
        ("inferencecache.io", "cachebackends/status", ()): {"update", "patch"},
        ("inferencecache.io", "cachepolicies/status", ()): {"patch"},
        ("inferencecache.io", "cachetenants/status", ()): {"patch"},
        ("inferencecache.io", "cachebackends/finalizers", ()): {"update"},
        ("inferencecache.io", "cacheindexes", ()): {"get", "create"},
        ("inferencecache.io", "cachenodes", ()): {"get", "create"},
        ("inferencecache.io", "cacheindexes/status", ()): {"patch"},
        ("inferencecache.io", "cachenodes/status", ()): {"patch"},
        ("", "pods", ()): read,
        ("apps", "deployments", ()): owned,
        ("apps", "statefulsets", ()): owned,
        ("", "services", ()): owned,
        ("autoscaling", "horizontalpodautoscalers", ()): owned,
        ("events.k8s.io", "events", ()): {"create", "patch"},
        ("authentication.k8s.io", "tokenreviews", ()): {"create"},
        ("authorization.k8s.io", "subjectaccessreviews", ()): {"create"},
    }
    if self_signed:
        for res in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            expected[("admissionregistration.k8s.io", res, ("inference-cache",))] = {"get", "update"}
    assert grants(rules_of(variant, "ClusterRole", CONTROLLER)) == expected
    binding = variant.one("ClusterRoleBinding", CONTROLLER)
    assert binding["roleRef"]["name"] == CONTROLLER
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": NAMESPACE}]


def test_controller_role_is_namespaced(variant: Rendered) -> None:
    """The release-namespace Role: the leader Lease (get and update by name; the chart creates
    it); the self-signed webhook Secret (get and update by name, create); the catalog ConfigMap (get by
    name) while the model cache is on."""
    role = variant.one("Role", CONTROLLER)
    assert role["metadata"]["namespace"] == NAMESPACE
    expected = {
        ("coordination.k8s.io", "leases", ("inference-cache-controller",)): {"get", "update"},
    }
    if variant.values.get("webhook", {}).get("certMode") == "selfSigned":
        expected[("", "secrets", ("inference-cache-webhook-self-signed",))] = {"get", "update"}
        expected[("", "secrets", ())] = {"create"}
    mc = variant.values.get("modelCache", {})
    if mc.get("enabled", True):
        catalog = mc.get("catalog", {}).get("name") or "inference-cache-storage-capabilities"
        expected[("", "configmaps", (catalog,))] = {"get"}
    assert grants(role["rules"]) == expected
    rb = variant.one("RoleBinding", CONTROLLER)
    assert rb["metadata"]["namespace"] == NAMESPACE
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": NAMESPACE}]


def test_secrets_access_is_scoped(variant: Rendered) -> None:
    """No ClusterRole touches Secrets, nothing lists or watches them, and no rule uses `*`. Secrets
    appear only in the release-namespace Role (self-signed webhook mode: get and update by name
    (certificate rotation), create) and
    in the model-cache control-namespace Role (key Secrets: get, delete; create with encryption)."""
    mc = variant.values.get("modelCache", {})
    control_ns = mc.get("controlNamespace") or "inference-cache-model-cache"
    for role in variant.of_kind("Role") + variant.of_kind("ClusterRole"):
        for rule in role.get("rules") or []:
            assert "*" not in rule.get("resources", []) and "*" not in rule["verbs"], role["metadata"]["name"]
            assert "*" not in rule.get("apiGroups", [])
            if "secrets" not in rule.get("resources", []):
                continue
            where = (role["kind"], role["metadata"].get("namespace"), role["metadata"]["name"])
            assert not set(rule["verbs"]) & {"list", "watch", "patch", "deletecollection"}, where
            if where == ("Role", NAMESPACE, CONTROLLER):
                assert variant.values.get("webhook", {}).get("certMode") == "selfSigned"
                # update only by name: the rotation's write of the one webhook Secret.
                assert (rule["verbs"], rule.get("resourceNames")) in (
                    (["get", "update"], ["inference-cache-webhook-self-signed"]),
                    (["create"], None),
                )
            else:
                assert "update" not in rule["verbs"], where
                assert where == ("Role", control_ns, f"{CONTROLLER}-model-cache"), where
                # create only with the ModelCacheEncryption gate (key Secrets); get and delete
                # release what an encrypted cache owned, also after the gate was turned off.
                assert rule["verbs"] in (["get", "delete"], ["get", "delete", "create"]), rule["verbs"]


def test_secrets_check_is_not_vacuous() -> None:
    """Self-signed mode and the model cache both grant Secrets, where the test above expects them."""
    r = variant_named("self-signed-certs")
    seen = {
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in r.of_kind("Role")
        if any("secrets" in rule.get("resources", []) for rule in o["rules"])
    }
    assert seen == {(NAMESPACE, CONTROLLER), ("inference-cache-model-cache", f"{CONTROLLER}-model-cache")}


# ----------------------------------------------------------------------------- webhooks


def _webhooks(r: Rendered) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for cfg in r.of_kind(kind):
            for w in cfg["webhooks"]:
                out[w["name"]] = w
    return out


def test_webhook_failure_policies(variant: Rendered) -> None:
    hooks = _webhooks(variant)
    assert set(hooks) == {"mpod.inferencecache.io", "mcachebackend.inferencecache.io", "vcachebackend.inferencecache.io"}
    assert hooks["mpod.inferencecache.io"]["failurePolicy"] == "Ignore"
    assert hooks["mcachebackend.inferencecache.io"]["failurePolicy"] == "Fail"
    assert hooks["vcachebackend.inferencecache.io"]["failurePolicy"] == "Fail"
    for w in hooks.values():
        assert w["sideEffects"] == "None"
        assert w["admissionReviewVersions"] == ["v1"]
    paths = {n: w["clientConfig"]["service"]["path"] for n, w in hooks.items()}
    assert paths == {
        "mpod.inferencecache.io": "/mutate-pod",
        "mcachebackend.inferencecache.io": "/mutate-cachebackend",
        "vcachebackend.inferencecache.io": "/validate-cachebackend",
    }


def test_pod_webhook_scope(default: Rendered) -> None:
    w = _webhooks(default)["mpod.inferencecache.io"]
    assert w["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}]
    ns_exprs = w["namespaceSelector"]["matchExpressions"]
    assert ns_exprs[0]["key"] == "kubernetes.io/metadata.name" and ns_exprs[0]["operator"] == "NotIn"
    assert {"kube-system", NAMESPACE} <= set(ns_exprs[0]["values"])
    assert w["objectSelector"]["matchExpressions"] == [{"key": "inferencecache.io/webhook", "operator": "NotIn", "values": ["disabled"]}]
    assert w["timeoutSeconds"] <= 10
    # The chart's own test pods carry the opt-out label.
    for pod in default.of_kind("Pod"):
        assert pod["metadata"]["labels"]["inferencecache.io/webhook"] == "disabled"


def test_pod_webhook_opt_in_namespaces() -> None:
    r = render({"webhook": {"pod": {"namespaceSelector": {"matchLabels": {"inferencecache.io/inject": "enabled"}}}}})
    sel = _webhooks(r)["mpod.inferencecache.io"]["namespaceSelector"]
    assert sel["matchLabels"] == {"inferencecache.io/inject": "enabled"}
    assert sel["matchExpressions"][0]["key"] == "kubernetes.io/metadata.name"


def test_pod_webhook_can_be_disabled() -> None:
    r = render({"webhook": {"pod": {"enabled": False}}})
    assert set(_webhooks(r)) == {"mcachebackend.inferencecache.io", "vcachebackend.inferencecache.io"}


def test_webhooks_call_the_webhook_service(variant: Rendered) -> None:
    svc = variant.one("Service", "inference-cache-webhook")
    for w in _webhooks(variant).values():
        ref = w["clientConfig"]["service"]
        assert (ref["name"], ref["namespace"], ref["port"]) == (
            svc["metadata"]["name"],
            svc["metadata"]["namespace"],
            svc["spec"]["ports"][0]["port"],
        )
        assert "caBundle" not in w["clientConfig"]


def test_cert_manager_mode(default: Rendered) -> None:
    cert = default.one("Certificate")
    issuer = default.one("Issuer")
    assert cert["spec"]["issuerRef"] == {"group": "cert-manager.io", "kind": "Issuer", "name": issuer["metadata"]["name"]}
    assert "inference-cache-webhook.inference-cache.svc" in cert["spec"]["dnsNames"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        ann = default.one(kind)["metadata"]["annotations"]
        assert ann["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{cert['metadata']['name']}"
    d = controller_deployment(default)
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert vols["webhook-cert"]["secret"]["secretName"] == cert["spec"]["secretName"]
    mounts = {m["name"]: m for m in the_container(d)["volumeMounts"]}
    assert mounts["webhook-cert"]["mountPath"] == args_of(the_container(d))["--webhook-cert-dir"]
    assert "subPath" not in mounts["webhook-cert"]  # subPath mounts never see a renewed certificate


def test_cluster_issuer() -> None:
    r = variant_named("cluster-issuer")
    assert r.of_kind("Issuer") == []
    assert r.one("Certificate")["spec"]["issuerRef"] == {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "ca"}


def test_self_signed_mode() -> None:
    r = variant_named("self-signed-certs")
    assert r.of_kind("Certificate") == [] and r.of_kind("Issuer") == []
    c = the_container(controller_deployment(r))
    args = args_of(c)
    assert "--webhook-self-signed" in args and "--webhook-cert-dir" not in args
    # Both configurations carry the one name the controller patches the CA into, and the
    # ClusterRole may get and update (PUT, admission/ca_bundle/webhook_config.rs) exactly those two objects.
    names = set()
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        cfg = r.one(kind)
        assert cfg["metadata"]["name"] == args["--webhook-config-name"]
        names.add(cfg["metadata"]["name"])
        assert "cert-manager.io/inject-ca-from" not in (cfg["metadata"].get("annotations") or {})
    g = grants(rules_of(r, "ClusterRole", CONTROLLER))
    for res in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        assert g[("admissionregistration.k8s.io", res, tuple(names))] == {"get", "update"}
    # The certificate's DNS names come from the webhook Service the API server calls.
    svc = r.one("Service", args["--webhook-service"])
    for w in _webhooks(r).values():
        assert w["clientConfig"]["service"]["name"] == svc["metadata"]["name"]
    # The replicas share one CA + serving pair through this Secret: get and update (rotation) by
    # name, create.
    secret = args["--webhook-tls-secret"]
    assert secret == "inference-cache-webhook-self-signed"
    role = grants(r.one("Role", CONTROLLER)["rules"])
    assert role[("", "secrets", (secret,))] == {"get", "update"}
    assert role[("", "secrets", ())] == {"create"}
    assert "webhook-cert" not in {m["name"] for m in c["volumeMounts"]}


def test_cert_manager_mode_has_no_self_signed_flags(default: Rendered) -> None:
    args = args_of(the_container(controller_deployment(default)))
    for flag in ("--webhook-self-signed", "--webhook-config-name", "--webhook-service", "--webhook-tls-secret"):
        assert flag not in args


# ----------------------------------------------------------------------------- ports


def _rendered_text(r: Rendered) -> str:
    """The rendered templates, less the CRD upgrade hook's copy of crds/ (CRD text, whose
    examples name default ports, is not configuration)."""
    return "\n".join(v for k, v in r.manifests.items()
                     if not k.endswith(".txt") and not k.endswith("crd-upgrade-hook.yaml"))


def test_every_port_is_configurable() -> None:
    """With every port value changed, no default port number is left anywhere in the manifests
    (container ports, Services, probes, flags, webhook client configs, test pods)."""
    r = render(CUSTOM_PORTS)
    text = _rendered_text(r)
    for port in DEFAULT_PORTS:
        assert not re.search(rf"(?<![\d.]){port}(?![\d.])", text), f"port {port} is hard-coded"
    c = the_container(controller_deployment(r))
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": 15051,
        "http": 18080,
        "health": 18081,
        "webhook": 19443,
    }
    a = the_container(agent_daemonset(r))
    assert args_of(a)["--http-addr"] == "127.0.0.1:19090"
    assert args_of(a)["--metrics-addr"] == "$(POD_IP):19091"
    assert args_of(a)["--controller"].endswith(":15051")
    # The defaults do appear in the default rendering (the search above is meaningful).
    default_text = _rendered_text(variant_named("default"))
    for port in DEFAULT_PORTS:
        assert re.search(rf"(?<![\d.]){port}(?![\d.])", default_text), port


def test_ipv6_bind_address() -> None:
    r = render({"controller": {"bindAddress": "::"}})
    assert args_of(the_container(controller_deployment(r)))["--grpc-addr"] == "[::]:50051"


# ----------------------------------------------------------------------------- namespace


def test_namespace_only_when_asked(default: Rendered) -> None:
    # By default the only Namespace rendered is the model-cache control namespace.
    assert [n["metadata"]["name"] for n in default.of_kind("Namespace")] == ["inference-cache-model-cache"]
    ns = variant_named("namespace-create").one("Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert ns["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


# ----------------------------------------------------------------------------- monitoring


def test_agent_http_auth_is_opt_in_and_the_pod_monitor_presents_the_token(default: Rendered) -> None:
    """agent.httpAuth.bearerTokenSecret: the agent reads the Secret's key as its token file, and
    the PodMonitor sends the same key; unset, nothing of it renders."""
    assert not any(a.startswith("--http-bearer-token-file") for a in the_container(agent_daemonset(default))["args"])
    r = render({
        "agent": {"httpAuth": {"bearerTokenSecret": {"name": "agent-scrape", "key": "tok"}}},
        "monitoring": {"podMonitor": {"enabled": True}},
    })
    ds = agent_daemonset(r)
    c = the_container(ds)
    assert "--http-bearer-token-file=/etc/inference-cache/agent-http-auth/tok" in c["args"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "http-auth"]
    assert mount["readOnly"] is True and mount["mountPath"] == "/etc/inference-cache/agent-http-auth"
    (vol,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "http-auth"]
    assert vol["secret"] == {"secretName": "agent-scrape", "items": [{"key": "tok", "path": "tok"}]}
    ep = r.one("PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": "agent-scrape", "key": "tok"}}


def dashboard_configmaps(r: Rendered) -> list[dict[str, Any]]:
    """ConfigMaps carrying the Grafana sidecar label (the catalog ConfigMap is not one)."""
    return [c for c in r.of_kind("ConfigMap") if "grafana_dashboard" in c["metadata"].get("labels", {})]


def test_monitoring_off_by_default(default: Rendered) -> None:
    for kind in ("ServiceMonitor", "PodMonitor"):
        assert default.of_kind(kind) == []
    assert dashboard_configmaps(default) == []


def test_monitoring_on() -> None:
    r = variant_named("monitoring-on")
    sm = r.one("ServiceMonitor")
    svc = r.one("Service", f"{CONTROLLER}-metrics")
    assert labels_match(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The selector picks only the metrics Service, not the gRPC or webhook ones.
    for other in r.of_kind("Service"):
        if other is not svc:
            assert not labels_match(sm["spec"]["selector"]["matchLabels"], other["metadata"]["labels"])
    pm = r.one("PodMonitor")
    ds = agent_daemonset(r)
    assert labels_match(pm["spec"]["selector"]["matchLabels"], ds["spec"]["template"]["metadata"]["labels"])
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert ep["port"] in {p["name"] for p in the_container(ds)["ports"]}
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"} in ep["relabelings"]
    dashboards = dashboard_configmaps(r)
    assert sorted(cm["metadata"]["name"] for cm in dashboards) == [
        "inference-cache-dashboard-cache-index",
        "inference-cache-dashboard-node-health",
    ]
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "inference-cache"
        (key, body), = cm["data"].items()
        assert json.loads(body) == json.loads((CHART_DIR / "dashboards" / key).read_text())


# ----------------------------------------------------------------------------- helm test, NOTES


def test_helm_test_hooks(default: Rendered) -> None:
    # Besides `helm test`, the only hooks are the model-cache uninstall hook's (pre-delete) and
    # the CRD upgrade hook's (pre-upgrade).
    assert {hook_of(o) for o in default.objects if is_hook(o)} == {"test", "pre-delete", "pre-upgrade"}
    tests = [o for o in default.objects if hook_of(o) == "test"]
    assert {o["metadata"]["name"] for o in tests} == {
        "inference-cache-test-controller-grpc",
        "inference-cache-test-agent-readyz",
    }
    for t in tests:
        assert t["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert t["spec"]["restartPolicy"] == "Never"
    grpc = the_pod_container(default.one("Pod", "inference-cache-test-controller-grpc"))
    assert grpc["image"].startswith("ghcr.io/grpc-ecosystem/grpc-health-probe:v")
    assert f"-addr={CONTROLLER}.{NAMESPACE}.svc:50051" in grpc["args"]
    readyz_pod = default.one("Pod", "inference-cache-test-agent-readyz")
    assert readyz_pod["spec"]["hostNetwork"] is True
    assert "http://127.0.0.1:9090/readyz" in " ".join(the_pod_container(readyz_pod)["command"])


def test_crd_upgrade_hook(default: Rendered) -> None:
    """helm upgrade applies the new CRDs first (Helm never upgrades crds/): `ic-controller
    upgrade-crds --crds-dir` over this chart's own crds/ files (a hook ConfigMap, byte for byte),
    allowed to read and apply exactly the chart's CRDs by name."""
    name = "inference-cache-upgrade-crds"
    hook = [o for o in default.objects if hook_of(o) == "pre-upgrade"]
    assert {(o["kind"], o["metadata"]["name"]) for o in hook} == {
        ("ServiceAccount", name), ("ClusterRole", name), ("ClusterRoleBinding", name), ("ConfigMap", name),
        ("Job", name),
    }
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hook}
    assert weights["Job"] > max(w for k, w in weights.items() if k != "Job"), "RBAC and CRDs must exist before the Job"
    job = default.one("Job", name)
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["args"] == ["upgrade-crds", "--crds-dir=/etc/inference-cache/crds", "--log-format=json"]
    # The CRDs are the chart's files, not the image's: whatever controller.image.tag is pinned.
    cm = default.one("ConfigMap", name)
    files = {p.name: p.read_text() for p in (CHART_DIR / "crds").glob("*.yaml")}
    assert {k: v.rstrip("\n") for k, v in cm["data"].items()} == {k: v.rstrip("\n") for k, v in files.items()}
    assert len(json.dumps(cm["data"])) < 1024 * 1024 * 0.8, "near the 1 MiB ConfigMap limit"
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == "/etc/inference-cache/crds" and mount["readOnly"] is True
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["configMap"]["name"] == name
    # The new release's controller image: its CRDs are the ones it serves.
    ctrl = default.one("Deployment", CONTROLLER)["spec"]["template"]["spec"]["containers"]
    assert c["image"] in {x["image"] for x in ctrl}
    crd_names = {p.name.removesuffix(".yaml") for p in (CHART_DIR / "crds").glob("*.yaml")}
    role = default.one("ClusterRole", name)
    by_verb = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["apiextensions.k8s.io"] and rule["resources"] == ["customresourcedefinitions"]
        for v in rule["verbs"]:
            by_verb[v] = set(rule.get("resourceNames", []))
    assert by_verb == {"get": crd_names, "patch": crd_names, "create": set()}
    off = render({"crds": {"upgradeHook": {"enabled": False}}})
    assert not [o for o in off.objects if hook_of(o) == "pre-upgrade"]


def the_pod_container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod["spec"]["containers"]
    return c


def test_notes_have_the_commands(variant: Rendered) -> None:
    notes = variant.notes
    assert "kubectl get cachebackends --all-namespaces" in notes
    assert "kubectl get cachenodes" in notes
    assert f"helm test inference-cache -n {NAMESPACE}" in notes
    agent = variant.values.get("agent", {})
    if agent.get("enabled", True):
        assert "-- ic-agent check" in notes
        if agent.get("hostNetwork", True):
            # The agent's endpoints are on the node's loopback, which port-forward reaches.
            assert "port-forward pod/$POD 9090:9090" in notes
            assert "http://<node-ip>:9091/metrics" in notes
        else:
            # On the pod IP only: port-forward (which dials the pod's loopback) cannot reach them.
            assert "port-forward pod/$POD" not in notes
            assert f'kubectl get --raw "/api/v1/namespaces/{NAMESPACE}/pods/$POD:9090/proxy/v1/report"' in notes
            assert "http://<pod-ip>:9091/metrics" in notes
    assert "{{" not in notes and "<no value>" not in notes


KIND_REF = re.compile(
    r"(?:-n|--namespace)[ =]([a-z0-9-]+)[^\n]*?\b"
    r"(deployment|daemonset|certificate|service|job|configmap|secret)/([a-z0-9][a-z0-9.-]*)\b"
)
KINDS = {
    "deployment": "Deployment",
    "daemonset": "DaemonSet",
    "certificate": "Certificate",
    "service": "Service",
    "job": "Job",
    "configmap": "ConfigMap",
    "secret": "Secret",
}


def referenced_objects(text: str) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every `kubectl -n NS … kind/name` in a text."""
    return {(KINDS[k], ns, name) for ns, k, name in KIND_REF.findall(text)}


def rendered_objects(r: Rendered) -> set[tuple[str, str, str]]:
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in r.objects}


def test_notes_name_rendered_objects(variant: Rendered) -> None:
    """Every `kubectl -n NS … kind/name` NOTES.txt prints names an object of the release."""
    refs = referenced_objects(variant.notes)
    assert refs, "NOTES.txt names no object"
    missing = refs - rendered_objects(variant)
    assert not missing, f"NOTES.txt names objects the chart does not render: {sorted(missing)}"


def test_install_doc_names_rendered_objects(default: Rendered) -> None:
    """docs/install.md's commands against the default release (name and namespace
    inference-cache) name objects the chart renders (cert-manager's own excepted)."""
    text = (CHART_DIR.parent / "docs" / "install.md").read_text()
    refs = {ref for ref in referenced_objects(text) if ref[1] == NAMESPACE}
    assert len(refs) >= 4, refs
    missing = refs - rendered_objects(default)
    assert not missing, f"docs/install.md names objects the chart does not render: {sorted(missing)}"


def test_no_unrendered_values(variant: Rendered) -> None:
    text = _rendered_text(variant)
    assert "<no value>" not in text
    assert "%!" not in text  # printf verb errors


# ----------------------------------------------------------------------------- names


def test_other_release_name_and_namespace() -> None:
    """Nothing assumes the release is called inference-cache or lives in that namespace."""
    r = render({}, namespace="gpu-ops", name="prod")
    control_ns = "prod-inference-cache-model-cache"
    for o in r.objects:
        if o["kind"] == "CustomResourceDefinition":
            continue
        assert o["metadata"]["name"].startswith("prod-inference-cache"), o["metadata"]["name"]
        if o["kind"] in ("Role", "RoleBinding"):
            assert o["metadata"]["namespace"] in ("gpu-ops", control_ns)
        else:
            assert o["metadata"].get("namespace") in (None, "gpu-ops")
    assert r.one("Namespace")["metadata"]["name"] == control_ns
    ctl = the_container(r.one("Deployment", "prod-inference-cache-controller"))
    args = args_of(ctl)
    assert args["--agent-service-account"] == "gpu-ops:prod-inference-cache-agent"
    assert args["--leader-election-lease-name"] == "prod-inference-cache-controller"
    assert args["--model-cache-control-namespace"] == control_ns
    assert args["--model-cache-catalog-namespace"] == "gpu-ops"
    assert args["--model-cache-catalog-config-map"] == "prod-inference-cache-storage-capabilities"
    job = r.one("Job", "prod-inference-cache-strip-finalizers")
    assert f"--namespace={control_ns}" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    agent = the_container(r.one("DaemonSet", "prod-inference-cache-agent"))
    assert args_of(agent)["--controller"] == "http://prod-inference-cache-controller-agents.gpu-ops.svc:50051"
    assert "prod-inference-cache-webhook.gpu-ops.svc" in r.one("Certificate")["spec"]["dnsNames"]
    hook = _webhooks(r)["mpod.inferencecache.io"]
    assert hook["clientConfig"]["service"]["namespace"] == "gpu-ops"
    assert "gpu-ops" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert "inference-cache" not in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    text = _rendered_text(r)
    assert ".inference-cache.svc" not in text and "inference-cache:" not in text
