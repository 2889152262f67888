"""The chart's PrometheusRule (monitoring.prometheusRule): valid for promtool, every alert unit-tested
with `promtool test rules` (chart-tests/alerts/alerts-test.yaml), every alert fully annotated with
a runbook anchor that exists, matchers that follow the release, and only metrics the binaries
register (or the named outside exporters)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from conftest import NAMESPACE, RELEASE, ROOT, load_chart, render
from test_dashboards import metric_names

TESTS = Path(__file__).resolve().parent / "alerts" / "alerts-test.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
ON = {"monitoring": {"prometheusRule": {"enabled": True}}}
# Series the alerts read that our binaries do not export, by who does.
OUTSIDE = {
    "up": "Prometheus",
    "kube_daemonset_status_desired_number_scheduled": "kube-state-metrics",
    "kube_daemonset_status_number_ready": "kube-state-metrics",
    "certmanager_certificate_expiration_timestamp_seconds": "cert-manager",
}
PROMQL_FUNCS = {
    "absent", "sum", "max", "min", "count", "increase", "rate", "histogram_quantile", "time",
    "unless", "and", "or", "vector", "scalar", "topk",
}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's `prometheus` package (scripts/setup.sh does)"
    return path


def rules_of(values: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    pr = render(values, **kw).one("PrometheusRule")
    (group,) = pr["spec"]["groups"]
    return group["rules"]


def alerts_under_test() -> set[str]:
    doc = yaml.safe_load(TESTS.read_text())
    return {c["alertname"] for t in doc["tests"] for c in t.get("alert_rule_test", [])}


def firing_cases() -> set[str]:
    doc = yaml.safe_load(TESTS.read_text())
    return {
        c["alertname"]
        for t in doc["tests"]
        for c in t.get("alert_rule_test", [])
        if c.get("exp_alerts")
    }


def quiet_cases() -> set[str]:
    doc = yaml.safe_load(TESTS.read_text())
    return {
        c["alertname"]
        for t in doc["tests"]
        for c in t.get("alert_rule_test", [])
        if not c.get("exp_alerts")
    }


def github_anchors(markdown: str) -> set[str]:
    """Heading anchors as GitHub makes them (lower case, punctuation dropped, spaces to '-')."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_off_by_default() -> None:
    assert render({}).of_kind("PrometheusRule") == []


def test_promtool_check_and_unit_tests(tmp_path: Path) -> None:
    rules = rules_of(ON)
    full = tmp_path / "full.yaml"
    full.write_text(yaml.safe_dump({"groups": [{"name": "ic", "rules": rules}]}))
    check = subprocess.run([promtool(), "check", "rules", str(full)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # promtool compares annotations exactly: the unit tests pin `summary` (with its templating)
    # and leave description / runbook_url to the other tests here.
    for r in rules:
        r["annotations"] = {"summary": r["annotations"]["summary"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "ic", "rules": rules}]}))
    shutil.copy(TESTS, tmp_path / "alerts-test.yaml")
    run = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "alerts-test.yaml")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout + run.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    names = {r["alert"] for r in rules_of(ON)}
    assert alerts_under_test() == names
    assert firing_cases() == names
    assert quiet_cases() == names


def test_the_alerts_the_issue_asks_for() -> None:
    names = {r["alert"] for r in rules_of(ON)}
    assert names >= {
        "InferenceCacheControllerDown",
        "InferenceCacheNoLeader",
        "InferenceCacheAgentLinkedToFewerReplicas",
        "InferenceCacheGpuXid",
        "InferenceCacheCudaLaunchFailed",
        "InferenceCacheShmUndersized",
        "InferenceCacheMpWorkerHung",
        "InferenceCachePortConflict",
        "InferenceCacheReaderMountWritable",
        "InferenceCacheKVStreamNotExact",
        "InferenceCacheNoKVEventsObserved",
        "InferenceCacheT2ZeroHitRate",
        "LMCacheT2NoHits",
        "InferenceCacheWebhookCertExpiring",
        "InferenceCacheWebhookServingCertExpiring",
        "InferenceCacheNodesWithoutAgent",
        "InferenceCacheAgentMissing",
    }


