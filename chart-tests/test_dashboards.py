"""Grafana dashboards: well-formed, and every metric they query exists in the binaries' sources."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import CHART_DIR, ROOT

DASHBOARDS = sorted((CHART_DIR / "dashboards").glob("*.json"))
METRIC_SOURCES = sorted((ROOT / "agent" / "src").rglob("*.rs")) + sorted(
    (ROOT / "controller" / "src").rglob("*.rs")
) + sorted((ROOT / "shared" / "src").rglob("*.rs"))
PROMQL_NAME = re.compile(r"\binferencecache_[a-z0-9_]+")
# Histograms (their series get _bucket, _sum and _count): the binaries' two latency histograms.
HISTOGRAM_SUFFIX = "_duration_seconds"


def metric_names() -> set[str]:
    """Metric families the binaries' sources register: `let p = "inferencecache_…_"` /
    `const P: &str = "…"` prefixes joined with `{p}name`, and whole names written as literals,
    plus the series histograms add."""
    names: set[str] = set()
    for src in METRIC_SOURCES:
        text = src.read_text()
        prefixes = dict(re.findall(r'(?:let|const)\s+(\w+)\s*(?::\s*&str)?\s*=\s*"(inferencecache_\w+)"', text))
        for var, prefix in prefixes.items():
            for name in re.findall(r"\{" + var + r"\}(\w+)", text):
                names.add(prefix + name)
            # `format!("{P}{name}")` helpers called with the bare name (agent/src/checks/metrics.rs).
            if "{" + var + "}{name}" in text:
                names |= {prefix + n for n in re.findall(r'gauge_vec\(\s*"(\w+)"', text)}
        names |= {n for n in re.findall(r'"(inferencecache_[a-z0-9_]+)"', text) if not n.endswith("_")}
    for n in list(names):
        if n.endswith(HISTOGRAM_SUFFIX):
            names |= {n + "_bucket", n + "_sum", n + "_count"}
    return names


def panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def test_there_are_two_dashboards() -> None:
    assert [p.name for p in DASHBOARDS] == ["cache-index.json", "node-health.json"]


def test_metric_sources_are_found() -> None:
    names = metric_names()
    for expected in (
        "inferencecache_controller_agents_connected",
        "inferencecache_controller_lookups_total",
        "inferencecache_agent_check_results",
        "inferencecache_agent_kv_blocks",
    ):
        assert expected in names


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_dashboard(path: Path) -> None:
    d = json.loads(path.read_text())
    known = metric_names()
    assert d["uid"].startswith("ic-") and d["title"].startswith("inference-cache / ")
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    assert variables >= {"datasource", "cluster", "job"}
    used = set()
    for p in panels(d):
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            used |= set(PROMQL_NAME.findall(t["expr"]))
            # Every selector is scoped by the cluster and job variables (one Prometheus may hold
            # several clusters or releases). The cache-index dashboard's job is the controller's
            # metrics job, which agent series never carry: its agent panels are scoped by the
            # release namespace instead (the agents' PodMonitor series carry it), or selecting a
            # release would blank them.
            controller_jobs = path.name == "cache-index.json"
            for name, s in re.findall(r"\b((?:inferencecache|process)_[a-z0-9_]+)(\{[^}]*\})?", t["expr"]):
                scope = (
                    'namespace=~"$namespace"'
                    if controller_jobs and name.startswith("inferencecache_agent_")
                    else 'job=~"$job"'
                )
                assert 'cluster=~"$cluster"' in s and scope in s, (p["title"], t["expr"])
            assert re.search(r"\b(?:inferencecache|process)_[a-z0-9_]+", t["expr"]), (p["title"], t["expr"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
    assert used and used <= known, sorted(used - known)


def test_node_health_covers_checks_and_streams() -> None:
    d = json.loads((CHART_DIR / "dashboards" / "node-health.json").read_text())
    exprs = " ".join(t["expr"] for p in panels(d) for t in p.get("targets", []))
    for needle in ('check="gpu"', 'check="shm"', 'check="ports"', "inferencecache_agent_kv_connected", "by (node"):
        assert needle in exprs


def test_cache_index_covers_lookups() -> None:
    d = json.loads((CHART_DIR / "dashboards" / "cache-index.json").read_text())
    exprs = " ".join(t["expr"] for p in panels(d) for t in p.get("targets", []))
    for needle in ('decision="prefix_match"', "inferencecache_controller_index_entries", "lookup_duration_seconds_bucket", "by (stream)"):
        assert needle in exprs


def test_panels_scope_memory_to_our_processes_and_drop_dead_streams() -> None:
    """Memory panels join on the job and instance of a metric only our binaries export (the live
    test shows another process excluded); the stream-lag panel keeps only connected streams, so a
    dead stream's last lag is not drawn on."""
    node = json.loads((CHART_DIR / "dashboards" / "node-health.json").read_text())
    index = json.loads((CHART_DIR / "dashboards" / "cache-index.json").read_text())
    by = {p["title"]: p["targets"][0]["expr"] for d in (node, index) for p in panels(d) if p.get("targets")}
    assert "and on (job, instance) inferencecache_agent_" in by["Agent memory"]
    assert "and on (job, instance) inferencecache_controller_" in by["Controller memory"]
    assert '".*controller.*"' not in by["Controller memory"]
    assert re.search(r"and on \(node, stream\) \(max by \(node, stream\) \(inferencecache_agent_kv_connected\{[^}]*\}\) == 1\)",
                     by["KV stream lag"]), by["KV stream lag"]
