#!/usr/bin/env python3
"""Agent memory by held block count (`scripts/footprint.sh --blocks N[,N…]`; issue 37 item 6,
issue 41 item 5).

For each N, a fresh stack on loopback:

- **controller**: the release `ic-controller standalone` (it receives the agent's stream, as in
  production; its `index_entries` gauge is read back to show it did);
- **engine**: `node-tests/vllm-faults/engine.py` — vLLM's own `ZmqEventPublisher`
  (`vllm/distributed/kv_events.py` from the released wheel, `scripts/fetch-vllm.sh`) over the
  fault suite's prefix-caching block-pool model with N physical blocks of 16 tokens;
- **agent**: the release `ic-agent run` with a one-engine plan and `--controller`.

Phases: *fill* — the engine's `load` at RATE block events/s until the pool has cached N
blocks (stores only: N / RATE seconds, plus 20 %); *churn* — `load` for WINDOW seconds at RATE
(each new block evicts a cached one: one BlockStored hash and one BlockRemoved per block, so
RATE/2 stores and RATE/2 removals a second) while the agent's VmRSS is sampled every 0.5 s.
WINDOW defaults to 2.5 × N / RATE (every held block replaced 1.25 times), at least 30 s.
Reported per N: the blocks the agent holds (`inferencecache_agent_kv_blocks`) and the
controller indexes, the block events/s the engine reached, the agent's RSS before any block,
average and max during churn, its VmHWM, and KiB per held block (max RSS ÷ held, and the
increment over the empty agent ÷ held); then, at the end, what the agent's pod holds besides:
its checks processes (`checks-supervisor` and `checks-worker`, VmRSS and their count), and the
PSS of the agent and those processes together (text shared among them counted once).

Environment: IC_VLLM_DIR (default target/ci-cache/vllm), IC_VLLM_VERSION (0.33.0), IC_BIN_DIR
(default target/release), RATE (20000), WINDOW (seconds; default above), BASE_PORT (26557); AGENT_WRAPPER (a command
prefix for the agent, e.g. `heaptrack -o /tmp/agent`: the RSS read is then the wrapper's).
Anything else in the environment (MALLOC_ARENA_MAX, …) passes through to the agent unchanged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("IC_BIN_DIR") or os.path.join(ROOT, "target", "release")
VLLM = os.environ.get("IC_VLLM_DIR") or os.path.join(ROOT, "target", "ci-cache", "vllm")
VLLM_VERSION = os.environ.get("IC_VLLM_VERSION", "0.33.0")
RATE = int(os.environ.get("RATE", "20000"))
# Churn seconds; default: every held block replaced 1.25 times over (at least 30 s). Shorter
# windows under-read big pools: a hash table under churn doubles once its deleted slots use up
# its spare capacity (hashbrown rehashes in place only below half load), which takes about one
# pool's worth of stores.
WINDOW = os.environ.get("WINDOW")
BASE_PORT = int(os.environ.get("BASE_PORT", "26557"))
BLOCK_SIZE = 16


def window(blocks: int) -> float:
    return float(WINDOW) if WINDOW else max(30.0, 2.5 * blocks / RATE)


def http(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def gauge(text: str, name: str) -> float | None:
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def wait_for(what: str, probe, deadline_s: float = 60):
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            v = probe()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready within {deadline_s:.0f} s ({last})")


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (its checks supervisor and worker, for an agent)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def agent_pid(parent: int) -> int | None:
    """The `ic-agent` process among `parent`'s descendants (under AGENT_WRAPPER)."""
    for k in descendants(parent):
        try:
            with open(f"/proc/{k}/comm") as f:
                if f.read().strip() == "ic-agent":
                    return k
        except OSError:
            pass
    return None