def test_every_alert_is_annotated_with_a_runbook_that_exists() -> None:
    anchors = github_anchors(TROUBLESHOOTING.read_text())
    base = "https://github.com/inference-cache/inference-cache/blob/main/docs/troubleshooting.md#"
    for r in rules_of(ON):
        a = r["annotations"]
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert a["summary"] and "\n" not in a["summary"], r["alert"]
        assert "Next: " in a["description"], r["alert"]
        assert re.search(r"Next: (kubectl|curl|dmesg) ", a["description"]), r["alert"]
        assert a["runbook_url"].startswith(base), r["alert"]
        anchor = a["runbook_url"][len(base):]
        assert anchor in anchors, f"{r['alert']}: docs/troubleshooting.md has no #{anchor}"


def metrics_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label matchers, ranges and label lists removed)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in PROMQL_FUNCS}


def test_metrics_in_reads_names_only() -> None:
    assert metrics_in('sum by (node) (rate(a_total{x="y"}[5m])) > 0 unless on(i) b == 1') == {"a_total", "b"}


def test_only_metrics_that_exist() -> None:
    known = metric_names()
    for r in rules_of(ON):
        for n in metrics_in(r["expr"]):
            if n.startswith("inferencecache_"):
                assert n in known, f"{r['alert']}: {n} is not registered by ic-controller or ic-agent"
            else:
                assert n in OUTSIDE, f"{r['alert']}: {n} is neither ours nor a named outside metric"


def test_matchers_follow_the_release() -> None:
    rules = rules_of({**ON, "fullnameOverride": "cache"}, name="other", namespace="ml")
    text = yaml.safe_dump(rules)
    assert RELEASE + "-" not in text and f'namespace="{NAMESPACE}"' not in text
    by = {r["alert"]: r for r in rules}
    assert 'up{job="cache-controller-metrics", namespace="ml"}' in by["InferenceCacheControllerDown"]["expr"]
    assert '{job="ml/cache-agent", namespace="ml"}' in by["InferenceCacheAgentUnlinked"]["expr"]
    assert 'daemonset="cache-agent", namespace="ml"' in by["InferenceCacheAgentMissing"]["expr"]
    assert 'name="cache-webhook", namespace="ml"' in by["InferenceCacheWebhookCertExpiring"]["expr"]
    assert "app.kubernetes.io/instance=other," in by["InferenceCacheControllerDown"]["annotations"]["description"]


def test_selectors_labels_and_optional_alerts() -> None:
    rules = rules_of(
        {
            "monitoring": {
                "prometheusRule": {
                    "enabled": True,
                    "controllerSelector": 'job="ic-controller"',
                    "agentSelector": 'job="ic-agent"',
                    "kubeStateMetrics": False,
                    "additionalAlertLabels": {"team": "ml", "severity": "ignored"},
                    "t2NoHitsWindow": "1h",
                }
            },
            "webhook": {"certMode": "selfSigned"},
        }
    )
    by = {r["alert"]: r for r in rules}
    assert "InferenceCacheAgentMissing" not in by and "InferenceCacheWebhookCertExpiring" not in by
    assert 'up{job="ic-controller"}' in by["InferenceCacheControllerDown"]["expr"]
    assert 'inferencecache_agent_link_connected{job="ic-agent"}' in by["InferenceCacheAgentUnlinked"]["expr"]
    assert 'inferencecache_agent_engine_t2_queries_total{job="ic-agent"}[1h]' in by["LMCacheT2NoHits"]["expr"]
    assert by["LMCacheT2NoHits"]["expr"].endswith("> 3600")
    assert all(r["labels"]["team"] == "ml" for r in rules)
    assert {r["labels"]["severity"] for r in rules} <= {"critical", "warning"}


def test_t2_window_is_one_setting_in_both_forms() -> None:
    """`t2NoHitsWindow` feeds LMCacheT2NoHits twice: as the range of the query increase and, in
    seconds, as the bound on the time since the last hit; the schema takes only d/h/m/s forms."""
    for window, seconds in [("30m", 1800), ("1h30m", 5400), ("2d", 172800), ("45s", 45)]:
        (rule,) = [
            r for r in rules_of({"monitoring": {"prometheusRule": {"enabled": True, "t2NoHitsWindow": window}}})
            if r["alert"] == "LMCacheT2NoHits"
        ]
        assert f"[{window}]" in rule["expr"] and rule["expr"].endswith(f"> {seconds}"), rule["expr"]
    chart = load_chart()
    for bad in ["30", "1.5h", "30min", ""]:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"monitoring": {"prometheusRule": {"t2NoHitsWindow": bad}}})
