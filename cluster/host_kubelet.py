"""The kubelet's part for the chart's hook Jobs on `scripts/cluster.sh up --with-chart`.

kwok (cluster/kwok-nodes.yaml) takes every other pod to Running without running anything; its
stages are told to leave the pods of the chart's hook Jobs alone (labels
`app.kubernetes.io/component` in HOST_COMPONENTS). This process runs those pods' container
**for real, on this host**: the controller image's entrypoint is `ic-controller`, so the
container's `args` run as `IC_CONTROLLER_BIN <args>` with

- the pod's ServiceAccount identity: a token bound to the pod (TokenRequest), in a kubeconfig
  given as KUBECONFIG — the hook gets exactly the RBAC the chart gives it;
- its ConfigMap volumes written to a directory per pod, and every argument naming a mount path
  pointed at that directory instead;

then writes the outcome as the kubelet would: `status.phase` Succeeded or Failed, the
container terminated with its exit code. The Job controller (kube-controller-manager) does the
rest, and Helm sees its hook succeed or fail. Output goes to stdout (the component's log).

usage: IC_KUBECTL=… host_kubelet.py STATE_DIR CONTROLLER_BIN   (runs until killed)
       host_kubelet.py --kwok-stages IN OUT   (kwok's stages, keeping off these pods)
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

# The chart's hook Jobs whose pods run here (chart/templates/crd-upgrade-hook.yaml,
# model-cache-uninstall-hook.yaml); cluster.sh keeps kwok's stages off these.
HOST_COMPONENTS = ("crd-upgrade", "model-cache-uninstall")


def kubectl(state: Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        [os.environ["IC_KUBECTL"], "--kubeconfig", str(state / "admin.kubeconfig"), *args],
        input=stdin, capture_output=True, text=True, check=True,
    ).stdout


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_pod(state: Path, controller_bin: str, pod: dict) -> None:
    meta, spec = pod["metadata"], pod["spec"]
    ns, name = meta["namespace"], meta["name"]
    (container,) = spec["containers"]
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=state / "host-pods"))
    # The pod's identity: a token of its ServiceAccount bound to the pod.
    token = kubectl(state, "create", "token", spec.get("serviceAccountName", "default"), "-n", ns,
                    "--bound-object-kind", "Pod", "--bound-object-name", name,
                    "--bound-object-uid", meta["uid"], "--duration", "1h").strip()
    server = json.loads(kubectl(state, "config", "view", "--raw", "-o", "json"))["clusters"][0]["cluster"]
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "pod",
        "clusters": [{"name": "local", "cluster": server}],
        "users": [{"name": "pod", "user": {"token": token}}],
        "contexts": [{"name": "pod", "context": {"cluster": "local", "user": "pod", "namespace": ns}}],
    }
    (work / "kubeconfig").write_text(json.dumps(kubeconfig))
    # ConfigMap volumes, at their mount paths.
    mounts: dict[str, Path] = {}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        v = volumes.get(m["name"], {})
        if "configMap" in v:
            cm = json.loads(kubectl(state, "get", "configmap", v["configMap"]["name"], "-n", ns, "-o", "json"))
            d = work / m["name"]
            d.mkdir()
            for key, text in (cm.get("data") or {}).items():
                (d / key).write_text(text)
            for key, b64 in (cm.get("binaryData") or {}).items():
                (d / key).write_bytes(base64.b64decode(b64))
            mounts[m["mountPath"]] = d
    args = []
    for a in container.get("args", []):
        for path, local in mounts.items():
            a = a.replace(path, str(local))
        args.append(a)
    env = dict(os.environ, KUBECONFIG=str(work / "kubeconfig"))
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    started = now()
    print(f"{started} {ns}/{name}: ic-controller {' '.join(args)}", flush=True)
    proc = subprocess.run([controller_bin, *args], env=env, capture_output=True, text=True)
    print(proc.stdout + proc.stderr, flush=True)
    print(f"{now()} {ns}/{name}: exit {proc.returncode}", flush=True)
    phase = "Succeeded" if proc.returncode == 0 else "Failed"
    status = {"status": {
        "phase": phase,
        "startTime": started,
        "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now()}],
        "containerStatuses": [{
            "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
            "restartCount": 0, "started": False,
            "state": {"terminated": {"exitCode": proc.returncode, "reason": "Completed" if proc.returncode == 0 else "Error",
                                     "startedAt": started, "finishedAt": now(),
                                     "message": (proc.stderr or "")[-1024:]}},
        }],
    }}
    kubectl(state, "patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status))


def kwok_stages(src: Path, out: Path) -> None:
    """kwok's pod stages that would take a pod to Running (pod-ready) or Succeeded
    (pod-complete), told to leave the HOST_COMPONENTS pods alone."""
    import yaml

    docs = [d for d in yaml.safe_load_all(src.read_text()) if d]
    for d in docs:
        if d["metadata"]["name"] in ("pod-ready", "pod-complete"):
            d["spec"]["selector"]["matchExpressions"].append({
                "key": '.metadata.labels["app.kubernetes.io/component"]',
                "operator": "NotIn",
                "values": list(HOST_COMPONENTS),
            })
    out.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def main() -> None:
    if sys.argv[1] == "--kwok-stages":
        kwok_stages(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    state, controller_bin = Path(sys.argv[1]), sys.argv[2]
    (state / "host-pods").mkdir(exist_ok=True)
    done: set[str] = set()
    selector = f"app.kubernetes.io/component in ({','.join(HOST_COMPONENTS)})"
    while True:
        try:
            pods = json.loads(kubectl(state, "get", "pods", "-A", "-l", selector, "-o", "json"))["items"]
        except subprocess.CalledProcessError as e:
            print(f"{now()} listing pods: {e.stderr.strip()}", flush=True)
            pods = []
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if uid in done or not pod["spec"].get("nodeName") or pod.get("status", {}).get("phase") != "Pending":
                continue
            if pod["metadata"].get("deletionTimestamp"):
                continue
            done.add(uid)
            try:
                run_pod(state, controller_bin, pod)
            except subprocess.CalledProcessError as e:
                print(f"{now()} {pod['metadata']['name']}: {e} {e.stderr}", flush=True)
        time.sleep(1)


if __name__ == "__main__":
    main()