def pss_kib(pid: int) -> int:
    """Proportional set size (shared pages split among their users), KiB; 0 once gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Engine:
    def __init__(self, blocks: int, pub: int, rep: int, log):
        kv = os.path.join(VLLM, VLLM_VERSION, "vllm", "distributed", "kv_events.py")
        py = os.path.join(VLLM, "venv", "bin", "python")
        for p in (kv, py):
            if not os.path.exists(p):
                sys.exit(f"footprint: {p} is missing (run scripts/fetch-vllm.sh, set IC_VLLM_DIR)")
        self.p = subprocess.Popen(
            [py, os.path.join(ROOT, "node-tests", "vllm-faults", "engine.py"), "--kv-events", kv,
             "--endpoint", f"tcp://*:{pub}", "--replay-endpoint", f"tcp://*:{rep}",
             "--num-blocks", str(blocks), "--user-blocks", "40", "--block-size", str(BLOCK_SIZE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    def load(self, seconds: float, per_step: int) -> dict:
        """One `load` command; probe lines (one per run with this probe interval) skipped."""
        cmd = {"cmd": "load", "seconds": seconds, "blocks_per_s": RATE, "per_step": per_step,
               "probe_ms": 3_600_000}
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        for line in self.p.stdout:
            r = json.loads(line)
            if "probe" not in r:
                return r
        raise RuntimeError("engine.py exited during load")

    def stop(self):
        self.p.kill()
        self.p.wait()


def run_one(blocks: int, work: str) -> dict:
    grpc, chttp, ahttp, pub = BASE_PORT, BASE_PORT + 1, BASE_PORT + 2, BASE_PORT + 3
    rep = pub + 1
    plan = os.path.join(work, "plan.yaml")
    with open(plan, "w") as f:
        f.write(f"""gpuNode: false
engines:
  - namespace: bench
    pod: vllm-0
    model: m
    hashScheme: vllm
    blockSize: {BLOCK_SIZE}
    kvEvents:
      - {{ endpoint: "tcp://127.0.0.1:{pub}", replayEndpoint: "tcp://127.0.0.1:{rep}", dpRank: 0 }}
