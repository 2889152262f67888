"""The chart's wiring of the model cache (spec 004) and of the engine-wiring images: controller
flags, the control namespace, least-privilege RBAC and the pre-delete hook that strips binding
finalizers before `helm uninstall` deletes the control namespace."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import (
    CHART_DIR,
    MODEL_CACHE_CUSTOM,
    NAMESPACE,
    Rendered,
    containers,
    hook_of,
    render,
    variant_named,
)
from test_chart import (
    CONTROLLER,
    _restricted_violations,
    _webhooks,
    args_of,
    controller_deployment,
    grants,
    the_container,
)

CONTROL_NS = "inference-cache-model-cache"
MC_RBAC = f"{CONTROLLER}-model-cache"
HOOK = "inference-cache-strip-finalizers"
HOOK_DELETE_POLICY = "before-hook-creation,hook-succeeded"
# The uninstall marker ConfigMap (controller/src/reconcile/model_cache/binding.rs UNINSTALL_MARKER).
UNINSTALL_MARKER = "inference-cache-model-cache-uninstalling"


def controller_args(r: Rendered) -> dict[str, str]:
    return args_of(the_container(controller_deployment(r)))


def encryption_on(r: Rendered) -> bool:
    """The ModelCacheEncryption gate, from featureGates as a map or as the flag's string."""
    gates = r.values.get("modelCache", {}).get("featureGates", {})
    if isinstance(gates, str):
        return "ModelCacheEncryption=true" in gates.replace(" ", "").split(",")
    return bool(gates.get("ModelCacheEncryption"))


def model_cache_on(r: Rendered) -> bool:
    return r.values.get("modelCache", {}).get("enabled", True)


def control_ns_of(r: Rendered) -> str:
    return r.values.get("modelCache", {}).get("controlNamespace") or CONTROL_NS


# ----------------------------------------------------------------------------- flags


def test_model_cache_flags_default(default: Rendered) -> None:
    args = controller_args(default)
    assert args["--model-cache-enabled"] == "true"
    assert args["--model-cache-control-namespace"] == CONTROL_NS
    assert args["--model-cache-storage-class"] == "inference-cache-model-cache"
    assert args["--model-cache-feature-gates"] == (
        "CachingSupport=true,HelmModelCaching=true,ModelCacheEncryption=false"
    )
    assert args["--model-cache-idle-seconds"] == "3600"
    assert args["--model-cache-writer-service-account"] == "default"
    # Unset by default: the engine image, no kvevent-subscriber sidecar.
    for flag in (
        "--lmcache-worker-image",
        "--lmcache-kernel-check-image",
        "--kvevent-subscriber-image",
        "--kvevent-subscriber-controller",
    ):
        assert flag not in args


@pytest.mark.parametrize("name", ["default", "model-cache-custom"])
def test_catalog_flags_name_the_shipped_config_map(name: str) -> None:
    """--model-cache-catalog-{namespace,config-map,key} name the ConfigMap the chart renders, and
    its key holds chart/files/catalog.json."""
    r = variant_named(name)
    args = controller_args(r)
    cm = r.one("ConfigMap", args["--model-cache-catalog-config-map"])
    assert cm["metadata"]["namespace"] == args["--model-cache-catalog-namespace"] == NAMESPACE
    body = cm["data"][args["--model-cache-catalog-key"]]
    assert json.loads(body) == json.loads((CHART_DIR / "files" / "catalog.json").read_text())
    assert args["--model-cache-catalog-key"] == "catalog.json"


def test_model_cache_flags_custom() -> None:
    r = variant_named("model-cache-custom")
    args = controller_args(r)
    assert args["--model-cache-enabled"] == "true"
    assert args["--model-cache-control-namespace"] == "mc-control"
    assert args["--model-cache-storage-class"] == "weka-retain"
    # A map merges over the defaults and is passed sorted.
    assert args["--model-cache-feature-gates"] == (
        "CachingSupport=true,HelmModelCaching=false,ModelCacheEncryption=true"
    )
    assert args["--model-cache-idle-seconds"] == "2592000"  # an integer, never 2.592e+06
    assert args["--model-cache-writer-service-account"] == "model-writer"
    assert args["--model-cache-catalog-config-map"] == "my-catalog"
    assert args["--lmcache-worker-image"] == "registry.example/lmcache:0.3.9"
    assert args["--lmcache-kernel-check-image"] == "registry.example/kernel-check:1.0"
    assert args["--kvevent-subscriber-image"] == "registry.example/ic-agent:0.1.0"
    # The sidecars reach every controller replica through the headless agents Service.
    assert args["--kvevent-subscriber-controller"] == (
        f"{CONTROLLER}-agents.{NAMESPACE}.svc:50051"
    )
    agents = r.one("Service", f"{CONTROLLER}-agents")
    assert agents["spec"]["clusterIP"] == "None"


