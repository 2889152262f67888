"""Who may read the data plane and what the controller may write (docs/security.md
"Authenticated data plane", "RBAC"): the data-plane flags, the gateway roles' least privilege
against the access requests the controller's code makes, and the opt-in
ValidatingAdmissionPolicies (rendered, schema-valid for Kubernetes 1.30 and 1.33, embedding
chart/files/controller-admission-policy.yaml verbatim — the file
controller/tests/admission_policy_cel.rs evaluates)."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import CHART_DIR, NAMESPACE, ROOT, render
from test_chart import args_of, controller_deployment, grants, the_container

SRC = ROOT / "controller" / "src"
GATEWAY = "inference-cache-gateway"
READER = "inference-cache-data-plane-reader"
CONTROLLER_USER = f"system:serviceaccount:{NAMESPACE}:inference-cache-controller"
POLICY_FILE = CHART_DIR / "files" / "controller-admission-policy.yaml"
VAP = "admissionregistration.k8s.io/v1"


def _access_requests() -> set[tuple[str, str, str]]:
    """(kind, verb, resource-or-path) of every SubjectAccessReview the data plane asks, read from
    the code that asks it (router.rs, http/mod.rs)."""
    text = (SRC / "router.rs").read_text() + (SRC / "http" / "mod.rs").read_text()
    out: set[tuple[str, str, str]] = set()
    out |= {("resource", v, "cacheroutes") for v in re.findall(r'AccessRequest::routes\("(\w+)"', text)}
    out |= {("resource", v, "cacheroutes") for v in re.findall(r'visible_tenants\(&user, "(\w+)"', text)}
    out |= {("resource", v, "cachenodes") for v in re.findall(r'AccessRequest::nodes\("(\w+)"', text)}
    paths = re.findall(r'path: "(/\w+)"', text)
    verbs = re.findall(r'verb: if method == Method::POST \{\s*"(\w+)"\s*\} else \{\s*"(\w+)"\s*\}', text)
    assert paths == ["/probe"] and verbs, "the /probe access request moved"
    out |= {("path", v, p) for p in paths for pair in verbs for v in pair}
    return out


def _allows(rules: list[dict[str, Any]], req: tuple[str, str, str]) -> bool:
    """RBAC's rule match for one request (no wildcards: the roles use none)."""
    kind, verb, what = req
    for rule in rules:
        if verb not in rule["verbs"]:
            continue
        if kind == "path" and what in rule.get("nonResourceURLs", []):
            return True
        if kind == "resource" and "inferencecache.io" in rule.get("apiGroups", []) and what in rule.get("resources", []):
            return True
    return False


def test_data_plane_auth_is_on_by_default_with_its_flags() -> None:
    c = args_of(the_container(controller_deployment(render({}))))
    assert c["--data-plane-auth"] == "true"
    assert c["--caller-audience"] == "inference-cache"
    assert (c["--access-review-ttl-seconds"], c["--max-concurrent-reviews"]) == ("30", "16")
    r = render({"auth": {"dataPlane": {"enabled": False}}})
    c = args_of(the_container(controller_deployment(r)))
    assert c["--data-plane-auth"] == "false"
    assert "--caller-audience" not in c
    # Without it the controller needs no SubjectAccessReview and no gateway roles are rendered.
    role = r.one("ClusterRole", "inference-cache-controller")
    assert ("authorization.k8s.io", "subjectaccessreviews", ()) not in grants(role["rules"])
    assert not [o for o in r.of_kind("ClusterRole") if o["metadata"]["name"] in (GATEWAY, READER)]


def test_the_code_asks_what_the_docs_name() -> None:
    assert _access_requests() == {
        ("resource", "get", "cacheroutes"),
        ("resource", "list", "cacheroutes"),
        ("resource", "list", "cachenodes"),
        ("resource", "get", "cachenodes"),
        ("path", "get", "/probe"),
        ("path", "post", "/probe"),
    }


def test_the_gateway_role_grants_lookups_and_nothing_else() -> None:
    r = render({})
    rules = r.one("ClusterRole", GATEWAY)["rules"]
    assert rules == [{"apiGroups": ["inferencecache.io"], "resources": ["cacheroutes"], "verbs": ["get"]}]
    asked = _access_requests()
    assert {q for q in asked if _allows(rules, q)} == {("resource", "get", "cacheroutes")}
    # The operators' role reads everything the data plane serves and writes nothing through the
    # Kubernetes API (`post` only on the /probe URL).
    reader = r.one("ClusterRole", READER)["rules"]
    assert {q for q in asked if _allows(reader, q)} == asked
    for rule in reader + rules:
        allowed = {"get", "list", "post"} if "nonResourceURLs" in rule else {"get", "list"}
        assert set(rule["verbs"]) <= allowed, rule
        assert "*" not in rule.get("resources", []) + rule.get("apiGroups", []) + rule["verbs"]