""")
    procs = []
    logs = {n: open(os.path.join(work, f"{n}-{blocks}.log"), "w") for n in ("controller", "agent", "engine")}
    try:
        ctrl = subprocess.Popen(
            [os.path.join(BIN, "ic-controller"), "standalone", "--grpc-addr", f"127.0.0.1:{grpc}",
             "--http-addr", f"127.0.0.1:{chttp}"],
            stdout=logs["controller"], stderr=subprocess.STDOUT,
            env={**os.environ, "MIMALLOC_PURGE_DELAY": os.environ.get("MIMALLOC_PURGE_DELAY", "0")})
        procs.append(ctrl)
        wait_for("ic-controller", lambda: http(f"http://127.0.0.1:{chttp}/readyz") is not None)
        eng = Engine(blocks, pub, rep, logs["engine"])
        procs.append(eng.p)
        agent = subprocess.Popen(
            os.environ.get("AGENT_WRAPPER", "").split() + [os.path.join(BIN, "ic-agent"), "run", "--plan", plan, "--controller",
             f"http://127.0.0.1:{grpc}", "--http-addr", f"127.0.0.1:{ahttp}", "--node", "footprint",
             "--check-interval-seconds", "30"],
            stdout=logs["agent"], stderr=subprocess.STDOUT)
        procs.append(agent)
        pid = agent.pid
        if os.environ.get("AGENT_WRAPPER"):
            pid = wait_for("ic-agent under AGENT_WRAPPER", lambda: agent_pid(agent.pid))
        metrics = f"http://127.0.0.1:{ahttp}/metrics"
        wait_for("ic-agent stream connected",
                 lambda: (gauge(http(metrics), "inferencecache_agent_kv_connected") or 0) >= 1)
        time.sleep(2)
        empty_rss = status_kib(pid, "VmRSS")

        # Requests per scheduler step (one batch each): 8, more for big pools, where the model's
        # per-step cost (it copies its cache's key set) would otherwise cap the rate.
        per_step = min(256, max(8, blocks // 4096))
        fill = eng.load(blocks / RATE * 1.2 + 2, per_step)
        samples: list[int] = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                samples.append(status_kib(pid, "VmRSS"))
                stop.wait(0.5)

        t = threading.Thread(target=sample)
        t.start()
        churn = eng.load(window(blocks), per_step)
        stop.set()
        t.join()
        time.sleep(1)
        m = http(metrics)
        held = gauge(m, "inferencecache_agent_kv_blocks") or 0
        hwm = status_kib(pid, "VmHWM")
        rss_end = status_kib(pid, "VmRSS")
        # The agent's pod also holds its checks processes (`checks-supervisor`, `checks-worker`,
        # docs/checks.md): their VmRSS, and the whole tree's PSS (shared text counted once).
        kids = descendants(pid)
        checks_kib = sum(status_kib(k, "VmRSS") for k in kids)
        tree_pss = pss_kib(pid) + sum(pss_kib(k) for k in kids)
        cm = http(f"http://127.0.0.1:{chttp}/metrics")
        indexed = next((gauge(cm, n) for n in re.findall(r"^(\w*index_entries)\b", cm, re.M)), None)
        if agent.poll() is not None:
            raise RuntimeError(f"ic-agent exited ({agent.returncode}); see {logs['agent'].name}")
        return {
            "blocks": blocks, "per_step": per_step, "held": int(held), "indexed": int(indexed or 0),
            "fill_events": fill["block_events"], "fill_s": fill["seconds"],
            "churn_s": churn["seconds"], "rate": churn["block_events"] / churn["seconds"], "engine_cpu": churn["cpu_s"] / churn["seconds"],
            "empty_kib": empty_rss, "avg_kib": sum(samples) / max(len(samples), 1),
            "max_kib": max(samples + [rss_end]), "end_kib": rss_end, "hwm_kib": hwm,
            "checks_kib": checks_kib, "checks_procs": len(kids), "tree_pss_kib": tree_pss,
        }
    finally:
        # The agent itself first (under a wrapper such as heaptrack, which then writes its file).
        if "pid" in locals() and pid != agent.pid:
            try:
                os.kill(pid, 15)
                agent.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()


def main() -> None:
    counts = [int(x.replace("_", "")) for x in ",".join(sys.argv[1:]).split(",") if x]
    if not counts:
        sys.exit("usage: footprint-blocks.py N[,N…]")
    work = tempfile.mkdtemp(prefix="ic-footprint-")
    print(f"agent memory by held blocks: vLLM {VLLM_VERSION} publisher, {RATE} block events/s, "
          f"{WINDOW + ' s' if WINDOW else 'max(30 s, 2.5 × pool / rate)'} churn; binaries {BIN}; logs {work}")
    try:
        la = open("/proc/loadavg").read().split()[:3]
    except OSError:
        la = ["?"]
    print(f"load average at start: {' '.join(la)}")
    hdr = ("pool", "churn s", "held", "indexed", "ev/s", "empty MiB", "avg MiB", "max MiB", "VmHWM MiB",
           "KiB/held", "Δ KiB/held", "checks processes MiB (VmRSS)", "agent + checks PSS MiB")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for n in counts:
        r = run_one(n, work)
        held = max(r["held"], 1)
        print("| %d | %.0f | %d | %d | %.0f | %.1f | %.1f | %.1f | %.1f | %.3f | %.3f | %.1f (%d) | %.1f |" % (
            n, r["churn_s"], r["held"], r["indexed"], r["rate"], r["empty_kib"] / 1024, r["avg_kib"] / 1024,
            r["max_kib"] / 1024, r["hwm_kib"] / 1024, r["max_kib"] / held,
            (r["max_kib"] - r["empty_kib"]) / held, r["checks_kib"] / 1024, r["checks_procs"],
            r["tree_pss_kib"] / 1024), flush=True)
    try:
        la = open("/proc/loadavg").read().split()[:3]
    except OSError:
        la = ["?"]
    print(f"load average at end: {' '.join(la)}")


if __name__ == "__main__":
    main()
