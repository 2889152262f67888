#!/usr/bin/env python3
"""Generate chart/README.md from chart/Chart.yaml, the head text below and
the `# --` descriptions of chart/values.yaml (helm-docs conventions: a `# --` comment above a key
is its description; the table lists Key, Type, Default, Description for every documented key).

Usage: gen_chart_readme.py            print the README
       gen_chart_readme.py --write    write chart/README.md
       gen_chart_readme.py --check    exit 1 when chart/README.md differs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from gen_values_schema import ROOT, VALUES, parse_annotations

CHART = ROOT / "chart" / "Chart.yaml"
README = ROOT / "chart" / "README.md"

HEAD = """\
# {name}

![Version: {version}](https://img.shields.io/badge/Version-{version}-informational?style=flat-square)
![AppVersion: {appVersion}](https://img.shields.io/badge/AppVersion-{appVersion}-informational?style=flat-square)

{description}

Generated from `values.yaml` by `chart-tests/gen_chart_readme.py` (`scripts/chart-tests.sh
--regen`); a chart test fails when it is stale. Do not edit by hand.

## Install

On a cluster without cert-manager (the controller then makes its own webhook CA):

```sh
kubectl create namespace inference-cache
kubectl label namespace inference-cache pod-security.kubernetes.io/enforce=privileged
helm install inference-cache ./chart --namespace inference-cache --set webhook.certMode=selfSigned
```

With cert-manager, leave out `--set webhook.certMode=selfSigned` (the default, `certManager`,
needs its `cert-manager.io/v1` API). The namespace label is for the agent DaemonSet: it reads the
host's `/proc` with added capabilities, which the Pod Security `baseline` level forbids. These
three commands are what `scripts/install-tests.sh` runs on a local control plane (kwok nodes), with
`helm upgrade` and `helm uninstall` after them; `scripts/cluster.sh up --with-chart` leaves such
an install running to try.

Kubernetes {kubeVersion}. Helm installs `crds/` on the first install only; on `helm upgrade`
this chart's pre-upgrade hook (`crds.upgradeHook`) applies them first. Prerequisites,
certificates and upgrades are in [docs/install.md]({docs}/install.md); operating it (metrics,
dashboards, the opt-in PrometheusRule and its runbooks) in
[docs/operations.md]({docs}/operations.md) and
[docs/troubleshooting.md]({docs}/troubleshooting.md).

## Sizing the controller

Each controller replica holds the whole KV-prefix index in memory: about **35–44 bytes per
(block, replica) entry** in the index itself at 10–30 M entries (it depends on the block
tables' load; `inferencecache_controller_index_heap_bytes` shows it), **73–86 bytes per entry
all-in** for the whole process with thousands of agents and replicas (measured at 10–30 M
entries, [docs/scaling.md]({docs}/scaling.md); `inferencecache_controller_index_entries` is the
live count) on top of its idle footprint (`process_resident_memory_bytes` of an idle controller,
about 21 MiB). Allow headroom for table growth and a reconnect storm:

    memory limit ≈ idle RSS + 1.3 × 86 B × entries

Entries ≈ engine replicas × KV blocks each holds (GPU KV-cache bytes ÷ bytes per block; with
`keepsL2`, plus the offload tier's blocks). For example 200 replicas × 50 000 blocks = 10 M
entries ≈ 0.86 GB all-in, ≈ 1.1 GB with headroom: set `controller.resources.limits.memory: 1200Mi`.
Where one controller stops sufficing and the sharded design beyond it: docs/scaling.md.
Alert on `process_resident_memory_bytes` against the limit (docs/operations.md "Capacity").

## Sizing the agent

The node agent keeps, per engine KV-event stream, the blocks its engines hold (to key children
and report removals) and a bounded list of recently removed blocks. Its memory therefore grows
with the blocks held on the node and with the number of streams that churn. Measured with
`scripts/footprint.sh --blocks` (release agent, one vLLM stream: vLLM's own publisher churning
at 20 000 block events/s, a controller receiving; [docs/benchmarks.md]({docs}/benchmarks.md)
"Agent memory by held blocks"):

| blocks held | 16 k | 65 k | 100 k | 300 k |
|---|---|---|---|---|
| RSS during churn, max | 16 MiB | 23 MiB | 31 MiB | 52 MiB |
| peak (VmHWM) | 16 MiB | 23 MiB | 31 MiB | 52 MiB |

    memory limit ≈ 1.5 × (12 MiB + 0.25 KiB × blocks held)

The default (`agent.resources`: request 64Mi, limit 256Mi) covers about 650 k blocks on the node;
for 1 M blocks or more set `agent.resources.limits.memory: 512Mi`. Blocks held ≈ the
sum over the node's engines of their GPU KV-cache blocks (vLLM logs `num_gpu_blocks`), plus the
offload tier's with `keepsL2`. Watch `container_memory_working_set_bytes{{container="agent"}}`.

## Values

| Key | Type | Default | Description |
|-----|------|---------|-------------|
"""


def type_of(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "list"
    return "object"


def default_of(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False)
    return "`" + text.replace("|", "\\|") + "`"


def rows() -> list[str]:
    text = VALUES.read_text()
    values = yaml.safe_load(text)
    ann = parse_annotations(text)
    out: list[str] = []

    def walk(v: Any, path: tuple[str, ...]) -> None:
        a = ann.get(path, {})
        if isinstance(v, dict) and v and "additionalProperties" not in a.get("schema", {}):
            for k, child in v.items():
                walk(child, path + (str(k),))
            return
        desc = a.get("description", "").replace("|", "\\|")
        out.append(f"| {'.'.join(path)} | {type_of(v)} | {default_of(v)} | {desc} |")

    walk(values, ())
    return out


def generate() -> str:
    chart = yaml.safe_load(CHART.read_text())
    head = HEAD.format(
        name=chart["name"],
        version=chart["version"],
        appVersion=chart["appVersion"],
        description=" ".join(chart["description"].split()),
        kubeVersion=chart.get("kubeVersion", ""),
        # Absolute: the chart is read packaged (Artifact Hub, `helm show readme`), away from docs/.
        docs=chart["home"] + "/blob/main/docs",
    )
    return head + "\n".join(rows()) + "\n"


def main(argv: list[str]) -> int:
    out = generate()
    if "--write" in argv:
        if not README.exists() or README.read_text() != out:
            README.write_text(out)
            print(f"wrote {README.relative_to(ROOT)}")
        return 0
    if "--check" in argv:
        if not README.exists() or README.read_text() != out:
            print(f"{README.relative_to(ROOT)} is stale: run scripts/chart-tests.sh --regen")
            return 1
        return 0
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
