"""The kubelet's part for the pods of `scripts/cluster.sh up --with-chart` that must run for real.

kwok (cluster/kwok-nodes.yaml) takes every other pod to Running without running anything; its
stages (`--kwok-stages`) are told to leave these pods alone, and this process runs their one
container **on this host**:

- the chart's hook Jobs (`app.kubernetes.io/component` in HOOK_COMPONENTS: the CRD upgrade, the
  model cache's finalizer strip), on whatever node they were scheduled to;
- the chart's `helm test` pods (component `test`), on whatever node: the controller's
  grpc-health-probe reaches the controller through its Service, as from any node. A pod in the
  node's network namespace (`hostNetwork`, the agent /readyz test) runs only on HOST_NODE, the
  one node whose network namespace is this host's: landing on another (a kwok node, where
  nothing listens) it fails at once, saying so;
- the agent DaemonSet's pod on HOST_NODE (component `agent`): a real `ic-agent` process, kept
  running (restarted with the kubelet's back-off when it exits), its readiness probe run and
  written to the pod (so `helm install --wait` waits for a really ready agent), stopped when its
  pod is deleted. The agent pods on the other GPU nodes stay kwok's.

What a container gets, as from a kubelet:

- its image's program on this host: IMAGE_PROGRAMS (ic-controller and ic-agent of this build,
  grpc-health-probe built by cluster/build.sh; for the busybox image, its command with only
  this host's sh, wget (one try, as busybox's), cat, echo and sleep on PATH) run with
  the container's `command`/`args`, `$(VAR)` references expanded from its environment;
- its environment: `value`s and the fieldRefs a kubelet resolves (spec.nodeName,
  status.podIP/hostIP: 127.0.0.1 on HOST_NODE, the address kwok gives every node here,
  metadata.name/namespace, spec.serviceAccountName), nothing inherited from this process;
- its volumes, each at a directory of the pod (`STATE/host-pods/<pod>-…/<volume>`) that every
  argument and environment value naming the mount path is pointed at: ConfigMaps and Secrets
  written out; projected ServiceAccount tokens requested for the pod (TokenRequest bound to the
  pod, with the volume's audience and lifetime, renewed at 80% of it as the kubelet does);
  emptyDirs; hostPaths: this host's path when mounted read-only and present (/proc, /sys,
  /dev/shm: the agent's checks read this host), else a directory of the node under
  `STATE/node-root/<node>/` (writable node state is not shared between clusters on one host);
- the pod's identity: hooks get a kubeconfig with a token of the pod's ServiceAccount bound to
  the pod (as KUBECONFIG), so they have exactly the RBAC the chart gives them;
- cluster DNS: the Services of the cluster (`<svc>.<ns>.svc[.cluster.local]`, and `<svc>`,
  `<svc>.<ns>` in the pod's namespace) resolve to their ClusterIP through an /etc/hosts of the
  pod, bind-mounted over /etc/hosts in a mount namespace of its own (`unshare`) and rewritten
  in place every 10 s; cluster.sh's DNAT rules take the ClusterIPs of the controller's
  Services to the controller on this host (kube-proxy's job);
- its user: runAsUser/runAsGroup (container, else pod) through `setpriv`.

The outcome is written as the kubelet would: phase, conditions, container state and exit
code. Output goes to stdout (the component's log, with each pod's command line and
`<ns>/<pod>: exit N`) and to one log file per container, served at the kubelet API's
`/containerLogs/<ns>/<pod>/<container>` over HTTPS (`--logs-port`: kwok gives every node this
port as its kubelet endpoint, so `kubectl logs` and `helm test --logs` read what ran; a pod kwok
plays has no logs, and the answer says so).

usage: IC_KUBECTL=… host_kubelet.py STATE_DIR CONTROLLER_BIN AGENT_BIN TOOLS_DIR \\
           --logs-port PORT --tls-cert CRT --tls-key KEY   (runs until killed)
       host_kubelet.py --kwok-stages IN OUT   (kwok's stages, keeping off these pods)
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

# The chart's hook Jobs whose pods run here (chart/templates/crd-upgrade-hook.yaml,
# model-cache-uninstall-hook.yaml) and its `helm test` pods (chart/templates/tests/), on any node.
HOOK_COMPONENTS = ("crd-upgrade", "model-cache-uninstall")
TEST_COMPONENT = "test"
# The node whose kubelet this process is (cluster/kwok-nodes.yaml): its network namespace is this
# host's, and its agent DaemonSet pod runs here for real.
HOST_NODE = "kwok-gpu-0"
HOST_NODE_COMPONENTS = ("agent",)
# The address of every node here (kwok --node-ip): on HOST_NODE, this host's loopback.
NODE_IP = "127.0.0.1"
# Image (last path element, without tag or digest) → the program its entrypoint is here; a
# busybox image's command runs with only BUSYBOX_APPLETS on PATH (this host's).
IMAGE_PROGRAMS = ("ic-controller", "ic-agent", "grpc-health-probe", "busybox")
BUSYBOX_APPLETS = ("sh", "wget", "cat", "echo", "sleep")
# The kubelet's crash back-off: 10 s doubling up to 5 min.
BACKOFF_START_S, BACKOFF_MAX_S = 10.0, 300.0
PATH_DEFAULT = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# This host's tools that put a container in place (resolved at start: `main`).
HOST_TOOLS = {"unshare": "", "mount": "", "setpriv": "", "sh": ""}


def log(msg: str) -> None:
    print(f"{now()} {msg}", flush=True)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kubelet:
    def __init__(self, state: Path, programs: dict[str, str]):
        self.state = state
        self.programs = programs
        self.pods_dir = state / "host-pods"
        self.logs_dir = self.pods_dir / "logs"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.running: dict[str, Running] = {}  # pod uid → long-running container
        self.done: set[str] = set()
        self.hosts_files: list[Path] = []
        self.lock = threading.Lock()

    # --- the API -------------------------------------------------------------------------------
    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return subprocess.run(
            [os.environ["IC_KUBECTL"], "--kubeconfig", str(self.state / "admin.kubeconfig"), *args],
            input=stdin, capture_output=True, text=True, check=True, timeout=60,
        ).stdout

    def patch_status(self, pod: dict, status: dict) -> None:
        meta = pod["metadata"]
        self.kubectl("patch", "pod", meta["name"], "-n", meta["namespace"], "--subresource=status",
                     "--type=merge", "-p", json.dumps({"status": status}))

    def token(self, pod: dict, audience: str | None, seconds: int) -> str:
        meta = pod["metadata"]
        args = ["create", "token", pod["spec"].get("serviceAccountName", "default"), "-n", meta["namespace"],
                "--bound-object-kind", "Pod", "--bound-object-name", meta["name"],
                "--bound-object-uid", meta["uid"], "--duration", f"{seconds}s"]
        if audience:
            args += ["--audience", audience]
        return self.kubectl(*args).strip()

    # --- cluster DNS ---------------------------------------------------------------------------
    def services(self) -> list[dict]:
        return json.loads(self.kubectl("get", "services", "-A", "-o", "json"))["items"]

    @staticmethod
    def hosts_text(namespace: str, services: list[dict]) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for svc in services:
            ip = svc["spec"].get("clusterIP")
            if not ip or ip == "None":
                continue  # headless: its names would be its endpoints' pod IPs, unrouted here
            name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
            names = [f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]
            if ns == namespace:
                names += [name, f"{name}.{ns}"]
            lines.append(f"{ip} {' '.join(names)}")
        return "\n".join(lines) + "\n"

    def refresh_hosts(self) -> None:
        """The /etc/hosts of every running container, rewritten when the Services changed."""
        with self.lock:
            paths = list(self.hosts_files)
        if not paths:
            return
        try:
            services = self.services()
        except subprocess.SubprocessError:
            return
        for path in paths:
            text = self.hosts_text(path.parent.name.split("@", 1)[0], services)
            if path.exists() and path.read_text() != text:
                with open(path, "r+") as f:  # in place: the bind mount holds this inode
                    f.seek(0)
                    f.write(text)
                    f.truncate()

    # --- a container's process -----------------------------------------------------------------
    def prepare(self, pod: dict) -> Prepared:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        (container,) = spec["containers"]
        work = Path(tempfile.mkdtemp(prefix=f"{ns}@{name}-", dir=self.pods_dir))
        node = spec.get("nodeName", "")
        tokens: list[TokenFile] = []
        mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):
            v = volumes.get(m["name"], {})
            d = work / "volumes" / m["name"]
            if "configMap" in v or "secret" in v:
                d.mkdir(parents=True)
                kind, ref = ("configmap", v["configMap"]["name"]) if "configMap" in v else ("secret", v["secret"]["secretName"])
                obj = json.loads(self.kubectl("get", kind, ref, "-n", ns, "-o", "json"))
                texts = obj.get("data") or {}
                binary = obj.get("binaryData") or {}
                if kind == "secret":
                    texts, binary = {}, texts
                for key, text in texts.items():
                    (d / key).write_text(text)
                for key, b64 in binary.items():
                    (d / key).write_bytes(base64.b64decode(b64))
            elif "projected" in v:
                d.mkdir(parents=True)
                for source in v["projected"].get("sources", []):
                    if "serviceAccountToken" in source:
                        t = source["serviceAccountToken"]
                        tf = TokenFile(d / t["path"], t.get("audience"), int(t.get("expirationSeconds", 3600)))
                        tf.renew(self, pod)
                        tokens.append(tf)
                    elif "configMap" in source:
                        cm = json.loads(self.kubectl("get", "configmap", source["configMap"]["name"], "-n", ns, "-o", "json"))
                        for key, text in (cm.get("data") or {}).items():
                            (d / key).write_text(text)
                    else:
                        log(f"{ns}/{name}: projected source {list(source)} left empty")
            elif "emptyDir" in v:
                d.mkdir(parents=True)
            elif "hostPath" in v:
                host = Path(v["hostPath"]["path"])
                if m.get("readOnly") and host.exists():
                    d = host
                else:
                    d = self.state / "node-root" / node / str(host).lstrip("/")
                    d.mkdir(parents=True, exist_ok=True)
            else:
                log(f"{ns}/{name}: volume {m['name']} ({list(v)}) not provided")
                continue
            mounts[m["mountPath"]] = d
        # Environment: the container's, as the kubelet resolves it.
        fields = {
            "spec.nodeName": node, "status.podIP": NODE_IP, "status.hostIP": NODE_IP,
            "metadata.name": name, "metadata.namespace": ns,
            "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        }
        env = {"PATH": PATH_DEFAULT, "HOME": "/", "HOSTNAME": node if spec.get("hostNetwork") else name}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = fields.get(e["valueFrom"]["fieldRef"]["fieldPath"], "")
        for k, val in env.items():
            env[k] = remap(val, mounts)
        image = container["image"].rsplit("/", 1)[-1].split("@")[0].split(":")[0]
        program = self.programs.get(image)
        if program is None:
            raise PodError(f"no program on this host for image {container['image']}")
        words = [expand(a, env) for a in container.get("command", []) + container.get("args", [])]
        words = [remap(a, mounts) for a in words]
        if image == "busybox":
            env["PATH"] = program  # the applets' directory
            if not words:
                raise PodError("busybox container without a command")
            found = shutil.which(words[0], path=program)
            if found is None:
                raise PodError(f"{words[0]}: not found (this host provides {', '.join(BUSYBOX_APPLETS)})")
            argv = [found, *words[1:]]
        else:
            argv = [program, *words] if not container.get("command") else [program, *words[1:]]
        if image == "ic-controller":
            # The hook's identity: a token of its ServiceAccount bound to the pod.
            server = json.loads(self.kubectl("config", "view", "--raw", "-o", "json"))["clusters"][0]["cluster"]
            kubeconfig = {
                "apiVersion": "v1", "kind": "Config", "current-context": "pod",
                "clusters": [{"name": "local", "cluster": server}],
                "users": [{"name": "pod", "user": {"token": self.token(pod, None, 3600)}}],
                "contexts": [{"name": "pod", "context": {"cluster": "local", "user": "pod", "namespace": ns}}],
            }
            (work / "kubeconfig").write_text(json.dumps(kubeconfig))
            env["KUBECONFIG"] = str(work / "kubeconfig")
        hosts = work / "hosts"
        hosts.write_text(self.hosts_text(ns, self.services()))
        with self.lock:
            self.hosts_files.append(hosts)
        sc = {**(spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup", sc.get("runAsUser"))
        if uid:
            for p in [work, *work.rglob("*")]:
                if not p.is_symlink():
                    os.chown(p, uid, gid or 0)
        # A mount namespace of its own with the pod's /etc/hosts; then the container's user.
        # (This host's tools by absolute path: the container's PATH may hold other ones.)
        wrapper = f'{HOST_TOOLS["mount"]} --bind "$0" /etc/hosts && exec "$@"'
        cmd = [HOST_TOOLS["unshare"], "--mount", "--propagation", "private", "--", HOST_TOOLS["sh"], "-c", wrapper,
               str(hosts)]
        if uid:
            cmd += [HOST_TOOLS["setpriv"], f"--reuid={uid}", f"--regid={gid or 0}", "--clear-groups"]
        log_file = self.logs_dir / f"{ns}_{name}_{container['name']}.log"
        return Prepared(cmd + argv, env, work, log_file, tokens, " ".join([image, *words]))

    # --- run-to-completion pods: hooks and tests -----------------------------------------------
    def run_to_completion(self, pod: dict) -> None:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        (container,) = pod["spec"]["containers"]
        started = now()
        try:
            prepared = self.prepare(pod)
            log(f"{ns}/{name}: {prepared.shown}")
            try:
                with open(prepared.log_file, "wb") as out:
                    proc = subprocess.run(prepared.argv, env=prepared.env, stdout=out, stderr=subprocess.STDOUT)
            finally:
                self.forget_hosts(prepared)
            output = prepared.log_file.read_text(errors="replace")
            # (Killed by a signal: 128 + its number, as a container runtime reports it.)
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            message = output[-1024:]
        except PodError as e:
            output, code, message = f"host-kubelet: {e}\n", 1, str(e)
            (self.logs_dir / f"{ns}_{name}_{container['name']}.log").write_text(output)
        print(output, end="" if output.endswith("\n") else "\n", flush=True)
        log(f"{ns}/{name}: exit {code}")
        self.patch_status(pod, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "startTime": started, "hostIP": NODE_IP,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now()}],
            "containerStatuses": [{
                "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                "restartCount": 0, "started": False,
                "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                         "startedAt": started, "finishedAt": now(), "message": message}},
            }],
        })

    def forget_hosts(self, prepared: Prepared) -> None:
        with self.lock:
            if prepared.work / "hosts" in self.hosts_files:
                self.hosts_files.remove(prepared.work / "hosts")

    # --- long-running pods: the agent on HOST_NODE ---------------------------------------------
    def start(self, r: Running) -> None:
        r.prepared = r.prepared or self.prepare(r.pod)
        meta = r.pod["metadata"]
        log(f"{meta['namespace']}/{meta['name']}: {r.prepared.shown}")
        out = open(r.prepared.log_file, "ab")
        r.proc = subprocess.Popen(r.prepared.argv, env=r.prepared.env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        out.close()
        r.started = now()
        r.ready = None
        (self.pods_dir / f"{r.component}.pid").write_text(f"{r.proc.pid}\n")
        self.write_running(r)

    def write_running(self, r: Running) -> None:
        (container,) = r.pod["spec"]["containers"]
        ready = "True" if r.ready else "False"
        cstatus = {
            "name": container["name"], "image": container["image"], "imageID": "", "ready": bool(r.ready),
            "restartCount": r.restarts, "started": r.proc is not None and r.proc.poll() is None,
        }
        if r.proc is not None and r.proc.poll() is None:
            cstatus["state"] = {"running": {"startedAt": r.started}}
        else:
            cstatus["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {r.backoff:.0f}s"}}
        if r.last_exit is not None:
            cstatus["lastState"] = {"terminated": {"exitCode": r.last_exit, "reason": "Error",
                                                   "startedAt": r.started, "finishedAt": r.finished}}
        t = now()
        self.patch_status(r.pod, {
            "phase": "Running", "hostIP": NODE_IP, "hostIPs": [{"ip": NODE_IP}],
            "podIP": NODE_IP, "podIPs": [{"ip": NODE_IP}], "startTime": r.first_started,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": r.first_started},
                {"type": "Initialized", "status": "True", "lastTransitionTime": r.first_started},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": t},
                {"type": "Ready", "status": ready, "lastTransitionTime": t},
            ],
            "containerStatuses": [cstatus],
        })

    def probe(self, r: Running) -> bool:
        (container,) = r.pod["spec"]["containers"]
        p = (container.get("readinessProbe") or {}).get("httpGet")
        if p is None:
            return True
        url = f"http://{p.get('host', NODE_IP)}:{p['port']}{p.get('path', '/')}"
        timeout = (container.get("readinessProbe") or {}).get("timeoutSeconds", 1)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        except (OSError, ValueError):
            return False

    def tend(self, r: Running) -> None:
        """One look at a long-running container: restart it after its back-off when it exited,
        probe its readiness, renew its tokens, and write what changed."""
        if r.proc is not None and r.proc.poll() is not None:
            r.last_exit, r.finished = r.proc.returncode, now()
            meta = r.pod["metadata"]
            log(f"{meta['namespace']}/{meta['name']}: exit {r.last_exit}; restart in {r.backoff:.0f} s")
            r.proc, r.ready, r.restart_at = None, False, time.monotonic() + r.backoff
            r.backoff = min(r.backoff * 2, BACKOFF_MAX_S)
            self.write_running(r)
        if r.proc is None:
            if time.monotonic() >= r.restart_at:
                r.restarts += 1
                self.start(r)
            return
        for tf in r.prepared.tokens:
            if tf.due():
                tf.renew(self, r.pod)
        period = (r.pod["spec"]["containers"][0].get("readinessProbe") or {}).get("periodSeconds", 10)
        if time.monotonic() - r.probed_at >= min(period, 2):
            r.probed_at = time.monotonic()
            ready = self.probe(r)
            if ready != r.ready:
                r.ready = ready
                if ready:
                    r.backoff = BACKOFF_START_S
                self.write_running(r)

    def stop(self, r: Running, grace: float) -> None:
        meta = r.pod["metadata"]
        if r.proc is not None and r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) process takes its TERM too
            os.killpg(r.proc.pid, signal.SIGTERM)
            try:
                r.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
            log(f"{meta['namespace']}/{meta['name']}: stopped (exit {r.proc.returncode})")
        if r.prepared is not None:
            self.forget_hosts(r.prepared)
        (self.pods_dir / f"{r.component}.pid").unlink(missing_ok=True)

    # --- the loop ------------------------------------------------------------------------------
    def sync(self) -> None:
        components = ",".join((*HOOK_COMPONENTS, TEST_COMPONENT, *HOST_NODE_COMPONENTS))
        pods = json.loads(self.kubectl("get", "pods", "-A", "-l", f"app.kubernetes.io/component in ({components})",
                                       "-o", "json"))["items"]
        live: dict[str, dict] = {}
        new: list[tuple[dict, str]] = []
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            component = meta.get("labels", {}).get("app.kubernetes.io/component", "")
            if component in HOST_NODE_COMPONENTS and spec.get("nodeName") != HOST_NODE:
                continue  # kwok's
            if not meta.get("deletionTimestamp"):
                live[meta["uid"]] = pod
            uid = meta["uid"]
            if uid in self.done or uid in self.running or not spec.get("nodeName") or meta.get("deletionTimestamp"):
                continue
            phase = pod.get("status", {}).get("phase")
            # (A Running pod of this node not run by this process: its kubelet restarted.)
            if phase != "Pending" and not (phase == "Running" and component in HOST_NODE_COMPONENTS):
                continue
            new.append((pod, component))
        # Containers of deleted pods stop first: a rollout's new agent takes the old one's ports.
        for uid, r in list(self.running.items()):
            if uid not in live:
                grace = float(r.pod["spec"].get("terminationGracePeriodSeconds", 30))
                self.stop(r, grace)
                del self.running[uid]
        for pod, component in new:
            meta = pod["metadata"]
            self.done.add(meta["uid"])
            if component in HOST_NODE_COMPONENTS:
                r = Running(pod, component)
                try:
                    self.start(r)
                except (PodError, subprocess.SubprocessError, OSError) as e:
                    log(f"{meta['namespace']}/{meta['name']}: cannot start: {e}")
                    continue
                self.running[meta["uid"]] = r
            else:
                threading.Thread(target=self.complete_safely, args=(pod,), daemon=True).start()
        for r in self.running.values():
            try:
                self.tend(r)
            except (subprocess.SubprocessError, OSError) as e:
                log(f"{r.pod['metadata']['name']}: {e}")

    def complete_safely(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        try:
            if spec.get("hostNetwork") and spec.get("nodeName") != HOST_NODE:
                raise PodError(f"scheduled to {spec['nodeName']}, a kwok node: its network namespace is not this "
                               f"host's and nothing runs there (only {HOST_NODE} is this host)")
            self.run_to_completion(pod)
        except PodError as e:
            self.fail(pod, str(e))
        except (subprocess.SubprocessError, OSError) as e:
            # Setting the pod up failed (an API call, a file): it fails, saying so, rather than
            # stay Pending until Helm's timeout.
            why = f"{e} {getattr(e, 'stderr', '') or ''}".strip()
            log(f"{meta['namespace']}/{meta['name']}: {why}")
            try:
                self.fail(pod, f"host-kubelet could not run it: {why}", reason="HostKubeletError")
            except (subprocess.SubprocessError, OSError) as e2:
                log(f"{meta['namespace']}/{meta['name']}: cannot write its failure: {e2}")

    def fail(self, pod: dict, message: str, reason: str = "NotOnThisHost") -> None:
        meta = pod["metadata"]
        (container,) = pod["spec"]["containers"]
        (self.logs_dir / f"{meta['namespace']}_{meta['name']}_{container['name']}.log").write_text(f"host-kubelet: {message}\n")
        log(f"{meta['namespace']}/{meta['name']}: {message}; exit 1")
        self.patch_status(pod, {"phase": "Failed", "reason": reason, "message": message,
                                "containerStatuses": [{
                                    "name": container["name"], "image": container["image"], "imageID": "",
                                    "ready": False, "restartCount": 0, "started": False,
                                    "state": {"terminated": {"exitCode": 1, "reason": reason,
                                                             "message": message, "finishedAt": now()}}}]})

    def loop(self) -> None:
        last_hosts = 0.0
        while True:
            try:
                self.sync()
            except subprocess.SubprocessError as e:
                log(f"listing pods: {getattr(e, 'stderr', '') or e}")
            if time.monotonic() - last_hosts >= 10:
                last_hosts = time.monotonic()
                self.refresh_hosts()
            time.sleep(1)

    def shutdown(self) -> None:
        for r in self.running.values():
            self.stop(r, 5)


class PodError(Exception):
    """A pod this host cannot run as asked; it fails, with this message."""


@dataclass
class TokenFile:
    path: Path
    audience: str | None
    seconds: int
    written: float = 0.0

    def renew(self, kubelet: Kubelet, pod: dict) -> None:
        self.path.write_text(kubelet.token(pod, self.audience, self.seconds))
        self.written = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.written >= 0.8 * self.seconds


@dataclass
class Prepared:
    argv: list[str]
    env: dict[str, str]
    work: Path
    log_file: Path
    tokens: list[TokenFile]
    shown: str


@dataclass
class Running:
    pod: dict
    component: str
    prepared: Prepared | None = None
    proc: subprocess.Popen | None = None
    started: str = ""
    first_started: str = field(default_factory=now)
    finished: str = ""
    ready: bool | None = None
    restarts: int = 0
    last_exit: int | None = None
    backoff: float = BACKOFF_START_S
    restart_at: float = 0.0
    probed_at: float = 0.0


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: defined variables replaced, `$$(` kept as `$(`, unknown
    references left as written."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and ")" in value[i:]:
            end = value.index(")", i)
            var = value[i + 2:end]
            out.append(env.get(var, value[i:end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def remap(value: str, mounts: dict[str, Path]) -> str:
    """A value (or the part after `=` of `--flag=value`) naming a mount path, or a path under one,
    pointed at the volume's directory here."""
    prefix, _, rest = value.partition("=") if value.startswith("-") and "=" in value else ("", "", value)
    for mount in sorted(mounts, key=len, reverse=True):
        if rest == mount or rest.startswith(mount.rstrip("/") + "/"):
            rest = str(mounts[mount]) + rest[len(mount.rstrip("/")):]
            break
    return f"{prefix}={rest}" if prefix else rest


