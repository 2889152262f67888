"""Least privilege, read from the real apiserver's audit log (docs/real-cluster.md).

For each identity the chart creates (the controller's ServiceAccount; the agent's), from the
audit log `scripts/cluster.sh` makes the apiserver write (every request, with its user, verb,
resource and response code) and the chart's rendered RBAC (objects.yaml, written by
cluster/chart_objects.py):

1. every request the identity made was allowed: no 403 (a missing grant);
2. every (apiGroup, resource, verb) the chart grants it was used by some request: a grant
   nothing uses is more privilege than the job needs. Grants listed in ALLOWED_UNUSED say
   why no scenario here exercises them.

usage: audit_check.py STATE_DIR   (exit 1 when a check fails; the report goes to stdout)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import yaml

NAMESPACE = "inference-cache"
IDENTITIES = {
    "controller": f"system:serviceaccount:{NAMESPACE}:inference-cache-controller",
    "agent": f"system:serviceaccount:{NAMESPACE}:inference-cache-agent",
}
# (identity, apiGroup, resource, verb) -> why no scenario on this control plane uses it.
ALLOWED_UNUSED: dict[tuple[str, str, str, str], str] = {}


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


def requests(audit_log: Path, username: str) -> list[dict]:
    out = []
    for line in audit_log.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("stage") != "ResponseComplete" or e.get("user", {}).get("username") != username:
            continue
        out.append(e)
    return out


def key(e: dict) -> tuple[str, str, str] | None:
    ref = e.get("objectRef")
    if not ref:
        return None
    resource = ref.get("resource", "")
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return (ref.get("apiGroup", ""), resource, e["verb"])


def main() -> int:
    state = Path(sys.argv[1])
    objects = [d for d in yaml.safe_load_all((state / "objects.yaml").read_text()) if d]
    failed = False
    for who, username in IDENTITIES.items():
        granted = grants(objects, username)
        made = requests(state / "audit.log", username)
        forbidden = [e for e in made if e.get("responseStatus", {}).get("code") == 403]
        used = {k for e in made if (k := key(e))}
        print(f"{who} ({username}): {len(made)} requests, {len(forbidden)} forbidden, "
              f"{len(granted)} granted (group, resource, verb)")
        for e in forbidden:
            failed = True
            print(f"  FORBIDDEN {e['verb']} {e.get('requestURI')}")
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