def test_feature_gates_as_a_string() -> None:
    gates = "CachingSupport=true,HelmModelCaching=true,ModelCacheEncryption=true"
    r = render({"modelCache": {"featureGates": gates}})
    assert controller_args(r)["--model-cache-feature-gates"] == gates


def test_kvevent_subscriber_controller_override() -> None:
    r = render(
        {
            "kvEventSubscriber": {"image": "x/ic-agent:1", "controller": "ic.example:15051"},
            "controller": {"ports": {"grpc": 15051}},
        }
    )
    assert controller_args(r)["--kvevent-subscriber-controller"] == "ic.example:15051"
    r = render({"kvEventSubscriber": {"image": "x/ic-agent:1"}, "controller": {"ports": {"grpc": 15051}}})
    assert controller_args(r)["--kvevent-subscriber-controller"].endswith(".svc:15051")


def test_model_cache_off_flags() -> None:
    args = controller_args(variant_named("model-cache-off"))
    assert args["--model-cache-enabled"] == "false"
    assert [a for a in args if a.startswith("--model-cache-") and a != "--model-cache-enabled"] == []


def test_model_cache_flags_are_unique(variant: Rendered) -> None:
    flags = [a.partition("=")[0] for a in the_container(controller_deployment(variant))["args"]]
    # --tokenizer MODEL=PATH is repeatable by design (one per model).
    repeatable = {"--tokenizer"}
    dupes = sorted({f for f in flags if f.startswith("--") and f not in repeatable and flags.count(f) > 1})
    assert dupes == []


# ----------------------------------------------------------------------------- namespace


def test_control_namespace(variant: Rendered) -> None:
    mc = variant.values.get("modelCache", {})
    rendered = {n["metadata"]["name"]: n for n in variant.of_kind("Namespace")}
    rendered.pop(NAMESPACE, None)  # namespace.create renders the release namespace
    if not model_cache_on(variant) or mc.get("createControlNamespace") is False:
        assert rendered == {}
        return
    ns = rendered.pop(CONTROL_NS)
    assert rendered == {}
    labels = ns["metadata"]["labels"]
    # Labelled like every other object of the chart.
    assert labels["app.kubernetes.io/instance"] == "inference-cache"
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert labels["app.kubernetes.io/part-of"] == "inference-cache"
    # Writer Jobs run the ModelCache's own pod template: baseline admits ordinary pods.
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    # Not kept: uninstall deletes it, after the hook stripped the finalizers.
    assert "helm.sh/resource-policy" not in (ns["metadata"].get("annotations") or {})


