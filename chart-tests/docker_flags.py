"""`docker run` flags for a workload the chart renders, derived from the rendered object (never a
hand copy): the container's securityContext, the pod's hostPID/hostNetwork, its volumes and
mounts, and its literal environment. scripts/image-tests.sh runs the agent and controller images
with them (issue 15 item 6: the agent under exactly the DaemonSet's securityContext).

    python docker_flags.py agent|controller --workdir DIR [--set key=value ...]

prints one flag per line. Anything the mapping does not know (a securityContext field, a volume
kind, a seccomp profile) is an error, so a chart change cannot silently weaken the test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import render  # noqa: E402
from test_chart import agent_daemonset, controller_deployment, the_container  # noqa: E402


class Unmapped(Exception):
    """A rendered field this mapping cannot express as a docker flag."""


def security_flags(sc: dict[str, Any]) -> list[str]:
    """Container securityContext → docker flags. Docker's default seccomp profile is what
    `RuntimeDefault` means for the Docker/containerd runtimes; `runAsNonRoot` has no flag (the
    caller checks the image's user)."""
    flags: list[str] = []
    known = {
        "privileged", "capabilities", "readOnlyRootFilesystem", "runAsUser", "runAsGroup",
        "allowPrivilegeEscalation", "seccompProfile", "runAsNonRoot",
    }
    extra = set(sc) - known
    if extra:
        raise Unmapped(f"securityContext fields without a docker flag: {sorted(extra)}")
    if sc.get("privileged"):
        flags.append("--privileged")
    caps = sc.get("capabilities") or {}
    if set(caps) - {"add", "drop"}:
        raise Unmapped(f"capabilities fields: {sorted(caps)}")
    for c in caps.get("drop") or []:
        flags += ["--cap-drop", c]
    for c in caps.get("add") or []:
        flags += ["--cap-add", c]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if "runAsUser" in sc:
        user = str(sc["runAsUser"])
        if "runAsGroup" in sc:
            user += f":{sc['runAsGroup']}"
        flags += ["--user", user]
    elif "runAsGroup" in sc:
        raise Unmapped("runAsGroup without runAsUser")
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    seccomp = (sc.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        flags += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise Unmapped(f"seccompProfile {seccomp}")
    return flags


def pod_flags(spec: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    if spec.get("hostPID"):
        flags += ["--pid", "host"]
    if spec.get("hostNetwork"):
        flags += ["--network", "host"]
    if spec.get("hostIPC"):
        flags += ["--ipc", "host"]
    return flags


def volume_flags(spec: dict[str, Any], container: dict[str, Any], workdir: Path) -> list[str]:
    """hostPath → bind mount (read-only as mounted; HostToContainer → rslave), emptyDir →
    tmpfs of its sizeLimit, projected service-account token → a file with a placeholder token."""
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    flags: list[str] = []
    for m in container.get("volumeMounts") or []:
        v = volumes[m["name"]]
        ro = m.get("readOnly", False)
        if "hostPath" in v:
            src = v["hostPath"]["path"]
            if v["hostPath"].get("type") == "DirectoryOrCreate":
                Path(src).mkdir(parents=True, exist_ok=True)
            opts = ["ro"] if ro else []
            if m.get("mountPropagation") == "HostToContainer":
                opts.append("rslave")
            elif m.get("mountPropagation") not in (None, "None"):
                raise Unmapped(f"mountPropagation {m['mountPropagation']}")
            flags += ["-v", f"{src}:{m['mountPath']}" + (":" + ",".join(opts) if opts else "")]
        elif "emptyDir" in v:
            size = (v["emptyDir"] or {}).get("sizeLimit")
            flags += ["--tmpfs", m["mountPath"] + (f":size={size.replace('Mi', 'm')}" if size else "")]
        elif "projected" in v:
            d = workdir / f"volume-{m['name']}"
            d.mkdir(parents=True, exist_ok=True)
            for src in v["projected"]["sources"]:
                if "serviceAccountToken" not in src:
                    raise Unmapped(f"projected source {sorted(src)}")
                (d / src["serviceAccountToken"]["path"]).write_text("placeholder-token\n")
            flags += ["-v", f"{d}:{m['mountPath']}" + (":ro" if ro else "")]
        else:
            raise Unmapped(f"volume {m['name']}: {sorted(set(v) - {'name'})}")
    return flags


def env_flags(container: dict[str, Any], node: str, pod_ip: str) -> list[str]:
    flags: list[str] = []
    fields = {"spec.nodeName": node, "status.podIP": pod_ip}
    for e in container.get("env") or []:
        if "value" in e:
            flags += ["-e", f"{e['name']}={e['value']}"]
        elif "fieldRef" in (e.get("valueFrom") or {}):
            flags += ["-e", f"{e['name']}={fields[e['valueFrom']['fieldRef']['fieldPath']]}"]
        else:
            raise Unmapped(f"env {e['name']}: {e}")
    return flags


def workload_flags(kind: str, values: dict[str, Any], workdir: Path, node: str = "image-test-node") -> list[str]:
    r = render(values)
    workload = agent_daemonset(r) if kind == "agent" else controller_deployment(r)
    spec = workload["spec"]["template"]["spec"]
    container = the_container(workload)
    flags = pod_flags(spec) + security_flags(container.get("securityContext") or {})
    if kind == "agent":
        flags += volume_flags(spec, container, workdir)
        flags += env_flags(container, node, "127.0.0.1")
    return flags


def _set(values: dict[str, Any], assignment: str) -> None:
    key, _, raw = assignment.partition("=")
    *path, last = key.split(".")
    d = values
    for p in path:
        d = d.setdefault(p, {})
    d[last] = raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["agent", "controller"])
    ap.add_argument("--workdir", type=Path, required=True, help="where projected volumes are made")
    ap.add_argument("--set", action="append", default=[], help="a chart value (dotted key=string)")
    a = ap.parse_args()
    values: dict[str, Any] = {}
    for s in a.set:
        _set(values, s)
    try:
        flags = workload_flags(a.kind, values, a.workdir)
    except Unmapped as e:
        print(f"docker_flags: {e}", file=sys.stderr)
        return 1
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