class LogsHandler(http.server.BaseHTTPRequestHandler):
    """The kubelet API's `/containerLogs/<ns>/<pod>/<container>` for the pods run here."""

    logs_dir: Path

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) == 4 and parts[0] == "containerLogs":
            f = self.logs_dir / f"{parts[1]}_{parts[2]}_{parts[3]}.log"
            if f.exists():
                body = f.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            body = (f"container {parts[3]} of pod {parts[1]}/{parts[2]} did not run on this host: kwok "
                    "plays that pod (nothing runs), or it has not started\n").encode()
            status = 400  # as the kubelet (and kwok) answer a container without logs: its message shown
        else:
            body, status = b"only /containerLogs/ is served here\n", 404
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass


def serve_logs(logs_dir: Path, port: int, cert: str, key: str) -> None:
    LogsHandler.logs_dir = logs_dir
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), LogsHandler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def kwok_stages(src: Path, out: Path) -> None:
    """kwok's pod stages that would take a pod to Running (pod-ready) or Succeeded
    (pod-complete), told to leave the pods run here alone: hooks and tests on every node, and
    on HOST_NODE the HOST_NODE_COMPONENTS too (each stage split in two: off HOST_NODE, on it)."""
    import copy

    import yaml

    docs = [d for d in yaml.safe_load_all(src.read_text()) if d]
    result = []
    component = '.metadata.labels["app.kubernetes.io/component"]'
    for d in docs:
        if d["metadata"]["name"] not in ("pod-ready", "pod-complete"):
            result.append(d)
            continue
        elsewhere, on_host = d, copy.deepcopy(d)
        elsewhere["spec"]["selector"]["matchExpressions"] += [
            {"key": component, "operator": "NotIn", "values": [*HOOK_COMPONENTS, TEST_COMPONENT]},
            {"key": ".spec.nodeName", "operator": "NotIn", "values": [HOST_NODE]},
        ]
        on_host["metadata"]["name"] += "-host-node"
        on_host["spec"]["selector"]["matchExpressions"] += [
            {"key": component, "operator": "NotIn",
             "values": [*HOOK_COMPONENTS, TEST_COMPONENT, *HOST_NODE_COMPONENTS]},
            {"key": ".spec.nodeName", "operator": "In", "values": [HOST_NODE]},
        ]
        result += [elsewhere, on_host]
    out.write_text(yaml.safe_dump_all(result, sort_keys=False))