def _policies(r) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in r.of_kind("ValidatingAdmissionPolicy")}


def test_admission_policies_are_on_by_default_and_can_be_turned_off() -> None:
    """On by default (rendered where the cluster serves v1 ValidatingAdmissionPolicy: an offline
    render always does; scripts/install-tests.sh proves them on a real install)."""
    r = render({})
    assert set(_policies(r)) == {"inference-cache-controller-owned-workloads", "inference-cache-controller-model-cache-writes"}
    assert len(r.of_kind("ValidatingAdmissionPolicyBinding")) == 2
    off = render({"controller": {"admissionPolicy": {"enabled": False}}})
    assert not off.of_kind("ValidatingAdmissionPolicy") and not off.of_kind("ValidatingAdmissionPolicyBinding")


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_admission_policies_render_valid_and_embed_the_tested_cel(version: str) -> None:
    values = {"controller": {"admissionPolicy": {"enabled": True}}, "modelCache": {"writerServiceAccount": "model-writer"}}
    r = render(values)
    pols = _policies(r)
    assert set(pols) == {"inference-cache-controller-owned-workloads", "inference-cache-controller-model-cache-writes"}
    bindings = r.of_kind("ValidatingAdmissionPolicyBinding")
    assert {b["spec"]["policyName"] for b in bindings} == set(pols)
    assert all(b["spec"]["validationActions"] == ["Deny"] for b in bindings)
    for o in list(pols.values()) + bindings:
        assert o["apiVersion"] == VAP
        kubernetes_validate.validate(o, version, strict=True)
    cel = yaml.safe_load(POLICY_FILE.read_text())
    wl = pols["inference-cache-controller-owned-workloads"]["spec"]
    mc = pols["inference-cache-controller-model-cache-writes"]["spec"]
    assert wl["variables"] == cel["workloads"]["variables"]
    assert wl["validations"] == cel["workloads"]["validations"]
    assert mc["variables"][:2] == [
        {"name": "controlNamespace", "expression": "'inference-cache-model-cache'"},
        {"name": "writerServiceAccount", "expression": "'model-writer'"},
    ]
    assert mc["variables"][2:] == cel["modelCache"]["variables"]
    assert mc["validations"] == cel["modelCache"]["validations"]
    for spec in (wl, mc):
        assert spec["failurePolicy"] == "Fail"
        assert spec["matchConditions"] == [
            {"name": "controller-service-account", "expression": f"request.userInfo.username == '{CONTROLLER_USER}'"}
        ]


def _matched(spec: dict[str, Any]) -> set[tuple[str, str]]:
    out = set()
    for rule in spec["matchConstraints"]["resourceRules"]:
        assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
        out |= {(g, res) for g in rule["apiGroups"] for res in rule["resources"]}
    return out


def test_admission_policies_cover_every_kind_the_controller_writes() -> None:
    """Every workload and model-cache kind the controller's RBAC lets it create, patch or delete
    goes through a policy."""
    r = render({"controller": {"admissionPolicy": {"enabled": True}}})
    pols = _policies(r)
    write = {"create", "patch", "update", "delete"}

    def written(role: str) -> set[tuple[str, str]]:
        out = set()
        for o in r.of_kind("ClusterRole") + r.of_kind("Role"):
            if o["metadata"]["name"] == role:
                g = grants(o.get("rules") or [])
                out |= {(grp, res) for (grp, res, _n), verbs in g.items() if verbs & write}
        return out

    workloads = {("apps", "deployments"), ("apps", "statefulsets"), ("", "services"), ("autoscaling", "horizontalpodautoscalers")}
    assert workloads <= written("inference-cache-controller")
    assert _matched(pols["inference-cache-controller-owned-workloads"]["spec"]) == workloads
    mc = {("batch", "jobs"), ("", "persistentvolumeclaims"), ("", "persistentvolumes"), ("storage.k8s.io", "storageclasses"),
          ("", "secrets")}  # key Secrets: deleted always, created with ModelCacheEncryption
    assert mc <= written("inference-cache-controller-model-cache")
    assert _matched(pols["inference-cache-controller-model-cache-writes"]["spec"]) == mc
    # Without the model cache only the workload policy is rendered; Warn/Audit reaches bindings.
    r = render({"controller": {"admissionPolicy": {"enabled": True, "validationActions": ["Warn", "Audit"]}},
                "modelCache": {"enabled": False}})
    assert set(_policies(r)) == {"inference-cache-controller-owned-workloads"}
    assert r.one("ValidatingAdmissionPolicyBinding")["spec"]["validationActions"] == ["Warn", "Audit"]