def test_control_namespace_labels_are_values() -> None:
    r = render({"modelCache": {"controlNamespaceLabels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    labels = r.one("Namespace", CONTROL_NS)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_control_namespace_equal_to_release_namespace() -> None:
    """A control namespace that is the release namespace is not rendered twice."""
    r = render({"modelCache": {"controlNamespace": NAMESPACE}, "namespace": {"create": True}})
    assert [n["metadata"]["name"] for n in r.of_kind("Namespace")] == [NAMESPACE]
    assert controller_args(r)["--model-cache-control-namespace"] == NAMESPACE
    assert r.one("Role", MC_RBAC)["metadata"]["namespace"] == NAMESPACE


def test_pod_webhook_skips_the_control_namespace(variant: Rendered) -> None:
    w = _webhooks(variant)["mpod.inferencecache.io"]
    excluded = w["namespaceSelector"]["matchExpressions"][0]["values"]
    assert (control_ns_of(variant) in excluded) == model_cache_on(variant)
    assert NAMESPACE in excluded


# ----------------------------------------------------------------------------- RBAC


def test_model_cache_cluster_role_is_exact(variant: Rendered) -> None:
    """Exactly the cluster-wide calls of controller/src/reconcile/model_cache (see the comments in
    templates/model-cache-rbac.yaml), bound to the controller's service account."""
    if not model_cache_on(variant):
        assert [o for o in variant.of_kind("ClusterRole") if o["metadata"]["name"] == MC_RBAC] == []
        assert [o for o in variant.of_kind("ClusterRoleBinding") if o["metadata"]["name"] == MC_RBAC] == []
        return
    g = grants(variant.one("ClusterRole", MC_RBAC)["rules"])
    assert g == {
        ("inferencecache.io", "modelcaches", ()): {"get", "list", "watch"},
        ("inferencecache.io", "modelcaches/status", ()): {"patch"},
        ("", "persistentvolumeclaims", ()): {"get", "create", "delete"},
        ("", "persistentvolumes", ()): {"get", "create", "delete"},
        ("batch", "jobs", ()): {"get", "create", "delete"},
        # create only for encrypted caches' derived classes; get and delete always (release).
        ("storage.k8s.io", "storageclasses", ()): {"get", "delete"} | ({"create"} if encryption_on(variant) else set()),
    }
    b = variant.one("ClusterRoleBinding", MC_RBAC)
    assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": MC_RBAC}
    assert b["subjects"] == [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": NAMESPACE}]


def test_model_cache_control_namespace_role_is_exact(variant: Rendered) -> None:
    """Bindings, writer Leases and key Secrets: only in the control namespace."""
    roles = [o for o in variant.of_kind("Role") if o["metadata"]["name"] == MC_RBAC]
    bindings = [o for o in variant.of_kind("RoleBinding") if o["metadata"]["name"] == MC_RBAC]
    if not model_cache_on(variant):
        assert roles == [] and bindings == []
        return
    (role,) = roles
    (rb,) = bindings
    assert role["metadata"]["namespace"] == rb["metadata"]["namespace"] == control_ns_of(variant)
    assert grants(role["rules"]) == {
        ("inferencecache.io", "modelcachebindings", ()): {"get", "list", "watch", "create", "patch", "delete"},
        ("inferencecache.io", "modelcachebindings/status", ()): {"update"},
        ("coordination.k8s.io", "leases", ()): {"get", "create", "update", "delete"},
        ("", "secrets", ()): {"get", "delete"} | ({"create"} if encryption_on(variant) else set()),
        ("", "configmaps", (UNINSTALL_MARKER,)): {"get"},
    }
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": MC_RBAC}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": NAMESPACE}]


def test_no_model_cache_grants_elsewhere(variant: Rendered) -> None:
    """The controller's main ClusterRole grants nothing of the model cache; no role anywhere grants
    modelcachebindings cluster-wide."""
    main = grants(variant.one("ClusterRole", CONTROLLER)["rules"])
    for group, res, _ in main:
        assert not res.startswith("modelcache"), res
        assert res not in ("persistentvolumes", "persistentvolumeclaims", "jobs", "storageclasses", "secrets")
    for cr in variant.of_kind("ClusterRole"):
        for rule in cr["rules"]:
            assert not any(r.startswith("modelcachebindings") for r in rule.get("resources", [])), cr["metadata"]["name"]


def test_catalog_read_is_named(variant: Rendered) -> None:
    """The catalog is read with GET by name; no role lists or watches ConfigMaps. In the control
    namespace the controller reads the uninstall marker by name and the hook creates it."""
    for role in variant.of_kind("Role") + variant.of_kind("ClusterRole"):
        for rule in role["rules"]:
            if "configmaps" in rule.get("resources", []):
                assert role["kind"] == "Role"
                if role["metadata"]["namespace"] == control_ns_of(variant):
                    assert (rule["verbs"], rule.get("resourceNames")) in (
                        (["get"], [UNINSTALL_MARKER]),
                        (["create"], None),
                    ), role["metadata"]["name"]
                    continue
                assert role["metadata"]["namespace"] == NAMESPACE
                assert rule["verbs"] == ["get"]
                assert rule["resourceNames"] == [controller_args(variant)["--model-cache-catalog-config-map"]]


# ----------------------------------------------------------------------------- uninstall hook


def hook_objects(r: Rendered) -> list[dict[str, Any]]:
    return [o for o in r.objects if hook_of(o) == "pre-delete"]


def test_uninstall_hook_absent_without_model_cache() -> None:
    r = variant_named("model-cache-off")
    assert hook_objects(r) == []
    assert [o for o in r.of_kind("ConfigMap") if o["metadata"]["name"].endswith("storage-capabilities")] == []


def test_uninstall_hook(variant: Rendered) -> None:
    if not model_cache_on(variant):
        return
    control_ns = control_ns_of(variant)
    objs = {(o["kind"], o["metadata"]["name"]): o for o in hook_objects(variant)}
    assert set(objs) == {
        ("ServiceAccount", HOOK),
        ("Role", HOOK),
        ("RoleBinding", HOOK),
        ("Job", HOOK),
    }
    weight = {}
    for key, o in objs.items():
        ann = o["metadata"]["annotations"]
        assert ann["helm.sh/hook-delete-policy"] == HOOK_DELETE_POLICY, key
        weight[key[0]] = int(ann["helm.sh/hook-weight"])
    # RBAC (and the service account) exist before the Job runs.
    assert max(weight["ServiceAccount"], weight["Role"], weight["RoleBinding"]) < weight["Job"]

    sa, role, rb, job = (objs[(k, HOOK)] for k in ("ServiceAccount", "Role", "RoleBinding", "Job"))
    assert sa["metadata"]["namespace"] == NAMESPACE
    assert role["metadata"]["namespace"] == rb["metadata"]["namespace"] == control_ns
    assert grants(role["rules"]) == {
        ("inferencecache.io", "modelcachebindings", ()): {"get", "list", "patch"},
        ("", "configmaps", ()): {"create"},
    }
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": HOOK}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": HOOK, "namespace": NAMESPACE}]

    assert job["metadata"]["namespace"] == NAMESPACE
    assert len(job["metadata"]["name"]) <= 63  # the Job labels its pods with its name
    assert 0 <= job["spec"]["backoffLimit"] <= 3
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["serviceAccountName"] == HOOK
    assert spec["automountServiceAccountToken"] is True  # in-cluster config
    assert _restricted_violations(spec) == []
    (c,) = containers(spec)
    ctl = the_container(controller_deployment(variant))
    assert c["image"] == ctl["image"]
    assert c["args"] == ["strip-finalizers", f"--namespace={control_ns}", "--log-format=json"]
    assert c["args"][1] == f"--namespace={controller_args(variant)['--model-cache-control-namespace']}"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_uninstall_hook_follows_names() -> None:
    r = render({"modelCache": {"controlNamespace": "caches"}}, namespace="gpu-ops", name="prod")
    job = r.one("Job", "prod-inference-cache-strip-finalizers")
    assert job["metadata"]["namespace"] == "gpu-ops"
    assert "--namespace=caches" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    role = r.one("Role", "prod-inference-cache-strip-finalizers")
    assert role["metadata"]["namespace"] == "caches"
    rb = r.one("RoleBinding", "prod-inference-cache-strip-finalizers")
    assert rb["subjects"] == [
        {"kind": "ServiceAccount", "name": "prod-inference-cache-strip-finalizers", "namespace": "gpu-ops"}
    ]


def test_long_release_name_keeps_names_valid() -> None:
    """fullname is cut to 44 characters: the hook Job (its pods carry its name as a label value)
    and the control namespace stay within 63."""
    name = "a-very-long-release-name-that-goes-on-and-on-and-on"
    r = render({}, name=name)
    job = next(o for o in r.of_kind("Job") if hook_of(o) == "pre-delete")
    assert len(job["metadata"]["name"]) <= 63
    (deployment,) = r.of_kind("Deployment")
    ns = args_of(the_container(deployment))["--model-cache-control-namespace"]
    assert len(ns) <= 63 and r.one("Namespace", ns)


def test_custom_variant_values_are_all_used() -> None:
    """Guard: every key of MODEL_CACHE_CUSTOM is one the schema knows (a typo would be rejected)."""
    from conftest import load_chart

    load_chart().validate_schema(MODEL_CACHE_CUSTOM)