def main() -> None:
    if sys.argv[1] == "--kwok-stages":
        kwok_stages(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("state", type=Path)
    p.add_argument("controller_bin")
    p.add_argument("agent_bin")
    p.add_argument("tools_dir", type=Path, help="grpc-health-probe (cluster/build.sh)")
    p.add_argument("--logs-port", type=int, required=True)
    p.add_argument("--tls-cert", required=True)
    p.add_argument("--tls-key", required=True)
    a = p.parse_args()
    for tool in HOST_TOOLS:
        found = shutil.which(tool, path=PATH_DEFAULT)
        if found is None:
            sys.exit(f"host_kubelet.py: {tool} not found on {PATH_DEFAULT}")
        HOST_TOOLS[tool] = found
    programs = {"ic-controller": a.controller_bin, "ic-agent": a.agent_bin,
                "grpc-health-probe": str(a.tools_dir / "grpc-health-probe")}
    # The busybox image's applets that the chart's test uses, as this host's tools (Debian's
    # busybox 1.35 `wget -T` crashes). GNU wget retries a timed-out read 20 times; busybox's
    # makes one try: the shim says --tries=1.
    applets = a.state / "host-pods" / "busybox"
    applets.mkdir(parents=True, exist_ok=True)
    for applet in BUSYBOX_APPLETS:
        found = shutil.which(applet, path=PATH_DEFAULT)
        link = applets / applet
        if found is None or link.exists() or link.is_symlink():
            continue
        if applet == "wget":
            link.write_text(f'#!{HOST_TOOLS["sh"]}\nexec {found} --tries=1 "$@"\n')
            link.chmod(0o755)
        else:
            link.symlink_to(found)
    programs["busybox"] = str(applets)
    kubelet = Kubelet(a.state, programs)
    # A container left by an earlier host_kubelet.py that was killed (its own session outlived
    # it): stopped, as a restarted kubelet's runtime would find and replace it.
    for pid_file in kubelet.pods_dir.glob("*.pid"):
        pid = int(pid_file.read_text().strip() or 0)
        try:
            if pid and b"ic-agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                log(f"stopped pid {pid}, left by an earlier host_kubelet.py")
        except OSError:
            pass
        pid_file.unlink()
    serve_logs(kubelet.logs_dir, a.logs_port, a.tls_cert, a.tls_key)

    def on_term(*_: object) -> None:
        kubelet.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    kubelet.loop()


if __name__ == "__main__":
    main()
