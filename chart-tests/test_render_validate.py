"""The chart lints strictly and every object it renders is valid Kubernetes for 1.29 and 1.33."""

from __future__ import annotations

from collections import Counter
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from conftest import CHART_DIR, KUBE_VERSIONS, NAMESPACE, VARIANTS, Rendered, crd_objects, render

# Kinds kubernetes-validate has no schema for (custom resources of cert-manager and
# prometheus-operator): checked below against the fields the chart uses, from the projects'
# published CRDs (cert-manager.io/v1, monitoring.coreos.com/v1).
_STR = {"type": "string", "minLength": 1}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": _STR, "namespace": _STR, "labels": {"type": "object"}},
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": {"type": "object", "minProperties": 1}},
    "required": ["matchLabels"],
}
_NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchNames": {"type": "array", "items": _STR, "minItems": 1}},
}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": _STR},
        "targetLabel": _STR,
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": _STR,
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "relabelings": {"type": "array", "items": _RELABEL},
        # prometheus-operator SafeAuthorization: a type and a Secret key selector.
        "authorization": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "type": _STR,
                "credentials": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["key"],
                    "properties": {"name": _STR, "key": _STR, "optional": {"type": "boolean"}},
                },
            },
        },
    },
}
_ISSUER_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {"name": _STR, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": _STR},
}


def _cr(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": spec,
        },
    }


CUSTOM_RESOURCE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _cr(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NS_SELECTOR,
                "endpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            },
        },
    ),
    "PodMonitor": _cr(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NS_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            },
        },
    ),
    "PrometheusRule": _cr(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": _STR,
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr"],
                                    "properties": {
                                        "alert": _STR,
                                        "expr": _STR,
                                        "for": _DURATION,
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    ),
    "Issuer": _cr(
        "cert-manager.io/v1",
        "Issuer",
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {"selfSigned": {"type": "object"}},
            "required": ["selfSigned"],
        },
    ),
    "Certificate": _cr(
        "cert-manager.io/v1",
        "Certificate",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["secretName", "issuerRef", "dnsNames"],
            "properties": {
                "secretName": _STR,
                "duration": _DURATION,
                "renewBefore": _DURATION,
                "dnsNames": {"type": "array", "items": _STR, "minItems": 1},
                "usages": {
                    "type": "array",
                    "items": {"enum": ["server auth", "digital signature", "key encipherment"]},
                },
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                },
                "issuerRef": _ISSUER_REF,
            },
        },
    ),
}


@pytest.mark.parametrize("kube", ["v1.29.0", "v1.33.0"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_lint_strict(name: str, kube: str) -> None:
    report = helm.lint(
        str(CHART_DIR), VARIANTS[name], strict=True, kube_version=kube, namespace=NAMESPACE
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"], report["errors"]
    assert not problems, problems


# Rendered only on Kubernetes 1.30 and later (`.Capabilities.KubeVersion` in
# controller-admission-policy.yaml; lint above renders 1.29 without them), but the offline render
# these tests validate is for Helm's own Kubernetes version, so they are not held to 1.29's schema.
SERVED_FROM = {("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "1.30",
               ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): "1.30"}


def _served(obj: dict[str, Any], version: str) -> bool:
    served_from = SERVED_FROM.get((obj["apiVersion"], obj["kind"]))
    return not served_from or tuple(map(int, version.split("."))) >= tuple(map(int, served_from.split(".")))


def _validate(obj: dict[str, Any], version: str) -> None:
    kind = obj["kind"]
    if not _served(obj, version):
        return
    if kind in CUSTOM_RESOURCE_SCHEMAS:
        jsonschema.validate(obj, CUSTOM_RESOURCE_SCHEMAS[kind])
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{kind}/{obj['metadata']['name']} invalid for {version} at {path}: {e.message}")


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(variant: Rendered, version: str) -> None:
    for obj in variant.objects:
        _validate(obj, version)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_custom_ports_are_valid_kubernetes(version: str) -> None:
    from conftest import CUSTOM_PORTS

    for obj in render(CUSTOM_PORTS).objects:
        _validate(obj, version)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_validation_is_strict(default: Rendered, version: str) -> None:
    """kubernetes-validate in strict mode rejects a misspelt field (the check is not vacuous)."""
    import copy

    d = copy.deepcopy(next(o for o in default.objects if o["kind"] == "Deployment"))
    d["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(d, version, strict=True)


def test_every_kind_has_a_schema(variant: Rendered) -> None:
    """No object is skipped as an unknown kind: core kinds have a kubernetes-validate schema and
    the custom resources the chart renders have one above."""
    for obj in variant.objects:
        if obj["kind"] in CUSTOM_RESOURCE_SCHEMAS:
            continue
        for version in KUBE_VERSIONS:
            if not _served(obj, version):
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as e:  # pragma: no cover
                pytest.fail(e.message)


def test_custom_resource_schemas_reject_mistakes() -> None:
    """The minimal custom-resource schemas are strict enough to catch a misspelt field."""
    bad = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "x", "namespace": "y"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"prot": "http"}]},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, CUSTOM_RESOURCE_SCHEMAS["ServiceMonitor"])


def test_no_duplicate_objects(variant: Rendered) -> None:
    keys = Counter(
        (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in variant.objects
    )
    assert [k for k, n in keys.items() if n > 1] == []


def test_namespaced_objects_are_in_the_release_namespace(variant: Rendered) -> None:
    cluster_scoped = {
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Namespace",
    }
    # The model cache's Roles and RoleBindings (the controller's and the uninstall hook's) live in
    # its control namespace; nothing else does.
    mc = variant.values.get("modelCache", {})
    control_ns = mc.get("controlNamespace") or "inference-cache-model-cache"
    in_control_ns = {
        ("Role", "inference-cache-controller-model-cache"),
        ("RoleBinding", "inference-cache-controller-model-cache"),
        ("Role", "inference-cache-strip-finalizers"),
        ("RoleBinding", "inference-cache-strip-finalizers"),
    }
    for o in variant.objects:
        ns = o["metadata"].get("namespace")
        if o["kind"] in cluster_scoped:
            assert ns is None, f"{o['kind']}/{o['metadata']['name']} must not set a namespace"
        elif (o["kind"], o["metadata"]["name"]) in in_control_ns:
            assert ns == control_ns, f"{o['kind']}/{o['metadata']['name']}: {ns}"
        else:
            assert ns == "inference-cache", f"{o['kind']}/{o['metadata']['name']}: {ns}"


def test_crds_are_shipped_as_generated() -> None:
    """crds/ holds exactly the generated CRDs (ic-controller crds), untemplated."""
    names = sorted(o["metadata"]["name"] for o in crd_objects())
    assert names == [
        "cachebackends.inferencecache.io",
        "cacheindexes.inferencecache.io",
        "cachenodes.inferencecache.io",
        "cachepolicies.inferencecache.io",
        "cachetenants.inferencecache.io",
        "modelcachebindings.inferencecache.io",
        "modelcaches.inferencecache.io",
    ]
    for path in (CHART_DIR / "crds").glob("*.yaml"):
        text = path.read_text()
        assert "{{" not in text, f"{path.name} is templated"
        assert text.startswith("# Generated by `ic-controller crds`"), path.name
