"""Every dashboard and alert expression against a real Prometheus (Debian's `prometheus`, loopback
only) scraping the real standalone stack (ic-controller standalone + ic-agent run from
$IC_BIN_DIR), with the job / namespace / pod / node labels the chart's ServiceMonitor and
PodMonitor give: each expression evaluates without error, reads only metrics the binaries
export, the chart's rules load and evaluate healthy, and what is meant to read 0 on an idle
stack returns a series (not "No data")."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from conftest import ROOT, render
from test_alerts import OUTSIDE, metrics_in
from test_dashboards import DASHBOARDS, metric_names, panels

BIN_DIR = Path(os.environ.get("IC_BIN_DIR") or ROOT / "target" / "debug")
NODE = "node-a"
# Families that have no series on an idle standalone stack without GPUs, engines or model-cache
# readers: they appear with their first subject (a GPU, a CUDA device, an engine stream's first
# block or event of that kind, a CacheBackend whose tier 2 was queried).
# Expressions over them must still evaluate; this list must not grow without a reason.
NO_SUBJECT_YET = {
    "inferencecache_agent_gpu_status",
    "inferencecache_agent_gpu_temperature_celsius",
    "inferencecache_agent_gpu_last_xid",
    "inferencecache_agent_gpu_xid_events_total",
    "inferencecache_agent_cuda_status",
    # Absent until the stream's first batch: the value is not known before (a planned stream's
    # counters, blocks and connected exist at 0 from the start).
    "inferencecache_agent_kv_stream_lag_seconds",
    "inferencecache_backend_t2_hit_rate",
    # Per configured --tokenizer model; the idle stack configures none.
    "inferencecache_controller_tokenizer_load_failing",
    # An engine stream's first tier-2 reading (a planned metrics URL that serves the counters).
    "inferencecache_agent_engine_t2_queries_total",
    "inferencecache_agent_engine_t2_last_hit_timestamp_seconds",
}
# Registered only by `ic-controller run` (leader election, TokenReview, node plans, CacheNode
# status), which the standalone stack does not run; test_dashboards / test_alerts check that the
# sources register them.
IN_CLUSTER_ONLY = {
    "inferencecache_controller_leader",
    "inferencecache_controller_nodes_without_agent",
    "inferencecache_controller_agent_auth_total",
    "inferencecache_controller_node_plans_sent_total",
    "inferencecache_controller_node_plan_issues",
    "inferencecache_controller_webhook_cert_expiry_timestamp_seconds",
    # Only where the self-signed webhook Secret is kept (--webhook-self-signed --webhook-tls-secret).
    "inferencecache_controller_webhook_cert_secret_problem",
}
# Expressions that must return a series on the idle stack (0 is an answer, "No data" is not).
MUST_ANSWER = [
    "inferencecache_agent_link_connected",
    "inferencecache_controller_agents_connected",
    'sum by (decision) (rate(inferencecache_controller_lookups_total[1m]))',
    'sum by (reason) (rate(inferencecache_controller_kv_deltas_refused_total[1m]))',
    'sum by (trigger) (increase(inferencecache_controller_kv_resyncs_total[1m]))',
    'sum by (outcome) (increase(inferencecache_controller_agent_streams_total[1m]))',
    "inferencecache_build_info",
    "process_resident_memory_bytes",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def wait_for(what: str, pred, timeout: float = 60.0, procs: list[subprocess.Popen] = ()) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[0]} exited with {p.returncode} while waiting for {what}"
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        for p in panels(d):
            for t in p.get("targets", []):
                expr = (
                    t["expr"]
                    .replace("$__rate_interval", "1m")
                    .replace('=~"$namespace"', '=~".*"')
                    .replace('=~"$node"', '=~".*"')
                    .replace('=~"$cluster"', '=~".*"')
                    .replace('=~"$job"', '=~".*"')
                )
                assert "$" not in expr, f"{path.name} {p['title']}: unresolved variable in {expr}"
                yield f"{path.name}: {p['title']}", expr


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    prom = shutil.which("prometheus")
    assert prom, "prometheus not found: install Debian's `prometheus` package (scripts/setup.sh does)"
    for b in ("ic-controller", "ic-agent"):
        assert (BIN_DIR / b).is_file(), f"{BIN_DIR / b} missing: build the binaries (cargo test) or set IC_BIN_DIR"
    tmp = tmp_path_factory.mktemp("live")
    grpc, http, agent_http, prom_port = (free_port() for _ in range(4))
    rules = render({"monitoring": {"prometheusRule": {"enabled": True}}}).one("PrometheusRule")["spec"]
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [
            {
                "job_name": "inference-cache-controller-metrics",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{http}"], "labels": {"namespace": "inference-cache", "pod": "ctrl-0"}}
                ],
            },
            # A process that is not ours on the same node and namespace, in a job whose name
            # has "controller" in it (as kube-controller-manager's does): the memory panels must
            # not draw it.
            {
                "job_name": "kube-controller-manager",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{prom_port}"],
                     "labels": {"namespace": "inference-cache", "pod": "other-0", "node": NODE}}
                ],
            },
            {
                "job_name": "inference-cache/inference-cache-agent",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{agent_http}"],
                        "labels": {"namespace": "inference-cache", "pod": "agent-0", "node": NODE},
                    }
                ],
            },
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    logs = {n: open(tmp / f"{n}.log", "w") for n in ("controller", "agent", "prometheus")}
    procs = [
        subprocess.Popen(
            [str(BIN_DIR / "ic-controller"), "standalone", "--grpc-addr", f"127.0.0.1:{grpc}",
             "--http-addr", f"127.0.0.1:{http}"],
            stdout=logs["controller"], stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [str(BIN_DIR / "ic-agent"), "run", "--controller", f"http://127.0.0.1:{grpc}",
             "--plan", str(ROOT / "config" / "standalone" / "plan.yaml"),
             "--http-addr", f"127.0.0.1:{agent_http}", "--check-interval-seconds", "1"],
            stdout=logs["agent"], stderr=subprocess.STDOUT, env={**os.environ, "NODE_NAME": NODE},
        ),
        subprocess.Popen(
            [prom, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=logs["prometheus"], stderr=subprocess.STDOUT,
        ),
    ]
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(expr: str) -> dict[str, Any]:
        return get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))

    try:
        wait_for(
            "the three targets up",
            lambda: len([r for r in query("up == 1")["data"]["result"]]) == 3,
            procs=procs,
        )
        wait_for(
            "the agent's link and first check pass scraped",
            lambda: query("inferencecache_agent_link_connected == 1")["data"]["result"]
            and query("inferencecache_agent_check_results")["data"]["result"],
            procs=procs,
        )
        time.sleep(4)  # a few samples per series, for rate() and increase()
        yield {"query": query, "api": api, "procs": procs}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()


def test_every_expression_evaluates_and_reads_exported_metrics(live: dict[str, Any]) -> None:
    names = set(get(f"{live['api']}/label/__name__/values")["data"])
    registered = metric_names()
    assert NO_SUBJECT_YET | IN_CLUSTER_ONLY <= registered, sorted((NO_SUBJECT_YET | IN_CLUSTER_ONLY) - registered)
    exported_anyway = sorted((NO_SUBJECT_YET | IN_CLUSTER_ONLY) & names)
    assert not exported_anyway, f"listed as absent but exported: {exported_anyway}"
    rules = render({"monitoring": {"prometheusRule": {"enabled": True}}}).one("PrometheusRule")
    exprs = list(dashboard_exprs()) + [
        (f"alert {r['alert']}", r["expr"]) for r in rules["spec"]["groups"][0]["rules"]
    ]
    assert len(exprs) > 50
    problems = []
    for where, expr in exprs:
        r = live["query"](expr)
        if r["status"] != "success":
            problems.append(f"{where}: {r}")
        for n in metrics_in(expr):
            if n in OUTSIDE or n in names or n in NO_SUBJECT_YET or n in IN_CLUSTER_ONLY:
                continue
            problems.append(f"{where}: {n} is not exported by the running binaries")
    assert not problems, "\n".join(problems)


def test_what_means_zero_answers_with_a_series(live: dict[str, Any]) -> None:
    empty = [e for e in MUST_ANSWER if not live["query"](e)["data"]["result"]]
    assert not empty, empty
    for where, expr in dashboard_exprs():
        if where.endswith(("Agents connected", "Agents linked to the controller",
                           "Nodes with a critical check", "Nodes with a warning")):
            assert live["query"](expr)["data"]["result"], f"{where}: no data on the idle stack"
    # One agent, linked to the one controller: counted once, not once per replica.
    (v,) = live["query"]('count(inferencecache_agent_link_connected > 0) or vector(0)')["data"]["result"]
    assert v["value"][1] == "1"


def test_panels_draw_only_our_processes_and_zero_and_live_streams(live: dict[str, Any]) -> None:
    """Agent memory and Controller memory draw the agent's and the controller's process only
    (not the other process scraped on the same node, namespace and a *controller* job);
    Critical results per node answers a number per node (0 rather than No data); the node x check panel
    answers a state for every check of the agent."""
    exprs = dict(dashboard_exprs())
    procs = wait_for("process metrics", lambda: live["query"]("process_resident_memory_bytes")["data"]["result"]
                     if len(live["query"]("process_resident_memory_bytes")["data"]["result"]) >= 3 else None)
    assert {r["metric"]["job"] for r in procs} >= {"kube-controller-manager"}
    for title, job in (("node-health.json: Agent memory", "inference-cache/inference-cache-agent"),
                       ("cache-index.json: Controller memory", "inference-cache-controller-metrics")):
        (series,) = live["query"](exprs[title])["data"]["result"]
        (ours,) = [r for r in procs if r["metric"]["job"] == job]
        assert series["value"][1] == ours["value"][1] or abs(float(series["value"][1]) - float(ours["value"][1])) < 64 << 20, title
    crit = live["query"](exprs["node-health.json: Critical results per node"])["data"]["result"]
    raw = live["query"]('inferencecache_agent_check_results{status="critical"}')["data"]["result"]
    expected = str(sum(int(r["value"][1]) for r in raw))  # "0" when nothing is critical here
    assert [(r["metric"].get("node"), r["value"][1]) for r in crit] == [(NODE, expected)], crit
    # With nothing critical (a status no result has), the panel draws 0, not No data.
    none = exprs["node-health.json: Critical results per node"].replace('status="critical"', 'status="none-such"')
    assert [(r["metric"].get("node"), r["value"][1]) for r in live["query"](none)["data"]["result"]] == [(NODE, "0")]
    states = live["query"](exprs["node-health.json: Node × check state"])["data"]["result"]
    checks = {r["metric"]["check"] for r in live["query"]("inferencecache_agent_check_results")["data"]["result"]}
    assert {r["metric"]["check"] for r in states} == checks
    assert all(r["value"][1] in {"0", "1", "2", "3"} for r in states), states


def test_the_chart_rules_load_and_evaluate_healthy(live: dict[str, Any]) -> None:
    groups = wait_for(
        "rules evaluated",
        lambda: [g for g in get(f"{live['api']}/rules")["data"]["groups"]
                 if all(r.get("lastEvaluation", "").startswith("20") for r in g["rules"])],
        timeout=20,
    )
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 20
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not unhealthy, unhealthy
    # An idle, healthy stack fires nothing but the alerts about what it cannot have (no leader
    # election in standalone mode is not "no leader": that alert needs the leader metric).
    firing = {r["name"] for r in rules if r["state"] == "firing"}
    assert "InferenceCacheControllerDown" not in firing and "InferenceCacheAgentUnlinked" not in firing


def test_a_healthy_cpu_node_is_not_listed_as_not_ok(live: dict[str, Any]) -> None:
    """The standalone plan says `gpuNode: false`: on a machine without an NVIDIA stack the gpu and
    cuda checks read Ok (GpuNotExpected, CudaNotExpected), so the dashboard's two "not Ok" tables
    list no GPU or CUDA row for it (they listed both as Unknown before)."""
    exprs = dict(dashboard_exprs())
    q = live["query"]
    reasons = {(r["metric"]["check"], r["metric"]["status"], r["metric"]["reason"])
               for r in q('inferencecache_agent_check_reasons{check=~"gpu|cuda"} > 0')["data"]["result"]}
    assert reasons, "no gpu or cuda result on the stack"
    if not q('inferencecache_agent_gpu_status')["data"]["result"]:  # no GPU on this machine
        assert ("gpu", "ok", "GpuNotExpected") in reasons, reasons
        assert ("cuda", "ok", "CudaNotExpected") in reasons, reasons
    not_ok = q(exprs["node-health.json: Results that are not Ok"])["data"]["result"]
    assert not [r["metric"] for r in not_ok if r["metric"].get("check") in ("gpu", "cuda")], not_ok
    assert q(exprs["node-health.json: GPU results that are not Ok"])["data"]["result"] == []
    states = q(exprs["node-health.json: Node × check state"])["data"]["result"]
    assert {(r["metric"]["check"], r["value"][1]) for r in states if r["metric"]["check"] in ("gpu", "cuda")} \
        == {("gpu", "0"), ("cuda", "0")}, states
