"""Least privilege, read from the real apiserver's audit log (docs/real-cluster.md).

For each identity the chart creates (the controller's ServiceAccount; the agent's), from the
audit log `scripts/cluster.sh` makes the apiserver write (every request, with its user, verb,
resource and response code) and the chart's rendered RBAC (objects.yaml, written by
cluster/chart_objects.py):

1. every request the identity made was authorized (the audit event's
   `authorization.k8s.io/decision` is never `forbid`: no missing grant) and passed the chart's
   ValidatingAdmissionPolicies (no `validation.policy.admission.k8s.io/validation_failure`);
   any other 403 fails too (an admission plugin refusing for want of a grant), except a write
   into a namespace being deleted, which is listed, and so are
   refusals in the first STARTUP_GRACE after a kube-apiserver restart (`cluster.sh restart`
   records them in `apiserver-restarts`): its RBAC caches fill a moment after it is ready;
2. every (apiGroup, resource, verb) the chart grants it was used by some request: a grant
   nothing uses is more privilege than the job needs. Grants listed in ALLOWED_UNUSED say
   why no scenario here exercises them.

usage: audit_check.py STATE_DIR   (exit 1 when a check fails; the report goes to stdout)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from datetime import datetime, timedelta
from pathlib import Path

import yaml

NAMESPACE = "inference-cache"
IDENTITIES = {
    "controller": f"system:serviceaccount:{NAMESPACE}:inference-cache-controller",
    "agent": f"system:serviceaccount:{NAMESPACE}:inference-cache-agent",
}
# Only the product's own requests count: its binaries send `User-Agent: <program>/<version>`.
# The tests borrow the controller's credentials to show what they are refused (the admission
# policy test) with a client that sends no such User-Agent.
PROGRAMS = {"controller": "ic-controller/", "agent": "ic-agent/"}
STARTUP_GRACE = timedelta(seconds=20)
# (identity, apiGroup, resource, verb) -> why no request in the audit log shows it used.
ALLOWED_UNUSED: dict[tuple[str, str, str, str], str] = {
    ("controller", "inferencecache.io", "cachebackends/finalizers", "update"):
        "checked by the OwnerReferencesPermissionEnforcement admission plugin (on here) when the "
        "controller applies a child with blockOwnerDeletion, which is no request of its own; "
        "without it every workload apply is refused and the workloads tests fail (tried)",
    ("controller", "events.k8s.io", "events", "patch"):
        "kube-runtime's Recorder patches an Event's series only when the same Event repeats within "
        "its cache window, which the suite's timing makes happen in some runs and not others; a run "
        "where it happened without the grant showed the refusal (chart-tests/test_rbac_usage.py "
        "ties the grant to the Recorder)",
}


def grants(objects: list[dict], username: str) -> dict[tuple[str, str, str], set[str]]:
    """(apiGroup, resource, verb) -> the namespaces ('*' = cluster-wide) it is granted in."""
    _, _, sa_ns, sa_name = username.split(":")
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("ClusterRole", "Role")}
    out: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for b in objects:
        if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name
                   and s.get("namespace", b["metadata"].get("namespace")) == sa_ns
                   for s in b.get("subjects") or []):
            continue
        ref = b["roleRef"]
        role_ns = None if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"]
        role = roles.get((ref["kind"], role_ns, ref["name"]))
        if role is None:
            continue
        scope = "*" if b["kind"] == "ClusterRoleBinding" else b["metadata"]["namespace"]
        for rule in role.get("rules") or []:
            for g in rule.get("apiGroups") or []:
                for r in rule.get("resources") or []:
                    for v in rule.get("verbs") or []:
                        out[(g, r, v)].add(scope)
    return out


def requests(audit_log: Path, username: str, program: str) -> list[dict]:
    out = []
    seen: set[str] = set()
    for line in audit_log.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("user", {}).get("username") != username:
            continue
        if not (e.get("userAgent") or "").startswith(program):
            continue
        # A watch logs ResponseStarted when it opens and ResponseComplete only when it ends
        # (the controller's watches are still open when this runs): one event per request.
        if e.get("stage") not in ("ResponseStarted", "ResponseComplete") or e["auditID"] in seen:
            continue
        seen.add(e["auditID"])
        out.append(e)
    return out


def keys(e: dict) -> list[tuple[str, str, str]]:
    """The (apiGroup, resource[/subresource], verb) grants request `e` needed. A server-side
    apply (or update) that creates its object (201) is authorized for `create` as well."""
    ref = e.get("objectRef")
    if not ref:
        return []
    resource = ref.get("resource", "")
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    group = ref.get("apiGroup", "")
    out = [(group, resource, e["verb"])]
    if e["verb"] in ("patch", "update") and e.get("responseStatus", {}).get("code") == 201:
        out.append((group, resource, "create"))
    return out


def when(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def main() -> int:
    state = Path(sys.argv[1])
    restarts_file = state / "apiserver-restarts"
    restarts = [when(l) for l in restarts_file.read_text().split()] if restarts_file.exists() else []

    def starting(e: dict) -> bool:
        t = when(e["requestReceivedTimestamp"])
        return any(r <= t <= r + STARTUP_GRACE for r in restarts)

    objects = [d for d in yaml.safe_load_all((state / "objects.yaml").read_text()) if d]
    failed = False
    for who, username in IDENTITIES.items():
        granted = grants(objects, username)
        made = requests(state / "audit.log", username, PROGRAMS[who])
        annotations = [e.get("annotations") or {} for e in made]
        refused = [e for e, a in zip(made, annotations)
                   if a.get("authorization.k8s.io/decision") == "forbid"]
        forbidden = [e for e in refused if not starting(e)]
        for e in refused:
            if starting(e):
                print(f"  refused during apiserver start-up: {e['verb']} {e.get('requestURI')}")
        denied = [e for e, a in zip(made, annotations)
                  if any(k.startswith("validation.policy.admission.k8s.io/validation_failure") for k in a)]
        other = [e for e in made if e.get("responseStatus", {}).get("code") == 403
                 and e not in refused and e not in denied]
        # A write into a namespace being deleted is the one refusal that is not the chart's
        # fault; any other 403 (an admission plugin such as OwnerReferencesPermissionEnforcement
        # refusing for want of a grant) fails the check.
        benign = [e for e in other if "NamespaceTerminating" in json.dumps(e["responseStatus"])]
        other_refused = [e for e in other if e not in benign]
        used = {k for e in made for k in keys(e)}
        print(f"{who} ({username}): {len(made)} requests, {len(forbidden)} not authorized, "
              f"{len(denied)} denied by an admission policy, {len(granted)} granted (group, resource, verb)")
        for e in forbidden:
            failed = True
            print(f"  NOT AUTHORIZED {e['verb']} {e.get('requestURI')}")
        for e in denied:
            failed = True
            print(f"  DENIED BY POLICY {e['verb']} {e.get('requestURI')}: {e['responseStatus'].get('message')}")
        for e in benign:
            print(f"  refused (namespace terminating): {e['verb']} {e.get('requestURI')}")
        for e in other_refused:
            failed = True
            print(f"  REFUSED {e['verb']} {e.get('requestURI')}: {e['responseStatus'].get('message')}")
        if not made:
            continue
        for g, r, v in sorted(granted):
            if (g, r, v) in used:
                continue
            why = ALLOWED_UNUSED.get((who, g, r, v))
            if why:
                print(f"  unused, allowed: {g or 'core'}/{r} {v}: {why}")
            else:
                failed = True
                print(f"  UNUSED GRANT {g or 'core'}/{r} {v} (scopes {sorted(granted[(g, r, v)])})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
