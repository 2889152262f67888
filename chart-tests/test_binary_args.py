"""The binaries accept every argument the chart passes them.

For every render variant (conftest.VARIANTS, plus a few renders below that move addresses, ports
and images away from their defaults), every container running one of our images (the controller
Deployment, the agent DaemonSet, the model-cache pre-delete hook Job, any `helm test` pod) is run
as the kubelet would start it -- the image's ENTRYPOINT/CMD (read from Dockerfile.controller and
Dockerfile.agent) combined with the container's `command`/`args` the Kubernetes way, `$(VAR)`
references expanded from the container's env -- with `--help` appended. clap handles `--help`
only after it has accepted every argument before it: an unknown flag, a flag on the wrong
subcommand or a value its parser rejects (a socket address, a bool, an enum) exits 2.

Not covered: values clap reads from environment variables (clap validates those only after the
command line, and `--help` ends parsing first), and rules the binary checks after parsing.

The binaries come from $IC_BIN_DIR (default $CARGO_TARGET_DIR/debug, else <repo>/target/debug).
They must be built first (a missing one fails the test, it never skips):
`cargo build --workspace --bins --locked` (scripts/test.sh does it before the chart tests).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import (
    CHART_DIR,
    CUSTOM_PORTS,
    ROOT,
    VARIANTS,
    Rendered,
    containers,
    pod_specs,
    render,
    variant_named,
)

BIN_DIR = Path(
    os.environ.get("IC_BIN_DIR")
    or Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target") / "debug"
)

# Image (values key) -> (binary name, Dockerfile). The Dockerfile's ENTRYPOINT/CMD say how the
# container's command/args reach the binary.
IMAGES = {
    "controller": ("ic-controller", ROOT / "Dockerfile.controller"),
    "agent": ("ic-agent", ROOT / "Dockerfile.agent"),
}

# Plausible values of the Downward API fields the chart's containers use.
POD_IPV4 = "10.244.3.17"
POD_IPV6 = "fd00:10:244::17"

# Renders beyond conftest.VARIANTS that change what the flags are built from.
EXTRA_RENDERS: dict[str, tuple[dict[str, Any], str]] = {
    # Every port away from its default.
    "custom-ports": (CUSTOM_PORTS, POD_IPV4),
    # IPv6 bind addresses, as values.yaml documents them.
    "ipv6": (
        {
            "controller": {"bindAddress": "::"},
            "agent": {"metricsBindAddress": "[$(POD_IP)]"},
        },
        POD_IPV6,
    ),
    # IPv6 bind addresses with the agent outside the host network (--http-addr on the pod IP).
    "ipv6-agent-pod-network": (
        {
            "controller": {"bindAddress": "::"},
            "agent": {"hostNetwork": False, "metricsBindAddress": "[$(POD_IP)]"},
        },
        POD_IPV6,
    ),
    # Self-signed webhooks with model cache off, plain logs, names and images overridden.
    "overrides": (
        {
            "fullnameOverride": "ic",
            "logFormat": "plain",
            "webhook": {"certMode": "selfSigned"},
            "modelCache": {"featureGates": "CachingSupport=true,ModelCacheEncryption=true"},
            "controller": {
                "image": {"digest": "sha256:" + "a" * 64},
                "leaderElection": {"leaseName": "my-lease"},
                "serviceAccount": {"name": "ctl"},
            },
            "agent": {
                "image": {"tag": "0.2.0"},
                "controllerURL": "http://ctl.example:50051",
                "checkIntervalSeconds": 30,
                "t2Scrape": {"intervalSeconds": 0, "timeoutMs": 500},
                "serviceAccount": {"name": "agt"},
            },
            "kvEventSubscriber": {"image": "registry.example/ic-agent:0.1.0", "controller": "ctl:50051"},
        },
        POD_IPV4,
    ),
}

RENDERS = sorted(VARIANTS) + sorted(EXTRA_RENDERS)


# ----------------------------------------------------------------------------- helpers


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def effective_values(values: dict[str, Any]) -> dict[str, Any]:
    return deep_merge(yaml.safe_load((CHART_DIR / "values.yaml").read_text()), values)


def dockerfile_exec_form(dockerfile: Path, instruction: str) -> list[str] | None:
    """The last ENTRYPOINT or CMD of the final stage, which must use the exec (JSON) form."""
    text = dockerfile.read_text()
    final_stage = re.split(r"^FROM\s", text, flags=re.M | re.I)[-1]
    found = re.findall(rf"^{instruction}\s+(.*)$", final_stage, flags=re.M | re.I)
    if not found:
        return None
    value = found[-1].strip()
    assert value.startswith("["), f"{dockerfile.name}: {instruction} must use the exec form: {value}"
    return json.loads(value)


def image_matches(image: str, repository: str) -> bool:
    return image.startswith(repository + ":") or image.startswith(repository + "@")


def which_image(image: str, values: dict[str, Any]) -> str | None:
    """"controller" or "agent" when the container runs one of our images, else None."""
    for key in IMAGES:
        if image_matches(image, values[key]["image"]["repository"]):
            return key
    return None


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (k8s.io/kubernetes third_party/forked/golang/expansion):
    `$(NAME)` becomes the value of NAME when the container defines it and stays as written
    otherwise; `$$` is a literal `$`."""
    out = []
    i = 0
    while i < len(s):
        if s[i] == "$" and i + 1 < len(s):
            nxt = s[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = s.find(")", i + 2)
                if end != -1:
                    name = s[i + 2 : end]
                    out.append(env[name] if name in env else s[i : end + 1])
                    i = end + 1
                    continue
        out.append(s[i])
        i += 1
    return "".join(out)


def field_value(obj: dict[str, Any], spec: dict[str, Any], path: str, pod_ip: str) -> str:
    namespace = obj["metadata"].get("namespace", "default")
    return {
        "metadata.name": f"{obj['metadata']['name']}-7d9c5",
        "metadata.namespace": namespace,
        "metadata.uid": "0b5e6c1a-2f0d-4c43-9a39-64c1d3f1f0a1",
        "spec.nodeName": "gpu-node-1",
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": pod_ip,
        "status.hostIPs": pod_ip,
    }.get(path, "placeholder")


def container_env(
    obj: dict[str, Any], spec: dict[str, Any], c: dict[str, Any], pod_ip: str
) -> dict[str, str]:
    """The container's environment as the kubelet builds it (in order, each value expanded
    against the ones before it); Downward API and secret references get plausible values."""
    env: dict[str, str] = {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        else:
            ref = e.get("valueFrom") or {}
            if "fieldRef" in ref:
                env[e["name"]] = field_value(obj, spec, ref["fieldRef"]["fieldPath"], pod_ip)
            elif "resourceFieldRef" in ref:
                env[e["name"]] = "1"
            else:
                env[e["name"]] = "placeholder"
    return env


def argv_of(c: dict[str, Any], key: str, env: dict[str, str]) -> tuple[list[str], str | None]:
    """(argv with argv[0] = our binary, None) or ([], why it cannot be checked).

    Kubernetes: `command` replaces the image's ENTRYPOINT, `args` its CMD; with `command` and no
    `args`, the CMD is dropped too."""
    binary, dockerfile = IMAGES[key]
    entrypoint = dockerfile_exec_form(dockerfile, "ENTRYPOINT") or []
    cmd = dockerfile_exec_form(dockerfile, "CMD") or []
    command = c.get("command")
    args = c.get("args")
    if command is not None:
        argv = list(command) + list(args or [])
    else:
        argv = entrypoint + (list(args) if args is not None else cmd)
    argv = [expand(str(a), env) for a in argv]
    if not argv:
        return [], "neither the image nor the container sets a command"
    if Path(argv[0]).name != binary:
        return [], f"runs {argv[0]!r}, not {binary}: cannot check its arguments"
    return argv, None


def our_containers(r: Rendered) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]]:
    """(object, pod spec, container, image key) of every container running one of our images."""
    values = effective_values(r.values)
    out = []
    for obj, spec in pod_specs(r, include_hooks=True):
        for c in containers(spec):
            key = which_image(c["image"], values)
            if key:
                out.append((obj, spec, c, key))
    return out


