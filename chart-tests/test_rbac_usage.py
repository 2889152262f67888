"""Least privilege: every verb the chart grants the controller is one a code path calls.

RULES maps each (apiGroup, resource, verb) the controller's Roles and ClusterRoles grant to the
code that uses it: a source file and the fragments (regular expressions) that make the call
there. The tests fail when the chart grants a verb with no entry (an unused permission), when an
entry's code is gone (the permission outlived its caller), and when a verb the issue found unused
comes back (docs/security.md "RBAC").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, Rendered
from test_chart import grants

CONTROLLER = "inference-cache-controller"
MC_RBAC = "inference-cache-controller-model-cache"
SRC = ROOT / "controller" / "src"

CB = "reconcile/cachebackend/mod.rs"
MC_REQ = "reconcile/model_cache/request.rs"
MC_BIND = "reconcile/model_cache/binding.rs"
SSA = r"PatchParams::apply\(FIELD_MANAGER\)\.force\(\)"
SHED = r"api\.delete\(&name, &DeleteParams::background\(\)\)"
# Release deletes go through one helper with UID + resourceVersion preconditions.
RELEASE = r"async fn delete_as_read[\s\S]*\.\.DeleteParams::background\(\)[\s\S]*api\.delete\(&name, &dp\)"

# (apiGroup, resource, verb) -> (file under controller/src, fragments that must all be there).
RULES: dict[tuple[str, str, str], tuple[str, list[str]]] = {
    # CacheBackends
    ("inferencecache.io", "cachebackends", "get"): (CB, [r"Api<CacheBackend>", r"\.get_opt\(&name\)"]),
    ("inferencecache.io", "cachebackends", "list"): (CB, [r"Controller::new\(\s*Api::<CacheBackend>::all"]),
    ("inferencecache.io", "cachebackends", "watch"): ("admission/sources.rs", [r"watcher\("]),
    ("inferencecache.io", "cachebackends/status", "patch"): (CB, [r"\.patch_status\(&name"]),
    ("inferencecache.io", "cachebackends/status", "update"): ("reconcile/nodes/advisory.rs", [r"\.replace_status\(&name"]),
    ("inferencecache.io", "cachebackends/finalizers", "update"): ("reconcile/render/mod.rs", [r"block_owner_deletion: Some\(true\)"]),
    # CachePolicies, CacheTenants
    # follow_all (reconcile/follow.rs) lists and watches every object of the kind.
    ("inferencecache.io", "cachepolicies", "list"): ("reconcile/policy.rs", [r"follow_all\(", r"policies: Vec<CachePolicy>"]),
    ("inferencecache.io", "cachepolicies", "watch"): ("reconcile/policy.rs", [r"follow_all\(", r"policies: Vec<CachePolicy>"]),
    ("inferencecache.io", "cachepolicies/status", "patch"): ("reconcile/policy.rs", [r"\.patch_status\(&name"]),
    ("inferencecache.io", "cachetenants", "list"): ("reconcile/tenants.rs", [r"Api<CacheTenant>", r"\.list\(&"]),
    ("inferencecache.io", "cachetenants", "watch"): ("reconcile/tenants.rs", [r"follow_all\(", r"all: Vec<CacheTenant>"]),
    ("inferencecache.io", "cachetenants/status", "patch"): ("reconcile/tenants.rs", [r"\.patch_status\(name"]),
    # CacheIndex, CacheNodes
    ("inferencecache.io", "cacheindexes", "get"): ("reconcile/cache_index.rs", [r"Api<CacheIndex>", r"\.get_opt\("]),
    ("inferencecache.io", "cacheindexes", "create"): ("reconcile/cache_index.rs", [r"\.create\(&"]),
    ("inferencecache.io", "cacheindexes/status", "patch"): ("reconcile/cache_index.rs", [r"\.patch_status\("]),
    ("inferencecache.io", "cachenodes", "get"): ("reconcile/nodes/cachenode.rs", [r"Api<CacheNode>", r"\.get_opt\(&node\)"]),
    ("inferencecache.io", "cachenodes", "create"): ("reconcile/nodes/cachenode.rs", [r"\.create\(&PostParams::default\(\), &obj\)"]),
    ("inferencecache.io", "cachenodes/status", "patch"): ("reconcile/nodes/cachenode.rs", [r"\.patch_status\(&node"]),
    # Pods
    ("", "pods", "get"): ("ingest/auth/verifier.rs", [r"Api<Pod>", r"\.get_opt\(pod_name\)"]),
    ("", "pods", "list"): ("reconcile/nodes/mod.rs", [r"Api::<Pod>::all", r"\.list\(&ListParams::default\(\)\)"]),
    ("", "pods", "watch"): ("reconcile/engine_pods.rs", [r"Controller::new\(Api::<Pod>::all\(client\)"]),
    # Provider workloads: owned (list/watch), server-side apply (patch; create when it creates),
    # shed (delete); the engine restart cascade (merge patch on Deployments).
    **{
        (group, res, verb): (CB, [frag, fragment])
        for group, res, kind in (
            ("apps", "deployments", "Deployment"),
            ("apps", "statefulsets", "StatefulSet"),
            ("", "services", "Service"),
            ("autoscaling", "horizontalpodautoscalers", "HorizontalPodAutoscaler"),
        )
        for verb, fragment in (
            ("list", r"list_owned\(client"),
            ("watch", r"\.owns\("),
            ("create", SSA),
            ("patch", SSA),
            ("delete", SHED),
        )
        for frag in [rf"\.owns\(Api::<{kind}>::all"]
    },
    ("events.k8s.io", "events", "create"): ("reconcile/cachebackend/events.rs", [r"Api<K8sEvent>", r"api\.create\(&PostParams::default\(\), &ev\)"]),
    # kube-runtime's Recorder patches a repeated Event's series (the real apiserver's audit log
    # showed it: cluster/audit_check.py).
    ("events.k8s.io", "events", "patch"): ("reconcile/cachebackend/events.rs", [r"Recorder::new\(client\.clone\(\), reporter\.clone\(\)\)", r"\.recorder\s*\.publish\(&ev, object\)"]),
    ("authentication.k8s.io", "tokenreviews", "create"): ("ingest/auth/verifier.rs", [r"Api<TokenReview>", r"\.create\(&PostParams::default\(\), &review\)"]),
    ("authorization.k8s.io", "subjectaccessreviews", "create"): ("access.rs", [r"Api<SubjectAccessReview>", r"\.create\(&PostParams::default\(\), &sar\)"]),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "get"): ("admission/ca_bundle/webhook_config.rs", [r"api\.get_opt\(name\)"]),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "update"): ("admission/ca_bundle/webhook_config.rs", [r"api\.replace\(name"]),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "get"): ("admission/ca_bundle/webhook_config.rs", [r"api\.get_opt\(name\)"]),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "update"): ("admission/ca_bundle/webhook_config.rs", [r"api\.replace\(name"]),
    # Release-namespace Role
    ("coordination.k8s.io", "leases", "create"): ("leader.rs", [r"\.create\(&PostParams::default\(\), &self\.object\(rec, None\)\)"]),
    ("coordination.k8s.io", "leases", "get"): ("leader.rs", [r"\.get_opt\(&self\.name\)"]),
    ("coordination.k8s.io", "leases", "update"): ("leader.rs", [r"\.replace\("]),
    ("", "secrets", "get"): ("admission/ca_bundle/keeper.rs", [r"Api<Secret>", r"api\.get_opt\(&name\)"]),
    ("", "secrets", "create"): ("admission/ca_bundle/keeper.rs", [r"Api<Secret>", r"\.create\(\s*&PostParams::default\(\),\s*&fresh"]),
    ("", "secrets", "update"): ("admission/ca_bundle/keeper.rs", [r"Api<Secret>", r"api\.replace\(&name"]),
    ("", "configmaps", "get"): (MC_REQ, [r"Api<ConfigMap>", r"\.get_opt\(&cfg\.catalog_config_map\)"]),
}

# The model-cache controllers (model-cache-rbac.yaml): the same table, their own Roles.
MC_RULES: dict[tuple[str, str, str], tuple[str, list[str]]] = {
    ("inferencecache.io", "modelcaches", "get"): (MC_REQ, [r"Api<ModelCache>", r"\.get_opt\(&name\)"]),
    ("inferencecache.io", "modelcaches", "list"): ("reconcile/nodes/mod.rs", [r"Api::<ModelCache>::all"]),
    ("inferencecache.io", "modelcaches", "watch"): ("reconcile/model_cache/mod.rs", [r"Controller::new\(requests"]),
    ("inferencecache.io", "modelcaches/status", "patch"): (MC_REQ, [r"\.patch_status\("]),
    ("", "persistentvolumeclaims", "get"): (MC_REQ, [r"Api<PersistentVolumeClaim>", r"\.get_opt\(&claim_name\)"]),
    ("", "persistentvolumeclaims", "create"): (MC_REQ, [r"claims\.create\(&PostParams::default\(\)"]),
    ("", "persistentvolumeclaims", "delete"): (MC_BIND, [r"Api<PersistentVolumeClaim>", RELEASE]),
    ("", "persistentvolumes", "get"): (MC_REQ, [r"Api<PersistentVolume>", r"\.get_opt\(&pv_name\)"]),
    ("", "persistentvolumes", "create"): (MC_REQ, [r"pvs\.create\(&PostParams::default\(\)"]),
    ("", "persistentvolumes", "delete"): (MC_BIND, [r"Api<PersistentVolume>", RELEASE]),
    ("batch", "jobs", "get"): (MC_REQ, [r"Api<Job>", r"\.get_opt\(&wname\)"]),
    ("batch", "jobs", "create"): (MC_REQ, [r"jobs\.create\(&PostParams::default\(\)"]),
    ("batch", "jobs", "delete"): (MC_BIND, [r"Api<Job>", RELEASE]),
    ("storage.k8s.io", "storageclasses", "get"): (MC_REQ, [r"Api<StorageClass>", r"\.get_opt\(&class_name\)"]),
    ("storage.k8s.io", "storageclasses", "create"): (MC_REQ, [r"classes\.create\(&PostParams::default\(\)"]),
    ("storage.k8s.io", "storageclasses", "delete"): (MC_BIND, [r"Api<StorageClass>", RELEASE]),
    ("inferencecache.io", "modelcachebindings", "get"): (MC_BIND, [r"Api<ModelCacheBinding>", r"\.get_opt\(&name\)"]),
    ("inferencecache.io", "modelcachebindings", "list"): (MC_REQ, [r"bindings\.list\(&lp\)"]),
    ("inferencecache.io", "modelcachebindings", "watch"): ("reconcile/model_cache/mod.rs", [r"Controller::new\(bindings"]),
    ("inferencecache.io", "modelcachebindings", "create"): (MC_REQ, [r"bindings\.create\(&PostParams::default\(\), &obj\)"]),
    ("inferencecache.io", "modelcachebindings", "patch"): (MC_BIND, [r"Api<ModelCacheBinding>", r"\.patch\("]),
    ("inferencecache.io", "modelcachebindings", "delete"): (MC_BIND, [r"\.delete\(&name"]),
    ("inferencecache.io", "modelcachebindings/status", "update"): (MC_BIND, [r"\.replace_status\(&name"]),
    ("coordination.k8s.io", "leases", "get"): (MC_REQ, [r"Api<Lease>", r"\.get_opt\(&lease_ref\.name\)"]),
    ("coordination.k8s.io", "leases", "create"): (MC_REQ, [r"leases\.create\(&PostParams::default\(\)"]),
    ("coordination.k8s.io", "leases", "update"): (MC_REQ, [r"\.replace\(&lease_ref\.name"]),
    ("coordination.k8s.io", "leases", "delete"): (MC_BIND, [r"Api<Lease>", RELEASE]),
    ("", "secrets", "get"): (MC_REQ, [r"Api<Secret>", r"\.get_opt\(&secret_ref\.name\)"]),
    ("", "secrets", "create"): (MC_REQ, [r"secrets\.create\(&PostParams::default\(\)"]),
    ("", "secrets", "delete"): (MC_BIND, [r"Api<Secret>", RELEASE]),
    # The uninstall marker: while it exists no new binding is created.
    ("", "configmaps", "get"): (MC_BIND, [r"Api<ConfigMap>", r"\.get_opt\(UNINSTALL_MARKER\)"]),
}

# The pre-upgrade hook's ClusterRole (chart/templates/crd-upgrade-hook.yaml): `ic-controller
# upgrade-crds` reads each CRD and server-side applies it (an apply that creates is `create`).
CRD_HOOK = "inference-cache-upgrade-crds"
CRD_UP = "crdupgrade.rs"
HOOK_RULES: dict[tuple[str, str, str], tuple[str, list[str]]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "get"): (CRD_UP, [r"Api<CustomResourceDefinition>", r"\.get_opt\(&n\)"]),
    ("apiextensions.k8s.io", "customresourcedefinitions", "patch"): (CRD_UP, [r"PatchParams::apply\(FIELD_MANAGER\)\.force\(\)", r"api\.patch\(&n, &params, &Patch::Apply"]),
    ("apiextensions.k8s.io", "customresourcedefinitions", "create"): (CRD_UP, [r"CrdAction::Create", r"&Patch::Apply\(crd\)"]),
}

# Verbs the issue found granted but unused; none may come back.
NEVER = [
    ("apps", "deployments", "update"),
    ("apps", "statefulsets", "update"),
    ("", "services", "update"),
    ("autoscaling", "horizontalpodautoscalers", "update"),
    ("inferencecache.io", "cacheindexes", "update"),
    ("inferencecache.io", "cacheindexes", "delete"),
    ("inferencecache.io", "cachenodes", "update"),
    ("inferencecache.io", "cachenodes", "delete"),
    ("", "events", "create"),
]


def _controller_grants(r: Rendered, names: tuple[str, ...]) -> set[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for kind in ("ClusterRole", "Role"):
        for o in r.of_kind(kind):
            if o["metadata"]["name"] not in names:
                continue
            for (group, res, _names), verbs in grants(o.get("rules") or []).items():
                out.update((group, res, v) for v in verbs)
    return out


@pytest.mark.parametrize("table", [RULES, MC_RULES, HOOK_RULES], ids=["controller", "model-cache", "crd-upgrade-hook"])
def test_every_table_entry_names_code_that_makes_the_call(table) -> None:
    missing = []
    for rule, (file, fragments) in table.items():
        text = (SRC / file).read_text()
        for f in fragments:
            if not re.search(f, text):
                missing.append(f"{rule}: {f!r} not in controller/src/{file}")
    assert not missing, "\n".join(missing)


def test_every_granted_verb_is_used_by_some_code_path(variant: Rendered) -> None:
    main = _controller_grants(variant, (CONTROLLER,))
    unused = sorted(main - set(RULES))
    assert not unused, f"granted to the controller but no code path uses them: {unused}"
    mc = _controller_grants(variant, (MC_RBAC,))
    unused = sorted(mc - set(MC_RULES))
    assert not unused, f"granted to the model-cache controllers but unused: {unused}"
    hook = _controller_grants(variant, (CRD_HOOK,))
    unused = sorted(hook - set(HOOK_RULES))
    assert not unused, f"granted to the CRD upgrade hook but unused: {unused}"


def test_the_unused_verbs_the_issue_found_stay_absent(variant: Rendered) -> None:
    granted = _controller_grants(variant, (CONTROLLER, MC_RBAC))
    back = [v for v in NEVER if v in granted]
    assert not back, back


def test_the_table_catches_an_extra_verb(default: Rendered) -> None:
    """The check above is not vacuous: a ClusterRole with one more verb fails it."""
    extra = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": CONTROLLER},
        "rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["update"]}],
    }
    r = Rendered(values={}, manifests=default.manifests, objects=default.objects + [extra])
    assert ("apps", "deployments", "update") in _controller_grants(r, (CONTROLLER,)) - set(RULES)