def _rendered(name: str) -> tuple[Rendered, str]:
    if name in VARIANTS:
        return variant_named(name), POD_IPV4
    return _extra_render(name), EXTRA_RENDERS[name][1]


_extra_cache: dict[str, Rendered] = {}


def _extra_render(name: str) -> Rendered:
    if name not in _extra_cache:
        _extra_cache[name] = render(EXTRA_RENDERS[name][0])
    return _extra_cache[name]


# ----------------------------------------------------------------------------- the binaries


def built_binaries() -> dict[str, Path]:
    """The built binaries; a missing one fails the calling test (never skips: an unbuilt binary
    would let a rejected chart argument through)."""
    paths = {key: BIN_DIR / binary for key, (binary, _) in IMAGES.items()}
    missing = [str(p) for p in paths.values() if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        pytest.fail(
            "chart-tests/test_binary_args.py runs the chart's container arguments through the "
            f"real binaries, and these are missing: {', '.join(missing)}.\n"
            "Build them first: `cargo build --workspace --bins --locked` (scripts/test.sh does "
            "this before the chart tests), or point IC_BIN_DIR at a directory holding "
            "ic-controller and ic-agent.",
            pytrace=False,
        )
    return paths


# ----------------------------------------------------------------------------- tests


def test_binaries_are_built() -> None:
    built_binaries()


def test_dockerfiles_start_our_binaries() -> None:
    """The argv mapping below assumes each image's ENTRYPOINT is its binary."""
    for key, (binary, dockerfile) in IMAGES.items():
        entrypoint = dockerfile_exec_form(dockerfile, "ENTRYPOINT")
        assert entrypoint and Path(entrypoint[0]).name == binary, (
            f"{dockerfile.name}: ENTRYPOINT {entrypoint} does not start {binary}"
        )


def test_every_image_of_ours_is_checked() -> None:
    """Every binary entry point the chart uses shows up in some render (so that a change in how
    images are matched cannot make the test below check nothing)."""
    seen = set()
    for name in RENDERS:
        r, pod_ip = _rendered(name)
        values = effective_values(r.values)
        for obj, spec in pod_specs(r, include_hooks=True):
            for c in containers(spec):
                image_name = c["image"].split("@")[0].rsplit("/", 1)[-1].split(":")[0]
                assert image_name not in ("ic-controller", "ic-agent") or which_image(c["image"], values), (
                    f"{name}: {obj['kind']}/{obj['metadata']['name']} container {c['name']} runs "
                    f"{c['image']}, which is not controller.image or agent.image: teach "
                    "test_binary_args.py which binary it starts"
                )
        for obj, spec, c, key in our_containers(r):
            argv, _ = argv_of(c, key, container_env(obj, spec, c, pod_ip))
            if argv:
                seen.add((IMAGES[key][0], argv[1] if len(argv) > 1 else ""))
    assert {("ic-controller", "run"), ("ic-controller", "strip-finalizers"), ("ic-agent", "run")} <= seen, seen


@pytest.mark.parametrize("name", RENDERS)
def test_binaries_accept_the_chart_arguments(name: str) -> None:
    binaries = built_binaries()
    r, pod_ip = _rendered(name)
    found = our_containers(r)
    assert found, f"{name}: no container runs the controller or agent image"
    failures = []
    for obj, spec, c, key in found:
        where = f"{obj['kind']}/{obj['metadata']['name']} container {c['name']}"
        env = container_env(obj, spec, c, pod_ip)
        argv, why = argv_of(c, key, env)
        if why:
            failures.append(f"{where}: {why}")
            continue
        unexpanded = [a for a in argv if re.search(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", a)]
        if unexpanded:
            failures.append(
                f"{where}: $(VAR) reference to a variable the container does not define "
                f"(the kubelet passes it literally): {unexpanded}"
            )
        run_argv = [str(binaries[key])] + argv[1:] + ["--help"]
        # The container's own environment only: no IC_* or KUBECONFIG of the machine running
        # the tests.
        run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", **env}
        proc = subprocess.run(run_argv, env=run_env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            failures.append(
                f"{where}: exit {proc.returncode}\n"
                f"  argv: {shlex.join(argv)}\n"
                f"  stderr: {proc.stderr.strip()}"
            )
    assert not failures, f"render {name!r}:\n" + "\n".join(failures)
